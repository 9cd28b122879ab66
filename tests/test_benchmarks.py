"""benchmarks/: the benchmarks' code paths end to end on a tiny model (server_overhead's on the demo model) on
the CPU (structure of the JSON, not speed: tests never assert timings), redrawing a plot from the JSON, the
shared workload files, the harness's alternation, ratios, percentiles and target lines, the synthetic GPT-2
vocabulary of the gpt2-124m-random model, and the front door's table and options."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import (
    async_scheduling_profile,
    attention,
    chunked_prefill,
    continuous,
    cuda_graphs,
    gpu,
    kvcache,
    ladder,
    quantized_kv,
    server_overhead,
    static_batch,
    tensor_parallel,
)
from benchmarks.lib import harness, load, workloads
from benchmarks.lib.models import GPT2_VOCAB_SIZE, write_random_snapshot, write_synthetic_vocab
from common.tokenizer import Tokenizer, byte_to_unicode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random GPT-2 with a 1000-token synthetic vocabulary and a 64-token context window."""
    folder = tmp_path_factory.mktemp("bench-tiny")
    return str(
        write_random_snapshot(folder, seed=0, vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    )


def test_kvcache_benchmark_writes_json_and_plot(tiny_model, tmp_path):
    limits = {tiny_model: {"max_tokens": 4, "runs": 1}}  # step1 only at 4 tokens, in the first run only
    result = kvcache.run(
        [tiny_model], runs=2, gen_lengths=[4, 8], ttft_prompts=[8], step1_limits=limits, out_dir=tmp_path
    )

    written = json.loads((tmp_path / "kvcache-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))  # what was returned is what was written
    assert (tmp_path / "kvcache-cpu.png").stat().st_size > 0
    assert {
        "cpu",
        "cpu_cores",
        "torch_threads",
        "platform",
        "python",
        "torch",
        "transformers",
        "dtype",
        "date",
    } <= set(written["machine"])
    assert written["workload"]["runs"] == 2
    model = written["models"][harness.portable(tiny_model)]
    assert model["step1"] == {"max_tokens": 4, "runs": 1, "capped": True}

    # a. generation: one point per length; step1 left out beyond its cap; every run's figures kept
    assert [g["generated_tokens"] for g in model["generation"]] == [4, 8]
    short, long = model["generation"]
    assert set(short["runs"]) == {"step1", "step2", "hf"} and set(long["runs"]) == {"step2", "hf"}
    assert len(short["runs"]["step1"]) == 1 and len(short["runs"]["step2"]) == 2
    for point in model["generation"]:
        for engine, runs in point["runs"].items():
            for r in runs:
                assert r["generated_tokens"] == point["generated_tokens"]
                assert r["wall_s"] > 0 and r["ms_per_token"] > 0
            assert point["median"][engine]["ms_per_token"] > 0
        assert point["median"]["step2"]["decode_latency_median_s"] > 0
        assert len(point["ratios"]["hf/step2"]["per_run"]) == 2 and point["ratios"]["hf/step2"]["median"] > 0
    assert len(short["ratios"]["step1/step2"]["per_run"]) == 1  # paired with step2's first run only

    # b. TTFT: the prompt lengths that fit, plus the context window minus 16
    assert [t["prompt_tokens"] for t in model["ttft"]] == [8, 48]
    for t in model["ttft"]:
        assert t["median"]["step2"]["ttft_s"] > 0 and t["median"]["hf"]["wall_s"] > 0

    # c. KV cache bytes: 2 x layers x heads x head_dim x bytes, and KVCache allocates exactly that
    fp32 = model["kv_cache_bytes"]["float32"]
    assert fp32["formula_bytes_per_token"] == 2 * 2 * 4 * 8 * 4 == fp32["measured_bytes_per_token"]
    assert fp32["context_window_bytes"] == 64 * fp32["formula_bytes_per_token"]
    assert (
        model["kv_cache_bytes"]["float16"]["formula_bytes_per_token"] == fp32["formula_bytes_per_token"] // 2
    )

    report = kvcache.report(written)
    assert "targets" in report and "step1 capped" in report


def test_alternate_rotates_the_order_and_skips_runs_beyond_runs_of():
    calls = []
    engines = {name: (lambda name=name: calls.append(name) or {"x": len(calls)}) for name in "abc"}
    results = harness.alternate(engines, runs=3, warmup=1, runs_of={"c": 1})
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "a", "a", "b"]  # warm-up, then abc, bc(a), (c)ab
    assert [len(results[n]) for n in "abc"] == [3, 3, 1]
    assert harness.ratio([{"t": 2.0}, {"t": 6.0}], [{"t": 1.0}, {"t": 2.0}, {"t": 5.0}], "t") == {
        "per_run": [2.0, 3.0],
        "median": 2.5,
    }


def test_synthetic_gpt2_vocab_loads_and_round_trips(tmp_path):
    write_synthetic_vocab(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.vocab_size == GPT2_VOCAB_SIZE == 50257
    assert tokenizer.eos_token_id == 50256 and tokenizer.encode("<|endoftext|>") == [50256]

    vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    char_to_byte = {ch: b for b, ch in byte_to_unicode().items()}
    assert [vocab[ch] for ch in byte_to_unicode().values()] == list(range(256))  # GPT-2's byte order
    # every id decodes to the bytes its vocab.json entry stands for
    for token, i in vocab.items():
        if i != tokenizer.eos_token_id:
            assert tokenizer.decode_bytes([i]) == bytes(char_to_byte[ch] for ch in token)
    # ids -> text -> ids: a two-letter token is one pre-tokenizer piece, and its one merge gives it back
    letters = {ch for ch in byte_to_unicode().values() if ch.isascii() and ch.isalpha()}
    two_letter = [i for token, i in vocab.items() if len(token) == 2 and set(token) <= letters]
    assert len(two_letter) > 1000
    for i in two_letter:
        assert tokenizer.encode(tokenizer.decode([i])) == [i]
    text = "The benchmark's vocabulary: meaningless, but GPT-2's size.\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


# (prompt tokens, max_tokens) of a small workload with spread lengths that fits the tiny model's 64 positions
SPREAD = [(5, 3), (12, 9), (3, 12), (20, 4), (8, 8), (15, 6), (9, 2), (4, 10)]


def small_workload(name: str, arrivals: list[float] | None = None) -> dict:
    arrivals = arrivals or [0.0] * len(SPREAD)
    requests = [
        {"index": i, "prompt_tokens": p, "max_tokens": n, "arrival_s": a}
        for i, ((p, n), a) in enumerate(zip(SPREAD, arrivals))
    ]
    return {"name": name, "token_id_seed": 7, "requests": requests}


def static_positions(requests: list[tuple[int, int]], batch_size: int) -> int:
    """Token positions a static batch computes: every row the longest prompt + the largest max_tokens."""
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    return sum(len(b) * (max(p for p, _ in b) + max(n for _, n in b)) for b in batches)


def test_workload_files_load_and_are_deterministic():
    for name in workloads.NAMES:
        assert workloads.load(name) == workloads.make(
            name
        )  # the committed file is what its seeded recipe makes
    mixed, staggered = workloads.load("mixed"), workloads.load("staggered")
    assert len(mixed["requests"]) == 64 and all(r["arrival_s"] == 0 for r in mixed["requests"])
    for r in mixed["requests"]:
        assert 8 <= r["prompt_tokens"] <= 256 and 8 <= r["max_tokens"] <= 128
        assert r["prompt_tokens"] + r["max_tokens"] <= 512  # fits the demo model's context window
    assert len({r["max_tokens"] for r in mixed["requests"]}) > 30  # widely spread lengths
    # staggered: the first mixed requests, arriving in order from time 0
    arrivals = [r["arrival_s"] for r in staggered["requests"]]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 5
    n = len(staggered["requests"])
    assert [(r["prompt_tokens"], r["max_tokens"]) for r in staggered["requests"]] == [
        (r["prompt_tokens"], r["max_tokens"]) for r in mixed["requests"][:n]
    ]

    # token ids: regenerated from the seed for any vocabulary, the same every time, never end-of-text
    first, again = workloads.requests(mixed, 1000), workloads.requests(mixed, 1000)
    assert first == again
    assert [r.prompt_tokens for r in first] == [r["prompt_tokens"] for r in mixed["requests"]]
    assert all(0 <= t < 999 for r in first for t in r.prompt_token_ids)
    small = workloads.take(mixed, 3, max_prompt_tokens=10, max_tokens=5)
    assert small["derived"] == {"from": "mixed", "first_n": 3, "max_prompt_tokens": 10, "max_tokens": 5}
    short = workloads.requests(small, 1000)
    assert [r.prompt_token_ids for r in short] == [r.prompt_token_ids[:10] for r in first[:3]]  # prefixes
    with pytest.raises(ValueError, match="context window"):
        workloads.requests(mixed, 1000, context_window=128)


def test_static_batch_benchmark_writes_json_and_plot(tiny_model, tmp_path):
    result = static_batch.run(
        [tiny_model],
        runs=2,
        batch_sizes=[1, 4],
        equal_prompt_tokens=8,
        equal_max_tokens=6,
        step2_max_requests=2,
        mixed=small_workload("test-mixed"),
        mixed_batch_size=4,
        out_dir=tmp_path,
    )

    written = json.loads((tmp_path / "static_batch-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "static_batch-cpu.png").stat().st_size > 0
    assert {"cpu", "torch_threads", "torch", "transformers", "dtype", "date"} <= set(written["machine"])
    assert written["workload"]["mixed"]["workload"]["requests"][1] == {
        "index": 1,
        "prompt_tokens": 12,
        "max_tokens": 9,
        "arrival_s": 0.0,
    }  # exactly what ran
    model = written["models"][harness.portable(tiny_model)]

    # a. equal-length requests: one point per batch size, every engine, every run; step2 serves at most 2
    assert [p["batch_size"] for p in model["equal_length"]] == [1, 4]
    for point in model["equal_length"]:
        b = point["batch_size"]
        assert point["requests"] == {"step2": min(b, 2), "step3": b, "hf": b}
        for engine, runs in point["runs"].items():
            assert len(runs) == 2
            for r in runs:
                assert r["generated_tokens"] == 6 * point["requests"][engine] and r["throughput_tok_s"] > 0
                assert r["computed_over_requested"] == 1  # equal lengths: no padding, no finished rows
        for label in ("step3/step2", "step3/hf", "hf/step2"):
            assert len(point["ratios"][label]["per_run"]) == 2 and point["ratios"][label]["median"] > 0

    # b. mixed lengths in batches of 4: static batching computes every row to the batch's longest
    mixed = model["mixed"]
    requested = sum(p + n for p, n in SPREAD)
    for engine in ("step2", "step3", "hf"):
        for r in mixed["runs"][engine]:
            assert r["requests_served"] == len(SPREAD) and r["generated_tokens"] == sum(n for _, n in SPREAD)
            assert r["requested_tokens"] == requested
            assert r["latency_mean_s"] > 0 and r["latency_p95_s"] >= r["latency_p50_s"] > 0
            assert len(r["requests"]) == len(SPREAD)  # every request's record is kept
    assert mixed["median"]["step2"]["computed_tokens"] == requested
    assert mixed["median"]["step3"]["computed_tokens"] == static_positions(SPREAD, 4) > requested
    assert mixed["median"]["hf"]["computed_tokens"] == static_positions(SPREAD, 4)
    assert [b["requests"] for b in mixed["runs"]["step3"][0]["batches"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # step 3's engine counts padding and finished rows per batch, not per request
    for r in mixed["runs"]["step3"]:
        assert all(rec["padding_tokens"] is None and rec["wasted_tokens"] is None for rec in r["requests"])
        for batch, spread in zip(r["batches"], (SPREAD[:4], SPREAD[4:])):
            longest, largest = max(p for p, _ in spread), max(n for _, n in spread)
            assert batch["padding_tokens"] == sum(longest - p for p, _ in spread)
            assert batch["wasted_tokens"] == sum(largest - n for _, n in spread)
    assert set(mixed["ratios"]) >= {"step3/step2", "step3/hf", "step2/step3 latency", "hf/step3 latency"}

    report = static_batch.report(written)
    # the targets are set at B = 8 and on the whole mixed workload: neither met nor MISSED at this size
    assert "targets" in report and report.count(": not measured at full size") == 2 and "MISSED" not in report


def test_continuous_benchmark_writes_json_and_plot(tiny_model, tmp_path):
    arrivals = [0.0, 0.0, 0.01, 0.012, 0.02, 0.05, 0.06, 0.08]  # seconds: short, so the test stays fast
    result = continuous.run(
        [tiny_model],
        runs=2,
        mixed=small_workload("test-mixed"),
        staggered=small_workload("test-staggered", arrivals),
        max_batch=4,
        concurrency=[2, 4],
        concurrency_requests=6,
        out_dir=tmp_path,
    )

    written = json.loads((tmp_path / "continuous-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "continuous-cpu.png").stat().st_size > 0
    model = written["models"][harness.portable(tiny_model)]

    # a. mixed and staggered: both engines, both runs; step 4 computes exactly what was asked for
    for name in ("mixed", "staggered"):
        point = model[name]
        assert point["max_batch"] == 4
        for engine in ("step3", "step4"):
            assert len(point["runs"][engine]) == 2
            for r in point["runs"][engine]:
                assert r["requests_served"] == len(SPREAD) and r["throughput_tok_s"] > 0
                assert r["ttft_p95_s"] >= r["ttft_p50_s"] > 0 and r["latency_mean_s"] > 0
                for rec in r["requests"]:  # nobody starts before arriving, and latency counts from arrival
                    assert (
                        rec["arrival_s"] == arrivals[rec["index"]]
                        if name == "staggered"
                        else rec["arrival_s"] == 0
                    )
                    assert rec["arrival_s"] <= rec["started_s"] < rec["first_token_s"] <= rec["finished_s"]
        assert point["median"]["step4"]["computed_over_requested"] == 1
        assert point["median"]["step4"]["num_preemptions"] == 0
        assert point["median"]["step3"]["computed_over_requested"] > 1
        for label in ("step4/step3", "step3/step4 latency", "step3/step4 p95 latency", "step3/step4 ttft"):
            assert len(point["ratios"][label]["per_run"]) == 2 and point["ratios"][label]["median"] > 0
    assert model["mixed"]["median"]["step3"]["computed_tokens"] == static_positions(SPREAD, 4)
    assert model["mixed"]["median"]["step4"]["max_running"] == 4

    # b. KV memory: step 3 reserves its largest batch; step 4 wastes less than a block per sequence
    kv = model["kv_memory"]
    bytes_per_token = 2 * 2 * 32 * 4  # K and V x 2 layers x 32 wide x fp32
    assert kv["bytes_per_token"] == bytes_per_token and kv["bytes_per_block"] == 16 * bytes_per_token
    capacities = [max(p for p, _ in b) + max(n for _, n in b) for b in (SPREAD[:4], SPREAD[4:])]
    assert kv["step3"]["peak_bytes"] == 4 * max(capacities) * bytes_per_token
    assert [b["capacity"] for b in kv["step3"]["batches"]] == capacities
    assert 0 < kv["step4"]["peak_tokens_stored"] <= kv["step4"]["peak_blocks"] * 16
    assert kv["step4"]["peak_bytes"] == kv["step4"]["peak_blocks"] * kv["bytes_per_block"]
    assert 0 <= kv["step4"]["waste_mean_blocks"] <= kv["step4"]["waste_max_blocks"] < 1
    assert kv["step3"]["waste_max_blocks"] > kv["step4"]["waste_max_blocks"]
    budget = kv["budget"]
    assert budget["bytes"] == kv["step3"]["peak_bytes"] and budget["step3_max_sequences"] == 4
    assert budget["step4_max_running"] >= 1 and budget["step4_run"]["requests_served"] == len(SPREAD)

    # c./d. the concurrency sweep on the first 6 requests; HF sequential at the last point only
    assert [p["max_batch"] for p in model["concurrency"]] == [2, 4]
    first, last = model["concurrency"]
    assert set(first["runs"]) == {"step3", "step4"} and set(last["runs"]) == {"step3", "step4", "hf"}
    assert all(r["requests_served"] == 6 for runs in last["runs"].values() for r in runs)
    assert last["median"]["hf"]["computed_over_requested"] == 1  # one request at a time: no padding
    assert len(last["ratios"]["step4/hf"]["per_run"]) == 2 and last["ratios"]["step4/hf"]["median"] > 0

    report = continuous.report(written)
    assert "targets" in report and "blocks" in report


def test_ladder_runs_every_step_from_5_against_the_one_before(tiny_model, tmp_path, monkeypatch):
    """The ladder on the CPU: every step package from step 5 on (found by name: a later step joins by
    existing), alternated over the runs, each step's ratio to the step before, a profile per step; the JSON
    names the commit given in BENCHMARK_COMMIT (the GPU machine's copy of .git is stale) and holds no
    absolute path of this machine."""
    monkeypatch.setenv(harness.COMMIT_VARIABLE, "0123456789abcdef")
    ladder.run([tiny_model], "cpu", runs=2, points={"batch 2": (2, 4, 3, 2)}, quick=True, out_dir=tmp_path)
    text = (tmp_path / "quick" / "ladder-cpu.json").read_text()
    written = json.loads(text)
    assert written["machine"]["git_commit"] == "0123456789abcdef"
    assert str(harness.ROOT) not in text and str(tmp_path) not in text and '"/' not in text
    (model,) = written["models"].values()
    point = model["points"]["batch 2"]
    steps = sorted(
        (p.name for p in harness.ROOT.glob("step[0-9]*_*") if int(p.name[4:].split("_")[0]) >= 5),
        key=lambda name: int(name[4:].split("_")[0]),
    )
    names = [f"step{name[4:].split('_')[0]}" for name in steps]
    assert list(point["median"]) == names  # no HF static cache on a CPU
    for name in names:
        assert [r["generated_tokens"] for r in point["runs"][name]] == [2 * 2 * 3] * 2  # 2 calls of 2 x 3
    assert set(point["ratios"]) == {f"{b}/{a}" for a, b in zip(names, names[1:])}
    for label, ratio in point["ratios"].items():
        a, b = label.split("/")
        expected = [
            x["throughput_tok_s"] / y["throughput_tok_s"] for x, y in zip(point["runs"][a], point["runs"][b])
        ]
        assert ratio["per_run"] == pytest.approx(expected)
    for name in names:
        top = model["profiles"][name]["top_tottime"]
        assert top and all(row["us_per_step"] >= 0 for row in top)
    assert "step12/step11, the lowest of the points" in ladder.report(written)


def test_portable_paths_name_what_ran_not_where():
    """A benchmark record's strings lose this machine's absolute paths: the repository's become relative,
    a library file keeps its path inside site-packages or the standard library, any other its last two
    parts; ratios and units with a slash stay as they are."""
    root = str(harness.ROOT)
    assert harness.portable(
        {
            f"{root}/demo/checkpoint": [f"{root}/.venv/lib/python3.11/site-packages/torch/nn/module.py:1(f)"],
            "stdlib": "/usr/lib/python3.12/asyncio/events.py:88(_run)",
            "other": "model in /tmp/pytest-of-x/pytest-1/bench-tiny0",
            "kept": "step9/step8 tok/s, 32 + 128 / 512",
        }
    ) == {
        "demo/checkpoint": ["torch/nn/module.py:1(f)"],
        "stdlib": "asyncio/events.py:88(_run)",
        "other": "model in .../pytest-1/bench-tiny0",
        "kept": "step9/step8 tok/s, 32 + 128 / 512",
    }


def test_percentile_and_target_lines():
    assert harness.percentile([], 95) is None
    assert harness.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert harness.percentile([0.0, 10.0], 95) == pytest.approx(9.5)  # linear between the two ranks
    assert harness.target_line("a", 2.0, ">= 1.5").startswith("met")
    assert harness.target_line("a", 1.0, "< 1", " blocks") == "MISSED  a: 1.00 blocks (target < 1 blocks)"
    assert harness.target_line("a", None, ">= 3").startswith("MISSED")
    # a target whose workload point did not run (--quick) is neither met nor missed
    line = harness.target_line("a at 64 tokens", 1.0, ">= 4", full_size=False)
    assert line == "-       a at 64 tokens: 1.00x (target >= 4x): not measured at full size"


def test_gpu_benchmark_writes_json_plot_and_profile(tiny_model, tmp_path):
    lengths = {"short": {"prompt_tokens": 4, "max_tokens": 4}, "long": {"prompt_tokens": 12, "max_tokens": 6}}
    profile = {**gpu.PROFILE, "dtype": "float32", "batch_size": 2, "steps": 3, "top": 5}
    result = gpu.run(
        [tiny_model],
        device="cpu",
        runs=2,
        batch_sizes=[1, 2],
        lengths=lengths,
        matrix={"float32": {"short": gpu.ENGINE_NAMES, "long": ("step3", "step4")}},
        profile=profile,
        dtype_study=gpu.QUICK["dtype_study"],
        out_dir=tmp_path,
    )

    written = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "gpu-cpu.png").stat().st_size > 0
    assert written["machine"]["copy_bandwidth_bytes_per_s"] > 0
    assert written["workload"]["workloads"]["long"]["prompt_tokens"] == 12  # exactly what ran
    model = written["models"][harness.portable(tiny_model)]
    step5 = importlib.util.find_spec("step5_flash_gpu") is not None
    step7 = importlib.util.find_spec("step7_cuda_graphs") is not None
    step8 = importlib.util.find_spec("step8_async_scheduling") is not None
    assert ("step5" in model["skipped"]) is not step5  # skipped, and said so, while the package is missing

    # one point per batch size and workload; step 2 at B = 1 only; every run generates exactly what it asks
    assert [(p["batch_size"], p["workload"]) for p in model["points"]] == [
        (1, "short"),
        (1, "long"),
        (2, "short"),
        (2, "long"),
    ]
    for point in model["points"]:
        b, n = point["batch_size"], lengths[point["workload"]]["max_tokens"]
        if point["workload"] == "short":  # every engine there; on long, only those the matrix names
            engines = (
                {"hf", "hf_static", "step3", "step4"}
                | ({"step2"} if b == 1 else set())
                | ({"step5"} if step5 else set())
                | ({"step7"} if step7 else set())
                | ({"step8"} if step8 else set())
            )
            assert set(point["ratios"]) >= {f"{e}/hf" for e in engines - {"hf"}}
        else:
            engines = {"step3", "step4"}
            assert point["ratios"] == {}
        assert set(point["runs"]) == engines
        for engine, runs in point["runs"].items():
            assert len(runs) == 2
            for r in runs:
                assert r["requests"] == b and r["generated_tokens"] == b * n
                assert r["throughput_tok_s"] == pytest.approx(b * n / r["wall_s"])
                assert r["ms_per_token"] == pytest.approx(1e3 * r["wall_s"] / n)
            assert point["median"][engine]["share_of_memory_floor"] > 0
        floor = point["memory_floor"]
        assert floor["weight_bytes"] == 4 * model["parameters"] and floor["throughput_tok_s"] > 0

    # the profiles: the top functions of steps 4, 5, 7 and 8's engines, by own and by cumulative time
    assert set(model["profiles"]) == {"step4"} | ({"step5"} if step5 else set()) | (
        {"step7"} if step7 else set()
    ) | ({"step8"} if step8 else set())
    for engine, prof in model["profiles"].items():
        assert prof["requests"] == 2 and prof["steps"] == 3 and len(prof["top_tottime"]) == 5
        own = [r["tottime_s"] for r in prof["top_tottime"]]
        assert own == sorted(own, reverse=True)
        package = gpu.STEP_PACKAGES[engine]
        assert any(f"{package}/engine.py" in r["function"] for r in prof["top_cumtime"])

    # the dtype study: every prompt identical to the fp32 run or diverged at a position it generated
    study = written["dtype_study"]["dtypes"]["bfloat16"]
    spec = gpu.QUICK["dtype_study"]
    assert study["prompts"] == spec["prompts"] == study["identical"] + study["diverged"]
    assert len(study["first_divergence"]) == study["diverged"] >= study["tier_holds"] >= 0
    assert all(0 <= i < spec["max_tokens"] for i in study["first_divergence"])

    report = gpu.report(written)
    assert "memory floor" in report and "profile: step4" in report and "dtype study" in report

    # --replot: the PNG again from the JSON, nothing measured
    (tmp_path / "gpu-cpu.png").unlink()
    harness.replot("gpu", "cpu", gpu.plot, gpu.report, out_dir=tmp_path)
    assert (tmp_path / "gpu-cpu.png").stat().st_size > 0


def test_attention_benchmark_quick_path_matches_the_reference(tiny_model, tmp_path):
    """--quick's path through Triton's interpreter on the tiny model's shape (4 heads x 8): every
    implementation's output equals the fp32 reference, write_kv's pool equals step 4's, and the memory
    model's prediction holds on step 5's engine (run here on the CPU, which reads no memory)."""
    block_bytes = 2 * 2 * 16 * 4 * 8 * 4  # K and V x 2 layers x 16 tokens x 4 heads x 8 x fp32
    sizes = {
        **attention.QUICK,
        "decode_seqs": [1, 2],
        "decode_ctx": [40],
        "kv_budgets": [16 * block_bytes],
        "kv_lengths": [32, 48],
        "kv_generated": 8,
    }
    result = attention.run(
        [tiny_model], "cpu", runs=1, sizes=sizes, quick=True, out_dir=tmp_path, measure_memory=True
    )

    written = json.loads((tmp_path / "quick" / "attention-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "quick" / "attention-cpu.png").stat().st_size > 0
    assert written["machine"]["triton_interpreter"] and written["machine"]["copy_bandwidth_bytes_per_s"] > 0
    model = written["models"][harness.portable(tiny_model)]
    assert model["config"]["n_head"] == 4 and model["config"]["head_dim"] == 8

    # a. prefill: T x (1 sequence, a batch of 2); every implementation equals the reference
    assert [(p["T"], p["num_seqs"]) for p in model["prefill"]] == [(16, 1), (16, 2), (40, 1), (40, 2)]
    for p in model["prefill"]:
        assert set(p["max_abs_diff"]) == {"materialised", "sdpa", "triton_paged"} and p["errors"] == {}
        assert all(d < 1e-4 for d in p["max_abs_diff"].values()), p["max_abs_diff"]
        for m in p["median"].values():
            assert m["ms"] > 0 and m["tflops"] > 0 and m["peak_bytes"] is None  # no peak memory on a CPU
        assert p["ratios"]["materialised/triton"]["median"] > 0 and p["ratios"]["triton/sdpa"]["median"] > 0

    # b. decode: step 4's gather + SDPA and the four Triton ways agree with the reference
    assert [(p["num_seqs"], p["context"]) for p in model["decode"]] == [(1, 40), (2, 40)]
    for p in model["decode"]:
        assert set(p["max_abs_diff"]) == {"step4_gather_sdpa", *attention.DECODE_SPLITS}
        assert all(d < 1e-4 for d in p["max_abs_diff"].values()), p["max_abs_diff"]
        assert p["kv_bytes"] == 2 * p["num_seqs"] * 40 * 4 * 8 * 4
        for m in p["median"].values():
            assert m["kv_bytes_per_s"] > 0 and m["share_of_copy_bandwidth"] > 0
        assert p["ratios"]["step4/triton_auto"]["median"] > 0

    # c. write_kv: the kernel leaves the pool exactly as step 4's indexing does
    assert [p["tokens"] for p in model["write_kv"]] == attention.QUICK["write_tokens"]
    assert all(p["pools_equal"] for p in model["write_kv"])

    # d. the memory model: the predicted number of sequences runs at once, one more does not
    mem = model["memory"]
    assert mem["bytes_per_block"] == block_bytes and mem["weight_bytes"] == 4 * mem["parameters"]
    assert [(p["sequence_tokens"], p["blocks"], p["sequences"]) for p in mem["points"]] == [
        (32, 16, 8),
        (48, 16, 5),
    ]
    for p in mem["points"]:
        assert p["predicted_bytes"] == mem["weight_bytes"] + 16 * block_bytes
        engine, more = p["engine"], p["engine_one_more"]
        assert engine["max_running"] == p["sequences"] and engine["num_preemptions"] == 0
        assert (
            engine["kv_pool_bytes"] == p["kv_pool_bytes"] and engine["generated_tokens"] == 8 * p["sequences"]
        )
        assert more["max_running"] < p["sequences"] + 1 or more["num_preemptions"] > 0
        assert engine["peak_bytes"] is None  # read on CUDA only

    report = attention.report(written)
    assert report.count("not measured at full size") == 5 and "MISSED" not in report
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        attention.main(device="cpu")


def test_server_benchmark_quick_path_http_matches_in_process(tmp_path):
    """--quick end to end on the demo model (trained: greedy ids have no near-ties): python -m step6_server
    in a subprocess against the engine in process, the same requests, the same texts."""
    result = server_overhead.main(models=["demo"], device="cpu", quick=True, out_dir=tmp_path)

    written = json.loads((tmp_path / "quick" / "server_overhead-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "quick" / "server_overhead-cpu.png").stat().st_size > 0
    assert (
        len(written["machine"]["load_average_start"]) == 3
        and len(written["machine"]["load_average_end"]) == 3
    )
    w = written["workload"]
    model = written["models"]["demo"]
    conc = w["concurrency"]["workload"]["requests"]
    assert len(conc) == server_overhead.QUICK["requests"] and all(
        r["max_tokens"] <= server_overhead.QUICK["max_tokens"] for r in conc
    )

    c = model["concurrency"]
    assert c["streams"] == server_overhead.STREAMS
    for engine in ("in_process", "http"):
        (run,) = c["runs"][engine]
        assert run["requests_served"] == len(conc) and run["generated_tokens"] == sum(
            r["max_tokens"] for r in conc
        )
        assert run["steps"] > 0 and run["throughput_tok_s"] > 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p95_s"] <= run["ttft_p99_s"]
        assert 0 < run["itl_p50_s"] <= run["itl_p99_s"]
        for rec in run["requests"]:
            assert rec["arrival_s"] <= rec["first_token_s"] <= rec["finished_s"]
    assert c["http_text_equals_in_process"] == {"per_run": [len(conc)], "requests": len(conc)}
    assert c["ratios"]["http/in_process throughput"]["median"] > 0
    assert c["ratios"]["outside engine share"]["median"] < 1
    assert model["capacity_requests_per_s"] == c["median"]["in_process"]["requests_per_s"]

    (p,) = model["arrivals"]
    n = len(w["arrivals"]["workload"]["requests"])
    assert p["load"] == 0.5 and p["rate_per_s"] == pytest.approx(0.5 * model["capacity_requests_per_s"])
    assert (
        p["arrival_s"]
        == load.poisson(n, p["rate_per_s"], server_overhead.ARRIVAL_SEED)
        == sorted(p["arrival_s"])
    )
    assert p["http_text_equals_in_process"]["per_run"] == [n]
    for engine in ("in_process", "http"):
        records = p["runs"][engine][0]["requests"]
        assert [r["arrival_s"] for r in records] == p[
            "arrival_s"
        ]  # latency counts from each request's arrival
        assert all(r["arrival_s"] <= r["first_token_s"] for r in records)

    report = server_overhead.report(written)
    assert "not measured at full size" in report and "MISSED" not in report and "load average" in report


def test_cuda_graphs_benchmark_breaks_a_step_down(tiny_model, tmp_path):
    """On a CPU: the kernel (operator) count and the step breakdown, eager only, no ladder; the phases of
    a step add up to the step."""
    spec = {**cuda_graphs.QUICK, "workload": {"prompt_tokens": 4, "max_tokens": 6}, "steps": 3}
    result = cuda_graphs.run([tiny_model], "cpu", 1, spec, quick=True, out_dir=tmp_path)
    written = json.loads((tmp_path / "quick" / "cuda_graphs-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    model = written["models"][harness.portable(tiny_model)]
    assert model["ladder"] is None and [k["batch_size"] for k in model["kernels"]] == [1, 4]
    assert all(k["kernels"] > 0 for k in model["kernels"])
    for point in model["breakdown"]:
        host = point["host_s"]
        assert not point["graphs"] and point["steps"] == 3
        assert sum(host[k] for k in cuda_graphs.PHASES) == pytest.approx(host["step"])
        assert point["decode_tok_s"] == pytest.approx(point["batch_size"] / host["step"])
    assert "per decode step" in cuda_graphs.report(written)


def test_quantized_kv_benchmark_measures_accuracy_and_the_speed_points(demo_snapshot, tmp_path):
    """On a CPU, --quick sizes: the held-out accuracy figures (auto agrees with itself exactly), the
    kernel, end-to-end and pool points for auto, int8 and fp8, the JSON as written, the report."""
    result = quantized_kv.run(["demo"], "cpu", 1, quantized_kv.SIZES["quick"], quick=True, out_dir=tmp_path)
    written = json.loads((tmp_path / "quick" / "quantized_kv-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    modes = written["models"]["demo"]["modes"]
    assert modes["auto"]["top1_agreement"] == 1 and modes["auto"]["perplexity_change"] == 0
    assert all(modes[m]["finite"] and 0.9 < modes[m]["top1_agreement"] for m in quantized_kv.MODES)
    pool = written["speed"]["pool"]
    assert pool["int8"]["num_kv_blocks"] > 3 * pool["auto"]["num_kv_blocks"]  # fp32 model: 256 vs 66 bytes
    assert set(written["speed"]["kernel"]["1x64"]["median"]) == set(quantized_kv.MODES)
    assert "top-1 = auto" in quantized_kv.report(written)


def test_chunked_prefill_benchmark_runs_each_part_on_every_engine(demo_snapshot, tmp_path):
    """On a CPU, --quick sizes: (a) the burst on step 12, step 13 off and step 13 at each budget, with the
    running streams' gaps and the burst's figures; (b) every Poisson rate and the steady batch (rate 0) on
    step 12 and step 13; (c) the generate ratio from per-run figures; the JSON as written, the report."""
    sizes = chunked_prefill.SIZES["quick"]
    result = chunked_prefill.run(["demo"], "cpu", 1, sizes, quick=True, out_dir=tmp_path)
    written = json.loads((tmp_path / "quick" / "chunked_prefill-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "quick" / "chunked_prefill-cpu.png").stat().st_size > 0
    model = written["models"]["demo"]

    burst = model["burst"]["engines"]
    assert list(burst) == ["step12", "step13_off", *(f"step13_{b}" for b in sizes["burst"]["budgets"])]
    for name, engine in burst.items():
        expected = sizes["burst"]["off_budget"] if name in ("step12", "step13_off") else int(name[7:])
        assert engine["max_num_batched_tokens"] == expected and engine["num_preemptions"] == 0
        (run,) = engine["runs"]
        assert run["gaps"] > 0 and 0 < run["gap_p50_ms"] <= run["gap_p99_ms"] <= run["gap_max_ms"]
        assert run["burst_ttft_p50_ms"] <= run["burst_ttft_p99_ms"] <= run["prefilled_ms"] + 1e-6
        assert (run["eager_share"] is None) == (name == "step12")  # step 12 has no step counters
    assert burst["step12"]["prefilled_vs_step12"] == 1

    poisson = model["poisson"]
    assert list(poisson["points"]) == ["0", *map(str, sizes["poisson"]["rates"])]
    assert poisson["arrivals"]["0"] == 0 and poisson["budgets"]["step13"] == 512  # the CPU default
    for rate, point in poisson["points"].items():
        for name in ("step12", "step13"):
            (run,) = point["runs"][name]
            assert run["arrived"] <= poisson["arrivals"][rate] and run["itl_p50_ms"] > 0 < run["span_s"]
            assert point["vs_steady"][name]["itl_p99"] > 0
    assert poisson["points"]["0"]["vs_steady"]["step13"] == {"itl_p50": 1, "itl_p99": 1}

    (point,) = model["generate"].values()
    (a,), (b,) = point["runs"]["step13"], point["runs"]["step12"]
    assert point["ratio"]["per_run"] == pytest.approx([a["tok_per_s"] / b["tok_per_s"]])
    assert 0 < a["eager_share"] <= 1 and b["eager_share"] is None
    assert "fully prefilled vs step 12" in chunked_prefill.report(written)


def test_tensor_parallel_benchmark_counts_the_collectives_of_a_decode_step(tiny_model, tmp_path):
    """On a CPU, --quick sizes: step 14, step 15 at t = 1 and at t = 2 (a worker process, gloo) alternated
    at each batch size, every request its exact tokens; rank 0's profile of a decode step at t = 2 finds
    an all-reduce per row-parallel layer and one for the embedding (2 n_layer + 1), the logits' all-gather
    and the step's broadcast; the cost model's GPT-2 124M is GPT-2's parameter count."""
    sizes = tensor_parallel.SIZES["quick"]
    result = tensor_parallel.run([tiny_model], "cpu", 1, sizes, quick=True, out_dir=tmp_path)
    written = json.loads((tmp_path / "quick" / "tensor_parallel-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    assert (tmp_path / "quick" / "tensor_parallel-cpu.png").stat().st_size > 0
    model = written["models"][harness.portable(tiny_model)]
    assert model["tp_sizes"] == [1, 2] and list(model["rounds"]) == ["2"]
    (round_,) = model["rounds"].values()
    assert list(round_["points"]) == [str(b) for b in sizes["batches"]]
    for point in round_["points"].values():
        assert set(point["runs"]) == {"step14", "tp1", "tp2"}
        for (run,) in point["runs"].values():
            assert run["generated_tokens"] == point["batch"] * sizes["max_tokens"] and run["tok_per_s"] > 0
        (a,), (b,) = point["runs"]["tp2"], point["runs"]["tp1"]
        assert point["ratios"]["tp2/tp1"]["per_run"] == pytest.approx([a["tok_per_s"] / b["tok_per_s"]])
        assert point["ratios"]["tp1/step14"]["median"] > 0

    profile = round_["profile"]
    n_layer = model["n_layer"]
    assert n_layer == 2 and profile["batch"] == sizes["profile"][0]
    assert profile["expected_allreduce_per_step"] == 2 * n_layer + 1
    assert profile["allreduce_per_step"] == pytest.approx(2 * n_layer + 1)
    assert profile["allgather_per_step"] == pytest.approx(1) and profile["broadcast_per_step"] >= 1
    assert profile["event_names_per_step"]["gloo:all_reduce"] == pytest.approx(2 * n_layer + 1)
    assert profile["allreduce_ms_per_step"] > 0 and profile["step_ms"] > 0
    assert 0 < profile["allreduce_share"] < 1

    cost = written["cost_model"]["models"]
    assert cost["gpt2 (124M)"]["params"] == 124_439_808  # GPT2LMHeadModel's, the tied head counted once
    for m in cost.values():
        assert m["allreduce_per_step"] == 2 * m["n_layer"] + 1
        for x in m["tp"].values():
            assert x["pays"] == (x["saved_us"] > x["collective_us"]) and x["read_us"] < m["read_us_t1"]
    assert not cost["gpt2 (124M)"]["tp"]["2"]["pays"]
    assert "collectives per decode step" in tensor_parallel.report(written)


def test_async_scheduling_profile_finds_the_gaps_between_steps(tiny_model, tmp_path):
    """A synthetic trace: each GPU activity goes to the step whose host range holds its launch; the gap
    runs from a step's last activity to the next step's first. Then a run on a CPU: no GPU timeline."""

    def event(cat: str, ts: float, dur: float, correlation: int | None = None, name: str = "") -> dict:
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args={"correlation": correlation})

    events = [event("user_annotation", 100 * i, 100, name=f"decode_step_{i}") for i in range(3)]
    events += [event("cuda_runtime", ts, 1, c) for c, ts in ((1, 10), (2, 110), (3, 210))]
    events += [event("cuda_driver", 20, 1, 4)]  # a Triton kernel's launch
    events += [event("kernel", 50, 30, 1), event("kernel", 85, 10, 4), event("gpu_memcpy", 120, 5, 2)]
    events += [event("kernel", 125, 60, 2), event("kernel", 200, 50, 3), event("kernel", 0, 500, 99)]
    gaps = async_scheduling_profile.step_gaps({"traceEvents": events})
    assert [(s["first_us"], s["last_us"], s["busy_us"]) for s in gaps["gpu_steps"]] == [
        (50, 95, 40),
        (120, 185, 65),
        (200, 250, 50),
    ]
    assert [(s["gap_us"], s["period_us"]) for s in gaps["gpu_steps"][:2]] == [(25, 70), (15, 80)]
    assert gaps["idle_between_steps_share"] == pytest.approx((25 / 70 + 15 / 80) / 2)
    assert gaps["gpu_busy_share"] == pytest.approx(105 / 150) and gaps["host_ms_per_step_profiled"] == 0.1

    spec = {
        **async_scheduling_profile.QUICK,
        "batch_size": 2,
        "workload": {"prompt_tokens": 4, "max_tokens": 8},
    }
    result = async_scheduling_profile.run([tiny_model], "cpu", spec, quick=True, out_dir=tmp_path)
    written = json.loads((tmp_path / "quick" / "async_scheduling_profile-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))
    engines = written["models"][harness.portable(tiny_model)]["engines"]
    assert set(engines) == {"step7", "step8"}
    for point in engines.values():
        assert point["ms_per_step"] > 0 and len(point["host_ranges_us"]) == spec["steps"]
        assert point["gpu_steps"] == [] and point["idle_between_steps_share"] is None
    assert "GPU idle between steps" in async_scheduling_profile.report(written)


def test_gpu_benchmark_merges_a_dtype_into_the_recorded_json(tiny_model, tmp_path):
    """`--dtype` runs one dtype's points and merges them into the recorded JSON: the other dtypes' points,
    profiles and study stay, the dtype's own earlier points are replaced, and earlier_runs says where the
    kept points came from."""
    lengths = {"short": {"prompt_tokens": 4, "max_tokens": 3}, "long": {"prompt_tokens": 6, "max_tokens": 2}}
    common = dict(device="cpu", runs=1, batch_sizes=[2], lengths=lengths, dtype_study=None, out_dir=tmp_path)
    profile = {**gpu.PROFILE, "dtype": "float32", "batch_size": 2, "steps": 2, "top": 3}
    first = gpu.run(
        [tiny_model], matrix={"float32": {"short": ("step3", "step4")}}, profile=profile, **common
    )
    second = gpu.run(
        [tiny_model], matrix={"bfloat16": {"short": ("step4",)}}, profile=None, merge=True, **common
    )
    model = second["models"][harness.portable(tiny_model)]
    assert [(p["dtype"], set(p["median"])) for p in model["points"]] == [
        ("float32", {"step3", "step4"}),
        ("bfloat16", {"step4"}),
    ]
    assert model["points"][0] == first["models"][harness.portable(tiny_model)]["points"][0]  # kept as it was
    assert model["profiles"] == first["models"][harness.portable(tiny_model)]["profiles"] != {}
    assert second["workload"]["matrix"] == {
        "float32": {"short": ["step3", "step4"]},
        "bfloat16": {"short": ["step4"]},
    }
    assert [r["parts"] for r in second["earlier_runs"]] == [["float32 short"]]
    assert second["earlier_runs"][0]["machine"] == first["machine"]
    assert json.loads((tmp_path / "gpu-cpu.json").read_text()) == json.loads(json.dumps(second))
    assert "float32 short: from an earlier run" in gpu.report(second)

    # float32 again: its points replaced, nothing left from the first run
    third = gpu.run(
        [tiny_model], matrix={"float32": {"short": ("step4",)}}, profile=None, merge=True, **common
    )
    points = third["models"][harness.portable(tiny_model)]["points"]
    assert [(p["dtype"], set(p["median"])) for p in points] == [
        ("bfloat16", {"step4"}),
        ("float32", {"step4"}),
    ]
    assert [r["parts"] for r in third["earlier_runs"]] == [["bfloat16 short"]]
    assert third["earlier_runs"][0]["machine"] == second["machine"]

    # one workload of float32 (--workload): float32's short points stay beside it
    fourth = gpu.run(
        [tiny_model], matrix={"float32": {"long": ("step3",)}}, profile=None, merge=True, **common
    )
    parts = [(p["dtype"], p["workload"]) for p in fourth["models"][harness.portable(tiny_model)]["points"]]
    assert parts == [("bfloat16", "short"), ("float32", "short"), ("float32", "long")]
    assert fourth["workload"]["matrix"]["float32"] == {"short": ["step4"], "long": ["step3"]}
    assert sorted(x for r in fourth["earlier_runs"] for x in r["parts"]) == [
        "bfloat16 short",
        "float32 short",
    ]


def test_frontend_alone_and_a_profile_split_by_category(tmp_path):
    """engine_core's --profile-frontend parts: step 10's frontend over the synthetic core (every request
    gets its tokens, one output per choice for the steps waiting), and a profile's own time put in
    categories, builtins by their callers."""

    from benchmarks import engine_core
    from benchmarks.lib import profiled
    from benchmarks.lib.models import snapshot

    folder = snapshot("demo")
    alone = engine_core.frontend_alone("step10_engine_core", folder, requests=8, max_tokens=4, runs=1)
    assert alone["server"]["steps"] == alone["llm"]["steps"] == 4
    assert alone["server"]["events_per_token"] == 1 / 4  # the core ahead: 4 steps at once, 1 event each
    assert sum(alone["server"]["share"].values()) == pytest.approx(1.0)

    # a pstats table: (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers), where
    # callers maps a caller to the same figures for the calls from there
    wide, narrow, leaf = ("a.py", 1, "wide"), ("a.py", 5, "narrow"), ("a.py", 9, "leaf")
    builtin = ("~", 0, "len")
    stats = SimpleNamespace(
        stats={
            wide: (1, 1, 1.0, 8.0, {}),
            narrow: (1, 1, 1.0, 3.0, {}),
            leaf: (4, 4, 2.0, 8.0, {wide: (3, 3, 1.5, 6.0), narrow: (1, 1, 0.5, 2.0)}),
            builtin: (4, 4, 6.0, 6.0, {leaf: (4, 4, 6.0, 6.0)}),
        }
    )
    seconds = profiled.shares(stats, [("wide", r"\(wide\)"), ("narrow", r"\(narrow\)")])
    # leaf's 2 s and its builtin's 6 s go 3:1, as leaf's time from each caller (6 s, 2 s)
    assert seconds == {"wide": 1.0 + 0.75 * 8.0, "narrow": 1.0 + 0.25 * 8.0, "other": 0.0}
    assert [r["function"] for r in profiled.top_functions(stats, "tottime", 2)] == ["len", "a.py:9(leaf)"]


def test_dtype_option_is_for_the_gpu_benchmark_only_and_the_device_must_exist():
    from benchmarks.__main__ import parse_args

    assert parse_args(["gpu", "--dtype", "float32", "--dtype", "bfloat16"]).dtypes == ["float32", "bfloat16"]
    assert parse_args(["gpu", "--workload", "short"]).workloads == ["short"]
    assert parse_args(["engine_core", "--profile-frontend"]).profile_frontend
    assert parse_args(["fused_kernels", "--tiles"]).tiles
    bad = [
        ["gpu", "--profile-frontend"],
        ["ladder", "--tiles"],
        ["fused_kernels", "--tiles", "--replot"],
        ["fused_kernels", "--tiles", "--quick"],
        ["engine_core", "--profile-frontend", "--replot"],
        ["kvcache", "--dtype", "float16"],
        ["gpu", "--dtype", "float64"],
        ["gpu", "--dtype", "float32", "--replot"],
        ["static_batch", "--workload", "short"],
        ["gpu", "--workload", "medium"],
        ["gpu", "--device", "tpu"],
        ["gpu", "--device", "meta"],
    ]
    if not torch.cuda.is_available():
        bad.append(["gpu", "--device", "cuda"])  # a clear error before anything runs, not a traceback
        from benchmarks.__main__ import main

        assert main(["fused_kernels", "--tiles"]) == 2  # the sweep times kernels on a GPU: said, exit 2
    for argv in bad:
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2


def test_front_door_lists_every_benchmark_with_its_quick_command():
    """Every module of benchmarks/ is a benchmark of ``BENCHMARKS`` under its file name (the shared code is
    in benchmarks/lib/), each with a --quick mode, and benchmarks/README.md opens with a table that gives
    each one's step, question and --quick command, in the same order."""
    import importlib
    import inspect
    import re
    from pathlib import Path

    from benchmarks.__main__ import BENCHMARKS

    folder = Path(harness.__file__).resolve().parent.parent
    assert {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"} == set(BENCHMARKS)
    for name, (module_name, step, question) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        assert module.NAME == name and module_name == f"benchmarks.{name}"
        assert "quick" in inspect.signature(module.main).parameters
        assert re.fullmatch(r"\d+(-\d+)?", step) and question
    readme = (folder / "README.md").read_text()
    rows = re.findall(
        r"^\| ([\d-]+) \| \[`(\w+)`\]\(\2\.py\) \| [^|]+ \| `python -m benchmarks \2( [^`]*)? --quick` \|",
        readme,
        flags=re.M,
    )
    assert [(name, step) for step, name, _ in rows] == [(n, s) for n, (_, s, _) in BENCHMARKS.items()]


def test_ladder_leaves_the_oldest_steps_out_of_a_point_whose_pools_do_not_fit(monkeypatch):
    """Every step holds a KV pool for the whole point: where they do not fit in ``POOLS_SHARE`` of the GPU's
    memory together, the newest steps that fit run (the rule is held between neighbours), at least two;
    on a CPU every step."""
    modules = {f"step{n}": object() for n in range(5, 14)}
    config = SimpleNamespace(n_layer=12, n_embd=768)
    pool = 2 * 12 * 256 * 48 * 16 * 768 * 2  # fp16: 6.75 GiB
    memory = SimpleNamespace(total_memory=int(7.5 * pool / ladder.POOLS_SHARE))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: memory)
    fits = ladder.fitting(modules, config, "cuda", "float16", 256 * 48)
    assert list(fits) == [f"step{n}" for n in range(7, 14)]
    assert list(ladder.fitting(modules, config, "cuda", "float16", 48)) == list(modules)
    assert list(ladder.fitting(modules, config, "cuda", "float32", 256 * 48 * 8)) == ["step12", "step13"]
    assert ladder.fitting(modules, config, "cpu", "float32", 10**9) is modules


def test_the_load_splits_server_sent_events_at_line_feeds_only():
    """A JSON string may hold U+2028, U+2029 and U+0085 unescaped (orjson, the server): one event stays one
    line, however the stream is chunked; a CR before the LF is dropped."""
    import asyncio

    from benchmarks.lib.load import sse_lines

    events = ['data: {"text": "a\u2028b\x85c\u2029d"}', "", 'data: {"text": "e"}', "", "data: [DONE]", ""]
    body = "\n".join(events[:2]) + "\r\n" + "\n".join(events[2:])

    class Chunked:  # the text in pieces of 3 characters, as a network delivers it
        async def aiter_text(self):
            for i in range(0, len(body), 3):
                yield body[i : i + 3]

    async def lines():
        return [line async for line in sse_lines(Chunked())]

    got = asyncio.run(lines())
    assert got == ['data: {"text": "a\u2028b\x85c\u2029d"}', "", 'data: {"text": "e"}', "", "data: [DONE]"]
    assert json.loads(got[0][6:]) == {"text": "a\u2028b\x85c\u2029d"}

"""benchmarks/: the kvcache benchmark's code path end to end on a tiny model (structure of the JSON, not
speed: tests never assert timings), the harness's alternation and ratios, and the synthetic GPT-2
vocabulary of the gpt2-124m-random benchmark model."""

from __future__ import annotations

import json

import pytest

from benchmarks import harness, kvcache
from benchmarks.models import GPT2_VOCAB_SIZE, write_random_snapshot, write_synthetic_vocab
from common.tokenizer import Tokenizer, byte_to_unicode


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random GPT-2 with a 1000-token synthetic vocabulary and a 64-token context window."""
    folder = tmp_path_factory.mktemp("bench-tiny")
    return str(write_random_snapshot(folder, seed=0, vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4))


def test_kvcache_benchmark_writes_json_and_plot(tiny_model, tmp_path):
    limits = {tiny_model: {"max_tokens": 4, "runs": 1}}  # step1 only at 4 tokens, in the first run only
    result = kvcache.run([tiny_model], runs=2, gen_lengths=[4, 8], ttft_prompts=[8], step1_limits=limits,
                         out_dir=tmp_path)

    written = json.loads((tmp_path / "kvcache-cpu.json").read_text())
    assert written == json.loads(json.dumps(result))  # what was returned is what was written
    assert (tmp_path / "kvcache-cpu.png").stat().st_size > 0
    assert {"cpu", "cpu_cores", "torch_threads", "platform", "python", "torch", "transformers", "dtype", "date"} <= set(
        written["machine"]
    )
    assert written["workload"]["runs"] == 2
    model = written["models"][tiny_model]
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
    assert model["kv_cache_bytes"]["float16"]["formula_bytes_per_token"] == fp32["formula_bytes_per_token"] // 2

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

"""Step 4's benchmark: continuous batching and a paged KV cache against step 3's static batches.

Greedy, ``ignore_eos``, fp32, shared workloads. Engines: ``step3`` (static batches of up to B in arrival
order), ``step4`` (``LLMEngine``, max_num_seqs = B, blocks of 16), ``hf`` (generate, one request after
another). a. ``mixed`` and ``staggered`` at B = 8: throughput, latency, TTFT, computed over requested
positions; b. KV memory on ``mixed``: step 4's blocks against step 3's reservation; c./d. throughput against
the concurrency (1 to 16). Workloads, figures, targets and the JSON layout: benchmarks/README.md.

    python -m benchmarks continuous                         # gpt2-124m-random, 3 runs
    python -m benchmarks continuous --model demo --quick    # 1 run, fewer and shorter requests
"""

from __future__ import annotations

import time
from pathlib import Path

from .lib import drivers, harness, workloads
from .lib.models import hf_model, snapshot

NAME = "continuous"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3  # a full run stays near 12 minutes on 2 cores
MAX_BATCH = 8  # step 3's max_batch_size and step 4's max_num_seqs on mixed and staggered
BLOCK_SIZE = 16
CONCURRENCY = [1, 2, 4, 8, 16]
CONCURRENCY_REQUESTS = 16  # the first 16 mixed requests
BUDGET_MAX_NUM_SEQS = 64
WARMUP_TOKENS = 4  # a warm-up runs the first requests with at most this many new tokens
# --quick: 16 mixed and 8 staggered requests, prompts <= 64 and max_tokens <= 32; the sweep at 2 and 4 on 8
QUICK = {
    "mixed": 16,
    "staggered": 8,
    "max_prompt_tokens": 64,
    "max_tokens": 32,
    "concurrency": [2, 4],
    "concurrency_requests": 8,
}
CONFIG_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "head_dim")
ENGINES = {
    "step3": "step3_static_batch.LLM.generate, one call per static batch of up to B requests that have "
    "arrived, in arrival order; a batch runs until its longest member finishes",
    "step4": "step4_paged_continuous.LLMEngine(max_num_seqs=B, block_size=16, num_kv_blocks = B x the "
    "blocks of the workload's longest request: no preemption), add_request as arrival times pass, step() "
    "while busy",
    "hf": "transformers GPT2LMHeadModel.generate(do_sample=False, use_cache=True, max_new_tokens = "
    "min_new_tokens = the request's max_tokens), one request after another; torch.inference_mode",
}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks continuous``): the full or quick workloads on each model."""
    if quick:
        caps = (QUICK["max_prompt_tokens"], QUICK["max_tokens"])
        mixed = workloads.take(workloads.load("mixed"), QUICK["mixed"], *caps)
        staggered = workloads.take(workloads.load("staggered"), QUICK["staggered"], *caps)
        return run(
            models or DEFAULT_MODELS,
            device,
            runs=1,
            mixed=mixed,
            staggered=staggered,
            concurrency=QUICK["concurrency"],
            concurrency_requests=QUICK["concurrency_requests"],
            quick=True,
        )
    return run(models or DEFAULT_MODELS, device, runs=runs)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    mixed: dict | None = None,
    staggered: dict | None = None,
    max_batch: int = MAX_BATCH,
    concurrency: list[int] = CONCURRENCY,
    concurrency_requests: int = CONCURRENCY_REQUESTS,
    block_size: int = BLOCK_SIZE,
    budget_max_num_seqs: int = BUDGET_MAX_NUM_SEQS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Run every workload on each model; write ``<out_dir>/continuous-<device>.json`` and ``.png``.

    models: benchmark model names or snapshot folders. runs: measured runs per point, after a warm-up.
    mixed, staggered: the workloads (default: the committed files). max_batch: the batch size of a.
    concurrency: the batch sizes of the sweep, on the first ``concurrency_requests`` mixed requests
    (the schedule picture uses ``max_batch`` if it is among them, else the largest). block_size: step 4's
    tokens per block. budget_max_num_seqs: step 4's max_num_seqs in the fixed-budget run. Returns the
    result dict that was written (see benchmarks/README.md for its layout).
    """
    started = time.perf_counter()
    mixed = mixed if mixed is not None else workloads.load("mixed")
    staggered = staggered if staggered is not None else workloads.load("staggered")
    sweep_workload = workloads.take(mixed, concurrency_requests)
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, "float32"),
        "workload": {
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "runs": runs,
            "warmup": f"before each point, every engine once on its first requests (up to the batch size) "
            f"with at most {WARMUP_TOKENS} new tokens, all at time 0, untimed",
            "quick": quick,
            "max_batch": max_batch,
            "block_size": block_size,
            "mixed": {"summary": workloads.summary(mixed), "workload": mixed},
            "staggered": {"summary": workloads.summary(staggered), "workload": staggered},
            "concurrency": {
                "max_batch": concurrency,
                "summary": workloads.summary(sweep_workload),
                "workload": sweep_workload,
            },
            "kv_budget": f"the largest KVCache step3 allocates on mixed at batch {max_batch} (its peak "
            f"reservation); step4 with kv_cache_memory = that, max_num_seqs = {budget_max_num_seqs}, mixed "
            "at time 0, one run",
            "engines": ENGINES,
            "timing": "time.perf_counter from the start of the workload (time 0 of the arrivals) to the last "
            "token; latency and TTFT from each request's own arrival; engines alternated within each run "
            "(order rotated per run); medians over runs; ratios are medians of per-run ratios",
        },
        "models": {},
    }

    def run(name: str) -> dict:
        return bench_model(
            name,
            device,
            runs,
            mixed,
            staggered,
            sweep_workload,
            max_batch,
            concurrency,
            block_size,
            budget_max_num_seqs,
        )

    harness.run_models(result, models, run)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str,
    device: str,
    runs: int,
    mixed: dict,
    staggered: dict,
    sweep_workload: dict,
    max_batch: int,
    concurrency: list[int],
    block_size: int,
    budget_max_num_seqs: int,
) -> dict:
    """Every workload on one model: every run's figures, their medians and the ratios."""
    import step3_static_batch
    import step4_paged_continuous

    folder = snapshot(name)
    step3 = step3_static_batch.LLM(
        model=str(folder), device=device, dtype="float32", max_batch_size=max([max_batch, *concurrency])
    )
    hf = hf_model(folder, device)
    config = step3.config
    reqs = {
        role: workloads.requests(w, config.vocab_size, config.n_positions)
        for role, w in (("mixed", mixed), ("staggered", staggered))
    }
    sweep_reqs = workloads.requests(sweep_workload, config.vocab_size, config.n_positions)
    # step 4's pool: room for B of the longest request, so that it never preempts at batch size B
    longest = max(r.prompt_tokens + r.max_tokens for rs in reqs.values() for r in rs)
    blocks_per_seq = -(-longest // block_size)
    step4_engines: dict[int, object] = {}

    def step4_engine(b: int):
        if b not in step4_engines:
            step4_engines.clear()  # one at a time: each holds its own copy of the weights
            step4_engines[b] = step4_paged_continuous.LLMEngine(
                model=str(folder),
                device=device,
                dtype="float32",
                block_size=block_size,
                max_num_seqs=b,
                num_kv_blocks=b * blocks_per_seq,
            )
        return step4_engines[b]

    def engines(rs: list[workloads.Request], b: int, with_hf: bool = False) -> dict:
        calls = {
            "step3": lambda: drivers.summarise(drivers.run_step3(step3, step3_static_batch, rs, b, device)),
            "step4": lambda: drivers.summarise(
                drivers.run_step4(step4_engine(b), step4_paged_continuous, rs, device)
            ),
        }
        if with_hf:
            calls["hf"] = lambda: drivers.summarise(drivers.run_hf(hf, rs, 1, device))
        return calls

    def measure(rs: list[workloads.Request], b: int, ratios: dict, with_hf: bool = False) -> dict:
        drivers.warm_up(engines(drivers.warmup_requests(rs, b, WARMUP_TOKENS), b, with_hf))
        return drivers.compare(harness.alternate(engines(rs, b, with_hf), runs, warmup=0), ratios)

    ratios = {
        "step4/step3": ("step4", "step3", "throughput_tok_s"),
        "step3/step4 latency": ("step3", "step4", "latency_mean_s"),
        "step3/step4 p95 latency": ("step3", "step4", "latency_p95_s"),
        "step3/step4 ttft": ("step3", "step4", "ttft_p50_s"),
    }
    out = {
        "snapshot": str(folder),
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "parameters": sum(p.numel() for p in step3.model.parameters()),
    }

    # a. mixed and staggered at the same maximum batch size
    for role, w in (("mixed", mixed), ("staggered", staggered)):
        print(f"  {role} ({w['name']}): {len(w['requests'])} requests, max batch {max_batch}", flush=True)
        out[role] = {"max_batch": max_batch, **measure(reqs[role], max_batch, ratios)}

    # b. KV memory on mixed, then step 4 in the memory step 3 reserves
    kv = kv_memory(out["mixed"], config, block_size)
    budget = int(kv["step3"]["peak_bytes"])  # the same every run: the batches at time 0 are fixed
    print(
        f"  mixed in step3's KV budget ({budget / 2**20:.3g} MiB), max_num_seqs {budget_max_num_seqs}",
        flush=True,
    )
    step4_engines.clear()
    budget_engine = step4_paged_continuous.LLMEngine(
        model=str(folder),
        device=device,
        dtype="float32",
        block_size=block_size,
        max_num_seqs=budget_max_num_seqs,
        kv_cache_memory=budget,
    )
    drivers.run_step4(
        budget_engine, step4_paged_continuous, drivers.warmup_requests(reqs["mixed"], max_batch), device
    )
    in_budget = drivers.summarise(
        drivers.run_step4(budget_engine, step4_paged_continuous, reqs["mixed"], device)
    )
    del budget_engine
    kv["budget"] = {
        "bytes": budget,
        "step3_max_sequences": max_batch,
        "step4_max_running": in_budget["max_running"],
        "step4_mean_running": in_budget["mean_running"],
        "step4_preemptions": in_budget["num_preemptions"],
        "step4_run": in_budget,
    }
    out["kv_memory"] = kv

    # c./d. throughput against the concurrency, HF sequential at the last point
    sweep = []
    for b in concurrency:
        with_hf = b == concurrency[-1]
        print(
            f"  concurrency {b}: first {len(sweep_reqs)} mixed requests"
            f"{' (+ HF sequential)' if with_hf else ''}",
            flush=True,
        )
        point_ratios = {
            "step4/step3": ratios["step4/step3"],
            "step3/step4 latency": ratios["step3/step4 latency"],
        }
        if with_hf:
            point_ratios |= {
                "step4/hf": ("step4", "hf", "throughput_tok_s"),
                "step3/hf": ("step3", "hf", "throughput_tok_s"),
            }
        sweep.append({"max_batch": b, **measure(sweep_reqs, b, point_ratios, with_hf)})
    out["concurrency"] = sweep
    step4_engines.clear()
    return out


def kv_memory(mixed_point: dict, config, block_size: int) -> dict:
    """KV figures of the mixed runs (medians; the schedule at time 0 is the same every run): step 3's
    reservation and step 4's blocks, bytes, real tokens, and waste per sequence in blocks."""
    s3, s4 = mixed_point["median"]["step3"], mixed_point["median"]["step4"]
    bytes_per_token = 2 * config.n_layer * config.n_embd * 4  # K and V, fp32
    first3 = mixed_point["runs"]["step3"][0]
    return {
        "block_size": block_size,
        "bytes_per_token": bytes_per_token,
        "bytes_per_block": s4["kv_bytes_per_block"],
        "step3": {
            "peak_bytes": s3["kv_peak_bytes"],
            "peak_tokens_stored": s3["kv_peak_tokens_stored"],
            "waste_mean_blocks": s3["kv_waste_mean_slots"] / block_size,
            "waste_max_blocks": s3["kv_waste_max_slots"] / block_size,
            "batches": [
                {
                    "requests": len(b["requests"]),
                    "capacity": b["capacity"],
                    "kv_bytes": b["kv_bytes"],
                    "tokens_stored": b["tokens_stored"],
                }
                for b in first3["batches"]
            ],
        },
        "step4": {
            "peak_blocks": s4["kv_peak_blocks"],
            "peak_bytes": s4["kv_peak_bytes"],
            "peak_tokens_stored": s4["kv_peak_tokens_stored"],
            "pool_bytes": s4["kv_pool_bytes"],
            "waste_mean_blocks": s4["kv_waste_mean_slots"] / block_size,
            "waste_max_blocks": s4["kv_waste_max_slots"] / block_size,
        },
        "step3/step4 peak bytes": s3["kv_peak_bytes"] / s4["kv_peak_bytes"],
    }


def targets(model: dict, workload: dict) -> list[dict]:
    """The step's performance targets on one model's results: ``harness.target_line``'s arguments (label,
    value, target, unit, full_size: whether the workload the target is defined at ran)."""
    mx, last = model["mixed"], model["concurrency"][-1]
    full_mixed = "derived" not in workload["mixed"]["workload"]  # not shortened (--quick)
    n = len(last["runs"]["step4"][0]["requests"])
    return [
        {
            "label": f"step4 / step3 throughput, mixed at max batch {mx['max_batch']}",
            "target": ">= 1.5",
            "value": mx["ratios"]["step4/step3"]["median"],
            "full_size": full_mixed and mx["max_batch"] == MAX_BATCH,
        },
        {
            "label": f"step3 / step4 mean latency, mixed at max batch {mx['max_batch']}",
            "target": ">= 1.5",
            "value": mx["ratios"]["step3/step4 latency"]["median"],
            "full_size": full_mixed and mx["max_batch"] == MAX_BATCH,
        },
        {
            "label": f"step4 / HF sequential throughput, {n} requests at concurrency {last['max_batch']}",
            "target": ">= 3",
            "value": last["ratios"]["step4/hf"]["median"],
            "full_size": full_mixed and (n, last["max_batch"]) == (CONCURRENCY_REQUESTS, CONCURRENCY[-1]),
        },
        {
            "label": "step4 KV waste per sequence, max over steps, mixed",
            "target": "< 1",
            "unit": " blocks",
            "value": model["kv_memory"]["step4"]["waste_max_blocks"],
            "full_size": full_mixed,
        },
    ]


def report(result: dict) -> str:
    """The readable summary printed at the end: per model, the tables and the target lines."""
    lines = []
    machine, w = result["machine"], result["workload"]
    lines.append(
        f"continuous on {machine['device']} ({machine['cpu']}, {machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, transformers {machine['transformers']}, {w['runs']} run(s), medians"
    )
    headers = [
        "workload",
        "engine",
        "tok/s",
        "lat mean s",
        "lat p95 s",
        "TTFT p50 s",
        "TTFT p95 s",
        "computed/req",
    ]
    for name, model in result["models"].items():
        c = model["config"]
        lines.append(
            f"\n## {name}: {model['parameters'] / 1e6:.1f}M parameters, {c['n_layer']} layers, "
            f"{c['n_embd']} wide, {c['n_positions']} positions"
        )
        rows = []
        for wname in ("mixed", "staggered"):
            s = w[wname]["summary"]
            point = model[wname]
            for engine, label in (("step3", "step3 static"), ("step4", "step4 continuous")):
                m = point["median"][engine]
                rows.append(
                    [
                        wname,
                        label,
                        m["throughput_tok_s"],
                        m["latency_mean_s"],
                        m["latency_p95_s"],
                        m["ttft_p50_s"],
                        m["ttft_p95_s"],
                        m["computed_over_requested"],
                    ]
                )
            r = point["ratios"]
            rows.append(
                [
                    wname,
                    "step4 vs step3",
                    f"{r['step4/step3']['median']:.2f}x",
                    f"{r['step3/step4 latency']['median']:.2f}x",
                    f"{r['step3/step4 p95 latency']['median']:.2f}x",
                    f"{r['step3/step4 ttft']['median']:.2f}x",
                    None,
                    None,
                ]
            )
        s = w["mixed"]["summary"]
        st = w["staggered"]["summary"]
        lines.append(
            f"\na. max batch {model['mixed']['max_batch']}: mixed = {s['requests']} requests at time 0, "
            f"prompts {s['prompt_tokens_range']}, max_tokens {s['max_tokens_range']}; "
            f"staggered = {st['requests']} "
            f"of them arriving over {st['last_arrival_s']:.1f} s (latency and TTFT from arrival)"
        )
        lines.append(harness.table(headers, rows))
        kv = model["kv_memory"]
        mib = 2**20
        lines.append(
            f"\nb. KV cache on mixed at max batch {model['mixed']['max_batch']} "
            f"({kv['bytes_per_token']} bytes per token, blocks of {kv['block_size']})"
        )
        rows = [
            [
                "step3 (reserved, largest batch)",
                kv["step3"]["peak_bytes"] / mib,
                kv["step3"]["peak_tokens_stored"],
                kv["step3"]["waste_mean_blocks"],
                kv["step3"]["waste_max_blocks"],
            ],
            [
                "step4 (peak blocks in use)",
                kv["step4"]["peak_bytes"] / mib,
                kv["step4"]["peak_tokens_stored"],
                kv["step4"]["waste_mean_blocks"],
                kv["step4"]["waste_max_blocks"],
            ],
        ]
        lines.append(
            harness.table(
                ["engine", "peak MiB", "tokens stored", "waste/seq mean blocks", "waste/seq max blocks"], rows
            )
        )
        b = kv["budget"]
        lines.append(
            f"in step3's budget of {b['bytes'] / mib:.3g} MiB: "
            f"step3 runs {b['step3_max_sequences']} sequences, "
            f"step4 up to {b['step4_max_running']} (mean {b['step4_mean_running']:.1f}, "
            f"{b['step4_preemptions']} preemptions, computed/requested "
            f"{b['step4_run']['computed_over_requested']:.2f}, "
            f"{b['step4_run']['throughput_tok_s']:.0f} tok/s)"
        )
        rows = []
        for p in model["concurrency"]:
            m = p["median"]
            rows.append(
                [
                    p["max_batch"],
                    m["step3"]["throughput_tok_s"],
                    m["step4"]["throughput_tok_s"],
                    p["ratios"]["step4/step3"]["median"],
                    m.get("hf", {}).get("throughput_tok_s"),
                    p["ratios"].get("step4/hf", {}).get("median"),
                ]
            )
        n = len(model["concurrency"][0]["runs"]["step3"][0]["requests"])
        lines.append(
            f"\nc./d. throughput (tok/s) against the concurrency, the first {n} mixed requests at time 0"
        )
        lines.append(
            harness.table(["max batch", "step3", "step4", "step4/step3", "HF sequential", "step4/HF"], rows)
        )
        lines.append("\ntargets")
        lines.extend(harness.target_line(**t) for t in targets(model, w))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model, two rows: throughput against the concurrency, latency on mixed and staggered, KV memory;
    then the schedule of the same requests, static batches beside continuous batching."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    models = result["models"]
    fig = plt.figure(figsize=(18, 11 * len(models)))
    grid = fig.add_gridspec(2 * len(models), 6, height_ratios=[1, 1.25] * len(models))
    colors = {"step3": "C1", "step4": "C2", "hf": "C7"}
    for i, (name, model) in enumerate(models.items()):
        # throughput against the concurrency
        ax = fig.add_subplot(grid[2 * i, 0:2])
        sweep = model["concurrency"]
        xs = [p["max_batch"] for p in sweep]
        for engine, label in (
            ("step3", "step3 static, batch = B"),
            ("step4", "step4 continuous, max_num_seqs = B"),
        ):
            ax.plot(
                xs,
                [p["median"][engine]["throughput_tok_s"] for p in sweep],
                marker="o",
                label=label,
                color=colors[engine],
            )
        hf = sweep[-1]["median"]["hf"]["throughput_tok_s"]
        ax.axhline(hf, color=colors["hf"], linestyle="--", label="HF generate, one request after another")
        n = len(sweep[0]["runs"]["step3"][0]["requests"])
        ax.set(
            xscale="log",
            xlabel="concurrency B (most requests in one batch)",
            ylabel="generated tokens / s",
            ylim=(0, None),
            title=f"{name}: throughput against the concurrency\n(the first {n} mixed requests at time 0)",
        )
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.legend(fontsize=9)
        # latency on mixed and staggered
        ax = fig.add_subplot(grid[2 * i, 2:4])
        groups = [
            ("mixed", "latency_mean_s", "mixed\nmean latency"),
            ("mixed", "latency_p95_s", "mixed\np95 latency"),
            ("mixed", "ttft_p50_s", "mixed\nTTFT p50"),
            ("staggered", "latency_mean_s", "staggered\nmean latency"),
            ("staggered", "latency_p95_s", "staggered\np95 latency"),
            ("staggered", "ttft_p50_s", "staggered\nTTFT p50"),
        ]
        for j, (engine, label) in enumerate((("step3", "step3 static"), ("step4", "step4 continuous"))):
            values = [model[w]["median"][engine][key] for w, key, _ in groups]
            ax.bar(
                [g + (j - 0.5) * 0.38 for g in range(len(groups))],
                values,
                width=0.38,
                label=label,
                color=colors[engine],
            )
        ax.set_xticks(range(len(groups)), [g[2] for g in groups], fontsize=8)
        mb = model["mixed"]["max_batch"]
        ax.set(
            ylabel="seconds from the request's arrival",
            title=f"{name}: latency at max batch {mb}\n(mixed: all at time 0; staggered: arriving over time)",
        )
        ax.legend(fontsize=9)
        # KV memory
        ax = fig.add_subplot(grid[2 * i, 4:6])
        kv = model["kv_memory"]
        mib = 2**20
        bpt = kv["bytes_per_token"]
        labels = ["step3\nreserved", "step4\nblocks in use"]
        held = [kv["step3"]["peak_bytes"] / mib, kv["step4"]["peak_bytes"] / mib]
        stored = [
            kv["step3"]["peak_tokens_stored"] * bpt / mib,
            kv["step4"]["peak_tokens_stored"] * bpt / mib,
        ]
        ax.bar(labels, held, color=[colors["step3"], colors["step4"]], alpha=0.45, label="allocated (peak)")
        ax.bar(labels, stored, color=[colors["step3"], colors["step4"]], label="holding real tokens")
        for x, (h, s) in enumerate(zip(held, stored)):
            ax.annotate(
                f"{h:.3g} MiB\n({100 * s / h:.0f}% real tokens)", (x, h), ha="center", va="bottom", fontsize=9
            )
        b = kv["budget"]
        ax.set(
            ylabel="MiB of KV cache",
            title=f"{name}: KV memory, mixed at max batch {mb}\nin step3's "
            f"{b['bytes'] / mib:.3g} MiB step4 ran up to {b['step4_max_running']} sequences, step3 "
            f"{b['step3_max_sequences']}",
        )
        ax.set_ylim(0, 1.45 * max(held))
        ax.legend(fontsize=9, loc="upper left")
        # the schedule: static vs continuous on the same requests, the first run at batch mb (or the largest)
        point = next((p for p in sweep if p["max_batch"] == mb), sweep[-1])
        ax3 = fig.add_subplot(grid[2 * i + 1, 0:3])
        ax4 = fig.add_subplot(grid[2 * i + 1, 3:6], sharex=ax3, sharey=ax3)
        schedule(ax3, point["runs"]["step3"][0], colors["step3"], static=True)
        schedule(ax4, point["runs"]["step4"][0], colors["step4"], static=False)
        n = len(point["runs"]["step3"][0]["requests"])
        ax3.set_title(
            f"{name}: step3, static batches of {point['max_batch']}: {n} mixed requests submitted at 0"
        )
        ax4.set_title(
            f"{name}: step4, continuous batching, at most {point['max_batch']} running: the same requests"
        )
        ax4.tick_params(labelleft=False)
        ax4.set_ylabel("")
    handles = [
        Patch(color="0.85", label="waiting (submitted, not started)"),
        Patch(color=colors["step3"], label="step3 running"),
        Patch(color=colors["step4"], label="step4 running"),
        Patch(
            facecolor="white", edgecolor="C3", hatch="///", label="finished, its row still computing (wasted)"
        ),
        plt.Line2D([], [], color="k", marker="|", linestyle="", markersize=10, label="first token"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=10, frameon=False)
    machine = result["machine"]
    headline = "; ".join(
        f"{name}: step4/step3 throughput at max batch {model['mixed']['max_batch']}: "
        + ", ".join(f"{w} {model[w]['ratios']['step4/step3']['median']:.2f}x" for w in ("mixed", "staggered"))
        for name, model in models.items()
    )
    fig.suptitle(
        f"Continuous batching benchmark, {machine['device']} ({machine['cpu']}, {machine['torch_threads']} "
        f"threads), {machine['dtype']}, median of {result['workload']['runs']} run(s)\n{headline}"
    )
    fig.tight_layout(rect=(0, 0.03 / len(models), 1, 1))
    return harness.save_figure(fig, path)


def schedule(ax, run: dict, color: str, static: bool) -> None:
    """Requests as horizontal bars over time: waiting (arrival -> start), running (start -> finished),
    and for static batches the time a finished request's row kept computing (-> its batch's end),
    with each batch's padding and wasted positions written beside it."""
    recs = sorted(run["requests"], key=lambda r: r["index"])
    for y, r in enumerate(recs):
        ax.barh(y, r["started_s"] - r["arrival_s"], left=r["arrival_s"], color="0.85", height=0.8)
        ax.barh(y, r["finished_s"] - r["started_s"], left=r["started_s"], color=color, height=0.8)
        if r["first_token_s"] is not None:
            ax.plot([r["first_token_s"]], [y], marker="|", color="k", markersize=8)
    if static:
        row = {r["index"]: y for y, r in enumerate(recs)}
        for k, batch in enumerate(run["batches"]):
            members = [recs[row[i]] for i in batch["requests"]]
            for r in members:
                ax.barh(
                    row[r["index"]],
                    batch["end_s"] - r["finished_s"],
                    left=r["finished_s"],
                    height=0.8,
                    facecolor="none",
                    edgecolor="C3",
                    hatch="///",
                    linewidth=0,
                )
            pad, wasted = drivers.batch_waste(run, batch)
            useful = sum(r["prompt_tokens"] + r["generated_tokens"] for r in members)
            ys = [row[i] for i in batch["requests"]]
            ax.axvline(batch["end_s"], color="0.5", linewidth=0.8, linestyle=":")
            ax.annotate(
                f"batch {k + 1}: {pad} padding + {wasted} wasted\npositions for {useful} useful",
                (batch["end_s"], (min(ys) + max(ys)) / 2),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                color="C3",
            )
        ax.set_xlim(0, 1.3 * max(b["end_s"] for b in run["batches"]))  # room for the batch labels
    ax.set_yticks(
        range(len(recs)),
        [f"#{r['index']}: {r['prompt_tokens']} + {r['generated_tokens']}" for r in recs],
        fontsize=8,
    )
    ax.set(xlabel="seconds since the requests were submitted", ylabel="request: prompt + generated tokens")
    ax.set_ylim(len(recs) - 0.5, -0.5)

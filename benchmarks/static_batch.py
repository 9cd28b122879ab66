"""Step 3's benchmark: what static batching buys over one request at a time, and what it wastes.

Greedy, ``ignore_eos``, fp32, prompts of random token ids from fixed seeds. Engines: ``step2`` (one request
after another), ``step3`` (static batches in arrival order, each running until its longest member finishes),
``hf`` (generate on the same batches). a. B equal requests (32 + 64 tokens) at once, B = 1 to 32: throughput;
b. ``mixed`` at batch size 8: throughput, latency, and computed over requested positions (padding and
finished rows: the price of static batching). Details and the JSON layout: benchmarks/README.md.

    python -m benchmarks static_batch                         # gpt2-124m-random, 3 runs
    python -m benchmarks static_batch --model demo --quick    # 1 run, fewer and shorter requests
"""

from __future__ import annotations

import time
from pathlib import Path

from .lib import drivers, harness, workloads
from .lib.models import hf_model, snapshot

NAME = "static_batch"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3  # a full run stays near 10 minutes on 2 cores
BATCH_SIZES = [1, 2, 4, 8, 16, 32]
EQUAL_PROMPT_TOKENS = 32
EQUAL_MAX_TOKENS = 64
EQUAL_TOKEN_ID_SEED = 2000
STEP2_MAX_REQUESTS = 2  # step 2 serves one request at a time: its throughput does not depend on B
MIXED_BATCH_SIZE = 8
WARMUP_TOKENS = 4  # a warm-up runs the same requests with at most this many new tokens
QUICK = {
    "batch_sizes": [1, 8],
    "equal_max_tokens": 16,
    "mixed": {"n": 16, "max_prompt_tokens": 64, "max_tokens": 32},
}
CONFIG_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "head_dim")
ENGINES = {
    "step2": "step2_kvcache.LLM.generate: one request after another, batch 1",
    "step3": "step3_static_batch.LLM.generate, one call per static batch (up to B requests in arrival order, "
    "what generate forms with max_batch_size=B); a batch runs until its longest member finishes",
    "hf": "transformers GPT2LMHeadModel.generate(do_sample=False, use_cache=True) per static batch of up "
    "to B in arrival order: left padding + attention_mask, max_new_tokens = min_new_tokens = the batch's "
    "largest max_tokens; torch.inference_mode",
}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks static_batch``): the full or quick workloads on each model."""
    if quick:
        q = QUICK["mixed"]
        mixed = workloads.take(workloads.load("mixed"), q["n"], q["max_prompt_tokens"], q["max_tokens"])
        return run(
            models or DEFAULT_MODELS,
            device,
            runs=1,
            batch_sizes=QUICK["batch_sizes"],
            equal_max_tokens=QUICK["equal_max_tokens"],
            mixed=mixed,
            quick=True,
        )
    return run(models or DEFAULT_MODELS, device, runs=runs)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    batch_sizes: list[int] = BATCH_SIZES,
    equal_prompt_tokens: int = EQUAL_PROMPT_TOKENS,
    equal_max_tokens: int = EQUAL_MAX_TOKENS,
    step2_max_requests: int = STEP2_MAX_REQUESTS,
    mixed: dict | None = None,
    mixed_batch_size: int = MIXED_BATCH_SIZE,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Run both workloads on each model; write ``<out_dir>/static_batch-<device>.json`` and ``.png``.

    models: benchmark model names or snapshot folders. runs: measured runs per point, after a warm-up.
    batch_sizes, equal_prompt_tokens, equal_max_tokens: workload a. step2_max_requests: step 2 serves
    at most this many of workload a's requests. mixed: the workload of b (default: the committed
    ``mixed``), served in static batches of ``mixed_batch_size``. Returns the result dict that was
    written (see benchmarks/README.md for its layout).
    """
    started = time.perf_counter()
    mixed = mixed if mixed is not None else workloads.load("mixed")
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, "float32"),
        "workload": {
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "runs": runs,
            "warmup": f"before each point, every engine once on the same requests with at most "
            f"{WARMUP_TOKENS} new tokens (the first 8 requests on the mixed workload), untimed",
            "quick": quick,
            "equal_length": {
                "batch_sizes": batch_sizes,
                "prompt_tokens": equal_prompt_tokens,
                "max_tokens": equal_max_tokens,
                "requests": "B per point, all at time 0; prompt ids: torch.Generator().manual_seed("
                f"{EQUAL_TOKEN_ID_SEED} + i), uniform in [0, vocab_size - 1)",
                "step2_max_requests": step2_max_requests,
            },
            "mixed": {"batch_size": mixed_batch_size, "summary": workloads.summary(mixed), "workload": mixed},
            "engines": ENGINES,
            "timing": "time.perf_counter from submitting the workload to its last token; engines "
            "alternated within each run (order rotated per run); medians over runs; ratios are medians of "
            "per-run ratios",
        },
        "models": {},
    }

    def run(name: str) -> dict:
        return bench_model(
            name,
            device,
            runs,
            batch_sizes,
            equal_prompt_tokens,
            equal_max_tokens,
            step2_max_requests,
            mixed,
            mixed_batch_size,
        )

    harness.run_models(result, models, run)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str,
    device: str,
    runs: int,
    batch_sizes: list[int],
    equal_prompt_tokens: int,
    equal_max_tokens: int,
    step2_max_requests: int,
    mixed: dict,
    mixed_batch_size: int,
) -> dict:
    """Both workloads on one model: every run's figures, their medians and the ratios."""
    import step2_kvcache
    import step3_static_batch

    folder = snapshot(name)
    step2 = step2_kvcache.LLM(model=str(folder), device=device, dtype="float32")
    step3 = step3_static_batch.LLM(
        model=str(folder),
        device=device,
        dtype="float32",
        max_batch_size=max(batch_sizes + [mixed_batch_size]),
    )
    hf = hf_model(folder, device)
    config = step3.config

    def engines(reqs: list[workloads.Request], batch_size: int, step2_reqs: list[workloads.Request]) -> dict:
        return {
            "step2": lambda: drivers.summarise(drivers.run_step2(step2, step2_kvcache, step2_reqs, device)),
            "step3": lambda: drivers.summarise(
                drivers.run_step3(step3, step3_static_batch, reqs, batch_size, device)
            ),
            "hf": lambda: drivers.summarise(drivers.run_hf(hf, reqs, batch_size, device)),
        }

    throughput_ratios = {
        "step3/step2": ("step3", "step2", "throughput_tok_s"),
        "step3/hf": ("step3", "hf", "throughput_tok_s"),
        "hf/step2": ("hf", "step2", "throughput_tok_s"),
    }

    # a. throughput against the batch size, equal-length requests
    sweep = []
    for b in batch_sizes:
        print(f"  {b} equal requests ({equal_prompt_tokens} + {equal_max_tokens} tokens)", flush=True)
        equal = workloads.equal(b, equal_prompt_tokens, equal_max_tokens, EQUAL_TOKEN_ID_SEED)
        reqs = workloads.requests(equal, config.vocab_size, config.n_positions)
        step2_reqs = reqs[:step2_max_requests]
        warm = drivers.warmup_requests(reqs, max_tokens=WARMUP_TOKENS)
        drivers.warm_up(engines(warm, b, warm[:step2_max_requests]))
        raw = harness.alternate(engines(reqs, b, step2_reqs), runs, warmup=0)
        point = drivers.compare(raw, throughput_ratios, keep_records=False)
        sweep.append({"batch_size": b, "requests": {"step2": len(step2_reqs), "step3": b, "hf": b}, **point})

    # b. the mixed workload in static batches of mixed_batch_size
    print(f"  mixed workload: {len(mixed['requests'])} requests, batches of {mixed_batch_size}", flush=True)
    reqs = workloads.requests(mixed, config.vocab_size, config.n_positions)
    warm = drivers.warmup_requests(reqs, mixed_batch_size, WARMUP_TOKENS)
    drivers.warm_up(engines(warm, mixed_batch_size, warm))
    raw = harness.alternate(engines(reqs, mixed_batch_size, reqs), runs, warmup=0)
    mixed_point = drivers.compare(
        raw,
        {
            **throughput_ratios,
            "step2/step3 latency": ("step2", "step3", "latency_mean_s"),
            "hf/step3 latency": ("hf", "step3", "latency_mean_s"),
        },
    )

    return {
        "snapshot": str(folder),
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "parameters": sum(p.numel() for p in step3.model.parameters()),
        "equal_length": sweep,
        "mixed": {"batch_size": mixed_batch_size, **mixed_point},
    }


def targets(model: dict, workload: dict) -> list[dict]:
    """The step's performance targets on one model's results: ``harness.target_line``'s arguments (label,
    value, target, full_size: whether the workload the target is defined at ran)."""
    sweep = {p["batch_size"]: p for p in model["equal_length"]}
    b = 8 if 8 in sweep else max(sweep)
    eq = workload["equal_length"]
    mixed = model["mixed"]
    return [
        {
            "label": f"step3 / step2 throughput, {b} equal-length requests",
            "target": ">= 3",
            "value": sweep[b]["ratios"]["step3/step2"]["median"],
            "full_size": b == 8
            and (eq["prompt_tokens"], eq["max_tokens"]) == (EQUAL_PROMPT_TOKENS, EQUAL_MAX_TOKENS),
        },
        {
            "label": f"step3 / HF batched throughput, mixed workload at batch {mixed['batch_size']}",
            "target": ">= 1.0",
            "value": mixed["ratios"]["step3/hf"]["median"],
            "full_size": mixed["batch_size"] == MIXED_BATCH_SIZE
            and "derived" not in workload["mixed"]["workload"],
        },
    ]


def report(result: dict) -> str:
    """The readable summary printed at the end: per model, two tables and the target lines."""
    lines = []
    machine, w = result["machine"], result["workload"]
    lines.append(
        f"static_batch on {machine['device']} ({machine['cpu']}, {machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, transformers {machine['transformers']}, {w['runs']} run(s), medians"
    )
    eq = w["equal_length"]
    for name, model in result["models"].items():
        c = model["config"]
        lines.append(
            f"\n## {name}: {model['parameters'] / 1e6:.1f}M parameters, {c['n_layer']} layers, "
            f"{c['n_embd']} wide, {c['n_positions']} positions"
        )
        lines.append(
            f"\na. throughput (generated tok/s), B equal requests of {eq['prompt_tokens']} + "
            f"{eq['max_tokens']} tokens (step2 serves min(B, {eq['step2_max_requests']}) of them)"
        )
        rows = []
        for p in model["equal_length"]:
            m, r = p["median"], p["ratios"]
            rows.append(
                [
                    p["batch_size"],
                    m["step2"]["throughput_tok_s"],
                    m["step3"]["throughput_tok_s"],
                    m["hf"]["throughput_tok_s"],
                    r["step3/step2"]["median"],
                    r["step3/hf"]["median"],
                ]
            )
        lines.append(harness.table(["B", "step2", "step3", "HF batched", "step3/step2", "step3/HF"], rows))
        mx = model["mixed"]
        s = w["mixed"]["summary"]
        lines.append(
            f"\nb. mixed workload: {s['requests']} requests at time 0, prompts {s['prompt_tokens_range']}, "
            f"max_tokens {s['max_tokens_range']} ({s['max_tokens']} to generate), "
            f"batch size {mx['batch_size']}"
        )
        rows = []
        for engine, label in (
            ("step2", "step2 (one by one)"),
            ("step3", "step3 (static)"),
            ("hf", "HF batched"),
        ):
            m = mx["median"][engine]
            rows.append(
                [
                    label,
                    m["throughput_tok_s"],
                    m["latency_mean_s"],
                    m["latency_p95_s"],
                    m.get("ttft_p50_s"),
                    m["computed_over_requested"],
                    m["wall_s"],
                ]
            )
        lines.append(
            harness.table(
                [
                    "engine",
                    "tok/s",
                    "latency mean s",
                    "latency p95 s",
                    "TTFT p50 s",
                    "computed/requested",
                    "wall s",
                ],
                rows,
            )
        )
        r = mx["ratios"]
        lines.append(
            f"step3/step2 throughput {r['step3/step2']['median']:.2f}x, "
            f"step3/HF {r['step3/hf']['median']:.2f}x; "
            f"mean latency step2/step3 {r['step2/step3 latency']['median']:.2f}x, "
            f"HF/step3 {r['hf/step3 latency']['median']:.2f}x"
        )
        lines.append("\ntargets")
        lines.extend(harness.target_line(**t) for t in targets(model, w))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """One row of three panels per model: throughput against the batch size (equal-length requests); on
    the mixed workload, throughput per engine (with computed/requested positions), and latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # the colours of the other benchmarks: step3 orange (as in continuous), HF grey
    engines = (
        ("step2", "step2 (one by one)", "C0"),
        ("step3", "step3 (static batch)", "C1"),
        ("hf", "HF batched", "C7"),
    )
    models = result["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.6 * len(models)), squeeze=False)
    for row, (name, model) in zip(axes, models.items()):
        ax = row[0]
        sizes = [p["batch_size"] for p in model["equal_length"]]
        for engine, label, color in engines:
            ax.plot(
                sizes,
                [p["median"][engine]["throughput_tok_s"] for p in model["equal_length"]],
                marker="o",
                label=label,
                color=color,
            )
        eq = result["workload"]["equal_length"]
        ax.set(
            xscale="log",
            xlabel="batch size B (B requests at once)",
            ylabel="generated tokens / s",
            ylim=(0, None),
            title=f"{name}: throughput, {eq['prompt_tokens']} + {eq['max_tokens']}-token requests",
        )
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.legend()
        mx = model["mixed"]
        labels = [label.replace(" (", "\n(") for _, label, _ in engines]
        colors = [color for _, _, color in engines]
        ax = row[1]
        tput = [mx["median"][e]["throughput_tok_s"] for e, _, _ in engines]
        bars = ax.bar(labels, tput, color=colors)
        for bar, (e, _, _) in zip(bars, engines):
            ax.annotate(
                f"{mx['median'][e]['computed_over_requested']:.2f}x positions",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=9,
            )
        ax.set(
            ylabel="generated tokens / s",
            title=f"{name}: mixed workload, batch {mx['batch_size']}: throughput\n"
            "(label: computed / requested token positions)",
        )
        ax.margins(y=0.15)
        ax = row[2]
        x = range(len(engines))
        mean = [mx["median"][e]["latency_mean_s"] for e, _, _ in engines]
        p95 = [mx["median"][e]["latency_p95_s"] for e, _, _ in engines]
        ax.bar([i - 0.2 for i in x], mean, width=0.4, color=colors)
        ax.bar([i + 0.2 for i in x], p95, width=0.4, color=colors, alpha=0.45, hatch="//")
        ax.set_xticks(list(x), labels)
        ax.set(ylabel="seconds from submit to last token", title=f"{name}: mixed workload: request latency")
        ax.legend(
            handles=[Patch(color="0.4", label="mean"), Patch(facecolor="0.75", hatch="//", label="p95")]
        )
    machine = result["machine"]
    fig.suptitle(
        f"Static batching benchmark, {machine['device']} ({machine['cpu']}, "
        f"{machine['torch_threads']} threads), "
        f"{machine['dtype']}, median of {result['workload']['runs']} run(s)"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path, dpi=110)

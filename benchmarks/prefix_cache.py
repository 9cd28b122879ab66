"""Step 9's benchmark: prefix caching on a shared-prefix workload and on one that shares nothing.

Poisson arrivals, greedy, ``ignore_eos``: ``shared`` (a 384-token system prompt, then 32 tokens of each
request's own) and ``unique`` (nothing shared); 64 requests of 64 new tokens, 8 per second on the CPU, 2,000
on a GPU. ``step9`` (cache on) and ``step8`` alternate in each run, on new token ids every run. Figures: TTFT,
throughput, hit rate, prefill tokens; on a GPU also ``THROUGHPUT``, the cache's own cost (256 requests at
once, nothing shared, step 9 with it on and off against step 8). Details: benchmarks/README.md.

    OMP_NUM_THREADS=1 python -m benchmarks prefix_cache   # CPU: the demo checkpoint, 3 runs
    python -m benchmarks prefix_cache --device cuda      # GPT-2 124M shapes, random weights, fp16
"""

from __future__ import annotations

import gc
import random
import time
from pathlib import Path

from common.weights import load_config

from .lib import drivers, harness
from .lib.load import poisson
from .lib.models import snapshot
from .lib.workloads import Request

NAME = "prefix_cache"
DEFAULT_MODELS = ["demo"]  # on cuda: gpt2-124m-random (see main)
DEFAULT_RUNS = 3
SHARED_TOKENS, OWN_TOKENS = 384, 32
NUM_REQUESTS = {"cpu": 64, "cuda": 64}
MAX_TOKENS = {"cpu": 64, "cuda": 64}
ARRIVAL_RATE_PER_S = {"cpu": 8.0, "cuda": 2000.0}  # requests per second: more than step 8 keeps up with
MAX_NUM_SEQS = {"cpu": 8, "cuda": 32}
BLOCK_SIZE = 16
ARRIVAL_SEED, TOKEN_SEED = 0, 9000
QUICK = {"num_requests": 8, "max_tokens": 8}
# nothing shared, every request at once: workload -> (prompt tokens, generated tokens); on a GPU only
THROUGHPUT = {"short": (32, 128), "long": (512, 256)}
THROUGHPUT_REQUESTS = 256
# LLM.generate calls of THROUGHPUT_REQUESTS per timed run: a short batch takes about 0.25 s on the H200,
# too short to tell 3 % from the run-to-run spread (0.76-1.19x in 15 runs of one call)
THROUGHPUT_CALLS = {"short": 8, "long": 2}
QUICK_THROUGHPUT = {"short": (8, 8)}  # --quick: 8 requests, on any device
ENGINES = {
    "step9": "step9_prefix_cache.LLMEngine(block_size=16, max_num_seqs=B), prefix caching on (the default)",
    "step8": "step8_async_scheduling.LLMEngine(block_size=16, max_num_seqs=B): every prompt token computed",
}


def workload(kind: str, run: int, vocab_size: int, num_requests: int, max_tokens: int, rate: float) -> list:
    """The requests of one run: ``kind`` "shared" (SHARED_TOKENS common tokens, then OWN_TOKENS of each
    request's own) or "unique" (every prompt its own, the same lengths); Poisson arrivals at ``rate`` per
    second (the same every run, seed ARRIVAL_SEED); token ids drawn from TOKEN_SEED + run, never the
    end-of-text id (the last)."""
    ids = random.Random(TOKEN_SEED + run)
    draw = lambda n: [ids.randrange(vocab_size - 1) for _ in range(n)]  # noqa: E731
    shared = draw(SHARED_TOKENS)
    requests = []
    for i, at in enumerate(poisson(num_requests, rate, ARRIVAL_SEED)):
        prompt = (shared if kind == "shared" else draw(SHARED_TOKENS)) + draw(OWN_TOKENS)
        requests.append(Request(i, prompt, max_tokens, at))
    return requests


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks prefix_cache``)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    models = models or (["gpt2-124m-random"] if kind == "cuda" else DEFAULT_MODELS)
    size = QUICK if quick else {"num_requests": NUM_REQUESTS[kind], "max_tokens": MAX_TOKENS[kind]}
    return run(models, device, 1 if quick else runs, quick=quick, **size)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    num_requests: int = NUM_REQUESTS["cpu"],
    max_tokens: int = MAX_TOKENS["cpu"],
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Both workloads on each model; write ``<out_dir>/prefix_cache-<device>.json`` and ``.png``."""
    started = time.perf_counter()
    kind = "cuda" if device.startswith("cuda") else "cpu"
    dtype = "float16" if kind == "cuda" else "float32"
    rate, max_num_seqs = ARRIVAL_RATE_PER_S[kind], MAX_NUM_SEQS[kind]
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "shared": f"{num_requests} requests: the same {SHARED_TOKENS}-token system prompt, then "
            f"{OWN_TOKENS} tokens of their own; {max_tokens} generated",
            "unique": f"{num_requests} requests of {SHARED_TOKENS + OWN_TOKENS} tokens each their own; "
            f"{max_tokens} generated",
            "arrivals": f"Poisson, {rate} requests/s, random.Random({ARRIVAL_SEED}); the same every run",
            "token_ids": f"uniform over the vocabulary but its last id, random.Random({TOKEN_SEED} + run): "
            "new ones every run (nothing cached across runs), the same for both engines",
            "sampling": "greedy, ignore_eos: every request generates exactly max_tokens",
            "block_size": BLOCK_SIZE,
            "max_num_seqs": max_num_seqs,
            "runs": runs,
            "warmup": "every engine once on the first 8 requests of run -1, at time 0, 4 new tokens, untimed",
            "engines": ENGINES,
            "timing": "time.perf_counter from the start of the run; TTFT from each request's arrival; "
            "engines alternated within each run (order rotated per run); medians over runs; ratios are "
            "medians of per-run ratios",
            "quick": quick,
        },
        "models": {},
    }

    def bench(name: str) -> dict:
        return bench_model(name, device, dtype, runs, num_requests, max_tokens, rate, max_num_seqs)

    harness.run_models(result, models, bench)
    if kind == "cuda" or quick:
        lengths, n = (QUICK_THROUGHPUT, 8) if quick else (THROUGHPUT, THROUGHPUT_REQUESTS)
        result["workload"]["throughput"] = (
            f"{n} requests submitted at once per workload (prompt + generated tokens: {lengths}), "
            f"LLM.generate calls of them per run {THROUGHPUT_CALLS} back to back, greedy, "
            "ignore_eos; every prompt its own, drawn anew every run (nothing shared, nothing cached from "
            "before); LLM.generate timed with the device synchronised; engines alternated, order rotated "
            "per run, after one untimed run each; ratios are medians of per-run ratios"
        )
        for name in models:
            result["models"][name]["throughput"] = throughput(name, device, dtype, runs, n, lengths)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def throughput(name: str, device: str, dtype: str, runs: int, n: int, lengths: dict) -> dict:
    """Step 9 with its cache on and off against step 8 on requests that share nothing (the cost of the
    cache's own bookkeeping): per workload, every run's tok/s, the medians and the ratios. The engines are
    configured as the gpu benchmark's (blocks of 16, ``max_num_seqs`` n, a pool and a token budget that
    admit every request in the first step)."""
    import step8_async_scheduling
    import step9_prefix_cache

    folder = snapshot(name)
    window = load_config(folder).n_positions
    longest = max(p + g for p, g in lengths.values())
    size = dict(
        block_size=BLOCK_SIZE,
        max_num_seqs=n,
        num_kv_blocks=n * -(-longest // BLOCK_SIZE),
        max_num_batched_tokens=max(n * max(p for p, _ in lengths.values()), window),
    )
    modules = {"step9": step9_prefix_cache, "step9_off": step9_prefix_cache, "step8": step8_async_scheduling}
    llms = {
        e: m.LLM(
            model=str(folder),
            device=device,
            dtype=dtype,
            **size,
            **({"enable_prefix_caching": False} if e == "step9_off" else {}),
        )
        for e, m in modules.items()
    }
    vocab = llms["step9"].engine.config.vocab_size
    # the three engines' objects frozen (as step 10 does at start-up): a full collection over them, which
    # lands on whichever engine runs then, would otherwise decide more than the bookkeeping measured here
    gc.collect()
    gc.freeze()
    out = {"config": {**size, "gc": "frozen after the engines were built"}}
    for wname, (prompt_tokens, max_tokens) in lengths.items():
        print(f"  throughput, {wname}: {n} x ({prompt_tokens} + {max_tokens}), nothing shared", flush=True)
        seed = TOKEN_SEED + 1000 * (1 + list(lengths).index(wname))
        repeat = THROUGHPUT_CALLS.get(wname, 1)
        calls = {
            e: unshared_generate(llm, modules[e], vocab, n, prompt_tokens, max_tokens, seed, device, repeat)
            for e, llm in llms.items()
        }
        raw = harness.alternate(calls, runs, warmup=1)
        out[wname] = drivers.compare(
            raw,
            {
                "step9/step8 throughput": ("step9", "step8", "throughput_tok_s"),
                "step9_off/step8 throughput": ("step9_off", "step8", "throughput_tok_s"),
            },
        )
    gc.unfreeze()
    del llms
    harness.free(device)
    return out


def bench_model(
    name: str,
    device: str,
    dtype: str,
    runs: int,
    num_requests: int,
    max_tokens: int,
    rate: float,
    max_num_seqs: int,
) -> dict:
    import step8_async_scheduling
    import step9_prefix_cache as module

    folder = snapshot(name)
    engines = {
        "step9": module.LLMEngine(
            model=str(folder), device=device, dtype=dtype, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs
        ),
        "step8": step8_async_scheduling.LLMEngine(
            model=str(folder), device=device, dtype=dtype, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs
        ),
    }
    vocab = engines["step9"].config.vocab_size
    out = {"snapshot": str(folder), "config": {"n_positions": engines["step9"].config.n_positions}}
    for kind in ("shared", "unique"):
        print(f"  {kind}: {num_requests} requests, {rate}/s", flush=True)
        warm = drivers.warmup_requests(workload(kind, -1, vocab, 8, max_tokens, rate))
        calls = {}
        for engine_name, engine in engines.items():
            mod = module if engine_name == "step9" else step8_async_scheduling  # its own SamplingParams
            drivers.run_step4(engine, mod, warm, device)
            calls[engine_name] = measured(engine, mod, kind, vocab, num_requests, max_tokens, rate, device)
        raw = harness.alternate(calls, runs, warmup=0)
        out[kind] = drivers.compare(
            raw,
            {
                "step8/step9 ttft p50": ("step8", "step9", "ttft_p50_s"),
                "step8/step9 ttft p99": ("step8", "step9", "ttft_p99_s"),
                "step9/step8 throughput": ("step9", "step8", "throughput_tok_s"),
                "step9/step8 prefill tokens": ("step9", "step8", "prefill_tokens_computed"),
            },
        )
    return out


def measured(engine, module, kind: str, vocab: int, num_requests: int, max_tokens: int, rate: float, device):
    """A call that runs the engine's next run of the workload and returns its figures, the prefix cache's
    among them (a counter per engine: run i of both engines draws the same token ids)."""
    count = iter(range(10**6))

    def call() -> dict:
        requests = workload(kind, next(count), vocab, num_requests, max_tokens, rate)
        before = engine.stats
        figures = drivers.summarise(drivers.run_step4(engine, module, requests, device))
        after = engine.stats
        if hasattr(after, "prefix_cache_queries"):
            queries = after.prefix_cache_queries - before.prefix_cache_queries
            hits = after.prefix_cache_hits - before.prefix_cache_hits
        else:  # step 8 has no cache: it computes every prompt token (no preemption in these pools)
            queries, hits = sum(r.prompt_tokens for r in requests), 0
        ttfts = [r["first_token_s"] - r["arrival_s"] for r in figures["requests"]]
        return {
            **figures,
            "ttft_p99_s": harness.percentile(ttfts, 99),
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries,
            "prefill_tokens_computed": queries - hits,
        }

    return call


def unshared_generate(
    llm, module, vocab: int, n: int, prompt_tokens: int, max_tokens: int, seed: int, device, repeat: int = 1
):
    """A call that runs the next run, ``repeat`` back-to-back ``llm.generate`` calls of ``n`` requests,
    and returns its figures: run i (from -1, the warm-up) draws every prompt from random.Random(seed + i),
    alike for every engine."""
    count = iter(range(-1, 10**6))

    def call() -> dict:
        ids = random.Random(seed + next(count))
        batches = [
            [[ids.randrange(vocab - 1) for _ in range(prompt_tokens)] for _ in range(n)]
            for _ in range(repeat)
        ]
        params = module.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        wall, outs = harness.timed(
            lambda: [o for b in batches for o in llm.generate(prompt_token_ids=b, sampling_params=params)],
            device,
        )
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"wall_s": wall, "generated_tokens": generated, "throughput_tok_s": generated / wall}

    return call


FIGURES = [
    ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
    ("ttft_p99_s", "TTFT p99 (ms)", 1e3),
    ("throughput_tok_s", "throughput (tok/s)", 1),
    ("prefill_tokens_computed", "prefill tokens computed", 1),
    ("prefix_cache_hit_rate", "prefix-cache hit rate (%)", 100),
]


def report(result: dict) -> str:
    lines = []
    for name, model in result["models"].items():
        rows = []
        for kind in ("shared", "unique"):
            for engine in ("step9", "step8"):
                m = model[kind]["median"][engine]
                rows.append([kind, engine, *(m[key] * scale for key, _, scale in FIGURES)])
        lines.append(f"{name}:")
        lines.append(harness.table(["workload", "engine", *(label for _, label, _ in FIGURES)], rows))
        shared, unique = model["shared"]["ratios"], model["unique"]["ratios"]
        full = not result["workload"]["quick"]
        lines += [
            harness.target_line(
                "shared: step8 / step9 TTFT p50",
                shared["step8/step9 ttft p50"]["median"],
                ">= 4",
                full_size=full,
            ),
            harness.target_line(
                "shared: step9 / step8 throughput",
                shared["step9/step8 throughput"]["median"],
                ">= 1.5",
                full_size=full,
            ),
            harness.target_line(
                "shared: step9 / step8 prefill tokens",
                shared["step9/step8 prefill tokens"]["median"],
                "<= 0.2",
                full_size=full,
            ),
            harness.target_line(
                "unique: step9 / step8 throughput",
                unique["step9/step8 throughput"]["median"],
                ">= 0.97",
                full_size=full,
            ),
        ]
        for wname, point in model.get("throughput", {}).items():
            if wname == "config":
                continue
            medians, ratios = point["median"], point["ratios"]
            lines.append(
                f"nothing shared, {wname}: tok/s step9 {medians['step9']['throughput_tok_s']:.0f}, "
                f"step9 cache off {medians['step9_off']['throughput_tok_s']:.0f}, "
                f"step8 {medians['step8']['throughput_tok_s']:.0f}"
            )
            lines.append(
                harness.target_line(
                    f"nothing shared, {wname}: step9 / step8 throughput",
                    ratios["step9/step8 throughput"]["median"],
                    ">= 0.97",
                    full_size=full,
                )
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(
        len(models), len(FIGURES), figsize=(4 * len(FIGURES), 4 * len(models)), squeeze=False
    )
    colors = {"step9": "C2", "step8": "C7"}
    for row, (name, model) in zip(axes, models.items()):
        for ax, (key, label, scale) in zip(row, FIGURES):
            for j, engine in enumerate(("step9", "step8")):
                values = [model[kind]["median"][engine][key] * scale for kind in ("shared", "unique")]
                bars = ax.bar([x + 0.4 * j for x in (0, 1)], values, 0.4, color=colors[engine], label=engine)
                ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_xticks([0.2, 1.2], ["shared prefix", "no sharing"])
            ax.set_title(f"{name}: {label}", fontsize=10)
        row[0].legend(fontsize=8)
    machine = result["machine"]
    fig.suptitle(
        f"Prefix caching: step 9 vs step 8, "
        f"{machine['device']}, {machine['dtype']}, median of {result['workload']['runs']} run(s)"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

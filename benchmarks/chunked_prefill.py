"""Step 13's benchmark: what chunked prefill buys the running streams, and what it costs (vs step 12).

(a) a burst of long prompts into running decodes: the running streams' gaps until the burst is prefilled,
its TTFT, tok/s; step 12 and step 13 off at a budget that admits prompts beside the decodes, step 13 on at
several budgets. (b) Poisson arrivals of long prompts into a steady batch: ITL against none. (c)
``LLM.generate`` throughput at each step's defaults, alternated. Engines stepped in process; random ids.

    python -m benchmarks chunked_prefill --device cuda    # GPT-2 124M shapes, fp16 (the recorded run)
    OMP_NUM_THREADS=1 python -m benchmarks chunked_prefill  # CPU, the demo, fp32, smaller sizes (~3.5 min)
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from pathlib import Path

from common.weights import load_config

from .lib import harness
from .lib.models import snapshot

NAME = "chunked_prefill"
DEFAULT_MODELS = ["gpt2-124m-random"]  # on a CPU: the demo (see main)
DEFAULT_RUNS = 3
BLOCK_SIZE = 16
TOKEN_ID_SEED = 13000  # prompts: random.Random(TOKEN_ID_SEED + run), new every run
ARRIVAL_SEED = 1300  # Poisson arrival times: random.Random(ARRIVAL_SEED + rate index), the same every run
GAP_TARGET_MS = 3.0  # (a): no running stream's gap above this with chunking
PREFILL_TARGET = 1.5  # (a): the burst fully prefilled within this x step 12's time
ITL_P99_TARGET, ITL_P50_TARGET = 2.0, 1.10  # (b): against the steady batch's
RATIO_TARGET = 0.97  # (c): step 13 / step 12 tok/s
# running: (streams, prompt, max_tokens, tokens each before the burst); burst: (requests, prompt,
# max_tokens); budgets: step 13's with chunking; off_budget: step 12's and step 13's with chunking off
SIZES = {
    "cuda": {
        "burst": {
            "running": (256, 32, 512, 32),
            "burst": (64, 1000, 16),
            "budgets": [512, 1024, 2048],
            "off_budget": 4096,
        },
        "poisson": {
            "running": (128, 32, 960, 32),
            "arrival": (1000, 16),
            "rates": [5, 20, 50],
            "span_s": 2.0,
            "off_budget": 4096,
        },
        "generate": {"256x(32+128)": (256, 32, 128), "256x(512+256)": (256, 512, 256)},
    },
    "cpu": {
        "burst": {
            "running": (16, 16, 256, 8),
            "burst": (4, 400, 8),
            "budgets": [128, 256, 512],
            "off_budget": 2048,
        },
        "poisson": {
            "running": (16, 16, 400, 8),
            "arrival": (400, 8),
            "rates": [0.5, 1, 2],
            "span_s": 6.0,
            "off_budget": 2048,
        },
        "generate": {"16x(16+32)": (16, 16, 32), "16x(256+32)": (16, 256, 32)},
    },
    "quick": {
        "burst": {"running": (4, 8, 32, 2), "burst": (2, 48, 2), "budgets": [16, 32], "off_budget": 512},
        "poisson": {
            "running": (4, 8, 120, 2),
            "arrival": (48, 2),
            "rates": [10],
            "span_s": 0.3,
            "off_budget": 512,
        },
        "generate": {"4x(8+4)": (4, 8, 4)},
    },
}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks chunked_prefill``)."""
    cuda = device.startswith("cuda")
    models = models or (DEFAULT_MODELS if cuda and not quick else ["demo"])
    kind = "quick" if quick else "cuda" if cuda else "cpu"
    return run(models, device, 1 if quick else runs, SIZES[kind], quick=quick)


def run(
    models: list[str],
    device: str,
    runs: int,
    sizes: dict,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """The three parts on each model; write ``<out_dir>/chunked_prefill-<device>.json`` and ``.png``."""
    started = time.perf_counter()
    dtype = "float16" if device.startswith("cuda") else "float32"
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "sizes": sizes,
            "full_size": sizes is SIZES["cuda"],
            "engines": {
                "step12": "step12_quantized_kv.LLMEngine at max_num_batched_tokens = off_budget: its default "
                "(the context window) cannot admit a long prompt beside the running decodes (1,024 - 256 < "
                "1,000 on GPT-2 shapes), so it runs at a budget that can",
                "step13_off": "step13_chunked_prefill.LLMEngine, enable_chunked_prefill=False, the same "
                "budget",
                "step13_<budget>": "step13_chunked_prefill.LLMEngine, chunked prefill on at that budget",
                "step13": "(b), (c): step 13 at its default budget (2,048 on CUDA, 512 on a CPU)",
            },
            "burst": "(a): the running streams decode to their steady count, then the burst is added at "
            "once; gaps: every running stream's inter-token gaps that overlap [the burst's arrival, its "
            "last first token]; TTFT from each burst request's arrival; tok/s: every token from the "
            "arrival until the burst has finished, over that span; then the running streams are "
            "aborted. One engine at a time (a pool that holds every request: no preemption), its runs "
            "back to back",
            "poisson": "(b): the running streams decode to their steady count, then arrivals at "
            f"random.Random({ARRIVAL_SEED} + rate index) exponential gaps over span_s (the same times every "
            "run and engine); ITL: the running streams' gaps inside the span; tok/s: every token of the "
            "span; rate 0 is the steady baseline; every (engine, rate) once per run, the order rotated",
            "generate": "(c): LLM.generate of every request at once, greedy, ignore_eos, each step at its "
            "defaults (budget, async scheduling, graphs) with max_num_seqs = the requests and a pool "
            "that holds them; alternated (harness.alternate, one warm-up run each); eager share: step "
            "13's num_eager_steps / num_steps over a run",
            "prompts": f"uniform over the vocabulary but its last id, random.Random({TOKEN_ID_SEED} + run)",
            "warm_up": "every engine: one generate of a long and a few short requests before timing",
            "gc": "gc.freeze() once an engine is built: a collection would land on whichever step runs",
            "runs": runs,
            "quick": quick,
        },
        "models": {},
    }
    harness.run_models(result, models, lambda name: bench_model(name, device, dtype, runs, sizes))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(name: str, device: str, dtype: str, runs: int, sizes: dict) -> dict:
    import step12_quantized_kv as step12
    import step13_chunked_prefill as step13

    folder = str(snapshot(name))
    config = load_config(folder)
    out = {"snapshot": folder, "context_window": config.n_positions}
    out["burst"] = burst_part(folder, config, step12, step13, device, dtype, runs, sizes["burst"])
    out["poisson"] = poisson_part(folder, config, step12, step13, device, dtype, runs, sizes["poisson"])
    out["generate"] = {
        point: generate_point(folder, config, step12, step13, device, dtype, runs, *size)
        for point, size in sizes["generate"].items()
    }
    return out


# ---- engines -----------------------------------------------------------------------------------------------


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def prompts(run: int, count: int, length: int, vocab_size: int, salt: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` ids from random.Random(TOKEN_ID_SEED + run) (run -1: the warm-up;
    ``salt`` tells two sets of one run apart), never the last id (GPT-2's end of text)."""
    ids = random.Random(TOKEN_ID_SEED + run + 100_000 * salt)
    return [[ids.randrange(vocab_size - 1) for _ in range(length)] for _ in range(count)]


def engine_specs(step12, step13, budgets: list[int] | None, off_budget: int) -> dict:
    """name -> (module, extra engine arguments): step 12 and step 13 off at ``off_budget``, step 13 with
    chunking at each budget (None: ``step13`` at its default)."""
    specs = {
        "step12": (step12, {"max_num_batched_tokens": off_budget}),
        "step13_off": (step13, {"max_num_batched_tokens": off_budget, "enable_chunked_prefill": False}),
    }
    if budgets is None:
        return {"step12": specs["step12"], "step13": (step13, {})}
    return specs | {f"step13_{b}": (step13, {"max_num_batched_tokens": b}) for b in budgets}


def drain(engine) -> None:
    """Step until nothing is left (aborted requests' last outputs, a step in flight)."""
    while engine.has_unfinished_requests():
        engine.step()


def warm_up(engine, module, vocab_size: int, long_prompt: int) -> None:
    """One small generate: a prompt of ``long_prompt`` tokens and three short ones, 4 new tokens each."""
    params = module.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(-1, 1, long_prompt, vocab_size) + prompts(-1, 3, 8, vocab_size, salt=1)):
        engine.add_request(f"warm{i}", p, params)
    drain(engine)


@contextlib.contextmanager
def frozen_gc():
    """The objects made so far (the engine's) out of the collector's reach while measuring."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def add(engine, module, request_id: str, prompt: list[int], max_tokens: int):
    """Add one request; returns its Sequence (the engine drops it when it finishes)."""
    params = module.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    return engine.requests[request_id]


def start_running(engine, module, run: int, vocab_size: int, running: tuple) -> list:
    """Add the running streams and step until each has its steady count of tokens. Returns them."""
    streams, prompt_len, max_tokens, steady = running
    seqs = [
        add(engine, module, f"r{i}", p, max_tokens)
        for i, p in enumerate(prompts(run, streams, prompt_len, vocab_size))
    ]
    while min(len(s.metrics.token_times) for s in seqs) < steady:
        engine.step()
    return seqs


def abort_all(engine) -> None:
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    drain(engine)


def steps_counted(engine) -> tuple[int | None, int | None]:
    """(steps, of them eager) since the engine started: step 13's counters; (None, None) for step 12."""
    stats = engine.stats
    return getattr(stats, "num_steps", None), getattr(stats, "num_eager_steps", None)


def eager_share(before: tuple, after: tuple) -> float | None:
    if before[0] is None or after[0] == before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def ms(values: list[float], q: float) -> float | None:
    p = harness.percentile(values, q)
    return None if p is None else 1e3 * p


# ---- (a) a burst of long prompts into a running batch ------------------------------------------------------


def burst_part(folder, config, step12, step13, device, dtype, runs, sizes) -> dict:
    """Each engine in turn (built, warmed up, ``runs`` runs, freed): see ``burst_run``."""
    (streams, prompt_len, max_tokens, _), (n_burst, burst_len, burst_tokens) = (
        sizes["running"],
        sizes["burst"],
    )
    out = {"engines": {}, "off_budget": sizes["off_budget"]}
    for name, (module, extra) in engine_specs(step12, step13, sizes["budgets"], sizes["off_budget"]).items():
        engine = module.LLMEngine(
            model=folder,
            device=device,
            dtype=dtype,
            block_size=BLOCK_SIZE,
            max_num_seqs=streams + n_burst,
            num_kv_blocks=streams * blocks_for(prompt_len + max_tokens)
            + n_burst * blocks_for(burst_len + burst_tokens),
            **extra,
        )
        warm_up(engine, module, config.vocab_size, burst_len)
        with frozen_gc():
            per_run = [burst_run(engine, module, run, config.vocab_size, sizes) for run in range(runs)]
        out["engines"][name] = {
            "max_num_batched_tokens": engine.args.max_num_batched_tokens,
            "num_preemptions": engine.stats.num_preemptions,
            "runs": per_run,
            "median": harness.medians(per_run),
        }
        m = out["engines"][name]["median"]
        print(
            f"  burst {name}: running gaps p99 {m['gap_p99_ms']:.1f} ms, max {m['gap_max_ms']:.1f} ms; "
            f"fully prefilled in {m['prefilled_ms']:.0f} ms",
            flush=True,
        )
        del engine
        harness.free(device)
    step12_ms = out["engines"]["step12"]["median"]["prefilled_ms"]
    for e in out["engines"].values():
        e["prefilled_vs_step12"] = e["median"]["prefilled_ms"] / step12_ms
    return out


def burst_run(engine, module, run: int, vocab_size: int, sizes: dict) -> dict:
    """One run: the running streams to steady decoding, the burst at once, step until the burst has
    finished; the figures of the module's docstring (ms, tok/s)."""
    n_burst, burst_len, burst_tokens = sizes["burst"]
    running = start_running(engine, module, run, vocab_size, sizes["running"])
    new = prompts(run, n_burst, burst_len, vocab_size, salt=1)  # made before the clock starts
    before = steps_counted(engine)
    arrival = time.perf_counter()
    burst = [add(engine, module, f"b{i}", p, burst_tokens) for i, p in enumerate(new)]
    while any(not s.metrics.token_times for s in burst):
        engine.step()
    prefilled = max(s.metrics.token_times[0] for s in burst)
    after_prefill = steps_counted(engine)
    while any(not s.finished for s in burst):
        engine.step()
    end = max(s.metrics.token_times[-1] for s in burst)
    abort_all(engine)
    gaps = [
        b - a
        for s in running
        for a, b in zip(s.metrics.token_times, s.metrics.token_times[1:])
        if b > arrival and a < prefilled
    ]
    ttfts = [s.metrics.token_times[0] - s.metrics.arrival_time for s in burst]
    tokens = sum(arrival < t <= end for s in running + burst for t in s.metrics.token_times)
    return {
        "gap_p50_ms": ms(gaps, 50),
        "gap_p99_ms": ms(gaps, 99),
        "gap_max_ms": 1e3 * max(gaps),
        "gaps": len(gaps),
        "burst_ttft_p50_ms": ms(ttfts, 50),
        "burst_ttft_p99_ms": ms(ttfts, 99),
        "prefilled_ms": 1e3 * (prefilled - arrival),
        "tok_per_s": tokens / (end - arrival),
        "steps_to_prefill": None if before[0] is None else after_prefill[0] - before[0],
        "eager_share": eager_share(before, steps_counted(engine)),
    }


# ---- (b) Poisson arrivals into a steady batch --------------------------------------------------------------


def arrival_times(rate: float, span_s: float, index: int) -> list[float]:
    """Seconds from the span's start of a Poisson process of ``rate`` per second (exponential gaps from
    random.Random(ARRIVAL_SEED + index)), up to ``span_s``; none for rate 0."""
    if rate == 0:
        return []
    gen, times, t = random.Random(ARRIVAL_SEED + index), [], 0.0
    while (t := t + gen.expovariate(rate)) < span_s:
        times.append(t)
    return times


def poisson_part(folder, config, step12, step13, device, dtype, runs, sizes) -> dict:
    """Step 12 (at ``off_budget``) and step 13 (its default budget), both built at once and warmed up; each
    run measures every (engine, rate) once, the order rotated per run (harness.alternate), so that a slow
    phase of the machine falls on no one rate; rate 0 is the steady batch."""
    streams, prompt_len, max_tokens, _ = sizes["running"]
    arrival_len, arrival_tokens = sizes["arrival"]
    rates = [0, *sizes["rates"]]
    schedules = {rate: arrival_times(rate, sizes["span_s"], i) for i, rate in enumerate(rates)}
    most = max(len(s) for s in schedules.values())
    engines = {}
    for name, (module, extra) in engine_specs(step12, step13, None, sizes["off_budget"]).items():
        engine = module.LLMEngine(
            model=folder,
            device=device,
            dtype=dtype,
            block_size=BLOCK_SIZE,
            max_num_seqs=streams + most,
            num_kv_blocks=streams * blocks_for(prompt_len + max_tokens)
            + most * blocks_for(arrival_len + arrival_tokens),
            **extra,
        )
        warm_up(engine, module, config.vocab_size, arrival_len)
        engines[name] = (engine, module)
    out = {
        "budgets": {name: e.args.max_num_batched_tokens for name, (e, _) in engines.items()},
        "arrivals": {str(rate): len(s) for rate, s in schedules.items()},
        "points": {},
    }
    calls = {}  # "<engine>@<rate>": every rate of every engine in each run, the order rotated per run
    for rate in rates:
        for name, (engine, module) in engines.items():
            count = iter(range(10**6))
            calls[f"{name}@{rate}"] = lambda e=engine, m=module, c=count, s=schedules[rate]: poisson_run(
                e, m, next(c), config.vocab_size, sizes, s
            )
    with frozen_gc():
        raw = harness.alternate(calls, runs, warmup=0)
    for rate in rates:
        per_engine = {name: raw[f"{name}@{rate}"] for name in engines}
        point = {"runs": per_engine, "median": {n: harness.medians(r) for n, r in per_engine.items()}}
        out["points"][str(rate)] = point
        line = ", ".join(
            f"{n} ITL p50 {m['itl_p50_ms']:.1f} p99 {m['itl_p99_ms']:.1f} ms"
            for n, m in point["median"].items()
        )
        print(f"  poisson {rate}/s: {line}", flush=True)
    steady = out["points"]["0"]["median"]
    for point in out["points"].values():
        point["vs_steady"] = {
            n: {
                "itl_p50": m["itl_p50_ms"] / steady[n]["itl_p50_ms"],
                "itl_p99": m["itl_p99_ms"] / steady[n]["itl_p99_ms"],
            }
            for n, m in point["median"].items()
        }
    engines.clear()
    harness.free(device)
    return out


def poisson_run(engine, module, run: int, vocab_size: int, sizes: dict, schedule: list[float]) -> dict:
    """One run: the running streams to steady decoding, then the arrivals of ``schedule`` added as their
    times pass, stepping, for span_s (less if a running stream finishes first); then everything aborted."""
    arrival_len, arrival_tokens = sizes["arrival"]
    running = start_running(engine, module, run, vocab_size, sizes["running"])
    new = prompts(run, len(schedule), arrival_len, vocab_size, salt=1)
    arrived = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < sizes["span_s"] and not any(s.finished for s in running):
        while len(arrived) < len(schedule) and start + schedule[len(arrived)] <= now:
            i = len(arrived)
            arrived.append(add(engine, module, f"a{i}", new[i], arrival_tokens))
        engine.step()
    end = time.perf_counter()
    abort_all(engine)
    itls = [
        b - a
        for s in running
        for a, b in zip(s.metrics.token_times, s.metrics.token_times[1:])
        if a >= start and b <= end
    ]
    ttfts = [s.metrics.token_times[0] - s.metrics.arrival_time for s in arrived if s.metrics.token_times]
    tokens = sum(start < t <= end for s in running + arrived for t in s.metrics.token_times)
    return {
        "itl_p50_ms": ms(itls, 50),
        "itl_p99_ms": ms(itls, 99),
        "itl_max_ms": 1e3 * max(itls),
        "tok_per_s": tokens / (end - start),
        "span_s": end - start,
        "arrived": len(arrived),
        "arrived_ttft_p50_ms": ms(ttfts, 50),
        "arrived_without_token": len(arrived) - len(ttfts),
    }


# ---- (c) LLM.generate throughput ---------------------------------------------------------------------------


def generate_point(folder, config, step12, step13, device, dtype, runs, requests, prompt_len, max_tokens):
    """Step 12 and step 13 at their defaults through ``LLM.generate``, alternated: tok/s and the ratio."""
    size = dict(
        block_size=BLOCK_SIZE,
        max_num_seqs=requests,
        num_kv_blocks=requests * blocks_for(prompt_len + max_tokens),
    )
    llms = {
        name: module.LLM(model=folder, device=device, dtype=dtype, **size)
        for name, module in (("step12", step12), ("step13", step13))
    }
    modules = {"step12": step12, "step13": step13}

    def call(name: str):
        count = iter(range(-1, 10**6))
        params = modules[name].SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm = llms[name]

        def measured() -> dict:
            batch = prompts(next(count), requests, prompt_len, config.vocab_size)
            before = steps_counted(llm)
            wall, outs = harness.timed(
                lambda: llm.generate(prompt_token_ids=batch, sampling_params=params), device
            )
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            return {
                "tok_per_s": tokens / wall,
                "wall_s": wall,
                "eager_share": eager_share(before, steps_counted(llm)),
            }

        return measured

    with frozen_gc():
        raw = harness.alternate({name: call(name) for name in llms}, runs)
    out = {
        "requests": requests,
        "prompt": prompt_len,
        "max_tokens": max_tokens,
        "budgets": {name: llm.engine.args.max_num_batched_tokens for name, llm in llms.items()},
        "runs": raw,
        "median": {name: harness.medians(r) for name, r in raw.items()},
        "ratio": harness.ratio(raw["step13"], raw["step12"], "tok_per_s"),
    }
    for llm in llms.values():
        llm.engine_core.shutdown()
    llms.clear()
    harness.free(device)
    print(
        f"  generate {requests}x({prompt_len}+{max_tokens}): step13/step12 {out['ratio']['median']:.3f}",
        flush=True,
    )
    return out


# ---- report and plot ---------------------------------------------------------------------------------------


def chunked(name: str) -> bool:
    return name.startswith("step13_") and name != "step13_off"


def report(result: dict) -> str:
    lines = []
    full = result["workload"]["full_size"] and not result["workload"]["quick"]
    for model_name, model in result["models"].items():
        burst = model["burst"]
        (streams, p, g, _), (n, bl, bt) = (
            result["workload"]["sizes"]["burst"][k] for k in ("running", "burst")
        )
        rows = [
            [
                name,
                e["max_num_batched_tokens"],
                e["median"]["gap_p50_ms"],
                e["median"]["gap_p99_ms"],
                e["median"]["gap_max_ms"],
                e["median"]["burst_ttft_p50_ms"],
                e["median"]["burst_ttft_p99_ms"],
                e["median"]["prefilled_ms"],
                f"{e['prefilled_vs_step12']:.2f}x",
                e["median"]["tok_per_s"],
                e["median"].get("eager_share"),
                e["num_preemptions"],
            ]
            for name, e in burst["engines"].items()
        ]
        headers = ["engine", "budget", "gap p50", "p99", "max", "TTFT p50", "p99", "prefilled", "vs 12"]
        lines += [
            f"{model_name} ({result['machine']['device']}, {result['machine']['dtype']}): (a) {streams} "
            f"running ({p} + {g}), a burst of {n} x ({bl} + {bt}); ms, medians of "
            f"{result['workload']['runs']} runs",
            harness.table([*headers, "tok/s", "eager", "preempt."], rows),
        ]
        for name, e in burst["engines"].items():
            if chunked(name):
                lines.append(
                    harness.target_line(
                        f"{name}: largest running gap",
                        e["median"]["gap_max_ms"],
                        f"<= {GAP_TARGET_MS}",
                        " ms",
                        full,
                    )
                )
                lines.append(
                    harness.target_line(
                        f"{name}: fully prefilled vs step 12",
                        e["prefilled_vs_step12"],
                        f"<= {PREFILL_TARGET}",
                        "x",
                        full,
                    )
                )
        poisson = model["poisson"]
        rows = []
        for rate, point in poisson["points"].items():
            for name, m in point["median"].items():
                v = point["vs_steady"][name]
                rows.append(
                    [
                        rate,
                        name,
                        poisson["budgets"][name],
                        poisson["arrivals"][rate],
                        m["itl_p50_ms"],
                        m["itl_p99_ms"],
                        m["itl_max_ms"],
                        f"{v['itl_p50']:.2f}x",
                        f"{v['itl_p99']:.2f}x",
                        m["tok_per_s"],
                        m["span_s"],
                    ]
                )
        sizes = result["workload"]["sizes"]["poisson"]
        streams, p, g, _ = sizes["running"]
        lines += [
            "",
            f"(b) {streams} steady streams ({p} + {g}), Poisson arrivals of {sizes['arrival'][0]} + "
            f"{sizes['arrival'][1]} over {sizes['span_s']} s (rate 0: steady; a span ends early if a steady "
            "stream finishes); ITL ms",
            harness.table(
                [
                    "rate/s",
                    "engine",
                    "budget",
                    "arrivals",
                    "p50",
                    "p99",
                    "max",
                    "p50/steady",
                    "p99/steady",
                    "tok/s",
                    "span s",
                ],
                rows,
            ),
        ]
        for rate, point in poisson["points"].items():
            if rate != "0":
                v = point["vs_steady"]["step13"]
                lines.append(
                    harness.target_line(
                        f"step13 at {rate}/s: ITL p99 / steady",
                        v["itl_p99"],
                        f"<= {ITL_P99_TARGET}",
                        "x",
                        full,
                    )
                )
                lines.append(
                    harness.target_line(
                        f"step13 at {rate}/s: ITL p50 / steady",
                        v["itl_p50"],
                        f"<= {ITL_P50_TARGET}",
                        "x",
                        full,
                    )
                )
        rows = [
            [
                point,
                g["median"]["step12"]["tok_per_s"],
                g["median"]["step13"]["tok_per_s"],
                g["ratio"]["median"],
                g["median"]["step13"].get("eager_share"),
                f"{g['budgets']['step12']} / {g['budgets']['step13']}",
            ]
            for point, g in model["generate"].items()
        ]
        lines += [
            "",
            "(c) LLM.generate at each step's defaults (tok/s)",
            harness.table(["workload", "step12", "step13", "13/12", "13 eager", "budgets 12 / 13"], rows),
        ]
        for point, g in model["generate"].items():
            lines.append(
                harness.target_line(
                    f"{point}: step13 / step12", g["ratio"]["median"], f">= {RATIO_TARGET}", "x", full
                )
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: (a) the running streams' p99 and largest gap per engine, with the 3 ms line; the burst's
    fully-prefilled time; (b) ITL p50 / p99 against the arrival rate, with each engine's steady p99; (c) the
    step 13 / step 12 ratios, with the 0.97 line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(len(models), 4, figsize=(20, 4.5 * len(models)), squeeze=False)
    for row, (model_name, model) in zip(axes, models.items()):
        engines = model["burst"]["engines"]
        names = list(engines)
        x = range(len(names))
        labels = [n.replace("step13_", "13 ").replace("step12", "12") for n in names]
        width = 0.4
        row[0].bar(
            [i - width / 2 for i in x],
            [engines[n]["median"]["gap_p99_ms"] for n in names],
            width,
            label="p99",
        )
        row[0].bar(
            [i + width / 2 for i in x],
            [engines[n]["median"]["gap_max_ms"] for n in names],
            width,
            label="largest",
        )
        row[0].axhline(GAP_TARGET_MS, color="C3", ls="--", lw=1, label=f"{GAP_TARGET_MS:g} ms")
        row[0].set_yscale("log")
        row[0].set_xticks(list(x), labels, fontsize=8)
        row[0].set_ylabel("running streams' gap (ms)")
        row[0].set_title(f"{model_name}: (a) gaps while the burst is prefilled", fontsize=9)
        row[0].legend(fontsize=8)
        bars = row[1].bar(list(x), [engines[n]["median"]["prefilled_ms"] for n in names])
        row[1].bar_label(
            bars, labels=[f"{engines[n]['prefilled_vs_step12']:.2f}x" for n in names], fontsize=7
        )
        row[1].set_xticks(list(x), labels, fontsize=8)
        row[1].set_ylabel("ms")
        row[1].set_title("(a) burst fully prefilled (label: vs step 12)", fontsize=9)
        points = model["poisson"]["points"]
        rates = list(points)  # "0" first: the steady batch
        for i, name in enumerate(points["0"]["median"]):
            color = f"C{i}"
            for q, style in (("itl_p50_ms", "o--"), ("itl_p99_ms", "o-")):
                row[2].plot(
                    [float(r) for r in rates],
                    [points[r]["median"][name][q] for r in rates],
                    style,
                    color=color,
                    label=f"{name} {q[4:7]}",
                )
            row[2].axhline(
                points["0"]["median"][name]["itl_p99_ms"],
                color=color,
                ls=":",
                lw=1,
                label=f"{name} steady p99",
            )
        row[2].set_xlabel("arrivals per second (0: steady)")
        row[2].set_ylabel("ITL (ms)")
        row[2].set_title("(b) steady streams' ITL under Poisson arrivals", fontsize=9)
        row[2].legend(fontsize=7)
        gen = model["generate"]
        bars = row[3].bar(list(gen), [g["ratio"]["median"] for g in gen.values()])
        row[3].bar_label(bars, fmt="%.3f", fontsize=8)
        row[3].axhline(RATIO_TARGET, color="C3", ls="--", lw=1)
        row[3].set_ylim(0, max(1.2, *(g["ratio"]["median"] * 1.1 for g in gen.values())))
        row[3].set_ylabel("step 13 / step 12 tok/s")
        row[3].set_title("(c) LLM.generate at the defaults", fontsize=9)
    fig.suptitle(
        f"{result['machine']['device']} ({result['machine'].get('gpu') or result['machine']['cpu']}), "
        f"{result['machine']['dtype']}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

"""Step 6's benchmark: what the HTTP server costs on top of the engine it serves.

The same ``mixed`` requests go to the same engine two ways, alternated within each run: ``in_process``
(``step6_server.LLMEngine`` stepped in a thread of this process) and ``http`` (``python -m step6_server`` in
a subprocess, one streaming ``POST /v1/completions`` per request from httpx); greedy, so each text must come
out the same both ways. a. 16 concurrent streams: throughput; b. Poisson arrivals at fractions of the
in-process capacity: throughput, TTFT, ITL. Details and the JSON layout: benchmarks/README.md.

    python -m benchmarks server_overhead                 # demo, 3 runs
    python -m benchmarks server_overhead --quick         # 1 run, fewer and shorter requests
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from .lib import harness, workloads
from .lib.load import ServerProcess, in_thread, poisson, run_http, run_in_process, summarise
from .lib.models import snapshot

NAME = "server_overhead"
DEFAULT_MODELS = ["demo"]
DEFAULT_RUNS = 3
MAX_NUM_SEQS = 16
STREAMS = 16  # the fixed-concurrency point: 16 streams in flight
CONCURRENCY_REQUESTS = 48  # the first 48 mixed requests (three rounds of 16 on average)
LOADS = [0.25, 0.5, 0.75]  # Poisson arrival rates as fractions of the in-process capacity at 16 streams
ARRIVAL_REQUESTS = 32  # the first 32 mixed requests for the Poisson points
ARRIVAL_SEED = 6
BLOCK_SIZE = 16
WARMUP_TOKENS = 4
# --quick: 16 and 12 requests, prompts <= 64 tokens, max_tokens <= 32, one Poisson point
QUICK = {"requests": 16, "arrival_requests": 12, "max_prompt_tokens": 64, "max_tokens": 32, "loads": [0.5]}
TARGET = ">= 0.9"
ENGINES = {
    "in_process": f"step6_server.LLMEngine(max_num_seqs={MAX_NUM_SEQS}, block_size={BLOCK_SIZE}, float32; "
    "other arguments: their defaults), add_request as requests arrive, step() while busy, in a thread of "
    "its own; outputs as DELTA",
    "http": f"python -m step6_server --max-num-seqs {MAX_NUM_SEQS} --block-size {BLOCK_SIZE} (the same "
    "engine) in a subprocess; httpx.AsyncClient in this process, one streaming POST /v1/completions per "
    "request (prompt as token ids, temperature 0, ignore_eos, stream_options.include_usage)",
}


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """The CLI entry (``python -m benchmarks server_overhead``): the full or quick workloads on each model."""
    mixed = workloads.load("mixed")
    if quick:
        caps = (QUICK["max_prompt_tokens"], QUICK["max_tokens"])
        return run(
            models or DEFAULT_MODELS,
            device,
            1,
            workloads.take(mixed, QUICK["requests"], *caps),
            workloads.take(mixed, QUICK["arrival_requests"], *caps),
            QUICK["loads"],
            quick=True,
            out_dir=out_dir,
        )
    return run(
        models or DEFAULT_MODELS,
        device,
        runs,
        workloads.take(mixed, CONCURRENCY_REQUESTS),
        workloads.take(mixed, ARRIVAL_REQUESTS),
        LOADS,
        out_dir=out_dir,
    )


def run(
    models: list[str],
    device: str,
    runs: int,
    concurrency_workload: dict,
    arrival_workload: dict,
    loads: list[float],
    streams: int = STREAMS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Measure every model; write ``<out_dir>/server-<device>.json`` and ``.png``; return the result.

    concurrency_workload: the requests of the fixed-concurrency point, ``streams`` in flight at a time.
    arrival_workload: the requests of the Poisson points (their own arrival times are replaced). loads: the
    Poisson rates as fractions of the in-process capacity measured at the fixed concurrency.
    """
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": {**harness.machine_info(device, "float32"), "load_average_start": os.getloadavg()},
        "workload": {
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "runs": runs,
            "quick": quick,
            "max_num_seqs": MAX_NUM_SEQS,
            "block_size": BLOCK_SIZE,
            "concurrency": {
                "streams": streams,
                "summary": workloads.summary(concurrency_workload),
                "workload": concurrency_workload,
            },
            "arrivals": {
                "loads": loads,
                "seed": ARRIVAL_SEED,
                "summary": workloads.summary(arrival_workload),
                "workload": arrival_workload,
                "process": "Poisson at load x the in-process requests/s at the fixed concurrency: the first "
                "request at 0 s, then gaps random.Random(seed).expovariate(rate)",
            },
            "engines": ENGINES,
            "warmup": f"before each point, each engine once on the point's first {streams} requests with at "
            f"most {WARMUP_TOKENS} new tokens, all at once, untimed",
            "timing": "time.perf_counter in this process, from the start of the load; TTFT and latency from "
            "each request's own arrival (at the fixed concurrency: when it was sent); ITL = gaps between a "
            "request's outputs (in-process: engine outputs; HTTP: SSE events); engines alternated within "
            "each run (order rotated per run); medians over runs; ratios are medians of per-run ratios",
            "outside_engine": "1 - in_process wall / http wall, run by run: the share of the HTTP run's time "
            "that the engine's own work on the same requests does not explain",
        },
        "models": {},
    }
    harness.run_models(
        result,
        models,
        lambda name: bench_model(name, device, runs, concurrency_workload, arrival_workload, loads, streams),
    )
    result["machine"]["load_average_end"] = os.getloadavg()
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str,
    device: str,
    runs: int,
    concurrency_workload: dict,
    arrival_workload: dict,
    loads: list[float],
    streams: int,
) -> dict:
    """Both points on one model: the engine in this process and the server in a subprocess, alternated."""
    import step6_server

    folder = snapshot(name)
    engine = step6_server.LLMEngine(
        model=str(folder), device=device, dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS
    )
    config = engine.config
    conc_reqs = workloads.requests(concurrency_workload, config.vocab_size, config.n_positions)
    arr_reqs = workloads.requests(arrival_workload, config.vocab_size, config.n_positions)
    fields = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    out: dict = {"snapshot": str(folder), "config": {k: getattr(config, k) for k in fields}}
    with ServerProcess(folder, device, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE) as url:

        def engines(requests, arrivals=None, concurrency=None) -> dict:
            return {
                "in_process": lambda: in_thread(
                    run_in_process, engine, step6_server, requests, arrivals, concurrency
                ),
                "http": lambda: asyncio.run(run_http(url, requests, arrivals, concurrency)),
            }

        def measure(requests, arrivals=None, concurrency=None) -> dict:
            warm = [
                workloads.Request(r.index, r.prompt_token_ids, min(r.max_tokens, WARMUP_TOKENS))
                for r in requests[:streams]
            ]
            for call in engines(warm, None, streams).values():
                call()
            raw = harness.alternate(engines(requests, arrivals, concurrency), runs, warmup=0)
            same = [same_texts(h, i) for i, h in zip(raw["in_process"], raw["http"])]
            runs_out = {e: [summarise(r) for r in rs] for e, rs in raw.items()}
            i_runs, h_runs = runs_out["in_process"], runs_out["http"]

            def per_run(values: list[float]) -> dict:
                return {"per_run": values, "median": harness.median(values)}

            return {
                "runs": runs_out,
                "median": {e: harness.medians(rs) for e, rs in runs_out.items()},
                "ratios": {
                    "http/in_process throughput": harness.ratio(h_runs, i_runs, "throughput_tok_s"),
                    "outside engine share": per_run(
                        [1 - i["wall_s"] / h["wall_s"] for i, h in zip(i_runs, h_runs)]
                    ),
                    "http-in_process ttft p50 s": per_run(
                        [h["ttft_p50_s"] - i["ttft_p50_s"] for i, h in zip(i_runs, h_runs)]
                    ),
                },
                "http_text_equals_in_process": {"per_run": same, "requests": len(requests)},
            }

        print(f"  {streams} concurrent streams: {len(conc_reqs)} mixed requests", flush=True)
        point = measure(conc_reqs, concurrency=streams)
        print_point(point)
        out["concurrency"] = {"streams": streams, **point}
        capacity = point["median"]["in_process"]["requests_per_s"]
        out["capacity_requests_per_s"] = capacity
        out["arrivals"] = []
        for load in loads:
            rate = load * capacity
            arrivals = poisson(len(arr_reqs), rate, ARRIVAL_SEED)
            print(
                f"  Poisson arrivals at {rate:.2f} requests/s ({load:.0%} of capacity): "
                f"{len(arr_reqs)} requests over {arrivals[-1]:.1f} s",
                flush=True,
            )
            p = measure(arr_reqs, arrivals=arrivals)
            print_point(p)
            out["arrivals"].append({"load": load, "rate_per_s": rate, "arrival_s": arrivals, **p})
    return out


def print_point(point: dict) -> None:
    m = point["median"]
    print(
        "    "
        + ", ".join(
            f"{e} {m[e]['throughput_tok_s']:.0f} tok/s, TTFT p50 {1e3 * m[e]['ttft_p50_s']:.0f} ms"
            for e in ("in_process", "http")
        )
        + f"; HTTP / in-process {point['ratios']['http/in_process throughput']['median']:.2f}x",
        flush=True,
    )


def same_texts(http: dict, in_process: dict) -> int:
    """How many requests have the same generated text (and token count) over HTTP as in process."""
    theirs = {r["index"]: (r["text"], r["generated_tokens"]) for r in in_process["requests"]}
    return sum(theirs.get(r["index"]) == (r["text"], r["generated_tokens"]) for r in http["requests"])


# ---- report and plot ---------------------------------------------------------------------------------------


def targets(model: dict, workload: dict) -> list[dict]:
    """The step's target on one model's results: ``harness.target_line``'s arguments; full size only on the
    full workload (not --quick) at 16 streams."""
    c = model["concurrency"]
    full = (
        not workload["quick"]
        and c["streams"] == STREAMS
        and workload["concurrency"]["summary"]["requests"] == CONCURRENCY_REQUESTS
    )
    return [
        {
            "label": f"HTTP / in-process throughput at {c['streams']} concurrent streams",
            "value": c["ratios"]["http/in_process throughput"]["median"],
            "target": TARGET,
            "full_size": full,
        }
    ]


def points(model: dict) -> list[tuple[str, dict]]:
    """(label, point): the fixed concurrency, then the Poisson points."""
    return [(f"{model['concurrency']['streams']} streams", model["concurrency"])] + [
        (f"Poisson {p['rate_per_s']:.2f}/s", p) for p in model["arrivals"]
    ]


def report(result: dict) -> str:
    """The table printed at the end: per point and engine, throughput, TTFT and ITL percentiles, the share of
    time outside the engine, and whether the texts matched; then the target."""
    m, w = result["machine"], result["workload"]
    load = (
        f"load average {m['load_average_start'][0]:.2f} at the start, "
        f"{m['load_average_end'][0]:.2f} at the end"
    )
    where = f"{m['gpu']}, " if m.get("gpu") else ""
    lines = [
        f"server on {m['device']} ({where}{m['cpu']}, {m['torch_threads']} torch threads), "
        f"torch {m['torch']}, "
        f"{w['runs']} run(s), medians; {load}"
    ]
    headers = [
        "load",
        "engine",
        "tok/s",
        "steps",
        "TTFT p50 ms",
        "p95",
        "p99",
        "ITL p50 ms",
        "p95",
        "p99",
        "outside engine",
        "same text",
    ]
    for name, model in result["models"].items():
        lines.append(
            f"\n## {name}: in-process capacity {model['capacity_requests_per_s']:.2f} requests/s at "
            f"{model['concurrency']['streams']} streams"
        )
        rows = []
        for label, p in points(model):
            for engine in ("in_process", "http"):
                s = p["median"][engine]
                http = engine == "http"
                share = p["ratios"]["outside engine share"]["median"]
                same = p["http_text_equals_in_process"]
                rows.append(
                    [
                        label,
                        engine,
                        s["throughput_tok_s"],
                        s["steps"],
                        *(1e3 * s[f"ttft_p{q}_s"] for q in (50, 95, 99)),
                        *(1e3 * s[f"itl_p{q}_s"] for q in (50, 95, 99)),
                        f"{100 * share:.1f}%" if http else None,
                        f"{min(same['per_run'])}/{same['requests']}" if http else None,
                    ]
                )
        lines.append(harness.table(headers, rows))
        per_run = model["concurrency"]["ratios"]["http/in_process throughput"]["per_run"]
        lines.append(
            f"HTTP / in-process throughput at {model['concurrency']['streams']} streams, run by run: "
            + ", ".join(f"{x:.2f}" for x in per_run)
            + " (a busy machine moves single runs)"
        )
        lines.append("\ntargets")
        lines.extend(harness.target_line(**t) for t in targets(model, w))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: throughput, TTFT and ITL percentiles against the Poisson rate, both engines; the 16-stream
    throughputs dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(17, 5 * len(models)), squeeze=False)
    colors = {"in_process": "C2", "http": "C0"}
    for row, (name, model) in zip(axes, models.items()):
        pts = model["arrivals"]
        xs = [p["rate_per_s"] for p in pts]
        ax = row[0]
        c = model["concurrency"]
        for engine in ("in_process", "http"):
            ax.plot(
                xs,
                [p["median"][engine]["throughput_tok_s"] for p in pts],
                marker="o",
                color=colors[engine],
                label=f"{engine.replace('_', '-')}, Poisson",
            )
            ax.axhline(
                c["median"][engine]["throughput_tok_s"],
                color=colors[engine],
                linestyle="--",
                linewidth=1,
                label=f"{engine.replace('_', '-')}, {c['streams']} streams",
            )
        ratio = c["ratios"]["http/in_process throughput"]["median"]
        ax.set(
            xlabel="Poisson arrival rate (requests / s)",
            ylabel="generated tokens / s",
            ylim=(0, None),
            title=f"{name}: throughput (HTTP / in-process at {c['streams']} streams: {ratio:.2f}x)",
        )
        ax.legend(fontsize=8)
        for ax, key, label in (
            (row[1], "ttft", "time to first token"),
            (row[2], "itl", "inter-token latency"),
        ):
            for engine in ("in_process", "http"):
                for q, style in ((50, "-"), (95, "--"), (99, ":")):
                    ax.plot(
                        xs,
                        [1e3 * p["median"][engine][f"{key}_p{q}_s"] for p in pts],
                        marker="o",
                        linestyle=style,
                        color=colors[engine],
                        label=f"{engine.replace('_', '-')} p{q}",
                    )
            ax.set(
                xlabel="Poisson arrival rate (requests / s)",
                ylabel="ms",
                ylim=(0, None),
                title=f"{name}: {label}",
            )
            ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"HTTP server vs in-process engine, {m['device']} ({m.get('gpu') or m['cpu']}), median of "
        f"{result['workload']['runs']} run(s), load average {m['load_average_start'][0]:.1f} -> "
        f"{m['load_average_end'][0]:.1f}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

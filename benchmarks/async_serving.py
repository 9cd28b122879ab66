"""Step 8's async scheduling behind the HTTP server: TTFT and inter-token latency at 1, 16 and 64 streams.

Step 7's and step 8's servers (``python -m step7_cuda_graphs`` / ``python -m step8_async_scheduling``, each
in a subprocess, both up for the whole run, alternated within each run; step 8 with its default on CUDA,
``--async-scheduling`` forced on a CPU) serve the same requests: 32-token prompts of random ids, 128 tokens
generated, greedy, ``ignore_eos``, on GPT-2 124M's shape with random weights in fp16 (the serving dtype).
At each concurrency (1, 16, 64 streams in flight, each stream one streaming ``POST /v1/completions`` at a
time, ``server.run_http``), 2 x streams requests (4 at 1 stream): throughput, TTFT and ITL percentiles
(``server.summarise``: SSE event times in this process). Overlap should lower ITL at 16 and 64 streams
and may raise TTFT (a request's first token is read one step after its prefill was launched).

    python -m benchmarks async_serving --device cuda --runs 2   # one H200: a few minutes
    python -m benchmarks async_serving --quick                  # on the CPU: checks that it works
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from common.weights import load_config

from . import harness, server, workloads
from .models import snapshot

NAME = "async_serving"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 2
TOKEN_ID_SEED = 3000
SERVERS = {"step7": "step7_cuda_graphs", "step8": "step8_async_scheduling"}
FULL = {
    "dtype": "float16",
    "streams": [1, 16, 64],
    "prompt_tokens": 32,
    "max_tokens": 128,
    "max_num_seqs": 64,
}
QUICK = {"dtype": "float32", "streams": [1, 2], "prompt_tokens": 8, "max_tokens": 8, "max_num_seqs": 4}


def main(models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False):
    """The CLI entry (``python -m benchmarks async_serving --device cuda``)."""
    return run(models or DEFAULT_MODELS, device, 1 if quick else runs, QUICK if quick else FULL, quick)


def run(models: list[str], device: str, runs: int, spec: dict, quick: bool = False, out_dir=harness.RESULTS):
    """Both servers on each model; writes ``<out_dir>/async_serving-<device>.json`` and ``.png``."""
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, spec["dtype"]),
        "workload": {
            **spec,
            "runs": runs,
            "quick": quick,
            "requests": "2 x streams per point (4 at 1 stream), all of prompt_tokens + max_tokens, greedy, "
            f"ignore_eos; prompt ids: torch.Generator().manual_seed({TOKEN_ID_SEED} + i)",
            "servers": {
                name: f"python -m {package} --dtype {spec['dtype']} --max-num-seqs {spec['max_num_seqs']} "
                f"--block-size {server.BLOCK_SIZE}" + (" --async-scheduling" if name == "step8" else "")
                for name, package in SERVERS.items()
            },
            "timing": "server.run_http: SSE event times in this process; servers alternated within each "
            "run (order rotated per run); medians over runs",
        },
        "models": {},
    }
    harness.run_models(result, models, lambda name: bench_model(name, device, runs, spec))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(name: str, device: str, runs: int, spec: dict) -> dict:
    folder = snapshot(name)
    config = load_config(folder)
    out: dict = {"snapshot": str(folder), "points": []}
    flags = {"step7": ("--dtype", spec["dtype"]), "step8": ("--dtype", spec["dtype"], "--async-scheduling")}
    procs = {
        e: server.ServerProcess(folder, device, package, flags[e], spec["max_num_seqs"])
        for e, package in SERVERS.items()
    }
    urls = {e: p.__enter__() for e, p in procs.items()}
    try:
        for streams in spec["streams"]:
            n = max(4, 2 * streams)
            equal = workloads.equal(n, spec["prompt_tokens"], spec["max_tokens"], TOKEN_ID_SEED)
            reqs = workloads.requests(equal, config.vocab_size, config.n_positions)
            calls = {
                e: lambda url=url, reqs=reqs, streams=streams: asyncio.run(
                    server.run_http(url, reqs, None, streams)
                )
                for e, url in urls.items()
            }
            for (
                call
            ) in calls.values():  # warm-up: every shape of the point once (and the servers' first steps)
                call()
            raw = harness.alternate(calls, runs, warmup=0)
            runs_out = {e: [server.summarise(r) for r in rs] for e, rs in raw.items()}
            same = [
                server.same_texts(a, b) == len(reqs) for a, b in zip(raw["step7"], raw["step8"])
            ]  # greedy: step 8's texts are step 7's
            point = {
                "streams": streams,
                "requests": n,
                "runs": runs_out,
                "median": {e: harness.medians(rs) for e, rs in runs_out.items()},
                "step8_texts_equal_step7": same,
            }
            m = point["median"]
            print(
                f"  {streams} streams: "
                + ", ".join(
                    f"{e} {m[e]['throughput_tok_s']:.0f} tok/s, TTFT p50 {1e3 * m[e]['ttft_p50_s']:.1f} ms, "
                    f"ITL p50 {1e3 * m[e]['itl_p50_s']:.2f} ms"
                    for e in SERVERS
                ),
                flush=True,
            )
            out["points"].append(point)
    finally:
        for p in procs.values():
            p.__exit__(None, None, None)
        harness.free(device)
    return out


def report(result: dict) -> str:
    m, w = result["machine"], result["workload"]
    lines = [
        f"async_serving on {m['device']} ({m.get('gpu') or m['cpu']}), torch {m['torch']}, {w['dtype']}, "
        f"{w['prompt_tokens']} + {w['max_tokens']} tokens, {w['runs']} run(s), medians"
    ]
    for name, model in result["models"].items():
        lines.append(f"\n## {name}")
        rows = []
        for p in model["points"]:
            for e, f in p["median"].items():
                rows.append(
                    [
                        p["streams"],
                        e,
                        f["throughput_tok_s"],
                        1e3 * f["ttft_p50_s"],
                        1e3 * f["ttft_p95_s"],
                        1e3 * f["itl_p50_s"],
                        1e3 * f["itl_p95_s"],
                        all(p["step8_texts_equal_step7"]),
                    ]
                )
        lines.append(
            harness.table(
                ["streams", "server", "tok/s", "TTFT p50 ms", "p95", "ITL p50 ms", "p95", "same texts"], rows
            )
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: TTFT p50 and ITL p50 against the number of streams, step 7 and step 8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), squeeze=False)
    for (name, model), (ax1, ax2) in zip(models, axes):
        streams = [p["streams"] for p in model["points"]]
        for e, color in zip(SERVERS, ("C4", "C5")):
            for ax, key, label in ((ax1, "ttft_p50_s", "TTFT p50"), (ax2, "itl_p50_s", "ITL p50")):
                ys = [1e3 * p["median"][e][key] for p in model["points"]]
                ax.plot(streams, ys, marker="o", color=color, label=e)
                ax.set(
                    xscale="log", xlabel="streams in flight", ylabel=f"{label}, ms", title=f"{name}: {label}"
                )
                ax.set_xticks(streams, [str(s) for s in streams])
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"step 8 (async scheduling) vs step 7 behind HTTP, {m['device']} ({m.get('gpu') or m['cpu']}), "
        f"{result['workload']['dtype']}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

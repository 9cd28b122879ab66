"""The servers of steps 6 and later side by side: what each mechanism buys a client of the HTTP API.

One ``python -m <step>`` server per step package present, alternated run by run; at 1, 16 and 64 streams in
flight (``STREAMS``), each request a streaming ``POST /v1/completions`` of ``PROMPT_TOKENS`` random ids and
exactly ``MAX_TOKENS`` new tokens (greedy, ``ignore_eos``): throughput, TTFT and inter-token latency
percentiles, and whether every step streamed the same text. GPT-2 124M's shape with random weights on a GPU
(fp16), the demo on a CPU (fp32); the load: ``lib/load.py``. Details: benchmarks/README.md.

    python -m benchmarks server_by_step --device cuda --runs 2
    python -m benchmarks server_by_step --quick       # CPU, 1 run, short requests
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import time
from contextlib import ExitStack
from pathlib import Path

from .lib import harness, workloads
from .lib.load import ServerProcess, run_http, summarise
from .lib.models import snapshot

NAME = "server_by_step"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3
STEPS = ["step6_server", "step7_cuda_graphs", "step8_async_scheduling", "step9_prefix_cache"]
STREAMS = [1, 16, 64]
ROUNDS = 4  # requests per point: ROUNDS x streams (at least MIN_REQUESTS)
MIN_REQUESTS = 8
PROMPT_TOKENS, MAX_TOKENS = 32, 128
TOKEN_ID_SEED = 3000
# --quick: the demo on a CPU, short requests, 1 and 4 streams
QUICK = {"streams": [1, 4], "prompt_tokens": 16, "max_tokens": 16}


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """The CLI entry (``python -m benchmarks server_by_step``)."""
    if quick:
        runs, streams = 1, QUICK["streams"]
        prompt_tokens, max_tokens = QUICK["prompt_tokens"], QUICK["max_tokens"]
    else:
        streams, prompt_tokens, max_tokens = STREAMS, PROMPT_TOKENS, MAX_TOKENS
    if models is None:
        models = DEFAULT_MODELS if device.startswith("cuda") else ["demo"]
    dtype = "float16" if device.startswith("cuda") else "float32"
    steps = [s for s in STEPS if importlib.util.find_spec(s) is not None]
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": {**harness.machine_info(device, dtype), "load_average_start": os.getloadavg()},
        "workload": {
            "quick": quick,
            "runs": runs,
            "steps": steps,
            "streams": streams,
            "requests_per_point": f"max({ROUNDS} x streams, {MIN_REQUESTS})",
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "token_id_seed": TOKEN_ID_SEED,
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "server": f"python -m <step> --dtype {dtype} --max-num-seqs max(streams) --block-size 16 "
            "(other flags: their defaults, so CUDA graphs and async scheduling are on where a step has "
            "them); one process per step, started once",
            "timing": "time.perf_counter in this process; TTFT from when a request was sent; ITL = gaps "
            "between a request's SSE events; steps alternated within each run (order rotated per run) after "
            "one untimed run of each; medians over runs",
        },
        "models": {},
    }
    harness.run_models(
        result,
        models,
        lambda name: bench_model(name, device, dtype, runs, steps, streams, prompt_tokens, max_tokens),
    )
    result["machine"]["load_average_end"] = os.getloadavg()
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str,
    device: str,
    dtype: str,
    runs: int,
    steps: list[str],
    streams: list[int],
    prompt_tokens: int,
    max_tokens: int,
) -> dict:
    """Every point on one model: one server per step, alternated."""
    from common.weights import load_config

    folder = snapshot(name)
    vocab_size = load_config(folder).vocab_size
    extra = ("--dtype", dtype, "--max-num-seqs", str(max(streams)))
    out: dict = {"snapshot": str(folder), "points": []}
    with ExitStack() as stack:
        urls = {s: stack.enter_context(ServerProcess(folder, device, s, extra)) for s in steps}
        for n in streams:
            rng = random.Random(TOKEN_ID_SEED + n)
            reqs = [
                workloads.Request(i, [rng.randrange(vocab_size) for _ in range(prompt_tokens)], max_tokens)
                for i in range(max(ROUNDS * n, MIN_REQUESTS))
            ]
            print(f"  {n} streams: {len(reqs)} requests of {prompt_tokens} + {max_tokens} tokens", flush=True)
            calls = {
                s: (lambda url=url, reqs=reqs, n=n: asyncio.run(run_http(url, reqs, concurrency=n)))
                for s, url in urls.items()
            }
            raw = harness.alternate(calls, runs, warmup=1)
            texts = {s: [[r["text"] for r in run["requests"]] for run in rs] for s, rs in raw.items()}
            first = texts[steps[0]][0]
            runs_out = {s: [summarise(r) for r in rs] for s, rs in raw.items()}
            point = {
                "streams": n,
                "requests": len(reqs),
                "runs": runs_out,
                "median": {s: harness.medians(rs) for s, rs in runs_out.items()},
                "same_text_as_first_step": {s: all(t == first for t in ts) for s, ts in texts.items()},
            }
            m = point["median"]
            print(
                "    "
                + "; ".join(
                    f"{s.split('_')[0]} {m[s]['throughput_tok_s']:.0f} tok/s, TTFT p50 "
                    f"{1e3 * m[s]['ttft_p50_s']:.1f} ms, ITL p50 {1e3 * m[s]['itl_p50_s']:.2f} ms"
                    for s in steps
                ),
                flush=True,
            )
            out["points"].append(point)
    return out


def report(result: dict) -> str:
    """The table printed at the end: per point and step, throughput, TTFT and ITL percentiles."""
    m, w = result["machine"], result["workload"]
    where = f"{m['gpu']}, " if m.get("gpu") else ""
    lines = [
        f"servers on {m['device']} ({where}{m['cpu']}), torch {m['torch']}, {m['dtype']}, "
        f"{w['runs']} run(s), medians; {w['prompt_tokens']} + {w['max_tokens']} tokens per request"
    ]
    headers = ["streams", "step", "tok/s", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "same text"]
    for name, model in result["models"].items():
        lines.append(f"\n## {name}")
        rows = []
        for p in model["points"]:
            for s, f in p["median"].items():
                rows.append(
                    [
                        p["streams"],
                        s,
                        f["throughput_tok_s"],
                        1e3 * f["ttft_p50_s"],
                        1e3 * f["ttft_p99_s"],
                        1e3 * f["itl_p50_s"],
                        1e3 * f["itl_p99_s"],
                        "yes" if p["same_text_as_first_step"][s] else "NO",
                    ]
                )
        lines.append(harness.table(headers, rows))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: throughput, TTFT p50 and ITL p50 against the number of streams, one line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.5 * len(models)), squeeze=False)
    panels = [
        ("throughput_tok_s", "tokens/s", 1),
        ("ttft_p50_s", "TTFT p50 (ms)", 1e3),
        ("itl_p50_s", "ITL p50 (ms)", 1e3),
    ]
    for row, (name, model) in zip(axes, models.items()):
        xs = [p["streams"] for p in model["points"]]
        for ax, (key, label, scale) in zip(row, panels):
            for s in result["workload"]["steps"]:
                ax.plot(xs, [scale * p["median"][s][key] for p in model["points"]], marker="o", label=s)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("streams in flight")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"servers on {result['machine'].get('gpu') or result['machine']['cpu']}")
    return harness.save_figure(fig, path)

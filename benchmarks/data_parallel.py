"""Step 14: what several frontends (``--api-server-count``) and several engine cores
(``--data-parallel-size``, all on one device here) buy an HTTP client: step 14's server in each of
``CONFIGS`` (frontends, cores) at 16, 64, 256 and 512 streams (32 random ids + exactly 128 greedy tokens
each; the load from ``CLIENTS`` processes), beside the engine in process at the same concurrency. Per point:
tok/s (first send to last token), TTFT and ITL percentiles, the frontends' CPU time per streamed token
(``/proc``: user + system of every frontend process over the point).

    python -m benchmarks data_parallel --device cuda --runs 1
    python -m benchmarks data_parallel --runs 2         # CPU, the demo: 4 and 16 streams, 64 tokens
    python -m benchmarks data_parallel --quick          # CPU, the demo, 1 run, short requests
"""

from __future__ import annotations

import concurrent.futures
import gc
import importlib
import multiprocessing
import random
import time
from pathlib import Path

from .engine_core import InProcessStep10, cpu_seconds, run_clients
from .lib import harness, workloads
from .lib.load import ServerProcess, run_in_process, summarise
from .lib.models import snapshot

NAME = "data_parallel"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 1
STEP = "step14_data_parallel"
CONFIGS = [(1, 1), (2, 1), (4, 1), (1, 2), (4, 2)]  # (api_server_count, data_parallel_size)
STREAMS = [16, 64, 256, 512]
CLIENTS = 16  # load processes
ROUNDS, MIN_REQUESTS = 2, 8  # requests per point: max(ROUNDS x streams, MIN_REQUESTS)
PROMPT_TOKENS, MAX_TOKENS = 32, 128
TOKEN_ID_SEED = 4000
# on a CPU (the demo): what a 2-core machine can run in a few minutes
CPU = {"streams": [4, 16], "max_tokens": 64, "configs": [(1, 1), (2, 1), (1, 2), (2, 2)], "clients": 4}
QUICK = {"streams": [4, 8], "prompt_tokens": 16, "max_tokens": 16, "configs": [(1, 1), (2, 2)], "clients": 4}


def main(models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False):
    """The CLI entry (``python -m benchmarks data_parallel``)."""
    started = time.perf_counter()
    cuda = device.startswith("cuda")
    models = models or (DEFAULT_MODELS if cuda else ["demo"])
    dtype = "float16" if cuda else "float32"
    q = QUICK if quick else ({} if cuda else CPU)
    streams, configs = q.get("streams", STREAMS), q.get("configs", CONFIGS)
    lengths = (q.get("prompt_tokens", PROMPT_TOKENS), q.get("max_tokens", MAX_TOKENS))
    clients = q.get("clients", CLIENTS)
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "streams": streams,
            "configs": [{"api_server_count": n, "data_parallel_size": m} for n, m in configs],
            "request": f"{lengths[0]} random ids + exactly {lengths[1]} greedy tokens (ignore_eos), streamed",
            "requests_per_point": f"max({ROUNDS} x streams, {MIN_REQUESTS})",
            "load": f"{clients} client processes, the streams shared round-robin",
            "server": f"python -m {STEP} --dtype {dtype} --max-num-seqs max(streams) --block-size 16 "
            "--api-server-count N --data-parallel-size M (every core on one device: --device cuda:0)",
            "in_process": f"{STEP}.LLMEngine, one core, the same requests at the same concurrency",
            "frontend_cpu": "user + system seconds of the frontend processes over a point, per token",
            "runs": runs,
            "quick": quick,
        },
        "models": {},
    }
    one_device = f"{device}:0" if device == "cuda" else device
    harness.run_models(
        result,
        models,
        lambda name: bench_model(name, one_device, dtype, runs, streams, configs, lengths, clients),
    )
    return harness.finish(NAME, device, result, started, plot, report)


def frontend_pids(server: ServerProcess, frontends: int) -> list[int]:
    """The server's frontend processes: the launcher itself for one, else its children that serve."""
    if frontends == 1:
        return [server.proc.pid]
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_text()
            ppid = int(Path(cmdline.parent, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == server.proc.pid and "frontend_main" in text:
            found.append(int(cmdline.parent.name))
    return found


def bench_model(name, device, dtype, runs, streams, configs, lengths, clients) -> dict:
    from common.weights import load_config

    folder = snapshot(name)
    vocab = load_config(folder).vocab_size
    seqs = max(streams)
    prompt_tokens, max_tokens = lengths
    out: dict = {"points": {}}
    requests = {}
    for n in streams:
        rng = random.Random(TOKEN_ID_SEED + n)
        requests[n] = [
            workloads.Request(i, [rng.randrange(vocab) for _ in range(prompt_tokens)], max_tokens)
            for i in range(max(ROUNDS * n, MIN_REQUESTS))
        ]
    module = importlib.import_module(STEP)  # LLM, its core in process, behind add_request / step
    engine = InProcessStep10(module, model=str(folder), device=device, dtype=dtype, max_num_seqs=seqs)
    for n in streams:
        call = {
            "in process": lambda r=requests[n], n=n, e=engine: summarise(
                run_in_process(e, module, r, concurrency=n)
            )
        }
        figures = harness.medians(harness.alternate(call, runs, warmup=1)["in process"])
        out["points"].setdefault(str(n), {})["in process"] = figures
        print(f"  in process, {n} streams: {figures['throughput_tok_s']:.0f} tok/s", flush=True)
    engine.close()
    del engine
    gc.collect()
    harness.free(device)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(clients, mp_context=spawn) as pool:
        for frontends, cores in configs:
            label = f"{frontends} api servers, {cores} core{'s' if cores > 1 else ''}"
            extra = ("--dtype", dtype, "--max-num-seqs", str(seqs))
            extra += ("--api-server-count", str(frontends), "--data-parallel-size", str(cores))
            server = ServerProcess(folder, device, STEP, extra)
            with server as url:
                pids = frontend_pids(server, frontends)
                for n in streams:
                    calls = {label: lambda r=requests[n], n=n: run_clients(pool, url, r, n, clients)}
                    cpu = [sum(cpu_seconds(p) for p in pids)]
                    raw = harness.alternate(calls, runs, warmup=1)[label]
                    cpu.append(sum(cpu_seconds(p) for p in pids))
                    runs_out = [summarise(r) for r in raw]
                    figures = harness.medians(runs_out)
                    tokens = sum(r["generated_tokens"] for r in runs_out) * (runs + 1) / runs
                    figures["frontend_cpu_us_per_token"] = 1e6 * (cpu[1] - cpu[0]) / tokens
                    inproc = out["points"][str(n)]["in process"]["throughput_tok_s"]
                    figures["over_in_process"] = figures["throughput_tok_s"] / inproc
                    out["points"][str(n)][label] = figures
                    print(
                        f"  {label}, {n} streams: {figures['throughput_tok_s']:.0f} tok/s "
                        f"({figures['over_in_process']:.2f}x in process), TTFT p50 "
                        f"{1e3 * figures['ttft_p50_s']:.1f} ms, ITL p50 {1e3 * figures['itl_p50_s']:.2f} ms, "
                        f"frontends' CPU {figures['frontend_cpu_us_per_token']:.1f} us/token",
                        flush=True,
                    )
    return out


def report(result: dict) -> str:
    lines = []
    for name, model in result["models"].items():
        points = model["points"]
        labels = list(next(iter(points.values())))
        rows = []
        for label in labels:
            row = [label]
            for figures in points.values():
                f = figures[label]
                row.append(f"{f['throughput_tok_s']:.0f} ({f.get('over_in_process', 1):.2f}x)")
            rows.append(row)
        lines += [f"{name}: tok/s (over in process)", harness.table(["config", *points], rows), ""]
        rows = [
            [label, *(f"{points[n][label].get('frontend_cpu_us_per_token', 0):.1f}" for n in points)]
            for label in labels[1:]
        ]
        lines += ["frontends' CPU, us per streamed token", harness.table(["config", *points], rows), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """tok/s against streams per configuration (the engine in process dashed), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, (name, model) in zip(axes[0], models.items()):
        points = model["points"]
        streams = [int(n) for n in points]
        for label in next(iter(points.values())):
            values = [points[str(n)][label]["throughput_tok_s"] for n in streams]
            ax.plot(streams, values, "--" if label == "in process" else "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tok/s")
        ax.set_title(f"{name}: step 14's server by frontends and cores", fontsize=9)
        ax.legend(fontsize=7)
    machine = result["machine"]
    fig.suptitle(
        f"{machine.get('gpu') or machine['cpu']}, {machine['dtype']}, commit {machine.get('git_commit')}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

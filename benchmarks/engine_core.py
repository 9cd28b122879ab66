"""Step 10: what the engine core in its own process buys a client of the HTTP server, and ``LLM``.

The servers of steps 8, 9 and 10, alternated, at 1, 16, 64 and 256 streams (32 random ids + exactly 128
greedy tokens each), the load from ``CLIENTS`` processes and, for step 10, twice as many (a figure that
moves by under 10% is the server's); beside each point each engine in process at the same concurrency.
Then ``LLM.generate`` of 256 x (512 + 256): step 9, step 10 in process, step 10 multiprocess.

    python -m benchmarks engine_core --device cuda --runs 3
    python -m benchmarks engine_core --quick          # CPU, the demo, 1 run, short requests
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import importlib
import multiprocessing
import os
import random
import time
from contextlib import ExitStack
from pathlib import Path

from .lib import harness, workloads
from .lib.load import ServerProcess, run_http, run_in_process, summarise
from .lib.models import snapshot

NAME = "engine_core"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3
STEPS = ["step8_async_scheduling", "step9_prefix_cache", "step10_engine_core"]
STREAMS = [1, 16, 64, 256]
CLIENTS = 4  # load processes (the doubling check: 2 x CLIENTS)
ROUNDS, MIN_REQUESTS = 2, 8  # requests per point: max(ROUNDS x streams, MIN_REQUESTS)
PROMPT_TOKENS, MAX_TOKENS = 32, 128
OFFLINE = (256, 512, 256)  # LLM.generate: requests, prompt tokens, new tokens
TOKEN_ID_SEED = 3000
QUICK = {"streams": [1, 4], "prompt_tokens": 16, "max_tokens": 16, "offline": (8, 16, 16)}


def _client(url: str, requests: list, concurrency: int, start_at: float) -> dict:
    """One load process: wait for the common start (the machine's monotonic clock), stream its share."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    return asyncio.run(run_http(url, requests, concurrency=concurrency))


def run_clients(pool, url: str, requests: list, streams: int, clients: int) -> dict:
    """``requests`` streamed ``streams`` at a time from ``clients`` processes (round-robin shares); one run
    with the processes' times on one clock: throughput over the first send to the last token."""
    clients = min(clients, streams)
    shares = [requests[i::clients] for i in range(clients)]
    per = [streams // clients + (i < streams % clients) for i in range(clients)]
    start_at = time.perf_counter() + 1.0
    runs = list(pool.map(_client, [url] * clients, shares, per, [start_at] * clients))
    t0 = min(r["t0"] for r in runs)
    records = []
    for r in runs:
        shift = r["t0"] - t0
        for rec in r["requests"]:
            for key in ("arrival_s", "first_token_s", "finished_s"):
                rec[key] += shift
            records.append(rec)
    wall = max(r["t0"] + r["wall_s"] for r in runs) - t0
    return {"wall_s": wall, "steps": max(r["steps"] for r in runs), "requests": records}


class InProcessStep10:
    """Step 10's ``LLM`` (core and frontend, in process or not) behind ``LLMEngine``'s ``add_request`` /
    ``step``, for ``run_in_process``: the same work as step 9's ``engine.step()``, text included."""

    def __init__(self, module, **args):
        self.module, self.llm = module, module.LLM(**args)

    def add_request(self, request_id: str, ids: list[int], params) -> None:
        from step10_engine_core.messages import EngineCoreRequest

        text, ids, params = self.llm.processor.process(ids, params)
        self.llm._add(text, EngineCoreRequest(request_id, ids, params))

    def step(self) -> list:
        self.llm._step()
        outs = []
        for request_id, queue in list(self.llm._outputs.items()):
            outs.extend(queue)
            queue.clear()
            if outs and outs[-1].finished:
                del self.llm._outputs[request_id]
        return outs

    def close(self) -> None:
        self.llm.engine_core.shutdown()


def make_engine(step: str, folder: Path, device: str, dtype: str, max_num_seqs: int, **extra):
    module = importlib.import_module(step)
    args = dict(model=str(folder), device=device, dtype=dtype, max_num_seqs=max_num_seqs, **extra)
    if step == "step10_engine_core":
        return module, InProcessStep10(module, **args)
    return module, module.LLMEngine(**args)


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """The CLI entry (``python -m benchmarks engine_core``)."""
    if quick:
        runs, streams, offline = 1, QUICK["streams"], QUICK["offline"]
        prompt_tokens, max_tokens = QUICK["prompt_tokens"], QUICK["max_tokens"]
    else:
        streams, prompt_tokens, max_tokens, offline = STREAMS, PROMPT_TOKENS, MAX_TOKENS, OFFLINE
    if models is None:
        models = DEFAULT_MODELS if device.startswith("cuda") else ["demo"]
    dtype = "float16" if device.startswith("cuda") else "float32"
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": {**harness.machine_info(device, dtype), "load_average_start": os.getloadavg()},
        "workload": {
            "quick": quick,
            "runs": runs,
            "steps": STEPS,
            "streams": streams,
            "clients": CLIENTS,
            "requests_per_point": f"max({ROUNDS} x streams, {MIN_REQUESTS})",
            "prompt_tokens": prompt_tokens,
            "max_tokens": max_tokens,
            "offline": dict(zip(("requests", "prompt_tokens", "max_tokens"), offline)),
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "server": f"python -m <step> --dtype {dtype} --max-num-seqs max(streams) --block-size 16 "
            "(CUDA graphs, async scheduling and the prefix cache at their defaults)",
            "timing": "time.perf_counter (one monotonic clock across the load processes); TTFT from when a "
            "request was sent; ITL = gaps between a request's SSE events; servers alternated within each "
            "run after one untimed run of each; medians over runs",
        },
        "models": {},
    }
    harness.run_models(
        result,
        models,
        lambda name: bench_model(name, device, dtype, runs, streams, prompt_tokens, max_tokens, offline),
    )
    result["machine"]["load_average_end"] = os.getloadavg()
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(name, device, dtype, runs, streams, prompt_tokens, max_tokens, offline) -> dict:
    from common.weights import load_config

    folder = snapshot(name)
    vocab = load_config(folder).vocab_size
    seqs = max(streams)
    out: dict = {"snapshot": str(folder), "points": [], "offline": {}}
    workloads_by_n = {}
    for n in streams:
        rng = random.Random(TOKEN_ID_SEED + n)
        workloads_by_n[n] = [
            workloads.Request(i, [rng.randrange(vocab) for _ in range(prompt_tokens)], max_tokens)
            for i in range(max(ROUNDS * n, MIN_REQUESTS))
        ]
    # in process first (one engine at a time), then the servers
    in_process: dict[int, dict] = {n: {} for n in streams}
    for step in STEPS:
        module, engine = make_engine(step, folder, device, dtype, seqs)
        for n in streams:
            reqs = workloads_by_n[n]
            rs = harness.alternate(
                {
                    step: lambda e=engine, m=module, r=reqs, n=n: summarise(
                        run_in_process(e, m, r, concurrency=n)
                    )
                },
                runs,
            )
            in_process[n][step] = harness.medians(rs[step])
            print(f"  in process {step} {n}: {in_process[n][step]['throughput_tok_s']:.0f} tok/s", flush=True)
        if hasattr(engine, "close"):
            engine.close()
        del engine
        gc.collect()
    extra = ("--dtype", dtype, "--max-num-seqs", str(seqs))
    with (
        ExitStack() as stack,
        concurrent.futures.ProcessPoolExecutor(
            2 * CLIENTS, mp_context=multiprocessing.get_context("spawn")
        ) as pool,
    ):
        urls = {s: stack.enter_context(ServerProcess(folder, device, s, extra)) for s in STEPS}
        for n in streams:
            reqs = workloads_by_n[n]
            print(f"  {n} streams: {len(reqs)} requests of {prompt_tokens} + {max_tokens}", flush=True)
            calls = {
                s: (lambda url=url, r=reqs, n=n: run_clients(pool, url, r, n, CLIENTS))
                for s, url in urls.items()
            }
            calls["step10_engine_core x2 clients"] = lambda r=reqs, n=n: run_clients(
                pool, urls["step10_engine_core"], r, n, 2 * CLIENTS
            )
            raw = harness.alternate(calls, runs, warmup=1)
            first = [r["text"] for r in sorted(raw[STEPS[0]][0]["requests"], key=lambda r: r["index"])]
            same = {
                s: all(
                    [r["text"] for r in sorted(x["requests"], key=lambda r: r["index"])] == first for x in xs
                )
                for s, xs in raw.items()
            }
            runs_out = {s: [summarise(r) for r in rs] for s, rs in raw.items()}
            point = {
                "streams": n,
                "requests": len(reqs),
                "runs": runs_out,
                "median": {s: harness.medians(rs) for s, rs in runs_out.items()},
                "in_process": in_process[n],
                "same_text_as_step8": same,
            }
            m = point["median"]
            print(
                "    "
                + "; ".join(f"{s.split('_')[0]} {m[s]['throughput_tok_s']:.0f}" for s in m)
                + f" tok/s; same text: {same}",
                flush=True,
            )
            out["points"].append(point)
    # LLM.generate, offline: step 9, step 10 in process, step 10 multiprocess
    count, prompt_len, new = offline
    rng = random.Random(TOKEN_ID_SEED)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(count)]
    variants = {
        "step9_prefix_cache": ("step9_prefix_cache", {}),
        "step10 in process": ("step10_engine_core", {"multiprocessing": False}),
        "step10 multiprocess": ("step10_engine_core", {"multiprocessing": True}),
    }
    llms = {}
    for label, (step, extra_args) in variants.items():
        module = importlib.import_module(step)
        llms[label] = (
            module,
            module.LLM(model=str(folder), device=device, dtype=dtype, max_num_seqs=count, **extra_args),
        )

    def generate(label):
        module, llm = llms[label]
        params = module.SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t
        return {"wall_s": wall, "throughput_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall}

    raw = harness.alternate({label: (lambda label=label: generate(label)) for label in variants}, runs)
    out["offline"] = {label: harness.medians(rs) for label, rs in raw.items()}
    out["offline_runs"] = raw
    for label, (_, llm) in llms.items():
        if hasattr(llm, "engine_core"):
            llm.engine_core.shutdown()
    print(
        "  LLM.generate: "
        + "; ".join(f"{k} {v['throughput_tok_s']:.0f} tok/s" for k, v in out["offline"].items())
    )
    return out


def report(result: dict) -> str:
    """Per point: each server's tok/s, TTFT p50, ITL p50, and each engine's in-process tok/s; then LLM."""
    lines = []
    for name, model in result["models"].items():
        lines.append(f"{name}: streams | server tok/s (in process) | TTFT p50 ms | ITL p50 ms")
        for p in model["points"]:
            for s, m in p["median"].items():
                ip = p["in_process"].get(s, {}).get("throughput_tok_s")
                lines.append(
                    f"  {p['streams']:>4} {s:<32} {m['throughput_tok_s']:>9.0f} ({ip or 0:>8.0f}) "
                    f"{1e3 * m['ttft_p50_s']:>8.2f} {1e3 * m['itl_p50_s']:>8.3f}"
                )
        for k, v in model["offline"].items():
            lines.append(f"  LLM.generate {k:<24} {v['throughput_tok_s']:>9.0f} tok/s")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Server tok/s vs streams per step (solid), each engine in process (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in result["models"].values():
        xs = [p["streams"] for p in model["points"]]
        for i, s in enumerate(STEPS):
            color = f"C{i}"
            ax.plot(
                xs,
                [p["median"][s]["throughput_tok_s"] for p in model["points"]],
                "o-",
                color=color,
                label=f"{s} server",
            )
            ax.plot(
                xs,
                [p["in_process"][s]["throughput_tok_s"] for p in model["points"]],
                "--",
                color=color,
                label=f"{s} in process",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams in flight")
    ax.set_ylabel("tokens / s")
    ax.set_title("HTTP server vs its engine in process")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

"""Step 10: what the engine core in its own process buys a client of the HTTP server, and ``LLM``.

The servers of steps 8, 9 and 10, alternated, at 1, 16, 64 and 256 streams (32 random ids + exactly 128
greedy tokens each), the load from ``CLIENTS`` processes and, for step 10, twice as many (a figure that
moves by under 10% is the server's); beside each point each engine in process at the same concurrency.
Then ``LLM.generate`` of 256 x (512 + 256): step 9, step 10 in process, step 10 multiprocess. Or, with
``--profile-frontend``, where step 10's frontend spends its time (``engine_core_frontend-<device>``).

    python -m benchmarks engine_core --device cuda --runs 3
    python -m benchmarks engine_core --quick          # CPU, the demo, 1 run, short requests
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import cProfile
import gc
import importlib
import multiprocessing
import os
import pstats
import random
import shutil
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from .lib import harness, profiled, workloads
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
            finished = bool(queue) and queue[-1].finished
            outs.extend(queue)
            queue.clear()
            if finished:
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
    profile_frontend: bool = False,
) -> dict:
    """The CLI entry (``python -m benchmarks engine_core``; ``profile_frontend``: ``frontend_main``)."""
    if profile_frontend:
        return frontend_main(models, device, runs, quick, out_dir)
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


# ---- --profile-frontend: where step 10's frontend spends its time --------------------------------------

FRONTEND_NAME = "engine_core_frontend"
PROFILE_STEP = "step10_engine_core"
PROFILE = {"streams": 64, "rounds": 4, "prompt_tokens": 32, "max_tokens": 128, "top": 30}  # 4 x 64 requests
CPU_PROFILE = {**PROFILE, "rounds": 1, "max_tokens": 64}  # a CPU's engine is slow: fewer tokens
QUICK_PROFILE = {"streams": 8, "rounds": 1, "prompt_tokens": 16, "max_tokens": 16, "top": 10}
ALONE = {"requests": 256, "max_tokens": 128}  # the frontend alone: 256 requests, one token each per step
QUICK_ALONE = {"requests": 32, "max_tokens": 16}
# each function's own time goes to the first category whose pattern matches its "file:line(name)";
# builtins and generic helpers go where their callers go (profiled.shares)
FRONTEND_CATEGORIES = [
    ("idle (waiting in epoll)", r"select\.epoll"),
    ("zmq receive, msgspec decode", r"zmq/|core_client\.py|msgspec\.msgpack\.Decoder"),
    (
        "request entry (pydantic, checks, submit)",
        r"pydantic|fastapi/|protocol\.py|/processor\.py|uuid|tokenizer\.py:\d+\(encode\)"
        r"|\((create_(chat_)?completion|check_\w+|budget|sampling_params|submit|response_head)\)",
    ),
    (
        "output processor (detokenize, stop strings)",
        r"output_processor\.py:\d+\((append|finish|finished|_first_stop_string|_stop_prefix_length"
        r"|process_outputs|_advance\w*)\)|tokenizer\.py|codecs",
    ),
    ("metrics (prometheus_client)", r"prometheus_client|metrics\.py"),
    ("RequestOutput, collector, routing", r"output_processor\.py|sequence\.py|<string>|async_engine\.py"),
    ("chunks (dicts, orjson, SSE bytes)", r"serving_\w+\.py|orjson"),
    (
        "HTTP (Starlette, uvicorn, socket writes)",
        r"starlette/|uvicorn/|h11|httptools|anyio/|api_server\.py|socket|asyncio/(selector_events|transports)\.py",
    ),
    ("asyncio event loop", r"asyncio/|_asyncio|_contextvars|selectors\.py"),
]
# the frontend alone: the synthetic core and the readers standing in for HTTP are the benchmark's own
ALONE_CATEGORIES = [
    ("the benchmark (synthetic core, readers)", r"benchmarks/engine_core\.py"),
    *FRONTEND_CATEGORIES,
]
SAMPLE_TEXT = (  # what the synthetic core "generates", cycled: detokenization as of real text
    "The Python interpreter reads a program, compiles it to bytecode and runs it one instruction at a "
    "time. Lists, dictionaries and sets are built in; functions are objects; a generator yields values "
    "as they are asked for. Exceptions unwind the stack until a handler catches them, and a context "
    "manager closes what it opened. Modules are imported once and cached in sys.modules."
)


def frontend_main(models, device: str, runs: int, quick: bool, out_dir: Path) -> dict:
    """``--profile-frontend``: step 10's frontend alone (synthetic core outputs: ``frontend_alone``), then its
    server under cProfile at 64 streams (``profile_server``). Writes ``engine_core_frontend-<device>``."""
    profile = PROFILE if device.startswith("cuda") else CPU_PROFILE
    profile, alone = (QUICK_PROFILE, QUICK_ALONE) if quick else (profile, ALONE)
    runs = 1 if quick else runs
    if models is None:
        models = DEFAULT_MODELS if device.startswith("cuda") else ["demo"]
    dtype = "float16" if device.startswith("cuda") else "float32"
    started = time.perf_counter()
    result = {
        "benchmark": FRONTEND_NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "quick": quick,
            "runs": runs,
            "alone": {
                **alone,
                "what": "the demo's tokenizer; step 10's AsyncEngine + OutputProcessor + collectors + "
                "create_completion's SSE body (no HTTP; the heap frozen, as the server's) over a synthetic "
                "core: every running request gets its next token each step, through msgspec, the next step "
                "always waiting; and LLM.generate (FINAL_ONLY) over the same core in process; us per token: "
                "this thread's CPU time less the synthetic core's / tokens; medians of runs after a warm-up; "
                "by category: one more run under cProfile (ALONE_CATEGORIES), scaled to the median",
            },
            "profile": {
                **profile,
                "clients": CLIENTS,
                "what": f"python -m {PROFILE_STEP} (--max-num-seqs 256) under benchmarks.lib.profiled; "
                "one warm-up run, one run unprofiled (tok/s; the frontend's CPU time from /proc), one run "
                "with cProfile on; categories: FRONTEND_CATEGORIES (own time, builtins by their callers); "
                "us_per_token: each category's share of the profiled busy time x the unprofiled CPU time",
            },
        },
        "categories": FRONTEND_CATEGORIES,
        "models": {},
    }

    def bench(name: str) -> dict:
        folder = snapshot(name)
        out = {"snapshot": str(folder)}
        out["alone"] = frontend_alone(PROFILE_STEP, snapshot("demo"), runs=runs, **alone)  # no model runs
        a = out["alone"]
        print(
            f"  the frontend alone: server path {a['server']['us_per_token']:.2f} us per token, LLM.generate "
            f"{a['llm']['us_per_token']:.2f}",
            flush=True,
        )
        out["profile"] = profile_server(folder, device, dtype, **profile)
        return out

    harness.run_models(result, models, bench)
    return harness.finish(FRONTEND_NAME, device, result, started, frontend_plot, frontend_report, out_dir)


def cpu_seconds(pid: int) -> float:
    """CPU time (seconds) of a process's threads so far: the nanoseconds of /proc/<pid>/task/*/schedstat
    (Linux), else user + system clock ticks of /proc/<pid>/stat (10 ms resolution)."""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def profile_server(folder, device, dtype, prompt_tokens, max_tokens, streams, rounds, top) -> dict:
    """Step 10's server at ``streams`` streams (``rounds`` x streams requests, from CLIENTS processes):
    a warm-up, a run without the profiler (its figures and the frontend process's CPU time), then a run
    with it; the profile's top functions and its own time per category (FRONTEND_CATEGORIES)."""
    vocab = importlib.import_module("common.weights").load_config(folder).vocab_size
    rng = random.Random(TOKEN_ID_SEED + streams)
    reqs = [
        workloads.Request(i, [rng.randrange(vocab) for _ in range(prompt_tokens)], max_tokens)
        for i in range(rounds * streams)
    ]
    tokens = len(reqs) * max_tokens
    stats_file = Path(tempfile.mkdtemp(prefix="frontend-profile-")) / "server.prof"
    extra = ("--dtype", dtype, "--max-num-seqs", "256")
    server = ServerProcess(folder, device, PROFILE_STEP, extra, profile_to=stats_file)
    with (
        server as url,
        concurrent.futures.ProcessPoolExecutor(
            CLIENTS, mp_context=multiprocessing.get_context("spawn")
        ) as pool,
    ):
        pid = server.proc.pid
        run_clients(pool, url, reqs, streams, CLIENTS)  # warm-up
        cpu = cpu_seconds(pid)
        plain = run_clients(pool, url, reqs, streams, CLIENTS)
        cpu = cpu_seconds(pid) - cpu
        os.kill(pid, signal.SIGUSR1)
        under = run_clients(pool, url, reqs, streams, CLIENTS)
        os.kill(pid, signal.SIGUSR2)
    stats = pstats.Stats(str(stats_file))  # written at the server's exit (SIGINT: a graceful shutdown)
    shutil.rmtree(stats_file.parent)
    seconds = profiled.shares(stats, FRONTEND_CATEGORIES)
    idle = seconds.pop("idle (waiting in epoll)")
    busy = sum(seconds.values())
    events = sum(len(r["itl_s"]) + 1 for r in plain["requests"])
    cpu_us = 1e6 * cpu / tokens
    out = {
        "streams": streams,
        "requests": len(reqs),
        "tokens": tokens,
        "unprofiled": {k: v for k, v in summarise(plain).items() if k != "requests"},
        "events_per_token": events / tokens,
        "frontend_cpu_s": cpu,
        "frontend_cpu_us_per_token": cpu_us,
        "profiled": {k: v for k, v in summarise(under).items() if k != "requests"},
        "profiled_busy_s": busy,
        "profiled_idle_s": idle,
        "share": {k: v / busy for k, v in seconds.items()},
        "us_per_token_profiled": {k: 1e6 * v / tokens for k, v in seconds.items()},
        "us_per_token": {k: cpu_us * v / busy for k, v in seconds.items()},
        "top_tottime": profiled.top_functions(stats, "tottime", top),
        "top_cumtime": profiled.top_functions(stats, "cumtime", top),
    }
    print(
        f"  server at {streams} streams: {out['unprofiled']['throughput_tok_s']:.0f} tok/s, frontend "
        f"{cpu_us:.1f} us CPU per token, {out['events_per_token']:.2f} events per token",
        flush=True,
    )
    return out


class SyntheticCore:
    """An engine core without a model, for the frontend alone: each step gives every running request its
    next token (``token_ids``, cycled) until its max_tokens, as one ``EngineCoreOutputs``. ``get_output``
    is ``InprocClient``'s (the step, no copy); ``get_output_async`` the server's (it waits for
    ``start_after`` requests, then sends each step through msgspec, as the socket does; then
    ``get_output_nowait`` finds the next step waiting: a core ahead of its frontend). ``core_s``: the CPU
    time (``time.thread_time``) spent making the steps and encoding them, not the frontend's."""

    def __init__(self, package: str, folder: Path, max_num_seqs: int, token_ids: list[int], start_after=1):
        from common.weights import load_config

        self.m = m = importlib.import_module(f"{package}.messages")
        config = load_config(folder)
        self.stats = m.SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)
        self.config = m.EngineCoreReady(
            os.getpid(), str(folder), config, config.n_positions, max_num_seqs, 0, 16, {}, self.stats
        )
        self.token_ids, self.start_after, self.alive = token_ids, start_after, True
        self.running: dict[str, list[int]] = {}  # request id -> [max_tokens, tokens so far]
        self.num_received, self.steps, self.core_s, self.first_step = 0, 0, 0.0, None
        self.encoder, self.decoder = m.output_encoder(), m.output_decoder()
        self.arrived: asyncio.Event | None = None
        self.profiler: cProfile.Profile | None = None  # switched on at the first step

    def add_request(self, request) -> None:
        self.running[request.request_id] = [request.sampling_params.max_tokens, 0]
        self.num_received += 1
        if self.arrived is not None:
            self.arrived.set()

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        self.running.pop(request_id, None)

    def get_output(self):
        started = time.thread_time()
        if self.first_step is None:
            self.first_step = started
            if self.profiler is not None:
                self.profiler.enable()
        outputs, ids = [], self.token_ids
        for request_id, state in list(self.running.items()):
            state[1] += 1
            finish = "length" if state[1] >= state[0] else None
            outputs.append(self.m.EngineCoreOutput(request_id, 0, [ids[state[1] % len(ids)]], None, finish))
            if finish:
                del self.running[request_id]
        self.steps += 1
        out = self.m.EngineCoreOutputs(outputs, self.stats, time.perf_counter(), self.num_received, 0, {})
        self.core_s += time.thread_time() - started
        return out

    async def get_output_async(self):
        self.arrived = self.arrived or asyncio.Event()
        while self.num_received < self.start_after or not self.running:
            self.arrived.clear()
            await self.arrived.wait()
        return self.decoder.decode(self._frame())

    def _frame(self) -> bytes:
        outputs = self.get_output()
        started = time.thread_time()
        frame = self.encoder.encode(outputs)
        self.core_s += time.thread_time() - started
        return frame

    def get_output_nowait(self):
        return self.decoder.decode(self._frame()) if self.running else None

    def shutdown(self) -> None:
        pass


def frontend_alone(package: str, folder: Path, requests: int, max_tokens: int, runs: int) -> dict:
    """Microseconds per token of ``package``'s frontend (step 10 or a copy of it) over a ``SyntheticCore``:
    the server's path (``AsyncEngine``, the collectors, ``create_completion``'s SSE body, read by one
    task per request in place of the HTTP send; with its metrics) and ``LLM.generate``'s (FINAL_ONLY).
    CPU time of this thread (``time.thread_time``: another process's load moves it less than a wall
    clock) less the synthetic core's. Medians of ``runs`` after a warm-up."""
    from common.tokenizer import Tokenizer

    ids = Tokenizer(folder).encode(SAMPLE_TEXT)
    calls = {
        "server": lambda: _frozen(lambda: _server_alone(package, folder, ids, requests, max_tokens)),
        "llm": lambda: _llm_alone(package, folder, ids, requests, max_tokens),
    }
    raw = harness.alternate(calls, runs)
    out = {k: harness.medians(v) for k, v in raw.items()}
    profiler = cProfile.Profile()
    _frozen(lambda: _server_alone(package, folder, ids, requests, max_tokens, profiler))
    seconds = profiled.shares(pstats.Stats(profiler), ALONE_CATEGORIES)
    del seconds[ALONE_CATEGORIES[0][0]], seconds[FRONTEND_CATEGORIES[0][0]]  # the benchmark's; idle (none)
    busy, us = sum(seconds.values()), out["server"]["us_per_token"]
    out["server"]["share"] = {k: v / busy for k, v in seconds.items()}
    out["server"]["us_per_token_by_category"] = {k: us * v / busy for k, v in seconds.items()}
    return out


def _frozen(fn):
    """``fn()`` with the heap made so far frozen (``gc.freeze``, as step 10's server does once started),
    so that the collections it triggers scan only what it makes."""
    gc.collect()
    gc.freeze()
    try:
        return fn()
    finally:
        gc.unfreeze()


def _server_alone(package: str, folder: Path, ids: list[int], requests: int, max_tokens: int, profiler=None):
    mod = {m: importlib.import_module(f"{package}.{m}") for m in ("async_engine", "metrics", "protocol")}
    serving_engine = importlib.import_module(f"{package}.serving_engine")
    serving_completion = importlib.import_module(f"{package}.serving_completion")
    core = SyntheticCore(package, folder, requests, ids, start_after=requests)
    core.profiler = profiler
    body = dict(prompt=ids[:8], max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)

    async def client(serving) -> int:
        req = mod["protocol"].CompletionRequest(**body, stream_options={"include_usage": True})
        response = await serving_completion.create_completion(serving, req, None)
        events = sum([1 async for _ in response.body_iterator]) - 2  # the usage chunk, [DONE]
        response.on_close()
        return events

    async def main() -> tuple[int, float]:
        metrics = mod["metrics"].ServerMetrics("demo")
        engine = mod["async_engine"].AsyncEngine(core, metrics, max_waiting_requests=10**6)
        engine.start()
        serving = serving_engine.OpenAIServing("demo", engine, metrics, None)
        events = await asyncio.gather(*(client(serving) for _ in range(requests)))
        ended = time.thread_time()
        if profiler is not None:
            profiler.disable()
        await engine.shutdown()
        return sum(events), ended

    events, ended = asyncio.run(main())
    tokens = requests * max_tokens
    return {
        "us_per_token": 1e6 * (ended - core.first_step - core.core_s) / tokens,
        "events_per_token": events / tokens,
        "steps": core.steps,
    }


def _llm_alone(package: str, folder: Path, ids: list[int], requests: int, max_tokens: int) -> dict:
    module = importlib.import_module(package)
    llm = module.LLM(model=str(folder), multiprocessing=False, max_num_seqs=requests, num_kv_blocks=64)
    llm.engine_core = core = SyntheticCore(package, folder, requests, ids)
    params = module.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    gc.collect()
    started = time.thread_time()
    outs = llm.generate(prompt_token_ids=[ids[:8]] * requests, sampling_params=params)
    cpu = time.thread_time() - started - core.core_s
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"us_per_token": 1e6 * cpu / tokens, "steps": core.steps}


def frontend_report(result: dict) -> str:
    """The frontend alone (us per token, by category), then the server at 64 streams: its figures, the
    frontend's CPU per streamed token by category, the top functions by own time."""
    lines = []
    for name, model in result["models"].items():
        a, p = model["alone"], model["profile"]
        lines.append(
            f"{name}: the frontend alone: server path {a['server']['us_per_token']:.2f} us/token "
            f"({a['server']['events_per_token']:.2f} events/token), LLM.generate "
            f"{a['llm']['us_per_token']:.2f}"
        )
        for k, v in sorted(a["server"]["us_per_token_by_category"].items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<46} {v:>6.2f}  {100 * a['server']['share'][k]:>5.1f}%")
        u = p["unprofiled"]
        lines.append(
            f"  server at {p['streams']} streams: {u['throughput_tok_s']:.0f} tok/s, TTFT p50 "
            f"{1e3 * u['ttft_p50_s']:.1f} ms, ITL p50 {1e3 * u['itl_p50_s']:.2f} ms, "
            f"{p['events_per_token']:.2f} events/token; frontend CPU {p['frontend_cpu_us_per_token']:.1f} "
            "us/token, by category (us/token, share):"
        )
        for k, v in sorted(p["us_per_token"].items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<46} {v:>6.2f}  {100 * p['share'][k]:>5.1f}%")
        lines.append("  top functions by own time (profiled s):")
        for row in p["top_tottime"][:12]:
            lines.append(f"    {row['tottime_s']:>7.3f} {row['calls']:>8} {row['function']}")
    return "\n".join(lines)


def frontend_plot(result: dict, path: Path) -> Path:
    """One bar per category: us per streamed token (the unprofiled CPU time split by the profile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, model) in enumerate(result["models"].items()):
        p = model["profile"]
        keys = list(p["us_per_token"])
        ax.barh([k for k in keys], [p["us_per_token"][k] for k in keys], color=f"C{i}", label=name)
    ax.set_xlabel("microseconds of frontend CPU per streamed token")
    streams = next(iter(result["models"].values()))["profile"]["streams"]
    ax.set_title(f"step 10's frontend at {streams} streams, by category")
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    fig.tight_layout()
    return harness.save_figure(fig, path)

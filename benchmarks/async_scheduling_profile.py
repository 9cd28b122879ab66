"""Step 8's async scheduling, seen by torch.profiler: how long the GPU idles between two decode steps, 7 vs 8.

GPT-2 124M's shape, random weights, fp16, 256 requests of 32-token prompts all decoding, on step 7's engine
and step 8's: ms per decode step without the profiler, then the same steps under torch.profiler, each
``LLMEngine.step`` in a ``record_function``. Each GPU activity belongs to the step whose host range launched
it; the idle share is the gap between two steps' activities over the GPU period (an upper bound: the profiler
slows the host). Details and the JSON layout: benchmarks/README.md.

    python -m benchmarks async_scheduling_profile --device cuda
    python -m benchmarks async_scheduling_profile --quick
"""

from __future__ import annotations

import importlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.weights import load_config

from .lib import harness, workloads
from .lib.models import snapshot

NAME = "async_scheduling_profile"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 1  # unused: one timed and one profiled window of ``steps`` decode steps per engine
BLOCK_SIZE = 16
TOKEN_ID_SEED = 3000
ENGINES = {  # name -> (package, extra LLMEngine arguments)
    "step7": ("step7_cuda_graphs", {}),
    "step8": ("step8_async_scheduling", {"async_scheduling": True}),  # its default on CUDA; forced on a CPU
}
FULL = {
    "dtype": "float16",
    "batch_size": 256,
    "workload": {"prompt_tokens": 32, "max_tokens": 128},
    "warmup_steps": 5,
    "steps": 20,
}
QUICK = {
    "dtype": "float32",
    "batch_size": 4,
    "workload": {"prompt_tokens": 8, "max_tokens": 16},
    "warmup_steps": 1,
    "steps": 4,
}
STEP_MARK = "decode_step_"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # GPU activities in a chrome trace
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # their launches on the host (Triton: the driver API)


def main(models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False):
    """The CLI entry (``python -m benchmarks async_scheduling_profile --device cuda``)."""
    return run(models or DEFAULT_MODELS, device, QUICK if quick else FULL, quick)


def run(models: list[str], device: str, spec: dict, quick: bool = False, out_dir=harness.RESULTS) -> dict:
    """Both engines on each model; writes ``<out_dir>/async_scheduling_profile-<device>.json``, ``.png``."""
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, spec["dtype"]),
        "workload": {
            **spec,
            "quick": quick,
            "block_size": BLOCK_SIZE,
            "engines": {
                name: f"{package}.LLMEngine(max_num_seqs=B, block_size={BLOCK_SIZE}, num_kv_blocks = B x the "
                f"blocks of one request{''.join(f', {k}={v}' for k, v in extra.items())})"
                for name, (package, extra) in ENGINES.items()
            },
            "requests": "B at once, greedy, ignore_eos, output_kind FINAL_ONLY; prompt ids: "
            f"torch.Generator().manual_seed({TOKEN_ID_SEED} + i); every request prefilled, then "
            "warmup_steps decode steps, before anything is measured",
            "timing": "ms_per_step: time.perf_counter around `steps` calls of step(), the device "
            "synchronised before and after, no profiler; gaps: torch.profiler (CPU and CUDA activities) over "
            "`steps` more calls",
        },
        "models": {},
    }
    harness.run_models(result, models, lambda name: bench_model(name, device, spec))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(name: str, device: str, spec: dict) -> dict:
    folder = snapshot(name)
    config = load_config(folder)
    out = {"snapshot": str(folder), "engines": {}}
    for engine_name, (package, extra) in ENGINES.items():
        module = importlib.import_module(package)
        engine = make_engine(module, folder, device, spec, extra)
        add_requests(engine, module, spec, config.vocab_size)
        while engine.scheduler.waiting:  # every prefill (the default token budget takes a few per step)
            engine.step()
        for _ in range(spec["warmup_steps"]):
            engine.step()
        point = {"ms_per_step": 1e3 * timed_steps(engine, spec["steps"], device) / spec["steps"]}
        trace = profiled_trace(engine, spec["steps"], device)
        point |= step_gaps(trace)
        point["running"] = engine.stats.num_running_reqs
        out["engines"][engine_name] = point
        idle = point["idle_between_steps_share"]
        print(
            f"  {engine_name}: {point['ms_per_step']:.3f} ms per decode step"
            + ("" if idle is None else f", GPU idle between steps {100 * idle:.1f}% of the step"),
            flush=True,
        )
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        del engine
        harness.free(device)
    return out


def make_engine(module, folder: Path, device: str, spec: dict, extra: dict):
    w = spec["workload"]
    return module.LLMEngine(
        model=str(folder),
        device=device,
        dtype=spec["dtype"],
        block_size=BLOCK_SIZE,
        max_num_seqs=spec["batch_size"],
        num_kv_blocks=spec["batch_size"] * -(-(w["prompt_tokens"] + w["max_tokens"]) // BLOCK_SIZE),
        **extra,
    )


def add_requests(engine, module, spec: dict, vocab_size: int) -> None:
    w = spec["workload"]
    equal = workloads.equal(spec["batch_size"], w["prompt_tokens"], w["max_tokens"], TOKEN_ID_SEED)
    for i, r in enumerate(workloads.requests(equal, vocab_size)):
        params = module.SamplingParams(
            max_tokens=r.max_tokens,
            temperature=0,
            ignore_eos=True,
            output_kind=module.RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(str(i), r.prompt_token_ids, params)


def timed_steps(engine, steps: int, device: str) -> float:
    """Seconds for ``steps`` calls of ``engine.step()``, the device synchronised before and after."""
    harness.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    harness.synchronize(device)
    return time.perf_counter() - start


def profiled_trace(engine, steps: int, device: str) -> dict:
    """``steps`` calls of ``engine.step()`` under torch.profiler, each in ``record_function``; the chrome
    trace as a dict (its ``traceEvents``: host ops and ranges, and on CUDA the GPU's activities)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    harness.synchronize(device)
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"{STEP_MARK}{i}"):
                engine.step()
        harness.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def step_gaps(trace: dict) -> dict:
    """The GPU's idle time between consecutive profiled steps, from a chrome trace (``profiled_trace``).

    Each GPU activity is given to the step whose host range (``record_function``) holds its launch (same
    correlation id). Per step i (in microseconds): its GPU span (first start to last end), its GPU busy time
    (the union of its activities), the gap from its last end to step i + 1's first start, and the period
    (first start to first start). Returns the per-step list, the host ms per step (the ranges' mean), and
    the gap as a share of the period (median over steps), None without GPU activities."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], int(e["name"][len(STEP_MARK) :]))
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP_MARK)
    )
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    by_step: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") not in DEVICE_CATEGORIES:
            continue
        launched = launches.get(e.get("args", {}).get("correlation"))
        step = next((i for a, b, i in ranges if launched is not None and a <= launched <= b), None)
        if step is not None:
            by_step.setdefault(step, []).append((e["ts"], e["ts"] + e["dur"]))
    steps = []
    for i in sorted(by_step):
        intervals = sorted(by_step[i])
        busy, end = 0.0, float("-inf")
        for a, b in intervals:  # the union's length
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        steps.append({"step": i, "first_us": intervals[0][0], "last_us": end, "busy_us": busy})
    for s, nxt in zip(steps, steps[1:]):
        if nxt["step"] == s["step"] + 1:
            s["gap_us"] = max(0.0, nxt["first_us"] - s["last_us"])
            s["period_us"] = nxt["first_us"] - s["first_us"]
    shares = [s["gap_us"] / s["period_us"] for s in steps if s.get("period_us")]
    return {
        "host_ms_per_step_profiled": 1e-3 * statistics.mean(b - a for a, b, _ in ranges) if ranges else None,
        "host_ranges_us": [[a, b] for a, b, _ in ranges],
        "gpu_steps": steps,
        "idle_between_steps_share": statistics.median(shares) if shares else None,
        "gpu_busy_share": (
            sum(s["busy_us"] for s in steps if s.get("period_us"))
            / sum(s["period_us"] for s in steps if s.get("period_us"))
            if shares
            else None
        ),
    }


def report(result: dict) -> str:
    """ms per decode step and the GPU's idle share between steps, per engine, with the target line."""
    m, w = result["machine"], result["workload"]
    lines = [
        f"{NAME} on {m['device']} ({m.get('gpu') or m['cpu']}), torch {m['torch']}, {w['dtype']}, "
        f"B = {w['batch_size']}, {w['workload']['prompt_tokens']}-token prompts, {w['steps']} decode steps"
    ]
    for name, model in result["models"].items():
        lines.append(f"\n## {name}")
        rows = [
            [
                engine,
                p["ms_per_step"],
                p["host_ms_per_step_profiled"],
                None
                if p["idle_between_steps_share"] is None
                else f"{100 * p['idle_between_steps_share']:.1f}%",
                None if p["gpu_busy_share"] is None else f"{100 * p['gpu_busy_share']:.1f}%",
            ]
            for engine, p in model["engines"].items()
        ]
        lines.append(
            harness.table(
                ["engine", "ms/step", "ms/step profiled", "GPU idle between steps", "GPU busy"], rows
            )
        )
        ours = model["engines"].get("step8", {}).get("idle_between_steps_share")
        if ours is not None:
            full = not w["quick"] and w["batch_size"] == FULL["batch_size"]
            lines.append(
                harness.target_line("step8: GPU idle between decode steps", 100 * ours, "< 10", "%", full)
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: the GPU's activities of the first profiled steps, one row per engine, a colour per step
    (the host's step ranges where there is no GPU timeline); beside it, ms per decode step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(
        len(models), 2, figsize=(13, 3.2 * len(models)), squeeze=False, gridspec_kw={"width_ratios": [3, 1]}
    )
    for (name, model), (ax1, ax2) in zip(models, axes):
        engines = list(model["engines"].items())
        for row, (engine, p) in enumerate(engines):
            shown = p["gpu_steps"][:4]
            spans = [(s["first_us"], s["last_us"]) for s in shown] or [
                tuple(r) for r in p["host_ranges_us"][:4]
            ]
            origin = spans[0][0] if spans else 0.0
            for k, (a, b) in enumerate(spans):
                ax1.broken_barh([(1e-3 * (a - origin), 1e-3 * (b - a))], (row - 0.3, 0.6), color=f"C{k % 10}")
        ax1.set_yticks(range(len(engines)), [e for e, _ in engines])
        what = "GPU activity" if any(p["gpu_steps"] for _, p in engines) else "host step ranges (no GPU)"
        ax1.set(xlabel="ms from the first profiled step", title=f"{name}: {what}, a colour per decode step")
        ax1.grid(axis="x", alpha=0.3)
        ax2.bar(
            [e for e, _ in engines],
            [p["ms_per_step"] for _, p in engines],
            color=["C7", "C5"][: len(engines)],
        )
        ax2.set(ylabel="ms per decode step", title="without the profiler")
    m = result["machine"]
    w = result["workload"]
    fig.suptitle(
        f"async scheduling (step 8) vs serial (step 7), {m['device']} ({m.get('gpu') or m['cpu']}), "
        f"{w['dtype']}, B = {w['batch_size']}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

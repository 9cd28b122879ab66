"""Step 7's CUDA graphs from inside one engine step: where a decode step's time goes, what the ladder costs.

GPT-2 124M's shape, random weights, fp16, blocks of 16, 32-token prompts, 128 generated: a. the kernels of
one eager ``decode_forward`` (what the graphs capture) and their GPU time at B = 1 and 256; b. a decode
step's breakdown, graphs and ``enforce_eager`` (host: inputs, launch, sampling, the rest of ``step``; GPU:
forward, sampler); c. the ladder: replay and eager at every rung, and what padding to a rung costs with rungs
every 8 or 16. ``--quick`` (CPU): a and b, eagerly. Details and the JSON layout: benchmarks/README.md.

    python -m benchmarks cuda_graphs --device cuda
    python -m benchmarks cuda_graphs --quick
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from common.weights import load_config

from .gpu import memory_floor
from .lib import harness, workloads
from .lib.models import snapshot

NAME = "cuda_graphs"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 20  # replays timed per ladder size
BLOCK_SIZE = 16
TOKEN_ID_SEED = 3000
FULL = {
    "dtype": "float16",
    "batch_sizes": [1, 256],
    "workload": {"prompt_tokens": 32, "max_tokens": 128},
    "steps": 64,
    "ladder": [1, 2, 4, *range(8, 257, 8)],
    "ladder_context": 100,
}
QUICK = {
    "dtype": "float32",
    "batch_sizes": [1, 4],
    "workload": {"prompt_tokens": 8, "max_tokens": 8},
    "steps": 4,
    "ladder": [1, 2, 4],
    "ladder_context": 8,
}
PHASES = ("prepare", "forward_launch", "sample", "rest")  # host time of one step, in order


def main(models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False):
    """The CLI entry (``python -m benchmarks cuda_graphs --device cuda``). runs: replays per ladder size."""
    return run(models or DEFAULT_MODELS, device, runs, QUICK if quick else FULL, quick)


def run(models: list[str], device: str, runs: int, spec: dict, quick: bool = False, out_dir=harness.RESULTS):
    """Every part on each model; writes ``<out_dir>/cuda_graphs-<device>.json`` and ``.png``."""
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": {
            **harness.machine_info(device, spec["dtype"]),
            "copy_bandwidth_bytes_per_s": harness.copy_bandwidth(device),
        },
        "workload": {
            **spec,
            "ladder": list(spec["ladder"]),
            "runs": runs,
            "quick": quick,
            "block_size": BLOCK_SIZE,
            "engine": "step7_cuda_graphs.LLMEngine(max_num_seqs=B, block_size=16, num_kv_blocks = B x the "
            "blocks of one request), greedy, ignore_eos; prompts of random ids: "
            f"torch.Generator().manual_seed({TOKEN_ID_SEED} + i)",
            "timing": "breakdown: time.perf_counter around each phase (host) and CUDA events (device), means "
            "over the decode steps; ladder: median of `runs` CUDA-event timings per size",
        },
        "models": {},
    }
    bandwidth = result["machine"]["copy_bandwidth_bytes_per_s"]
    harness.run_models(result, models, lambda name: bench_model(name, device, runs, spec, bandwidth))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def make_engine(folder: Path, device: str, dtype: str, b: int, length: int, enforce_eager: bool):
    """Step 7's engine for B requests of ``length`` tokens, all at once, nothing preempted."""
    import step7_cuda_graphs

    return step7_cuda_graphs.LLMEngine(
        model=str(folder),
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        max_num_seqs=b,
        num_kv_blocks=b * -(-length // BLOCK_SIZE),
        enforce_eager=enforce_eager,
    )


def add_requests(engine, b: int, prompt_tokens: int, max_tokens: int, vocab_size: int) -> None:
    import step7_cuda_graphs

    reqs = workloads.requests(workloads.equal(b, prompt_tokens, max_tokens, TOKEN_ID_SEED), vocab_size)
    for i, r in enumerate(reqs):
        params = step7_cuda_graphs.SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(str(i), r.prompt_token_ids, params)


def prefill_all(engine) -> None:
    """Step until every request has been prefilled (a step takes at most max_num_batched_tokens tokens)."""
    while engine.scheduler.waiting:
        engine.step()


def bench_model(name: str, device: str, runs: int, spec: dict, bandwidth: float) -> dict:
    folder = snapshot(name)
    config = load_config(folder)
    w = spec["workload"]
    length = w["prompt_tokens"] + w["max_tokens"]
    out = {"snapshot": str(folder), "kernels": [], "breakdown": [], "ladder": None}
    cuda = torch.device(device).type == "cuda"
    for b in spec["batch_sizes"]:
        for eager in (False, True) if cuda else (True,):
            engine = make_engine(folder, device, spec["dtype"], b, length, eager)
            add_requests(engine, b, w["prompt_tokens"], w["max_tokens"], config.vocab_size)
            prefill_all(engine)
            engine.step()  # one decode step: the buffers hold a decode batch (what decode_forward reads)
            if eager:
                out["kernels"].append({"batch_size": b, **count_kernels(engine, b, device)})
            point = breakdown(engine, b, spec["steps"], device)
            params = sum(p.numel() for p in engine.model.parameters())
            item = torch.empty((), dtype=engine.dtype).element_size()
            floor = memory_floor(params, config, item, b, w, bandwidth)
            point["memory_floor"] = floor
            point["share_of_memory_floor"] = floor["ms_per_token"] / (1e3 * point["host_s"]["step"])
            out["breakdown"].append({"batch_size": b, "graphs": not eager, **point})
            mode = "eager" if eager else "graphs"
            print(f"  B = {b}, {mode}: {1e3 * point['host_s']['step']:.3f} ms per step", flush=True)
            del engine
            harness.free(device)
    if cuda:
        out["ladder"] = ladder_study(folder, device, runs, spec, config.vocab_size)
    return out


@torch.inference_mode()
def count_kernels(engine, b: int, device: str) -> dict:
    """The CUDA kernels (and their summed GPU time) of one eager ``decode_forward`` over b lanes, from
    torch.profiler; on a CPU, the operators it runs instead."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.model_runner
    cuda = torch.device(device).type == "cuda"
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    runner.decode_forward(b)  # the inputs of the last step are still in the buffers
    harness.synchronize(device)
    with profile(activities=[activity]) as prof:
        runner.decode_forward(b)
        harness.synchronize(device)
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return {
            "kernels": len(kernels),
            "kernel_time_s": sum(e.device_time for e in kernels) / 1e6,  # µs -> s
            "what": "CUDA kernels",
        }
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    return {"kernels": len(ops), "kernel_time_s": None, "what": "aten operators (CPU)"}


def breakdown(engine, b: int, steps: int, device: str) -> dict:
    """Host and device time of ``steps`` decode steps of ``engine`` (its prefills done), per phase: the
    engine's runner methods are wrapped with timers and CUDA events for the run (see the module doc).
    Returns means per step, in seconds: host_s {prepare, forward_launch, sample, rest, step} and, on a
    GPU, device_s {forward, sample}; the number of steps and their decode tokens per second."""
    runner = engine.model_runner
    cuda = torch.device(device).type == "cuda"
    host = {k: 0.0 for k in (*PHASES[:-1], "step")}
    pairs = []  # per step: (forward start, forward end, ids back) events

    def timed(name, fn, mark=None):
        def wrapper(*args):
            if mark == "forward" and cuda:
                pairs.append([torch.cuda.Event(enable_timing=True) for _ in range(3)])
                pairs[-1][0].record()
            start = time.perf_counter()
            value = fn(*args)
            host[name] += time.perf_counter() - start
            if cuda and mark == "forward":
                pairs[-1][1].record()
            if cuda and mark == "sample":
                pairs[-1][2].record()
            return value

        return wrapper

    graphs = runner.graph_runner
    forward_owner, forward_name = (graphs, "replay") if graphs is not None else (runner, "decode_forward")
    originals = [(runner.input_batch, "prepare"), (forward_owner, forward_name), (runner, "sample")]
    runner.input_batch.prepare = timed("prepare", runner.input_batch.prepare)
    setattr(
        forward_owner, forward_name, timed("forward_launch", getattr(forward_owner, forward_name), "forward")
    )
    runner.sample = timed("sample", runner.sample, "sample")
    harness.synchronize(device)
    done = 0
    try:
        start = time.perf_counter()
        while done < steps and engine.has_unfinished_requests():
            engine.step()
            done += 1
        harness.synchronize(device)
        host["step"] = time.perf_counter() - start
    finally:
        for owner, attr in originals:
            del owner.__dict__[attr]  # the wrapper was an instance attribute: the method shows again
    mean = {k: v / done for k, v in host.items()}
    mean["rest"] = mean["step"] - sum(mean[k] for k in PHASES[:-1])
    out = {"steps": done, "host_s": mean, "decode_tok_s": b / mean["step"]}
    if cuda:
        forward = [p[0].elapsed_time(p[1]) / 1e3 for p in pairs]
        sample = [p[1].elapsed_time(p[2]) / 1e3 for p in pairs]
        out["device_s"] = {"forward": statistics.mean(forward), "sample": statistics.mean(sample)}
        out["gpu_busy_share"] = (out["device_s"]["forward"] + out["device_s"]["sample"]) / mean["step"]
    return out


@torch.inference_mode()
def ladder_study(folder: Path, device: str, runs: int, spec: dict, vocab_size: int) -> dict:
    """Replay and eager time of the decode forward at every size of ``spec["ladder"]`` (see the module doc),
    and what the ladders of 8 and 16 cost: capture seconds and memory, mean time of a rung over the batch
    sizes 1..max."""
    from step7_cuda_graphs.cuda_graph import CUDAGraphRunner, capture_sizes, padded_size
    from step7_cuda_graphs.scheduler import SchedulerOutput

    sizes = list(spec["ladder"])
    top = max(sizes)
    context = spec["ladder_context"]
    engine = make_engine(folder, device, spec["dtype"], top, context + 1, enforce_eager=True)
    add_requests(engine, top, context, 2, vocab_size)
    prefill_all(engine)  # `top` sequences of `context` tokens, each with its first token to feed
    runner = engine.model_runner
    seqs = list(engine.scheduler.running)
    ladders = {}
    for step in (8, 16):
        graphs = CUDAGraphRunner(
            runner.decode_forward, capture_sizes(top, step), vocab_size, engine.dtype, device
        )
        runner.input_batch.fill_padding(top)
        ladders[step] = {"graphs": graphs, "stats": graphs.capture()}
    every = CUDAGraphRunner(runner.decode_forward, sizes, vocab_size, engine.dtype, device)
    runner.input_batch.fill_padding(top)
    every.capture()
    times = []
    for b in sorted(sizes, reverse=True):  # each batch a prefix of the one before (rows of the others drop)
        runner.input_batch.prepare(SchedulerOutput(decodes=seqs[:b]), engine.block_manager.block_tables, b)
        times.append(
            {
                "batch_size": b,
                "replay_s": event_median(lambda b=b: every.replay(b), runs),
                "eager_s": event_median(lambda b=b: runner.decode_forward(b), runs),
            }
        )
    times.sort(key=lambda t: t["batch_size"])
    replay = {t["batch_size"]: t["replay_s"] for t in times}
    out = {"context_tokens": context, "points": times, "ladders": {}}
    for step, ladder in ladders.items():
        rungs = ladder["stats"].sizes
        per_size = [
            replay[padded_size(rungs, b)] for b in range(1, top + 1) if padded_size(rungs, b) in replay
        ]
        out["ladders"][step] = {
            **dataclasses.asdict(ladder["stats"]),
            "mean_rung_replay_s": statistics.mean(per_size),
        }
    return out


def event_median(fn, repeats: int) -> float:
    """The median of ``repeats`` CUDA-event timings of ``fn()`` (after one untimed call), in seconds."""
    fn()
    found = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        found.append(start.elapsed_time(end) / 1e3)
    return statistics.median(found)


def report(result: dict) -> str:
    """The kernel counts, the step breakdown table and the ladder's figures, per model."""
    m = result["machine"]
    lines = [
        f"cuda_graphs on {m['device']} ({m.get('gpu') or m['cpu']}), torch {m['torch']}, "
        f"{result['workload']['dtype']}, copy bandwidth {m['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s"
    ]
    for name, model in result["models"].items():
        lines.append(f"\n## {name}")
        for k in model["kernels"]:
            t = k["kernel_time_s"]
            extra = f", {1e3 * t:.3f} ms of GPU time" if t is not None else ""
            lines.append(f"decode forward at B = {k['batch_size']}: {k['kernels']} {k['what']}{extra}")
        rows = []
        for p in model["breakdown"]:
            h, d = p["host_s"], p.get("device_s", {})
            rows.append(
                [
                    p["batch_size"],
                    "graphs" if p["graphs"] else "eager",
                    *[1e3 * h[k] for k in (*PHASES, "step")],
                    1e3 * d["forward"] if d else None,
                    1e3 * d["sample"] if d else None,
                    p["decode_tok_s"],
                    f"{100 * p['share_of_memory_floor']:.0f}%",
                ]
            )
        lines.append(
            "\nper decode step, ms (host: prepare, forward launch, sample + wait, rest; GPU: forward, sample)"
        )
        lines.append(
            harness.table(
                ["B", "mode", *PHASES, "step", "GPU fwd", "GPU sample", "tok/s", "of floor"],
                rows,
            )
        )
        ladder = model.get("ladder")
        if ladder:
            lines.append(
                f"\nladder at a context of {ladder['context_tokens']} tokens: replay vs eager forward, ms"
            )
            lines.append(
                harness.table(
                    ["B", "replay", "eager"],
                    [[p["batch_size"], 1e3 * p["replay_s"], 1e3 * p["eager_s"]] for p in ladder["points"]],
                )
            )
            for step, lad in ladder["ladders"].items():
                lines.append(
                    f"ladder every {step}: {len(lad['sizes'])} graphs, captured in {lad['seconds']:.2f} s, "
                    f"{lad['memory_bytes'] / 2**20:.0f} MiB; a batch of 1..{max(lad['sizes'])} replays its "
                    f"rung in {1e3 * lad['mean_rung_replay_s']:.3f} ms on average"
                )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: the forward pass's time against B, replayed and eager (log-log), and the step breakdown
    as stacked bars (host phases) beside the GPU's forward time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"].items())
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.8 * len(models)), squeeze=False)
    for (name, model), (ax1, ax2) in zip(models, axes):
        ladder = model.get("ladder")
        if ladder:
            bs = [p["batch_size"] for p in ladder["points"]]
            ax1.plot(
                bs, [1e3 * p["replay_s"] for p in ladder["points"]], marker="o", ms=3, label="replayed graph"
            )
            ax1.plot(bs, [1e3 * p["eager_s"] for p in ladder["points"]], marker="o", ms=3, label="eager")
            ax1.set(xscale="log", yscale="log", xlabel="B (decodes)", ylabel="forward pass, ms")
            ax1.set_title(f"{name}: decode forward at a context of {ladder['context_tokens']} tokens")
            ax1.grid(alpha=0.3)
            ax1.legend(fontsize=8)
        else:
            ax1.set_axis_off()
        points = model["breakdown"]
        labels = [f"B={p['batch_size']}\n{'graphs' if p['graphs'] else 'eager'}" for p in points]
        bottoms = [0.0] * len(points)
        for phase in PHASES:
            heights = [1e3 * p["host_s"][phase] for p in points]
            ax2.bar(labels, heights, bottom=bottoms, label=f"host: {phase}")
            bottoms = [a + b for a, b in zip(bottoms, heights)]
        if all("device_s" in p for p in points):
            ax2.scatter(
                labels,
                [1e3 * p["device_s"]["forward"] for p in points],
                color="k",
                zorder=3,
                label="GPU: forward",
            )
        ax2.set(ylabel="ms per decode step", title=f"{name}: one decode step")
        ax2.legend(fontsize=8)
    m = result["machine"]
    fig.suptitle(
        f"CUDA graphs (step 7), {m['device']} ({m.get('gpu') or m['cpu']}), {result['workload']['dtype']}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

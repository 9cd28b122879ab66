"""Step 16's benchmark: five fused kernels a layer against step 15 and step 15 compiled by torch.compile
inside the same CUDA graphs. Per engine and batch B (1, 16, 64, 256 x (32 random ids + exactly 128 greedy
tokens), in process, alternated): ms/token, tok/s; the decode graph of B lanes replayed alone: kernels
(torch.profiler), GPU ms (CUDA events), the share of the memory floor (weights and KV read, over the copy
bandwidth of this run); the host's ms per step: a step's wall less its waits for the device, and the same
engine's steps on the demo checkpoint (7M parameters: little GPU work a kernel).

    python -m benchmarks fused_kernels --device cuda     # gpt2-124m-random, fp16 (the recorded run)
    python -m benchmarks fused_kernels --quick           # CPU, the demo: checks that it runs
"""

from __future__ import annotations

import functools
import gc
import random
import time
from pathlib import Path

import torch

from common.weights import load_config

from .lib import harness
from .lib.models import raise_recompile_limit, snapshot

NAME = "fused_kernels"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3
BATCHES = [1, 16, 64, 256]
PROMPT_TOKENS, MAX_TOKENS = 32, 128
QUICK = {"batches": [1, 2], "prompt_tokens": 8, "max_tokens": 4}
BLOCK_SIZE = 16
TOKEN_ID_SEED = 16000
REPLAYS = 50  # decode-graph replays timed per engine and batch
# where step 15 runs compiled too (a compilation takes about half a minute): the batches step 16 fuses
COMPILED_BATCHES = (1, 16, 64)
ENGINES = {
    "step15": "step15_tensor_parallel.LLMEngine, its defaults (CUDA graphs, async scheduling)",
    "step15_compiled": "the same, its model compiled by torch.compile (Inductor, default mode) before its "
    "decode graph of B lanes is captured: the compiled kernels replayed in the same graph; other steps "
    "eager; at B = 1, 16, 64 on the model (COMPILED_BATCHES)",
    "step16": "step16_fused_kernels.LLMEngine, its defaults (fused decode steps up to MAX_BATCH lanes)",
    "step16_no_pdl": "the same, its graphs captured with plain launches (fused_kernels.PDL off)",
}
TARGETS = {
    "kernels_b1": "<= 64",
    "gpu_ms_b1": "<= 0.18",
    "ms_per_token_b1": "<= 0.3",
    "speedup_16_64": ">= 1.5",
}


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    tiles: bool = False,
):
    """The CLI entry (``python -m benchmarks fused_kernels``; ``--tiles``: ``sweep_tiles`` instead)."""
    started = time.perf_counter()
    cuda = device.startswith("cuda")
    if tiles:
        if not cuda:
            raise ValueError("--tiles times kernels on a GPU: run it with --device cuda")
        return sweep_tiles(device, started)
    if not cuda and not quick:
        raise ValueError(
            "fused_kernels measures CUDA graphs and kernels: run it with --device cuda (or --quick)"
        )
    sizes = QUICK if quick else {"batches": BATCHES, "prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS}
    dtype = "float16" if cuda else "float32"
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            **sizes,
            "engines": ENGINES,
            "arguments": f"multiprocessing=False, enable_prefix_caching=False, block_size={BLOCK_SIZE}, "
            "max_num_seqs = B, a pool for every request; the rest their defaults",
            "timing": "every request added, LLMEngine.step until none is left (prefill included); engines "
            "alternated, the order rotated per run, after one untimed run each; medians",
            "gpu_time": f"the decode graph of B lanes replayed {REPLAYS} times between CUDA events, after a "
            "run (valid inputs in the buffers)",
            "kernels": "torch.profiler (CUDA activity) over one replay of that graph: kernels launched",
            "floor": "the parameters' bytes (the tied embedding once) plus the KV a step reads (B x the mean "
            "context x layers x 2 x C x 2 bytes), over the copy bandwidth measured in this run",
            "host": "the same engine and B on the demo checkpoint (7M parameters): ms per engine step; and "
            "host_ms_per_step: a step's wall less the host's waits for the device (the copy event)",
            "runs": runs,
            "quick": quick,
        },
        "bandwidth_bytes_per_s": harness.copy_bandwidth(device) if cuda else None,
        "models": {},
    }
    harness.run_models(
        result,
        models or (DEFAULT_MODELS if cuda else ["demo"]),
        lambda name: bench_model(name, device, dtype, runs, sizes, result),
    )
    return harness.finish(NAME, device, result, started, plot, report)


def build(name: str, folder: Path, device: str, dtype: str, b: int, longest: int):
    """The engine ``name`` of ``ENGINES`` for batches of ``b``: (its module, the engine)."""
    import step15_tensor_parallel as step15
    import step16_fused_kernels as step16

    args = dict(
        model=str(folder),
        device=device,
        dtype=dtype,
        multiprocessing=False,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        max_num_seqs=b,
        num_kv_blocks=b * -(-longest // BLOCK_SIZE) + 1,
        # on a CPU (--quick) the kernels run through Triton's interpreter: both steps on the Triton backend
        **({} if device.startswith("cuda") else {"attention_backend": "triton"}),
    )
    if name.startswith("step16"):
        from step16_fused_kernels import fused_kernels

        default, fused_kernels.PDL = fused_kernels.PDL, name == "step16"  # read at launch: the capture
        try:
            return step16, step16.LLMEngine(**args, fused_kernels=True)
        finally:
            fused_kernels.PDL = default
    if name == "step15":
        return step15, step15.LLMEngine(**args)
    engine = step15.LLMEngine(**args, enforce_eager=True)  # captured below, compiled
    if device.startswith("cuda"):
        raise_recompile_limit()
        runner = engine.model_runner
        eager = runner.model
        runner.model = torch.compile(eager)
        runner.token_sizes = []  # mixed steps eager: only the decode graphs are compiled
        runner.capture_sizes = [b]  # one graph, one compilation (every decode step here has b lanes)
        try:
            runner.capture_cudagraphs()
        finally:
            runner.model = eager  # prefills run eagerly; the graphs keep the compiled kernels
    return step15, engine


class DeviceWaits:
    """The seconds the host spends waiting for the device in ``torch.cuda.Event.synchronize`` (the engine's
    one wait a step: its sampled ids' copy) while in the ``with`` block: the rest of a step is host work."""

    def __enter__(self) -> DeviceWaits:
        self.seconds, self.synchronize = 0.0, torch.cuda.Event.synchronize

        def timed(event):
            start = time.perf_counter()
            self.synchronize(event)
            self.seconds += time.perf_counter() - start

        torch.cuda.Event.synchronize = timed
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.Event.synchronize = self.synchronize


def generate(module, engine, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    """Add every prompt (greedy, ignore_eos) and step until none is left: wall, tokens, steps, and the host's
    own ms per step (the wall less its waits for the device)."""
    params = module.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    base = f"{time.monotonic_ns()}-"
    harness.synchronize(device)
    with DeviceWaits() as waits:
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(base + str(i), ids, params)
        tokens = steps = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
        harness.synchronize(device)
        wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "tokens": tokens,
        "steps": steps,
        "tok_per_s": tokens / wall,
        "ms_per_token": 1e3 * wall / max_tokens,
        "ms_per_step": 1e3 * wall / steps,
        "host_ms_per_step": 1e3 * (wall - waits.seconds) / steps,
    }


def replay_figures(engine, b: int, device: str) -> dict:
    """The decode graph of ``b`` lanes: GPU ms per replay (CUDA events) and kernels per replay."""
    runner = engine.model_runner
    if runner.graph_runner is None:
        return {}
    replay = lambda: runner.graph_runner.replay(b)  # noqa: E731
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        replay()
    end.record()
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in kernels if not e.name.lower().startswith(("memcpy", "memset"))]
    return {"gpu_ms_per_step": start.elapsed_time(end) / REPLAYS, "kernels_per_step": len(kernels)}


def floor_bytes(config, engine, b: int, context: float) -> float:
    """Bytes one decode step must read: every parameter once, and the KV of ``b`` sequences of ``context``
    tokens in every layer (keys and values in the model's dtype)."""
    params = {p.data_ptr(): p.nbytes for p in engine.model.parameters()}  # tied weights counted once
    kv = b * context * config.n_layer * 2 * config.n_embd * engine.model.wpe.weight.element_size()
    return sum(params.values()) + kv


def bench_model(name: str, device: str, dtype: str, runs: int, sizes: dict, result: dict) -> dict:
    """Every batch: the engines alternated, then each one's replay, kernels, floor; the host on the demo."""
    cuda = device.startswith("cuda")
    folder, demo = snapshot(name), snapshot("demo")
    config = load_config(folder)
    p, g = sizes["prompt_tokens"], sizes["max_tokens"]
    names = list(ENGINES) if cuda else ["step15", "step16"]
    if cuda and torch.cuda.get_device_capability(device) < (9, 0):
        names.remove("step16_no_pdl")  # no PDL there: the same engine as step16
    out = {"snapshot": str(folder), "points": {}}
    for b in sizes["batches"]:
        print(f"  B={b}", flush=True)
        point: dict = {"batch": b, "engines": {}}
        for model_name, model_folder in (("host", demo), ("model", folder)):
            vocab = load_config(model_folder).vocab_size
            built = {}
            compiled = model_name == "model" and b in COMPILED_BATCHES
            for engine_name in [n for n in names if n != "step15_compiled" or compiled]:
                try:
                    built[engine_name] = build(engine_name, model_folder, device, dtype, b, p + g)
                except Exception as error:  # torch.compile on this code, this machine: say why, go on
                    point["engines"].setdefault(engine_name, {})["error"] = f"{type(error).__name__}: {error}"
            gc.collect()
            gc.freeze()
            try:
                runner = make_runner(built, b, p, g, vocab, device)
                raw = harness.alternate({n: runner(n) for n in built}, runs, warmup=1)
                for engine_name, (_, engine) in built.items():
                    figures = point["engines"].setdefault(engine_name, {})
                    figures[model_name] = harness.medians(raw[engine_name])
                    if model_name == "model" and cuda:
                        figures.update(replay_figures(engine, b, device))
                        nbytes = floor_bytes(config, engine, b, p + g / 2)
                        figures["floor_ms"] = 1e3 * nbytes / result["bandwidth_bytes_per_s"]
                        if figures.get("gpu_ms_per_step"):
                            figures["floor_share"] = figures["floor_ms"] / figures["gpu_ms_per_step"]
            finally:
                gc.unfreeze()
                built.clear()
                harness.free(device)
        engines = point["engines"]
        if "step15" in engines and "model" in engines["step15"]:
            base = engines["step15"]["model"]["tok_per_s"]
            point["speedup_over_step15"] = {
                n: e["model"]["tok_per_s"] / base for n, e in engines.items() if "model" in e
            }
        print("    " + "; ".join(f"{n}: {summary(e)}" for n, e in engines.items()), flush=True)
        out["points"][str(b)] = point
    return out


def make_runner(built: dict, b: int, p: int, g: int, vocab: int, device: str):
    """engine name -> a call that runs one generate of ``b`` new prompts (``alternate``'s form)."""
    count = iter(range(-1, 10**6))  # the prompts' seed: one per call, shared by the engines

    def runner(name: str):
        module, engine = built[name]

        def once() -> dict:
            ids = random.Random(TOKEN_ID_SEED + next(count))
            prompts = [[ids.randrange(vocab - 1) for _ in range(p)] for _ in range(b)]
            return generate(module, engine, prompts, g, device)

        return once

    return runner


def summary(figures: dict) -> str:
    if "error" in figures and "model" not in figures:
        return figures["error"][:80]
    model, host = figures.get("model", {}), figures.get("host", {})
    parts = [f"{model.get('ms_per_token', 0):.3f} ms/token", f"{model.get('tok_per_s', 0):.0f} tok/s"]
    if "gpu_ms_per_step" in figures:
        parts += [f"GPU {figures['gpu_ms_per_step']:.3f} ms", f"{figures['kernels_per_step']} kernels"]
    if host:
        parts.append(f"demo {host.get('ms_per_step', 0):.3f} ms/step")
    if "host_ms_per_step" in model:
        parts.append(f"host {model['host_ms_per_step']:.3f} ms/step")
    return ", ".join(parts)


def report(result: dict) -> str:
    lines = []
    for model, data in result["models"].items():
        lines.append(f"{model}:")
        rows = []
        for b, point in data["points"].items():
            for name, e in point["engines"].items():
                m, h = e.get("model", {}), e.get("host", {})
                rows.append(
                    [
                        b,
                        name,
                        m.get("ms_per_token"),
                        m.get("tok_per_s"),
                        e.get("gpu_ms_per_step"),
                        e.get("kernels_per_step"),
                        e.get("floor_share"),
                        m.get("host_ms_per_step"),
                        h.get("ms_per_step"),
                        point.get("speedup_over_step15", {}).get(name),
                    ]
                )
        headers = [
            "B",
            "engine",
            "ms/token",
            "tok/s",
            "GPU ms/step",
            "kernels",
            "of floor",
            "host ms/step",
            "demo ms/step",
            "x step15",
        ]
        lines.append(harness.table(headers, rows))
        points = data["points"]
        if "1" in points and not result["workload"]["quick"]:
            s16 = points["1"]["engines"].get("step16", {})
            lines.append(
                harness.target_line(
                    "kernels per decode step, batch 1", s16.get("kernels_per_step"), TARGETS["kernels_b1"], ""
                )
            )
            lines.append(
                harness.target_line(
                    "GPU ms per step, batch 1", s16.get("gpu_ms_per_step"), TARGETS["gpu_ms_b1"], " ms"
                )
            )
            lines.append(
                harness.target_line(
                    "ms per token, batch 1",
                    s16.get("model", {}).get("ms_per_token"),
                    TARGETS["ms_per_token_b1"],
                    " ms",
                )
            )
            for b in ("16", "64"):
                if b in points:
                    lines.append(
                        harness.target_line(
                            f"step16 / step15 tok/s, batch {b}",
                            points[b].get("speedup_over_step15", {}).get("step16"),
                            TARGETS["speedup_16_64"],
                        )
                    )
            if "256" in points:
                lines.append(
                    harness.target_line(
                        "step16 / step15 tok/s, batch 256",
                        points["256"].get("speedup_over_step15", {}).get("step16"),
                        ">= 0.97",
                    )
                )
    return "\n".join(lines)


# --tiles: fused_linear's tile options, one at a time from the table's (two passes), at GPT-2 124M's products
TILE_SPACE = {
    "block_n": [16, 32, 64, 128],
    "block_k": [64, 128, 256],
    "num_warps": [2, 4, 8],
    "num_stages": [1, 2, 3],
    "split_k": [1, 2, 4, 8],
}
TILE_ROWS = [1, 16, 64]


def sweep_tiles(device: str, started: float) -> dict:
    """Each product of a fused GPT-2 124M layer (fp16) at 1, 16 and 64 rows: its time in a CUDA graph
    (``triton.testing.do_bench_cudagraph``) with ``_config``'s tiles, then with the best found by changing
    one option of ``TILE_SPACE`` at a time (two passes). Writes ``fused_kernels_tiles-<device>.json``."""
    from step16_fused_kernels.fused_kernels import _config, fused_linear

    C, V, dtype = 768, 50257, torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    ln = (rand(C), rand(C), 1e-5)
    pool = [torch.zeros(4096, BLOCK_SIZE, 12, 64, device=device, dtype=dtype) for _ in "kv"]
    slots = lambda M: torch.arange(M, device=device) * 7  # noqa: E731
    products = {  # name: K, N, the flavour's arguments for M rows
        "qkv (ln_1, bias, KV write)": (C, 3 * C, lambda M: dict(ln=ln, kv=(*pool, None, None, slots(M)))),
        "attn c_proj (bias, residual)": (C, C, lambda M: dict(residual=rand(M, C))),
        "c_fc (ln_2, bias, GELU)": (C, 4 * C, lambda M: dict(ln=ln, gelu=True)),
        "mlp c_proj (bias, residual)": (4 * C, C, lambda M: dict(residual=rand(M, C))),
        "lm_head (ln_f)": (C, V, lambda M: dict(ln=ln)),
    }
    result = {
        "benchmark": "fused_kernels_tiles",
        "machine": harness.machine_info(device, "float16"),
        "workload": {
            "products": list(products),
            "rows": TILE_ROWS,
            "space": TILE_SPACE,
            "timing": "triton.testing.do_bench_cudagraph (rep 30 ms): one launch in a CUDA graph, replayed",
            "search": "from _config's tiles, each option in turn set to its best value, two passes",
            "quick": False,
        },
        "points": {},
    }
    for M in TILE_ROWS:
        for name, (K, N, flavour) in products.items():
            x = rand(M, K)
            w = (rand(N, K) * K**-0.5).t()  # [K, N]; the LM head is wte.t(), the others contiguous
            w = w if N == V else w.contiguous()
            bias = None if N == V else rand(N)
            launch, times = functools.partial(fused_linear, x, w, bias, **flavour(M)), {}
            time_us = functools.partial(launch_us, launch, times)
            default = _config(M, N, K, None, C if "kv" in launch.keywords else None, True)
            best = dict(default)
            for _ in range(2):
                for option, values in TILE_SPACE.items():
                    best = min((dict(best, **{option: v}) for v in values), key=time_us)
            point = {
                "rows": M,
                "default": default,
                "default_us": time_us(default),
                "best": best,
                "best_us": time_us(best),
                "weight_bytes": K * N * 2,
                "configs_timed": len(times),
            }
            if point["best_us"] == float("inf"):  # no tile ran: said, and the JSON stays strict
                raise RuntimeError(f"--tiles: no tile option could run {name} at {M} rows")
            point["best_gb_per_s"] = point["weight_bytes"] / point["best_us"] / 1e3
            result["points"][f"{name}, M={M}"] = point
            print(
                f"  {name}, M={M}: {point['default_us']:.1f} -> {point['best_us']:.1f} us {best}", flush=True
            )
    return harness.finish("fused_kernels_tiles", device, result, started, plot_tiles, report_tiles)


def launch_us(launch, times: dict, cfg: dict) -> float:
    """Microseconds of ``launch(**cfg)`` replayed in a CUDA graph (remembered in ``times``); inf for tiles
    the product cannot take."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench_cudagraph

    key = tuple(sorted(cfg.items()))
    if key not in times:
        try:
            launch(**cfg)  # compiled (and split-K's counters allocated) before the capture
            times[key] = 1e3 * do_bench_cudagraph(lambda: launch(**cfg), rep=30)
        except (ValueError, RuntimeError, OutOfResources, CompilationError):
            times[key] = float("inf")
    return times[key]


def report_tiles(result: dict) -> str:
    rows = [
        [
            key,
            p["default_us"],
            p["best_us"],
            p["best_gb_per_s"],
            " ".join(f"{k}={v}" for k, v in p["best"].items()),
        ]
        for key, p in result["points"].items()
    ]
    return harness.table(["product, rows", "table's us", "best us", "best GB/s", "best tiles"], rows)


def plot_tiles(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    y = range(len(points))
    ax.barh([i + 0.2 for i in y], [p["default_us"] for p in points.values()], 0.4, label="the table's tiles")
    ax.barh([i - 0.2 for i in y], [p["best_us"] for p in points.values()], 0.4, label="the best found")
    ax.set_yticks(list(y), list(points), fontsize=7)
    ax.set_xlabel("us per launch (in a CUDA graph)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    gpu = result["machine"].get("gpu") or result["machine"].get("cpu")
    ax.set_title(f"fused_linear's tiles at GPT-2 124M's products, fp16 ({gpu})", fontsize=10)
    fig.tight_layout()
    return harness.save_figure(fig, path)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for model, data in result["models"].items():
        points = data["points"]
        batches = [int(b) for b in points]
        for name in ENGINES:
            figures = [points[str(b)]["engines"].get(name, {}) for b in batches]
            for ax, get, style in [
                (axes[0], lambda e: e.get("model", {}).get("ms_per_token"), dict(marker="o", label=name)),
                (axes[1], lambda e: e.get("gpu_ms_per_step"), dict(marker="o", label=f"{name} GPU")),
                (
                    axes[1],
                    lambda e: e.get("model", {}).get("host_ms_per_step"),
                    dict(marker="x", linestyle="--", label=f"{name} host"),
                ),
                (axes[2], lambda e: e.get("kernels_per_step"), dict(marker="o", label=name)),
            ]:
                values = [get(e) for e in figures]
                if any(v is not None for v in values):
                    ax.plot(batches, values, **style)
    titles = [
        "ms per token (wall, 32 + 128)",
        "ms per decode step: GPU (replay) vs host (wall less device waits)",
        "kernels per decode step",
    ]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (requests)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    gpu = result["machine"].get("gpu") or result["machine"].get("cpu")
    fig.suptitle(f"Step 16: fused decode kernels vs step 15 and torch.compile ({gpu})", fontsize=11)
    fig.tight_layout()
    return harness.save_figure(fig, path)

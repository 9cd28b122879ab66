"""The ladder: every step from 5 on and HF's static cache in one process and one run, so that no step is
slower than the one before it with its own mechanism unused (the target: >= 0.97x at every point).

Each step runs as a user gets it (its defaults; nothing to share or speculate) through ``LLM.generate``,
greedy, every request at once, new prompts every run (``POINTS``: batch 1, 64, 256 of 32 + 128, 256 of
512 + 256), the engines alternated in each run; then one cProfiled generate per step at batch 256: the
host's time per engine step by function, where a tax would show (``PROFILE``).

    python -m benchmarks ladder --device cuda --runs 5      # GPT-2 124M shapes, fp16 (the recorded run)
    python -m benchmarks ladder --quick                     # CPU, the demo, tiny points: checks that it runs
"""

from __future__ import annotations

import cProfile
import gc
import importlib
import random
import time
from pathlib import Path

import torch

from common.weights import load_config

from .lib import harness
from .lib.models import hf_model, raise_recompile_limit, snapshot
from .lib.profiled import top_functions

NAME = "ladder"
DEFAULT_MODELS = ["gpt2-124m-random"]  # on a CPU: the demo (see main)
DEFAULT_RUNS = 5
ROOT = Path(__file__).resolve().parent.parent
FIRST_STEP = 5  # the first step on the GPU path (Triton attention); step 6 is step 5's engine behind HTTP
BLOCK_SIZE = 16
TOKEN_ID_SEED = 7000
# name -> (requests, prompt tokens, new tokens, LLM.generate calls per timed run: 0.3 to 1.6 s of step 8's)
POINTS = {
    "batch 1": (1, 32, 128, 3),
    "batch 64": (64, 32, 128, 3),
    "batch 256": (256, 32, 128, 6),
    "batch 256, long": (256, 512, 256, 2),
}
QUICK_POINTS = {"batch 1": (1, 8, 8, 1), "batch 4": (4, 8, 8, 1)}
SLOW_ENGINES_RUNS = 3  # steps 5 and 6 (no CUDA graphs: several times slower): the first 3 runs at batch 256
POOLS_SHARE = 0.6  # of the GPU's memory, for every engine's KV pool at once; the newest steps that fit run
PROFILE = {"point": "batch 256", "top": 25}  # cProfile of one generate call per step, after the runs


def steps() -> dict[str, object]:
    """Every step package from ``FIRST_STEP`` on, by short name ("step5" ...), in order: a step added later
    joins the ladder by existing."""
    found = sorted(
        (int(p.name[4:].split("_")[0]), p.name)
        for p in ROOT.glob("step[0-9]*_*")
        if (p / "__init__.py").is_file()
    )
    return {f"step{n}": importlib.import_module(name) for n, name in found if n >= FIRST_STEP}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks ladder``)."""
    cuda = device.startswith("cuda")
    models = models or (DEFAULT_MODELS if cuda else ["demo"])
    return run(models, device, 1 if quick else runs, QUICK_POINTS if quick else POINTS, quick=quick)


def run(
    models: list[str],
    device: str,
    runs: int,
    points: dict[str, tuple[int, int, int, int]],
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Every point on each model; write ``<out_dir>/ladder-<device>.json`` and ``.png``."""
    started = time.perf_counter()
    cuda = device.startswith("cuda")
    dtype = "float16" if cuda else "float32"
    modules = steps()
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "points": {
                name: {"requests": b, "prompt_tokens": p, "max_tokens": g, "calls_per_run": c}
                for name, (b, p, g, c) in points.items()
            },
            "engines": {
                "hf_static": "transformers GPT2LMHeadModel.generate(cache_implementation='static'), the "
                "decode forward compiled on a GPU (HF's fastest documented path; compiled in the untimed "
                "warm-up), the batch left-padded"
                if cuda
                else "not run on a CPU",
                **{
                    name: f"{module.__name__}.LLM(block_size={BLOCK_SIZE}, max_num_seqs = the most "
                    "requests of a point, a pool and a token budget that admit every request in the "
                    "first step), its defaults otherwise"
                    for name, module in modules.items()
                },
            },
            "prompts": f"uniform over the vocabulary but its last id, random.Random({TOKEN_ID_SEED} + run): "
            "new ones every run, the same for every engine",
            "sampling": "greedy, ignore_eos: every request generates exactly its new tokens",
            "runs": runs,
            "timing": "LLM.generate calls back to back, the device synchronised; one untimed run per engine "
            "first; engines alternated, the order rotated per run; steps 5 and 6 in the first "
            f"{SLOW_ENGINES_RUNS} runs only at batch 256; ratios are medians of per-run ratios",
            "memory": f"the newest steps whose KV pools fit together in {POOLS_SHARE} of the GPU's memory "
            "(at 256 x (512 + 256) a pool is 7 GiB in fp16): the oldest leave such a point first",
            "gc": "every engine built, then gc.freeze(): a collection over the engines' objects would land "
            "on whichever engine runs then",
            "quick": quick,
        },
        "models": {},
    }

    def bench(name: str) -> dict:
        return bench_model(name, modules, device, dtype, runs, points, quick)

    harness.run_models(result, models, bench)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str, modules: dict, device: str, dtype: str, runs: int, points: dict, quick: bool
) -> dict:
    """Every point on one model: its engines, built once for the points of one prompt length."""
    folder = snapshot(name)
    config = load_config(folder)
    cuda = device.startswith("cuda")
    out = {"model": name, "points": {}, "profiles": {}}
    hf = hf_model(folder, device, dtype) if cuda else None
    if hf is not None:
        raise_recompile_limit()
    # engines are built for the points that share a request length, then freed (a pool for 256 x 768
    # tokens is 7 GiB a step in fp16 on GPT-2 124M)
    groups: dict[int, list[str]] = {}
    for point, (b, p, g, _) in points.items():
        groups.setdefault(p + g, []).append(point)
    for length, names in groups.items():
        most = max(points[n][0] for n in names)
        longest_prompt = max(points[n][1] for n in names)
        size = dict(
            block_size=BLOCK_SIZE,
            max_num_seqs=most,
            num_kv_blocks=most * -(-length // BLOCK_SIZE),
            max_num_batched_tokens=max(most * longest_prompt, config.n_positions),
        )
        llms = {
            step: module.LLM(model=str(folder), device=device, dtype=dtype, **size)
            for step, module in fitting(modules, config, device, dtype, size["num_kv_blocks"]).items()
        }
        gc.collect()
        gc.freeze()
        try:
            for point in names:
                b, p, g, calls = points[point]
                print(f"  {point}: {b} x ({p} + {g}), {calls} calls a run", flush=True)
                out["points"][point] = measure(hf, llms, modules, config, device, runs, b, p, g, calls)
                print("    " + summary_line(out["points"][point]), flush=True)
            if PROFILE["point"] in names or quick:
                point = PROFILE["point"] if PROFILE["point"] in names else names[-1]
                b, p, g, _ = points[point]
                for step, llm in llms.items():
                    out["profiles"][step] = profile_generate(llm, modules[step], config, device, b, p, g)
                out["profiles"]["point"] = point
        finally:
            gc.unfreeze()
        del llms
        harness.free(device)
    return out


def fitting(modules: dict, config, device: str, dtype: str, num_kv_blocks: int) -> dict:
    """The newest steps whose KV pools of ``num_kv_blocks`` blocks fit in ``POOLS_SHARE`` of the GPU's
    memory together (a pool for 256 x 768 tokens is 7 GiB in fp16 on GPT-2 124M, and every step holds
    one): the oldest steps leave such a point first. Every step on a CPU."""
    if not device.startswith("cuda"):
        return modules
    pool = (
        2
        * config.n_layer
        * num_kv_blocks
        * BLOCK_SIZE
        * config.n_embd
        * torch.finfo(getattr(torch, dtype)).bits
        // 8
    )
    room = int(POOLS_SHARE * torch.cuda.get_device_properties(device).total_memory) // pool
    kept = dict(list(modules.items())[-max(room, 2) :])
    if len(kept) < len(modules):
        print(
            f"  {len(modules) - len(kept)} oldest step(s) left out: {room} pools of {pool / 2**30:.1f} GiB "
            "fit"
        )
    return kept


def prompts_for(run: int, b: int, p: int, vocab_size: int, calls: int) -> list[list[list[int]]]:
    """``calls`` batches of ``b`` prompts of ``p`` ids each, drawn from random.Random(TOKEN_ID_SEED + run)
    (run -1: the warm-up), never the last id (GPT-2's end of text)."""
    ids = random.Random(TOKEN_ID_SEED + run)
    return [[[ids.randrange(vocab_size - 1) for _ in range(p)] for _ in range(b)] for _ in range(calls)]


def measure(
    hf, llms: dict, modules: dict, config, device: str, runs: int, b: int, p: int, g: int, calls: int
):
    """One point: the engines alternated over ``runs`` runs after one untimed run each; per run tok/s and
    ms per token; each step's ratio to the step before, and step 8's to HF's static cache."""

    def engine_call(step: str):
        count = iter(range(-1, 10**6))
        params = modules[step].SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True)

        def call() -> dict:
            batches = prompts_for(next(count), b, p, config.vocab_size, calls)
            wall, outs = harness.timed(
                lambda: [
                    o
                    for batch in batches
                    for o in llms[step].generate(prompt_token_ids=batch, sampling_params=params)
                ],
                device,
            )
            return figures(wall, sum(len(o.outputs[0].token_ids) for o in outs), calls, g)

        return call

    def hf_call():
        count = iter(range(-1, 10**6))

        def call() -> dict:
            batches = prompts_for(next(count), b, p, config.vocab_size, calls)
            wall, _ = harness.timed(lambda: [hf_static(hf, batch, g, device) for batch in batches], device)
            return figures(wall, b * g * calls, calls, g)

        return call

    engines = ({"hf_static": hf_call()} if hf is not None else {}) | {s: engine_call(s) for s in llms}
    slow = {  # at the largest points only, where their runs take several seconds
        s: SLOW_ENGINES_RUNS
        for s in ("step5", "step6")
        if s in engines and runs > SLOW_ENGINES_RUNS and b >= 256
    }
    raw = harness.alternate(engines, runs, warmup=1, runs_of=slow)
    names = list(llms)
    ratios = {f"{a}/{b_}": (a, b_, "throughput_tok_s") for b_, a in zip(names, names[1:])}
    if "hf_static" in raw:
        ratios |= {f"{s}/hf_static": (s, "hf_static", "throughput_tok_s") for s in names}
    return {
        "runs": raw,
        "median": {e: harness.medians(r) for e, r in raw.items()},
        "ratios": {label: harness.ratio(raw[a], raw[c], k) for label, (a, c, k) in ratios.items()},
    }


def figures(wall_s: float, generated: int, calls: int, max_tokens: int) -> dict:
    """One run's figures: tok/s over the run, and ms per token of one request (the run's wall time over
    the tokens one request generated in all its calls)."""
    return {
        "wall_s": wall_s,
        "generated_tokens": generated,
        "throughput_tok_s": generated / wall_s,
        "ms_per_token": 1e3 * wall_s / (calls * max_tokens),
    }


def hf_static(model, prompts: list[list[int]], max_tokens: int, device: str) -> None:
    """HF ``generate`` with a static cache over one batch of equal-length prompts (no padding needed),
    greedy, exactly ``max_tokens`` new tokens a row."""
    ids = torch.tensor(prompts, device=device)  # [B, T]
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        use_cache=True,
        cache_implementation="static",
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=model.config.eos_token_id,
    )


def profile_generate(llm, module, config, device: str, b: int, p: int, g: int) -> dict:
    """One ``LLM.generate`` of ``b`` new prompts under cProfile: the host's time by function (own time and
    with callees), per engine step. The profiler inflates every Python call, so the wall time here is
    not a speed figure; the shares between functions are what it tells."""
    (batch,) = prompts_for(10**6, b, p, config.vocab_size, 1)
    params = module.SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True)
    profiler = cProfile.Profile()
    harness.synchronize(device)
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompt_token_ids=batch, sampling_params=params)
    harness.synchronize(device)
    profiler.disable()
    wall = time.perf_counter() - start
    steps = g + 1  # a prefill step, then one decode step per token after the first (one in flight at the end)
    top = top_functions(profiler, "tottime", PROFILE["top"])
    for row in top:
        row["us_per_step"] = 1e6 * row["tottime_s"] / steps
    return {"wall_s_profiled": wall, "engine_steps": steps, "top_tottime": top}


def summary_line(point: dict) -> str:
    medians = point["median"]
    return ", ".join(f"{e} {m['throughput_tok_s']:.0f}" for e, m in medians.items()) + " tok/s"


TARGET = ">= 0.97"


def ratio_of(point: dict, label: str) -> float | None:
    """A point's median ratio for ``label``, None where one of its steps did not run there."""
    ratio = point["ratios"].get(label)
    return None if ratio is None else ratio["median"]


def report(result: dict) -> str:
    lines = []
    for name, model in result["models"].items():
        points = model["points"]
        engines = list(next(iter(points.values()))["median"])
        rows = []
        for e in engines:
            row = [e]
            for point in points.values():
                m = point["median"].get(e)
                row += [
                    None if m is None else m["throughput_tok_s"],
                    None if m is None else m["ms_per_token"],
                ]
            rows.append(row)
        headers = ["engine"]
        for point in points:
            headers += [f"{point}: tok/s", "ms/token"]
        lines += [f"{name}:", harness.table(headers, rows), ""]
        ratio_rows = []
        labels = [label for label in next(iter(points.values()))["ratios"] if not label.endswith("hf_static")]
        for label in labels:
            ratio_rows.append([label, *(ratio_of(point, label) for point in points.values())])
        lines.append(harness.table(["step / the one before", *points], ratio_rows))
        full = not result["workload"]["quick"]
        for label in labels:
            worst = min(r for point in points.values() if (r := ratio_of(point, label)) is not None)
            lines.append(
                harness.target_line(f"{label}, the lowest of the points", worst, TARGET, full_size=full)
            )
        for point_name, point in points.items():
            if "step8/hf_static" in point["ratios"]:
                ratio = point["ratios"]["step8/hf_static"]["median"]
                lines.append(f"{point_name}: step 8 / HF static cache {ratio:.2f}x")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model: each point's tok/s by engine (top row), and each step over the step before at every
    point, with the 0.97 line the ladder holds them to (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    npoints = max(len(m["points"]) for m in models.values())
    fig = plt.figure(figsize=(4.5 * npoints, 7.5 * len(models)))
    grid = fig.add_gridspec(2 * len(models), npoints)
    for m, (name, model) in enumerate(models.items()):
        top = [fig.add_subplot(grid[2 * m, j]) for j in range(npoints)]
        for ax, (point_name, point) in zip(top, model["points"].items()):
            engines = list(point["median"])
            values = [point["median"][e]["throughput_tok_s"] for e in engines]
            colors = ["C8" if e == "hf_static" else "C0" for e in engines]
            bars = ax.bar(range(len(engines)), values, color=colors)
            ax.bar_label(
                bars, labels=[f"{v / 1e3:.3g}k" if v >= 1e4 else f"{v:.0f}" for v in values], fontsize=6
            )
            ax.set_xticks(range(len(engines)), [e.replace("step", "") for e in engines], fontsize=8)
            ax.set_title(f"{name}: {point_name}", fontsize=9)
            ax.set_ylabel("tok/s (median)")
        ax = fig.add_subplot(grid[2 * m + 1, :])
        first = next(iter(model["points"].values()))
        labels = [label for label in first["ratios"] if not label.endswith("hf_static")]
        for i, (point_name, point) in enumerate(model["points"].items()):
            ax.plot(
                range(len(labels)),
                [ratio_of(point, label) or float("nan") for label in labels],
                "o-",
                label=point_name,
                color=f"C{i}",
            )
        ax.axhline(float(TARGET.split()[1]), color="red", linestyle="--", linewidth=1, label="target 0.97")
        ax.set_xticks(range(len(labels)), [label.replace("step", "") for label in labels], fontsize=8)
        ax.set_ylabel("step / the step before (median of runs)")
        ax.set_ylim(0.85, 1.15)
        ax.legend(fontsize=7)
        ax.set_title(f"{name}: each step against the one before", fontsize=9)
    machine = result["machine"]
    fig.suptitle(
        f"The ladder: steps {FIRST_STEP}+ and HF's static cache, {machine.get('gpu') or machine['cpu']}, "
        f"{machine['dtype']}, median of {result['workload']['runs']} run(s), "
        f"commit {machine.get('git_commit')}",
        fontsize=10,
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

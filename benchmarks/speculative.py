"""Step 11's benchmark: speculative decoding with prompt-lookup or draft-model drafts against none.

``extractive`` (a passage, then its first sentence again) and ``prose`` (an opening line); B requests of
the demo checkpoint (on CUDA also GPT-2 124M's shapes, random weights) at B = 1, 16, 64, 128, 256 (CPU: 1,
16, 64), greedy, ``ignore_eos``; ``off`` (step 10's path), ``ngram`` (k = 4, n-grams of 4 down to 2; also
``ngram_default`` where its default turns it off) and ``draft`` (demo/draft, k = 4), alternated in each
run. Figures: tok/s, ms per token, acceptance, eager verification steps. Details: benchmarks/README.md.

    OMP_NUM_THREADS=1 python -m benchmarks speculative      # CPU, fp32, 3 runs
    python -m benchmarks speculative --device cuda          # fp16
"""

from __future__ import annotations

import time
from pathlib import Path

from common.weights import REPO_ROOT

from .lib import harness
from .lib.models import snapshot

NAME = "speculative"
DEFAULT_MODELS = ["demo"]  # on cuda also gpt2-124m-random: GPT-2 124M's shapes (see main)
DEFAULT_RUNS = 3
# disable_by_batch_size None: speculation at every batch size, the figures its default is chosen from
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": None,
}
# a model's draft for the "draft" engine (the demo draft: demo/train.py at 2 layers, width 128); models
# not named here run "off" and "ngram" only
DRAFTS = {"demo": REPO_ROOT / "demo" / "draft"}
DRAFT_K = 4
BATCHES = {"cpu": [1, 16, 64], "cuda": [1, 16, 64, 128, 256]}
MAX_TOKENS = {"cpu": 64, "cuda": 128}
QUICK = {"batches": [1, 4], "max_tokens": 16}
PASSAGES = [  # in-domain for the demo checkpoint (trained on Python's documentation); written for this file
    "The for statement iterates over the items of any sequence, in the order that they appear in the "
    "sequence. If the sequence is empty, the loop body is never executed.",
    "A module is a file containing Python definitions and statements. The file name is the module name "
    "with the suffix .py appended. Within a module, the module's name is available as __name__.",
    "The with statement is used to wrap the execution of a block with methods defined by a context "
    "manager. This allows common try, except and finally usage patterns to be encapsulated.",
    "A dictionary maps hashable keys to arbitrary objects. Dictionaries are mutable; the keys of a "
    "dictionary are unique, and the values can be of any type.",
]
OPENINGS = [
    "The Python interpreter",
    "A list comprehension is a concise way to",
    "Exceptions are raised when",
    "The standard library provides",
]
# the n-gram config with its default disable_by_batch_size (128), timed where that default turns it off
NGRAM_DEFAULT = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
ENGINES = {
    "off": "step11_speculative.LLM(max_num_seqs=B): no speculation (step 10's path; async on CUDA)",
    "ngram": f"step11_speculative.LLM(max_num_seqs=B, speculative_config={NGRAM}) (steps that draft run "
    "serially)",
    "ngram_default": f"step11_speculative.LLM(max_num_seqs=B, speculative_config={NGRAM_DEFAULT}): the "
    "default disable_by_batch_size, at B >= it only",
    "draft": "step11_speculative.LLM(max_num_seqs=B, speculative_config={'method': 'draft_model', 'model': "
    f"<DRAFTS[model]>, 'num_speculative_tokens': {DRAFT_K}, 'disable_by_batch_size': None}}) "
    "(models with a draft only: demo -> demo/draft)",
}


def prompts(kind: str, batch: int) -> list[str]:
    """``batch`` prompts of a workload: "extractive" (a passage, a blank line, then its first sentence
    again: what follows is a copy) or "prose" (an opening line), cycling through the list."""
    if kind == "extractive":
        texts = [f"{p}\n\n{p.split('. ')[0]}" for p in PASSAGES]
    else:
        texts = OPENINGS
    return [texts[i % len(texts)] for i in range(batch)]


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks speculative``)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    size = QUICK if quick else {"batches": BATCHES[kind], "max_tokens": MAX_TOKENS[kind]}
    models = models or (
        DEFAULT_MODELS + ["gpt2-124m-random"] if kind == "cuda" and not quick else DEFAULT_MODELS
    )
    return run(models, device, 1 if quick else runs, quick=quick, **size)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    batches: list[int] = BATCHES["cpu"],
    max_tokens: int = MAX_TOKENS["cpu"],
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Both workloads at each batch size on each model; write ``<out_dir>/speculative-<device>.json``/.png."""
    started = time.perf_counter()
    dtype = "float16" if device.startswith("cuda") else "float32"
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "extractive": "each prompt a passage of PASSAGES, a blank line, its first sentence again",
            "prose": "each prompt an opening line of OPENINGS",
            "batches": batches,
            "max_tokens": max_tokens,
            "sampling": "greedy, ignore_eos: every request generates exactly max_tokens",
            "engines": ENGINES,
            "runs": runs,
            "warmup": "every engine once on the point's workload, untimed",
            "timing": "LLM.generate of the B prompts, the device synchronised; engines alternated within "
            "each run (order rotated per run); medians over runs; ratios are medians of per-run ratios",
            "quick": quick,
        },
        "models": {},
    }
    harness.run_models(
        result, models, lambda name: bench_model(name, device, dtype, runs, batches, max_tokens)
    )
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(name: str, device: str, dtype: str, runs: int, batches: list[int], max_tokens: int) -> dict:
    import step11_speculative as step11
    from step11_speculative.spec_decode import SpeculativeConfig

    folder = snapshot(name)
    out = {"snapshot": str(folder), "points": {}}
    for batch in batches:
        llms = {
            "off": step11.LLM(model=str(folder), device=device, dtype=dtype, max_num_seqs=batch),
            "ngram": step11.LLM(
                model=str(folder), device=device, dtype=dtype, max_num_seqs=batch, speculative_config=NGRAM
            ),
        }
        if batch >= SpeculativeConfig().disable_by_batch_size:
            llms["ngram_default"] = step11.LLM(
                model=str(folder),
                device=device,
                dtype=dtype,
                max_num_seqs=batch,
                speculative_config=NGRAM_DEFAULT,
            )
        if name in DRAFTS:
            draft = {
                "method": "draft_model",
                "model": str(DRAFTS[name]),
                "num_speculative_tokens": DRAFT_K,
                "disable_by_batch_size": None,
            }
            llms["draft"] = step11.LLM(
                model=str(folder), device=device, dtype=dtype, max_num_seqs=batch, speculative_config=draft
            )
        for kind in ("extractive", "prose"):
            print(f"  B={batch} {kind}", flush=True)
            calls = {
                e: measured(llm, step11, prompts(kind, batch), max_tokens, device) for e, llm in llms.items()
            }
            per_run = harness.alternate(calls, runs)
            point = out["points"][f"{kind}/{batch}"] = {
                "workload": kind,
                "batch": batch,
                "runs": per_run,
                "median": {e: harness.medians(r) for e, r in per_run.items()},
                "ratio": harness.ratio(per_run["ngram"], per_run["off"], "tok_per_s"),
            }
            if "ngram_default" in per_run:
                point["default_ratio"] = harness.ratio(per_run["ngram_default"], per_run["off"], "tok_per_s")
            if "draft" in per_run:
                point["draft_ratio"] = harness.ratio(per_run["draft"], per_run["off"], "tok_per_s")
        for llm in llms.values():
            llm.engine_core.shutdown()  # a child process on CUDA: its GPU memory back before the next point
        del llms
        harness.free(device)
    return out


def measured(llm, module, texts: list[str], max_tokens: int, device: str):
    """A call that generates for ``texts`` once and returns its figures (the speculation counters as the
    difference of the engine's stats before and after)."""
    params = module.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def call() -> dict:
        before = llm.stats
        wall, outs = harness.timed(lambda: llm.generate(texts, params), device)
        after = llm.stats
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        figures = {
            "wall_s": wall,
            "tokens": tokens,
            "tok_per_s": tokens / wall,
            "ms_per_token": 1e3 * wall / max_tokens,
        }
        counters = (
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        )
        deltas = {c: getattr(after, c) - (getattr(before, c) if before is not None else 0) for c in counters}
        drafts, proposed, accepted = deltas.values()
        figures["acceptance_rate"] = accepted / proposed if proposed else 0.0
        figures["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        figures["num_drafts"], figures["num_draft_tokens"], figures["num_accepted_tokens"] = (
            drafts,
            proposed,
            accepted,
        )
        figures["num_eager_verify_steps"] = after.num_eager_verify_steps - (
            before.num_eager_verify_steps if before is not None else 0
        )
        return figures

    return call


def report(result: dict) -> str:
    lines = []
    for name, model in result["models"].items():
        rows = []
        for point in model["points"].values():
            off, ngram = point["median"]["off"], point["median"]["ngram"]
            rows.append(
                [
                    point["workload"],
                    point["batch"],
                    f"{off['tok_per_s']:,.0f}",
                    f"{ngram['tok_per_s']:,.0f}",
                    f"{point['ratio']['median']:.2f}x",
                    f"{off['ms_per_token']:.2f}",
                    f"{ngram['ms_per_token']:.2f}",
                    f"{100 * ngram['acceptance_rate']:.0f} %",
                    f"{ngram['mean_acceptance_length']:.2f}",
                    f"{point['default_ratio']['median']:.2f}x" if "default_ratio" in point else "",
                ]
            )
        headers = ["workload", "B", "off tok/s", "ngram tok/s", "ngram/off", "off ms/tok", "ngram ms/tok",
                   "accepted", "mean accept len", "default/off"]  # fmt: skip
        lines += [
            f"{name} ({result['machine']['device']}, {result['machine']['dtype']})",
            harness.table(headers, rows),
        ]
        drafted = [p for p in model["points"].values() if "draft_ratio" in p]
        if drafted:
            rows = [
                [
                    p["workload"],
                    p["batch"],
                    f"{p['median']['draft']['tok_per_s']:,.0f}",
                    f"{p['draft_ratio']['median']:.2f}x",
                    f"{p['median']['draft']['ms_per_token']:.2f}",
                    f"{100 * p['median']['draft']['acceptance_rate']:.0f} %",
                    f"{p['median']['draft']['mean_acceptance_length']:.2f}",
                ]
                for p in drafted
            ]
            headers = ["workload", "B", "draft tok/s", "draft/off", "draft ms/tok", "accepted",
                       "mean accept len"]  # fmt: skip
            draft = DRAFTS[name].relative_to(REPO_ROOT) if name in DRAFTS else "a draft model"
            lines += [f"{name}, speculative_config draft_model {draft}", harness.table(headers, rows)]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 4 * len(models)), squeeze=False)
    for row, (name, model) in zip(axes, models.items()):
        for ax, kind in zip(row, ("extractive", "prose")):
            points = [p for p in model["points"].values() if p["workload"] == kind]
            batches = [p["batch"] for p in points]
            for engine in ("off", "ngram", "draft"):
                if all(engine in p["median"] for p in points):
                    ax.plot(batches, [p["median"][engine]["tok_per_s"] for p in points], "o-", label=engine)
            for p in points:
                ax.annotate(
                    f"{p['ratio']['median']:.2f}x, {100 * p['median']['ngram']['acceptance_rate']:.0f}% acc.",
                    (p["batch"], p["median"]["ngram"]["tok_per_s"]),
                    fontsize=8,
                )
            ax.set_xscale("log")
            harness.log_axis(ax.xaxis, batches)
            ax.set_xlabel("batch size (requests)")
            ax.set_ylabel("tok/s")
            ax.set_title(f"{name}, {kind} ({result['machine']['device']}, {result['machine']['dtype']})")
            ax.legend()
    fig.tight_layout()
    return harness.save_figure(fig, path)

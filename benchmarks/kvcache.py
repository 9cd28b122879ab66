"""Step 2's benchmark: what the KV cache buys, against step 1 (no cache) and Hugging Face's generate.

Batch 1, greedy, ``ignore_eos``, prompts of random token ids from a fixed seed: a. ms per generated token
against the tokens generated after a 16-token prompt (step1, step2, HF ``generate`` with its cache), and
step2's median decode latency, which stays flat; b. time to first token against the prompt length; c. KV
cache bytes per token, by the formula (Pope et al. 2022, "Efficiently Scaling Transformer Inference") and as
``step2_kvcache.KVCache`` allocates them. Details and the JSON layout: benchmarks/README.md.

    python -m benchmarks kvcache                         # both models, 5 runs
    python -m benchmarks kvcache --model demo --quick    # one model, 1 run, shorter lengths
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .lib import harness
from .lib.models import hf_model, snapshot

NAME = "kvcache"
DEFAULT_MODELS = ["demo", "gpt2-124m-random"]
PROMPT_TOKENS = 16  # prompt length of the generation workload
GEN_LENGTHS = [16, 32, 64, 128, 256, 512]  # generated tokens; capped at the context window minus the prompt
TTFT_PROMPTS = [16, 64, 256, 512]  # prompt tokens; plus the context window minus 16
QUICK_GEN_LENGTHS = [16, 64]
QUICK_TTFT_PROMPTS = [16, 256]
# Step 1 is O(n^2) in the generated length: on the larger model it stops at 256 tokens and takes part in
# fewer runs, so that the whole benchmark stays near 15 minutes on a 2-core CPU.
STEP1_LIMITS = {"gpt2-124m-random": {"max_tokens": 256, "runs": 3}}
STEP1_TARGET_TOKENS = 256  # the step1/step2 target holds from this generated length on
SEED = 0
CONFIG_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "head_dim")


def main(models: list[str] | None = None, device: str = "cpu", runs: int = 5, quick: bool = False) -> dict:
    """The CLI entry (``python -m benchmarks kvcache``): the full or quick workload on each model."""
    if quick:
        return run(
            models or DEFAULT_MODELS,
            device,
            runs=1,
            gen_lengths=QUICK_GEN_LENGTHS,
            ttft_prompts=QUICK_TTFT_PROMPTS,
            quick=True,
        )
    return run(models or DEFAULT_MODELS, device, runs=runs)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = 5,
    gen_lengths: list[int] = GEN_LENGTHS,
    ttft_prompts: list[int] = TTFT_PROMPTS,
    step1_limits: dict[str, dict] = STEP1_LIMITS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Run the three workloads on each model; write ``<out_dir>/kvcache-<device>.json`` and ``.png``.

    models: benchmark model names (``benchmarks.lib.models.MODELS``) or snapshot folders. runs: measured
    runs per point, after one warm-up. gen_lengths: generated tokens of workload a (each capped at the
    context window minus the 16-token prompt). ttft_prompts: prompt lengths of workload b (those that fit,
    plus the context window minus 16). step1_limits: model name -> {"max_tokens", "runs"} for step 1.
    Returns the result dict that was written (see benchmarks/README.md for its layout).
    """
    started = time.perf_counter()
    torch.manual_seed(SEED)
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, "float32"),
        "workload": {
            "batch_size": 1,
            "sampling": "greedy (temperature 0), ignore_eos",
            "prompts": f"random token ids in [0, vocab_size - 1), torch.Generator seeded {SEED} + prompt "
            "length",
            "generation_prompt_tokens": PROMPT_TOKENS,
            "generated_tokens": gen_lengths,
            "ttft_prompt_tokens": ttft_prompts,
            "runs": runs,
            "warmup_runs": 1,
            "quick": quick,
            "step1_limits": step1_limits,
            "engines": {
                "step1": "step1_generate.LLM.generate: no cache, the whole sequence every step",
                "step2": "step2_kvcache.LLM.generate: KV cache, prefill then one token per step",
                "hf": "transformers GPT2LMHeadModel.generate(do_sample=False, use_cache=True, "
                "max_new_tokens=n, min_new_tokens=n), torch.inference_mode",
            },
            "timing": "time.perf_counter around the whole generate call; engines alternated within each run "
            "(order rotated per run); medians over runs; ratios are medians of per-run ratios",
        },
        "models": {},
    }

    def run(name: str) -> dict:
        return bench_model(
            name,
            device,
            runs,
            gen_lengths,
            ttft_prompts,
            step1_limits.get(name, {}),
        )

    harness.run_models(result, models, run)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str, device: str, runs: int, gen_lengths: list[int], ttft_prompts: list[int], step1_limit: dict
) -> dict:
    """All three workloads on one model; the figures of every run, their medians and ratios."""
    import step1_generate
    import step2_kvcache

    folder = snapshot(name)
    step1 = step1_generate.LLM(model=str(folder), device=device, dtype="float32")
    step2 = step2_kvcache.LLM(model=str(folder), device=device, dtype="float32")
    hf = hf_model(folder, device)
    config = step2.config
    window = config.n_positions

    def engines(prompt: list[int], n: int) -> dict:
        return {
            "step1": lambda: time_llm(step1, step1_generate.SamplingParams, prompt, n, device),
            "step2": lambda: time_llm(step2, step2_kvcache.SamplingParams, prompt, n, device),
            "hf": lambda: time_hf(hf, prompt, n, device),
        }

    # a. ms per generated token against the generated length
    lengths = sorted({min(n, window - PROMPT_TOKENS) for n in gen_lengths})
    step1_max = step1_limit.get("max_tokens", max(lengths))
    step1_runs = min(runs, step1_limit.get("runs", runs))
    prompt = random_prompt(PROMPT_TOKENS, config.vocab_size)
    generation = []
    for n in lengths:
        print(f"  generate {n} tokens after {PROMPT_TOKENS}", flush=True)
        calls = engines(prompt, n)
        if n > step1_max:
            del calls["step1"]
        raw = harness.alternate(calls, runs, runs_of={"step1": step1_runs})
        generation.append(summarise({"generated_tokens": n}, raw, "ms_per_token"))

    # b. time to first token against the prompt length
    ttft = []
    for p in sorted({p for p in ttft_prompts if p <= window - 16} | {window - 16}):
        print(f"  first token after {p} prompt tokens", flush=True)
        calls = engines(random_prompt(p, config.vocab_size), 1)
        del calls["step1"]
        ttft.append(summarise({"prompt_tokens": p}, harness.alternate(calls, runs), "wall_s"))

    return {
        "snapshot": str(folder),
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "parameters": sum(p.numel() for p in step2.model.parameters()),
        "step1": {
            "max_tokens": step1_max,
            "runs": step1_runs,
            "capped": step1_max < max(lengths) or step1_runs < runs,
        },
        "generation": generation,
        "ttft": ttft,
        "kv_cache_bytes": kv_cache_bytes(config, device),
    }


def time_llm(llm, sampling_params: type, prompt: list[int], n: int, device: str) -> dict:
    """One request to a step's ``LLM``: ``n`` tokens, greedy, ignore_eos. Wall time of the ``generate``
    call, ms per generated token, and the engine's own metrics (TTFT, gaps between tokens), in seconds."""
    params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
    wall, outs = harness.timed(
        lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=params), device
    )
    out = outs[0]
    ids = out.outputs[0].token_ids
    latencies = out.metrics.decode_latencies_s
    return {
        "wall_s": wall,
        "generated_tokens": len(ids),
        "ms_per_token": 1e3 * wall / len(ids),
        "ttft_s": out.metrics.ttft_s,
        "decode_latency_median_s": harness.median(latencies),
        "decode_latency_mean_s": sum(latencies) / len(latencies) if latencies else None,
        "token_ids": ids,
    }


@torch.inference_mode()
def time_hf(model, prompt: list[int], n: int, device: str) -> dict:
    """One request to Hugging Face's ``generate``: exactly ``n`` new tokens, greedy, its KV cache on."""
    input_ids = torch.tensor([prompt], device=device)  # [1, T]
    wall, out = harness.timed(
        lambda: model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            use_cache=True,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=model.config.eos_token_id,
        ),
        device,
    )
    new = out[0, input_ids.shape[1] :].tolist()  # [n]
    return {
        "wall_s": wall,
        "generated_tokens": len(new),
        "ms_per_token": 1e3 * wall / len(new),
        "token_ids": new,
    }


def summarise(point: dict, raw: dict[str, list[dict]], key: str) -> dict:
    """One workload point: every run's figures, the medians, engine/step2 ratios on ``key``, and whether
    the engines' greedy token ids agreed with step2's (in the first run; random weights have near-ties,
    so a mismatch there is a hint, not a failure)."""
    ids = {engine: runs[0].pop("token_ids") for engine, runs in raw.items()}
    others = [engine for engine in raw if engine != "step2"]
    for runs in raw.values():
        for r in runs:
            r.pop("token_ids", None)
    return {
        **point,
        "runs": raw,
        "median": {engine: harness.medians(runs) for engine, runs in raw.items()},
        "ratios": {f"{engine}/step2": harness.ratio(raw[engine], raw["step2"], key) for engine in others},
        "same_ids_as_step2": {engine: ids[engine] == ids["step2"] for engine in others},
    }


def random_prompt(length: int, vocab_size: int) -> list[int]:
    """``length`` token ids, uniform in [0, vocab_size - 1) (never the end-of-text id), seeded by the
    length."""
    generator = torch.Generator().manual_seed(SEED + length)
    return torch.randint(0, vocab_size - 1, (length,), generator=generator).tolist()


def kv_cache_bytes(config, device: str) -> dict:
    """KV cache bytes per token, fp32 and fp16: by the formula, and as ``step2_kvcache.KVCache``
    allocates them for the whole context window (an allocation only, nothing is computed)."""
    from step2_kvcache.kv_cache import KVCache

    out = {}
    for dtype in (torch.float32, torch.float16):
        element = torch.empty((), dtype=dtype).element_size()
        formula = 2 * config.n_layer * config.n_head * config.head_dim * element
        cache = KVCache(config, config.n_positions, device, dtype)
        out[str(dtype).removeprefix("torch.")] = {
            "bytes_per_element": element,
            "formula_bytes_per_token": formula,
            "measured_bytes_per_token": cache.nbytes / cache.capacity,
            "context_window_tokens": config.n_positions,
            "context_window_bytes": cache.nbytes,
        }
        del cache
    return out


def targets(model: dict) -> list[dict]:
    """The step's performance targets on one model's results: ``harness.target_line``'s arguments (label,
    value, target, full_size: whether the lengths the target is defined at ran)."""
    gen = model["generation"]
    first, last = gen[0], gen[-1]
    decode = [g["median"]["step2"]["decode_latency_median_s"] for g in (first, last)]
    with_step1 = [g for g in gen if "step1" in g["median"]]
    s1 = with_step1[-1] if with_step1 else None
    longest = last["generated_tokens"] == min(
        max(GEN_LENGTHS), model["config"]["n_positions"] - PROMPT_TOKENS
    )
    return [
        {
            "label": f"step2 decode latency at {last['generated_tokens']} / at "
            f"{first['generated_tokens']} generated tokens",
            "value": decode[1] / decode[0] if all(decode) else None,
            "target": "<= 1.3",
            "full_size": longest and first["generated_tokens"] == min(GEN_LENGTHS),
        },
        {
            "label": f"step1 / step2 ms per token at {s1['generated_tokens'] if s1 else '-'} generated "
            "tokens",
            "value": s1["ratios"]["step1/step2"]["median"] if s1 else None,
            "target": ">= 4",
            "full_size": s1 is not None and s1["generated_tokens"] >= STEP1_TARGET_TOKENS,
        },
        {
            "label": f"HF / step2 ms per token at {last['generated_tokens']} generated tokens",
            "value": last["ratios"]["hf/step2"]["median"],
            "target": ">= 1.0",
            "full_size": longest,
        },
    ]


def report(result: dict) -> str:
    """The readable summary printed at the end: per model, three tables and the target lines."""
    lines = []
    machine = result["machine"]
    lines.append(
        f"kvcache on {machine['device']} ({machine['cpu']}, {machine['torch_threads']} torch threads), "
        f"torch {machine['torch']}, transformers {machine['transformers']}, "
        f"{result['workload']['runs']} run(s), medians"
    )
    for name, model in result["models"].items():
        c = model["config"]
        lines.append(
            f"\n## {name}: {model['parameters'] / 1e6:.1f}M parameters, {c['n_layer']} layers, "
            f"{c['n_embd']} wide, {c['n_positions']} positions"
        )
        rows = []
        for g in model["generation"]:
            m, r = g["median"], g["ratios"]
            rows.append(
                [
                    g["generated_tokens"],
                    m.get("step1", {}).get("ms_per_token"),
                    m["step2"]["ms_per_token"],
                    m["hf"]["ms_per_token"],
                    r.get("step1/step2", {}).get("median"),
                    r["hf/step2"]["median"],
                    1e3 * m["step2"]["decode_latency_median_s"],
                ]
            )
        lines.append(f"\ngeneration after a {PROMPT_TOKENS}-token prompt (ms per generated token)")
        headers = ["tokens", "step1", "step2", "HF", "step1/step2", "HF/step2", "step2 decode ms"]
        lines.append(harness.table(headers, rows))
        s1 = model["step1"]
        if s1["capped"]:
            lines.append(f"(step1 capped: up to {s1['max_tokens']} tokens, {s1['runs']} run(s))")
        rows = [
            [
                t["prompt_tokens"],
                1e3 * t["median"]["step2"]["ttft_s"],
                1e3 * t["median"]["step2"]["wall_s"],
                1e3 * t["median"]["hf"]["wall_s"],
                t["ratios"]["hf/step2"]["median"],
            ]
            for t in model["ttft"]
        ]
        lines.append("\ntime to first token (ms)")
        lines.append(harness.table(["prompt", "step2 TTFT", "step2 call", "HF call", "HF/step2"], rows))
        rows = [
            [
                dtype,
                k["formula_bytes_per_token"],
                k["measured_bytes_per_token"],
                k["context_window_tokens"],
                f"{k['context_window_bytes'] / 2**20:.2f} MiB",
            ]
            for dtype, k in model["kv_cache_bytes"].items()
        ]
        lines.append("\nKV cache memory")
        headers = ["dtype", "bytes/token (formula)", "bytes/token (KVCache)", "window", "window total"]
        lines.append(harness.table(headers, rows))
        lines.append("\ntargets")
        lines.extend(harness.target_line(**t) for t in targets(model))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """One row of three panels per model: ms/token vs generated length (step1, step2, HF, log scale),
    step2's decode latency vs generated length, and the first token's time vs prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = result["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for row, (name, model) in zip(axes, models.items()):
        gen = model["generation"]
        ax = row[0]
        all_ms = []
        for engine, label in (
            ("step1", "step1 (no cache)"),
            ("step2", "step2 (KV cache)"),
            ("hf", "HF generate"),
        ):
            points = [g for g in gen if engine in g["median"]]
            all_ms += [g["median"][engine]["ms_per_token"] for g in points]
            ax.plot([g["generated_tokens"] for g in points], all_ms[-len(points) :], marker="o", label=label)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="generated tokens",
            ylabel="ms per generated token",
            title=f"{name}: ms/token after a {PROMPT_TOKENS}-token prompt",
        )
        ax.set_xticks([g["generated_tokens"] for g in gen], [str(g["generated_tokens"]) for g in gen])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        harness.log_axis(ax.yaxis, all_ms)
        ax.grid(which="major", axis="y", alpha=0.3)
        ax.legend()
        ax = row[1]
        decode_ms = [1e3 * g["median"]["step2"]["decode_latency_median_s"] for g in gen]
        ax.plot([g["generated_tokens"] for g in gen], decode_ms, marker="o", color="C1")
        ax.set(
            xlabel="generated tokens",
            ylabel="ms between tokens (median)",
            ylim=(0, None),
            title=f"{name}: step2 decode latency",
        )
        ax = row[2]
        for engine, label, color in (("step2", "step2", "C1"), ("hf", "HF generate", "C2")):
            ttft_ms = [1e3 * t["median"][engine]["wall_s"] for t in model["ttft"]]
            ax.plot(
                [t["prompt_tokens"] for t in model["ttft"]], ttft_ms, marker="o", label=label, color=color
            )
        ax.set(
            xlabel="prompt tokens",
            ylabel="ms to the first token (whole call)",
            ylim=(0, None),
            title=f"{name}: time to first token",
        )
        ax.legend()
    machine = result["machine"]
    fig.suptitle(
        f"KV cache benchmark, {machine['device']} ({machine['cpu']}, {machine['torch_threads']} threads), "
        f"{machine['dtype']}, median of {result['workload']['runs']} run(s)"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path, dpi=110)

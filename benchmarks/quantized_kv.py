"""Step 12's benchmark: what an 8-bit KV cache costs in accuracy and buys in speed and room (auto/int8/fp8).

Accuracy: the demo checkpoint, teacher-forced over held-out text (lib/workloads/heldout.txt), perplexity
and top-1 agreement with auto, greedy continuations token by token. Speed (GPT-2 124M shapes): the decode
attention kernel alone (batch 1 / 64 / 256, context 128-1,024), end to end (256 x (512 + 256), batch 1
short), and a fixed 1 GiB pool with more requests than fit in fp16 (tok/s, preemptions, most running).
Details: benchmarks/README.md.

    python -m benchmarks quantized_kv                  # CPU, fp32: accuracy (speed points tiny, interpreted)
    python -m benchmarks quantized_kv --device cuda    # fp16: accuracy and the H200 points
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import torch

from .lib import harness
from .lib.models import snapshot

NAME = "quantized_kv"
DEFAULT_MODELS = ["demo"]
DEFAULT_RUNS = 3
MODES = ["auto", "int8", "fp8"]
HELDOUT = Path(__file__).resolve().parent / "lib" / "workloads" / "heldout.txt"
SIZES = {  # kernel: (batches, contexts); e2e: name -> (requests, prompt, generated); pool: bytes, requests
    "cuda": {
        "kernel": ([1, 64, 256], [128, 256, 512, 1024]),
        "e2e": {"batch1_short": (1, 32, 128), "256x(512+256)": (256, 512, 256)},
        "pool": (2**30, 128, 512, 256),
        "greedy": (64, 8),
    },
    "cpu": {
        "kernel": ([1], [128]),
        "e2e": {"batch1_short": (1, 32, 32), "8x(64+32)": (8, 64, 32)},
        "pool": (6 * 2**20, 16, 64, 32),
        "greedy": (64, 8),
    },
    "quick": {
        "kernel": ([1], [64]),
        "e2e": {"batch1_short": (1, 8, 8)},
        "pool": (2 * 2**20, 6, 32, 16),
        "greedy": (16, 2),
        "windows": 1,
    },
}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks quantized_kv``)."""
    kind = "quick" if quick else "cuda" if device.startswith("cuda") else "cpu"
    return run(models or DEFAULT_MODELS, device, 1 if quick else runs, SIZES[kind], quick)


def run(models, device, runs, sizes, quick=False, out_dir: Path = harness.RESULTS) -> dict:
    started = time.perf_counter()
    dtype = "float16" if device.startswith("cuda") else "float32"
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            "accuracy": "demo checkpoint, held-out documents (every 50th of the corpus, never trained on), "
            "windows of the context length, teacher-forced; greedy: the first tokens of each document as "
            "prompts",
            "speed": "gpt2-124m-random (GPT-2 124M shapes), greedy, ignore_eos; modes alternated per run",
            "sizes": {k: v for k, v in sizes.items()},
            "runs": runs,
            "quick": quick,
        },
        "models": {},
    }
    harness.run_models(result, models, lambda name: accuracy(name, device, dtype, sizes))
    speed_model = "demo" if quick or not device.startswith("cuda") else "gpt2-124m-random"
    result["speed"] = speed(speed_model, device, dtype, runs, sizes)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


# ---- accuracy ----------------------------------------------------------------------------------------------


def heldout_ids(tokenizer) -> list[int]:
    """The held-out documents as one id stream, a line <|endoftext|> between them (the training format;
    the tokenizer gives it its own id)."""
    return tokenizer.encode(HELDOUT.read_text())


def window_logits(model, ids: torch.Tensor, mode: str, device: str, dtype, backend: str) -> torch.Tensor:
    """Logits at every position of one prefill of ``ids`` [T] through a fresh pool of ``mode``: [T, V]."""
    from step12_quantized_kv.kv_cache import PagedKVCache
    from step12_quantized_kv.model import AttentionMetadata

    T, bs = ids.numel(), 16
    cache = PagedKVCache(model.config, math.ceil(T / bs), bs, device, dtype, mode)
    starts = torch.tensor([0, T], device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T, device=device),
        query_start_loc=[0, T],
        query_start_loc_t=starts,
        logits_indices=torch.arange(T, device=device),
        num_prefills=1,
        seq_lens=torch.tensor([T], device=device),
        block_tables=torch.arange(math.ceil(T / bs), device=device)[None],
        max_query_len=T,
        attention_backend=backend,
        decode_mask=None,
        prefill_seq_lens=[T] if backend == "torch" else None,
    )
    with torch.inference_mode():
        return model(ids.to(device), torch.arange(T, device=device), cache, meta).float()  # [T, V]


def accuracy(name: str, device: str, dtype: str, sizes: dict) -> dict:
    import step12_quantized_kv as step12
    from common.tokenizer import Tokenizer
    from step12_quantized_kv.model import GPT

    folder = snapshot(name)
    torch_dtype = getattr(torch, dtype)
    model = GPT.from_pretrained(str(folder), device=device, dtype=torch_dtype)
    backend = "triton" if device.startswith("cuda") else "torch"
    ids = torch.tensor(heldout_ids(Tokenizer(folder)))
    window = model.config.n_positions
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)][: sizes.get("windows")]
    per_mode = {
        m: {"nll": 0.0, "tokens": 0, "agree": 0, "finite": True, "max_abs_logit_diff": 0.0} for m in MODES
    }
    for w in windows:
        logits = {m: window_logits(model, w, m, device, torch_dtype, backend) for m in MODES}
        targets = w[1:].to(device)
        top_auto = logits["auto"][:-1].argmax(-1)
        for m in MODES:
            x = per_mode[m]
            lp = torch.log_softmax(logits[m][:-1], -1)
            x["nll"] += -lp.gather(1, targets[:, None]).sum().item()
            x["tokens"] += targets.numel()
            x["agree"] += (logits[m][:-1].argmax(-1) == top_auto).sum().item()
            x["finite"] &= bool(torch.isfinite(logits[m]).all())
            x["max_abs_logit_diff"] = max(
                x["max_abs_logit_diff"], (logits[m] - logits["auto"]).abs().max().item()
            )
    out = {"snapshot": str(folder), "tokens": int(len(ids)), "windows": len(windows), "modes": {}}
    for m, x in per_mode.items():
        out["modes"][m] = {
            "perplexity": math.exp(x["nll"] / x["tokens"]),
            "top1_agreement": x["agree"] / x["tokens"],
            "finite": x["finite"],
            "max_abs_logit_diff": x["max_abs_logit_diff"],
            "positions": x["tokens"],
        }
    ppl = out["modes"]["auto"]["perplexity"]
    for m in MODES:
        out["modes"][m]["perplexity_change"] = out["modes"][m]["perplexity"] / ppl - 1
    # greedy continuations: the first tokens of each document as a prompt, counted to the first difference
    max_tokens, num = sizes["greedy"]
    docs = [d.strip() for d in HELDOUT.read_text().split("<|endoftext|>")][:num]
    prompts = [" ".join(d.split()[:12]) for d in docs]
    params = step12.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    greedy = {}
    for m in MODES:
        llm = step12.LLM(model=str(folder), device=device, dtype=dtype, kv_cache_dtype=m)
        greedy[m] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine_core.shutdown()
    out["greedy"] = {"max_tokens": max_tokens, "prompts": len(prompts)}
    for m in MODES[1:]:
        same = [
            next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
            for r, g in zip(greedy["auto"], greedy[m])
        ]
        out["greedy"][m] = {
            "tokens_equal_before_first_difference": same,
            "all_equal": sum(s == max_tokens for s in same),
        }
    return out


# ---- speed -------------------------------------------------------------------------------------------------


def speed(name: str, device: str, dtype: str, runs: int, sizes: dict) -> dict:
    folder = snapshot(name)
    out = {"model": name, "kernel": kernel_points(folder, device, dtype, runs, *sizes["kernel"])}
    out["e2e"] = {k: e2e_point(folder, device, dtype, runs, *v) for k, v in sizes["e2e"].items()}
    out["pool"] = pool_point(folder, device, dtype, *sizes["pool"])
    return out


def kernel_points(folder, device, dtype, runs, batches, contexts) -> dict:
    """One layer's decode attention (a query per sequence, H x D of the model), auto vs int8 vs fp8: the
    median microseconds per launch (50 launches replayed from a CUDA graph) and the bytes of K, V and
    scales it must read, over the copy bandwidth."""
    from common.weights import load_config
    from step12_quantized_kv import kernels
    from step12_quantized_kv.kv_cache import KV_CACHE_DTYPES
    from step12_quantized_kv.kv_quant import SCALE_DTYPE, quantize

    config, torch_dtype = load_config(folder), getattr(torch, dtype)
    H, D, bs = config.n_head, config.head_dim, 16
    bandwidth = harness.copy_bandwidth(device) if device.startswith("cuda") else None
    reps = 50 if device.startswith("cuda") else 1
    points = {}
    for B in batches:
        for L in contexts:
            width = math.ceil(L / bs)
            tables = torch.randperm(B * width, device=device).view(B, width)
            k = torch.randn(B * width, bs, H, D, device=device, dtype=torch_dtype)
            v = torch.randn_like(k)
            q = torch.randn(B, H, D, device=device, dtype=torch_dtype)
            lens, qsl = torch.full((B,), L, device=device), torch.arange(B + 1, device=device)
            calls, nbytes = {}, {}
            for m in MODES:
                if m == "auto":
                    args, kw, nbytes[m] = (k, v), {}, 2 * B * L * H * D * k.element_size()
                else:
                    (kq, ks), (vq, vs) = (quantize(t.flatten(0, 1), KV_CACHE_DTYPES[m]) for t in (k, v))
                    args = (kq.view(k.shape), vq.view(v.shape))
                    kw = dict(k_scale=ks.view(k.shape[:3]), v_scale=vs.view(v.shape[:3]))
                    nbytes[m] = 2 * B * L * H * (D + SCALE_DTYPE.itemsize)

                launch = functools.partial(kernels.paged_attention, q, *args, tables, lens, qsl, 1, **kw)
                replay = repeated(launch, reps, device)

                def call(replay=replay):
                    wall, _ = harness.timed(replay, device)
                    return {"us": 1e6 * wall / reps}

                calls[m] = call
            per_run = harness.alternate(calls, runs)
            point = {"batch": B, "context": L, "median": {m: harness.medians(r) for m, r in per_run.items()}}
            for m in MODES:
                point["median"][m]["bytes"] = nbytes[m]
                if bandwidth:
                    point["median"][m]["of_copy_bandwidth"] = (
                        nbytes[m] / (point["median"][m]["us"] * 1e-6) / bandwidth
                    )
            point["speedup"] = {
                m: harness.ratio(per_run["auto"], per_run[m], "us")["median"] for m in MODES[1:]
            }
            points[f"{B}x{L}"] = point
            print(
                f"  kernel B={B} L={L}: " + ", ".join(f"{m} {point['median'][m]['us']:.1f} us" for m in MODES)
            )
    return points


def repeated(launch, reps: int, device: str):
    """A call that runs ``launch`` ``reps`` times: on CUDA one replay of a graph that holds them (compiled
    and captured here), so that the time is the GPU's, not the host's ~50 us of checks per launch."""
    if not device.startswith("cuda"):
        return lambda: [launch() for _ in range(reps)]
    launch()  # compile outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            launch()

    def replay(inputs=launch):  # holds the captured tensors: freed, the graph would read released memory
        graph.replay()

    return replay


def e2e_point(folder, device, dtype, runs, requests, prompt_len, max_tokens) -> dict:
    """``requests`` random prompts of ``prompt_len`` tokens, ``max_tokens`` each, through ``LLM.generate``."""
    import step12_quantized_kv as step12

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 8000, (requests, prompt_len), generator=gen).tolist()
    params = step12.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llms = {
        m: step12.LLM(model=str(folder), device=device, dtype=dtype, max_num_seqs=requests, kv_cache_dtype=m)
        for m in MODES
    }

    def measured(llm):
        def call():
            wall, outs = harness.timed(
                lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params), device
            )
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            return {"tok_per_s": tokens / wall, "ms_per_token": 1e3 * wall / max_tokens}

        return call

    per_run = harness.alternate({m: measured(llm) for m, llm in llms.items()}, runs)
    for llm in llms.values():
        llm.engine_core.shutdown()
    harness.free(device)
    print(f"  e2e {requests}x({prompt_len}+{max_tokens}) done", flush=True)
    return {
        "requests": requests,
        "prompt": prompt_len,
        "max_tokens": max_tokens,
        "median": {m: harness.medians(r) for m, r in per_run.items()},
        "ratio": {m: harness.ratio(per_run[m], per_run["auto"], "tok_per_s")["median"] for m in MODES[1:]},
    }


def pool_point(folder, device, dtype, budget, requests, prompt_len, max_tokens) -> dict:
    """A KV pool of ``budget`` bytes, ``requests`` requests submitted at once (more than fit in auto's
    pool): throughput, preemptions and the most sequences running at once, stepping ``LLMEngine``."""
    import step12_quantized_kv as step12

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 8000, (requests, prompt_len), generator=gen).tolist()
    params = step12.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = {"budget_bytes": budget, "requests": requests, "prompt": prompt_len, "max_tokens": max_tokens}
    for m in MODES:
        engine = step12.LLMEngine(
            model=str(folder),
            device=device,
            dtype=dtype,
            kv_cache_memory=budget,
            max_num_seqs=requests,
            kv_cache_dtype=m,
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        most, tokens = 0, 0
        harness.synchronize(device)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            most = max(most, engine.stats.num_running_reqs)
        harness.synchronize(device)
        wall = time.perf_counter() - start
        out[m] = {
            "num_kv_blocks": engine.args.num_kv_blocks,
            "tok_per_s": tokens / wall,
            "num_preemptions": engine.stats.num_preemptions,
            "most_running": most,
        }
        del engine
        harness.free(device)
    for m in MODES[1:]:
        out[m]["ratio"] = out[m]["tok_per_s"] / out["auto"]["tok_per_s"]
    print("  pool: " + ", ".join(f"{m} {out[m]['tok_per_s']:.0f} tok/s" for m in MODES), flush=True)
    return out


# ---- report and plot ---------------------------------------------------------------------------------------


def report(result: dict) -> str:
    lines = []
    for name, model in result["models"].items():
        rows = [
            [
                m,
                f"{x['perplexity']:.4f}",
                f"{100 * x['perplexity_change']:+.3f} %",
                f"{100 * x['top1_agreement']:.2f} %",
                f"{x['max_abs_logit_diff']:.3f}",
                x["finite"],
            ]
            for m, x in model["modes"].items()
        ]
        headers = ["kv_cache_dtype", "perplexity", "vs auto", "top-1 = auto", "max |dlogit|", "finite"]
        lines += [
            f"{name}, {model['tokens']} held-out tokens "
            f"({result['machine']['device']}, {result['machine']['dtype']})",
            harness.table(headers, rows),
        ]
        for m in MODES[1:]:
            g = model["greedy"][m]
            lines.append(
                f"greedy {m}: {g['all_equal']}/{model['greedy']['prompts']} continuations equal auto's over "
                f"{model['greedy']['max_tokens']} tokens; equal tokens before the first difference: "
                f"{g['tokens_equal_before_first_difference']}"
            )
    speed_result = result["speed"]
    rows = [
        [
            key,
            *(f"{p['median'][m]['us']:.1f}" for m in MODES),
            *(f"{p['speedup'][m]:.2f}x" for m in MODES[1:]),
        ]
        for key, p in speed_result["kernel"].items()
    ]
    lines += ["decode attention kernel, one layer (us)", harness.table(["BxL", *MODES, "int8", "fp8"], rows)]
    rows = [
        [
            key,
            *(f"{p['median'][m]['tok_per_s']:,.0f}" for m in MODES),
            *(f"{p['ratio'][m]:.2f}x" for m in MODES[1:]),
        ]
        for key, p in speed_result["e2e"].items()
    ]
    lines += ["end to end (tok/s)", harness.table(["workload", *MODES, "int8", "fp8"], rows)]
    pool = speed_result["pool"]
    rows = [
        [
            m,
            pool[m]["num_kv_blocks"],
            f"{pool[m]['tok_per_s']:,.0f}",
            pool[m]["num_preemptions"],
            pool[m]["most_running"],
        ]
        for m in MODES
    ]
    lines += [
        f"a {pool['budget_bytes'] / 2**20:.0f} MiB pool, "
        f"{pool['requests']} x ({pool['prompt']} + {pool['max_tokens']})",
        harness.table(["mode", "blocks", "tok/s", "preemptions", "most running"], rows),
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    model = next(iter(result["models"].values()))
    modes = list(model["modes"])
    axes[0].bar(modes, [100 * model["modes"][m]["perplexity_change"] for m in modes])
    axes[0].set_ylabel("perplexity vs auto (%)")
    axes[0].set_title(
        "held-out perplexity; top-1 = auto: "
        + ", ".join(f"{m} {100 * model['modes'][m]['top1_agreement']:.2f}%" for m in modes[1:]),
        fontsize=9,
    )
    kernel = result["speed"]["kernel"]
    keys = list(kernel)
    for m in MODES:
        axes[1].plot(keys, [kernel[k]["median"][m]["us"] for k in keys], "o-", label=m)
    axes[1].set_ylabel("us per launch")
    axes[1].set_title("decode attention kernel (B x context)")
    axes[1].legend()
    pool = result["speed"]["pool"]
    axes[2].bar(MODES, [pool[m]["tok_per_s"] for m in MODES])
    for i, m in enumerate(MODES):
        axes[2].annotate(
            f"{pool[m]['num_preemptions']} preempt., {pool[m]['most_running']} at once",
            (i, pool[m]["tok_per_s"]),
            ha="center",
            fontsize=8,
        )
    axes[2].set_ylabel("tok/s")
    axes[2].set_title(f"{pool['budget_bytes'] / 2**20:.0f} MiB pool, {pool['requests']} requests")
    fig.suptitle(f"{result['machine']['device']}, {result['machine']['dtype']}")
    fig.tight_layout()
    return harness.save_figure(fig, path)

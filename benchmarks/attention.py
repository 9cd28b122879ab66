"""Step 5's kernels against the PyTorch ways, one operation at a time, and a KV-memory model.

On the model's attention shape (``gpt2-124m-random``: 12 heads x 64), fp16, blocks of 16, random data: a.
causal prefill (materialised T x T, torch's SDPA, the Triton kernel over a paged pool), b. paged decode (step
4's gather + SDPA, the Triton kernel plain and flash-decoding), c. ``write_kv`` against step 4's indexing, d.
the blocks and sequences a KV budget holds. Checked against ``paged_attention_reference``;
``triton.testing.do_bench`` on a GPU. Sizes, figures, targets and the JSON layout: benchmarks/README.md.

    python -m benchmarks attention --device cuda
    python -m benchmarks attention --quick         # the CPU, through Triton's interpreter: tiny sizes, fp32
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter for the kernels on CPU tensors: read when triton is
    os.environ.setdefault("TRITON_INTERPRET", "1")  # first imported (by kernels below, or by transformers)

import torch.nn.functional as F  # noqa: E402

from common.weights import load_config  # noqa: E402
from step4_paged_continuous.kv_cache import PagedKVCache  # noqa: E402
from step4_paged_continuous.model import decode_attention_mask  # noqa: E402
from step5_flash_gpu.flash_decoding import choose_num_splits, flash_decoding_attention  # noqa: E402
from step5_flash_gpu.kernels import paged_attention, paged_attention_reference, triton_usable  # noqa: E402
from step5_flash_gpu.kv_write import write_kv  # noqa: E402

from .lib import harness  # noqa: E402
from .lib.models import snapshot  # noqa: E402

NAME = "attention"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3  # rounds per point
BLOCK_SIZE = 16
SEED = 0
FULL = {
    "dtype": "float16",
    "prefill_lens": [128 * 2**i for i in range(7)],  # 128 .. 8192
    "prefill_batch": 8,
    "decode_seqs": [1, 8, 64, 256],
    "decode_ctx": [128, 512, 1024, 4096],
    "write_tokens": [1, 64, 256, 2048, 8192],
    "write_pool_blocks": 16384,
    "kv_budgets": [2**30, 4 * 2**30],  # KV-cache bytes
    "kv_lengths": [256, 1024],  # tokens per sequence (prompt + generated)
    # long enough that every sequence is admitted (1024 prompt tokens a step) before any ends
    "kv_generated": 192,
    "cpu_repeats": 3,
}
# --quick, on the CPU through the interpreter (one program at a time: slow): lengths off block boundaries
QUICK = {
    **FULL,
    "dtype": "float32",
    "prefill_lens": [16, 40],
    "prefill_batch": 2,
    "decode_seqs": [1, 2],
    "decode_ctx": [40],
    "write_tokens": [1, 24],
    "write_pool_blocks": 8,
    "cpu_repeats": 1,
}
TARGETS = {"prefill_faster_from": 256, "prefill_sdpa_from": 2048, "decode_point": (256, 1024)}
DECODE_SPLITS = {"triton_auto": None, "triton_plain": 1, "triton_split4": 4, "triton_split16": 16}
IMPLEMENTATIONS = {
    "materialised": "q k^T * D^-0.5, masked_fill(~causal, -inf) with a T x T tril mask made once, softmax, "
    "@ v; [B, H, T, D] contiguous",
    "sdpa": "F.scaled_dot_product_attention(q, k, v, is_causal=True) on [B, H, T, D] (PyTorch's backend "
    "choice)",
    "triton_paged": "step5_flash_gpu.kernels.paged_attention on q [B T, H, D] and a K/V pool of shuffled "
    "16-token blocks (tile sizes: the kernel's table)",
    "step4_gather_sdpa": "step4_paged_continuous PagedKVCache.gather (a copy of every sequence's blocks) + "
    "the SDPA call of step 4's model.paged_attention decode branch (additive mask of the positions past "
    "each length, made once per step)",
    "triton_auto": "flash_decoding_attention, num_splits=None: choose_num_splits decides (plain or "
    "flash-decoding)",
    "triton_plain": "flash_decoding_attention, num_splits=1: one program per (sequence, head)",
    "triton_split4": "flash_decoding_attention, num_splits=4: flash-decoding, 4 programs per (sequence, "
    "head) + the merge",
    "triton_split16": "flash_decoding_attention, num_splits=16",
    "indexing": "step4_paged_continuous PagedKVCache.write: k_cache.view(-1, H, D)[slots] = k, and v",
    "triton_write_kv": "step5_flash_gpu.kv_write.write_kv: one kernel for K and V",
}


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """The CLI entry (``python -m benchmarks attention``). Raises ValueError for the full sizes without
    CUDA."""
    if not quick and torch.device(device).type != "cuda":
        raise ValueError("the attention benchmark's full sizes need a CUDA GPU; use --quick on a CPU")
    return run(
        models or DEFAULT_MODELS, device, 1 if quick else runs, QUICK if quick else FULL, quick, out_dir
    )


def run(
    models: list[str],
    device: str,
    runs: int,
    sizes: dict = FULL,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
    measure_memory: bool | None = None,
) -> dict:
    """Every section on each model's attention shape; write ``<out_dir>/attention-<device>.json`` and
    ``.png``.

    sizes: ``FULL``'s keys. measure_memory: run the engine for section d (default: on CUDA only; on a CPU the
    engine runs but no memory figure is read). Returns the result written (see benchmarks/README.md).
    """
    if not triton_usable(device):
        raise ValueError(
            f"Triton cannot run on {device} in this process: without CUDA, TRITON_INTERPRET=1 must be "
            "set before triton is first imported (import benchmarks.attention first)"
        )
    started = time.perf_counter()
    import triton

    result = {
        "benchmark": NAME,
        "machine": {
            **harness.machine_info(device, sizes["dtype"]),
            "triton": triton.__version__,
            "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
            "copy_bandwidth_bytes_per_s": harness.copy_bandwidth(device),
        },
        "workload": {
            **{k: v for k, v in sizes.items()},
            "block_size": BLOCK_SIZE,
            "runs": runs,
            "quick": quick,
            "seed": SEED,
            "implementations": IMPLEMENTATIONS,
            "prefill_batches": f"1 sequence, and {sizes['prefill_batch']} sequences of T tokens each",
            "decode": "S sequences of the same context, one query each; K/V bytes = 2 x S x context x H x D "
            "x itemsize",
            "write_kv": f"N tokens into random distinct slots of a {sizes['write_pool_blocks']}-block pool "
            "(one layer)",
            "timing": "triton.testing.do_bench median (warmup 25 ms, rep 100 ms) on a GPU, the median of "
            f"{sizes['cpu_repeats']} perf_counter-timed calls on a CPU; one untimed call per implementation "
            "first (its peak memory read then); rounds in rotating order; medians over rounds; ratios are "
            "medians of per-round ratios",
            "reference": "kernels.paged_attention_reference: textbook attention in fp32, one sequence at a "
            "time",
        },
        "models": {},
    }
    if measure_memory is None:
        measure_memory = torch.device(device).type == "cuda"

    def bench(name: str) -> dict:
        return bench_model(
            name, device, runs, sizes, result["machine"]["copy_bandwidth_bytes_per_s"], measure_memory
        )

    harness.run_models(result, models, bench)
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def bench_model(
    name: str, device: str, runs: int, sizes: dict, bandwidth: float, measure_memory: bool
) -> dict:
    folder = snapshot(name)
    config = load_config(folder)
    dtype = getattr(torch, sizes["dtype"])
    shape = {"n_layer": config.n_layer, "n_head": config.n_head, "head_dim": config.head_dim}
    gen = torch.Generator(device=device).manual_seed(SEED)  # data made on the device: fast at real sizes
    out = {
        "snapshot": str(folder),
        "config": {
            **shape,
            "n_embd": config.n_embd,
            "n_positions": config.n_positions,
            "vocab_size": config.vocab_size,
        },
    }
    out["prefill"] = bench_prefill(config, dtype, device, runs, sizes, gen)
    out["decode"] = bench_decode(config, dtype, device, runs, sizes, gen, bandwidth)
    out["write_kv"] = bench_write_kv(config, dtype, device, runs, sizes, gen)
    harness.free(device)  # its two pools went with its frame
    out["memory"] = memory_model(folder, config, sizes, device, measure_memory)
    return out


# ---- timing ------------------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Milliseconds of one ``fn()``: ``do_bench``'s median on a GPU, the median of ``repeats`` calls on a
    CPU."""
    if torch.device(device).type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(repeats):
        seconds, _ = harness.timed(fn, device)
        times.append(1e3 * seconds)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object], device: str) -> tuple[int | None, object]:
    """(bytes of GPU memory ``fn()`` allocates at its peak beyond what was allocated before (None on a CPU),
    its result)."""
    if torch.device(device).type != "cuda":
        return None, fn()
    harness.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    harness.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, out


def measure(
    impls: dict[str, Callable[[], object]],
    device: str,
    runs: int,
    repeats: int,
    check: Callable[[str, object], float] | None = None,
) -> dict:
    """One point: each implementation once untimed (its peak memory, and ``check(name, its output)``, the
    max_abs_diff recorded; out of memory recorded and the implementation left out), then ``runs`` rounds
    alternated. Returns runs, medians (+ peak_bytes), max_abs_diff (with ``check``), errors."""
    peaks, diffs, errors = {}, {}, {}
    for name, fn in impls.items():
        try:
            peaks[name], output = peak_bytes(fn, device)
            if check is not None:
                diffs[name] = check(name, output)
        except torch.OutOfMemoryError:
            errors[name] = "out of memory"
        output = None
        harness.free(device)
    live = {
        name: (lambda fn=fn: {"ms": time_ms(fn, device, repeats)})
        for name, fn in impls.items()
        if name not in errors
    }
    raw = harness.alternate(live, runs, warmup=0)
    median = {name: {**harness.medians(rs), "peak_bytes": peaks[name]} for name, rs in raw.items()}
    return {"runs": raw, "median": median, **({"max_abs_diff": diffs} if check else {}), "errors": errors}


def max_abs_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


# ---- the data ----------------------------------------------------------------------------------------------


def kv_pool(config, num_blocks: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> PagedKVCache:
    """Step 4's ``PagedKVCache`` for one layer of this attention shape, filled with random keys and values."""
    cache = PagedKVCache(dataclasses.replace(config, n_layer=1), num_blocks, BLOCK_SIZE, device, dtype)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=dtype))
    return cache


def paged_batch(config, num_seqs: int, seq_len: int, dtype, device: str, gen: torch.Generator):
    """A pool holding num_seqs sequences of seq_len tokens in shuffled blocks, and their block tables
    [S, M]."""
    m = math.ceil(seq_len / BLOCK_SIZE)
    cache = kv_pool(config, num_seqs * m, dtype, device, gen)
    block_tables = torch.randperm(num_seqs * m, generator=gen, device=device).view(
        num_seqs, m
    )  # int64, as step 4
    return cache, block_tables


# ---- a. prefill --------------------------------------------------------------------------------------------


def bench_prefill(config, dtype, device: str, runs: int, sizes: dict, gen) -> list[dict]:
    points = []
    for T in sizes["prefill_lens"]:
        for B in (1, sizes["prefill_batch"]):
            points.append(prefill_point(config, dtype, device, runs, sizes, gen, T, B))
            harness.free(device)  # the point's tensors went with its frame
    return points


def prefill_point(config, dtype, device: str, runs: int, sizes: dict, gen, T: int, B: int) -> dict:
    """B causal prompts of T tokens: materialised attention, SDPA and the Triton kernel."""
    H, D = config.n_head, config.head_dim
    cache, block_tables = paged_batch(config, B, T, dtype, device, gen)
    k_cache, v_cache = cache.k[0], cache.v[0]
    q = torch.randn(B * T, H, D, generator=gen, device=device, dtype=dtype)  # [B T, H, D]
    seq_lens = torch.full((B,), T, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)
    bt32 = block_tables.to(torch.int32)
    qc = q.view(B, T, H, D).transpose(1, 2).contiguous()  # [B, H, T, D], the same values, contiguous
    kc, vc = (c[block_tables].flatten(1, 2)[:, :T].transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # made once, like nanoGPT's buffer

    def materialised():
        att = (qc @ kc.transpose(-2, -1)) * (1.0 / math.sqrt(D))  # [B, H, T, T]
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        return att @ vc  # [B, H, T, D]

    def sdpa():
        return F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)  # [B, H, T, D]

    def triton_paged():
        return paged_attention(q, k_cache, v_cache, bt32, seq_lens, query_start_loc, T)  # [B T, H, D]

    impls = {"materialised": materialised, "sdpa": sdpa, "triton_paged": triton_paged}
    ref = paged_attention_reference(q, k_cache, v_cache, bt32, seq_lens, query_start_loc, T)  # [B T, H, D]

    def check(name: str, y: torch.Tensor) -> float:  # [B T, H, D] from Triton, [B, H, T, D] otherwise
        return max_abs_diff(y if name == "triton_paged" else y.transpose(1, 2).flatten(0, 1), ref)

    point = measure(impls, device, runs, sizes["cpu_repeats"], check)
    diffs = point["max_abs_diff"]
    flops = 4 * B * H * D * T * (T + 1) / 2
    for m in point["median"].values():
        if "ms" in m:
            m["tflops"] = flops / (m["ms"] * 1e-3) / 1e12
    ran = point["runs"]
    point["ratios"] = {
        label: harness.ratio(ran[a], ran[b], "ms")
        for label, (a, b) in {
            "materialised/triton": ("materialised", "triton_paged"),
            "triton/sdpa": ("triton_paged", "sdpa"),
        }.items()
        if a in ran and b in ran
    }
    print(
        f"  prefill T = {T:5d} x {B}: "
        + "  ".join(
            f"{n} {m['ms']:.3f} ms"
            + (f" {m['peak_bytes'] / 2**20:.1f} MiB" if m["peak_bytes"] is not None else "")
            for n, m in point["median"].items()
            if "ms" in m
        )
        + "".join(f"  {n}: {e}" for n, e in point["errors"].items())
        + f"  |triton - ref| {diffs.get('triton_paged', math.nan):.1e}",
        flush=True,
    )
    return {"T": T, "num_seqs": B, "tokens": B * T, "flops": flops, **point}


# ---- b. decode ---------------------------------------------------------------------------------------------


def bench_decode(config, dtype, device: str, runs: int, sizes: dict, gen, bandwidth: float) -> list[dict]:
    points = []
    for S in sizes["decode_seqs"]:
        for ctx in sizes["decode_ctx"]:
            points.append(decode_point(config, dtype, device, runs, sizes, gen, bandwidth, S, ctx))
            harness.free(device)  # the point's tensors went with its frame
    return points


def decode_point(
    config, dtype, device: str, runs: int, sizes: dict, gen, bandwidth: float, S: int, ctx: int
) -> dict:
    """S decodes over ctx tokens of context each: step 4's gather + SDPA and the Triton kernel's paths."""
    H, D = config.n_head, config.head_dim
    cache, block_tables = paged_batch(config, S, ctx, dtype, device, gen)
    q = torch.randn(S, H, D, generator=gen, device=device, dtype=dtype)  # [S, H, D]
    seq_lens = torch.full((S,), ctx, dtype=torch.int64, device=device)  # the new token included
    query_start_loc = torch.arange(S + 1, dtype=torch.int32, device=device)
    bt32, lens32 = block_tables.to(torch.int32), seq_lens.to(torch.int32)

    mask = decode_attention_mask(seq_lens, block_tables.shape[1] * BLOCK_SIZE, dtype)  # once per step

    def step4_gather_sdpa():  # step4_paged_continuous/model.py, paged_attention's decode branch (one layer)
        k_all, v_all = cache.gather(0, block_tables)  # [S_d, M * block_size, H, D]
        return F.scaled_dot_product_attention(
            q[:, :, None, :],  # [S_d, H, 1, D]
            k_all.transpose(1, 2),  # [S_d, H, M * block_size, D]
            v_all.transpose(1, 2),
            attn_mask=mask,  # [S_d, 1, 1, M * block_size]
        )[:, :, 0]  # [S_d, H, D]

    def triton_with(num_splits):
        return lambda: flash_decoding_attention(
            q, cache.k[0], cache.v[0], bt32, lens32, query_start_loc, 1, num_splits=num_splits
        )

    impls = {"step4_gather_sdpa": step4_gather_sdpa} | {n: triton_with(s) for n, s in DECODE_SPLITS.items()}
    ref = paged_attention_reference(q, cache.k[0], cache.v[0], bt32, lens32, query_start_loc, 1)
    point = measure(impls, device, runs, sizes["cpu_repeats"], lambda name, y: max_abs_diff(y, ref))
    kv_bytes = 2 * S * ctx * H * D * dtype.itemsize
    for m in point["median"].values():
        if "ms" in m:
            m["kv_bytes_per_s"] = kv_bytes / (m["ms"] * 1e-3)
            m["share_of_copy_bandwidth"] = m["kv_bytes_per_s"] / bandwidth
    ran = point["runs"]
    point["ratios"] = {
        f"step4/{n}": harness.ratio(ran["step4_gather_sdpa"], ran[n], "ms")
        for n in DECODE_SPLITS
        if n in ran and "step4_gather_sdpa" in ran
    }
    auto = choose_num_splits(S, H, 1, bt32.shape[1] * BLOCK_SIZE, q.device)
    print(
        f"  decode S = {S:3d}, context {ctx:4d} (auto: {auto} splits): "
        + "  ".join(
            f"{n.removeprefix('triton_')} {1e3 * m['ms']:.1f} us {100 * m['share_of_copy_bandwidth']:.1f}%"
            for n, m in point["median"].items()
            if "ms" in m
        )
        + f"  max |diff| {max(point['max_abs_diff'].values()):.1e}",
        flush=True,
    )
    return {"num_seqs": S, "context": ctx, "kv_bytes": kv_bytes, "auto_num_splits": auto, **point}


# ---- c. write_kv -------------------------------------------------------------------------------------------


def bench_write_kv(config, dtype, device: str, runs: int, sizes: dict, gen) -> list[dict]:
    H, D = config.n_head, config.head_dim
    num_blocks = sizes["write_pool_blocks"]
    cache = kv_pool(config, num_blocks, dtype, device, gen)
    twin = kv_pool(config, num_blocks, dtype, device, gen)
    points = []
    for N in sizes["write_tokens"]:
        k = torch.randn(N, H, D, generator=gen, device=device, dtype=dtype)
        v = torch.randn(N, H, D, generator=gen, device=device, dtype=dtype)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen, device=device)[:N]  # int64, as step 4

        def indexing(k=k, v=v, slots=slots):  # step4_paged_continuous/kv_cache.py
            cache.write(0, k, v, slots)

        def triton_write_kv(k=k, v=v, slots=slots):
            write_kv(twin.k[0], twin.v[0], k, v, slots)

        twin.k[0].copy_(cache.k[0])
        twin.v[0].copy_(cache.v[0])
        indexing()
        triton_write_kv()
        equal = torch.equal(cache.k[0], twin.k[0]) and torch.equal(cache.v[0], twin.v[0])
        point = measure(
            {"indexing": indexing, "triton_write_kv": triton_write_kv}, device, runs, sizes["cpu_repeats"]
        )
        nbytes = 2 * 2 * N * H * D * dtype.itemsize  # K and V, each read once and written once
        for m in point["median"].values():
            m["bytes_per_s"] = nbytes / (m["ms"] * 1e-3)
        point["ratios"] = {
            "indexing/triton": harness.ratio(
                point["runs"]["indexing"], point["runs"]["triton_write_kv"], "ms"
            )
        }
        points.append({"tokens": N, "bytes_moved": nbytes, "pools_equal": equal, **point})
        print(
            f"  write_kv N = {N:5d}: "
            + "  ".join(f"{n} {1e3 * m['ms']:.1f} us" for n, m in point["median"].items())
            + f"  pools equal: {equal}",
            flush=True,
        )
    return points


# ---- d. the KV memory model --------------------------------------------------------------------------------


def weight_bytes(folder: Path, itemsize: int) -> tuple[int, int]:
    """(parameters, bytes) of the model: transformers' GPT2LMHeadModel on the meta device (no memory), the
    tied LM head counted once."""
    import transformers

    with torch.device("meta"):
        hf_config = transformers.GPT2Config.from_pretrained(folder)
        parameters = sum(p.numel() for p in transformers.GPT2LMHeadModel(hf_config).parameters())
    return parameters, parameters * itemsize


def memory_model(folder: Path, config, sizes: dict, device: str, run_engine: bool) -> dict:
    """The prediction for every budget and sequence length, and, with ``run_engine``, the check on step 5's
    engine (the memory read on CUDA only)."""
    dtype = getattr(torch, sizes["dtype"])
    block_bytes = 2 * config.n_layer * BLOCK_SIZE * config.n_head * config.head_dim * dtype.itemsize
    assert block_bytes == PagedKVCache.block_bytes(config, BLOCK_SIZE, dtype)  # the formula is step 4's
    parameters, weights = weight_bytes(folder, dtype.itemsize)
    out = {
        "dtype": sizes["dtype"],
        "block_size": BLOCK_SIZE,
        "bytes_per_block": block_bytes,
        "bytes_per_token": block_bytes // BLOCK_SIZE,
        "parameters": parameters,
        "weight_bytes": weights,
        "generated_tokens": sizes["kv_generated"],
        "measured": run_engine,
        "memory_read": run_engine and torch.device(device).type == "cuda",
        "points": [],
    }
    if torch.device(device).type == "cuda":
        free_bytes, total = torch.cuda.mem_get_info(device)
        out["device"] = {
            "total_bytes": total,
            "free_bytes": free_bytes,
            "kv_blocks_in_free_memory": (free_bytes - weights) // block_bytes,
            "sequences_of_each_length": {
                str(L): (free_bytes - weights) // block_bytes // math.ceil(L / BLOCK_SIZE)
                for L in sizes["kv_lengths"]
            },
        }
    for budget in sizes["kv_budgets"]:
        for length in sizes["kv_lengths"]:
            if length > config.n_positions:
                continue
            blocks = budget // block_bytes
            per_seq = math.ceil(length / BLOCK_SIZE)
            point = {
                "budget_bytes": budget,
                "sequence_tokens": length,
                "blocks": blocks,
                "blocks_per_sequence": per_seq,
                "sequences": blocks // per_seq,
                "kv_pool_bytes": blocks * block_bytes,
                "predicted_bytes": weights + blocks * block_bytes,
            }
            if run_engine and point["sequences"] >= 1:
                point["engine"] = check_fit(
                    folder, device, sizes["dtype"], budget, length, sizes["kv_generated"], point["sequences"]
                )
                point["engine_one_more"] = check_fit(
                    folder,
                    device,
                    sizes["dtype"],
                    budget,
                    length,
                    sizes["kv_generated"],
                    point["sequences"] + 1,
                    read_memory=False,
                )
                mem = point["engine"]
                if mem["peak_bytes"] is not None:
                    mem["peak_over_predicted"] = mem["peak_bytes"] / point["predicted_bytes"]
                    mem["built_over_predicted"] = mem["built_bytes"] / point["predicted_bytes"]
                print(
                    f"  memory: {budget / 2**30:.2f} GiB, {length} tokens: "
                    f"{point['sequences']} sequences predicted, "
                    f"{mem['max_running']} ran at once ({mem['num_preemptions']} preemptions); one more: "
                    f"{point['engine_one_more']['max_running']} at once, "
                    f"{point['engine_one_more']['num_preemptions']} preemptions"
                    + (
                        f"; peak {mem['peak_bytes'] / 2**20:.0f} MiB vs "
                        f"{point['predicted_bytes'] / 2**20:.0f} MiB predicted"
                        if mem["peak_bytes"] is not None
                        else ""
                    ),
                    flush=True,
                )
            out["points"].append(point)
    return out


def check_fit(
    folder: Path,
    device: str,
    dtype: str,
    budget: int,
    length: int,
    generated: int,
    n: int,
    read_memory: bool = True,
) -> dict:
    """Build a step 5 ``LLMEngine`` with ``kv_cache_memory=budget`` and ``max_num_seqs=n``, run n sequences of
    ``length`` tokens (``length - generated`` prompt tokens, random ids, ``generated`` new ones, ignore_eos),
    and report the most running at once, the preemptions and, on CUDA, the memory: allocated after the build
    and at the peak, both beyond what was allocated before."""
    import step5_flash_gpu

    cuda = torch.device(device).type == "cuda" and read_memory
    harness.free(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    engine = step5_flash_gpu.LLMEngine(
        model=str(folder),
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        kv_cache_memory=budget,
        max_num_seqs=n,
    )
    built = torch.cuda.memory_allocated(device) - before if cuda else None
    gen = torch.Generator().manual_seed(SEED)
    params = step5_flash_gpu.SamplingParams(
        max_tokens=generated,
        temperature=0.0,
        ignore_eos=True,
        output_kind=step5_flash_gpu.RequestOutputKind.FINAL_ONLY,
    )
    vocab = engine.config.vocab_size
    for i in range(n):
        prompt = torch.randint(0, vocab - 1, (length - generated,), generator=gen).tolist()
        engine.add_request(f"fit-{i}", prompt, params)
    max_running, steps, tokens = 0, 0, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += len(o.outputs[0].token_ids)
        steps += 1
        max_running = max(max_running, engine.stats.num_running_reqs)
    harness.synchronize(device)
    stats = engine.stats
    out = {
        "sequences": n,
        "max_running": max_running,
        "num_preemptions": stats.num_preemptions,
        "steps": steps,
        "generated_tokens": tokens,
        "num_blocks": stats.num_blocks,
        "kv_pool_bytes": engine.kv_cache.nbytes,
        "built_bytes": built,
        "peak_bytes": torch.cuda.max_memory_allocated(device) - before if cuda else None,
    }
    del engine
    harness.free(device)
    return out


# ---- targets, report, plot ---------------------------------------------------------------------------------


def memory_exponent(points: list[dict], impl: str) -> float | None:
    """The largest, over the batch sizes, exponent e of peak memory ~ T^e from the smallest to the largest T
    (None without peak memory: a CPU)."""
    exps = []
    for B in sorted({p["num_seqs"] for p in points}):
        pts = [p for p in points if p["num_seqs"] == B and (p["median"].get(impl) or {}).get("peak_bytes")]
        if len(pts) >= 2 and pts[-1]["T"] > pts[0]["T"]:
            a, b = pts[0], pts[-1]
            exps.append(
                math.log(b["median"][impl]["peak_bytes"] / a["median"][impl]["peak_bytes"])
                / math.log(b["T"] / a["T"])
            )
    return max(exps) if exps else None


def targets(model: dict) -> list[dict]:
    """Step 5's kernel targets: ``harness.target_line``'s arguments. Where the sizes they are defined at
    did not run (--quick), the figure over the sizes that ran, not full size."""
    pre, dec = model["prefill"], model["decode"]
    lens = sorted({p["T"] for p in pre})
    full_prefill = set(FULL["prefill_lens"]) <= set(lens)
    faster_from = TARGETS["prefill_faster_from"] if full_prefill else lens[0]
    sdpa_from = TARGETS["prefill_sdpa_from"] if full_prefill else lens[-1]
    # materialised out of memory while the kernel ran: the kernel is the faster one there
    faster = [
        p["ratios"]["materialised/triton"]["median"] if "materialised/triton" in p["ratios"] else math.inf
        for p in pre
        if p["T"] >= faster_from and "triton_paged" in p["runs"]
    ]
    within = [
        p["ratios"]["triton/sdpa"]["median"]
        for p in pre
        if p["T"] >= sdpa_from and "triton/sdpa" in p["ratios"]
    ]
    S, ctx = TARGETS["decode_point"]
    at = [p for p in dec if (p["num_seqs"], p["context"]) == (S, ctx)]
    full_decode = bool(at)
    point = at[0] if at else max(dec, key=lambda p: p["kv_bytes"])
    where = f"{point['num_seqs']} x {point['context']}"
    share = point["median"].get("triton_auto", {}).get("share_of_copy_bandwidth")
    return [
        {
            "label": f"prefill: materialised / Triton time, the least at T >= {faster_from}",
            "value": min(faster) if faster else None,
            "target": ">= 1",
            "full_size": full_prefill,
        },
        {
            "label": f"prefill: Triton / SDPA time, the most at T >= {sdpa_from}",
            "value": max(within) if within else None,
            "target": "<= 1.5",
            "full_size": full_prefill,
        },
        {
            "label": "prefill: Triton peak memory ~ T^e, e (1: O(T), 2: O(T^2))",
            "value": memory_exponent(pre, "triton_paged"),
            "target": "<= 1.1",
            "unit": "",
            "full_size": full_prefill,
        },
        {
            "label": f"decode: step 4 gather + SDPA / Triton (auto) time at {where}",
            "value": point["ratios"].get("step4/triton_auto", {}).get("median"),
            "target": ">= 2",
            "full_size": full_decode,
        },
        {
            "label": f"decode: Triton (auto) K+V bytes / time over the copy bandwidth at {where}",
            "value": share,
            "target": ">= 0.5",
            "unit": "",
            "full_size": full_decode,
        },
    ]


def _mib(n) -> str | None:
    return None if n is None else f"{n / 2**20:.1f}"


def report(result: dict) -> str:
    """Tables of the four sections per model, then the targets."""
    m, w = result["machine"], result["workload"]
    interpreter = ", Triton interpreter" if m["triton_interpreter"] else ""
    lines = [
        f"attention on {m['device']} ({m.get('gpu') or m['cpu']}{interpreter}), "
        f"{w['dtype']}, torch {m['torch']}, triton {m['triton']}, copy bandwidth "
        f"{m['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, {w['runs']} round(s), medians"
    ]
    for name, model in result["models"].items():
        c = model["config"]
        lines.append(f"\n## {name}: {c['n_head']} heads x {c['head_dim']}, {c['n_layer']} layers")
        lines.append("\na. causal prefill: ms (peak MiB added)")
        impls = ("materialised", "sdpa", "triton_paged")
        rows = []
        for p in model["prefill"]:
            cells = []
            for i in impls:
                med = p["median"].get(i)
                peak = "" if med is None or med["peak_bytes"] is None else f" ({_mib(med['peak_bytes'])})"
                cells.append(p["errors"].get(i, "-") if med is None else f"{med['ms']:.3g}{peak}")
            r = p["ratios"]
            rows.append(
                [
                    p["T"],
                    p["num_seqs"],
                    *cells,
                    r["materialised/triton"]["median"] if "materialised/triton" in r else None,
                    r["triton/sdpa"]["median"] if "triton/sdpa" in r else None,
                    f"{p['max_abs_diff'].get('triton_paged', math.nan):.1e}",
                ]
            )
        lines.append(harness.table(["T", "seqs", *impls, "mat/triton", "triton/sdpa", "|triton-ref|"], rows))
        lines.append("\nb. paged decode: us (K+V bytes / time, share of the copy bandwidth)")
        names = ("step4_gather_sdpa", *DECODE_SPLITS)
        rows = []
        for p in model["decode"]:
            cells = [
                f"{1e3 * p['median'][n]['ms']:.4g} ({100 * p['median'][n]['share_of_copy_bandwidth']:.0f}%)"
                if n in p["median"]
                else p["errors"].get(n)
                for n in names
            ]
            rows.append(
                [
                    p["num_seqs"],
                    p["context"],
                    p["auto_num_splits"],
                    *cells,
                    p["ratios"].get("step4/triton_auto", {}).get("median"),
                    f"{max(p['max_abs_diff'].values()):.1e}",
                ]
            )
        lines.append(
            harness.table(
                [
                    "seqs",
                    "context",
                    "auto splits",
                    "step4",
                    *(n.removeprefix("triton_") for n in DECODE_SPLITS),
                    "step4/auto",
                    "max |diff|",
                ],
                rows,
            )
        )
        lines.append("\nc. write_kv: us")
        lines.append(
            harness.table(
                ["tokens", "indexing", "triton", "indexing/triton", "pools equal"],
                [
                    [
                        p["tokens"],
                        1e3 * p["median"]["indexing"]["ms"],
                        1e3 * p["median"]["triton_write_kv"]["ms"],
                        p["ratios"]["indexing/triton"]["median"],
                        p["pools_equal"],
                    ]
                    for p in model["write_kv"]
                ],
            )
        )
        mem = model["memory"]
        lines.append(
            f"\nd. KV memory model, {mem['dtype']}: {mem['bytes_per_block']} bytes per block of "
            f"{mem['block_size']} tokens ({mem['bytes_per_token']} per token), weights "
            f"{mem['weight_bytes'] / 2**20:.1f} MiB"
        )
        rows = []
        for p in mem["points"]:
            e, more = p.get("engine"), p.get("engine_one_more")
            rows.append(
                [
                    f"{p['budget_bytes'] / 2**30:.3g}",
                    p["sequence_tokens"],
                    p["blocks"],
                    p["sequences"],
                    _mib(p["predicted_bytes"]),
                    e and e["max_running"],
                    e and e["num_preemptions"],
                    more and f"{more['max_running']}, {more['num_preemptions']}",
                    _mib(e and e["built_bytes"]),
                    _mib(e and e["peak_bytes"]),
                ]
            )
        lines.append(
            harness.table(
                [
                    "budget GiB",
                    "tokens",
                    "blocks",
                    "seqs",
                    "predicted MiB",
                    "ran at once",
                    "preempted",
                    "one more: at once, preempted",
                    "built MiB",
                    "peak MiB",
                ],
                rows,
            )
        )
        if "device" in mem:
            d = mem["device"]
            lines.append(
                f"the whole device: {d['kv_blocks_in_free_memory']} blocks in its free memory, sequences "
                + ", ".join(f"{n} of {L} tokens" for L, n in d["sequences_of_each_length"].items())
            )
        lines.append("\ntargets")
        lines.extend(harness.target_line(**t) for t in targets(model))
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Per model, two rows: prefill time and peak memory against T, the memory model's sequences per budget;
    decode step4/Triton speed-up and bandwidth share against the context, write_kv time against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = result["models"]
    fig, axes = plt.subplots(2 * len(models), 3, figsize=(19, 10 * len(models)), squeeze=False)
    colors = {
        "materialised": "C3",
        "sdpa": "C7",
        "triton_paged": "C2",
        "indexing": "C1",
        "triton_write_kv": "C2",
    }
    for i, (name, model) in enumerate(models.items()):
        top, bottom = axes[2 * i], axes[2 * i + 1]
        pre = model["prefill"]
        batches = sorted({p["num_seqs"] for p in pre})
        lens = sorted({p["T"] for p in pre})
        for ax, key, ylabel in ((top[0], "ms", "ms"), (top[1], "peak_bytes", "peak memory added (MiB)")):
            values = []
            for impl in ("materialised", "sdpa", "triton_paged"):
                for B, style in zip(batches, ("-", "--")):
                    pts = [
                        p
                        for p in pre
                        if p["num_seqs"] == B and (p["median"].get(impl) or {}).get(key) is not None
                    ]
                    ys = [(1 if key == "ms" else 2**-20) * p["median"][impl][key] for p in pts]
                    values += ys
                    if pts:
                        ax.plot(
                            [p["T"] for p in pts],
                            ys,
                            marker="o",
                            linestyle=style,
                            color=colors[impl],
                            label=f"{impl}, {B} seq{'s' if B > 1 else ''}",
                        )
            ax.set(
                xscale="log",
                xlabel="T (tokens per sequence)",
                ylabel=ylabel,
                title=f"{name}: causal prefill, {'time' if key == 'ms' else 'peak memory added'}",
            )
            if values:
                ax.set_xticks(lens, [str(t) for t in lens])
                ax.xaxis.set_minor_locator(ticker.NullLocator())
                ax.set_yscale("log")
                harness.log_axis(ax.yaxis, values)
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no peak memory on a CPU", ha="center", transform=ax.transAxes)
            ax.grid(which="major", alpha=0.3)

        mem = model["memory"]
        ax = top[2]
        budgets = sorted({p["budget_bytes"] for p in mem["points"]})
        lengths = sorted({p["sequence_tokens"] for p in mem["points"]})
        width = 0.8 / max(1, len(lengths))
        for j, length in enumerate(lengths):
            pts = {p["budget_bytes"]: p for p in mem["points"] if p["sequence_tokens"] == length}
            xs = [k + (j - (len(lengths) - 1) / 2) * width for k, b in enumerate(budgets) if b in pts]
            ys = [pts[b]["sequences"] for b in budgets if b in pts]
            bars = ax.bar(xs, ys, width, color=f"C{j}", label=f"{length}-token sequences, predicted")
            ax.bar_label(bars, fontsize=7)
            ran = [
                (x, pts[b]["engine"]["max_running"])
                for x, b in zip(xs, [b for b in budgets if b in pts])
                if "engine" in pts[b]
            ]
            if ran:
                ax.plot(
                    *zip(*ran), "kx", markersize=9, label="ran at once on step 5's engine" if j == 0 else None
                )
        ax.set_xticks(range(len(budgets)), [f"{b / 2**30:g} GiB" for b in budgets])
        ax.set(
            xlabel="KV-cache budget",
            ylabel="sequences at once",
            title=f"{name}: KV memory model, {mem['dtype']}, {mem['bytes_per_token']} B/token",
        )
        ax.legend(fontsize=7)

        dec = model["decode"]
        contexts = sorted({p["context"] for p in dec})
        for ax, title in (
            (bottom[0], "step 4 / Triton (auto) time"),
            (bottom[1], "K+V bytes / time / copy bandwidth"),
        ):
            for k, S in enumerate(sorted({p["num_seqs"] for p in dec})):
                pts = [p for p in dec if p["num_seqs"] == S]
                xs = [p["context"] for p in pts]
                if ax is bottom[0]:
                    ax.plot(
                        xs,
                        [p["ratios"]["step4/triton_auto"]["median"] for p in pts],
                        marker="o",
                        color=f"C{k}",
                        label=f"{S} seq{'s' if S > 1 else ''}",
                    )
                else:
                    for impl, style in (("triton_auto", "-"), ("step4_gather_sdpa", "--")):
                        ax.plot(
                            xs,
                            [100 * p["median"][impl]["share_of_copy_bandwidth"] for p in pts],
                            marker="o",
                            linestyle=style,
                            color=f"C{k}",
                            label=f"{S} seq{'s' if S > 1 else ''}, {impl}",
                        )
            target = 2 if ax is bottom[0] else 50
            ax.axhline(
                target,
                color="k",
                linestyle=":",
                linewidth=1,
                label=f"target at 256 x 1024: {target}{'x' if ax is bottom[0] else '%'}",
            )
            ax.set(
                xscale="log",
                xlabel="context (tokens)",
                ylabel="x" if ax is bottom[0] else "%",
                ylim=(0, None),
                title=f"{name}: paged decode, {title}",
            )
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.legend(fontsize=7)
            ax.grid(which="major", alpha=0.3)

        ax = bottom[2]
        wk = model["write_kv"]
        values = []
        for impl in ("indexing", "triton_write_kv"):
            ys = [1e3 * p["median"][impl]["ms"] for p in wk]
            values += ys
            ax.plot([p["tokens"] for p in wk], ys, marker="o", color=colors[impl], label=impl)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="new tokens written",
            ylabel="us",
            title=f"{name}: KV cache write, one layer",
        )
        harness.log_axis(ax.xaxis)
        harness.log_axis(ax.yaxis, values)
        ax.legend(fontsize=7)
        ax.grid(which="major", alpha=0.3)
    m = result["machine"]
    fig.suptitle(
        f"step 5's kernels vs PyTorch, {m['device']} ({m.get('gpu') or m['cpu']}"
        f"{', Triton interpreter' if m['triton_interpreter'] else ''}), {result['workload']['dtype']}, "
        f"median of {result['workload']['runs']} round(s)"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path, dpi=90)

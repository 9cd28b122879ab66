"""Triton kernel: causal attention read in place from the paged KV cache, for prefills and decodes at once.

One kernel streams each sequence's keys and values out of the pool through its block table (Kwon et al. 2023,
PagedAttention, SOSP) with an online softmax, tile by tile (Dao et al. 2022, FlashAttention; Dao 2023,
FlashAttention-2): no gathered copy as in step 4, no score matrix in memory; keys and values in the model's
dtype, or 8-bit (int8, fp8 e4m3) with a scale per token and head, dequantized in the kernel (step 12).
``paged_attention`` launches it, ``warm_up`` compiles its variants, ``paged_attention_reference`` is PyTorch.
Shapes: N new tokens, S sequences, H heads, D head size, L a sequence's length (cached + new), M blocks per
sequence. Without CUDA, Triton's interpreter runs the kernel on CPU tensors (slow, for tests): this module
sets TRITON_INTERPRET=1 before importing triton; a process that imported triton earlier must set it.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read by the first `import triton`: keep it above that
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the kernels work in base 2, exp2 is one instruction


def triton_usable(device: torch.device | str) -> bool:
    """Whether the kernels can run on this device's tensors in this process: a CUDA device, or any device
    through the interpreter when TRITON_INTERPRET=1 was set before triton was first imported."""
    return torch.device(device).type == "cuda" or isinstance(tl.zeros, InterpretedFunction)


# The 8-bit element types of a quantized pool (step 12); e4m3 needs compute capability 8.9 on a GPU.
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)

# The interpreter multiplies bfloat16 bit patterns in tl.dot: garbage, no error (triton-lang/triton#11584).
CPU_BF16_UNSUPPORTED = (
    "Triton's interpreter (the kernels on a CPU) computes bfloat16 dot products wrongly "
    "(triton-lang/triton#11584); on a CPU use float32 or float16, or the torch backend"
)


def _check_usable(device: torch.device) -> None:
    if not triton_usable(device):
        raise RuntimeError(
            f"the Triton kernels run on CUDA tensors, or on {device} tensors through Triton's "
            "interpreter, which needs TRITON_INTERPRET=1 set before triton is first imported"
        )


# ---- the kernel --------------------------------------------------------------------------------------------

# Triton compiles a kernel again for each new "kind" of argument: an int equal to 1, a multiple of 16 or
# neither, a pointer 16-byte aligned or not. The sequence count, the block table's row stride and the
# alignment of the engine's int tensors (slices of one packed copy) change from step to step: each new kind
# would stall a serving step for a compilation (about a second). None is specialised (unknown names ignored).
NOT_SPECIALISED = dict(
    do_not_specialize=["num_seqs", "stride_bts"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)


@triton.jit
def _to_float32(x):
    """An 8-bit tile in fp32, exactly. int8 by its bits: 0x4B000080 + x read as a float32 is 2^23 + 128 + x
    (x in the low mantissa bits), so an integer add and a float subtract replace the int-to-float
    conversion, which has a fraction of their throughput and bound int8 decodes (benchmarks/NOTES.md)."""
    if x.dtype == tl.int8:
        return (x.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    return x.to(tl.float32)


@triton.jit
def _online_softmax(scores, m_i, l_i):
    """One tile's step of the online softmax (FlashAttention-2), base 2: the tile's scores (fp32, -inf where
    masked) [BLOCK_M, BLOCK_N], or one query row's [BLOCK_N]; the running max m_i and sum l_i of each row
    [BLOCK_M] ([1] for one row). Returns p = exp2(scores - new max), alpha = exp2(old max - new max) (the
    caller rescales what it summed under the old max by it), the new max, the new sum."""
    keys: tl.constexpr = len(scores.shape) - 1  # the key axis
    m_new = tl.maximum(m_i, tl.max(scores, keys))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old max
    if keys == 1:  # rows of a tile: each row's max against its own scores
        m_safe = m_safe[:, None]
    p = tl.exp2(scores - m_safe)  # [BLOCK_M, BLOCK_N] or [BLOCK_N]
    return p, alpha, m_new, l_i * alpha + tl.sum(p, keys)


@triton.jit(**NOT_SPECIALISED)
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_seqs,
    qk_scale,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_on,
    stride_oh,
    stride_od,
    stride_bts,
    stride_btm,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """One query tile (BLOCK_M rows of one sequence) and one head: causal attention over the sequence's keys.

    Grid: (N // BLOCK_M + S, H), a program per (query tile, head). Sequence s owns the tiles numbered from
    query_start_loc[s] // BLOCK_M + s on (the + s leaves room for each sequence's last, partial tile); a
    program binary-searches query_start_loc for its sequence and exits if its tile lies past that
    sequence's queries. Tiles run last first: under the causal mask a prompt's last tiles have the most
    keys, so they start early instead of finishing the launch alone.
    Each program loads its Q tile [BLOCK_M, D_PAD] once, then streams keys 0 .. its last row's position in K
    and V tiles [BLOCK_N, D_PAD], key n read from block block_tables[s, n // BLOCK_SIZE], slot n % BLOCK_SIZE
    (block ids in int64: block x stride cannot overflow). Keys past that position are not loaded (they
    read as 0), so slots the sequence has not written never enter the sums.
    Query row i sits at position context_len + i (context_len = L - query_len) and sees keys n <= position.
    The softmax is online (FlashAttention-2): the running max and sum of the scores (fp32, base 2: qk_scale
    includes log2 e) rescale the fp32 accumulator by exp2(m_old - m_new) tile after tile, and the sum
    divides it once at the end, so the [BLOCK_M, L] scores never reach memory and each key and value is
    read once per query tile. Q @ K^T and P @ V run on tensor cores in q's dtype (fp32: three tf32
    products, tf32x3, as accurate as fp32; IEEE in the interpreter). D is padded to a power of two, the
    padding masked to 0. A decode is a tile with one valid row (BLOCK_M >= 16 keeps tl.dot legal).
    KV_QUANT (step 12): K and V tiles are 8-bit; each key's K and V scales ([num_blocks, block_size, H],
    read through pointers: CUDA graphs replay them) load as two [BLOCK_N] vectors. The 8-bit values
    convert exactly to q's dtype for the dots; the K scale multiplies the score vector (q . k_q x
    k_scale[n]) and the V scale the probabilities before P @ V (p[n] x v_scale[n]), after their sum
    (vLLM's triton_unified_attention.py): a vector per tile, no dequantized tile. Off: today's kernel.
    BLOCK_M = 1 (the launcher's choice for 8-bit decodes): the two products are sums on CUDA cores in fp32.
    A tensor-core dot takes its operands from shared memory in q's dtype, so a converted 8-bit tile makes
    a round trip there, and a decode fills one of its 16 rows: measured no faster than fp16 with half the
    bytes. Read straight into registers, the 8-bit tile's halved bytes are the saving (benchmarks/NOTES.md).
    """
    # last tiles first: a long prompt's heaviest tiles start early
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)

    # Which sequence owns this tile: the last s with first_tile(s) <= tile (first_tile increases with s).
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_M + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    s = lo
    # int32 index arithmetic from here: int64 metadata would make every key's block lookup 64-bit
    q_start = tl.load(query_start_loc_ptr + s).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + s + 1).to(tl.int32) - q_start
    row0 = (tile - (q_start // BLOCK_M + s)) * BLOCK_M  # first query row of this tile, within the sequence
    if row0 >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + s).to(tl.int32) - q_len

    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < q_len
    positions = context_len + rows  # [BLOCK_M], each row's position in its sequence
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qn + h * stride_qh + d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, D_PAD]

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # running max of the scores (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)  # running sum of exp2(score - m_i) * v
    q_row = tl.sum(q.to(tl.float32), 0)  # [D_PAD] BLOCK_M = 1: the one row, and its sum below
    acc_row = tl.zeros([D_PAD], dtype=tl.float32)
    kv_end = context_len + tl.minimum(row0 + BLOCK_M, q_len)  # keys this tile needs: 0 .. kv_end - 1
    block_table = block_tables_ptr + s.to(tl.int64) * stride_bts
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = n < kv_end
        block = tl.load(block_table + (n // BLOCK_SIZE) * stride_btm, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr
            + block[:, None] * stride_kb
            + slot[:, None] * stride_ks
            + h * stride_kh
            + d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        v = tl.load(
            v_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + h * stride_vh
            + d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, D_PAD]
        if KV_QUANT:  # 8-bit tiles (exact in q's dtype and in fp32): the scales of these keys, in fp32
            scale_at = block * stride_sb + slot * stride_ss + h * stride_sh  # [BLOCK_N]
            k_scale = tl.load(k_scale_ptr + scale_at, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
            v_scale = tl.load(v_scale_ptr + scale_at, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]

        if BLOCK_M == 1:  # one query row (8-bit decodes): vectors and sums on CUDA cores, in fp32
            s_n = tl.sum(q_row[None, :] * _to_float32(k), 1) * qk_scale  # [BLOCK_N]
            if KV_QUANT:
                s_n = s_n * k_scale
            s_n = tl.where(n <= positions, s_n, float("-inf"))  # causal (and n < L)
            p_n, alpha, m_i, l_i = _online_softmax(s_n, m_i, l_i)  # [BLOCK_N], [1], [1], [1]
            if KV_QUANT:
                p_n = p_n * v_scale
            acc_row = acc_row * alpha + tl.sum(p_n[:, None] * _to_float32(v), 0)  # [D_PAD]
        else:
            if KV_QUANT:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            if KV_QUANT:
                scores = scores * k_scale[None, :]  # q . (k_q x k_scale): the keys' scale on the scores
            scores = tl.where(n[None, :] <= positions[:, None], scores, float("-inf"))  # causal (and n < L)
            p, alpha, m_i, l_i = _online_softmax(scores, m_i, l_i)  # p: [BLOCK_M, BLOCK_N]
            acc = acc * alpha[:, None]
            if KV_QUANT:  # sum_n p[n] v_scale[n] v_q[n]: the values' scale on the probabilities, after l_i
                p = p * v_scale[None, :]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, D_PAD]

    if BLOCK_M == 1:
        acc = acc_row[None, :]

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_on + h * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# ---- the launcher ------------------------------------------------------------------------------------------

# A query run of each row of the tile table below: warm_up compiles each once.
TILE_TABLE_QUERY_LENS = (1, 64, 128)


def _attention_config(max_query_len: int, head_dim: int, quantized: bool = False) -> dict:
    """Tile sizes for the kernel, by the longest query run in the batch (a fixed table, no autotuning; a
    new row needs its query length in ``TILE_TABLE_QUERY_LENS``); 8-bit decodes one row per tile."""
    if quantized and max_query_len == 1:  # CUDA-core products (see the kernel)
        return dict(block_m=1, block_n=128, num_warps=2, num_stages=2)
    if max_query_len <= 16:  # decodes, short chunks: 16 rows, the smallest tl.dot M
        return dict(block_m=16, block_n=64, num_warps=4, num_stages=2)
    if max_query_len <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return dict(block_m=128, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=3)


def _check_index_tensor(name: str, t, dims: int, device: torch.device) -> None:
    """Raise ValueError, naming the argument, unless ``t`` is an integer tensor the kernels can index:
    int32/int64, ``dims`` dimensions, on ``device``, and if 1-D contiguous (a kernel reads its element i at
    offset i; a block table's strides are passed to the kernel, so any view of one is read right)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be an int32 or int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, as the other tensors, got {t.device}")
    if dims == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(
            f"{name} must be contiguous (stride 1), got stride {t.stride(0)}: pass .contiguous()"
        )


def _check_attention_inputs(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale=None, v_scale=None
) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be [N, H, D] float32/float16/bfloat16, got {list(q.shape)} {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != q.shape[1:]:
        raise ValueError(
            f"k_cache, v_cache must be [num_blocks, block_size, H, D] = [.., .., {q.shape[1]}, "
            f"{q.shape[2]}], got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale, v_scale: give both (8-bit k_cache and v_cache) or neither")
    if k_scale is None and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        raise ValueError(
            f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_scale is not None:
        if k_cache.dtype not in QUANTIZED_DTYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"with k_scale, v_scale: k_cache and v_cache must be int8 or float8_e4m3fn, one dtype, got "
                f"{k_cache.dtype}, {v_cache.dtype}"
            )
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t.shape != k_cache.shape[:3] or t.stride() != k_scale.stride() or t.device != q.device:
                raise ValueError(
                    f"{name} must be [num_blocks, block_size, H] = {list(k_cache.shape[:3])} on {q.device}, "
                    f"k_scale's strides, got {list(t.shape)} {t.stride()} on {t.device}"
                )
            if t.dtype not in (torch.float16, torch.float32):
                raise ValueError(f"{name} must be float16 or float32, got {t.dtype}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(
            f"k_cache and v_cache must be on q's device {q.device}, got {k_cache.device}, {v_cache.device}"
        )
    _check_index_tensor("block_tables", block_tables, 2, q.device)
    _check_index_tensor("seq_lens", seq_lens, 1, q.device)
    _check_index_tensor("query_start_loc", query_start_loc, 1, q.device)
    S = seq_lens.shape[0]
    if block_tables.shape[0] != S or query_start_loc.shape != (S + 1,):
        raise ValueError(
            f"expected block_tables [S, M], seq_lens [S], query_start_loc [S + 1] with S = {S}, "
            f"got {list(block_tables.shape)}, {list(seq_lens.shape)}, {list(query_start_loc.shape)}"
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch of new tokens over their sequences in the paged KV cache.

    q: [N, H, D] the new tokens' queries (float32, float16 or bfloat16), sequence s owning rows
    query_start_loc[s]:query_start_loc[s + 1] (query_start_loc [S + 1] int32/int64, on q's device).
    k_cache, v_cache: [num_blocks, block_size, H, D] one layer's pool, in q's dtype, the new tokens' keys and
    values already written. block_tables: [S, M] int32/int64 block ids (short rows padded with any valid id).
    seq_lens: [S] each sequence's length in tokens, new tokens included. max_query_len: the longest query
    run (tokens), a host int (it picks the tile size). Query i of sequence s is at position
    seq_lens[s] - query_len + i and attends to keys 0 .. that position. scale: default D ** -0.5.
    k_scale, v_scale: [num_blocks, block_size, H] float16/float32, with 8-bit (int8 or float8_e4m3fn)
    k_cache, v_cache: key n of head h is k_cache[b, i, h] x k_scale[b, i, h] (``kv_quant.quantize``).
    block_m, block_n, num_warps, num_stages override the tile table (block_m >= 16, or 1 with an 8-bit
    pool, and block_n >= 16, powers of two, on a GPU).
    Returns out [N, H, D] in q's dtype. Raises ValueError, naming the argument, on inconsistent shapes,
    dtypes or devices and on a non-contiguous seq_lens or query_start_loc (block_tables may be any view),
    or on bfloat16 on a CPU (``CPU_BF16_UNSUPPORTED``); RuntimeError on CPU tensors without the
    interpreter.
    Sources: Dao et al. 2022 / Dao 2023 (FlashAttention, -2), Kwon et al. 2023 (PagedAttention).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale)
    _check_usable(q.device)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(CPU_BF16_UNSUPPORTED)
    N, H, D = q.shape
    S = seq_lens.shape[0]
    out = torch.empty((N, H, D), device=q.device, dtype=q.dtype)  # [N, H, D]
    if N == 0 or S == 0:
        return out
    qk_scale = (D**-0.5 if scale is None else scale) * LOG2E
    d_pad = max(16, triton.next_power_of_2(D))  # tl.arange needs a power of two, tl.dot K >= 16
    # fp32 must not round to tf32: on a GPU three tf32 products (tf32x3) keep fp32 accuracy on tensor cores,
    # where "ieee" (no tensor cores) was far slower in the engine (benchmarks/NOTES.md, the fp32 run); the
    # interpreter computes "ieee". Halves ignore it.
    precision = "tf32" if q.dtype != torch.float32 else "tf32x3" if q.device.type == "cuda" else "ieee"
    quantized = k_scale is not None
    cfg = _attention_config(max_query_len, D, quantized)
    block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
    grid = (N // block_m + S, H)  # one program per (query tile, head); see the kernel for the tile numbering
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        k_scale if quantized else k_cache,  # unread unless quantized
        v_scale if quantized else v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        S,
        qk_scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *(k_scale.stride() if quantized else (0, 0, 0)),
        *out.stride(),
        *block_tables.stride(),
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        KV_QUANT=quantized,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out


def warm_up(
    num_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Compile now every kernel variant an engine of this shape can launch: the kernel in each tile
    configuration of ``_attention_config`` (``TILE_TABLE_QUERY_LENS``), on a tiny batch of the engine's
    dtypes (int64 metadata, as the model runner's; an 8-bit ``cache_dtype`` with float16 scales).

    Triton compiles a variant on its first launch (later processes read Triton's on-disk cache): without
    this, the first request that needs one waits for the compiler (benchmarks/NOTES.md: recompilation).
    """
    device = torch.device(device)
    blocks = -(-max(TILE_TABLE_QUERY_LENS) // block_size)  # one sequence with room for the longest query
    k_cache = torch.zeros(blocks, block_size, num_heads, head_dim, device=device, dtype=cache_dtype or dtype)
    v_cache = torch.zeros_like(k_cache)
    quantized = cache_dtype is not None and cache_dtype != dtype
    k_scale = torch.zeros(k_cache.shape[:3], device=device, dtype=torch.float16) if quantized else None
    block_tables = torch.arange(blocks, device=device)[None, :]  # [1, blocks] int64
    for query_len in TILE_TABLE_QUERY_LENS:
        q = torch.zeros(query_len, num_heads, head_dim, device=device, dtype=dtype)
        seq_lens = torch.tensor([query_len], device=device)
        query_start_loc = torch.tensor([0, query_len], device=device)
        paged_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            query_len,
            k_scale=k_scale,
            v_scale=k_scale,
        )


# ---- the reference -----------------------------------------------------------------------------------------


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` in plain PyTorch, one sequence at a time, for tests (max_query_len unused).

    Per sequence: gather its blocks into [L, H, D] (8-bit ones times their scales, in fp32), scores in fp32,
    mask key j for query i unless j <= context_len + i, softmax, times V. Returns [N, H, D] in q's dtype.
    """
    N, H, D = q.shape
    block_size = k_cache.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, L in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        blocks = block_tables[s, : math.ceil(L / block_size)].long()
        k = k_cache[blocks].reshape(-1, H, D)[:L].float()  # [L, H, D]
        v = v_cache[blocks].reshape(-1, H, D)[:L].float()  # [L, H, D]
        if k_scale is not None:  # 8 bits: each token-head's values times its scale
            k = k * k_scale[blocks].reshape(-1, H)[:L, :, None].float()
            v = v * v_scale[blocks].reshape(-1, H)[:L, :, None].float()
        scores = torch.einsum("thd,lhd->htl", q[a:b].float(), k) * scale  # [H, T, L]
        positions = L - (b - a) + torch.arange(b - a, device=q.device)  # [T]
        visible = torch.arange(L, device=q.device)[None, :] <= positions[:, None]  # [T, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)  # [T, H, D]
    return out

"""Triton kernels: causal attention read in place from the paged KV cache, and the cache write.

Step 4 gathered every decoding sequence's blocks into a contiguous copy, then ran masked attention over it:
the copy is written and read once more than needed, and the S x L score matrix of a prefill is
materialised. Here one kernel streams each sequence's keys and values straight out of the pool through
its block table (Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP) and keeps the softmax online, tile by tile, in registers (Dao et al. 2022,
"FlashAttention", NeurIPS; Dao 2023, "FlashAttention-2"): scores never reach memory, and each key and
value is read from the pool once per query tile. A batch of decodes too small to fill the GPU splits each
sequence's keys across several programs and merges their partial softmaxes afterwards (flash-decoding,
Dao, Haziza, Massa, Sizov 2023).

Shapes: N new tokens in the batch, S sequences, H heads, D head size, L a sequence's length (cached + new),
num_blocks x block_size slots in the pool, M block-table entries per sequence.

Where the kernels run: on a CUDA GPU, compiled; without one, Triton's interpreter runs them on CPU tensors
(numpy, one program at a time: slow, for tests). Triton decides which when it is first imported (its own
library functions, tl.max, tl.zeros..., are decorated then), so on a machine without CUDA this module sets
TRITON_INTERPRET=1 before importing triton; a process that imported triton earlier must set it itself.
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


# Triton's interpreter (CPU) holds bfloat16 as 16-bit integers and multiplies their bit patterns in tl.dot:
# the results are garbage, with no error (triton-lang/triton#11584, "not supported yet").
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


# ----------------------------------------------------------------------------------------------------------
# The kernels


# Triton compiles a kernel again for each new "kind" of argument: an int equal to 1, a multiple of 16 or
# neither, a pointer 16-byte aligned or not. The batch's sequence count and the block table's row stride
# (its width) change from step to step, and the engine's small int tensors are slices of one packed copy,
# whose alignment changes with the batch: each new kind would stall a step for a compilation (about a
# second) while a server runs. None of these is specialised (a name a kernel lacks is ignored).
NOT_SPECIALISED = dict(
    do_not_specialize=["num_seqs", "stride_bts"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)


@triton.jit(**NOT_SPECIALISED)
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
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
):
    """Causal attention of BLOCK_M query rows of one sequence, one head, over keys read through the block table.

    Grid: (N // BLOCK_M + S, H). Sequence s owns the query tiles starting at query_start_loc[s] // BLOCK_M + s
    (this numbering leaves room for every sequence's last, partial tile); a program binary-searches
    query_start_loc for its sequence, and exits if its tile lies past the sequence's queries. Tiles run in
    reverse order: under the causal mask the last tiles of a prompt have the most keys, so they go first.
    Each program: loads its Q tile [BLOCK_M, D_PAD] once, then streams the keys 0 .. its last row's position
    in tiles of BLOCK_N, each key row found at block_tables[s, n // BLOCK_SIZE], slot n % BLOCK_SIZE (block
    ids in int64, so that block x stride cannot overflow); K and V tiles are [BLOCK_N, D_PAD].
    Query row i sits at position context_len + i (context_len = L - query_len) and sees keys n <= position.
    Online softmax (FlashAttention-2): scores and running max / sum in fp32, base 2 (qk_scale includes
    log2 e), fp32 accumulator rescaled by exp2(m_old - m_new), divided by the sum once at the end. Q @ K^T
    and P @ V run on tensor cores in q's dtype (fp32 inputs: three tf32 products, tf32x3, as accurate as fp32;
    IEEE in the interpreter). D is padded to a power of two, the padding masked to 0. A decode is a tile with
    one valid row (BLOCK_M >= 16 keeps tl.dot legal).
    """
    tile = (
        tl.num_programs(0) - 1 - tl.program_id(0)
    )  # last tiles first: a long prompt's heaviest tiles start early
    h = tl.program_id(1)

    # Which sequence owns this tile: the last s with first_tile(s) <= tile (first_tile increases with s).
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    s = lo
    q_start = tl.load(query_start_loc_ptr + s)
    q_len = tl.load(query_start_loc_ptr + s + 1) - q_start
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

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        scores = tl.where(n[None, :] <= positions[:, None], scores, float("-inf"))  # causal (and n < L)
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_safe)  # rescales what was summed under the old max
        p = tl.exp2(scores - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # [BLOCK_M, D_PAD]
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_on + h * stride_oh + d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit(**NOT_SPECIALISED)
def _paged_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
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
    stride_bts,
    stride_btm,
    stride_ps,
    stride_ph,
    stride_pj,
    stride_as,
    stride_ah,
    stride_aj,
    stride_ad,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Flash-decoding, part 1: one query of sequence s, head h, against the j-th of NUM_SPLITS slices of its keys.

    Grid: (S, H, NUM_SPLITS). Every query_len is 1, so sequence s's query is row query_start_loc[s] and
    sees all L keys. Split j takes keys [j * chunk, (j + 1) * chunk) with chunk = cdiv(L, NUM_SPLITS) rounded
    up to BLOCK_N, streamed in [BLOCK_N, D_PAD] tiles through the block table as in the main kernel. One
    query row is a vector, so the dot products are multiply-and-sum on fp32 registers, not tl.dot.
    Writes the unnormalised partial state, fp32: max [S, H, NUM_SPLITS], sum [S, H, NUM_SPLITS] and
    acc [S, H, NUM_SPLITS, D]; a split with no keys writes max -inf, sum 0, acc 0.
    """
    s = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    q_row = tl.load(query_start_loc_ptr + s).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + q_row * stride_qn + h * stride_qh + d * stride_qd, mask=d_ok, other=0.0).to(
        tl.float32
    )

    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    key_start = j * chunk
    key_end = tl.minimum(key_start + chunk, seq_len)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + s.to(tl.int64) * stride_bts
    for start in range(key_start, key_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < key_end
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
        scores = tl.sum(k.to(tl.float32) * q[None, :], 1) * qk_scale  # [BLOCK_N]
        scores = tl.where(n_ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))  # finite: key `start` is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new)  # [BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)  # [D_PAD]
        m_i = m_new

    part = s.to(tl.int64) * stride_ps + h * stride_ph + j * stride_pj
    tl.store(part_max_ptr + part, m_i)
    tl.store(part_sum_ptr + part, l_i)
    tl.store(
        part_acc_ptr + s.to(tl.int64) * stride_as + h * stride_ah + j * stride_aj + d * stride_ad,
        acc,
        mask=d_ok,
    )


@triton.jit(**NOT_SPECIALISED)
def _combine_splits_kernel(
    out_ptr,
    query_start_loc_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    stride_on,
    stride_oh,
    stride_od,
    stride_ps,
    stride_ph,
    stride_pj,
    stride_as,
    stride_ah,
    stride_aj,
    stride_ad,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Flash-decoding, part 2: merge the NUM_SPLITS partial softmaxes of sequence s, head h into its output row.

    Grid: (S, H). Loads max, sum [SPLITS_PAD] and acc [SPLITS_PAD, D_PAD] (fp32), rescales every split to
    the common max: out = sum_j acc_j 2^(m_j - m) / sum_j l_j 2^(m_j - m), stored in out's dtype at row
    query_start_loc[s]. Empty splits (max -inf) get weight 0.
    """
    s = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, SPLITS_PAD)
    j_ok = j < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    part = s.to(tl.int64) * stride_ps + h * stride_ph + j * stride_pj
    m_j = tl.load(part_max_ptr + part, mask=j_ok, other=float("-inf"))  # [SPLITS_PAD]
    l_j = tl.load(part_sum_ptr + part, mask=j_ok, other=0.0)
    acc_j = tl.load(
        part_acc_ptr
        + s.to(tl.int64) * stride_as
        + h * stride_ah
        + j[:, None] * stride_aj
        + d[None, :] * stride_ad,
        mask=j_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [SPLITS_PAD, D_PAD]
    m = tl.max(m_j, 0)
    w = tl.where(m_j == float("-inf"), 0.0, tl.exp2(m_j - m))  # [SPLITS_PAD]
    out = tl.sum(acc_j * w[:, None], 0) / tl.sum(l_j * w, 0)  # [D_PAD]
    q_row = tl.load(query_start_loc_ptr + s).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_on + h * stride_oh + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Store new token i's keys and values [H, D] at its cache slot: block slot // BLOCK_SIZE, offset slot % BLOCK_SIZE.

    Grid: (N,). Each program loads one [H_PAD, D_PAD] tile of k and of v (heads and head size padded to
    powers of two, masked) and stores it, in the cache's dtype, with int64 block offsets. A negative slot
    (a padding token) is skipped.
    """
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + i * stride_kn + h * stride_kh + d * stride_kd, mask=mask)  # [H_PAD, D_PAD]
    v = tl.load(v_ptr + i * stride_vn + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(
        k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


# ----------------------------------------------------------------------------------------------------------
# The Python entry points


# A query run of each row of the tile table below: warm_up compiles each once.
TILE_TABLE_QUERY_LENS = (1, 64, 128)
SPLIT_COUNTS = (8, 16)  # flash-decoding's split counts, a compiled kernel each: see choose_num_splits
SPLIT_MIN_KEYS = 256  # the fewest keys one split takes: contexts from 8 x 256 = 2,048 tokens split


def _attention_config(max_query_len: int, head_dim: int) -> dict:
    """Tile sizes for the main kernel, by the longest query run in the batch (a fixed table, no autotuning; a
    new row needs its query length in ``TILE_TABLE_QUERY_LENS``)."""
    if max_query_len <= 16:  # decodes, short chunks: 16 rows, the smallest tl.dot M
        return dict(block_m=16, block_n=64, num_warps=4, num_stages=2)
    if max_query_len <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
    return dict(block_m=128, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=3)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's count, so that the choice below is the same on CPU (tests)


def choose_num_splits(
    num_seqs: int, num_heads: int, max_query_len: int, max_kv_len: int, device: torch.device
) -> int:
    """How many programs share one decode's keys: 1 (the plain kernel) unless S x H programs leave SMs idle
    and the contexts are long enough for the fewest splits of ``SPLIT_COUNTS`` to take ``SPLIT_MIN_KEYS`` each.

    Only all-decode batches split, into the most of ``SPLIT_COUNTS`` that leaves each split at least
    ``SPLIT_MIN_KEYS`` keys: each count is a kernel of its own (a compile-time constant), so a growing context
    compiles 2 of them, not one per 256 tokens. Tuned on an H200 (benchmarks/results/attention-cuda.json): below
    ~2,048 tokens the split path's second launch costs more than it saves (1 x 512: 56 us with 2 splits, 18 us
    plain), and where it pays, more splits pay more (8 x 4,096: 55 us with 16 splits, 119 us with 2, 113 us
    plain). GPT-2's 1,024-token window never splits.
    """
    fitting = [n for n in SPLIT_COUNTS if n * SPLIT_MIN_KEYS <= max_kv_len]
    if max_query_len != 1 or num_seqs * num_heads >= _num_sms(device) or not fitting:
        return 1
    return max(fitting)


def _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) -> None:
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be [N, H, D] float32/float16/bfloat16, got {list(q.shape)} {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != q.shape[1:]:
        raise ValueError(
            f"k_cache, v_cache must be [num_blocks, block_size, H, D] = [.., .., {q.shape[1]}, "
            f"{q.shape[2]}], got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(
            f"k_cache and v_cache must have q's dtype {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}"
        )
    S = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != S or query_start_loc.shape != (S + 1,):
        raise ValueError(
            f"expected block_tables [S, M], seq_lens [S], query_start_loc [S + 1] with S = {S}, "
            f"got {list(block_tables.shape)}, {list(seq_lens.shape)}, {list(query_start_loc.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}) != 1:
        raise ValueError("all tensors must be on one device")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    num_splits: int | None = None,
    *,
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
    num_splits: None chooses (``choose_num_splits``); 1 forces the plain kernel; k > 1 forces flash-decoding
    with k splits (every query_len must then be 1). block_m, block_n, num_warps, num_stages override the
    tile table (block_m >= 16 and block_n >= 16, powers of two, on a GPU).
    Returns out [N, H, D] in q's dtype. Raises ValueError on inconsistent shapes, dtypes or devices, or
    bfloat16 on a CPU (``CPU_BF16_UNSUPPORTED``),
    RuntimeError on CPU tensors without the interpreter.
    Sources: Dao et al. 2022 / Dao 2023 (FlashAttention, -2), Kwon et al. 2023 (PagedAttention), flash-decoding.
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_usable(q.device)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(CPU_BF16_UNSUPPORTED)
    N, H, D = q.shape
    S = seq_lens.shape[0]
    block_size = k_cache.shape[1]
    out = torch.empty((N, H, D), device=q.device, dtype=q.dtype)  # [N, H, D]
    if N == 0 or S == 0:
        return out
    qk_scale = (D**-0.5 if scale is None else scale) * LOG2E
    d_pad = max(16, triton.next_power_of_2(D))
    # fp32 must not round to tf32: on a GPU three tf32 products (tf32x3) keep fp32 accuracy on tensor cores, where
    # "ieee" (no tensor cores) ran 40x slower in the engine; the interpreter computes "ieee". Halves ignore it.
    precision = "tf32" if q.dtype != torch.float32 else "tf32x3" if q.device.type == "cuda" else "ieee"
    if num_splits is None:
        num_splits = choose_num_splits(S, H, max_query_len, block_tables.shape[1] * block_size, q.device)
    if num_splits > 1:
        if max_query_len != 1:
            raise ValueError(
                f"num_splits={num_splits} needs a batch of decodes (max_query_len 1), got {max_query_len}"
            )
        return _paged_decode_split(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            qk_scale,
            num_splits,
            d_pad,
            block_n or 64,
            num_warps or 4,
            num_stages or 2,
        )

    cfg = _attention_config(max_query_len, D)
    block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
    grid = (N // block_m + S, H)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        S,
        qk_scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out


def _paged_decode_split(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    out,
    qk_scale,
    num_splits,
    d_pad,
    block_n,
    num_warps,
    num_stages,
):
    """Flash-decoding: partial softmaxes over num_splits key slices per (sequence, head), then their merge."""
    S, (_, H, D) = seq_lens.shape[0], q.shape
    part_max = torch.empty((S, H, num_splits), device=q.device, dtype=torch.float32)  # [S, H, splits]
    part_sum = torch.empty((S, H, num_splits), device=q.device, dtype=torch.float32)  # [S, H, splits]
    part_acc = torch.empty((S, H, num_splits, D), device=q.device, dtype=torch.float32)  # [S, H, splits, D]
    _paged_decode_split_kernel[(S, H, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        part_max,
        part_sum,
        part_acc,
        qk_scale,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *part_max.stride(),
        *part_acc.stride(),
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _combine_splits_kernel[(S, H)](
        out,
        query_start_loc,
        part_max,
        part_sum,
        part_acc,
        *out.stride(),
        *part_max.stride(),
        *part_acc.stride(),
        HEAD_DIM=D,
        D_PAD=d_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=1,
    )
    return out


def warm_up(
    num_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> None:
    """Compile now every kernel variant an engine of this shape can launch: the main kernel in each tile
    configuration of ``_attention_config`` (``TILE_TABLE_QUERY_LENS``) and flash-decoding with each of
    ``SPLIT_COUNTS``, on a tiny batch of the engine's dtypes (int64 metadata, as the model runner's).

    Triton compiles a variant on its first launch (about a second each on an H200; later processes read
    Triton's on-disk cache): without this, the first request that needs one waits for the compiler.
    """
    device = torch.device(device)
    blocks = -(
        -max(TILE_TABLE_QUERY_LENS) // block_size
    )  # one sequence with room for the longest warm-up query
    k_cache = torch.zeros(blocks, block_size, num_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.arange(blocks, device=device)[None, :]  # [1, blocks] int64
    for query_len, num_splits in [(n, 1) for n in TILE_TABLE_QUERY_LENS] + [(1, n) for n in SPLIT_COUNTS]:
        q = torch.zeros(query_len, num_heads, head_dim, device=device, dtype=dtype)
        seq_lens = torch.tensor([query_len], device=device)
        query_start_loc = torch.tensor([0, query_len], device=device)
        paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, query_len, num_splits=num_splits
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the keys and values of N new tokens into one layer's pool, in place.

    k_cache, v_cache: [num_blocks, block_size, H, D]; k, v: [N, H, D] (any strides; cast to the cache's
    dtype); slot_mapping: [N] int32/int64, slot = block * block_size + offset; a negative slot is skipped.
    The same as step 4's ``k_cache.view(-1, H, D)[slot_mapping] = k``, as one kernel for K and V.
    Raises ValueError on mismatched shapes or devices.
    """
    N, H, D = k.shape
    if (
        v.shape != k.shape
        or k_cache.shape[2:] != (H, D)
        or v_cache.shape != k_cache.shape
        or slot_mapping.shape != (N,)
    ):
        raise ValueError(
            f"expected k, v [N, H, D], caches [num_blocks, block_size, H, D], slot_mapping [N]; got "
            f"{list(k.shape)}, {list(v.shape)}, {list(k_cache.shape)}, {list(slot_mapping.shape)}"
        )
    if len({t.device for t in (k, v, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("all tensors must be on one device")
    _check_usable(k.device)
    if N == 0:
        return
    _write_kv_kernel[(N,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        NUM_HEADS=H,
        H_PAD=triton.next_power_of_2(H),
        HEAD_DIM=D,
        D_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``paged_attention`` in plain PyTorch, one sequence at a time, for tests (max_query_len, num_splits unused).

    Per sequence: gather its blocks into [L, H, D], scores in fp32, mask key j for query i unless
    j <= context_len + i, softmax, times V. Returns [N, H, D] in q's dtype.
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
        scores = torch.einsum("thd,lhd->htl", q[a:b].float(), k) * scale  # [H, T, L]
        positions = L - (b - a) + torch.arange(b - a, device=q.device)  # [T]
        visible = torch.arange(L, device=q.device)[None, :] <= positions[:, None]  # [T, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)  # [T, H, D]
    return out

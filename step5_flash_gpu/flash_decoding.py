"""Flash-decoding (split-K): an exercise beyond GPT-2's window; no engine imports this module.

kernels.py runs a program per (query tile, head): a batch of few decodes gives S x H programs, 12 for one
GPT-2 sequence on an H200's 132 SMs, each walking all of its sequence's keys alone. Flash-decoding (Dao,
Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference") splits each decode's keys across
NUM_SPLITS programs that each write a partial softmax (max, sum, weighted values), then merges them in a
second, small kernel. It pays only for long contexts, from about 2,048 tokens (step 5's README has the
measurements); GPT-2's window is 1,024 tokens, so its engine never splits.

Shapes as in kernels.py: N new tokens, S sequences, H heads, D head size, L a sequence's length.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as in kernels.py: read by the first `import triton`
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .kernels import (  # noqa: E402
    CPU_BF16_UNSUPPORTED,
    LOG2E,
    NOT_SPECIALISED,
    _check_attention_inputs,
    _check_usable,
    paged_attention,
)

# ----------------------------------------------------------------------------------------------------------
# Flash-decoding: the kernels


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
    """Flash-decoding, part 1: the query of sequence s, head h, against the j-th of NUM_SPLITS key slices.

    Grid: (S, H, NUM_SPLITS), a program per (sequence, head, split): NUM_SPLITS times kernels.py's programs
    for a batch of decodes, so that a few long sequences fill the GPU. Every query_len is 1: sequence s's
    query is row query_start_loc[s] and sees all L keys. Split j takes keys [j * chunk, (j + 1) * chunk),
    chunk = cdiv(L, NUM_SPLITS) rounded up to BLOCK_N. Each program loads its query [D_PAD] once and streams
    its keys in K and V tiles [BLOCK_N, D_PAD] through the block table as kernels.py does (keys past L are
    not loaded). One query row is a vector, so the dot products are multiply-and-sum on fp32 registers,
    not tl.dot. Writes the unnormalised partial softmax, fp32: max [S, H, NUM_SPLITS], sum
    [S, H, NUM_SPLITS] and acc [S, H, NUM_SPLITS, D]; a split with no keys writes max -inf, sum 0, acc 0.
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
    """Flash-decoding, part 2: merge the NUM_SPLITS partial softmaxes of sequence s, head h into its row.

    Grid: (S, H), a program per (sequence, head). Loads max, sum [SPLITS_PAD] and acc [SPLITS_PAD, D_PAD]
    (fp32), rescales every split to the common max: out = sum_j acc_j 2^(m_j - m) / sum_j l_j 2^(m_j - m),
    stored in out's dtype at row query_start_loc[s]. Empty splits (max -inf) get weight 0.
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


# ----------------------------------------------------------------------------------------------------------
# Flash-decoding: when to split, and the launcher


SPLIT_COUNTS = (8, 16)  # the split counts, a compiled kernel each: see choose_num_splits
SPLIT_MIN_KEYS = 256  # the fewest keys one split takes: contexts from 8 x 256 = 2,048 tokens split


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's count, so that the choice below is the same on CPU (tests)


def choose_num_splits(
    num_seqs: int, num_heads: int, max_query_len: int, max_kv_len: int, device: torch.device
) -> int:
    """How many programs share one decode's keys: 1 (kernels.py's kernel) unless S x H programs leave SMs
    idle and the contexts are long enough for the fewest of ``SPLIT_COUNTS`` to take ``SPLIT_MIN_KEYS``
    keys each.

    Only all-decode batches split, into the most of ``SPLIT_COUNTS`` that leaves each split at least
    ``SPLIT_MIN_KEYS`` keys: each count is a kernel of its own (a compile-time constant), so a growing
    context compiles 2 of them, not one per 256 tokens. Tuned on an H200 (step 5's README): below ~2,048
    tokens the split path's second launch costs more than it saves, and where it pays, more splits pay
    more. GPT-2's 1,024-token window never splits.
    """
    fitting = [n for n in SPLIT_COUNTS if n * SPLIT_MIN_KEYS <= max_kv_len]
    if max_query_len != 1 or num_seqs * num_heads >= _num_sms(device) or not fitting:
        return 1
    return max(fitting)


def flash_decoding_attention(
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
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """``kernels.paged_attention`` with each decode's keys split across ``num_splits`` programs.

    Arguments and result as ``kernels.paged_attention``'s. num_splits: None chooses
    (``choose_num_splits``); 1 runs ``kernels.paged_attention`` (block_n, num_warps, num_stages passed on);
    k > 1 splits each (sequence, head) into k key slices, and then every query_len must be 1
    (max_query_len 1). Raises as paged_attention does, and ValueError for k > 1 with max_query_len != 1.
    Source: Dao, Haziza, Massa, Sizov 2023 (flash-decoding).
    """
    _check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(seq_lens.shape[0], q.shape[1], max_query_len, max_kv_len, q.device)
    if num_splits == 1:
        tiles = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        return paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, **tiles
        )
    if max_query_len != 1:
        raise ValueError(
            f"num_splits={num_splits} needs a batch of decodes (max_query_len 1), got {max_query_len}"
        )
    _check_usable(q.device)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise ValueError(CPU_BF16_UNSUPPORTED)
    N, H, D = q.shape
    S = seq_lens.shape[0]
    out = torch.empty((N, H, D), device=q.device, dtype=q.dtype)  # [N, H, D]
    if N == 0 or S == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(D))
    # part 1: a partial softmax per (sequence, head, split); part 2: their merge into out
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
        (D**-0.5 if scale is None else scale) * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *part_max.stride(),
        *part_acc.stride(),
        HEAD_DIM=D,
        D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_N=block_n or 64,
        NUM_SPLITS=num_splits,
        num_warps=num_warps or 4,
        num_stages=num_stages or 2,
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

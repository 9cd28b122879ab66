"""The KV-cache write as a kernel: an exercise beside the engine, which does not import this module.

``write_kv`` stores the new tokens' keys and values into one layer's pool as one kernel for K and V. The
engine writes them by indexing (``PagedKVCache.write``), which was faster on the H200 below about 2,048
new tokens per step (step 5's README has the measurements), more than GPT-2's steps carry.

Shapes as in kernels.py: N new tokens, H heads, D head size.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as in kernels.py: read by the first `import triton`
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .kernels import _check_index_tensor, _check_usable  # noqa: E402


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
    """Store new token i's keys and values [H, D] at its cache slot: block slot // BLOCK_SIZE, at offset
    slot % BLOCK_SIZE.

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


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the keys and values of N new tokens into one layer's pool, in place.

    k_cache, v_cache: [num_blocks, block_size, H, D]; k, v: [N, H, D] (any strides; cast to the cache's
    dtype); slot_mapping: [N] int32/int64, slot = block * block_size + offset; a negative slot is skipped.
    The same as step 4's ``k_cache.view(-1, H, D)[slot_mapping] = k``, as one kernel for K and V.
    Raises ValueError, naming the argument, on mismatched shapes or devices, or a slot_mapping that is not
    a contiguous int32/int64 tensor.
    """
    _check_index_tensor("slot_mapping", slot_mapping, 1, k.device)
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
    if len({t.device for t in (k, v, k_cache, v_cache)}) != 1:
        raise ValueError("k, v, k_cache and v_cache must be on one device")
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

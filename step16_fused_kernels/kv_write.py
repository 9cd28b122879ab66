"""The 8-bit KV write as one Triton kernel: quantize the new tokens' keys and values and store them.

``write_kv_quantized`` stores what ``kv_quant.quantize`` computes, bit for bit, line for line (the same fp32
operations in the same order, the rounding explicit, no FMA contraction), for K and V in one launch instead of
a dozen torch operations per layer; the pool writes through it under the Triton backend on CUDA (vLLM
quantizes in its KV-write kernel too: triton_reshape_and_cache_flash.py). Step 5's exercise kv_write.py is
the same kernel without the scales. Shapes as in kernels.py: N new tokens, H heads, D head size.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as in kernels.py: read by the first `import triton`
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import kv_quant  # noqa: E402
from .kernels import QUANTIZED_DTYPES, _check_index_tensor, _check_usable  # noqa: E402

# kv_quant's constants where a kernel can read them (a global read inside a kernel must be a constexpr)
_ROUND, _NAN_SCALE_BITS = tl.constexpr(kv_quant.ROUND), tl.constexpr(kv_quant.NAN_SCALE_BITS)
_E4M3_MIN_NORMAL = tl.constexpr(kv_quant.E4M3_MIN_NORMAL)
_E4M3_MANTISSA_STEP = tl.constexpr(kv_quant.E4M3_MANTISSA_STEP)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr, INV_QMAX: tl.constexpr, SCALE_MAX: tl.constexpr, FP8: tl.constexpr):
    """A tile x [R, D] in fp32 (padding 0: it never raises an amax), one token-head a row -> (values [R, D]
    in fp32, exact in the 8-bit type; scales [R] float16, the NaN scale for a row that holds a NaN):
    ``kv_quant.quantize``, step for step. Step 16's fused QKV kernel quantizes its tile through it too."""
    nan = tl.max((x != x).to(tl.int32), 1) > 0  # [R]
    x = tl.where(x != x, 0.0, x)
    amax = tl.max(tl.abs(x), 1)  # [R]
    scale = tl.minimum(amax * INV_QMAX, SCALE_MAX).to(tl.float16)  # rounded to nearest even
    s = scale.to(tl.float32)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)[:, None]  # [R, 1]
    y = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)  # [R, D]
    if FP8:  # e4m3's spacing at |y|, a power of two (see kv_quant.quantize)
        step = (tl.abs(y).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        step = tl.maximum(step, _E4M3_MIN_NORMAL) * _E4M3_MANTISSA_STEP
        y = ((tl.math.div_rn(y, step) + _ROUND) - _ROUND) * step
    else:
        y = (y + _ROUND) - _ROUND
    scale_bits = tl.where(nan, _NAN_SCALE_BITS, scale.to(tl.int16, bitcast=True)).to(tl.int16)
    return y, scale_bits.to(tl.float16, bitcast=True)


@triton.jit
def _quantize_store(
    x_ptr,
    cache_ptr,
    scale_ptr,
    i,
    slot,
    stride_xn,
    stride_xh,
    stride_cn,
    stride_ch,
    stride_sn,
    heads,
    d,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    FP8: tl.constexpr,
):
    """One token's [H_PAD, D_PAD] tile of x -> 8-bit values at its slot of the cache, a scale per head
    (``quantize_rows``)."""
    h = heads[:, None]  # [H_PAD, 1]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    x = tl.load(x_ptr + i * stride_xn + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    y, scale = quantize_rows(x, QMAX, INV_QMAX, SCALE_MAX, FP8)  # [H_PAD, D_PAD], [H_PAD]
    tl.store(cache_ptr + slot * stride_cn + h * stride_ch + d, y.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + slot * stride_sn + heads, scale, mask=heads < NUM_HEADS)


# slot_mapping is a slice of the runner's packed copy, its alignment changing from step to step: not
# specialised on it, or each new alignment would compile the kernel again (kernels.py, NOT_SPECIALISED)
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _write_kv_quantized_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_cn,
    stride_ch,
    stride_sn,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    FP8: tl.constexpr,
):
    """New token i's keys and values [H, D], quantized per head, at its cache slot (the pools seen as
    [num_slots, H, D], the scales as [num_slots, H]).

    Grid: (N,). Each program loads one [H_PAD, D_PAD] tile of k and of v (padding masked to 0, so it
    never raises an amax), takes each head's amax in fp32 and stores its float16 scale and 8-bit values
    (``kv_quant.quantize``). Slots in int64.
    """
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + i).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)[None, :]
    _quantize_store(
        k_ptr,
        k_cache_ptr,
        k_scale_ptr,
        i,
        slot,
        stride_kn,
        stride_kh,
        stride_cn,
        stride_ch,
        stride_sn,
        heads,
        d,
        NUM_HEADS,
        HEAD_DIM,
        QMAX,
        INV_QMAX,
        SCALE_MAX,
        FP8,
    )
    _quantize_store(
        v_ptr,
        v_cache_ptr,
        v_scale_ptr,
        i,
        slot,
        stride_vn,
        stride_vh,
        stride_cn,
        stride_ch,
        stride_sn,
        heads,
        d,
        NUM_HEADS,
        HEAD_DIM,
        QMAX,
        INV_QMAX,
        SCALE_MAX,
        FP8,
    )


def write_kv_quantized(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantize the keys and values of N new tokens and store them, with their scales, in one layer's pool.

    k_cache, v_cache: [num_blocks, block_size, H, D] int8 or float8_e4m3fn, contiguous; k_scale, v_scale:
    [num_blocks, block_size, H] float16, contiguous; k, v: [N, H, D] (rows of any stride, D contiguous);
    slot_mapping: [N] int32/int64, slot = block * block_size + offset. Bit for bit what
    ``kv_quant.quantize`` makes, on a GPU and through Triton's interpreter. Raises ValueError, naming the
    argument, on mismatched shapes, dtypes, layouts or devices.
    """
    _check_index_tensor("slot_mapping", slot_mapping, 1, k.device)
    N, H, D = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (H, D) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"expected k, v [N, H, D] and caches [num_blocks, block_size, H, D]; got {list(k.shape)}, "
            f"{list(v.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}"
        )
    if k_cache.dtype not in QUANTIZED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache, v_cache must be int8 or float8_e4m3fn, got {k_cache.dtype}, {v_cache.dtype}"
        )
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.shape != k_cache.shape[:3] or t.dtype != torch.float16 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous float16 {list(k_cache.shape[:3])}, got {list(t.shape)} {t.dtype}"
            )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k_cache and v_cache must be contiguous, and k, v contiguous along D")
    if len({t.device for t in (k, v, k_cache, v_cache, k_scale, v_scale)}) != 1:
        raise ValueError("k, v, the caches and their scales must be on one device")
    _check_usable(k.device)
    if N == 0:
        return
    _write_kv_quantized_kernel[(N,)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        H * D,  # the pools as [num_slots, H, D]
        D,
        H,  # the scales as [num_slots, H]
        NUM_HEADS=H,
        H_PAD=triton.next_power_of_2(H),
        HEAD_DIM=D,
        D_PAD=triton.next_power_of_2(D),
        QMAX=kv_quant.qmax(k_cache.dtype),
        INV_QMAX=kv_quant.inv_qmax(k_cache.dtype),
        SCALE_MAX=kv_quant.scale_max(k_cache.dtype),
        FP8=k_cache.dtype != torch.int8,
        num_warps=4,
        enable_fp_fusion=False,  # x * inv then + ROUND must round twice, as torch's two operations do
    )


def warm_up(
    num_heads: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device | str
) -> None:
    """Compile the kernel now, on the CUDA ``device``, for an engine of these shapes and dtypes: k and v as
    views into one [N, 3 x C] projection (the model's strides), int64 slots; without this the first step
    (or a CUDA-graph capture) would wait for the compiler."""
    C = num_heads * head_dim
    qkv = torch.zeros(2, 3 * C, device=device, dtype=dtype)  # [N, 3C], as c_attn's output
    k, v = (t.view(2, num_heads, head_dim) for t in qkv[:, C:].split(C, dim=1))
    caches = [torch.zeros(1, 2, num_heads, head_dim, device=device, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.zeros(1, 2, num_heads, device=device, dtype=torch.float16) for _ in range(2)]
    write_kv_quantized(*caches, *scales, k, v, torch.arange(2, device=device))

"""The 8-bit KV format: a token-head's values -> 8-bit values over a float16 scale, by one exact formula.

``quantize`` is the formula in PyTorch (the pool's torch write); kv_write.py's Triton kernel follows it line
for line. Every step is one IEEE fp32 operation or exact, rounding is explicit, and nothing is left to a
backend (torch on CUDA divides by a Python number as a multiply by its reciprocal, Triton contracts a
multiply and an add into one FMA, Triton's interpreter casts to e4m3 wrongly), so both paths store the
same bits on any device. ``dequantize`` reads back: a value times its scale, finite in float16 by the cap.
"""

from __future__ import annotations

import functools

import torch

# One scale per token and head: 2 bytes, next to 64 of a GPT-2 head (about 1.94x fp16's tokens per byte).
# float16's 11 significant bits are finer than the 8-bit values they scale; its range (6e-8 .. 65504) holds
# amax / 448 of any fp16 value (a scale that underflows to 0 stores 0s, which are then within 1e-5 of x).
SCALE_DTYPE = torch.float16
NAN_SCALE_BITS = 0x7E00  # float16's quiet NaN: the scale of a token-head that holds a NaN
# (y + 1.5 x 2^23) - 1.5 x 2^23 rounds an fp32 |y| < 2^22 to an integer, ties to even: the sum lies where
# fp32's spacing is 1, and the subtraction is exact. Two adds, alike in torch and Triton; a zero comes out +0.
ROUND = 12582912.0
E4M3_MIN_NORMAL, E4M3_MANTISSA_STEP = 2.0**-6, 2.0**-3  # e4m3: 3 mantissa bits, 2^-9 apart below 2^-6


def qmax(dtype: torch.dtype) -> float:
    """The largest magnitude an 8-bit ``dtype`` stores, onto which a token-head's amax maps: 127 (int8),
    448 (e4m3: no infinities, "fn", 448 its largest finite value)."""
    return float(torch.iinfo(dtype).max if dtype == torch.int8 else torch.finfo(dtype).max)


@functools.cache
def inv_qmax(dtype: torch.dtype) -> float:
    """fp32(1 / qmax), an fp32 value (the scale is amax times it, one fp32 multiply)."""
    return (1.0 / torch.tensor(qmax(dtype), dtype=torch.float32)).item()


@functools.cache
def scale_max(dtype: torch.dtype) -> float:
    """The cap on a scale: the largest float16 s with qmax x s <= 65504 (float16's largest), 515.5 (int8) and
    146.125 (e4m3), so that every stored value reads back finite in float16. Uncapped, 65504 / 127 rounds
    up to 516, and 127 x 516 = 65532 is inf in float16."""
    s = torch.arange(0x7C00, dtype=torch.int16).view(SCALE_DTYPE).float()  # every finite float16 >= 0
    return s[s * qmax(dtype) <= torch.finfo(SCALE_DTYPE).max].max().item()


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (values [N, H, D] in ``dtype``, int8 or float8_e4m3fn; scales [N, H] float16), with
    x ~= values x scale, symmetric, one scale per token-head (row of D). In fp32, per row:

        amax  = max |x|                          (NaNs counted as 0)
        scale = float16(min(amax x fp32(1 / qmax), scale_max))      one rounding, to nearest even
        inv   = 1 / scale, or 0 for a scale of 0                    (zeros, or amax below ~3e-8 x qmax)
        y     = clamp(x x inv, -qmax, qmax)
        int8: values = round(y)
        e4m3: step = max(2^floor(log2 |y|), 2^-6) / 8;  values = round(y / step) x step

    round: to nearest, ties to even (``ROUND``), so the e4m3 cast is exact. A row holding a NaN stores
    the NaN scale (``NAN_SCALE_BITS``) over its values: it reads back NaN, as a pool in the model's dtype
    would give it back. +-inf saturates at +-qmax x scale_max.
    """
    q, fp8 = qmax(dtype), dtype != torch.int8
    x = x.float()  # [N, H, D], exact
    isnan = x.isnan()
    nan, x = isnan.any(-1), x.masked_fill(isnan, 0.0)  # [N, H], [N, H, D]
    amax = x.abs().amax(-1)  # [N, H]
    scale = (amax * inv_qmax(dtype)).clamp(max=scale_max(dtype)).to(SCALE_DTYPE)  # [N, H]
    s = scale.float()
    inv = torch.where(s > 0, s.reciprocal(), 0.0)[..., None]  # [N, H, 1]
    y = (x * inv).clamp(-q, q)  # [N, H, D]
    if fp8:  # e4m3's spacing at |y|: 2^(exponent - 3), at least 2^-9 (subnormals); a power of two
        step = (y.abs().view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^floor(log2 |y|), 0 for 0
        step = step.clamp(min=E4M3_MIN_NORMAL) * E4M3_MANTISSA_STEP
        y = ((y / step + ROUND) - ROUND) * step  # exact but for the rounding
    else:
        y = (y + ROUND) - ROUND
    scale = scale.view(torch.int16).masked_fill(nan, NAN_SCALE_BITS).view(SCALE_DTYPE)
    return y.to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] (8-bit) times scale [...] (their token-heads'), in ``dtype``: the kernel's arithmetic
    (exact fp32 products), for the torch backend. Finite in float16: |values| x scale <= qmax x scale_max
    <= 65504 (a NaN scale reads back NaN)."""
    return (values.float() * scale.float()[..., None]).to(dtype)

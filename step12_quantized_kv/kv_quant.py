"""The 8-bit KV format: a token-head's values -> 8-bit values over a float16 scale, and back.

``quantize`` is the format in PyTorch (the pool's torch write); kv_write.py's Triton kernel computes the
same; ``dequantize`` reads back (the torch backend).
"""

from __future__ import annotations

import torch

# One scale per token and head: 2 bytes, next to 64 of a GPT-2 head (about 1.94x fp16's tokens per byte).
# float16's 11 significant bits are finer than the 8-bit values they scale; its range (6e-8 .. 65504) holds
# amax / 448 of any fp16 value (a scale that underflows to 0 stores 0s, which are then within 1e-5 of x).
SCALE_DTYPE = torch.float16


def qmax(dtype: torch.dtype) -> float:
    """The largest magnitude an 8-bit ``dtype`` stores, onto which a token-head's amax maps: 127 (int8),
    448 (e4m3: no infinities, "fn", 448 its largest finite value)."""
    return float(torch.iinfo(dtype).max if dtype == torch.int8 else torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H, D] -> (values [N, H, D] in ``dtype``, int8 or float8_e4m3fn; scales [N, H] float16), with
    x ~= values * scale: scale = amax over D / qmax (127 or 448), symmetric, values rounded to nearest,
    half up (int8; as the write kernel, kv_write.py) or cast (e4m3) after clamping to +-qmax. A row of
    zeros gets scale 0 and zeros, not NaN."""
    q = qmax(dtype)
    amax = x.abs().amax(-1).float()  # [N, H]
    scale = (amax / q).clamp(max=torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)  # [N, H]
    s = scale.float()[..., None]  # [N, H, 1] the rounded scale: what the reader multiplies by
    y = torch.where(s > 0, x.float() / s, 0.0).clamp(-q, q)  # [N, H, D] fp32, a scale of 0 -> 0
    return (torch.floor(y + 0.5) if dtype == torch.int8 else y).to(dtype), scale  # int8: half up


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] (8-bit) times scale [...] (their token-heads'), in ``dtype``: the kernel's arithmetic
    (fp32 products), for the torch backend; clamped to ``dtype``'s finite range (a float16 scale rounded up
    would otherwise turn float16's largest value, 65504 = 127 x 515.78, into 127 x 516: inf)."""
    top = torch.finfo(dtype).max
    return (values.float() * scale.float()[..., None]).clamp_(-top, top).to(dtype)

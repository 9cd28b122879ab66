"""The KV cache: every layer's keys and values of the tokens seen so far, kept between forward passes.

In causal attention a token's key and value never change once computed (they depend only on the
tokens before it), so a decoder can keep them and, for each new token, compute only that token's
query, key and value (the standard incremental decoding of Vaswani et al. 2017; its memory cost is
analysed in Pope et al. 2022, "Efficiently Scaling Transformer Inference").

Memory: 2 (K and V) x n_layer x n_head x head_dim x bytes per element, per token. GPT-2 124M in fp32:
2 x 12 x 12 x 64 x 4 = 73,728 bytes (72 KiB) per token, 72 MiB for its 1024-token context window.
"""

from __future__ import annotations

import torch

from common.weights import GPT2Config


class KVCache:
    """A pre-allocated cache for a batch of ``len(num_pads)`` sequences of at most ``capacity`` tokens.

    k[layer], v[layer]: [B, H, capacity, D] buffers, allocated once; positions 0..length-1 are filled,
    for all rows at once. num_pads: row b's first num_pads[b] positions hold its left padding (the
    prompts are padded to the longest); num_pads_t: the same as a [B] int64 tensor on ``device``, or None
    for a batch without padding (what the model's attention mask is built from).
    ``update`` writes a layer's new keys and values after the cached ones; the model calls ``advance``
    once all layers have written, so every layer sees the same ``length``.

    Raises RuntimeError instead of writing past ``capacity``.
    """

    def __init__(
        self,
        config: GPT2Config,
        capacity: int,
        device: torch.device | str,
        dtype: torch.dtype,
        num_pads: list[int] | tuple[int, ...] = (0,),
    ):
        shape = (len(num_pads), config.n_head, capacity, config.head_dim)  # [B, H, capacity, D]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.capacity = capacity
        self.length = 0  # tokens cached
        self.num_pads = list(num_pads)
        self.num_pads_t = torch.tensor(self.num_pads, device=device) if any(num_pads) else None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values of ``layer`` and return all of them, cached and new.

        k, v: [B, H, T, D] for the T new tokens, at positions length..length+T-1.
        Returns k, v: [B, H, length+T, D] (views into the cache, no copy).
        """
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {start} cached + {k.shape[2]} new tokens > capacity {self.capacity}"
            )
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions as filled (after every layer has called ``update``)."""
        self.length += n

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (all layers, the full capacity)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

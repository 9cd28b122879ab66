"""The paged KV cache: one pool of fixed-size blocks per layer, shared by every sequence.

Instead of one contiguous buffer per sequence sized for its longest possible length (step 3), the
cache is cut into blocks of ``block_size`` tokens, and a sequence holds a list of blocks (its block
table), taken one at a time as it grows (Kwon et al. 2023, "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP). A token at position p of a sequence lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``; the flat index of that place,
``block * block_size + offset``, is its *slot*. The engine computes the slots of the new tokens of a
step (the slot mapping); the model writes their keys and values there and reads every sequence's
keys and values back through its block table. Which blocks are free and who owns what is the
``BlockManager``'s business, not this pool's.

Memory: 2 (K and V) x n_layer x n_head x head_dim x bytes per element, per token, as in step 2, but
only for the blocks in use: at most block_size - 1 slots are wasted per sequence (its last block).
"""

from __future__ import annotations

import torch

from common.weights import GPT2Config


class PagedKVCache:
    """Pre-allocated K and V pools: k[layer], v[layer] are [num_blocks, block_size, H, D].

    Sizes: ``bytes_per_block`` = 2 x n_layer x block_size x n_head x head_dim x element size.
    """

    def __init__(
        self, config: GPT2Config, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
    ):
        shape = (num_blocks, block_size, config.n_head, config.head_dim)  # [num_blocks, block_size, H, D]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the keys and values of N new tokens: k, v [N, H, D] go to the slots slot_mapping [N]."""
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = k  # the pool seen as [num_blocks * block_size, H, D]
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of S sequences, laid out contiguously by following their block tables.

        block_tables: [S, M] block ids (rows shorter than M blocks padded with any valid id).
        Returns k, v: [S, M * block_size, H, D] (a copy); positions past a sequence's length are junk.
        """
        S, M = block_tables.shape
        k = self.k[layer][block_tables]  # [S, M, block_size, H, D]
        v = self.v[layer][block_tables]  # [S, M, block_size, H, D]
        return k.view(S, M * self.block_size, *k.shape[3:]), v.view(S, M * self.block_size, *v.shape[3:])

    @staticmethod
    def block_bytes(config: GPT2Config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V: 2 x n_layer x block_size x n_head x head_dim x size."""
        return 2 * config.n_layer * block_size * config.n_head * config.head_dim * dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.config, self.block_size, self.k[0].dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole pool (all layers, K and V)."""
        return self.bytes_per_block * self.num_blocks

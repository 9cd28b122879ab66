"""The paged KV cache: one pool of fixed-size blocks per layer, shared by every sequence.

Instead of one buffer per sequence sized for its longest length (step 3), a sequence holds a list of blocks
of ``block_size`` tokens (its block table), taken one at a time as it grows (Kwon et al. 2023, "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP). Position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``: its *slot* is ``block * block_size + offset``.
The model writes a step's keys and values at their slots (the slot mapping) and reads each sequence's back
through its block table; who owns which block is the ``BlockManager``'s business. Memory per token: 2 x
n_layer x n_head x head_dim x bytes per element, as in step 2, for the blocks in use only (at most
block_size - 1 slots wasted per sequence).
"""

from __future__ import annotations

import torch

from common.weights import GPT2Config


class PagedKVCache:
    """Pre-allocated K and V pools: k[layer], v[layer] are [num_blocks, block_size, H, D].

    Sizes: ``block_bytes`` = 2 x n_layer x block_size x n_head x head_dim x element size per block.
    Raises ValueError if the pool would not fit in the device's free memory.
    """

    def __init__(
        self,
        config: GPT2Config,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        check_free_memory(
            num_blocks * self.block_bytes(config, block_size, dtype), torch.device(device), num_blocks
        )
        self.block_size, self.dtype = block_size, dtype
        shape = (num_blocks, block_size, config.n_head, config.head_dim)  # [num_blocks, block_size, H, D]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the keys and values of N new tokens: k, v [N, H, D] go to the slots slot_mapping [N]."""
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = (
            k  # the pool seen as [num_blocks * block_size, H, D]
        )
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy whole blocks, keys and values in every layer: (source, destination) block ids, the
        copies-on-write of a step (a forked choice's first write into a block it shares). On the device's
        stream, so after the previous step's writes and before this step's."""
        if not blocks_to_copy:
            return
        device = self.k[0].device
        # from pinned memory, without waiting: the host does not wait for the steps still on the device
        pairs = torch.tensor(blocks_to_copy, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        src, dst = pairs[:, 0], pairs[:, 1]  # [B], [B]
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]  # [B, block_size, H, D]
            v[dst] = v[src]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of S sequences, laid out contiguously by following their block tables.

        block_tables: [S, M] block ids (rows shorter than M blocks padded with any valid id).
        Returns k, v: [S, M * block_size, H, D] (a copy); positions past a sequence's length are junk.
        """
        S, M = block_tables.shape
        k = self.k[layer][block_tables]  # [S, M, block_size, H, D]
        v = self.v[layer][block_tables]  # [S, M, block_size, H, D]
        return k.flatten(1, 2), v.flatten(1, 2)  # [S, M * block_size, H, D]

    @staticmethod
    def block_bytes(config: GPT2Config, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, K and V:
        2 x n_layer x block_size x n_head x head_dim x dtype size."""
        return 2 * config.n_layer * block_size * config.n_head * config.head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole pool (all layers, K and V)."""
        return sum(t.nbytes for t in self.k + self.v)


def check_free_memory(nbytes: int, device: torch.device, num_blocks: int) -> None:
    """Raise ValueError, before allocating, if a pool of ``nbytes`` bytes cannot fit in the device's free
    memory (the GPU's, or the machine's available RAM for the CPU, where the OS tells it)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:  # Linux: memory available without swapping (free + reclaimable cache)
            with open("/proc/meminfo") as f:
                free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):  # not every OS tells
            return
    if nbytes > free:
        raise ValueError(
            f"num_kv_blocks={num_blocks}: the KV cache would need {nbytes / 2**30:.2f} GiB, "
            f"but {free / 2**30:.2f} GiB is free on {device}"
        )

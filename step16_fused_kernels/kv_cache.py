"""The paged KV cache: one pool of fixed-size blocks per layer, shared by every sequence.

Instead of one buffer per sequence sized for its longest length (step 3), a sequence holds a list of blocks
of ``block_size`` tokens (its block table), taken one at a time as it grows (Kwon et al. 2023, "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP). Position p lives in block
``block_table[p // block_size]`` at offset ``p % block_size``: its *slot* is ``block * block_size + offset``.
The model writes a step's keys and values at their slots and reads each sequence's back through its block
table; the ``BlockManager`` owns the blocks. Step 12: ``kv_cache_dtype`` "int8" or "fp8" stores each value
in 8 bits over a float16 scale of its token and head (kv_quant.py), set as it is written: no calibration,
and a scale never changes under stored values. Bytes per token: ``block_bytes`` / block_size.
"""

from __future__ import annotations

import torch

from common.weights import GPT2Config

from .kv_quant import SCALE_DTYPE, dequantize, quantize

try:
    from . import kv_write
except ImportError:  # Triton is not installed: the torch write only
    kv_write = None

# kv_cache_dtype -> the pool's element type; "auto" (None): the model's dtype, unscaled
KV_CACHE_DTYPES = {
    "auto": None,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


class PagedKVCache:
    """Pre-allocated K and V pools: k[layer], v[layer] are [num_blocks, block_size, H, D], in ``dtype``
    (the model's) with kv_cache_dtype "auto", else 8-bit (``cache_dtype``) with their scales k_scale[layer],
    v_scale[layer] [num_blocks, block_size, H] float16 (None for "auto"). ``write`` stores 8-bit keys
    through kv_write.py's Triton kernel under the "triton" ``attention_backend`` on CUDA, else in torch ops
    (``kv_quant.quantize``): the same bits either way.

    Sizes: ``block_bytes`` = 2 x n_layer x block_size x n_head x (head_dim x element size + scale size).
    Raises ValueError if the pool would not fit in the device's free memory, or for an unknown
    kv_cache_dtype (``KV_CACHE_DTYPES``).
    """

    def __init__(
        self,
        config: GPT2Config,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "torch",
    ):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: must be one of {list(KV_CACHE_DTYPES)}")
        check_free_memory(
            num_blocks * self.block_bytes(config, block_size, dtype, kv_cache_dtype),
            torch.device(device),
            num_blocks,
        )
        self.block_size, self.dtype = block_size, dtype
        self.cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or dtype  # what the pool stores
        self.quantized = kv_cache_dtype != "auto"
        shape = (num_blocks, block_size, config.n_head, config.head_dim)  # [num_blocks, block_size, H, D]
        self.k = [torch.zeros(shape, device=device, dtype=self.cache_dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=self.cache_dtype) for _ in range(config.n_layer)]
        # a scale per token-head: [num_blocks, block_size, H]
        scales = (num_blocks, block_size, config.n_head)
        self.k_scale = [self.zeros(scales, device) for _ in range(config.n_layer)]  # None for "auto"
        self.v_scale = [self.zeros(scales, device) for _ in range(config.n_layer)]
        # 8 bits with the Triton backend on CUDA: one kernel quantizes and stores K and V, compiled now so
        # that no step (or CUDA-graph capture) waits for the compiler
        self.write_kernel = (
            self.quantized and attention_backend == "triton" and torch.device(device).type == "cuda"
        )
        if self.write_kernel:
            kv_write.warm_up(config.n_head, config.head_dim, dtype, self.cache_dtype, device)

    def zeros(self, shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor | None:
        """A zeroed scale tensor of ``shape`` (float16), or None if the pool is not quantized."""
        return torch.zeros(shape, device=device, dtype=SCALE_DTYPE) if self.quantized else None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the keys and values of N new tokens: k, v [N, H, D] go to the slots slot_mapping [N];
        in 8 bits, with each token-head's scale at the same slot, through kv_write.py's kernel if
        ``write_kernel``, else by ``quantize``: the same bits."""
        if self.write_kernel:  # one launch for K and V
            pool = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
            kv_write.write_kv_quantized(*pool, k, v, slot_mapping)
            return
        if self.quantized:
            (k, k_scale), (v, v_scale) = quantize(k, self.cache_dtype), quantize(v, self.cache_dtype)
            self.k_scale[layer].view(-1, k.shape[1])[slot_mapping] = k_scale  # [num_blocks * block_size, H]
            self.v_scale[layer].view(-1, v.shape[1])[slot_mapping] = v_scale
        self.k[layer].view(-1, *k.shape[1:])[slot_mapping] = (
            k  # the pool seen as [num_blocks * block_size, H, D]
        )
        self.v[layer].view(-1, *v.shape[1:])[slot_mapping] = v

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy whole blocks, keys and values in every layer: (source, destination) block ids, the
        copies-on-write of a step (a forked choice's first write into a block it shares), with their scales.
        On the device's stream, so after the previous step's writes and before this step's."""
        if not blocks_to_copy:
            return
        device = self.k[0].device
        # from pinned memory, without waiting: the host does not wait for the steps still on the device
        pairs = torch.tensor(blocks_to_copy, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        src, dst = pairs[:, 0], pairs[:, 1]  # [B], [B]
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]  # [B, block_size, H, D]
            v[dst] = v[src]
        for scale in self.k_scale + self.v_scale if self.quantized else []:  # 8 bits: scales travel along
            scale[dst] = scale[src]  # [B, block_size, H]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (slot ids of any shape [...]), a copy: [..., H, D] each, in the
        model's dtype (8-bit values dequantized with their scales: the torch backend's read)."""
        k, v = self.k[layer].flatten(0, 1)[slots], self.v[layer].flatten(0, 1)[slots]  # [..., H, D]
        if not self.quantized:
            return k, v
        k_scale, v_scale = self.k_scale[layer].flatten(0, 1)[slots], self.v_scale[layer].flatten(0, 1)[slots]
        return dequantize(k, k_scale, self.dtype), dequantize(v, v_scale, self.dtype)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of S sequences, laid out contiguously by following their block tables.

        block_tables: [S, M] block ids (rows shorter than M blocks padded with any valid id).
        Returns k, v: [S, M * block_size, H, D] (a copy, in the model's dtype); positions past a sequence's
        length are junk.
        """
        offsets = torch.arange(self.block_size, device=block_tables.device)  # [block_size]
        slots = (block_tables[:, :, None] * self.block_size + offsets).flatten(1)  # [S, M * block_size]
        return self.read(layer, slots)  # [S, M * block_size, H, D]

    @staticmethod
    def block_bytes(
        config: GPT2Config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        """Bytes one block takes over all layers, K and V:
        2 x n_layer x block_size x n_head x (head_dim x element size + scale size), the element in ``dtype``
        for "auto" (no scale), else 1 byte with a 2-byte scale (GPT-2: 64 x 2 = 128 vs 64 + 2 = 66 bytes)."""
        element = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
        scale = 0 if kv_cache_dtype == "auto" else SCALE_DTYPE.itemsize
        per_head = config.head_dim * element.itemsize + scale  # bytes per token and head
        return 2 * config.n_layer * block_size * config.n_head * per_head

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole pool (all layers, K and V, their scales)."""
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.v_scale if t is not None)


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

"""The engine's arguments in one place (vLLM's ``EngineArgs``, nano-vllm's ``Config``): each one checked,
and what the engine's parts are built from resolved, before any weights load. A request's own checks run
where the request enters (``LLMEngine.make_sequence``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.weights import GPT2Config, load_config, resolve_model

from .block_manager import blocks_for
from .kv_cache import PagedKVCache
from .model import kernels

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_device(device: str) -> torch.device:
    """The torch device named ``device``: "cpu", "cuda" or "cuda:N". Raises ValueError for anything else,
    or for a GPU this machine does not have."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r}: not a device name (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: the engines run on 'cpu' or 'cuda' only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


ATTENTION_BACKENDS = ("auto", "triton", "torch")


def choose_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The attention backend for ``device``: "triton" or "torch" ("auto": Triton on CUDA if it is installed).

    Raises ValueError for an unknown name, or "triton" where the kernels cannot run (no Triton, or a CPU
    without Triton's interpreter switched on: TRITON_INTERPRET=1, for tests), or would be wrong (bfloat16
    through the interpreter: see ``kernels.paged_attention``)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r}: must be one of {list(ATTENTION_BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and kernels is not None else "torch"
    if name == "triton" and (kernels is None or not kernels.triton_usable(device)):
        raise ValueError(
            f"attention_backend='triton': the Triton kernels cannot run on {device} here "
            "(they need Triton and a CUDA device, or TRITON_INTERPRET=1 on the CPU)"
        )
    if name == "triton" and device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError(f"attention_backend='triton', dtype='bfloat16': {kernels.CPU_BF16_UNSUPPORTED}")
    return name


def is_integer(value) -> bool:
    """Whether ``value`` is an int, and not a bool (Python's True is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class EngineArgs:
    """The arguments of ``LLMEngine``, checked and resolved by ``__post_init__``.

    model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...), or a local snapshot
    folder (see ``common.weights.resolve_model``). device: a torch device string ("cpu", "cuda",
    "cuda:N"). dtype: of the weights and activations, "float32", "float16" or "bfloat16".
    block_size: tokens per KV-cache block (at most the context window). num_kv_blocks: blocks in the
    pool; or kv_cache_memory: a pool budget in bytes; default: room for max_num_seqs sequences of the
    full context window. max_num_seqs: most requests running at once. max_num_batched_tokens: most
    tokens in one forward pass (default and minimum: the context window, so that any request, also one
    preempted late, can be prefilled in one step). attention_backend: "triton" (the kernels of kernels.py:
    CUDA, or Triton's interpreter on the CPU for tests), "torch" (step 4's plain-PyTorch attention) or
    "auto": Triton on a CUDA device, torch elsewhere. enforce_eager (vLLM's name): capture no CUDA graphs
    (a CPU has none either way); decode-only batches are padded to the capture ladder's sizes all the same.
    async_scheduling (vLLM's name): overlap the host's work with the GPU's (engine.py): schedule and launch
    step N+1 before reading step N's tokens; None (default): on for a CUDA device, off on a CPU, where
    there is nothing to overlap with (True runs the same code path there, for tests).
    enable_prefix_caching (vLLM's name, on by default as in vLLM v1): keep computed full blocks for later
    requests that share their prefix.

    Resolved from them: folder (the snapshot folder), hf_config (its ``GPT2Config``), torch_device,
    torch_dtype, and max_model_len: the tokens one request can reach, prompt included (the context window,
    or the pool's tokens if fewer). num_kv_blocks, max_num_batched_tokens, attention_backend and
    async_scheduling hold their resolved values.

    Raises ValueError, naming the argument, if one is bad; ConnectionError if a Hub model cannot be fetched.
    """

    model: str = "demo"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True
    folder: Path = field(init=False)
    hf_config: GPT2Config = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    max_model_len: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r}: must be True, False or None")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {sorted(DTYPES)}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks, kv_cache_memory: give one of them, not both")
        self.torch_dtype = DTYPES[self.dtype]
        self.torch_device = check_device(self.device)
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda"
        self.attention_backend = choose_attention_backend(
            self.attention_backend, self.torch_device, self.torch_dtype
        )
        self.folder = resolve_model(self.model)  # may download: after the checks that need no model
        self.hf_config = load_config(self.folder)
        window = self.hf_config.n_positions
        if self.block_size > window:
            raise ValueError(
                f"block_size={self.block_size}: must be at most the context window ({window} tokens)"
            )

        bytes_per_block = PagedKVCache.block_bytes(self.hf_config, self.block_size, self.torch_dtype)
        if self.kv_cache_memory is not None:
            if not is_integer(self.kv_cache_memory) or self.kv_cache_memory < bytes_per_block:
                raise ValueError(
                    f"kv_cache_memory={self.kv_cache_memory!r}: must be an integer >= {bytes_per_block} "
                    "bytes (one block)"
                )
            self.num_kv_blocks = self.kv_cache_memory // bytes_per_block
        if self.num_kv_blocks is None:  # every request can reach the window
            self.num_kv_blocks = self.max_num_seqs * blocks_for(window, self.block_size)
        if not is_integer(self.num_kv_blocks) or self.num_kv_blocks < 1:
            raise ValueError(
                f"num_kv_blocks={self.num_kv_blocks!r}: must be an integer >= 1 "
                f"(a block of {self.block_size} tokens takes {bytes_per_block} bytes)"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = window
        if not is_integer(self.max_num_batched_tokens) or self.max_num_batched_tokens < window:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens!r}: must be an integer >= the "
                f"context window ({window})"
            )
        self.max_model_len = min(window, self.num_kv_blocks * self.block_size)

"""The engine's arguments in one place (vLLM's ``EngineArgs``, nano-vllm's ``Config``): each one checked,
and what the engine's parts are built from resolved, before any weights load. A request's own checks run
where the request enters (``LLMEngine.make_sequence``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.weights import GPT2Config, load_config, resolve_model

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


@dataclass
class EngineArgs:
    """The arguments of ``LLMEngine``, checked and resolved by ``__post_init__``.

    model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...), or a local snapshot
    folder (see ``common.weights.resolve_model``). device: a torch device string ("cpu", "cuda",
    "cuda:N"). dtype: of the weights and activations, "float32", "float16" or "bfloat16".

    Resolved from them: folder (the snapshot folder), hf_config (its ``GPT2Config``), torch_device,
    torch_dtype, and max_model_len: the tokens one request can reach, prompt included (the context window).

    Raises ValueError, naming the argument, if one is bad; ConnectionError if a Hub model cannot be fetched.
    """

    model: str = "demo"
    device: str = "cpu"
    dtype: str = "float32"
    folder: Path = field(init=False)
    hf_config: GPT2Config = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    max_model_len: int = field(init=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {sorted(DTYPES)}")
        self.torch_dtype = DTYPES[self.dtype]
        self.torch_device = check_device(self.device)
        self.folder = resolve_model(self.model)  # may download: after the checks that need no model
        self.hf_config = load_config(self.folder)
        self.max_model_len = self.hf_config.n_positions

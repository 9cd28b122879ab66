"""The engine's arguments in one place (vLLM's ``EngineArgs``, nano-vllm's ``Config``): each one declared
once, with its default, its check, its help text and its command-line flag; all checked, and what the
engine's parts are built from resolved, before any weights load. ``LLMEngine``, ``LLM``, the command line
and the server take them from here. A request's own checks run where the request enters
(``LLMEngine.make_sequence``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields
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


def is_integer(value) -> bool:
    """Whether ``value`` is an int, and not a bool (Python's True is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


COUNT = (lambda value: is_integer(value) and value >= 1, "an integer >= 1")  # the check of a count or size


def engine_arg(default, help: str, check: tuple[Callable, str] | None = None, **flag):
    """An argument of ``EngineArgs``: its default; its help text; its check, (ok, allowed): ``ok(value)``
    is true, or EngineArgs raises ValueError "<name>=<value>: must be <allowed>"; and its command-line flag,
    ``--name-with-dashes``, made with argparse's keywords ``flag`` (type, choices, action)."""
    return field(default=default, metadata={"help": help, "check": check, "flag": flag})


@dataclass
class EngineArgs:
    """The arguments of ``LLMEngine``, checked and resolved by ``__post_init__``; each one's help text says
    what it is (``python -m <step> --help`` shows them all). model: see ``common.weights.resolve_model``.

    Resolved from them: folder (the snapshot folder), hf_config (its ``GPT2Config``), torch_device,
    torch_dtype, and max_model_len: the tokens one request can reach, prompt included (the context window).

    Raises ValueError, naming the argument, if one is bad; ConnectionError if a Hub model cannot be fetched.
    """

    model: str = engine_arg(
        "demo", "'demo' (bundled), a Hub id or alias such as gpt2, or a local snapshot folder"
    )
    device: str = engine_arg("cpu", "torch device: cpu, cuda or cuda:N")
    dtype: str = engine_arg(
        "float32",
        "weights and activations",
        (tuple(DTYPES).__contains__, f"one of {sorted(DTYPES)}"),  # a tuple: an unhashable value is refused
        choices=sorted(DTYPES),
    )
    max_batch_size: int = engine_arg(8, "most requests decoded together", COUNT, type=int)
    folder: Path = field(init=False)
    hf_config: GPT2Config = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    max_model_len: int = field(init=False)

    def __post_init__(self) -> None:
        for arg in fields(self):  # each argument's own check, in the order declared
            ok, allowed = arg.metadata.get("check") or (None, "")
            if ok is not None and not ok(value := getattr(self, arg.name)):
                raise ValueError(f"{arg.name}={value!r}: must be {allowed}")
        self.torch_dtype = DTYPES[self.dtype]
        self.torch_device = check_device(self.device)
        self.folder = resolve_model(self.model)  # may download: after the checks that need no model
        self.hf_config = load_config(self.folder)
        self.max_model_len = self.hf_config.n_positions

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """A flag for every argument, with its default and help (vLLM's ``EngineArgs.add_cli_args``); a
        value its check refuses is argparse's error (one line, exit status 2), before anything loads."""
        group = parser.add_argument_group("engine arguments (EngineArgs)")
        for arg in fields(EngineArgs):
            if arg.init:
                flag = "--" + arg.name.replace("_", "-")
                group.add_argument(flag, default=arg.default, help=arg.metadata["help"], **cli_keywords(arg))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments of a parsed command line (vLLM's ``EngineArgs.from_cli_args``), checked and
        resolved: raises what ``EngineArgs`` raises."""
        return cls(**{arg.name: getattr(args, arg.name) for arg in fields(cls) if arg.init})

    @classmethod
    def make(cls, *args, **kwargs) -> EngineArgs:
        """``EngineArgs(*args, **kwargs)``, or ``args[0]`` if it is an ``EngineArgs`` already (how ``LLM``
        and ``LLMEngine`` take their arguments)."""
        if len(args) == 1 and not kwargs and isinstance(args[0], cls):
            return args[0]
        return cls(*args, **kwargs)


def cli_keywords(arg) -> dict:
    """argparse's keywords for an argument's flag: its own, with ``type`` wrapped to apply its check."""
    keywords, check = dict(arg.metadata["flag"]), arg.metadata["check"]
    convert = keywords.get("type")
    if convert is not None and check is not None:

        def checked(text: str):
            value = convert(text)
            if not check[0](value):
                raise argparse.ArgumentTypeError(f"must be {check[1]}")
            return value

        checked.__name__ = convert.__name__  # argparse names it: "invalid int value: 'x'"
        keywords["type"] = checked
    return keywords

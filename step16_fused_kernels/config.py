"""The engine's arguments in one place (vLLM's ``EngineArgs``, nano-vllm's ``Config``): each one declared
once, with its default, its check, its help text and its command-line flag; all checked, and what the
engine's parts are built from resolved, before any weights load. ``LLMEngine``, ``LLM``, the command line
and the server take them from here. A request's own checks run where the request enters
(``LLMEngine.make_sequence``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from common.weights import GPT2Config, load_config, resolve_model

from .block_manager import blocks_for
from .kv_cache import KV_CACHE_DTYPES, PagedKVCache
from .model import fused_kernels, kernels
from .spec_decode import SpeculativeConfig, check_draft

# multiprocessing=None: the engine core in a child process on CUDA? (never on a CPU, where the two processes
# would share its cores); set from the H200 measurement of LLM.generate: not faster there (step 10's README)
MULTIPROCESSING_ON_CUDA = False
# the token budget of a step with chunked prefill on, by device type (step 13's README, benchmarks/
# chunked_prefill.py): the smallest measured budget whose burst was prefilled within 1.5x of step 12's time
# (a CPU: 512 of 128-512, 1.34x; an H100: 2,048 of 512-2,048, 0.94x, where 1,024 took 1.65x)
DEFAULT_TOKEN_BUDGET = {"cuda": 2048, "cpu": 512}
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


def check_kv_cache_dtype(name: str, backend: str, device: torch.device) -> None:
    """Raise ValueError if the pool cannot be stored as ``name`` (``KV_CACHE_DTYPES``) with this attention
    backend on ``device``: fp8 through the Triton kernels needs a GPU of compute capability 8.9 or more
    (Ada, Hopper: e4m3 conversions in hardware). The torch backend converts e4m3 on any device (the CPU
    included); int8 runs everywhere."""
    if name.startswith("fp8") and backend == "triton" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={name!r}: fp8 (e4m3) in the Triton kernels needs compute capability 8.9 or "
                f"more, {device} has {capability[0]}.{capability[1]}; use 'int8' or attention_backend='torch'"
            )


def is_integer(value) -> bool:
    """Whether ``value`` is an int, and not a bool (Python's True is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


COUNT = (lambda value: is_integer(value) and value >= 1, "an integer >= 1")  # the check of a count or size
OPTIONAL_COUNT = (lambda value: value is None or COUNT[0](value), "an integer >= 1, or None for the default")
BOOL = (lambda value: isinstance(value, bool), "True or False")


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
    torch_dtype, speculative (``SpeculativeConfig`` or None), draft_folder (its draft model's snapshot, or
    None), and max_model_len: the tokens one request can reach, prompt included (the context window, or the
    pool's tokens if fewer). An argument whose default is resolved (from the model, the pool or the device)
    holds the resolved value.

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
    block_size: int = engine_arg(16, "tokens per KV-cache block", COUNT, type=int)
    num_kv_blocks: int | None = engine_arg(
        None,
        "KV-cache blocks in the pool (default: room for --max-num-seqs full context windows)",
        OPTIONAL_COUNT,
        type=int,
    )
    kv_cache_memory: int | None = engine_arg(
        None,
        "KV-cache pool size in bytes (a draft model's pool included), instead of --num-kv-blocks",
        OPTIONAL_COUNT,
        type=int,
    )
    kv_cache_dtype: str = engine_arg(
        "auto",
        "KV-cache storage: auto = the model's dtype; int8 (symmetric) or fp8 / fp8_e4m3 (e4m3): 8 bits "
        "with a float16 scale per token and head, set when the token is written (a draft model's cache "
        "stays in the model's dtype)",
        (tuple(KV_CACHE_DTYPES).__contains__, f"one of {list(KV_CACHE_DTYPES)}"),
        choices=list(KV_CACHE_DTYPES),
    )
    max_num_seqs: int = engine_arg(8, "most requests running at once", COUNT, type=int)
    max_num_batched_tokens: int | None = engine_arg(
        None,
        "the token budget of one step, decodes and prompt chunks together (default: 2,048 on CUDA, 512 on a "
        "CPU: step 13's README; at least --max-num-seqs and --block-size); with chunked prefill "
        "off, at least the context window (its default), so that any prompt is prefilled in one step",
        OPTIONAL_COUNT,
        type=int,
    )
    enable_chunked_prefill: bool = engine_arg(
        True,
        "split prompts into chunks that fit what the running requests leave of the token budget (off: "
        "step 12's scheduling, a whole prompt in one step)",
        BOOL,
        action=argparse.BooleanOptionalAction,
    )
    long_prefill_token_threshold: int | None = engine_arg(
        None,
        "with chunked prefill, the most prompt tokens one request computes in a step (default: the budget "
        "only; at most --max-num-batched-tokens)",
        OPTIONAL_COUNT,
        type=int,
    )
    attention_backend: str = engine_arg(
        "auto",
        "attention kernels: triton (step 5's, for the GPU; on a CPU they run through Triton's interpreter, "
        "~100x slower: for tests), torch (step 4's), auto = triton on CUDA, else torch",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = engine_arg(
        False,
        "capture no CUDA graphs: every step runs eagerly (on a CPU it always does); decode-only and uniform "
        "verification batches are padded to the capture ladder's sizes all the same",
        BOOL,
        action="store_true",
    )
    fused_kernels: bool | None = engine_arg(
        None,
        "run decode steps of up to 64 sequences in step 16's fused Triton kernels, five a layer (default: on "
        "with the triton attention backend on CUDA; off: step 15's path, for comparisons); needs the triton "
        "backend",
        (lambda value: value is None or isinstance(value, bool), "True, False or None"),
        action=argparse.BooleanOptionalAction,
    )
    async_scheduling: bool | None = engine_arg(
        None,
        "schedule and launch the next step before reading this one's tokens (default: on with CUDA, off on a "
        "CPU, where there is nothing to overlap with; on runs the same code path there, for tests)",
        (lambda value: value is None or isinstance(value, bool), "True, False or None"),
        action=argparse.BooleanOptionalAction,
    )
    enable_prefix_caching: bool = engine_arg(
        True,
        "keep computed full KV blocks for later requests that share their prefix (on by default, as in "
        "vLLM v1)",
        BOOL,
        action=argparse.BooleanOptionalAction,
    )
    multiprocessing: bool | None = engine_arg(
        None,
        "LLM: run the engine core in a child process (default: in process; see step 10's README for why "
        "on CUDA too); the server always runs it in a process of its own",
        (lambda value: value is None or isinstance(value, bool), "True, False or None"),
        action=argparse.BooleanOptionalAction,
    )
    data_parallel_size: int = engine_arg(
        1,
        "engine cores, each a process with its own KV pool; a new request goes to the least loaded "
        "(step 14's README); on CUDA core i runs on cuda:i with --device cuda, all on one device with "
        "--device cuda:N",
        COUNT,
        type=int,
    )
    tensor_parallel_size: int = engine_arg(
        1,
        "ranks that each hold 1/t of the model (heads, MLP columns, vocabulary) and of the KV cache, one "
        "process and device each: cuda:N .. N + t - 1 with --device cuda:N (bare cuda: N = 0), or t CPU "
        "processes (step 15's README); must divide the model's n_head",
        COUNT,
        type=int,
    )
    dp_routing: str = engine_arg(
        "load",
        "how a frontend picks the core of a new request: load = the lowest waiting * 4 + running; prefix = "
        "the core that last took a request with the same first KV block (its prefix cache may hold it), "
        "unless that core is loaded past the least loaded by more than 8 waiting requests' worth",
        (("load", "prefix").__contains__, "'load' or 'prefix'"),
        choices=["load", "prefix"],
    )
    speculative_config: dict | str | None = engine_arg(
        None,
        "speculative decoding, vLLM's fields as JSON: method ('ngram' or 'draft_model'; required unless a "
        "model is given), num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model (the draft), "
        "disable_by_batch_size (no drafts while this many requests run or wait, up to max_num_seqs; default "
        "128; null: always); steps that speculate run without async scheduling's overlap",
        (lambda value: value is None or isinstance(value, (dict, str)), "a dict, its JSON text, or None"),
        type=str,
    )
    folder: Path = field(init=False)
    hf_config: GPT2Config = field(init=False)
    torch_device: torch.device = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    speculative: SpeculativeConfig | None = field(init=False)
    draft_folder: Path | None = field(init=False)
    max_model_len: int = field(init=False)

    def __post_init__(self) -> None:
        for arg in fields(self):  # each argument's own check, in the order declared
            ok, allowed = arg.metadata.get("check") or (None, "")
            if ok is not None and not ok(value := getattr(self, arg.name)):
                raise ValueError(f"{arg.name}={value!r}: must be {allowed}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("num_kv_blocks, kv_cache_memory: give one of them, not both")
        self.torch_dtype = DTYPES[self.dtype]
        self.torch_device = check_device(self.device)
        self.speculative = SpeculativeConfig.make(self.speculative_config)
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda"
        if self.multiprocessing is None:  # a group's rank 0 lives in a process that may exit with it
            self.multiprocessing = (
                self.data_parallel_size > 1
                or self.tensor_parallel_size > 1
                or (MULTIPROCESSING_ON_CUDA and self.torch_device.type == "cuda")
            )
        self.check_data_parallel()
        self.attention_backend = choose_attention_backend(
            self.attention_backend, self.torch_device, self.torch_dtype
        )
        check_kv_cache_dtype(self.kv_cache_dtype, self.attention_backend, self.torch_device)
        self.folder = resolve_model(self.model)  # may download: after the checks that need no model
        self.hf_config = load_config(self.folder)
        self.check_tensor_parallel()
        self.check_fused_kernels()
        self.draft_folder = None
        if self.speculative is not None and self.speculative.method == "draft_model":
            self.draft_folder = check_draft(self.speculative.model, self.folder, self.hf_config)
        window = self.hf_config.n_positions
        if self.block_size > window:
            raise ValueError(
                f"block_size={self.block_size}: must be at most the context window ({window} tokens)"
            )
        if self.speculative is not None and self.speculative.num_speculative_tokens >= window:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={self.speculative.num_speculative_tokens}: must "
                f"be less than the context window ({window} tokens)"
            )

        bytes_per_block = (
            PagedKVCache.block_bytes(self.hf_config, self.block_size, self.torch_dtype, self.kv_cache_dtype)
            // self.tensor_parallel_size
        )  # a device's: its ranks' heads

        if self.draft_folder is not None:  # the draft's pool: as many blocks, in the model's dtype
            draft = load_config(self.draft_folder)
            bytes_per_block += PagedKVCache.block_bytes(draft, self.block_size, self.torch_dtype)
        if self.kv_cache_memory is not None:
            if self.kv_cache_memory < bytes_per_block:
                raise ValueError(
                    f"kv_cache_memory={self.kv_cache_memory!r}: must be an integer >= {bytes_per_block} "
                    "bytes (one block)"
                )
            self.num_kv_blocks = self.kv_cache_memory // bytes_per_block
        if self.num_kv_blocks is None:  # every request can reach the window
            self.num_kv_blocks = self.max_num_seqs * blocks_for(window, self.block_size)
        self.check_token_budget(window)
        self.max_model_len = min(window, self.num_kv_blocks * self.block_size)

    def check_data_parallel(self) -> None:
        """Several engine cores run in processes of their own (multiprocessing True), and on a bare
        ``cuda`` one per GPU: raises ValueError if either cannot be."""
        cores, dev = self.data_parallel_size, self.torch_device
        if cores > 1 and not self.multiprocessing:
            raise ValueError(
                f"data_parallel_size={cores}: each engine core runs in a process of its own, so it needs "
                "multiprocessing=True (or None)"
            )
        if cores > 1 and dev.type == "cuda" and dev.index is None and cores > torch.cuda.device_count():
            raise ValueError(
                f"data_parallel_size={cores}: device='cuda' puts core i on cuda:i, and this machine has "
                f"{torch.cuda.device_count()} CUDA device(s); give device='cuda:0' to run them all on one"
            )

    @property
    def fused_max_batch(self) -> int:
        """The most sequences of a decode step that runs fused (0: none)."""
        return fused_kernels.MAX_BATCH if self.fused_kernels else 0

    def check_fused_kernels(self) -> None:
        """Resolve ``fused_kernels`` (None: on with the triton backend on CUDA where the shapes allow); raise
        ValueError if asked for where they cannot run (``fused_kernels.unsupported``)."""
        why = "needs attention_backend='triton'" if self.attention_backend != "triton" else None
        if why is None:
            local = self.hf_config.n_embd // self.tensor_parallel_size  # a rank's columns of q, k or v
            why = fused_kernels.unsupported(local, self.hf_config.head_dim, self.kv_cache_dtype != "auto")
        if self.fused_kernels is None:
            self.fused_kernels = why is None and self.torch_device.type == "cuda"
        elif self.fused_kernels and why is not None:
            raise ValueError(f"fused_kernels=True: {why}")

    def check_tensor_parallel(self) -> None:
        """t = tensor_parallel_size ranks: t divides n_head, and t GPUs from ``cuda:N`` on (times the cores
        for a bare ``cuda``); raises ValueError naming the numbers if not."""
        t, dev, heads = self.tensor_parallel_size, self.torch_device, self.hf_config.n_head
        if t == 1:
            return
        if heads % t:
            raise ValueError(f"tensor_parallel_size={t}: must divide the model's n_head={heads}")
        if dev.type == "cuda":
            cores = self.data_parallel_size if dev.index is None else 1
            needed = (dev.index or 0) + cores * t
            if needed > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={t}: needs cuda:{dev.index or 0} .. cuda:{needed - 1} (one GPU a "
                    f"rank), and this machine has {torch.cuda.device_count()} CUDA device(s)"
                )
        if os.environ.get("MASTER_PORT") and self.data_parallel_size > 1:
            raise ValueError(
                "MASTER_PORT is one group's port: with data_parallel_size > 1 leave it unset (each core's "
                "group takes a free port)"
            )

    def core_device(self, rank: int) -> str:
        """The device of engine core ``rank`` (0 .. data_parallel_size - 1): ``cuda:(rank x t)`` for a bare
        ``cuda`` (t GPUs per core), else the device given (``cuda:N``, ``cpu``: every core on it)."""
        dev = self.torch_device
        spread = dev.type == "cuda" and dev.index is None and self.data_parallel_size > 1
        return f"cuda:{rank * self.tensor_parallel_size}" if spread else str(self.device)

    def check_token_budget(self, window: int) -> None:
        """Resolve and check the step's token budget. Chunked prefill off: at least the context window
        (the default), as in step 12. On: the device's measured default (``DEFAULT_TOKEN_BUDGET``, or
        max_num_seqs if more), at least max_num_seqs (every running request decodes in every step) and
        block_size, and a long_prefill_token_threshold (None: none) at most the budget, with chunking on."""
        budget, threshold = self.max_num_batched_tokens, self.long_prefill_token_threshold
        if not self.enable_chunked_prefill:
            if threshold is not None:
                raise ValueError(
                    f"long_prefill_token_threshold={threshold!r}: caps a prompt's chunks, so it needs "
                    "enable_chunked_prefill=True"
                )
            self.max_num_batched_tokens = budget = window if budget is None else budget
            if budget < window:
                raise ValueError(
                    f"max_num_batched_tokens={budget!r}: must be an integer >= the context window ({window}) "
                    "with enable_chunked_prefill=False"
                )
            return
        if budget is None:
            default = DEFAULT_TOKEN_BUDGET[self.torch_device.type]
            self.max_num_batched_tokens = budget = max(default, self.max_num_seqs)
        least = max(self.max_num_seqs, self.block_size)
        if budget < least:
            raise ValueError(
                f"max_num_batched_tokens={budget!r}: must be an integer >= max_num_seqs "
                f"({self.max_num_seqs}) and >= block_size ({self.block_size})"
            )
        if threshold is not None and threshold > budget:
            raise ValueError(
                f"long_prefill_token_threshold={threshold!r}: must be at most max_num_batched_tokens "
                f"({budget})"
            )

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

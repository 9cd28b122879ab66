"""The engine: ``LLMEngine`` takes requests and advances them one step at a time (vLLM's names).

Every ``step`` picks the requests to run, hands them to the ``ModelRunner`` (one forward pass, one
sampled token each), appends the tokens to their sequences, and returns the outputs that are due.
Continuous batching over a paged KV cache: every step asks the ``Scheduler`` which requests run,
the ``ModelRunner`` runs them as one flattened batch (whole prompts for requests that start, one token
for requests that are decoding), and finished requests are retired at once, giving their cache blocks
back. Requests join and leave between any two steps, so there is neither padding nor a finished row
that keeps computing, and the KV cache holds only the blocks that requests actually use.
``LLM`` (llm.py) sits on top.
"""

from __future__ import annotations

import operator

import torch

from common.tokenizer import Tokenizer
from common.weights import resolve_model

from .block_manager import BlockManager, blocks_for
from .kv_cache import PagedKVCache
from .model import GPT, kernels
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerStats
from .sequence import RequestOutput, Sequence

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


def as_token_ids(ids) -> list[int]:
    """A prompt given as token ids, as a list of ints; numpy and torch integers are accepted, bools are not.
    Raises ValueError for anything else."""
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids: each prompt must be a list of integer token ids") from None


class LLMEngine:
    """The generation engine, driven one step at a time.

    model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...), or a local snapshot
    folder (see ``common.weights.resolve_model``). device: a torch device string. dtype: "float32",
    "float16" or "bfloat16". block_size: tokens per KV-cache block (at most the context window).
    num_kv_blocks: blocks in the pool; or kv_cache_memory: a pool budget in bytes; default: room for
    max_num_seqs sequences of the full context window. max_num_seqs: most requests running at once.
    max_num_batched_tokens: most tokens in one forward pass (default and minimum: the context window,
    so that any request, also one preempted late, can be prefilled in one step). attention_backend:
    "triton" (the kernels of kernels.py: CUDA, or Triton's interpreter on the CPU for tests), "torch"
    (step 4's plain-PyTorch attention) or "auto": Triton on a CUDA device, torch elsewhere.

    A request longer than the pool holds ends with finish_reason "length" when the pool is full, as at
    the context window. Raises ValueError on a bad argument, or a pool larger than the free memory;
    ConnectionError if a Hub model cannot be fetched.
    """

    def __init__(
        self,
        model: str = "demo",
        device: str = "cpu",
        dtype: str = "float32",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int | None = None,
        attention_backend: str = "auto",
    ):
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("num_kv_blocks, kv_cache_memory: give one of them, not both")
        self.device = check_device(device)
        self.dtype = DTYPES[dtype]
        self.attention_backend = choose_attention_backend(attention_backend, self.device, self.dtype)
        folder = resolve_model(model)
        self.tokenizer = Tokenizer(folder)
        self.model = GPT.from_pretrained(str(folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        window = self.config.n_positions
        if block_size > window:
            raise ValueError(f"block_size={block_size}: must be at most the context window ({window} tokens)")

        bytes_per_block = PagedKVCache.block_bytes(self.config, block_size, self.dtype)
        if kv_cache_memory is not None:
            if (
                not isinstance(kv_cache_memory, int)
                or isinstance(kv_cache_memory, bool)
                or kv_cache_memory < bytes_per_block
            ):
                raise ValueError(
                    f"kv_cache_memory={kv_cache_memory!r}: must be an integer >= {bytes_per_block} bytes (one block)"
                )
            num_kv_blocks = kv_cache_memory // bytes_per_block
        if num_kv_blocks is None:
            num_kv_blocks = max_num_seqs * blocks_for(
                window, block_size
            )  # every request can reach the window
        if not isinstance(num_kv_blocks, int) or isinstance(num_kv_blocks, bool) or num_kv_blocks < 1:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks!r}: must be an integer >= 1 "
                f"(a block of {block_size} tokens takes {bytes_per_block} bytes)"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = window
        if (
            not isinstance(max_num_batched_tokens, int)
            or isinstance(max_num_batched_tokens, bool)
            or max_num_batched_tokens < window
        ):
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens!r}: must be an integer >= the context window ({window})"
            )

        self.kv_cache = PagedKVCache(self.config, num_kv_blocks, block_size, self.device, self.dtype)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.max_model_len = min(
            window, num_kv_blocks * block_size
        )  # tokens one request can reach, prompt included
        self.model_runner = ModelRunner(
            self.model, self.tokenizer, self.device, self.kv_cache, self.block_manager, self.attention_backend
        )
        if (
            self.attention_backend == "triton" and self.device.type == "cuda"
        ):  # compile now, not during a request
            kernels.warm_up(self.config.n_head, self.config.head_dim, block_size, self.dtype, self.device)
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.aborted: list[RequestOutput] = []  # final outputs of aborted requests, returned by the next step

    def add_request(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Queue a request; ``prompt`` is a text or a list of token ids. Raises ValueError (see
        ``make_sequence``) before the request enters the queue."""
        self.add_sequence(self.make_sequence(request_id, prompt, sampling_params))

    def make_sequence(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> Sequence:
        """Tokenize and check one request, the one place where requests are validated; queues nothing.

        Raises ValueError if the id is in use, the prompt or the parameters are bad, or the request can
        never run (no room to generate in the context window).
        """
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: must be a string not used by an unfinished request")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, as_token_ids(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        vocab, window = self.config.vocab_size, self.config.n_positions
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if len(ids) == 0:
            raise ValueError("prompt is empty; give at least one token")
        if not all(0 <= t < vocab for t in ids):
            field = (
                "prompt" if text is not None else "prompt_token_ids"
            )  # a text can hold added tokens the model lacks
            raise ValueError(f"{field}: every token id must be in the model's vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room to generate: at most {self.max_model_len - 1} prompt "
                f"tokens fit (context window: {window} tokens)"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: every id must be < vocab_size={vocab}")
        return Sequence(request_id, text, ids, params, self.tokenizer, self.max_model_len, self.device)

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by ``make_sequence``."""
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request, waiting or running, and free its blocks at once; unknown or finished ids are
        ignored. Its final output (finish_reason "abort") comes out of the next ``step``."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        seq.finish("abort")
        self.aborted.append(seq.output())

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (an aborted one's last output may still be due)."""
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def stats(self) -> SchedulerStats:
        """Requests running and waiting, KV-cache blocks in use, preemptions, tokens in the last step."""
        return self.scheduler.make_stats()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, one forward pass over the mixed batch, sample, retire the finished.

        Returns the outputs due in this step (per each request's ``output_kind``).
        """
        outputs, self.aborted = self.aborted, []
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return outputs
        token_ids, logprobs = self.model_runner.run(scheduled)
        for seq, token_id, token_logprobs in zip(scheduled.seqs, token_ids, logprobs):
            seq.append(token_id, token_logprobs)
            if (out := seq.output()) is not None:
                outputs.append(out)
            if seq.finished:  # leaves the batch now; its blocks are free for the next step
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
        return outputs

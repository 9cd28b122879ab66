"""The engine: ``LLMEngine`` takes requests and advances them one step at a time (vLLM's names).

Continuous batching over a paged KV cache: every ``step`` asks the ``Scheduler`` which requests run, the
``ModelRunner`` runs them as one flat batch, finished requests retire at once. ``LLM`` (llm.py) sits on top.

Async scheduling (vLLM's ``async_scheduling``, SGLang's overlap scheduler): ``step`` N launches step N, then
processes step N-1's tokens while the GPU runs step N. A sequence of step N-1 counts its token in flight (a
placeholder) that its decode lane takes on the device; no position past its max_tokens-th token is scheduled,
one that a stop ends at N-1 may get one (its token dropped). A step after a penalised one waits for it.
"""

from __future__ import annotations

import contextlib
import operator
import sys

from common.tokenizer import Tokenizer

from .block_manager import BlockManager
from .config import EngineArgs
from .kv_cache import PagedKVCache
from .model import GPT, kernels
from .model_runner import AsyncModelRunnerOutput, ModelRunner
from .sampling_params import SamplingParams, type_name
from .scheduler import Scheduler, SchedulerStats
from .sequence import RequestOutput, Sequence


def as_token_ids(ids) -> list[int]:
    """A prompt given as token ids, as a list of ints; numpy and torch integers are accepted, bools are not.
    Raises ValueError for anything else."""
    if type(ids) is list and set(map(type, ids)) <= {int}:  # plain ints (a bool's type is bool): a copy
        return ids[:]
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids: each prompt must be a list of integer token ids") from None


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """Raises ValueError naming ``field``, the first id of ``ids`` outside the vocabulary and its range."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"{field}: token id {bad} is out of range: the vocabulary has {vocab_size} tokens "
            f"(ids 0..{vocab_size - 1})"
        )


class LLMEngine:
    """The generation engine, driven one step at a time.

    attention_backend: "triton" or "torch", as ``EngineArgs`` resolved it; the Triton kernels are compiled
    here, on a CUDA device, before the first request. Then, on a CUDA device and unless ``enforce_eager``,
    the decode step is captured in CUDA graphs (``ModelRunner.capture_cudagraphs``), printed on stderr.

    async_scheduling: overlap the host's work with the GPU's (the module's docstring): True, False, or None
    (on for a CUDA device); with False every step waits for its own tokens, as in step 7.

    A request whose prompt and max_tokens do not fit in max_model_len (the context window, or the pool's
    tokens if fewer) is refused when it is made (``check_length``), as one that would pass the window is.

    The arguments are those of ``EngineArgs`` (config.py), by name or in its order, or one ``EngineArgs``
    already made (the command line's); it checks them before any weights load:
    raises ValueError on a bad argument; ConnectionError if a Hub model cannot be fetched. Raises
    ValueError, once the weights are loaded, if the KV-cache pool does not fit in the free memory.
    """

    def __init__(self, *engine_args, **kwargs):
        self.args = args = EngineArgs.make(*engine_args, **kwargs)
        self.async_scheduling = args.async_scheduling
        self.device, self.dtype = args.torch_device, args.torch_dtype
        self.attention_backend = args.attention_backend
        self.tokenizer = Tokenizer(args.folder)
        self.model = GPT.from_pretrained(str(args.folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        self.max_model_len = args.max_model_len  # tokens one request can reach, prompt included
        # one block more than the block manager hands out: the scratch block, which padding lanes write to
        self.kv_cache = PagedKVCache(
            self.config, args.num_kv_blocks + 1, args.block_size, self.device, self.dtype
        )
        self.block_manager = BlockManager(args.num_kv_blocks, args.block_size)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.model_runner = ModelRunner(
            self.model,
            self.tokenizer,
            self.device,
            self.kv_cache,
            self.block_manager,
            self.attention_backend,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            scratch_block=args.num_kv_blocks,
        )
        if self.attention_backend == "triton" and self.device.type == "cuda":  # compile before any request
            kernels.warm_up(
                self.config.n_head, self.config.head_dim, args.block_size, self.dtype, self.device
            )
        # the decode step in CUDA graphs, after the warm-up: no compiling in a capture
        if self.device.type == "cuda" and not args.enforce_eager:
            stats = self.model_runner.capture_cudagraphs()
            print(
                f"captured {len(stats.sizes)} CUDA graphs (batch sizes {', '.join(map(str, stats.sizes))}) "
                f"in {stats.seconds:.2f} s, {stats.memory_bytes / 2**20:.0f} MiB of GPU memory",
                file=sys.stderr,
            )
        self.requests: dict[str, Sequence] = {}  # unfinished requests by id
        self.aborted: list[RequestOutput] = []  # final outputs of aborted requests, returned by the next step
        self.in_flight: AsyncModelRunnerOutput | None = None  # the step launched, its tokens not yet read

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
        never run (its prompt and max_tokens do not fit in max_model_len: ``check_length``).
        """
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id={request_id!r}: must be a string not used by an unfinished request")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, as_token_ids(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        vocab = self.config.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type_name(params)}")
        field = "prompt" if text is not None else "prompt_token_ids"
        if len(ids) == 0:
            raise ValueError(f"{field} is empty; give at least one token")
        check_token_ids(ids, vocab, field)  # a text can hold added tokens the model lacks
        self.check_length(len(ids), params.max_tokens)
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        return Sequence(request_id, text, ids, params, self.tokenizer, self.max_model_len, self.device)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """The one rule for a request's length, for ``LLM`` and the server alike (vLLM's server's): the
        prompt leaves room for a token, and the prompt plus ``max_tokens`` (None: what the prompt leaves)
        fit in ``max_model_len``. A request that does not fit is refused, not cut short: raises ValueError
        naming both numbers and the limit."""
        window = self.config.n_positions
        bound = f"context window: {window} tokens"
        if self.max_model_len < window:
            bound = f"the KV-cache pool holds {self.max_model_len} tokens"
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens leaves no room to generate: at most "
                f"{self.max_model_len - 1} prompt tokens fit ({bound})"
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens}: the request needs {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} in the completion), more than "
                f"max_model_len={self.max_model_len} ({bound})"
            )

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by ``make_sequence``."""
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request, waiting or running, and free its blocks at once; unknown or finished ids are
        ignored. Its final output (finish_reason "abort") comes out of the next ``step``; a token of it still
        in flight is dropped."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        seq.finish("abort")
        self.aborted.append(seq.output())

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (an aborted one's last output may still be due), or a
        step is in flight (the next ``step`` reads its tokens)."""
        return bool(self.requests or self.aborted) or self.in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def stats(self) -> SchedulerStats:
        """Requests running and waiting, KV-cache blocks in use, preemptions, tokens in the last step."""
        return self.scheduler.make_stats()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, launch one forward pass over the mixed batch and its sampling, then
        process the tokens of the step before (async scheduling) or of this one (serial): append them,
        stream them, retire the finished.

        Returns the outputs due (per each request's ``output_kind``): with async scheduling, those of the
        step launched by the previous call; a call with nothing to schedule only reads the step in flight.
        """
        outputs, self.aborted = self.aborted, []
        if self.in_flight is not None and any(uses_penalty(seq.params) for seq in self.in_flight.seqs):
            outputs += self.process_outputs(self.in_flight)  # a penalty needs every token on the host
            self.in_flight = None
        with self.placeholders():  # the in-flight tokens count in their sequences' lengths
            scheduled = self.scheduler.schedule()
            launched = self.model_runner.launch(scheduled) if scheduled.seqs else None
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:  # the GPU runs the step just launched meanwhile
            outputs += self.process_outputs(previous)
        if not self.async_scheduling and self.in_flight is not None:  # serial: wait for this step's tokens
            outputs += self.process_outputs(self.in_flight)
            self.in_flight = None
        return outputs

    @contextlib.contextmanager
    def placeholders(self):
        """While scheduling and preparing a step: each unfinished sequence of the step in flight holds a
        placeholder (-1) for its token in flight at the end of ``token_ids``, so that its length, hence its
        position, slot and blocks, include that token. Only decodes hold one (a sequence preempted in this
        step is not readmitted in it), and a decode's input id is gathered on the device (input_batch.py):
        the placeholder's value is never read (an id of -1 would fail the embedding, loudly)."""
        seqs = [] if self.in_flight is None else [s for s in self.in_flight.seqs if not s.finished]
        for seq in seqs:
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
        try:
            yield
        finally:
            for seq in seqs:
                seq.token_ids.pop()

    def process_outputs(self, launched: AsyncModelRunnerOutput) -> list[RequestOutput]:
        """Wait for a launched step's tokens, append them to their sequences, retire the finished ones;
        returns the outputs due. A sequence that finished (or was aborted) after that step was launched
        gets nothing: its token is one position past its end."""
        outputs = []
        for seq, token_id, token_logprobs in zip(launched.seqs, *launched.get_output()):
            if seq.finished:
                continue
            seq.append(token_id, token_logprobs)
            if (out := seq.output()) is not None:
                outputs.append(out)
            if seq.finished:  # leaves the batch now; its blocks are free for the next step
                # Its blocks may still be written by the step in flight; a later step that reuses them is
                # queued behind it on the same stream, so it reads and writes them only after that one.
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
        return outputs


PLACEHOLDER_TOKEN_ID = -1  # a token in flight, in ``Sequence.token_ids`` while a step is scheduled


def uses_penalty(params: SamplingParams) -> bool:
    """Whether the sampler reads the request's output ids (a repetition, presence or frequency penalty)."""
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )

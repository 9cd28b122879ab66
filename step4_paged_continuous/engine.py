"""The generation engine: `LLMEngine` (add requests, step, abort), the `LLM` wrapper, the requests it tracks.

This step's loop keeps a KV cache: the prompt goes through the model once (prefill), filling the cache,
and every later forward pass takes only the newest token (decode), reading the others' keys and values
from the cache. Generating n tokens after a prompt of p tokens costs p + n token positions instead of
step 1's p + (p+1) + ... + (p+n-1); each decode step is one token's work plus attention over the cache.

Continuous batching over a paged KV cache: every ``LLMEngine.step`` asks the ``Scheduler`` which requests
run, builds one flattened batch of their new tokens (whole prompts for requests that start, one token for
requests that are decoding), runs the model once, samples one token per request, and retires finished
requests at once, giving their cache blocks back. Requests join and leave between any two steps, so
there is neither padding nor a finished row that keeps computing (both waste counters stay at 0), and
the KV cache holds only the blocks that requests actually use.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.tokenizer import IncrementalDetokenizer, Tokenizer
from common.weights import resolve_model

from .block_manager import BlockManager
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, SchedulerOutput

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


def as_token_ids(ids) -> list[int]:
    """A prompt given as token ids, as a list of ints; numpy and torch integers are accepted, bools are not.
    Raises ValueError for anything else."""
    try:
        if isinstance(ids, (str, bytes)) or any(isinstance(t, bool) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids: each prompt must be a list of integer token ids") from None


@dataclass
class RequestMetrics:
    """When things happened to one request, in seconds of ``time.perf_counter()``.

    ttft_s: time to first token (arrival -> first token sampled); token_times: when each output token
    was sampled; decode_latencies_s: the gaps between consecutive tokens (inter-token latency, ITL).
    padding_tokens: left-padding positions computed in this request's batch row; wasted_tokens:
    positions its row computed after the request had finished (the batch was still running). Both stay
    0 from step 4 on: continuous batching has no padding and retires a request as soon as it finishes.
    """

    arrival_time: float
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    padding_tokens: int = 0
    wasted_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def decode_latencies_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first one, per second of decoding; None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


@dataclass
class RequestOutput:
    """What a request has produced so far (or in all, once ``finish_reason`` is set).

    text: the output text (stop strings excluded); token_ids: the output token ids (a stop token
    included); delta: the text added since the previous output of this request (for streaming);
    finish_reason: None while running, "stop" (eos, a stop token or a stop string) or "length"
    (max_tokens or the context window).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    delta: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """One request in flight: its tokens, its sampling state and its stopping rules.

    ``append`` takes each sampled token and decides whether the request is done. Stop strings are
    matched on the text, also when one spans several tokens: text that could be the beginning of a
    stop string is held back until it is known not to be one, so a stop string never reaches the
    output, not even in a stream.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        max_model_len: int,
        device: torch.device,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_len = min(max_model_len, len(prompt_token_ids) + params.max_tokens)  # tokens, prompt included
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {tokenizer.eos_token_id})
        self.generator = torch.Generator(device=device)
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.text = ""  # released output text
        self.pending = ""  # decoded text held back: it may be the start of a stop string
        self.finish_reason: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output, the sequence the model sees."""
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int) -> str:
        """Add a sampled token; return the text that can be shown now (possibly ""); maybe finish."""
        self.output_token_ids.append(token_id)
        self.metrics.token_times.append(time.perf_counter())
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
            self.pending += self.detokenizer.flush()
        else:
            self.pending += self.detokenizer.push(token_id)
            cut = self._stop_string_index()
            if cut is not None:
                self.pending = self.pending[:cut]
                self.finish_reason = "stop"
            elif len(self) >= self.max_len:
                self.finish_reason = "length"
                self.pending += self.detokenizer.flush()
        if self.finished:
            self.metrics.finished_time = time.perf_counter()
            released, self.pending = self.pending, ""
        else:
            held = self._stop_prefix_length()
            released, self.pending = self.pending[: len(self.pending) - held], self.pending[len(self.pending) - held :]
        self.text += released
        return released

    def _stop_string_index(self) -> int | None:
        """Where the earliest stop string starts in the held-back text, or None."""
        hits = [i for s in self.params.stop if (i := self.pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the held-back text that begins some stop string."""
        longest = 0
        for s in self.params.stop:
            for n in range(min(len(s) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def output(self, delta: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            delta=delta,
        )


@dataclass
class EngineStats:
    """The engine after a step: requests running and waiting, KV-cache blocks in use out of the pool,
    preemptions since the start, and tokens in the last forward pass."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_batched_tokens: int


class LLMEngine:
    """The serving engine, driven one step at a time (names as in vLLM); ``LLM`` and a server sit on top.

    model, device, dtype: as for ``LLM``. block_size: tokens per KV-cache block. num_kv_blocks: blocks
    in the pool; or kv_cache_memory: a pool budget in bytes; default: room for max_num_seqs sequences
    of the full context window. max_num_seqs: most requests running at once. max_num_batched_tokens:
    most tokens in one forward pass (default and minimum: the context window, so that any request,
    also one preempted late, can be prefilled in one step).

    A request longer than the pool holds ends with finish_reason "length" when the pool is full, as at
    the context window. Raises ValueError on a bad argument; ConnectionError if a Hub model cannot be fetched.
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
    ):
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {sorted(DTYPES)}")
        self.device = check_device(device)
        folder = resolve_model(model)
        self.tokenizer = Tokenizer(folder)
        self.dtype = DTYPES[dtype]
        self.model = GPT.from_pretrained(str(folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        window = self.config.n_positions

        bytes_per_block = PagedKVCache.block_bytes(self.config, block_size, self.dtype)
        if num_kv_blocks is not None and kv_cache_memory is not None:
            raise ValueError("num_kv_blocks, kv_cache_memory: give one of them, not both")
        if kv_cache_memory is not None:
            if not isinstance(kv_cache_memory, int) or kv_cache_memory < bytes_per_block:
                raise ValueError(f"kv_cache_memory={kv_cache_memory!r}: must be an integer >= {bytes_per_block} bytes (one block)")
            num_kv_blocks = kv_cache_memory // bytes_per_block
        if num_kv_blocks is None:
            num_kv_blocks = max_num_seqs * -(-window // block_size)  # every request can reach the window
        if not isinstance(num_kv_blocks, int) or isinstance(num_kv_blocks, bool) or num_kv_blocks < 1:
            raise ValueError(
                f"num_kv_blocks={num_kv_blocks!r}: must be an integer >= 1 "
                f"(a block of {block_size} tokens takes {bytes_per_block} bytes)"
            )
        if max_num_batched_tokens is None:
            max_num_batched_tokens = window
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < window:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}: must be an integer >= the context window ({window})")

        self.kv_cache = PagedKVCache(self.config, num_kv_blocks, block_size, self.device, self.dtype)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.max_model_len = min(window, num_kv_blocks * block_size)  # tokens one request can reach
        self.sequences: dict[str, Sequence] = {}  # unfinished requests by id
        self.last_num_batched_tokens = 0

    def add_request(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> None:
        """Queue a request; ``prompt`` is a text or a list of token ids.

        Raises ValueError, before the request enters the queue, if the id is in use, the prompt or the
        parameters are bad, or the request can never fit (prompt + 1 token over the pool or the window).
        """
        if not isinstance(request_id, str) or request_id in self.sequences:
            raise ValueError(f"request_id={request_id!r}: must be a string not used by an unfinished request")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, as_token_ids(prompt)
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.check_request(ids, params)
        seq = Sequence(request_id, text, ids, params, self.tokenizer, self.max_model_len, self.device)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if a request is malformed or can never run; nothing is computed."""
        vocab, window = self.config.vocab_size, self.config.n_positions
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if len(ids) == 0:
            raise ValueError("prompt: is empty; give at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids: every id must be an integer in [0, {vocab})")
        if len(ids) >= window:
            raise ValueError(
                f"prompt: {len(ids)} tokens leaves no room to generate in the context window of {window} "
                f"tokens (at most {window - 1} prompt tokens)"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens + 1 do not fit in the KV cache of {self.block_manager.num_blocks} "
                f"blocks x {self.block_manager.block_size} tokens"
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: every id must be < vocab_size={vocab}")

    def abort_request(self, request_id: str) -> None:
        """Drop a request, waiting or running, and free its blocks at once; unknown ids are ignored."""
        if self.scheduler.abort(request_id) is not None:
            del self.sequences[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.sequences)

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_batched_tokens=self.last_num_batched_tokens,
        )

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, one forward pass over the mixed batch, sample, retire the finished.

        Returns an output (with its ``delta``) for every request that got a new token in this step.
        """
        scheduled = self.scheduler.schedule()
        batch = scheduled.prefills + scheduled.decodes
        self.last_num_batched_tokens = scheduled.num_batched_tokens
        if not batch:
            return []
        input_ids, positions, meta = self._prepare_inputs(scheduled)
        logits = self.model(input_ids, positions, self.kv_cache, meta)  # [S, V], one row per sequence
        outputs = []
        for row, seq in enumerate(batch):
            token_id = sample(logits[row], seq.params, seq.generator, seq.token_ids)
            delta = seq.append(token_id)
            if seq.finished:  # leaves the batch now; its blocks are free for the next step
                self.scheduler.finish(seq)
                del self.sequences[seq.request_id]
            outputs.append(seq.output(delta))
        return outputs

    def _prepare_inputs(self, scheduled: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step's sequences into one batch: token ids, positions and slot mapping [N] each,
        plus where each sequence starts and, for the decodes, their lengths and block tables."""
        blocks = self.block_manager
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        for seq in scheduled.prefills:  # every token of the sequence (prompt, and output if it was preempted)
            new = range(len(seq))
            token_ids += seq.token_ids
            positions += new
            slots += [blocks.slot(seq.request_id, p) for p in new]
            query_start_loc.append(query_start_loc[-1] + len(new))
        for seq in scheduled.decodes:  # only the newest token, at position len - 1
            token_ids.append(seq.token_ids[-1])
            positions.append(len(seq) - 1)
            slots.append(blocks.slot(seq.request_id, len(seq) - 1))
            query_start_loc.append(query_start_loc[-1] + 1)
        tables = [blocks.block_tables[seq.request_id] for seq in scheduled.decodes]
        width = max((len(t) for t in tables), default=1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            query_start_loc=query_start_loc,
            num_prefills=len(scheduled.prefills),
            decode_seq_lens=torch.tensor([len(seq) for seq in scheduled.decodes], dtype=torch.long, device=self.device),
            decode_block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=self.device
            ).view(len(tables), width),
        )
        return torch.tensor(token_ids, device=self.device), torch.tensor(positions, device=self.device), meta


class LLM:
    """Generate text with a GPT-2 model: the offline entry point, named as in vLLM.

    model: "demo" (bundled), a Hub id or alias ("gpt2", "gpt2-medium", ...), or a local snapshot
    folder (see ``common.weights.resolve_model``). device: a torch device string. dtype: "float32",
    "float16" or "bfloat16". Further keyword arguments go to ``LLMEngine`` (block_size, num_kv_blocks,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens).

    Raises ValueError on a bad model, device, dtype or engine argument; ConnectionError if a Hub model
    cannot be fetched.
    """

    def __init__(self, model: str = "demo", device: str = "cpu", dtype: str = "float32", **engine_args):
        self.engine = LLMEngine(model, device, dtype, **engine_args)
        self.tokenizer = self.engine.tokenizer
        self.model = self.engine.model
        self.config = self.engine.config
        self._request_ids = itertools.count()
        self._outputs: dict[str, deque[RequestOutput]] = {}  # outputs not yet read, per request of this LLM

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[list[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt (text, or token ids); outputs in input order.

        All requests are queued at once and the engine steps until every one has finished.
        sampling_params: one for all prompts, or one per prompt; default ``SamplingParams()``.
        Every request is validated before any compute; a bad one raises ValueError. If anything
        interrupts the loop, this call's unfinished requests are aborted, so that none is left behind.
        """
        request_ids = self._add(self._requests(prompts, sampling_params, prompt_token_ids))
        outputs = []
        try:
            for request_id in request_ids:
                last = None  # stays None only if the request was aborted through self.engine meanwhile
                for last in self._follow(request_id):  # steps the engine: every request advances together
                    pass
                outputs.append(last)
        finally:
            for request_id in request_ids:
                self._stop(request_id)
        return outputs

    def stream(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion piece by piece, as it is generated.

        The request is validated when ``stream`` is called (ValueError), before the first token.
        Closing the stream (or leaving a loop over it early) aborts the request and frees its blocks.
        """
        return _text_deltas(self.stream_outputs(prompt, sampling_params))

    def stream_outputs(self, prompt: str, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Like ``stream``, but yield a ``RequestOutput`` after every token (with ``delta``, metrics).

        The request enters the engine when the first output is asked for, and leaves it (its blocks freed)
        when the stream ends or is closed. Several streams of one ``LLM`` may be read in any interleaving.
        """
        return self._stream(self._requests(prompt, sampling_params, None))

    def _stream(self, requests: list[tuple]) -> Iterator[RequestOutput]:
        (request_id,) = self._add(requests)
        try:
            yield from self._follow(request_id)
        finally:
            self._stop(request_id)

    def _follow(self, request_id: str) -> Iterator[RequestOutput]:
        """The outputs of one request, in order; steps the engine whenever none is waiting. Every step's
        outputs go to their own request's queue, so readers of other requests lose nothing."""
        queue = self._outputs[request_id]
        while True:
            while not queue:
                if request_id not in self.engine.sequences:  # aborted from outside
                    return
                for out in self.engine.step():
                    if out.request_id in self._outputs:
                        self._outputs[out.request_id].append(out)
            out = queue.popleft()
            yield out
            if out.finished:
                return

    def _stop(self, request_id: str) -> None:
        self._outputs.pop(request_id, None)
        self.engine.abort_request(request_id)  # nothing happens if it has finished

    def _requests(self, prompts, sampling_params, prompt_token_ids) -> list[tuple]:
        """(prompt, token ids, params) of every request, all validated (ValueError) before any is queued."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass either prompts or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompts: must be strings (use prompt_token_ids= for token ids)")
            token_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            if prompt_token_ids and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
                prompt_token_ids = [prompt_token_ids]  # one prompt given as a flat list
            token_lists = [as_token_ids(ids) for ids in prompt_token_ids]
            prompts = token_lists
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(token_lists)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params: expected SamplingParams or a list of them, got {type(sampling_params).__name__}")
        if len(sampling_params) != len(token_lists):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(token_lists)} prompts")
        for ids, params in zip(token_lists, sampling_params):
            self.engine.check_request(ids, params)
        return list(zip(prompts, token_lists, sampling_params))

    def _add(self, requests: list[tuple]) -> list[str]:
        request_ids = []
        for prompt, ids, params in requests:
            request_id = str(next(self._request_ids))
            self.engine.add_request(request_id, prompt, params)
            self._outputs[request_id] = deque()
            request_ids.append(request_id)
        return request_ids


def _text_deltas(outputs: Iterator[RequestOutput]) -> Iterator[str]:
    with contextlib.closing(outputs):  # closing this stream closes the request's own at once, not at garbage collection
        for out in outputs:
            if out.delta:
                yield out.delta

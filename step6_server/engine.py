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

from common.tokenizer import Tokenizer

from .block_manager import BlockManager
from .config import EngineArgs
from .kv_cache import PagedKVCache
from .model import GPT, kernels
from .model_runner import ModelRunner
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
    here, on a CUDA device, before the first request.

    A request whose prompt and max_tokens do not fit in max_model_len (the context window, or the pool's
    tokens if fewer) is refused when it is made (``check_length``), as one that would pass the window is.

    The arguments are those of ``EngineArgs`` (config.py), by name or in its order, or one ``EngineArgs``
    already made (the command line's); it checks them before any weights load:
    raises ValueError on a bad argument; ConnectionError if a Hub model cannot be fetched. Raises
    ValueError, once the weights are loaded, if the KV-cache pool does not fit in the free memory.
    """

    def __init__(self, *engine_args, **kwargs):
        self.args = args = EngineArgs.make(*engine_args, **kwargs)
        self.device, self.dtype = args.torch_device, args.torch_dtype
        self.attention_backend = args.attention_backend
        self.tokenizer = Tokenizer(args.folder)
        self.model = GPT.from_pretrained(str(args.folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        self.max_model_len = args.max_model_len  # tokens one request can reach, prompt included
        self.kv_cache = PagedKVCache(
            self.config, args.num_kv_blocks, args.block_size, self.device, self.dtype
        )
        self.block_manager = BlockManager(args.num_kv_blocks, args.block_size)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.model_runner = ModelRunner(
            self.model, self.tokenizer, self.device, self.kv_cache, self.block_manager, self.attention_backend
        )
        if self.attention_backend == "triton" and self.device.type == "cuda":  # compile before any request
            kernels.warm_up(
                self.config.n_head, self.config.head_dim, args.block_size, self.dtype, self.device
            )
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
        ignored. Its final output (finish_reason "abort") comes out of the next ``step``."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.abort(seq)
        seq.finish("abort")
        self.aborted.append(seq.output())

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (an aborted one's last output may still be due)."""
        return bool(self.requests or self.aborted)

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

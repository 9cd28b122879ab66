"""The engine: ``LLMEngine`` runs requests one step at a time (vLLM's name).

Every ``step`` hands the running sequences to the ``ModelRunner`` (one forward pass, one sampled token
each) and appends the tokens to their sequences. This step runs one request at a time, in the order
given, until it finishes, with a KV cache of its own (model_runner.py); ``LLM`` (llm.py) sits on top.
Requests that come and go at any step (vLLM's ``add_request`` / ``step`` / ``abort_request``) arrive
with continuous batching, in step 4.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator

from common.tokenizer import Tokenizer

from .config import EngineArgs
from .kv_cache import KVCache
from .model import GPT
from .model_runner import ModelRunner
from .sampling_params import SamplingParams, type_name
from .sequence import Sequence


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
    """The generation engine: ``run`` takes sequences made by ``make_sequence`` to their ends.

    The arguments are those of ``EngineArgs`` (config.py), by name or in its order, or one ``EngineArgs``
    already made (the command line's); it checks them before any weights load:
    raises ValueError on a bad argument; ConnectionError if a Hub model cannot be fetched.
    """

    def __init__(self, *engine_args, **kwargs):
        self.args = args = EngineArgs.make(*engine_args, **kwargs)
        self.device, self.dtype = args.torch_device, args.torch_dtype
        self.tokenizer = Tokenizer(args.folder)
        self.model = GPT.from_pretrained(str(args.folder), device=self.device, dtype=self.dtype)
        self.config = self.model.config
        self.max_model_len = args.max_model_len  # tokens one request can reach, prompt included
        self.model_runner = ModelRunner(self.model, self.tokenizer, self.device)

    def make_sequence(
        self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> Sequence:
        """Tokenize and check one request, the one place where requests are validated; runs nothing.

        Raises ValueError if the prompt or the parameters are bad, or the request can never run (no room
        to generate in the context window).
        """
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

    def run(self, seqs: list[Sequence]) -> Iterator[None]:
        """Take ``seqs`` to their ends, one at a time in the given order. A generator: each item read is one
        step (the running sequence's new token appended), so a caller can stream it; closing it stops it.
        The first item raises ValueError if a sequence is given twice or has already run."""
        if len({id(seq) for seq in seqs}) < len(seqs) or any(seq.output_token_ids for seq in seqs):
            raise ValueError("run: every sequence must be new (from make_sequence) and given once")
        for seq in seqs:
            kv_cache = self.model_runner.allocate_kv_cache([seq])
            while not seq.finished:
                self.step([seq], kv_cache)
                yield

    def step(self, seqs: list[Sequence], kv_cache: KVCache) -> None:
        """One iteration: the sequences' new tokens through the model (``kv_cache`` holds the others'
        keys and values), one token sampled and appended to each."""
        token_ids, logprobs = self.model_runner.run(seqs, kv_cache)
        for seq, token_id, token_logprobs in zip(seqs, token_ids, logprobs):
            seq.append(token_id, token_logprobs)

"""A request's entrance checks, in the frontend (vLLM's ``Processor``): a prompt -> checked token ids.

The engine core runs in another process, so a bad request is refused here, as a ValueError before anything
is sent to it, with the same words in ``LLM`` and the server. The core applies the same checks again, as
its own word (``LLMEngine.make_sequence`` holds a ``Processor`` too). The limits are the core's; in the
frontend they come from its ``EngineCoreReady``. Source: vLLM's ``vllm/v1/engine/processor.py``.
"""

from __future__ import annotations

import operator

from common.tokenizer import Tokenizer

from .messages import EngineCoreReady
from .sampling_params import SamplingParams, type_name


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


class Processor:
    """Tokenizes and checks requests against the engine's limits: the vocabulary, the context window
    (``window``), ``max_model_len`` (the tokens one request can reach) and ``max_num_seqs``."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, window: int, max_model_len: int, max_num_seqs: int
    ):
        self.tokenizer = tokenizer
        self.vocab_size, self.window = vocab_size, window
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs

    @classmethod
    def for_core(cls, tokenizer: Tokenizer, ready: EngineCoreReady) -> Processor:
        """The frontend's processor: the limits of the engine core that sent ``ready``."""
        config = ready.hf_config
        return cls(tokenizer, config.vocab_size, config.n_positions, ready.max_model_len, ready.max_num_seqs)

    def process(
        self, prompt: str | list[int], sampling_params: SamplingParams | None
    ) -> tuple[str | None, list[int], SamplingParams]:
        """(the prompt's text or None, its token ids, the parameters: ``SamplingParams()`` for None).

        Raises ValueError if the prompt or the parameters are bad, or the request can never run (its
        prompt and max_tokens do not fit in max_model_len: ``check_length``; more choices than
        ``max_num_seqs``)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, as_token_ids(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        vocab = self.vocab_size
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type_name(params)}")
        field = "prompt" if text is not None else "prompt_token_ids"
        if len(ids) == 0:
            raise ValueError(f"{field} is empty; give at least one token")
        check_token_ids(ids, vocab, field)  # a text can hold added tokens the model lacks
        self.check_length(len(ids), params.max_tokens)
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"n={params.n}: the choices run together, at most max_num_seqs={self.max_num_seqs}"
            )
        return text, ids, params

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """The one rule for a request's length, for ``LLM`` and the server alike (vLLM's server's): the
        prompt leaves room for a token, and the prompt plus ``max_tokens`` (None: what the prompt leaves)
        fit in ``max_model_len``. A request that does not fit is refused, not cut short: raises ValueError
        naming both numbers and the limit."""
        window = self.window
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

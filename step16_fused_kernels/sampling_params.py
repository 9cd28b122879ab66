"""What a request asks for, with vLLM's names: ``SamplingParams``, ``RequestOutputKind``, ``Logprob``.
``SamplingParams`` checks its fields when made, so the sampler (``sampler.py``) checks none of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    """Which outputs a request gets, as vLLM's ``RequestOutputKind``."""

    CUMULATIVE = 0  # every output carries everything so far (the default)
    DELTA = 1  # every output carries only what is new since the previous one (servers, streams)
    FINAL_ONLY = 2  # one output, when the request finishes (LLM.generate)


@dataclass
class Logprob:
    """One token's log-probability in an output, as vLLM's ``Logprob``.

    logprob: natural log of the token's probability (nats, <= 0; -inf for a token the filters removed).
    rank: 1-based rank of the token in the distribution it was sampled from.
    decoded_token: the token's text, or None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingParams:
    """How one request is decoded (names, meanings and defaults as in vLLM's ``SamplingParams``).

    n: completions (choices) of the prompt to generate (>= 1): the prompt is prefilled once, and choice i
        samples with its own generator, seeded with seed + i (``RequestOutput.outputs`` holds them all).
    max_tokens: most tokens to generate (>= 1); the prompt plus max_tokens must fit in the context window
        (the engine's max_model_len), or the engine refuses the request (ValueError), as vLLM's server does.
    temperature: logits are divided by it; 0 means greedy decoding (argmax), no randomness; so does any
        temperature below 1e-5 (as in vLLM: dividing by less would overflow float32).
    top_k: keep the k most likely tokens; 0 or -1 = off (vLLM accepts both).
    top_p: nucleus sampling (Holtzman et al. 2020): keep the most likely tokens up to and including the
        one whose cumulative probability crosses top_p; in (0, 1], 1 = off.
    min_p: keep tokens whose probability is at least min_p times the top token's; in [0, 1], 0 = off.
    repetition_penalty: CTRL's penalty (Keskar et al. 2019), as in HF: a logit of a token already in
        the prompt or the output is divided by it if positive, multiplied by it if negative; > 0, 1 = off.
    presence_penalty: subtracted once from the logit of every token that the output already holds;
        in [-2, 2], 0 = off (OpenAI's definition; negative values encourage repetition).
    frequency_penalty: subtracted from a token's logit once per time the output already holds it;
        in [-2, 2], 0 = off. Both OpenAI penalties count the generated tokens only, not the prompt:
        logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0).
    logprobs: None, or return for every generated token its log-probability and rank, plus the
        ``logprobs`` most likely tokens (0..5), from the distribution it was sampled from (``sampler.py``).
    stop: strings that end generation when they appear in the output text; not included in the text
        (a string, a list of strings, or None).
    stop_token_ids: token ids that end generation (kept in token_ids and in the text, unlike stop strings).
    ignore_eos: keep generating after <|endoftext|> (for benchmarks).
    seed: seed of this request's own random generator, in [-2**63, 2**64); None = nondeterministic.
        A seeded request draws only from its own generator, so it gives the same tokens on the same
        device whichever requests share its batch.
    output_kind: CUMULATIVE (everything so far), DELTA (what is new) or FINAL_ONLY (one output at the end).

    Raises ValueError, naming the field and its allowed range, on any value out of range; numbers must be
    finite, and bools are not numbers.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    stop: str | list[str] | None = field(default_factory=list)  # a list after construction
    stop_token_ids: list[int] | None = field(default_factory=list)  # a list after construction
    ignore_eos: bool = False
    seed: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        checks = [
            ("n", _is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "an integer >= 0, or -1 (0 and -1 = off)"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a finite number in (0, 1]"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "a finite number in [0, 1]"),
            ("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
             "a finite number > 0"),
            ("presence_penalty", _is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "a finite number in [-2, 2]"),
            ("frequency_penalty", _is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "a finite number in [-2, 2]"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 5),
             "an integer in [0, 5] or None"),
            ("stop", _is_list_of(self.stop, lambda s: isinstance(s, str) and s),
             "a list of non-empty strings"),
            ("stop_token_ids", _is_list_of(self.stop_token_ids, lambda t: _is_int(t) and t >= 0),
             "a list of integers >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("seed", self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
             "an integer in [-2**63, 2**64) or None"),
            ("output_kind", isinstance(self.output_kind, RequestOutputKind),
             "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)"),
        ]  # fmt: skip
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be {allowed}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_list_of(x, ok) -> bool:
    return isinstance(x, (list, tuple)) and all(ok(item) for item in x)


GREEDY_BELOW = 1e-5  # temperatures under this are greedy: dividing logits by them overflows float32


def is_greedy(params: SamplingParams) -> bool:
    """True if the request decodes greedily (argmax, no randomness): temperature below GREEDY_BELOW."""
    return params.temperature < GREEDY_BELOW


def type_name(value) -> str:
    """The name of ``value``'s type, for an error that expected this step's ``SamplingParams``: another
    step's SamplingParams is named with its step (each step has a class of its own, which isinstance tells
    apart: step 9's parameters passed to step 10's engine are not step 10's)."""
    kind = type(value)
    if kind.__name__ == SamplingParams.__name__ and kind is not SamplingParams:
        return f"a SamplingParams of {kind.__module__.split('.')[0]}, not of {__package__}"
    return kind.__name__

"""Sampling parameters, and turning one row of logits into the next token.

The order is the one Hugging Face ``generate`` and vLLM use: repetition penalty, then temperature
(0 means greedy: take the argmax), then the filters top-k, top-p and min-p, then a draw from what is left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request is decoded (names and meanings as in vLLM's ``SamplingParams``).

    max_tokens: most tokens to generate (>= 1); generation also ends at the context window.
    temperature: logits are divided by it; 0 means greedy decoding (argmax), no randomness; so does any
        temperature below 1e-5 (as in vLLM: dividing by less would overflow float32).
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus sampling (Holtzman et al. 2020): keep the most likely tokens up to and including the
        one whose cumulative probability crosses top_p; in (0, 1], 1 = off.
    min_p: keep tokens whose probability is at least min_p times the top token's; in [0, 1], 0 = off.
    repetition_penalty: CTRL's penalty (Keskar et al. 2019), as in HF: a logit of a token already in
        the prompt or the output is divided by it if positive, multiplied by it if negative; > 0, 1 = off.
    stop: strings that end generation when they appear in the output text; not included in the text
        (a string, a list of strings, or None).
    stop_token_ids: token ids that end generation (kept in token_ids, not in the text).
    ignore_eos: keep generating after <|endoftext|> (for benchmarks).
    seed: seed of this request's own random generator, in [-2**63, 2**64); None = nondeterministic.

    Raises ValueError, naming the field and its allowed range, on any value out of range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "a number >= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("stop", _is_list_of(self.stop, lambda s: isinstance(s, str) and s), "a list of non-empty strings"),
            ("stop_token_ids", _is_list_of(self.stop_token_ids, lambda t: _is_int(t) and t >= 0), "a list of integers >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("seed", self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "an integer in [-2**63, 2**64) or None"),
        ]
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
FLOAT32_MAX = torch.finfo(torch.float32).max


def apply_repetition_penalty(logits: torch.Tensor, seen_token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty on one row of logits [V] for the tokens in ``seen_token_ids``."""
    seen = torch.tensor(sorted(set(seen_token_ids)), device=logits.device, dtype=torch.long)  # [S]
    scores = logits[seen]  # [S]
    logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.nan_to_num_(nan=-math.inf, posinf=FLOAT32_MAX)  # an extreme penalty overflows float32


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, seen_token_ids: list[int]
) -> int:
    """The next token id from one row of logits.

    logits: [V], any float dtype (computed in float32). seen_token_ids: the prompt and output so far,
    for the repetition penalty. generator: the request's random generator, on the logits' device.
    """
    logits = logits.float()  # [V]
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits.clone(), seen_token_ids, params.repetition_penalty)
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    logits = (logits / params.temperature).clamp_(max=FLOAT32_MAX)  # a new tensor: the filters below write into it
    if params.top_k > 0:
        kth_best = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits[logits < kth_best] = -math.inf
    probs = torch.softmax(logits, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V], [V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the better tokens
        drop = mass_before >= params.top_p  # the token that crosses top_p is kept...
        drop[0] = False  # ...and so is the best one, however small top_p is
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return int(torch.multinomial(probs, num_samples=1, generator=generator))  # renormalises probs

"""The sampler: one request's row of logits in, its next token out, by the request's ``SamplingParams``.

One row, [V], per call, the stages in Hugging Face ``generate``'s and vLLM's order (a filter sets a removed
token's logit to -inf, so the draw and the reported logprobs see only the tokens that survive):

    penalties    repetition (CTRL), then frequency and presence (OpenAI)   when set
    greedy       argmax                                                    temperature < 1e-5
    temperature  logits / T                                                the other (sampled) requests
    filters      top-k, then top-p, then min-p                             when set
    draw         the exponential race (a categorical draw)                 from the request's generator
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling_params import Logprob, SamplingParams, is_greedy

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32 > 0


@dataclass
class TokenLogprobs:
    """The logprobs of one sampled token, as plain Python values (``sample`` gives one per request that asks).

    token_id, logprob, rank: the sampled token, its log-probability (nats) and its 1-based rank
    (1 + the number of tokens with a strictly higher logprob) in the distribution it was sampled from.
    top: the ``params.logprobs`` most likely (token id, logprob) pairs of that distribution, best first;
    tokens that the filters removed have logprob -inf (they appear when fewer than n tokens survive).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]

    def as_dict(self, decode=None) -> dict[int, Logprob]:
        """vLLM's form: {token id: Logprob}, the sampled token first, then the top-n with ranks 1..n (a
        sampled token that is also in the top-n appears once). decode: token id -> text, or None."""
        text = decode or (lambda token_id: None)
        out = {self.token_id: Logprob(self.logprob, self.rank, text(self.token_id))}
        for rank, (token_id, logprob) in enumerate(self.top, start=1):
            if token_id not in out:
                out[token_id] = Logprob(logprob, rank, text(token_id))
        return out


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
) -> tuple[int, TokenLogprobs | None]:
    """The next token id from one row of ``logits`` [V] (any float dtype; computed in float32), and its
    logprobs if ``params.logprobs`` is set (else None).

    generator: the request's own (seeded) ``torch.Generator`` on the logits' device, or None for a
    request without a seed (it then draws from torch's default generator). The token lists are read only
    by the penalties. Logprobs come from the distribution the token was sampled from: the log_softmax of
    the processed logits (``process_logits``); tokens the filters removed have logprob -inf.
    """
    logits = process_logits(logits, params, prompt_token_ids, output_token_ids)  # [V]
    if is_greedy(params):
        token_id = int(logits.argmax())
    else:
        token_id = exponential_race(logits, generator)
    if params.logprobs is None:
        return token_id, None
    return token_id, gather_logprobs(logits, token_id, params.logprobs)


def process_logits(
    logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
) -> torch.Tensor:
    """One row of logits [V] after the penalties and, unless greedy, the temperature and the filters:
    [V] float32, a copy (the caller's row stays as it was), removed tokens at -inf."""
    logits = logits.to(torch.float32, copy=True)  # [V]
    if params.repetition_penalty != 1.0:
        # CTRL's penalty (Keskar et al. 2019), as HF's RepetitionPenaltyLogitsProcessor: the logit of a token
        # of the prompt or the output is divided by the penalty if positive, multiplied by it if not
        penalty = min(params.repetition_penalty, FLOAT32_MAX)  # a larger one is inf, and 0 * inf = NaN
        seen = sorted(set(prompt_token_ids + output_token_ids))
        seen = torch.tensor(seen, dtype=torch.long, device=logits.device)  # [S]
        scores = logits[seen]  # [S]
        logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
        logits.clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # an extreme penalty overflows float32
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        # OpenAI's penalties, over the generated tokens only (as vLLM):
        # logit[j] -= frequency * count[j] + presence * (count[j] > 0), count[j] = times the output holds j
        output = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)  # [N]
        counts = torch.bincount(output, minlength=logits.numel()).float()  # [V]
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    if is_greedy(params):
        return logits  # greedy decoding takes the argmax of the penalised logits
    logits = (logits / params.temperature).clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # T >= 1e-5
    if params.top_k > 0:
        # top-k (Fan et al. 2018): tokens below the k-th largest logit are removed (ties with it are kept)
        kth_best = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth_best, -math.inf)
    if params.top_p < 1.0:
        # top-p, nucleus sampling (Holtzman et al. 2020): keep the most likely tokens up to and including
        # the one whose cumulative probability crosses top_p
        sorted_probs, order = torch.sort(logits.softmax(dim=-1), descending=True, stable=True)  # [V], [V]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [V] probability of the better tokens
        drop = mass_before >= params.top_p  # the token that crosses top_p is kept...
        drop[0] = False  # ...and so is the best one, however small top_p is
        logits = logits.index_fill(0, order[drop], -math.inf)
    if params.min_p > 0.0:
        # min-p (Nguyen et al. 2024): tokens less likely than min_p times the best one are removed
        probs = logits.softmax(dim=-1)  # [V]
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    return logits


def exponential_race(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """One categorical draw from softmax(logits) [V]: the token id.

    The exponential race: with q_j ~ Exp(1) independent, argmax_j p_j / q_j is token j with probability
    p_j (q_j / p_j ~ Exp(p_j) is the time token j's clock rings; the first of independent exponential
    clocks is j with probability p_j / sum(p)). It is the Gumbel-max trick (-log q_j is Gumbel) without
    the logs. A seeded request's q comes from its own generator, V numbers per draw.
    """
    probs = logits.softmax(dim=-1)  # [V]; removed tokens have probability 0
    q = torch.empty_like(probs).exponential_(generator=generator)  # [V], Exp(1)
    return int((probs / q.clamp_(min=FLOAT32_TINY)).argmax())  # q = 0 would make 0/0 = NaN


def gather_logprobs(logits: torch.Tensor, token_id: int, n: int) -> TokenLogprobs:
    """From log_softmax of the processed logits [V]: the chosen token's logprob and rank (1 + the number
    of tokens with a strictly higher logprob), and the n best tokens, best first."""
    logprobs = logits.log_softmax(dim=-1)  # [V]
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    top = torch.topk(logprobs, min(n, logprobs.numel()))  # [n] values and indices, descending
    return TokenLogprobs(token_id, chosen.item(), rank, list(zip(top.indices.tolist(), top.values.tolist())))

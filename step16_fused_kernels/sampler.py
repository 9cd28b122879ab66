"""The batched sampler: the logits of every request in the step, [B, V], in; one next token per row out.

Each row by its own ``SamplingParams``, in one call with one device->host copy (``to_host``), each stage
over only the rows that use it; stages and per-request generators are step 2's (seeded tokens unchanged):

    penalties    repetition (CTRL), then frequency and presence (OpenAI)   rows that set them
    greedy       one argmax over the batch                                 rows with temperature < 1e-5
    temperature  logits / T                                                the other (sampled) rows
    filters      top-k, then top-p, then min-p                             sampled rows that set them
    draw         the exponential race (a categorical draw)                 sampled rows
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling_params import Logprob, SamplingParams, is_greedy

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32 > 0
EXACT_IDS_BELOW = 2**24  # float32 holds every integer below this exactly: the packed output's ids and ranks


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


@dataclass
class SamplerOutput:
    """What one ``sample`` call returns: one entry per row of the batch, in row order.

    token_ids: [B] the sampled token ids.
    logprobs: [B] a TokenLogprobs for each row whose params set ``logprobs``, None for the others.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> SamplerOutput:
    """The next token of every row of ``logits`` [B, V], each row by its own params.

    params, generators, prompt_token_ids, output_token_ids: one entry per row. A row's generator is its
    request's own (seeded) ``torch.Generator`` on the logits' device, or None for a request without a
    seed (it then draws from torch's default generator, together with the other unseeded rows). The token
    lists are read only for the rows that use a penalty.

    Logprobs (rows with ``params.logprobs`` set) come from the distribution the token was actually sampled
    from: the log_softmax of the processed logits, i.e. after the penalties, the temperature and the
    top-k/top-p/min-p filters, renormalised over the tokens that survive (vLLM calls these "processed
    logprobs"); for a greedy row, after the penalties only (no temperature, no filters). Removed tokens
    have logprob -inf.

    On a GPU this waits for the device once (the single ``.tolist()`` in ``to_host``). Raises ValueError
    if the lists do not have one entry per row, or if V >= 2**24.
    """
    return to_host(sample_on_device(logits, params, generators, prompt_token_ids, output_token_ids), params)


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """``sample`` up to, not including, the copy to the host: never waits for the device.

    Returns the packed result, float32 on the logits' device (ids and ranks < 2**24 are exact in float32):
    [B, 1] (the sampled ids) when no row asks for logprobs, else [B, 3 + 2n] with n the largest
    ``logprobs`` in the batch: columns id, logprob, rank, n top ids, n top logprobs (zeros on rows that
    did not ask). ``to_host`` unpacks it. Arguments and errors as in ``sample``.
    """
    B, V = _check_batch(logits, params, generators, prompt_token_ids, output_token_ids)
    logits = logits.to(torch.float32, copy=True)  # [B, V]: our own copy, processed in place
    sampled = [i for i, p in enumerate(params) if not is_greedy(p)]  # rows that draw at random

    # penalties, on greedy and sampled rows alike
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rows:
        seen = [prompt_token_ids[i] + output_token_ids[i] for i in rows]
        penalize_repetitions(logits, rows, seen, [params[i].repetition_penalty for i in rows])
    rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if rows:
        penalize_presence_frequency(
            logits, rows, [output_token_ids[i] for i in rows],
            [params[i].presence_penalty for i in rows], [params[i].frequency_penalty for i in rows],
        )  # fmt: skip

    # greedy rows: one argmax over the whole batch (the sampled rows' ids are overwritten below)
    if len(sampled) < B:
        ids = logits.argmax(dim=-1)  # [B]
    else:
        ids = torch.zeros(B, dtype=torch.long, device=logits.device)  # [B]

    # sampled rows: temperature, filters, draw
    rows = [i for i in sampled if params[i].temperature != 1.0]
    if rows:
        scale_by_temperature(logits, rows, [params[i].temperature for i in rows])
    rows = [i for i in sampled if params[i].top_k > 0]
    if rows:
        keep_top_k(logits, rows, [params[i].top_k for i in rows])
    rows = [i for i in sampled if params[i].top_p < 1.0]
    if rows:
        keep_top_p(logits, rows, [params[i].top_p for i in rows])
    rows = [i for i in sampled if params[i].min_p > 0.0]
    if rows:
        keep_min_p(logits, rows, [params[i].min_p for i in rows])
    if sampled:
        drawn = exponential_race(logits, sampled, [generators[i] for i in sampled])  # [R]
        ids.index_copy_(0, _to_device(sampled, torch.long, logits.device), drawn)

    # pack: ids, and for the rows that ask, the logprobs of what they were sampled from
    packed = ids.to(torch.float32).unsqueeze(1)  # [B, 1]
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        n = min(max(params[i].logprobs for i in rows), V)
        block = torch.zeros(B, 2 + 2 * n, device=logits.device)  # [B, 2 + 2n]
        block.index_copy_(
            0, _to_device(rows, torch.long, logits.device), gather_logprobs(logits, rows, ids, n)
        )
        packed = torch.cat([packed, block], dim=1)  # [B, 3 + 2n]
    return packed


def to_host(packed: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
    """Unpack ``sample_on_device``'s result: the call's one device->host copy (on a GPU it waits for the
    device), then plain Python values. params: the same list as given to ``sample_on_device``."""
    table = packed.tolist()  # [B][1 or 3 + 2n], the one sync
    n = (packed.shape[1] - 3) // 2  # top-n width, when there are logprob columns
    token_ids = [int(row[0]) for row in table]
    logprobs: list[TokenLogprobs | None] = []
    for row, p in zip(table, params):
        if p.logprobs is None:
            logprobs.append(None)
            continue
        k = min(p.logprobs, n)
        top = [(int(t), lp) for t, lp in zip(row[3 : 3 + k], row[3 + n : 3 + n + k])]
        logprobs.append(TokenLogprobs(int(row[0]), row[1], int(row[2]), top))
    return SamplerOutput(token_ids, logprobs)


# The stages. Each takes the batch's logits [B, V] (float32, processed in place) and the indices of the R
# rows that use it (a python list, known on the host), and leaves the other rows alone.


def penalize_repetitions(
    logits: torch.Tensor, rows: list[int], seen: list[list[int]], penalties: list[float]
) -> None:
    """CTRL's repetition penalty (Keskar et al. 2019; HF's ``RepetitionPenaltyLogitsProcessor``): for
    each listed row, the logit of every token in that row's ``seen`` ids (prompt and output) is divided by
    the penalty if positive, multiplied by it if not. Results are clamped to float32's finite range (an
    extreme penalty would overflow to inf, then to NaN later)."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    x = logits.index_select(0, idx)  # [R, V]
    was_seen = token_counts(seen, x.shape[1], x.device) > 0  # [R, V]
    penalties = [min(p, FLOAT32_MAX) for p in penalties]  # a larger one is inf in float32, and 0 * inf = NaN
    penalty = _to_device(penalties, torch.float32, x.device).unsqueeze(1)  # [R, 1]
    x = torch.where(was_seen, torch.where(x > 0, x / penalty, x * penalty), x)
    logits.index_copy_(0, idx, x.clamp_(-FLOAT32_MAX, FLOAT32_MAX))


def penalize_presence_frequency(
    logits: torch.Tensor,
    rows: list[int],
    outputs: list[list[int]],
    presence: list[float],
    frequency: list[float],
) -> None:
    """OpenAI's presence and frequency penalties over the generated tokens only (as vLLM):
    logit[j] -= frequency * count[j] + presence * (count[j] > 0), count[j] = times the output holds j."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    x = logits.index_select(0, idx)  # [R, V]
    counts = token_counts(outputs, x.shape[1], x.device)  # [R, V]
    frequency_t = _to_device(frequency, torch.float32, x.device).unsqueeze(1)  # [R, 1]
    presence_t = _to_device(presence, torch.float32, x.device).unsqueeze(1)  # [R, 1]
    x = x - frequency_t * counts
    x = x - presence_t * (counts > 0).float()
    logits.index_copy_(0, idx, x)


def scale_by_temperature(logits: torch.Tensor, rows: list[int], temperatures: list[float]) -> None:
    """Divide each listed row by its temperature (>= 1e-5), clamped to float32's finite range."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    t = _to_device(temperatures, torch.float32, logits.device).unsqueeze(1)  # [R, 1]
    logits.index_copy_(0, idx, (logits.index_select(0, idx) / t).clamp_(-FLOAT32_MAX, FLOAT32_MAX))


def keep_top_k(logits: torch.Tensor, rows: list[int], top_ks: list[int]) -> None:
    """Top-k filtering (Fan et al. 2018): in each listed row, tokens below the k-th largest logit get -inf
    (ties with the k-th are kept). One ``topk`` with the largest k of the rows serves them all."""
    V = logits.shape[1]
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    x = logits.index_select(0, idx)  # [R, V]
    ks = [min(k, V) for k in top_ks]
    best = torch.topk(x, max(ks), dim=-1).values  # [R, max k], descending
    kth_best = best.gather(1, _to_device(ks, torch.long, x.device).unsqueeze(1) - 1)  # [R, 1]
    logits.index_copy_(0, idx, x.masked_fill(x < kth_best, -math.inf))


def keep_top_p(logits: torch.Tensor, rows: list[int], top_ps: list[float]) -> None:
    """Nucleus filtering (Holtzman et al. 2020): in each listed row, keep the most likely tokens up to
    and including the one whose cumulative probability crosses p, and always the best one; the others
    get -inf."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    x = logits.index_select(0, idx)  # [R, V]
    p = _to_device(top_ps, torch.float32, x.device).unsqueeze(1)  # [R, 1]
    sorted_probs, order = torch.sort(x.softmax(dim=-1), dim=-1, descending=True, stable=True)  # [R, V] x2
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V] probability of the better tokens
    drop_sorted = mass_before >= p  # the token that crosses p is kept...
    drop_sorted[:, 0] = False  # ...and so is the best one, however small p is
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # [R, V] back in token order
    logits.index_copy_(0, idx, x.masked_fill(drop, -math.inf))


def keep_min_p(logits: torch.Tensor, rows: list[int], min_ps: list[float]) -> None:
    """Min-p filtering (Nguyen et al. 2024): in each listed row, tokens whose probability is below min_p
    times the best token's get -inf."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    x = logits.index_select(0, idx)  # [R, V]
    probs = x.softmax(dim=-1)  # [R, V]
    min_p = _to_device(min_ps, torch.float32, x.device).unsqueeze(1)  # [R, 1]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    logits.index_copy_(0, idx, x.masked_fill(probs < threshold, -math.inf))


def exponential_race(
    logits: torch.Tensor, rows: list[int], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One categorical draw from softmax(logits[row]) for each listed row; returns the ids, [R] int64.

    The exponential race: with q_j ~ Exp(1) independent, argmax_j p_j / q_j is token j with probability
    p_j (q_j / p_j ~ Exp(p_j) is the time token j's clock rings; the first of independent exponential
    clocks is j with probability p_j / sum(p)). It is the Gumbel-max trick (-log q_j is Gumbel) without the
    logs, and, unlike ``torch.multinomial``, it never makes the host wait for the device (vLLM's sampler
    does the same). A seeded row's q comes from its own generator only, V numbers per draw, so its token
    does not depend on the batch; the unseeded rows draw theirs from torch's default generator in one call.
    """
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    probs = logits.index_select(0, idx).softmax(dim=-1)  # [R, V]; removed tokens have probability 0
    q = torch.empty_like(probs)  # [R, V]
    if any(g is None for g in generators):
        q.exponential_()  # every row at once; seeded rows are overwritten just below
    for r, g in enumerate(generators):
        if g is not None:
            q[r].exponential_(generator=g)  # [V]
    return (probs / q.clamp_(min=FLOAT32_TINY)).argmax(dim=-1)  # q = 0 would make 0/0 = NaN


def gather_logprobs(logits: torch.Tensor, rows: list[int], token_ids: torch.Tensor, n: int) -> torch.Tensor:
    """For each listed row, from log_softmax of its processed logits: the chosen token's logprob and rank
    (1 + the number of tokens with a strictly higher logprob), and the n best tokens. token_ids: [B] int64.
    Returns [R, 2 + 2n] float32: logprob, rank, n top ids, n top logprobs (best first)."""
    idx = _to_device(rows, torch.long, logits.device)  # [R]
    logprobs = logits.index_select(0, idx).log_softmax(dim=-1)  # [R, V]
    chosen = logprobs.gather(1, token_ids.index_select(0, idx).unsqueeze(1))  # [R, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1  # [R, 1]
    top = torch.topk(logprobs, n, dim=-1)  # [R, n] values and indices, descending
    return torch.cat([chosen, rank.float(), top.indices.float(), top.values], dim=1)  # [R, 2 + 2n]


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each of the R lists. Built on the device with one
    ``index_add_`` at flat positions row * V + id (a host->device copy of the ids, no wait)."""
    flat = [r * vocab_size + t for r, ids in enumerate(token_ids) for t in ids]  # [N]
    counts = torch.zeros(len(token_ids) * vocab_size, device=device)  # [R * V]
    counts.index_add_(0, _to_device(flat, torch.long, device), torch.ones(len(flat), device=device))
    return counts.view(len(token_ids), vocab_size)  # [R, V]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of host values on ``device``, without making the host wait: on a GPU through pinned
    memory and a non-blocking copy (a copy from ordinary, pageable memory waits for the device)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _check_batch(logits, params, generators, prompt_token_ids, output_token_ids) -> tuple[int, int]:
    """(B, V) of a valid call; raises ValueError (shapes only: nothing is read from the device)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: must be a float tensor [B, V], got {tuple(logits.shape)} {logits.dtype}")
    B, V = logits.shape
    if V >= EXACT_IDS_BELOW:
        raise ValueError(f"logits: vocabulary of {V} tokens; the sampler packs ids in float32, so V < 2**24")
    lists = dict(params=params, generators=generators, prompt_token_ids=prompt_token_ids,
                 output_token_ids=output_token_ids)  # fmt: skip
    for name, value in lists.items():
        if len(value) != B:
            raise ValueError(f"{name}: must have one entry per row of logits ({B}), got {len(value)}")
    return B, V

"""The rejection sampler: which of a sequence's k proposed tokens the target model accepts (vLLM's name).

Leviathan et al. 2023 (arXiv 2211.17192), Chen et al. 2023 (arXiv 2302.01318). One forward pass gave the
target's logits after the last accepted token and after each of the k drafts: rows 0..k of a lane. Row i
judges draft i + 1; row k gives the bonus token, drawn when all k are accepted. On the device, no wait.
    greedy   accept draft d while d == argmax(row); at the first mismatch emit that argmax
    sampled  p = the row's warped distribution (temperature, top-k, top-p, min-p: the sampler's stages);
             accept d with probability min(1, p(d) / q(d)); on a rejection draw from max(p - q, 0),
             normalised. Prompt lookup has no q of its own: q is one-hot on d, so d is accepted with
             probability p(d) and the residual is p without d. Either way the token's law is p's.
"""

from __future__ import annotations

import torch

from .sampler import _to_device, exponential_race, keep_min_p, keep_top_k, keep_top_p, scale_by_temperature
from .sampling_params import SamplingParams, is_greedy


def warp(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The sampler's temperature and filters over every row of ``logits`` [R, V] whose params sample;
    greedy rows are left as they are. Returns a float32 copy [R, V] (removed tokens: -inf)."""
    logits = logits.to(torch.float32, copy=True)  # [R, V]
    sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
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
    return logits


def rejection_sample(
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    draft_probs: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Verify B lanes of drafts against the target's logits; never waits for the device.

    logits: [R, V], R = sum(len(d) + 1 for d in drafts): lane b's rows in order, its k_b + 1 positions.
    drafts: B lists of proposed ids (k_b >= 1 each); params, generators: one per lane (a seeded lane draws
    its uniforms and its residual or bonus token from its own generator only, so its tokens do not depend on
    the batch). draft_probs: per lane, the draft model's distributions q [k_b, V] its drafts were drawn
    from (a sampled lane of a draft model), or None (q one-hot on the draft). Returns [B, 2] int64 on the
    logits' device: each lane's accepted count a (0..k_b), then the token emitted after them (the target's
    at the first rejection, or the bonus token).
    """
    device, R = logits.device, logits.shape[0]
    ks = [len(d) for d in drafts]
    lane_of_row = [b for b, k in enumerate(ks) for _ in range(k + 1)]
    row_params = [params[b] for b in lane_of_row]
    row_gens = [generators[b] for b in lane_of_row]
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k + 1)
    # each row's draft (-1 on a bonus row: no token matches it), its position in its lane, its lane, and
    # each lane's first row: one copy to the device (through pinned memory on a GPU: the host does not wait)
    judged = [t for d in drafts for t in (*d, -1)]  # [R]
    pos = [r - starts[b] for r, b in enumerate(lane_of_row)]  # [R]
    index = _to_device(judged + pos + lane_of_row + starts[:-1], torch.long, device)  # [3R + B]
    judged, pos, lanes, first = index.split([R, R, R, len(ks)])  # [R], [R], [R], [B]
    sampled = [r for r in range(R) if not is_greedy(row_params[r])]
    warped = warp(logits, row_params) if sampled else logits  # [R, V]; greedy rows need no float32 copy
    tokens = warped.argmax(dim=-1)  # [R] the greedy rows' answers (sampled rows are overwritten)
    accept = tokens == judged  # [R]; bonus rows never accept
    if sampled:
        s_rows = [starts[b] + i for b, k in enumerate(ks) for i in range(k) if not is_greedy(params[b])]
        if s_rows:  # the sampled rows that judge a draft
            rows = _to_device(s_rows, torch.long, device)  # [Rs]
            ids = judged[rows]  # [Rs] the drafts
            p = warped[rows].softmax(dim=-1)  # [Rs, V] the target's law at each judged position
            q = torch.zeros_like(p).scatter_(1, ids[:, None], 1.0)  # [Rs, V] one-hot on each draft...
            at = 0  # ...or the draft model's law: the sampled lanes' rows, in lane order
            for b, k in enumerate(ks):
                if not is_greedy(params[b]):
                    if draft_probs is not None and draft_probs[b] is not None:
                        q[at : at + k] = draft_probs[b].to(q.dtype)  # [k, V]
                    at += k
            p_d, q_d = p.gather(1, ids[:, None])[:, 0], q.gather(1, ids[:, None])[:, 0]  # [Rs] each
            u = torch.rand(len(s_rows), device=device)  # [Rs] uniforms: torch's default generator...
            for n, r in enumerate(s_rows):  # ...or, for a seeded lane, its own
                if (gen := row_gens[r]) is not None:
                    u[n : n + 1].uniform_(generator=gen)
            accept[rows] = u * q_d < p_d  # with probability min(1, p(d) / q(d))
            # the residual max(p - q, 0), normalised by the draw (log 0 = -inf); where it is all zero (p <= q
            # everywhere: p == q) the draft is accepted for sure and the residual is never read
            residual = (p - q).clamp_(min=0.0)  # [Rs, V]
            empty = residual.sum(dim=-1, keepdim=True) <= 0  # [Rs, 1]
            warped[rows] = torch.where(empty, warped[rows], residual.log())
        tokens.index_copy_(
            0,
            _to_device(sampled, torch.long, device),
            exponential_race(warped, sampled, [row_gens[r] for r in sampled]),
        )  # a residual draw on the rows that judge a draft, the bonus draw on the last row of a lane
    # a lane's accepted count: the position of its first row that does not accept (its bonus row at worst)
    stop = torch.where(accept, R, pos)  # [R]
    num_accepted = torch.full((len(ks),), R, dtype=torch.long, device=device)
    num_accepted.scatter_reduce_(0, lanes, stop, reduce="amin")  # [B]
    return torch.stack([num_accepted, tokens[first + num_accepted]], dim=1)  # [B, 2]

"""The batched sampler against a one-row reference, and its host syncs on a GPU.

``sample_one`` (below) runs every stage the plain way on one row and draws with the same exponential race
from the same generator, so a seeded row must give exactly the reference's id, alone or anywhere in any
batch. Unseeded rows cannot be compared id by id: they are checked where the outcome is certain (greedy,
top_k=1, a tiny top_p), by their processed distribution (the logprobs), and by their frequencies over many
rows of one batch (Pearson's chi-square). The GPU test counts host syncs: one call may wait for the device
once. SamplingParams' validation is tested in step 1 (``test_sampling_params.py``).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from .sampler import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    penalize_repetitions,
    sample,
    sample_on_device,
    to_host,
)
from .sampling_params import Logprob, SamplingParams, is_greedy

V = 1000  # vocabulary of the random-logit tests


def generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A request's own generator, as the engine makes it: None without a seed."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def random_history(rng: random.Random, vocab: int = V) -> tuple[list[int], list[int]]:
    """A prompt and an output with repeats, so that the penalties have something to count."""
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    output = [
        rng.choice(prompt) if rng.random() < 0.3 else rng.randrange(vocab)
        for _ in range(rng.randrange(0, 20))
    ]
    return prompt, output


# The reference: one row, written the plain way. Same stages, same formulas, same random numbers (the
# exponential race from the same generator), so the batched sampler must give exactly its ids.


def apply_repetition_penalty(logits: torch.Tensor, seen_token_ids: list[int], penalty: float) -> torch.Tensor:
    """CTRL's repetition penalty on one row of logits [V] for the tokens in ``seen_token_ids``."""
    penalty = min(penalty, FLOAT32_MAX)  # a larger one is inf in float32, and 0 * inf = NaN
    seen = torch.tensor(sorted(set(seen_token_ids)), device=logits.device, dtype=torch.long)  # [S]
    scores = logits[seen]  # [S]
    logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # an extreme penalty overflows float32


def process_one(
    logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]
) -> torch.Tensor:
    """One row of logits [V] after the penalties and, unless greedy, the temperature and the filters:
    [V] float32, removed tokens at -inf. Its log_softmax is what ``sample`` must report as logprobs."""
    logits = logits.to(torch.float32, copy=True)  # [V]
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(
            logits, prompt_token_ids + output_token_ids, params.repetition_penalty
        )
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        output = torch.tensor(output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output, minlength=logits.numel()).float()  # [V]
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).float()
    if is_greedy(params):
        return logits
    logits = (logits / params.temperature).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
    if params.top_k > 0:
        kth_best = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits[logits < kth_best] = -math.inf
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(
            torch.softmax(logits, dim=-1), descending=True, stable=True
        )  # [V], [V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the better tokens
        drop = mass_before >= params.top_p  # the token that crosses top_p is kept...
        drop[0] = False  # ...and so is the best one, however small top_p is
        logits[order[drop]] = -math.inf
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)  # [V]
        logits[probs < params.min_p * probs.max()] = -math.inf
    return logits


def sample_one(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
) -> int:
    """The next token id from one row of logits [V] (any float dtype; computed in float32): the reference
    for ``sample``. generator: the request's own generator on the logits' device, or None (torch's default).
    """
    logits = process_one(logits, params, prompt_token_ids, output_token_ids)  # [V]
    if is_greedy(params):
        return int(logits.argmax())
    probs = torch.softmax(logits, dim=-1)  # [V]
    q = torch.empty_like(probs).exponential_(generator=generator)  # [V], Exp(1): the exponential race
    return int((probs / q.clamp_(min=FLOAT32_TINY)).argmax())


# Every kind of row in one batch. (seeded, unseeded-but-certain, and unseeded-random rows side by side)
MIXED = [
    SamplingParams(temperature=0),  # greedy
    SamplingParams(temperature=0.8, seed=1),  # plain sampling
    SamplingParams(temperature=1.3, top_k=20, seed=2),
    SamplingParams(temperature=0.7, top_p=0.6, seed=3),
    SamplingParams(min_p=0.05, seed=4),
    SamplingParams(temperature=0, repetition_penalty=1.8),  # greedy after a penalty
    SamplingParams(repetition_penalty=0.7, seed=5),
    SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, seed=6),
    SamplingParams(temperature=0, presence_penalty=-2, frequency_penalty=2, logprobs=1),
    SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        seed=7,
        logprobs=3,
    ),  # fmt: skip
    SamplingParams(temperature=1.5, top_k=1),  # unseeded, but only one token survives
    SamplingParams(top_p=1e-6),  # unseeded, likewise
    SamplingParams(temperature=0.6, logprobs=5),  # unseeded and random
    SamplingParams(top_k=-1, seed=8, logprobs=0),
    SamplingParams(temperature=2.0, top_k=5, seed=2**64 - 1, logprobs=2),
    SamplingParams(
        temperature=1e-5, top_p=0.5, seed=-(2**63)
    ),  # just above greedy: huge logits, still finite
]
CERTAIN = {10, 11}  # unseeded rows whose token is the argmax of the processed logits


@pytest.mark.parametrize("trial", range(3))
def test_batch_equals_reference_row_by_row(trial):
    rng = random.Random(trial)
    torch.manual_seed(trial)
    B = len(MIXED)
    histories = [random_history(rng) for _ in range(B)]
    batch_gens = [generator(p.seed) for p in MIXED]
    ref_gens = [generator(p.seed) for p in MIXED]
    for _ in range(3):  # several steps: the generators advance, the outputs grow
        logits = torch.randn(B, V) * 3
        out = sample(logits, MIXED, batch_gens, [h[0] for h in histories], [h[1] for h in histories])
        assert len(out.token_ids) == len(out.logprobs) == B
        for i, (p, (prompt, output)) in enumerate(zip(MIXED, histories)):
            expected = sample_one(logits[i], p, ref_gens[i], prompt, output)
            ref_logprobs = torch.log_softmax(process_one(logits[i], p, prompt, output), dim=-1)  # [V]
            token = out.token_ids[i]
            if p.seed is not None or p.temperature == 0 or i in CERTAIN:
                assert token == expected, (i, p)
            assert ref_logprobs[token] > -math.inf, (i, p)  # never a removed token
            if p.logprobs is None:
                assert out.logprobs[i] is None
            else:
                lp = out.logprobs[i]
                assert lp.token_id == token
                assert lp.logprob == pytest.approx(ref_logprobs[token].item(), abs=1e-5)
                assert lp.rank == 1 + int((ref_logprobs > ref_logprobs[token]).sum())
                assert len(lp.top) == p.logprobs
                assert [t for t, _ in lp.top] == ref_logprobs.topk(p.logprobs).indices.tolist()
            output.append(token)


def test_every_rows_processed_distribution_equals_the_reference():
    """With logprobs=5 on every row, the top-5 of each row equal the reference's processed logprobs."""
    rng = random.Random(5)
    params = [dataclasses.replace(p, logprobs=5) for p in MIXED]
    histories = [random_history(rng) for _ in params]
    logits = torch.randn(len(params), V) * 3
    out = sample(
        logits,
        params,
        [generator(p.seed) for p in params],
        [h[0] for h in histories],
        [h[1] for h in histories],
    )
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        ref = torch.log_softmax(process_one(logits[i], p, prompt, output), dim=-1)  # [V]
        top = ref.topk(5)
        got = out.logprobs[i].top
        assert [t for t, _ in got] == top.indices.tolist(), (i, p)
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), top.values, atol=1e-5, rtol=0)


def test_seeded_row_is_the_same_alone_and_anywhere_in_any_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(seed=99),
        SamplingParams(),
        SamplingParams(top_k=3),
    ]
    row = torch.randn(V) * 2
    steps = 5

    def run(batch_size: int, position: int) -> list[int]:
        own = generator(params.seed)
        ids = []
        for _ in range(steps):
            logits = torch.randn(batch_size, V)
            logits[position] = row
            batch = [others[j % len(others)] for j in range(batch_size)]
            batch[position] = params
            row_gens = [own if p is params else generator(p.seed) for p in batch]
            empty = [[] for _ in range(batch_size)]
            ids.append(sample(logits, batch, row_gens, empty, empty).token_ids[position])
        return ids

    alone = run(1, 0)
    assert len(set(alone)) > 1  # it does sample
    for batch_size, position in [(2, 0), (2, 1), (5, 2), (9, 8), (16, 0)]:
        assert run(batch_size, position) == alone, (batch_size, position)
    own = generator(params.seed)
    assert [sample_one(row, params, own, [], []) for _ in range(steps)] == alone


P = [0.5, 0.3, 0.15, 0.05]
DISTRIBUTIONS = [  # (params, expected frequencies of the tokens of P), as today's single-row tests
    (SamplingParams(temperature=1.0), P),
    (SamplingParams(temperature=2.0), [math.sqrt(p) / sum(map(math.sqrt, P)) for p in P]),
    (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0, 0]),
    (SamplingParams(temperature=1.0, top_p=0.6), [0.625, 0.375, 0, 0]),  # 0.5 < 0.6: the 0.3 crosses, kept
    (SamplingParams(temperature=1.0, top_p=0.5), [1, 0, 0, 0]),
    (SamplingParams(temperature=1.0, min_p=0.3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),  # >= 0.15
]


def chi_square_ok(observed: list[float], expected: list[float], n: int) -> bool:
    """Pearson's test at the 0.1% level for the cells with expected > 0 (critical values of chi2)."""
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    if len(cells) == 1:  # one possible outcome: every draw must be it
        return observed == expected
    stat = sum(n * (o - e) ** 2 / e for o, e in cells)
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[len(cells) - 1]
    return stat < critical and all(o == 0 for o, e in zip(observed, expected) if e == 0)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
def test_frequencies_of_every_setting_in_one_batch(seeded):
    """20000 rows per setting, all settings in one batch: each setting's frequencies match its distribution
    (unseeded rows draw together from torch's generator; seeded rows each from their own)."""
    torch.manual_seed(0)
    n = 20000
    params = [p for p, _ in DISTRIBUTIONS for _ in range(n)]
    gens = [generator(seed) if seeded else None for seed in range(len(params))]
    logits = torch.log(torch.tensor(P)).expand(len(params), -1)
    empty = [[]] * len(params)
    ids = torch.tensor(sample(logits, params, gens, empty, empty).token_ids).view(len(DISTRIBUTIONS), n)
    for (p, expected), row in zip(DISTRIBUTIONS, ids):
        observed = (torch.bincount(row, minlength=len(P)).float() / n).tolist()
        assert chi_square_ok(observed, expected, n), (p, observed, expected)
    # and the test can fail: temperature 1 is not temperature 2
    observed = (torch.bincount(ids[0], minlength=len(P)).float() / n).tolist()
    assert not chi_square_ok(observed, DISTRIBUTIONS[1][1], n)


def test_greedy_logprobs_are_the_log_softmax_of_the_logits():
    torch.manual_seed(0)
    logits = (torch.randn(4, V) * 4).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=5e-6, top_k=2, logprobs=3),
    ]
    empty = [[]] * 4
    out = sample(logits, params, [None] * 4, empty, empty)
    expected = torch.log_softmax(logits.float(), dim=-1)  # [4, V]: no temperature, no filters
    assert out.token_ids == expected.argmax(dim=-1).tolist()
    for i, n in [(0, 5), (1, 0), (3, 3)]:
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i] and lp.rank == 1
        assert lp.logprob == pytest.approx(expected[i].max().item(), abs=1e-5)
        assert len(lp.top) == n
        assert [t for t, _ in lp.top] == expected[i].topk(n).indices.tolist()
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), expected[i].topk(n).values, atol=1e-5, rtol=0)
        if n:
            assert lp.top[0][0] == lp.token_id
    assert out.logprobs[2] is None
    # ties: the rank counts strictly better tokens only
    out = sample(
        torch.tensor([[1.0, 2.0, 2.0, 0.0]]), [SamplingParams(temperature=0, logprobs=3)], [None], [[]], [[]]
    )
    assert out.token_ids == [1] and out.logprobs[0].rank == 1


def test_filtered_tokens_have_minus_infinity_and_ranks_count_better_tokens():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    params = [SamplingParams(top_k=2, logprobs=5, seed=0), SamplingParams(top_p=0.3, logprobs=5, seed=1),
              SamplingParams(temperature=0.5, logprobs=5, seed=2)]  # fmt: skip
    empty = [[]] * 3
    out = sample(logits, params, [generator(p.seed) for p in params], empty, empty)
    top_k = out.logprobs[0]
    kept = [lp for _, lp in top_k.top[:2]]
    assert all(math.isfinite(lp) for lp in kept) and sum(math.exp(lp) for lp in kept) == pytest.approx(
        1, abs=1e-5
    )
    assert [lp for _, lp in top_k.top[2:]] == [-math.inf] * 3
    assert top_k.token_id in [t for t, _ in top_k.top[:2]] and top_k.rank in (1, 2)
    for i in (1, 2):  # the sampled token's rank: 1 + tokens with a strictly higher processed logprob
        ref = torch.log_softmax(process_one(logits[i], params[i], [], []), dim=-1)
        lp = out.logprobs[i]
        assert math.isfinite(lp.logprob) and lp.rank == 1 + int((ref > ref[lp.token_id]).sum())
        assert lp.rank <= int(torch.isfinite(ref).sum())


def test_top_k_minus_one_is_top_k_zero():
    torch.manual_seed(2)
    logits = torch.randn(6, V) * 2
    results = []
    for off in (0, -1):
        params = [SamplingParams(top_k=off, seed=s, logprobs=2) for s in range(6)]
        results.append(sample(logits, params, [generator(p.seed) for p in params], [[]] * 6, [[]] * 6))
    assert results[0] == results[1]


def test_presence_and_frequency_penalties_follow_openai():
    """logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the generated tokens only."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, 2.5]] * 3)
    prompt, output = [4, 0], [3, 3, 1]  # the prompt's tokens are not penalised
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.5, logprobs=5),
              SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=-2.0, logprobs=5),
              SamplingParams(temperature=0, logprobs=5)]  # fmt: skip
    expected = [
        [1.0, 2.0 - 1.5 * 1 - 0.5, 0.5, 3.0 - 1.5 * 2 - 0.5, 2.5],
        [1.0, 2.0 + 2.0 * 1 + 1.0, 0.5, 3.0 + 2.0 * 2 + 1.0, 2.5],
        [1.0, 2.0, 0.5, 3.0, 2.5],  # no penalty: untouched
    ]
    out = sample(logits, params, [None] * 3, [prompt] * 3, [output] * 3)
    for i, row in enumerate(expected):
        want = torch.log_softmax(torch.tensor(row), dim=-1)
        got = torch.full((5,), math.nan)
        for token, lp in out.logprobs[i].top:
            got[token] = lp
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert out.token_ids[i] == int(torch.tensor(row).argmax())
        torch.testing.assert_close(process_one(logits[i], params[i], prompt, output), torch.tensor(row))


def test_repetition_penalty_follows_ctrl_on_its_row_only():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    assert apply_repetition_penalty(logits.clone(), [0, 1, 1], 2.0).tolist() == [1.0, -4.0, 1.0, -1.0]
    batch = logits.repeat(3, 1)  # [3, 4]
    penalize_repetitions(batch, [1], [[0, 1, 1]], [2.0])
    assert batch.tolist() == [logits.tolist(), [1.0, -4.0, 1.0, -1.0], logits.tolist()]
    # greedy with a strong penalty never repeats a token of the prompt; its neighbours keep the argmax
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=10.0),
        SamplingParams(temperature=0),
    ]
    out = sample(torch.tensor([[5.0, 4.0, 0.0]] * 3), params, [None] * 3, [[0]] * 3, [[]] * 3)
    assert out.token_ids == [0, 1, 0]


@pytest.mark.parametrize("penalty", [1e-30, 1e30, 1e-300, 1e300])
def test_extreme_penalties_stay_finite(penalty):
    """Dividing by 1e-30 or multiplying by 1e30 overflows float32 (1e300 is inf in float32, and 0 * inf
    is NaN): the logits are clamped to float32's range, never NaN."""
    torch.manual_seed(3)
    logits = torch.randn(5, V) * 50
    logits[:, :6] = torch.tensor([FLOAT32_MAX, -FLOAT32_MAX, 3e38, -3e38, 0.0, -0.0])
    seen = list(range(V))  # every token
    params = [
        SamplingParams(temperature=0, repetition_penalty=penalty, logprobs=5),
        SamplingParams(repetition_penalty=penalty, seed=0, logprobs=5),
        SamplingParams(temperature=1e-5, repetition_penalty=penalty, top_p=0.9, seed=1, logprobs=5),
        SamplingParams(repetition_penalty=penalty, min_p=0.5, frequency_penalty=2, seed=2, logprobs=5),
        SamplingParams(repetition_penalty=penalty, top_k=3, presence_penalty=-2, seed=3, logprobs=5),
    ]
    out = sample(logits, params, [generator(p.seed) for p in params], [seen] * 5, [[1, 2]] * 5)
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        assert 0 <= out.token_ids[i] < V and not math.isnan(lp.logprob) and lp.logprob > -math.inf
        assert not any(math.isnan(v) for _, v in lp.top)
        assert out.token_ids[i] == sample_one(logits[i], p, generator(p.seed), seen, [1, 2])
    # every logit pushed to -FLOAT32_MAX: a uniform distribution, not NaN
    out = sample(
        -torch.rand(1, V) - 1, [SamplingParams(repetition_penalty=1e300, logprobs=0)], [None], [seen], [[]]
    )
    assert out.logprobs[0].logprob == pytest.approx(-math.log(V), abs=1e-4)


def test_low_precision_logits_are_computed_in_float32_and_left_unchanged():
    torch.manual_seed(4)
    logits = (torch.randn(3, V) * 3).half()
    before = logits.clone()
    params = [
        SamplingParams(seed=1, repetition_penalty=1.5, logprobs=2),
        SamplingParams(temperature=0),
        SamplingParams(top_p=0.8, seed=2),
    ]
    history = [[1, 2, 3]] * 3
    a = sample(logits, params, [generator(p.seed) for p in params], history, history)
    b = sample(logits.float(), params, [generator(p.seed) for p in params], history, history)
    assert a == b
    assert torch.equal(logits, before)


def test_logprobs_as_vllm_dict():
    out = sample(
        torch.tensor([[3.0, 2.0, 1.0, 0.0]]), [SamplingParams(temperature=0, logprobs=2)], [None], [[]], [[]]
    )
    d = out.logprobs[0].as_dict(decode=lambda t: f"<{t}>")
    assert list(d) == [0, 1]
    assert (
        d[0] == Logprob(out.logprobs[0].logprob, 1, "<0>") and d[1].rank == 2 and d[1].decoded_token == "<1>"
    )
    out = sample(
        torch.tensor([[3.0, 2.0, 1.0, 0.0]]),
        [SamplingParams(top_k=4, min_p=0.3, logprobs=1, seed=5)],
        [generator(5)],
        [[]],
        [[]],
    )
    assert len(out.logprobs[0].as_dict()) in (1, 2)  # the sampled token, plus the best one if it differs


def test_batch_arguments_must_have_one_entry_per_row():
    logits = torch.zeros(2, 5)
    ok = dict(
        params=[SamplingParams()] * 2,
        generators=[None] * 2,
        prompt_token_ids=[[]] * 2,
        output_token_ids=[[]] * 2,
    )
    for name in ok:
        with pytest.raises(ValueError, match=name):
            sample(logits, **{**ok, name: ok[name][:1]})
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(5), **{k: v[:1] for k, v in ok.items()})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_call_waits_for_the_gpu_once():
    """Sync budget of one ``sample`` call on a GPU: 0 in ``sample_on_device`` (checked: any sync raises in
    torch's "error" sync-debug mode), then exactly 1, the ``.tolist()`` in ``to_host``. Also: a seeded row
    gives the same ids alone and in a batch, and the GPU's ids of seeded rows match the reference's."""
    device = torch.device("cuda")
    rng = random.Random(0)
    B, vocab = len(MIXED), 50257
    histories = [random_history(rng, vocab) for _ in range(B)]
    logits = torch.randn(B, vocab, device=device) * 3
    gens = [generator(p.seed, device) for p in MIXED]
    args = (logits, MIXED, gens, [h[0] for h in histories], [h[1] for h in histories])
    sample(*args)  # warm up: pinned-memory pool, kernels
    torch.cuda.synchronize()
    gens[:] = [generator(p.seed, device) for p in MIXED]
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = sample_on_device(*args)  # SYNCS ALLOWED HERE: 0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = to_host(packed, MIXED)  # SYNCS HERE: 1
    for i, p in enumerate(MIXED):
        if p.seed is not None or p.temperature == 0 or i in CERTAIN:
            ref = sample_one(logits[i], p, generator(p.seed, device), *histories[i])
            assert out.token_ids[i] == ref, (i, p)
    alone = [
        sample(logits[i : i + 1], [p], [generator(p.seed, device)], [histories[i][0]], [histories[i][1]])
        for i, p in enumerate(MIXED)
        if p.seed is not None
    ]
    alone = [out_i.token_ids[0] for out_i in alone]
    assert alone == [t for t, p in zip(out.token_ids, MIXED) if p.seed is not None]

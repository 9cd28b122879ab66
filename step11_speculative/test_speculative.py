"""Step 11 tests: speculative decoding changes how fast tokens come, never which tokens come.

Greedy ids with prompt-lookup drafts equal those without (the same engine, speculation off: step 10's path),
over prompts that repeat themselves and prompts that do not, k from 1 to 5, blocks of 4 tokens (so that
drafts cross block edges and rejected tails are given back), stop tokens and max_tokens inside an accepted
run, preemption, aborts, the prefix cache, the engine core in a child process and the server. The rejection
sampler alone: its output law is the target's warped distribution (total variation <= 0.01), greedy exact,
seeded lanes reproducible. A draft model: its keys rolled back to the accepted tokens as each verification
is known, through pauses in drafting; its drafts equal a fresh draft's. The config: every bad field named; a
draft with another tokenizer refused.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import httpx
import pytest
import torch

from .config import EngineArgs
from .cuda_graph import padded_size
from .engine import LLMEngine
from .input_batch import PADDING_ROW
from .llm import LLM
from .ngram_proposer import NgramProposer
from .rejection_sampler import rejection_sample, warp
from .sampling_params import SamplingParams
from .spec_decode import SpeculativeConfig

BLOCK = 4
DEMO_DRAFT_ACCEPTANCE_FLOOR = 0.1  # the demo draft over PROMPTS, 40 greedy tokens, k = 4: measured 0.15
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "The Python interpreter",
    "x",
    "A list comprehension is a concise way to",
    "def f(x): return x\ndef g(x): return x\ndef h(x): return",  # extractive: the answer repeats the prompt
    "import os\nimport sys\nimport os\nimport sys\nimport",
    "Exceptions are raised when an error occurs. Exceptions are",
]


def greedy_ids(llm: LLM, prompts=PROMPTS, **fields) -> list[list[int]]:
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0, **fields})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(demo_snapshot):
    return LLM(model=str(demo_snapshot), block_size=BLOCK)


@pytest.fixture(scope="module")
def spec(demo_snapshot):
    return LLM(model=str(demo_snapshot), block_size=BLOCK, speculative_config=NGRAM)


def assert_no_block_held(llm: LLM) -> None:
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.block_tables


def test_greedy_equals_no_speculation(plain, spec):
    for max_tokens in (1, 2, 7, 40):
        assert greedy_ids(spec, max_tokens=max_tokens) == greedy_ids(plain, max_tokens=max_tokens)
    s = spec.stats
    assert (
        s.spec_decode_num_drafts > 0
        and 0 < s.spec_decode_num_accepted_tokens <= s.spec_decode_num_draft_tokens
    )
    assert s.spec_decode_num_accepted_tokens_per_pos[0] >= s.spec_decode_num_accepted_tokens_per_pos[-1]
    assert s.spec_decode_num_accepted_tokens == sum(s.spec_decode_num_accepted_tokens_per_pos)
    assert 1 < s.spec_decode_mean_acceptance_length <= 1 + NGRAM["num_speculative_tokens"]
    assert s.num_eager_verify_steps > 0  # on a CPU every verification runs eagerly
    assert_no_block_held(spec)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_equals_for_every_k_and_ngram_range(demo_snapshot, plain, k):
    config = {**NGRAM, "num_speculative_tokens": k, "prompt_lookup_min": 2 if k == 5 else 1}
    llm = LLM(
        model=str(demo_snapshot), block_size=BLOCK, speculative_config=config, enable_prefix_caching=False
    )
    assert greedy_ids(llm, max_tokens=24) == greedy_ids(plain, max_tokens=24)
    assert_no_block_held(llm)


# prompts for batches wider than a rung: PROMPTS, then again with a tail each
MANY = [PROMPTS[i % len(PROMPTS)] + " and" * (i // len(PROMPTS)) for i in range(17)]


@pytest.mark.parametrize("batch", [3, 5, 9, 17])
def test_uniform_verification_is_padded_to_a_rung(demo_snapshot, plain, batch):
    """A step whose every lane is a verification of k drafts is padded to its rung (padding lanes of
    1 + k tokens) and runs ``verify_forward``, the pass a CUDA graph captures on a GPU; the real lanes'
    logits equal the unpadded pass's; the greedy ids equal speculation off. On a CPU (no graph) the
    padded steps count as eager verification steps."""
    spec = LLM(model=str(demo_snapshot), block_size=BLOCK, max_num_seqs=32, speculative_config=NGRAM)
    runner, q = spec.engine.model_runner, 1 + NGRAM["num_speculative_tokens"]
    assert runner.capture_sizes == [1, 2, 4, 8, 16, 32]
    lanes = []  # (real lanes, padded lanes) of every padded verification
    verify_forward = runner.verify_forward

    def spy(num_lanes: int) -> torch.Tensor:
        logits = verify_forward(num_lanes)  # [num_lanes * q, V]
        real = int((runner.input_batch.np["rows"][:num_lanes] != PADDING_ROW).sum())
        lanes.append((real, num_lanes))
        torch.testing.assert_close(logits[: real * q], verify_forward(real))
        return logits

    runner.verify_forward = spy
    assert greedy_ids(spec, MANY[:batch], max_tokens=24) == greedy_ids(plain, MANY[:batch], max_tokens=24)
    assert runner.num_uniform_verify_steps == len(lanes) > 0
    assert all(n == padded_size(runner.capture_sizes, b) for b, n in lanes)
    assert (batch, padded_size(runner.capture_sizes, batch)) in lanes  # the whole batch, padded
    assert spec.stats.num_eager_verify_steps >= len(lanes)
    assert_no_block_held(spec)


def test_a_stop_token_inside_an_accepted_run_cuts_it(plain, spec):
    """The run is cut at the stop token: nothing after it is returned, and the stats count what was
    verified, not what was kept."""
    full = greedy_ids(plain, max_tokens=40)
    for ids in full:
        if len(ids) > 6:
            stop = ids[5]
            cut = greedy_ids(spec, prompts=[PROMPTS[full.index(ids)]], stop_token_ids=[stop])[0]
            assert cut == ids[: ids.index(stop) + 1]
    assert_no_block_held(spec)


def test_accepted_drafts_count_only_the_drafts_a_request_keeps(spec):
    """A run cut by max_tokens or a stop token counts as accepted only the drafts appended before the cut
    (vllm #56101; here max_tokens=2 counted 2 accepted for the 1 kept)."""
    prompt = PROMPTS[5]  # its first verification accepts its first two drafts
    full = greedy_ids(spec, prompts=[prompt], max_tokens=12)[0]
    for fields in [{"max_tokens": 2}, {"stop_token_ids": [full[1]]}, {"max_tokens": 3}, {}]:
        before = spec.engine.stats
        ids = greedy_ids(spec, prompts=[prompt], **{"max_tokens": 12, **fields})[0]
        after = spec.engine.stats
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        per_pos = [
            a - b
            for a, b in zip(
                after.spec_decode_num_accepted_tokens_per_pos, before.spec_decode_num_accepted_tokens_per_pos
            )
        ]
        assert drafts >= 1 and ids == full[: len(ids)], fields
        # the prefill makes the first token; each verification its kept drafts and at most one more
        assert len(ids) - 1 - drafts <= accepted <= len(ids) - 1, (fields, ids, drafts, accepted)
        assert accepted == sum(per_pos), fields
    assert_no_block_held(spec)


@pytest.mark.parametrize("block_size, num_kv_blocks", [(4, 15), (2, 29)])
def test_drafts_take_only_the_blocks_no_running_request_needs(demo_snapshot, block_size, num_kv_blocks):
    """Small pools that fit the requests without speculation (found by a sweep): drafts take only what is
    left once every running request has room for its next token, so nobody is preempted for a draft (the
    drafts of an older request had taken the block a younger one needed) and the ids are unchanged."""
    params = SamplingParams(max_tokens=12, temperature=0)
    outputs, stats = {}, {}
    for config in (None, {"method": "ngram", "num_speculative_tokens": 6}):
        llm = LLM(
            model=str(demo_snapshot),
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=2,
            speculative_config=config,
        )
        outputs[config is None] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        stats[config is None] = llm.engine.stats
    assert stats[True].num_preemptions == 0  # the workload fits without speculation
    assert stats[False].num_preemptions == 0 and stats[False].spec_decode_num_drafts > 0
    assert outputs[True] == outputs[False]


def test_the_prefix_cache_never_holds_a_rejected_draft(demo_snapshot, plain, spec):
    """After speculative runs the cache holds these prompts' blocks; a plain engine sharing nothing
    agrees with the answers read from them, and every registered block holds accepted tokens only."""
    first = greedy_ids(spec)
    engine = spec.engine
    outputs = {tuple(engine.tokenizer.encode(p)) + tuple(ids) for p, ids in zip(PROMPTS, first)}
    for block in engine.block_manager.blocks:
        if block.block_hash is not None:
            assert any(
                tuple(block.token_ids) == seq[i : i + BLOCK]
                for seq in outputs
                for i in range(0, len(seq), BLOCK)
            )
    assert greedy_ids(spec) == first == greedy_ids(plain)  # the second run reads the cached blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_and_aborts_mid_run(demo_snapshot, plain, method):
    """A pool of 24 blocks of 4 tokens for 6 requests of ~50 tokens: verifications preempt and are
    preempted; an aborted request frees everything (the draft model's blocks too); the others' ids are
    unchanged."""
    config = NGRAM if method == "ngram" else {"method": method, "model": str(demo_snapshot)}
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        num_kv_blocks=24,
        max_num_seqs=6,
        speculative_config=config,
    )
    params = SamplingParams(max_tokens=40, temperature=0)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ids))}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
        if steps == 6:
            engine.abort_request("1")
    assert engine.stats.num_preemptions > 0 and engine.stats.spec_decode_num_drafts > 0
    want = greedy_ids(plain, max_tokens=40)
    for i in range(len(ids)):
        if i != 1:
            assert got[str(i)] == want[i], i
    assert engine.block_manager.num_free_blocks == 24
    if method == "draft_model":
        assert len(engine.proposer.free_blocks) == 24 and not engine.proposer.block_tables


def test_the_core_in_a_child_process_and_the_server(demo_snapshot, plain):
    from step10_engine_core.test_engine_core import counter, serve

    from .api_server import build_app
    from .core_client import AsyncMPClient

    want = greedy_ids(plain, max_tokens=24)
    texts = [o.outputs[0].text for o in plain.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0))]
    child = LLM(model=str(demo_snapshot), block_size=BLOCK, speculative_config=NGRAM, multiprocessing=True)
    try:
        assert greedy_ids(child, max_tokens=24) == want
        assert child.stats.spec_decode_num_drafts > 0
    finally:
        child.engine_core.shutdown()
    args = EngineArgs(model=str(demo_snapshot), block_size=BLOCK, speculative_config=json.dumps(NGRAM))
    with serve(build_app(AsyncMPClient(args))) as url:
        for prompt, want_text in zip(PROMPTS, texts):
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
            text = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
            assert text == want_text
        stats = httpx.get(url + "/v1/engine/stats").json()
        drafts, accepted = (
            counter(url, f"vllm:spec_decode_num_{n}_total") for n in ("drafts", "accepted_tokens")
        )
        assert drafts == stats["spec_decode_num_drafts"] > 0
        assert accepted == stats["spec_decode_num_accepted_tokens"] > 0
        assert counter(url, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
        assert 0 < stats["spec_decode_acceptance_rate"] <= 1 < stats["spec_decode_mean_acceptance_length"]
        assert stats["features"]["speculative_decoding"] == "ngram"


def test_seeded_sampling_is_reproducible(spec):
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=50, seed=11)
    a, b = (spec.generate(PROMPTS[3:5], params) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert_no_block_held(spec)


@pytest.mark.parametrize("block_size", [3, 4])
def test_choices_that_share_a_block_verify_into_their_own_copies(demo_snapshot, block_size):
    """n = 2 forks the prompt's partly filled last block; a choice's first verification copies it and
    takes blocks past it in one step, so the copy is not the table's last entry: it must still replace
    the shared block in the device's row, or the drafts land in the other choice's KV. Seeded choices
    then come out as at block size 16, where the first verification fits in the copied block."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, n=2)
    prompt = ["The cat sat on the mat. The cat"]  # 10 tokens: the last block part-filled at 3 and 4

    def choices(size: int) -> list[list[int]]:
        llm = LLM(model=str(demo_snapshot), max_num_seqs=4, block_size=size, speculative_config=NGRAM)
        out = llm.generate(prompt, params)[0]
        assert_no_block_held(llm)
        return [c.token_ids for c in out.outputs]

    assert choices(block_size) == choices(16)


# ---- the rejection sampler alone: a stand-in vocabulary of 8 tokens ----

V = 8


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between the empirical law of ``counts`` [V] and ``p`` [V]."""
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize(
    "fields",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8, min_p=0.05)],
    ids=["plain", "top-k", "top-p+min-p"],
)
def test_sampled_tokens_follow_the_warped_target_distribution(fields):
    """40,000 lanes of k = 2 drafts against fixed target logits: the first emitted token's law is the
    warped p of row 0, and the second's (given the first draft accepted) is row 1's; the drafts are right
    about as often as wrong (half drawn from p, half uniform). TV <= 0.01 each."""
    torch.manual_seed(0)
    B, k = 40_000, 2
    rows = torch.randn(k + 1, V) * 1.5  # [3, V] the target's logits after each position
    params = SamplingParams(**fields)
    p = warp(rows, [params] * (k + 1)).softmax(dim=-1)  # [3, V]
    from_p = torch.stack([torch.multinomial(p[i], B, replacement=True) for i in range(k)], dim=1)  # [B, k]
    uniform = torch.randint(0, V, (B, k))
    drafts = torch.where(torch.rand(B, 1) < 0.5, from_p, uniform).tolist()
    out = rejection_sample(rows.repeat(B, 1), drafts, [params] * B, [None] * B)  # [B, 2]
    accepted, token = out[:, 0], out[:, 1]
    d = torch.tensor(drafts)
    first = torch.where(accepted >= 1, d[:, 0], token)
    assert 0.2 < (accepted >= 1).float().mean() < 0.9  # sometimes right, sometimes wrong
    assert tv(torch.bincount(first, minlength=V).float(), p[0]) <= 0.01
    on = accepted >= 1
    second = torch.where(accepted[on] >= 2, d[on, 1], token[on])
    assert tv(torch.bincount(second, minlength=V).float(), p[1]) <= 0.01


def test_drafts_of_a_draft_model_keep_the_target_distribution():
    """Drafts drawn from a draft model's own law q (k = 1), accepted with min(1, p/q), else the residual:
    the emitted token's law is the warped p, TV <= 0.01 over 40,000 lanes."""
    torch.manual_seed(2)
    B = 40_000
    rows = torch.randn(2, V) * 1.5  # [2, V] the target's rows: the judged position, the bonus
    params = SamplingParams(temperature=0.8, top_k=6)
    p = warp(rows, [params] * 2).softmax(dim=-1)[0]  # [V]
    q = (rows[0] + torch.randn(V)).softmax(dim=-1)  # [V] the draft's law: near p, not p
    drafts = torch.multinomial(q, B, replacement=True)[:, None].tolist()  # [B, 1]
    out = rejection_sample(rows.repeat(B, 1), drafts, [params] * B, [None] * B, [q[None]] * B)
    first = torch.where(out[:, 0] >= 1, torch.tensor(drafts)[:, 0], out[:, 1])
    assert 0.1 < (out[:, 0] >= 1).float().mean() < 0.9
    assert tv(torch.bincount(first, minlength=V).float(), p) <= 0.01


def test_greedy_verification_is_exact_and_takes_the_bonus():
    rows = torch.tensor([[0.0, 3, 1], [5, 0, 1], [0, 1, 9]])  # argmax 1, 0, 2
    greedy = SamplingParams(temperature=0)
    lanes = [[1, 0], [1, 2], [2, 0]]  # all right (bonus 2); right then wrong (0); wrong at once (1)
    out = rejection_sample(rows.repeat(3, 1), lanes, [greedy] * 3, [None] * 3)
    assert out.tolist() == [[2, 2], [1, 0], [0, 1]]


def test_a_seeded_lane_does_not_depend_on_its_batch():
    torch.manual_seed(1)
    rows = torch.randn(3, V)
    params = SamplingParams(temperature=1.0, seed=5)

    def run(batch: int) -> list[int]:
        gens = [torch.Generator().manual_seed(5) for _ in range(batch)]
        return rejection_sample(rows.repeat(batch, 1), [[3, 4]] * batch, [params] * batch, gens)[0].tolist()

    assert run(1) == run(7)


# ---- the proposer and the config ----


def test_ngram_proposes_what_followed_the_latest_longest_match():
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert prop.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]  # the latest 3-gram match
    assert prop.propose([5, 1, 2, 6, 0, 2], 2) == [6, 0]  # no 3- or 2-gram: the 1-gram [2]
    assert prop.propose([1, 2, 3, 4], 2) == [4, 4]  # no match at all: the last id, k times
    assert prop.propose([4, 4], 5) == [4] * 5  # what is left after the match (one id), periodically
    assert NgramProposer(SpeculativeConfig(prompt_lookup_min=2)).propose([5, 1, 2, 6, 0, 2], 2) == [2, 2]


def test_ngram_drafts_are_always_k():
    """A continuation that reaches the end after d < k ids goes on with period d; no match (or a single
    id) proposes the last id k times; k < 1 proposes nothing."""
    prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    assert prop.propose([5, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # the 2-gram [1, 2] at d = 3
    assert prop.propose([9, 7, 8, 9, 7, 8, 9], 7) == [7, 8, 9, 7, 8, 9, 7]  # the 3-gram [7, 8, 9]: d = 3
    assert prop.propose([3, 6, 6], 4) == [6, 6, 6, 6]  # the 1-gram [6] at d = 1
    assert prop.propose([7], 3) == [7, 7, 7]
    assert prop.propose([1, 2, 3], 0) == []
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        ids = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        k = int(torch.randint(1, 9, (1,), generator=rng))
        assert len(prop.propose(ids, k)) == k


def reference_lookup(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup written out one comparison at a time: the oracle of ``propose``."""
    if k < 1:
        return []
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):  # the most recent window first, the suffix excluded
            if ids[start : start + n] == suffix:
                rest = ids[start + n :]  # what followed it, d ids, repeated with period d
                return [rest[j % len(rest)] for j in range(k)]
    return [ids[-1]] * k


def test_the_string_lookup_equals_the_written_out_one():
    """The string lookup (one character an id, ``str.rfind``) equals the written-out one for every row, over
    batches of mixed lengths, alphabets (ids around the surrogates and up to 0x10FFFF too), n ranges and k
    (k < 1 included)."""
    rng = random.Random(7)
    for _ in range(300):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        prop = NgramProposer(SpeculativeConfig(prompt_lookup_min=min_n, prompt_lookup_max=max_n))
        base = rng.choice([0, 0, 0xD800 - 2, 0x110000 - 50])  # a lone surrogate is a character like any other
        batch = [
            [base + rng.randrange(rng.choice([2, 3, 50])) for _ in range(rng.randint(1, 40))]
            for _ in range(rng.randint(1, 9))
        ]
        ks = [rng.randint(-1, 6) for _ in batch]
        want = [reference_lookup(ids, k, min_n, max_n) for ids, k in zip(batch, ks)]
        assert [prop.propose(ids, k) for ids, k in zip(batch, ks)] == want


def test_disable_by_batch_size_counts_the_batch_the_step_would_run(demo_snapshot):
    """disable_by_batch_size compares the batch a step would run, the running and waiting requests up to
    max_num_seqs, not the running alone: 6 prompts of 100 tokens, 6 places, a budget of 512 tokens (5
    prompts a step), a threshold of 6: no drafts while all 6 are there, though only 5 run in the first
    decode step (the drafts would then take the budget that admits the sixth). With 2 places the batch is
    never 6: drafts from the start. Greedy ids equal speculation off."""
    for places, most_when_proposing in ((6, 5), (2, 6)):
        args = dict(model=str(demo_snapshot), block_size=BLOCK, max_num_seqs=places)
        engine = LLMEngine(**args, speculative_config={**NGRAM, "disable_by_batch_size": 6})
        plain = LLMEngine(**args)
        enqueued_when_proposing = []
        propose_all = engine.proposer.propose_all

        def spy(seqs, ks, engine=engine, seen=enqueued_when_proposing, propose_all=propose_all):
            seen.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
            propose_all(seqs, ks)

        engine.proposer.propose_all = spy
        ids = engine.tokenizer.encode(" ".join(PROMPTS))
        prompts = [(ids * 10)[i : i + 100] for i in range(6)]
        got, want = {}, {}
        for llm_engine, out in ((engine, got), (plain, want)):
            for i, prompt in enumerate(prompts):
                llm_engine.add_request(str(i), prompt, SamplingParams(max_tokens=6 + i, temperature=0))
            while llm_engine.has_unfinished_requests():
                for o in llm_engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert got == want
        assert max(enqueued_when_proposing) == most_when_proposing
        assert engine.stats.spec_decode_num_drafts > 0


def test_drafts_stop_at_the_window_not_at_max_tokens(demo_snapshot):
    """Drafts are k until the window (max_model_len: 48 tokens here, a pool of 12 blocks) leaves less
    room, then max_model_len - len - 1 (that step verifies eagerly); a request's max_tokens does not cut
    them (what passes it is dropped). Greedy ids equal speculation off either way."""
    args = dict(model=str(demo_snapshot), block_size=BLOCK, num_kv_blocks=12)
    engine, plain = LLMEngine(**args, speculative_config=NGRAM), LLMEngine(**args)
    assert engine.max_model_len == 48
    seen = []  # (length, drafts) of every sequence proposed for
    propose_all = engine.proposer.propose_all

    def spy(seqs, ks):
        propose_all(seqs, ks)
        seen.extend((len(seq), len(seq.spec_token_ids)) for seq in seqs)

    engine.proposer.propose_all = spy
    prompt = engine.tokenizer.encode(PROMPTS[4])
    for llm_engine in (engine, plain):
        for m in range(len(prompt) - 4, len(prompt)):  # to the window: lengths of every residue mod 1 + k
            llm_engine.add_request(str(m), prompt[:m], SamplingParams(max_tokens=48 - m, temperature=0))
        llm_engine.add_request("short", prompt[:5], SamplingParams(max_tokens=3, temperature=0))
    got, want = ({}, {})
    for llm_engine, out in ((engine, got), (plain, want)):
        while llm_engine.has_unfinished_requests():
            for o in llm_engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == want and len(got["short"]) == 3
    assert all(n == min(4, 48 - L - 1) for L, n in seen) and all(L + n < 48 for L, n in seen)
    assert any(n < 4 for _, n in seen) and (6, 4) in seen  # the window cut some; "short" (5 + 1) got 4


@pytest.mark.parametrize(
    "config, named",
    [
        ({}, "speculative_config.method: required (one of ['ngram', 'draft_model']"),
        ("{}", "speculative_config.method: required"),
        ({"num_speculative_tokens": 2, "method": None}, "speculative_config.method: required"),
        ({"method": "medusa"}, "speculative_config.method"),
        ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 512}, "num_speculative_tokens=512: must be less than the"),
        ({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
        ({**NGRAM, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({"num_speculative_token": 2}, "speculative_config.num_speculative_token"),
        ({"method": "draft_model"}, "speculative_config.model"),
        ({"method": "ngram", "model": "demo"}, "speculative_config.model"),
        ({"method": "draft_model", "model": "demo/draft", "prompt_lookup_min": 2}, "prompt_lookup_min: for"),
        ({"model": "demo/draft", "prompt_lookup_max": 2}, "prompt_lookup_max: for"),  # a draft_model's
        ({"method": "draft_model", "model": ""}, "speculative_config.model='': model '': no such folder"),
        ("{not json", "speculative_config="),
        ([1], "speculative_config="),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(demo_snapshot, config, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        EngineArgs(model=str(demo_snapshot), speculative_config=config)


def test_a_config_needs_a_method_or_a_model(demo_snapshot, run_main):
    """As vLLM's SpeculativeConfig: a model without a method drafts with that model ("draft_model"); with
    neither ({}) the config is refused naming method, also on the server's command line: one line on
    stderr, exit status 2, before any model loads."""
    from .__main__ import main as cli_main

    args = EngineArgs(model=str(demo_snapshot), speculative_config={"model": "demo/draft"})
    assert args.speculative.method == "draft_model" and args.draft_folder.name == "draft"
    status, out, err = run_main(cli_main, ["--model", "demo", "--port", "0", "--speculative-config", "{}"])
    assert status == 2 and out == "", err
    assert err == (
        "error: speculative_config.method: required (one of ['ngram', 'draft_model']; or a draft model in "
        "speculative_config.model)\n"
    )


@pytest.mark.parametrize("draft", [None, "demo/draft"])
def test_async_scheduling_overlaps_the_steps_that_do_not_speculate(demo_snapshot, plain, draft):
    """With async scheduling on, steps of a batch of disable_by_batch_size or more run overlapped (a step
    left in flight when step() returns), and once the batch shrinks below it the steps drain the one in
    flight and verify drafts serially: 6 requests of 4 to 39 tokens, a threshold of 3. Greedy ids equal
    speculation off, with prompt lookup and with the demo's draft model."""
    config = {**NGRAM, "disable_by_batch_size": 3}
    if draft:
        config = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 3,
        }
    engine = LLMEngine(
        model=str(demo_snapshot), block_size=BLOCK, async_scheduling=True, speculative_config=config
    )
    assert engine.async_scheduling
    got, overlapped, drafted = {}, 0, []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4 + 7 * i, temperature=0))
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(int(o.request_id), []).extend(o.new_token_ids)
        overlapped += engine.in_flight is not None
        drafted.append(engine.stats.spec_decode_num_drafts)
    want = [
        o.outputs[0].token_ids
        for o in plain.generate(
            PROMPTS, [SamplingParams(max_tokens=4 + 7 * i, temperature=0) for i in range(len(PROMPTS))]
        )
    ]
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert overlapped > 0 and drafted[-1] > 0  # both kinds of step ran
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_kv_cache_memory_counts_the_draft_models_pool(demo_snapshot):
    """With a draft model, kv_cache_memory covers both pools (as many blocks each): 8 MiB give
    floor(8 MiB / (target block + draft block)) blocks, and the two pools together fit in it."""
    from common.weights import REPO_ROOT

    from .kv_cache import PagedKVCache

    budget = 8 * 2**20
    config = {"method": "draft_model", "model": str(REPO_ROOT / "demo" / "draft")}
    engine = LLMEngine(model=str(demo_snapshot), kv_cache_memory=budget, speculative_config=config)
    target, draft = engine.config, engine.proposer.model.config
    per_block = [PagedKVCache.block_bytes(c, engine.args.block_size, torch.float32) for c in (target, draft)]
    assert engine.args.num_kv_blocks == budget // sum(per_block)
    pools = [engine.kv_cache, engine.proposer.kv_cache]
    held = sum(t.numel() * t.element_size() for pool in pools for t in pool.k + pool.v)
    assert held - sum(per_block) <= budget  # the scratch blocks (one a pool) beside the budget's blocks


def test_a_draft_model_with_another_tokenizer_is_refused(demo_snapshot, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(demo_snapshot, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 50257}))
    draft = {"method": "draft_model", "model": str(other)}
    with pytest.raises(ValueError, match="vocabulary has 50257 tokens"):
        EngineArgs(model=str(demo_snapshot), speculative_config=draft)
    (other / "config.json").write_text(json.dumps({**config, "n_positions": 256}))
    with pytest.raises(ValueError, match="window"):
        EngineArgs(model=str(demo_snapshot), speculative_config=draft)
    (other / "config.json").write_text(json.dumps(config))
    (other / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="merges.txt differs"):
        EngineArgs(model=str(demo_snapshot), speculative_config=draft)
    merges = (demo_snapshot / "merges.txt").read_text(encoding="utf-8")
    (other / "merges.txt").write_bytes(merges.replace("\n", "\r\n").encode())  # the same merges, CRLF
    vocab = json.loads((demo_snapshot / "vocab.json").read_text(encoding="utf-8"))
    (other / "vocab.json").write_text(json.dumps(vocab, indent=2))  # the same mapping, laid out otherwise
    assert EngineArgs(model=str(demo_snapshot), speculative_config=draft).draft_folder == other
    (other / "merges.txt").unlink()  # no tokenizer: named as the draft's field, not the target's model
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*merges\.txt"):
        EngineArgs(model=str(demo_snapshot), speculative_config=draft)
    assert EngineArgs(model=str(demo_snapshot), speculative_config="null").speculative is None


def test_a_draft_that_cannot_be_had_or_loaded_is_named(demo_snapshot, tmp_path, monkeypatch):
    """A Hub draft that cannot be fetched is a ConnectionError, weights that do not fit the draft's
    config.json a ValueError: both name speculative_config.model, not the target's model."""
    from common.weights import REPO_ROOT

    from . import spec_decode

    draft = tmp_path / "draft"
    shutil.copytree(REPO_ROOT / "demo" / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "n_embd": 2 * config["n_embd"]}))
    with pytest.raises(ValueError, match=r"speculative_config\.model \(the draft in .*draft\): .*shape"):
        LLMEngine(model=str(demo_snapshot), speculative_config={"method": "draft_model", "model": str(draft)})

    def offline(spec):
        raise ConnectionError(f"model {spec!r}: the Hugging Face Hub could not be reached")

    monkeypatch.setattr(spec_decode, "resolve_model", offline)
    with pytest.raises(ConnectionError, match=r"speculative_config\.model='someone/draft': model"):
        EngineArgs(
            model=str(demo_snapshot), speculative_config={"method": "draft_model", "model": "someone/draft"}
        )


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A 2-layer GPT-2 with random weights and the demo's tokenizer and window: a draft that is mostly
    wrong, so that verification rejects and rolls back the draft's own cache too."""
    from conftest import write_random_snapshot

    return write_random_snapshot(
        tmp_path_factory.mktemp("draft"), n_positions=512, n_embd=32, n_layer=2, n_head=4
    )


@pytest.mark.parametrize("draft", ["itself", "random"])
def test_a_draft_model_keeps_the_greedy_output(demo_snapshot, plain, random_draft, draft):
    """The demo checkpoint drafting for itself (every draft accepted) and a random draft (nearly none):
    greedy ids equal the plain engine's; every draft block is given back at the end; seeded sampling is
    reproducible."""
    model = str(demo_snapshot if draft == "itself" else random_draft)
    config = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    llm = LLM(model=str(demo_snapshot), block_size=BLOCK, speculative_config=config)
    assert greedy_ids(llm, max_tokens=24) == greedy_ids(plain, max_tokens=24)
    s = llm.stats
    rate = s.spec_decode_acceptance_rate
    assert rate == 1.0 if draft == "itself" else rate < 0.5
    proposer = llm.engine.proposer
    assert not proposer.block_tables and len(proposer.free_blocks) == llm.engine.args.num_kv_blocks
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=5)
    a, b = (llm.generate(PROMPTS[:3], params) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert_no_block_held(llm)


def test_the_draft_passes_propose_the_drafts_greedy_continuation(demo_snapshot, plain):
    """The proposer alone, the demo drafting for itself, over 30 steps of 3-5 sequences of other lengths
    and k (1-4; 0: none this step, its blocks given back), each step accepting a random number of the
    drafts and the next true token (the engine's ``rollback``), or none when the drafts were dropped
    unverified (no rollback: one true token), and at times 1-3 steps without any proposal (drafting
    paused, one true token each): every draft equals the plain engine's greedy continuation of its
    sequence, whether the draft caught up by one decode pass, two, or an eager prefill (a new sequence,
    one back after a step without drafts, or after a pause); the passes are padded to rungs (an idle lane
    writes the scratch slot) and every block comes back."""
    from .draft_model import DraftModelProposer
    from .sequence import Sequence

    engine = plain.engine
    proposer = DraftModelProposer(demo_snapshot, "cpu", torch.float32, "torch", BLOCK, 160, 8)
    truth = {}  # prompt index -> its greedy continuation by the plain engine, 60 tokens

    def greedy(i: int) -> list[int]:
        if i not in truth:
            params = SamplingParams(max_tokens=60, temperature=0)
            out = plain.generate(
                prompt_token_ids=[engine.tokenizer.encode(PROMPTS[i])], sampling_params=params
            )
            truth[i] = engine.tokenizer.encode(PROMPTS[i]) + out[0].outputs[0].token_ids
        return truth[i]

    rng, seqs, gaps, widths = random.Random(0), {}, [], []
    plan, run = proposer.plan, proposer.run
    proposer.plan = lambda s, ks, c: (gaps.append(c), plan(s, ks, c))[1]
    proposer.run = lambda n, w: (widths.append(n), run(n, w))[1]
    for step in range(30):
        for i in rng.sample(range(len(PROMPTS)), rng.randint(3, 5)):
            if i not in seqs:
                ids = greedy(i)[: len(engine.tokenizer.encode(PROMPTS[i])) + 1]
                seqs[i] = Sequence(
                    str(i), None, ids, SamplingParams(temperature=0), engine.tokenizer, 512, "cpu"
                )
        live = [i for i in seqs if len(seqs[i]) + 5 < len(greedy(i))]
        ks = [rng.choice([0, 1, 2, 3, 4, 4, 4]) for _ in live]
        proposer.propose_all([seqs[i] for i in live], ks)
        for i, k in zip(live, ks):
            seq, n = seqs[i], len(seqs[i])
            assert seq.spec_token_ids == (greedy(i)[n : n + k] if k else []), (step, i, k)
            verified = k >= 1 and rng.random() < 0.8  # else dropped unverified (no room in the step)
            accepted = rng.randint(0, k) if verified else 0
            seq.token_ids += greedy(i)[n : n + accepted + 1]
            if verified:
                proposer.rollback(seq.request_id, len(seq) - 1)
        for _ in range(rng.choice([0, 0, 0, 1, 3])):  # steps without proposals: one true token each
            for i in live:
                seqs[i].token_ids += greedy(i)[len(seqs[i]) : len(seqs[i]) + 1]
    assert set(gaps) == {1, 2} and widths and set(widths) <= {1, 2, 4, 8}
    proposer.propose_all([], [])
    assert len(proposer.free_blocks) == 160 and not proposer.block_tables


@pytest.mark.parametrize("load", ["pauses", "short of blocks"])
def test_the_draft_rolls_back_when_its_verification_is_known(demo_snapshot, plain, load):
    """The demo's draft, its drafting paused and resumed: two requests decode, and a one-token request joins
    every third step, bringing the batch to disable_by_batch_size (3), so that drafting stops for a step or
    two; or six requests in a pool of 24 blocks of 4, so that drafts are dropped for want of room and
    sequences preempted. After every step each sequence's draft holds keys for its accepted tokens at most
    (a rejected draft's key goes when its verification is known, not at the next proposal, which a pause
    puts off), and every draft proposed equals a fresh draft's, one that computes the same tokens from
    scratch (in a pool of its own, large enough). Greedy ids equal speculation off."""
    from .draft_model import DraftModelProposer

    config = {"method": "draft_model", "model": "demo/draft", "num_speculative_tokens": 4}
    prompts, args = PROMPTS, {"num_kv_blocks": 24, "max_num_seqs": 6}  # the draft's own pool as small
    if load == "pauses":
        prompts, args, config = [PROMPTS[0], PROMPTS[2]], {}, {**config, "disable_by_batch_size": 3}
    engine = LLMEngine(model=str(demo_snapshot), block_size=BLOCK, speculative_config=config, **args)
    draft = engine.proposer
    fresh = DraftModelProposer(engine.args.draft_folder, "cpu", torch.float32, "torch", BLOCK, 96, 8)
    propose_all, proposals, unverified = draft.propose_all, [], 0

    def checked(seqs, ks):
        nonlocal unverified
        unverified += len(draft.num_written)  # drafts dropped unverified, or preempted, since the last call
        fresh.propose_all(seqs, ks)  # a draft that has seen none of them: a prefill of every token
        want = [seq.spec_token_ids for seq in seqs]
        fresh.propose_all([], [])  # and forgets them
        propose_all(seqs, ks)
        proposals.extend((seq.spec_token_ids, w) for seq, w in zip(seqs, want) if seq.spec_token_ids)

    draft.propose_all = checked
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=0))
    got, steps, paused = {}, 0, 0
    while engine.has_unfinished_requests():
        if load == "pauses" and steps % 3 == 2 and steps < 30:
            engine.add_request(f"one{steps}", PROMPTS[1], SamplingParams(max_tokens=1, temperature=0))
        paused += not engine.speculating()
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        for seq in engine.scheduler.running:
            assert draft.num_computed.get(seq.request_id, 0) <= len(seq) - 1, (steps, seq.request_id)
    assert [got[str(i)] for i in range(len(prompts))] == greedy_ids(plain, prompts)
    assert len(proposals) >= 20 and engine.stats.spec_decode_num_accepted_tokens > 0
    if load == "pauses":
        assert paused >= 5
    else:
        assert engine.stats.num_preemptions > 0 and unverified > 0
    assert [(got, want) for got, want in proposals if got != want] == []


def test_the_demo_draft_keeps_the_greedy_output_and_guesses_well(demo_snapshot, plain):
    """The shipped demo draft (demo/draft: demo/train.py at 2 layers, width 128, the demo's tokenizer) is
    accepted by check_draft for the demo checkpoint; greedy ids equal the plain engine's; and it guesses
    often enough to matter (ACCEPTANCE_FLOOR measured with margin; see demo/draft/README.md)."""
    from common.weights import REPO_ROOT

    folder = REPO_ROOT / "demo" / "draft"
    config = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 4}
    assert EngineArgs(model=str(demo_snapshot), speculative_config=config).draft_folder == folder
    llm = LLM(model=str(demo_snapshot), block_size=BLOCK, speculative_config=config)
    assert greedy_ids(llm) == greedy_ids(plain)
    s = llm.stats
    assert s.spec_decode_num_drafts > 0 and s.spec_decode_acceptance_rate > DEMO_DRAFT_ACCEPTANCE_FLOOR
    assert_no_block_held(llm)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_block_leaks_after_many_random_requests(demo_snapshot, method):
    """1,000 requests (random prompts cut from PROMPTS, max_tokens 1-16, greedy or seeded sampling, one in
    ten aborted after a random number of steps) through a pool of 20 blocks with speculation: every block
    is free at the end, none held by a finished request, and the greedy ones equal the plain engine's."""
    import random

    rng = random.Random(0)
    args = dict(model=str(demo_snapshot), block_size=BLOCK, num_kv_blocks=20, max_num_seqs=8)
    config = {**NGRAM, "num_speculative_tokens": 3}
    if method == "draft_model":  # the demo drafting for itself, with its own pool of 20 blocks
        config = {"method": method, "model": str(demo_snapshot), "num_speculative_tokens": 3}
    engine = LLMEngine(**args, speculative_config=config)
    plain = LLMEngine(**args)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    requests = {}
    for i in range(1000):
        ids = rng.choice(prompts)[: rng.randint(1, 12)]
        greedy = rng.random() < 0.7
        fields = dict(max_tokens=rng.randint(1, 16), temperature=0 if greedy else 0.9, seed=i)
        requests[str(i)] = (ids, SamplingParams(**fields), greedy, rng.random() < 0.1, rng.randint(0, 5))
    got = {rid: [] for rid in requests}
    pending, steps = list(requests), 0
    while pending or engine.has_unfinished_requests():
        for rid in pending[: rng.randint(0, 6)]:
            engine.add_request(rid, requests[rid][0], requests[rid][1])
            requests[rid] += (steps,)
        pending = [rid for rid in pending if len(requests[rid]) == 5]
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        steps += 1
        for rid, (_, _, _, abort, after, *added) in requests.items():
            if abort and added and added[0] + after == steps:
                engine.abort_request(rid)
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and not blocks.block_tables
    assert engine.stats.spec_decode_num_drafts > 0 and engine.stats.num_preemptions > 0
    if method == "draft_model":
        assert len(engine.proposer.free_blocks) == 20 and not engine.proposer.block_tables
    greedy = [rid for rid, r in requests.items() if r[2] and not r[3]]
    for rid in greedy[:200]:
        plain.add_request(rid, requests[rid][0], requests[rid][1])
    want = {rid: [] for rid in greedy[:200]}
    while plain.has_unfinished_requests():
        for out in plain.step():
            want[out.request_id] += out.new_token_ids
    assert all(got[rid] == want[rid] for rid in want)


@pytest.mark.slow
def test_verification_through_the_triton_kernel(demo_snapshot, plain):
    """The Triton kernel's query-length > 1 path (through Triton's interpreter on the CPU) verifies drafts
    as the torch backend does: the same greedy ids."""
    pytest.importorskip("triton")
    llm = LLM(
        model=str(demo_snapshot), block_size=BLOCK, speculative_config=NGRAM, attention_backend="triton"
    )
    assert greedy_ids(llm, prompts=PROMPTS[3:6], max_tokens=12) == greedy_ids(
        plain, prompts=PROMPTS[3:6], max_tokens=12
    )
    assert llm.stats.spec_decode_num_accepted_tokens > 0
    assert llm.engine.model_runner.num_uniform_verify_steps > 0  # 3 lanes padded to 4: the graphs' pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_verification_replays_its_cuda_graph(demo_snapshot, batch):
    """fp32 on CUDA, CUDA graphs, the Triton backend: an extractive batch (prompts that repeat, far from
    the window) verifies in uniform steps only, each replaying its rung's graph (no eager verification
    step); the replayed logits of the real lanes equal the eager padded pass's bit for bit; the greedy ids
    equal speculation off."""
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[5], PROMPTS[3] + "\ndef k(x): return x"][:batch]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    args = dict(model=str(demo_snapshot), device="cuda", multiprocessing=False)
    spec = LLM(**args, speculative_config=NGRAM)
    runner, q = spec.engine.model_runner, 1 + NGRAM["num_speculative_tokens"]
    assert runner.attention_backend == "triton" and runner.verify_graph_runner is not None
    assert runner.verify_graph_runner.stats.sizes == [b * q for b in runner.capture_sizes]
    replays = []  # the token count of every verification replay
    replay = runner.verify_graph_runner.replay

    def spy(size: int) -> torch.Tensor:
        logits = replay(size)  # [size, V]
        real = int((runner.input_batch.np["rows"][: size // q] != PADDING_ROW).sum()) * q
        with torch.inference_mode():
            eager = runner.verify_forward(size // q)  # the same buffers, eagerly
        assert torch.equal(logits[:real], eager[:real]), (logits[:real] - eager[:real]).abs().max().item()
        replays.append(size)
        return logits

    runner.verify_graph_runner.replay = spy
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in LLM(**args).generate(prompts, params)]
    assert got == want
    s = spec.stats
    assert replays and len(replays) == runner.num_uniform_verify_steps
    assert s.num_eager_verify_steps == 0 and s.spec_decode_num_accepted_tokens > 0
    assert_no_block_held(spec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_draft_passes_replay_their_cuda_graphs(demo_snapshot, batch):
    """fp32 on CUDA, the Triton backend, the demo drafting for itself: every decode pass of the draft
    replays its rung's graph (none runs eagerly after the capture), the replayed logits of the real lanes
    equal the eager pass's bit for bit, nearly every draft is accepted, and the greedy ids equal
    speculation off."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    args = dict(model=str(demo_snapshot), device="cuda", multiprocessing=False)
    config = {"method": "draft_model", "model": str(demo_snapshot), "num_speculative_tokens": 4}
    spec = LLM(**args, speculative_config=config)
    proposer = spec.engine.proposer
    assert proposer.graph_runner.stats.sizes == proposer.capture_sizes
    replays, eager = [], []
    replay, decode_forward = proposer.graph_runner.replay, proposer.decode_forward

    def spy(num_lanes: int) -> torch.Tensor:
        logits = replay(num_lanes)  # [num_lanes, V]
        scratch = proposer.scratch_slot // proposer.block_size  # the padding lanes' block
        real = int((proposer.tables[:num_lanes, 0] != scratch).sum())
        assert torch.equal(logits[:real], decode_forward(num_lanes)[:real])  # the same buffers, eagerly
        replays.append(num_lanes)
        return logits

    proposer.graph_runner.replay = spy
    proposer.decode_forward = lambda *args: eager.append(args) or decode_forward(*args)
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:batch], params)]
    want = [o.outputs[0].token_ids for o in LLM(**args).generate(PROMPTS[:batch], params)]
    assert got == want
    assert replays and not eager and set(replays) <= set(proposer.capture_sizes)
    assert spec.stats.spec_decode_acceptance_rate > 0.9
    assert_no_block_held(spec)

"""Step 9 tests: prefix caching and n choices give step 8's outputs, and the block bookkeeping never leaks.

The oracle is step 8's engine, which computes every prompt whole: on the demo checkpoint with blocks of 4
tokens, prompts that share a prefix of every length around the block boundaries (greedy and seeded), a
prompt found whole in the cache, and eviction under a small pool while shared blocks are in use all give
its ids; n seeded choices equal n separate requests seeded seed + i, with one copy-on-write per choice
that writes into the shared last block. A property test drives the scheduler and block manager through
random requests (n > 1 among them), aborts and preemptions with a stand-in for the model that checks that
every sequence reads back its own prefix from its blocks; reference counts never go negative and no block
stays in use. The Triton kernel and the torch backend agree on a chunk of new queries over cached context.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import step8_async_scheduling

from .__main__ import parse_args
from .api_server import build_app
from .async_engine import AsyncEngine, EngineRequest, engine_features
from .block_manager import BlockManager, hash_block
from .engine import PLACEHOLDER_TOKEN_ID, LLMEngine
from .kernels import paged_attention as triton_attention
from .kernels import triton_usable
from .kv_cache import PagedKVCache
from .llm import LLM
from .metrics import ServerMetrics
from .model import AttentionMetadata, decode_attention_mask
from .model import paged_attention as torch_attention
from .sampling_params import RequestOutputKind, SamplingParams

BLOCK = 4
needs_triton = pytest.mark.skipif(
    not triton_usable("cuda" if torch.cuda.is_available() else "cpu"),
    reason="Triton's interpreter was not switched on before triton was imported",
)


@pytest.fixture(scope="module")
def llm(demo_snapshot):  # the overlapped path (step 8's, off by default on a CPU), which CUDA runs
    return LLM(model=str(demo_snapshot), block_size=BLOCK, async_scheduling=True)


@pytest.fixture(scope="module")
def oracle(demo_snapshot):
    return step8_async_scheduling.LLM(model=str(demo_snapshot), block_size=BLOCK)


def ids(outputs) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def check_blocks(bm: BlockManager) -> None:
    """The block manager's invariants: each block is held once per table that lists it (never a negative
    count), free exactly when nobody holds it, registered under its own hash, each registration numbered
    apart."""
    holders = [0] * bm.num_blocks
    for table in bm.block_tables.values():
        for b in table:
            holders[b] += 1
    assert [b.ref_count for b in bm.blocks] == holders
    assert set(bm.free_blocks) == {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert {h: b for h, b in bm.cached_blocks.items()} == {
        b.block_hash: b.block_id for b in bm.blocks if b.block_hash is not None
    }
    registrations = [b.registration for b in bm.blocks if b.block_hash is not None]
    assert len(set(registrations)) == len(registrations) and 0 not in registrations
    assert set(bm.unhashed) == set(registrations)  # runs wait only behind a block still registered


def waiting(bm: BlockManager) -> dict:
    """The runs that wait to be hashed, by the registration they follow."""
    return {registration: runs for registration, runs in bm.unhashed.items() if runs}


class FakeSeq:
    """What the block manager reads and writes of a sequence: its id, tokens, hash chain, computed count,
    choices waiting to be forked, and whether it was ever admitted (``metrics.first_scheduled_time``)."""

    def __init__(self, request_id: str, token_ids: list[int]):
        self.request_id, self.token_ids, self.block_hashes = request_id, list(token_ids), []
        self.num_computed_tokens, self.forks = 0, []
        self.metrics = SimpleNamespace(first_scheduled_time=None)

    def __len__(self) -> int:
        return len(self.token_ids)


def test_block_hashes_chain_lru_and_eviction(monkeypatch):
    bm = BlockManager(num_blocks=6, block_size=2)
    a = FakeSeq("a", [1, 2, 3, 4, 5])
    bm.allocate(a, bm.find_cached_blocks(a))  # nothing cached yet: 3 fresh blocks
    bm.cache_blocks(a, len(a))  # a step wrote its tokens: its two full blocks
    # the first is registered now; the second waits, unhashed, behind it
    first = bm.blocks[bm.block_tables["a"][0]]
    assert list(bm.cached_blocks.values()) == [first.block_id]
    assert a.block_hashes == [hash_block(None, (1, 2))]
    assert bm.unhashed[first.registration] == (
        ((bm.block_tables["a"][1],), (1, 2, 3, 4), a.block_hashes, 1, 3),
    )
    # the same tokens after another prefix, or at another position, are another block
    assert bm.find_cached_blocks(FakeSeq("b", [3, 4, 1, 2, 9])) == []
    assert len(bm.cached_blocks) == 1  # b's lookup stopped at its first block: nothing more was hashed
    assert bm.find_cached_blocks(FakeSeq("c", [1, 2, 3, 4, 9, 9])) == bm.block_tables["a"][:2]
    # c's lookup reached a's first block: a's second was hashed and registered then
    assert len(bm.cached_blocks) == 2 and a.block_hashes[1] == hash_block(hash_block(None, (1, 2)), (3, 4))
    assert waiting(bm) == {}
    # the block holding the last token is never taken from the cache: a whole hit computes its last token
    assert bm.find_cached_blocks(FakeSeq("d", [1, 2, 3, 4])) == bm.block_tables["a"][:1]
    bm.free("a")
    assert bm.num_free_blocks == 6 and len(bm.cached_blocks) == 2  # free, but cached
    c = FakeSeq("c", [1, 2, 3, 4, 9, 9])
    hit = bm.find_cached_blocks(c)
    bm.allocate(c, hit)  # the hits leave the free queue; a fresh block for the rest
    assert bm.block_tables["c"][:2] == hit and bm.num_hit_tokens == 4
    check_blocks(bm)
    e = FakeSeq("e", [7] * 6)  # takes the 3 blocks left, least recently freed first: a's last one
    bm.allocate(e, bm.find_cached_blocks(e))
    assert bm.num_free_blocks == 0 and len(bm.cached_blocks) == 2  # c's hits, in use, were not evicted
    bm.free("e")
    bm.free("c")
    f = FakeSeq("f", [8] * 12)  # needs every block: the cached ones are evicted, their hashes dropped
    bm.allocate(f, bm.find_cached_blocks(f))
    assert bm.cached_blocks == {} and all(b.block_hash is None for b in bm.blocks)
    check_blocks(bm)
    # a hash collision cannot give a wrong hit: a hit is confirmed on the whole chain (tokens and parent)
    monkeypatch.setattr("step9_prefix_cache.block_manager.hash_block", lambda parent, tokens: b"same")
    bm2 = BlockManager(num_blocks=8, block_size=2)
    g = FakeSeq("g", [1, 2, 3])
    bm2.allocate(g, [])
    bm2.cache_blocks(g, len(g))
    assert bm2.find_cached_blocks(FakeSeq("h", [5, 6, 7])) == []
    assert bm2.find_cached_blocks(FakeSeq("i", [1, 2, 7])) == bm2.block_tables["g"][:1]
    # [1, 2] [1, 2]: the second block's tokens equal the first's, its parent does not (the issue's [0, 0])
    assert bm2.find_cached_blocks(FakeSeq("j", [1, 2, 1, 2, 7])) == bm2.block_tables["g"][:1]
    k = FakeSeq("k", [1, 2, 1, 2, 7])
    bm2.allocate(k, bm2.find_cached_blocks(k))
    bm2.cache_blocks(k, len(k))
    # l's lookup finds g's first block, then hashes k's second, which replaces g's under the one hash:
    # l's two blocks are found (each holds what l asks for, after the block before)
    assert bm2.find_cached_blocks(FakeSeq("l", [1, 2, 1, 2, 7])) == bm2.block_tables["k"][:2]
    assert list(bm2.cached_blocks.values()) == [bm2.block_tables["k"][1]]
    assert bm2.find_cached_blocks(FakeSeq("m", [3, 4, 1, 2, 7])) == []  # the only one left holds [1, 2]
    assert bm2.find_cached_blocks(FakeSeq("n", [1, 2, 7])) == []  # and only after g's first block
    check_blocks(bm2)


def test_unhashed_blocks_handed_out_again_end_their_run():
    """A block that waits to be hashed and is handed out again (rewritten) ends its run there; evicting the
    block a run follows drops the run (nothing can reach it)."""
    bm = BlockManager(num_blocks=8, block_size=2)
    a = FakeSeq("a", [1, 2, 3, 4, 5, 6, 7])
    bm.allocate(a, [])
    a0, a1, a2, a3 = bm.block_tables["a"]
    bm.cache_blocks(a, 6)  # three full blocks written: a0 registered, a1 and a2 wait
    bm.free("a")  # to the end of the free queue, last block first: a3, a2, a1, a0
    x, y = FakeSeq("x", [9] * 9), FakeSeq("y", [9])
    bm.allocate(x, [])
    bm.allocate(y, [])
    assert bm.block_tables["x"][-1] == a3 and bm.block_tables["y"] == [a2]  # a2 is rewritten
    assert bm.find_cached_blocks(FakeSeq("z", [1, 2, 3, 4, 5, 6, 9])) == [a0, a1]
    assert sorted(bm.cached_blocks.values()) == sorted([a0, a1]) and waiting(bm) == {}
    check_blocks(bm)
    bm.cache_blocks(y, 1)  # less than a block: nothing to cache
    assert len(bm.cached_blocks) == 2 and waiting(bm) == {}
    bm.free("x")
    b = FakeSeq("b", [1, 2, 3, 4, 5, 6, 7])
    bm.allocate(b, bm.find_cached_blocks(b))  # a0, a1 found; fresh blocks for the rest
    bm.cache_blocks(b, 6)  # its third block waits behind a1
    assert list(waiting(bm)) == [bm.blocks[a1].registration]
    bm.free("b")
    bm.free("y")
    bm.allocate(FakeSeq("c", [8] * 16), [])  # every block: a1 is evicted, and the run behind it dropped
    assert bm.cached_blocks == {} and bm.unhashed == {}
    check_blocks(bm)


def test_runs_wait_only_where_a_lookup_can_reach_them():
    """The same prompt asked again and again: each request's own blocks wait behind the prompt's last full
    block, which every lookup finds whole, so each lookup hashes what waits there and nothing piles up. And
    a run behind a registration that is gone (evicted) is not filed: no lookup could reach it."""
    bm = BlockManager(num_blocks=24, block_size=2)
    for i in range(30):
        s = FakeSeq(f"r{i}", [1, 2, 3, 4, 5])  # 2 full blocks, found from the second request on
        bm.allocate(s, bm.find_cached_blocks(s))
        assert sum(map(len, bm.unhashed.values())) == 0
        for token in (6 + i, 7, 8):  # a step writes the prompt, then each output token is appended
            bm.cache_blocks(s, len(s) - 1)
            s.token_ids.append(token)
            assert bm.append(s.request_id, len(s))
        bm.cache_blocks(s, len(s) - 1)
        bm.free(s.request_id)
        check_blocks(bm)
    assert bm.num_hit_tokens == 29 * 4
    bm = BlockManager(num_blocks=6, block_size=1)
    a, b = FakeSeq("a", [1, 1]), FakeSeq("b", [1, 1])  # the same prompt, admitted in one step: no hits
    for s in (a, b):
        bm.allocate(s, bm.find_cached_blocks(s))
    for s in (a, b):
        s.token_ids.append(7)
        bm.cache_blocks(s, len(s) - 1)  # a's first block is registered; b's chain follows it
    bm.cache_blocks(a, len(a) - 1)
    bm.free("a")
    bm.allocate(FakeSeq("x", [9] * 4), [])  # evicts a's blocks, a's first among them
    bm.free("x")
    bm.cache_blocks(b, len(b) - 1)  # b's second block would follow a's first: not filed
    bm.free("b")
    assert waiting(bm) == {}
    check_blocks(bm)


def test_a_lookup_registers_the_copy_written_last():
    """Two requests admitted in one step compute the same blocks: the lookup that hashes both copies
    registers the later one's, which the free queue evicts last, so the block stays found after the earlier
    copy is evicted."""
    bm = BlockManager(num_blocks=6, block_size=1)
    a, b = FakeSeq("a", [0, 0]), FakeSeq("b", [0, 0])
    for s in (a, b):  # neither finds anything: both compute [0] [0]
        bm.allocate(s, bm.find_cached_blocks(s))
    first, a_copy, b_copy = bm.block_tables["a"][0], bm.block_tables["a"][1], bm.block_tables["b"][1]
    for s in (a, b):
        s.token_ids.append(7)
        bm.cache_blocks(s, len(s) - 1)  # a's first block is registered, b's chain follows it
    for s in (a, b):  # a finishes first
        bm.cache_blocks(s, len(s) - 1)
        bm.free(s.request_id)
    assert bm.find_cached_blocks(FakeSeq("x", [0, 0, 0])) == [first, b_copy]
    bm.allocate(FakeSeq("y", [8, 8, 8]), [])  # the front of the free queue: a's copy, not the first block
    assert a_copy in bm.block_tables["y"] and first not in bm.block_tables["y"]
    assert bm.find_cached_blocks(FakeSeq("z", [0, 0, 0])) == [first, b_copy]
    check_blocks(bm)


def test_every_choice_of_a_fork_gets_its_blocks_hashed():
    """The n choices of a prompt share its blocks (fork), and each files a run over them when it finishes:
    whichever finishes first, a prompt that continues its text finds its own blocks, not only the prompt's."""
    bm = BlockManager(num_blocks=12, block_size=2)
    a, b = FakeSeq("a", [1, 2, 3, 4, 5]), FakeSeq("1_a", [1, 2, 3, 4, 5])
    a.forks = [b]
    assert bm.allocate(a, bm.find_cached_blocks(a)) == [a, b]
    for seq in (a, b):  # the prefill's step was launched: its full blocks are cached
        bm.cache_blocks(seq, len(seq) - 1)
    for seq, new in ((a, [6, 7, 8, 9]), (b, [16, 17, 18, 19])):  # each decodes its own tokens
        for token in new:
            seq.token_ids.append(token)
            assert bm.append(seq.request_id, len(seq))
    assert bm.block_tables["a"][:2] == bm.block_tables["1_a"][:2]  # the prompt's full blocks, shared
    for seq in (b, a):  # the second choice finishes first
        bm.cache_blocks(seq, len(seq) - 1)
        bm.free(seq.request_id)
    for seq in (a, b):
        c = FakeSeq("c", seq.token_ids + [99])
        found = bm.find_cached_blocks(c)
        assert len(found) == 4  # 8 of its tokens: the prompt's 2 blocks and the choice's own 2
        assert [bm.blocks[i].token_ids for i in found] == [
            tuple(seq.token_ids[k : k + 2]) for k in (0, 2, 4, 6)
        ]
    check_blocks(bm)


def test_a_hash_collision_gives_no_wrong_hit(demo_snapshot, monkeypatch):
    """With every block hash the same (a collision everywhere), a prompt X X + tail (X one block) run twice
    never reads X's first block in place of its second (block table [b, b]): its ids equal those of the
    engine without the cache; the cache only finds less."""
    monkeypatch.setattr("step9_prefix_cache.block_manager.hash_block", lambda parent, tokens: b"same")
    x = [464, 3616, 286, 1204]
    prompt = x + x + [318, 257]
    params = SamplingParams(max_tokens=8, temperature=0)
    off = LLM(model=str(demo_snapshot), block_size=BLOCK, enable_prefix_caching=False)
    expected = ids(off.generate(prompt_token_ids=[prompt], sampling_params=params))
    on = LLM(model=str(demo_snapshot), block_size=BLOCK, async_scheduling=True)
    tables = []
    allocate, bm = on.engine.block_manager.allocate, on.engine.block_manager

    def recording(seq, cached):
        admitted = allocate(seq, cached)
        tables.append(bm.block_tables[seq.request_id][:2])
        return admitted

    monkeypatch.setattr(bm, "allocate", recording)
    for _ in range(3):
        assert ids(on.generate(prompt_token_ids=[prompt], sampling_params=params)) == expected
    assert len(tables) == 3 and all(a != b for a, b in tables), tables


def test_fork_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = FakeSeq("p", [1, 2, 3, 4, 5, 6])  # a full block, then a partly filled one
    bm.allocate(p, [])
    q = FakeSeq("q", p.token_ids)
    bm.fork(p, q)
    assert bm.block_tables["q"] == bm.block_tables["p"] and [b.ref_count for b in bm.blocks[:2]] == [2, 2]
    for seq in (p, q):
        seq.token_ids.append(7)  # position 6 lands in the shared block
    shared, copies = bm.block_tables["p"][1], bm.blocks_to_copy
    assert bm.append("p", len(p)) and copies == {"p": (shared, bm.block_tables["p"][1])} != {
        "p": (shared, shared)
    }
    assert bm.append("q", len(q)) and len(copies) == 1 and bm.block_tables["q"][1] == shared  # last holder
    check_blocks(bm)


def test_outputs_equal_step8_around_block_boundaries(llm, oracle):
    """Prompts sharing the first k tokens of a base prompt, k around every block boundary, each behind
    tokens of its own: each finds exactly its shared full blocks cached (the block of its last token never),
    and its greedy and seeded ids are step 8's."""
    tok = llm.get_tokenizer()
    base = tok.encode("The Python interpreter reads a program and runs it line by line, and then")[:14]
    assert len(base) == 14
    tails = iter(range(2000, 2100))  # tokens of their own, new in every round: no other cache hits
    for kind in ("greedy", "seeded"):
        prompts = [base[:k] + [next(tails) for _ in range(3)] for k in (1, 3, 4, 5, 7, 8, 9, 12, 13)]
        params = [
            SamplingParams(max_tokens=6, temperature=0 if kind == "greedy" else 1.0, seed=i)
            for i in range(len(prompts) + 1)
        ]
        llm.generate(prompt_token_ids=[base], sampling_params=params[0])  # the base's blocks are cached
        ours = []
        for prompt, p in zip(prompts, params[1:]):
            before = llm.engine.stats.prefix_cache_hits
            ours += llm.generate(prompt_token_ids=[prompt], sampling_params=p)
            shared = next(k for k in range(len(prompt)) if prompt[k] != base[k])
            assert (
                llm.engine.stats.prefix_cache_hits - before == min(shared, len(prompt) - 1) // BLOCK * BLOCK
            )
        theirs = oracle.generate(
            prompt_token_ids=prompts,
            sampling_params=[step8_async_scheduling.SamplingParams(**vars_of(p)) for p in params[1:]],
        )
        assert ids(ours) == ids(theirs), kind


def vars_of(p: SamplingParams) -> dict:
    return dict(max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed, ignore_eos=p.ignore_eos)


def test_fully_cached_prompt_computes_its_last_token(llm, oracle):
    """A prompt seen before is found whole but for the block of its last token, which is computed again
    (a prompt of 12 = 3 blocks: 2 found, 4 tokens computed; of 13: 3 found, 1 computed)."""
    tok = llm.get_tokenizer()
    text = "A list comprehension is a concise way to build a list from another one in Python"
    for n, hit in ((12, 8), (13, 12)):
        prompt = tok.encode(text)[:n]
        params = SamplingParams(max_tokens=8, temperature=0)
        first = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        s = llm.engine.stats
        second = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        assert llm.engine.stats.prefix_cache_hits - s.prefix_cache_hits == hit
        assert llm.engine.stats.prefix_cache_queries - s.prefix_cache_queries == n
        expected = oracle.generate(
            prompt_token_ids=[prompt],
            sampling_params=step8_async_scheduling.SamplingParams(max_tokens=8, temperature=0),
        )
        assert ids(first) == ids(second) == ids(expected)


def test_each_block_hashed_once_and_no_work_for_unchanged_sequences(tiny_snapshot, monkeypatch):
    """Each full block of a sequence is hashed once, however often it waits at the head of the queue or is
    preempted and readmitted (its hashes stay with it), and a step that completes no block registers
    nothing: the block manager does no per-step work for sequences whose blocks did not change."""
    import step9_prefix_cache.block_manager as block_manager

    hashed, registering = [], []
    hash_block = block_manager.hash_block
    monkeypatch.setattr(block_manager, "hash_block", lambda p, t: hashed.append(t) or hash_block(p, t))
    engine = LLMEngine(
        model=str(tiny_snapshot), async_scheduling=True, max_num_seqs=2, block_size=BLOCK, num_kv_blocks=7
    )
    cache_blocks = engine.block_manager.cache_blocks
    monkeypatch.setattr(
        engine.block_manager, "cache_blocks", lambda seq, n: registering.append(seq) or cache_blocks(seq, n)
    )
    prompts = [[100 * i + j for j in range(9)] for i in range(1, 5)]  # distinct: nothing shared
    for i, prompt in enumerate(prompts):
        engine.add_request(f"h{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    quiet_steps = 0
    while engine.has_unfinished_requests():
        registering.clear()
        engine.step()
        if engine.scheduler.running and not registering:  # a step that completed no block
            quiet_steps += 1
    assert engine.stats.num_preemptions > 0 and quiet_steps > 10
    blocks = [tuple(p + [0] * 12)[j * BLOCK : (j + 1) * BLOCK] for p in prompts for j in range(5)]
    assert len(hashed) == len(set(hashed)) <= len(blocks)  # no block hashed twice


def test_a_block_is_hashed_when_a_lookup_reaches_it(tiny_snapshot, monkeypatch):
    """Requests that share nothing hash one block each (their lookups stop at their first block, the one
    registered at once): the rest of their blocks wait, unhashed, until a prompt that continues one of them
    reaches them. Then they are hashed once and found."""
    import step9_prefix_cache.block_manager as block_manager

    hashed = []
    hash_block = block_manager.hash_block
    monkeypatch.setattr(block_manager, "hash_block", lambda p, t: hashed.append(t) or hash_block(p, t))
    llm = LLM(model=str(tiny_snapshot), block_size=BLOCK)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[100 * i + j for j in range(9)] for i in (1, 2)]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)

    def blocks(tokens, first, last):
        return [tuple(tokens[j * BLOCK : (j + 1) * BLOCK]) for j in range(first, last)]

    assert sorted(hashed) == sorted(blocks(prompts[0], 0, 1) + blocks(prompts[1], 0, 1))
    hashed.clear()
    turn = prompts[0] + outputs[0].outputs[0].token_ids + [7]  # 22 tokens: 5 full blocks before its last
    before = llm.engine.stats.prefix_cache_hits
    llm.generate(prompt_token_ids=[turn], sampling_params=params)
    assert llm.engine.stats.prefix_cache_hits - before == 5 * BLOCK
    # the turn's lookup hashes its 5 blocks, and the first request's blocks 1-4 when it reaches them
    assert sorted(hashed) == sorted(blocks(turn, 0, 5) + blocks(turn, 1, 5))


def test_a_finished_sequence_leaves_its_generated_blocks_cached(llm, oracle):
    """A sequence's blocks, its generated tokens' included, join the cache when it finishes: a prompt that
    continues it (a chat's next turn: prompt + output + more) finds every full block of them, and gives
    step 8's ids."""
    prompt = llm.get_tokenizer().encode("Dictionaries map keys to values, and lists hold")[:9]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
    turn = prompt + first.outputs[0].token_ids + [2100, 2101]  # 23 tokens: 5 full blocks before the last
    before = llm.engine.stats.prefix_cache_hits
    ours = llm.generate(prompt_token_ids=[turn], sampling_params=params)
    assert llm.engine.stats.prefix_cache_hits - before == (9 + 12 - 1) // BLOCK * BLOCK
    theirs = oracle.generate(
        prompt_token_ids=[turn],
        sampling_params=step8_async_scheduling.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    )
    assert ids(ours) == ids(theirs)


def test_eviction_under_a_small_pool(demo_snapshot, oracle):
    """A pool of 18 blocks of 4 tokens: an earlier prompt's cached blocks are evicted while four requests
    share a 12-token prefix (its blocks, in use, stay; the first request computes them, the others, a step
    later, find them), with preemption; ids are step 8's; the invariants hold after every step, and at
    the end no block is in use."""
    engine = LLMEngine(
        model=str(demo_snapshot), block_size=BLOCK, num_kv_blocks=18, max_num_seqs=4, async_scheduling=True
    )
    tok = engine.tokenizer
    old = tok.encode("Exceptions are raised when something goes wrong in a program")[:12]
    shared = tok.encode("The standard library of Python has modules for files, dates and")[:12]
    prompts = [shared + [3000 + i, 3100 + i] for i in range(4)] + [old[:5] + [17]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(batch: list[list[int]]) -> dict[str, list[int]]:
        out, step = {}, 0
        engine.add_request(f"{len(batch)}-0", batch[0], params)
        while engine.has_unfinished_requests():
            if step == 1:
                for i, p in enumerate(batch[1:], 1):
                    engine.add_request(f"{len(batch)}-{i}", p, params)
            step += 1
            for o in engine.step():
                out[o.request_id] = o.outputs[0].token_ids
            check_blocks(engine.block_manager)
            for seq in engine.scheduler.running:  # a block in use keeps its registration
                for b in engine.block_manager.block_tables[seq.request_id]:
                    blk = engine.block_manager.blocks[b]
                    assert blk.block_hash is None or engine.block_manager.cached_blocks[blk.block_hash] == b
        return [out[f"{len(batch)}-{i}"] for i in range(len(batch))]

    run([old])
    old_blocks = len(engine.block_manager.find_cached_blocks(FakeSeq("x", old)))
    assert old_blocks == 2
    ours = run(prompts)
    assert engine.stats.num_preemptions > 0 and engine.stats.prefix_cache_hits >= 3 * 12
    assert len(engine.block_manager.find_cached_blocks(FakeSeq("x", old))) < old_blocks  # evicted
    assert engine.stats.num_used_blocks == 0
    theirs = oracle.generate(
        prompt_token_ids=prompts,
        sampling_params=step8_async_scheduling.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    )
    assert ours == ids(theirs)


def test_n_choices_copy_on_write_equal_separate_seeded_requests(llm, oracle, monkeypatch):
    """n = 4 seeded choices of a 7-token prompt: one prefill, three copies of the shared last block (the
    fourth choice writes it in place), four outputs in index order equal to four separate step 8 requests
    seeded seed + i, which diverge. Greedy n = 2 on a prompt of whole blocks copies nothing."""
    copies = []
    copy_blocks = llm.engine.kv_cache.copy_blocks
    monkeypatch.setattr(
        llm.engine.kv_cache, "copy_blocks", lambda pairs: copies.extend(pairs) or copy_blocks(pairs)
    )
    prompt = llm.get_tokenizer().encode("Strings are immutable in Python, so")[:7]
    assert len(prompt) == 7
    before = llm.engine.stats.prefix_cache_queries
    (out,) = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(n=4, max_tokens=8, seed=11)
    )
    assert llm.engine.stats.prefix_cache_queries - before == 7  # the prompt went in once
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and len(copies) == 3
    separate = oracle.generate(
        prompt_token_ids=[prompt] * 4,
        sampling_params=[step8_async_scheduling.SamplingParams(max_tokens=8, seed=11 + i) for i in range(4)],
    )
    assert ids([out]) == ids(separate) and len({tuple(c.token_ids) for c in out.outputs}) > 1
    copies.clear()
    greedy = SamplingParams(n=2, max_tokens=6, temperature=0)
    (out,) = llm.generate(prompt_token_ids=[prompt[:4] * 2], sampling_params=greedy)
    expected = oracle.generate(
        prompt_token_ids=[prompt[:4] * 2],
        sampling_params=step8_async_scheduling.SamplingParams(max_tokens=6, temperature=0),
    )
    assert ids([out]) == ids(expected) * 2 and copies == []
    assert llm.engine.stats.num_used_blocks == 0 and not llm.engine.parents


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_no_position_scheduled_past_max_tokens(tiny_snapshot, monkeypatch, async_scheduling):
    """With async scheduling, a sequence whose last token (its max_tokens-th) is in flight gets no position
    in the next step (vLLM PR #27922): max_tokens 1, 2, 5 take 1, 2, 5 lanes, as serially; in a pool of 4
    blocks no request is preempted for a position nobody computes; n = 3 choices of max_tokens = 1 make no
    copy-on-write (each would copy the shared last block for the position after its only token)."""
    engine = LLMEngine(
        model=str(tiny_snapshot),
        async_scheduling=async_scheduling,
        max_num_seqs=4,
        block_size=BLOCK,
        num_kv_blocks=4,
    )
    lanes, copies = [], []
    schedule, copy_blocks = engine.scheduler.schedule, engine.kv_cache.copy_blocks
    monkeypatch.setattr(
        engine.scheduler, "schedule", lambda: (out := schedule()) and lanes.extend(out.seqs) or out
    )
    monkeypatch.setattr(
        engine.kv_cache, "copy_blocks", lambda pairs: copies.extend(pairs) or copy_blocks(pairs)
    )

    def run(requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, int]:
        lanes.clear()
        for request_id, (prompt, params) in requests.items():
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return {r: sum(seq.request_id == r for seq in lanes) for r in requests}

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    assert run({f"m{n}": ([11, 12, 13], greedy(n)) for n in (1, 2, 5)}) == {"m1": 1, "m2": 2, "m5": 5}
    two = {"short": ([21, 22, 23], greedy(2)), "long": ([31, 32, 33, 34, 35, 36, 37], greedy(6))}
    assert run(two) == {"short": 2, "long": 6}
    run({"n3": ([41, 42, 43, 44, 45, 46], SamplingParams(n=3, max_tokens=1, seed=0))})
    assert engine.stats.num_preemptions == 0 and copies == []
    assert engine.stats.num_used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_counts_a_prompt_once(tiny_snapshot, async_scheduling):
    """Six prompts that share nothing, in a pool that preempts: 0 hits, and the queries are their prompt
    tokens, each counted at its first admission only; a preempted request readmitted with its own blocks
    found again is not counted again (vLLM #25780; it reported 17% serially and 40% with async
    scheduling)."""
    engine = LLMEngine(
        model=str(tiny_snapshot),
        async_scheduling=async_scheduling,
        max_num_seqs=4,
        block_size=BLOCK,
        num_kv_blocks=10,
    )
    prompts = [[100 * i + j for j in range(10)] for i in range(1, 7)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"u{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats
    assert stats.num_preemptions > 0
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_hit_rate) == (60, 0, 0.0)


class ShadowModel:
    """Stands in for the model runner and the KV pool: "computing" position p of a sequence writes, at its
    slot, the prefix the keys and values there would encode (tokens 0..p); after a step's writes every
    lane must read its own prefix back at every position through its block table. Samples from a few
    tokens, so that prefixes repeat."""

    def __init__(self, engine: LLMEngine, rng: random.Random):
        self.engine, self.rng, self.kv, self.num_copies, self.sampled = engine, rng, {}, 0, {}
        self.bm, self.size = engine.block_manager, engine.block_manager.block_size

    def slot(self, seq, p: int) -> int:
        return self.bm.block_tables[seq.request_id][p // self.size] * self.size + p % self.size

    def copy_blocks(self, pairs) -> None:
        self.num_copies += len(pairs)
        for src, dst in pairs:
            for o in range(self.size):
                self.kv[dst * self.size + o] = self.kv.get(src * self.size + o)

    def launch(self, scheduled):
        """``ModelRunner.launch``'s stand-in: a token in flight (async scheduling's placeholder at the end
        of a decode's ``token_ids``) is the one this model sampled for the sequence at its last launch."""

        def tokens(seq) -> list[int]:
            ids = list(seq.token_ids)
            if ids[-1] == PLACEHOLDER_TOKEN_ID:
                ids[-1] = self.sampled[seq.request_id]
            return ids

        for seq in scheduled.prefills:
            for p in range(seq.num_computed_tokens, len(seq)):
                self.kv[self.slot(seq, p)] = tuple(tokens(seq)[: p + 1])
        for seq in scheduled.decodes:
            self.kv[self.slot(seq, len(seq) - 1)] = tuple(tokens(seq))
        for seq in scheduled.seqs:
            for p in range(len(seq)):
                assert self.kv.get(self.slot(seq, p)) == tuple(tokens(seq)[: p + 1]), (seq.request_id, p)
        sampled = [self.rng.randrange(3) for _ in scheduled.seqs]
        self.sampled.update((seq.request_id, t) for seq, t in zip(scheduled.seqs, sampled))
        return SimpleNamespace(seqs=scheduled.seqs, get_output=lambda: (sampled, [None] * len(sampled)))


@pytest.mark.parametrize("async_scheduling", [False, True])
@settings(max_examples=5)
@given(data=st.data())
def test_random_requests_aborts_and_preemption_leak_nothing(tiny_snapshot, async_scheduling, data):
    """100 random requests per example (1,000 in all, serial and with async scheduling): prompts built
    from a few shared beginnings, n of 1 to 3, aborted at random, in a pool of 12 blocks (preemption all
    along). After every step the block manager's invariants hold (reference counts never negative) and
    every registered block holds the tokens it is registered for; at the end no block is in use and
    nothing is left of any request."""
    engine = LLMEngine(
        model=str(tiny_snapshot),
        block_size=BLOCK,
        num_kv_blocks=12,
        max_num_seqs=4,
        async_scheduling=async_scheduling,
    )
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
    shadow = ShadowModel(engine, rng)
    engine.model_runner.launch, engine.kv_cache.copy_blocks = shadow.launch, shadow.copy_blocks
    bm = engine.block_manager
    beginnings = [[1, 2, 1, 2, 0, 1], [2, 2, 2, 2, 2], [0]]
    added, live = 0, []
    while added < 100 or engine.has_unfinished_requests():
        if added < 100 and rng.random() < 0.5:
            prompt = rng.choice(beginnings)[: rng.randint(1, 6)] + [
                rng.randrange(3) for _ in range(rng.randint(0, 9))
            ]
            params = SamplingParams(
                n=rng.randint(1, 3), max_tokens=rng.randint(1, 12), ignore_eos=True, seed=added
            )
            engine.add_request(f"r{added}", prompt, params)
            live.append(f"r{added}")
            added += 1
        if live and rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        engine.step()
        check_blocks(bm)
        for block in bm.blocks:
            if block.block_hash is not None:  # its content is the full block it is registered as
                for o, token in enumerate(block.token_ids):
                    assert shadow.kv[block.block_id * BLOCK + o][-1] == token
    engine.step()  # the last aborted outputs
    assert engine.stats.num_used_blocks == 0 and bm.block_tables == {}
    assert engine.requests == {} and engine.parents == {} and not engine.scheduler.running
    assert engine.stats.num_preemptions > 0 and engine.stats.prefix_cache_hits > 0 and shadow.num_copies > 0


@needs_triton
def test_triton_and_torch_attend_alike_over_cached_context(tiny_snapshot):
    """One batch: a prefill of 5 new tokens after 8 cached ones, a forked choice with no token, a whole
    prefill and a decode; the Triton kernel (the interpreter on a CPU) and the torch backend agree."""
    torch.manual_seed(0)
    H, D = 2, 16
    cache = PagedKVCache(
        type("C", (), dict(n_layer=1, n_head=H, head_dim=D))(),
        num_blocks=16,
        block_size=BLOCK,
        device="cpu",
        dtype=torch.float32,
    )
    cache.k[0].normal_()
    cache.v[0].normal_()
    tables = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 0, 0], [6, 7, 8, 0]])  # [S, M]
    seq_lens = torch.tensor([13, 13, 6, 10])
    qsl = [0, 5, 5, 11, 12]  # new tokens: 5, 0 (the fork), 6, 1
    N = qsl[-1]
    q, k, v = (torch.randn(N, H, D) for _ in range(3))
    positions = [8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 9]
    lanes = [0] * 5 + [2] * 6 + [3]
    slots = torch.tensor([tables[s, p // BLOCK] * BLOCK + p % BLOCK for s, p in zip(lanes, positions)])
    cache.write(0, k, v, slots)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=qsl,
        query_start_loc_t=torch.tensor(qsl),
        logits_indices=torch.tensor(qsl[1:]) - 1,
        num_prefills=3,
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=6,
        attention_backend="torch",
        decode_mask=decode_attention_mask(seq_lens[3:], 4 * BLOCK, torch.float32),
        prefill_seq_lens=[13, 13, 6],
    )
    ours = torch_attention(q, k, v, cache, 0, meta)
    kernel = triton_attention(q, cache.k[0], cache.v[0], tables, seq_lens, torch.tensor(qsl), 6)
    torch.testing.assert_close(ours, kernel, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@needs_triton
def test_triton_engine_equals_step8_with_prefix_hits(demo_snapshot, oracle):
    prompts = [[11, 12, 13, 14, 15, 16, 17], [11, 12, 13, 14, 15, 16, 18, 19, 20]]
    ours = LLM(model=str(demo_snapshot), block_size=BLOCK, attention_backend="triton")
    params = SamplingParams(max_tokens=4, temperature=0)
    got = [ours.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
    assert ours.engine.stats.prefix_cache_hits == BLOCK
    expected = oracle.generate(
        prompt_token_ids=prompts,
        sampling_params=step8_async_scheduling.SamplingParams(max_tokens=4, temperature=0),
    )
    assert ids(got) == ids(expected)


def test_server_n_is_one_engine_request_and_metrics(demo_snapshot, llm):
    """The server's n: one engine request of n choices, seeded seed + i as before (equal to LLM's n);
    /metrics counts prefix-cache queries and hits in tokens, /v1/engine/stats shows the hit rate (and the
    pool and the features from the start)."""
    engine = LLMEngine(model=str(demo_snapshot), block_size=BLOCK)
    added = []
    add_request = engine.add_request
    engine.add_request = lambda *a: added.append(a[0]) or add_request(*a)
    text = "The Python interpreter reads a program and runs it"
    body = {"prompt": text, "max_tokens": 5, "n": 3, "seed": 4}
    with TestClient(build_app(engine, max_waiting_requests=4)) as client:
        fresh = client.get("/v1/engine/stats").json()
        first = client.post("/v1/completions", json=body).json()
        again = client.post("/v1/completions", json=body).json()
        metrics = client.get("/metrics").text
        stats = client.get("/v1/engine/stats").json()
        # the waiting limit counts engine requests, one per prompt: 4 prompts x n = 3 fit a limit of 4
        four = client.post("/v1/completions", json={**body, "prompt": ["x"] * 4, "max_tokens": 1})
        five = client.post("/v1/completions", json={**body, "prompt": ["x"] * 5, "max_tokens": 1})
    assert four.status_code == 200 and len(four.json()["choices"]) == 12
    assert five.status_code == 400 and five.json()["error"]["param"] == "prompt"
    assert "5 engine requests" in five.json()["error"]["message"]
    assert len(added) == 2 + 4 and [c["index"] for c in first["choices"]] == [0, 1, 2]
    (expected,) = llm.generate(text, SamplingParams(n=3, max_tokens=5, seed=4))
    assert (
        [c["text"] for c in first["choices"]]
        == [c.text for c in expected.outputs]
        == [c["text"] for c in again["choices"]]
    )
    prompt_len = len(engine.tokenizer.encode(text))
    assert f'vllm:prefix_cache_queries_total{{model_name="demo"}} {2 * prompt_len}.0' in metrics
    hits = (prompt_len - 1) // BLOCK * BLOCK
    assert f'vllm:prefix_cache_hits_total{{model_name="demo"}} {hits}.0' in metrics
    assert stats["prefix_cache_hit_rate"] == pytest.approx(hits / (2 * prompt_len))
    assert (fresh["kv_blocks_used"], fresh["kv_blocks_total"]) == (0, engine.block_manager.num_blocks)
    assert fresh["features"] == {
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "torch",
        "cuda_graphs": False,
        "async_scheduling": False,
        "prefix_caching": True,
    }


def sse_chunks(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(demo_snapshot, llm):
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field, filled as vLLM does): 0 for a prompt
    seen the first time, its full blocks but the last token's the second time; completions and chat, whole
    and streamed (the usage chunk), read with the openai SDK's types. ``RequestOutput.num_cached_tokens``
    (vLLM's name) says the same, for each of n choices."""
    engine = LLMEngine(model=str(demo_snapshot), block_size=BLOCK)
    kinds = {
        "/v1/completions": (Completion, Completion),
        "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    }
    with TestClient(build_app(engine)) as client:
        for i, (path, stream) in enumerate([(p, s) for p in kinds for s in (False, True)]):
            text = f"Request {i} asks the server about modules, packages and the import system"
            body = (
                {"prompt": text}
                if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": text}]}
            )
            body |= {"max_tokens": 3, "temperature": 0, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            whole, chunk = kinds[path]
            cached = []
            for _ in range(2):
                r = client.post(path, json=body)
                answer = chunk.model_validate(sse_chunks(r)[-1]) if stream else whole.model_validate(r.json())
                cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            assert cached == [0, (answer.usage.prompt_tokens - 1) // BLOCK * BLOCK], (path, stream)
    text = "The standard library's modules are imported like any other module"
    params = SamplingParams(max_tokens=3, temperature=0)
    first, again = (llm.generate(text, params)[0] for _ in range(2))
    (choices,) = llm.generate(text, SamplingParams(n=2, max_tokens=3, seed=0))
    hits = (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert (first.num_cached_tokens, again.num_cached_tokens, choices.num_cached_tokens) == (0, hits, hits)


def continuous_usages(client: TestClient, path: str, include_usage: bool) -> list:
    """The usage of every chunk of a stream of n = 2 choices x 6 tokens asked with vLLM's
    ``continuous_usage_stats`` (and OpenAI's ``include_usage`` or not), read with the openai SDK's types;
    checks what every chunk's usage must say: the prompt's tokens, the completion tokens streamed so
    far (never fewer than the chunk before), their sum; with include_usage, a last chunk without choices."""
    prompt = {"prompt": "The Python interpreter"}
    if path == "/v1/chat/completions":
        prompt = {"messages": [{"role": "user", "content": "What is a list?"}]}
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    body = {**prompt, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True, "stream": True}
    chunks = sse_chunks(client.post(path, json={**body, "stream_options": options}))
    assert all(chunk.get("usage") for chunk in chunks), chunks
    for chunk in chunks if path == "/v1/chat/completions" else []:  # (the SDK's Completion wants a
        ChatCompletionChunk.model_validate(chunk)  # finish_reason in every chunk: its usage alone, below)
    usages = [CompletionUsage.model_validate(chunk["usage"]) for chunk in chunks]
    assert [chunk["choices"] == [] for chunk in chunks] == [False] * (len(chunks) - include_usage) + [
        True
    ] * include_usage
    assert {u.prompt_tokens for u in usages} == {usages[-1].prompt_tokens} and usages[-1].prompt_tokens > 0
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 2 * 6
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    return usages


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(demo_snapshot):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it) is honoured, with OpenAI's
    ``include_usage`` and without it, for completions and chat (``continuous_usages``)."""
    with TestClient(build_app(LLMEngine(model=str(demo_snapshot), block_size=BLOCK))) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for include_usage in (False, True):
                continuous_usages(client, path, include_usage)


def test_an_empty_body_is_told_the_field_it_lacks(demo_snapshot):
    """An empty body gets OpenAI's 400 naming the field it lacks (FastAPI says only "Field required")."""
    with TestClient(build_app(LLMEngine(model=str(demo_snapshot), block_size=BLOCK))) as client:
        answers = {
            path: client.post(path, content=b"") for path in ("/v1/completions", "/v1/chat/completions")
        }
    for path, field in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        r = answers[path]
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": f"The request body is empty: send a JSON object with `{field}`.",
            "type": "invalid_request_error",
            "param": field,
            "code": "missing_required_parameter",
        }


def test_server_inter_token_latency_is_timed_per_choice(demo_snapshot):
    """``vllm:inter_token_latency_seconds`` holds, for each choice, the time between two of its own outputs
    (as step 8 does for its n engine requests, and vLLM for each child request): n = 4 choices of 10 tokens
    are 4 x 9 samples, none of them the 0 s between two choices of one step."""
    engine = LLMEngine(model=str(demo_snapshot), block_size=BLOCK)
    body = {"prompt": "The Python interpreter", "max_tokens": 10, "n": 4, "seed": 1, "ignore_eos": True}
    app = build_app(engine)
    samples = []
    itl = app.state.server.metrics.itl
    observe = itl.observe
    itl.observe = lambda seconds: samples.append(seconds) or observe(seconds)
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200
    assert len(samples) == 4 * 9 and min(samples) > 0, samples


def request_metrics(exposition: str) -> dict[str, float]:
    """The per-request figures of a /metrics page: token counters, finished requests by reason, and the
    number of samples of each latency histogram (their values are times, which differ from run to run)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name.endswith("_count") or (s.name.endswith("_total") and family.name in names)
    }


def test_server_request_metrics_are_per_choice_as_in_step8(demo_snapshot):
    """One request of n = 4 choices is one engine request here and 4 in step 8's server (and 4 child
    requests in vLLM): its metrics count 4 of everything, as step 8's do: 4 samples of time to first token,
    queue time and end-to-end latency, 4 finished requests by their finish reasons, every choice's tokens,
    the prompt's tokens once per choice."""
    body = {"prompt": "The Python interpreter", "max_tokens": 6, "n": 4, "seed": 1, "stop": ["in"]}
    got = {}
    for step, make_app, make_engine in [
        (9, build_app, LLMEngine),
        (8, step8_async_scheduling.build_app, step8_async_scheduling.LLMEngine),
    ]:
        engine = make_engine(model=str(demo_snapshot), block_size=BLOCK)
        prompt_len = len(engine.tokenizer.encode(body["prompt"]))
        with TestClient(make_app(engine)) as client:
            response = client.post("/v1/completions", json={**body, "stream": True})
            assert response.status_code == 200
            got[step] = request_metrics(client.get("/metrics").text)
    assert got[9] == got[8]
    label = "[('model_name', 'demo')]"
    assert got[9][f"vllm:time_to_first_token_seconds_count{label}"] == 4
    assert got[9][f"vllm:e2e_request_latency_seconds_count{label}"] == 4
    assert got[9][f"vllm:request_queue_time_seconds_count{label}"] == 4
    assert got[9][f"vllm:prompt_tokens_total{label}"] == 4 * prompt_len
    for reason in ("stop", "length"):  # two choices hit the stop string, two run to max_tokens
        assert got[9][f"vllm:request_success_total[('finished_reason', '{reason}'), {label[1:-1]}]"] == 2


def test_server_counts_an_aborted_request_once_per_unfinished_choice(demo_snapshot):
    """A request of n = 4 choices aborted after two of them stopped (a stop string) counts 2 requests
    finished with "stop" and 2 with "abort", as step 8's 4 engine requests would."""
    engine = LLMEngine(model=str(demo_snapshot), block_size=BLOCK)
    bridge = AsyncEngine(engine, ServerMetrics("demo"))  # stepped here, as its loop thread would
    params = SamplingParams(n=4, max_tokens=50, seed=1, stop=["in"], output_kind=RequestOutputKind.DELTA)
    prompt_ids = engine.tokenizer.encode("The Python interpreter")
    loop = asyncio.new_event_loop()
    request = EngineRequest("r", prompt_ids, params, loop=loop, queue=asyncio.Queue())
    bridge._apply([("add", request)])
    stopped = 0
    while stopped < 2:
        outputs = engine.step()
        stopped += sum(c.finish_reason == "stop" for out in outputs for c in out.outputs)
        bridge._route(outputs, 0.0, 0.0)
    bridge._apply([("abort", "r")])
    loop.close()
    got = request_metrics(bridge.metrics.exposition().decode())
    for reason in ("stop", "abort"):
        assert (
            got[f"vllm:request_success_total[('finished_reason', '{reason}'), ('model_name', 'demo')]"] == 2
        )


def test_enable_prefix_caching_argument(demo_snapshot, oracle):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLMEngine(model=str(demo_snapshot), enable_prefix_caching="yes")
    assert parse_args([]).enable_prefix_caching is True
    assert parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False  # to EngineArgs
    off = LLM(model=str(demo_snapshot), block_size=BLOCK, enable_prefix_caching=False)
    assert engine_features(off.engine)["prefix_caching"] is False  # what the server shows
    with pytest.raises(ValueError, match="n=9"):
        off.engine.add_request("a", [1, 2], SamplingParams(n=9))
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    for _ in range(2):
        out = off.generate(
            prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=5, temperature=0)
        )
    assert off.engine.stats.prefix_cache_hits == 0 and off.engine.stats.num_cached_blocks == 0
    assert off.engine.stats.prefix_cache_queries == 0  # nothing looked up, nothing counted (as vLLM)
    assert ids(out) == ids(
        oracle.generate(
            prompt_token_ids=prompt,
            sampling_params=step8_async_scheduling.SamplingParams(max_tokens=5, temperature=0),
        )
    )
    delta = SamplingParams(n=2, max_tokens=3, seed=1, output_kind=RequestOutputKind.DELTA)
    off.engine.add_request("d", [5, 6, 7], delta)
    seen = []
    while off.engine.has_unfinished_requests():
        seen += [(o.request_id, [c.index for c in o.outputs], o.finished) for o in off.engine.step()]
    assert {r for r, _, _ in seen} == {"d"} and all(len(i) == 1 for _, i, _ in seen) and seen[-1][2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp16_outputs_equal_with_and_without_the_cache(demo_snapshot):
    """fp16 on the GPU (Triton attention, CUDA graphs): prompts sharing prefixes give the same greedy ids
    with the cache as without it (each request after the first finds the shared blocks)."""
    base = list(range(100, 140))
    prompts = [base[:k] + [3000 + k, 3001 + k] for k in (5, 16, 17, 31, 32, 33)]
    params = SamplingParams(max_tokens=16, temperature=0)
    results = {}
    for enabled in (True, False):
        llm = LLM(model=str(demo_snapshot), device="cuda", dtype="float16", enable_prefix_caching=enabled)
        llm.generate(prompt_token_ids=[base], sampling_params=params)
        results[enabled] = [llm.generate(prompt_token_ids=[p], sampling_params=params)[0] for p in prompts]
        assert (llm.engine.stats.prefix_cache_hits > 0) == enabled
    assert ids(results[True]) == ids(results[False])

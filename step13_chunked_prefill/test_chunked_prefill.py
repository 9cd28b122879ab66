"""Step 13 tests: chunked prefill changes when a prompt's tokens are computed, never what the model says.

Step 12 is the oracle (demo checkpoint, fp32, greedy): the same ids at token budgets of 16, 37, 64, 512 and
unbounded and thresholds of 1, 7 and 64, with the prefix cache on and off, n = 2, n-gram speculation, an int8
pool, async scheduling, the engine core in its own process and the server. A chunk short of its prompt's end
is never sampled and says nothing (no output, no stream event); the prefix cache takes only full, computed
blocks (a chunk that ends mid-block; a block another request registered meanwhile); a request part-way is
preempted and aborted cleanly (every block back); bad budgets are refused naming the field.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

import step12_quantized_kv as step12

from .config import EngineArgs
from .engine import LLMEngine
from .llm import LLM
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import Scheduler

BLOCK = 4
LONG = (
    "A list comprehension is a concise way to build a list from an iterable. Exceptions are raised when an "
    "error occurs, and the Python interpreter reads each line of the program in turn."
)
PROMPTS = [
    "x",
    "The Python interpreter",
    LONG,
    LONG + " " + LONG,  # past every budget but the unbounded one
    "def f(x): return x\ndef g(x): return x\ndef h(x): return",
    "Exceptions are raised when an error occurs. Exceptions are",
]
MAX_TOKENS = 24
BUDGETS = [16, 37, 64, 512, 10**6]  # 10**6: unbounded, no prompt is ever cut
THRESHOLDS = [1, 7, 64]


def greedy_ids(llm, prompts=PROMPTS, params=SamplingParams, **fields) -> list[list[int]]:
    """Each prompt's greedy ids (every choice's, with n); ``params``: the SamplingParams of llm's step."""
    p = params(**{"max_tokens": MAX_TOKENS, "temperature": 0, **fields})
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, p)]


def chunked(demo_snapshot, budget: int, threshold: int | None = None, **args) -> LLM:
    return LLM(
        model=str(demo_snapshot),
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        **args,
    )


@pytest.fixture(scope="module")
def want(demo_snapshot) -> list[list[list[int]]]:
    """Step 12's greedy ids of PROMPTS (its default budget: the window; every prompt in one step)."""
    return greedy_ids(step12.LLM(model=str(demo_snapshot), block_size=BLOCK), params=step12.SamplingParams)


def test_the_prompts_need_chunks(demo_snapshot):
    tokenizer = LLM(model=str(demo_snapshot)).engine.tokenizer
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert max(lengths) > 64 and min(lengths) == 1, lengths


# ---- the same ids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_ids_equal_step_12_at_every_budget_and_threshold(demo_snapshot, want, budget, threshold):
    """Twice each: the second run finds the first's blocks in the prefix cache (its chunks start there)."""
    if threshold > budget:
        pytest.skip("a threshold above the budget is refused (test_bad_budgets_are_refused_naming_the_field)")
    llm = chunked(demo_snapshot, budget, threshold)
    assert greedy_ids(llm) == want
    assert greedy_ids(llm) == want
    stats = llm.stats
    assert stats.prefix_cache_hits > 0 and stats.num_used_blocks == 0
    if budget < 100:  # the long prompts took several steps each
        assert stats.num_steps > 2 * MAX_TOKENS


EVERYTHING = dict(  # the prefix cache off, n-gram drafts, an int8 pool, n = 2 (below)
    enable_prefix_caching=False,
    kv_cache_dtype="int8",
    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
)


@pytest.fixture(scope="module")
def want_everything(demo_snapshot) -> list[list[list[int]]]:
    """Step 12's greedy ids of PROMPTS, n = 2, with EVERYTHING."""
    theirs = step12.LLM(model=str(demo_snapshot), block_size=BLOCK, **EVERYTHING)
    return greedy_ids(theirs, params=step12.SamplingParams, n=2)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_with_everything_at_once_at_every_budget_and_threshold(
    demo_snapshot, want_everything, budget, threshold
):
    """The prefix cache off, n-gram speculation, an int8 pool and n = 2 together: step 12's ids."""
    if threshold > budget:
        pytest.skip("a threshold above the budget is refused (test_bad_budgets_are_refused_naming_the_field)")
    llm = chunked(demo_snapshot, budget, threshold, **EVERYTHING)
    assert greedy_ids(llm, n=2) == want_everything
    assert llm.stats.spec_decode_num_drafts > 0 and llm.stats.num_used_blocks == 0


@pytest.mark.parametrize("budget, threshold", [(16, 7), (37, None), (64, 1)])
def test_greedy_ids_equal_step_12_without_the_prefix_cache(demo_snapshot, want, budget, threshold):
    llm = chunked(demo_snapshot, budget, threshold, enable_prefix_caching=False)
    assert greedy_ids(llm) == want
    assert llm.stats.prefix_cache_hits == 0


def test_chunking_off_is_step_12(demo_snapshot, want):
    llm = LLM(model=str(demo_snapshot), block_size=BLOCK, enable_chunked_prefill=False)
    assert llm.engine.args.max_num_batched_tokens == 512  # the window, step 12's default
    assert greedy_ids(llm) == want


@pytest.mark.parametrize("budget, threshold", [(16, 7), (37, None)])
def test_n_choices_fork_after_the_last_chunk(demo_snapshot, want, budget, threshold):
    """n = 2: greedy choices each equal the single choice; seeded sampled choices equal step 12's."""
    llm = chunked(demo_snapshot, budget, threshold)
    assert greedy_ids(llm, n=2) == [ids * 2 for ids in want]
    sampled = dict(max_tokens=16, temperature=0.8, top_k=20, n=2, seed=11)
    theirs = step12.LLM(model=str(demo_snapshot), block_size=BLOCK)
    assert greedy_ids(llm, **sampled) == greedy_ids(theirs, params=step12.SamplingParams, **sampled)


@pytest.mark.parametrize("budget, threshold", [(16, 7), (37, None)])
def test_ngram_speculation_drafts_only_past_the_prompt(demo_snapshot, want, budget, threshold, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = chunked(demo_snapshot, budget, threshold, speculative_config=spec)
    engine, seen = llm.engine, []
    propose_all = engine.proposer.propose_all

    def checked(seqs, ks):
        seen.extend(seqs)
        assert not set(seqs) & set(engine.scheduler.prefilling)  # nobody part-way through a prompt
        assert all(seq in engine.scheduler.running for seq in seqs)
        return propose_all(seqs, ks)

    monkeypatch.setattr(engine.proposer, "propose_all", checked)
    assert greedy_ids(llm) == want
    assert seen and llm.stats.spec_decode_num_drafts > 0


@pytest.mark.parametrize("budget, threshold", [(16, 7), (37, None)])
def test_an_int8_pool_equals_step_12s(demo_snapshot, budget, threshold):
    theirs = step12.LLM(model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype="int8")
    ours = chunked(demo_snapshot, budget, threshold, kv_cache_dtype="int8")
    assert greedy_ids(ours) == greedy_ids(theirs, params=step12.SamplingParams)


@pytest.mark.parametrize("budget, threshold", [(16, 7), (37, None)])
def test_async_scheduling_schedules_past_a_last_chunk(demo_snapshot, want, budget, threshold):
    """With async scheduling (its code path on a CPU) the step after a request's last chunk is scheduled
    while that chunk's token is in flight: the same ids."""
    llm = chunked(demo_snapshot, budget, threshold, async_scheduling=True)
    assert greedy_ids(llm) == want


def test_the_engine_core_in_its_own_process(demo_snapshot, want):
    llm = chunked(demo_snapshot, 16, 7, multiprocessing=True)
    assert greedy_ids(llm) == want
    assert llm.stats.num_steps > MAX_TOKENS + 147 // 16  # 147 prompt tokens, 16 a step at most


# ---- no token from a partial chunk ------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_chunk_short_of_the_prompt_says_nothing(demo_snapshot, async_scheduling):
    """A streamed request (DELTA) with a long prompt, budget 16, threshold 5: no output while it is part-way;
    its first output carries one token, after the step that computed its last prompt token."""
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
        async_scheduling=async_scheduling,
    )
    prompt = engine.tokenizer.encode(LONG)
    params = SamplingParams(max_tokens=4, temperature=0, output_kind=RequestOutputKind.DELTA)
    engine.add_request("long", prompt, params)
    seq, chunk_steps, first = engine.requests["long"], 0, None
    while engine.has_unfinished_requests():
        part_way = seq in engine.scheduler.prefilling
        outputs = engine.step()
        chunk_steps += bool(engine.scheduler.chunked)
        if first is None and outputs:
            first = outputs[0]
            assert seq.num_computed_tokens + 5 >= len(prompt)  # its last chunk has run
        if part_way and seq in engine.scheduler.prefilling:  # still part-way after this step: silent
            assert outputs == []
    assert chunk_steps == -(-len(prompt) // 5) - 1
    assert first is not None and len(first.new_token_ids) == 1


def test_a_streamed_request_has_no_event_before_its_first_token(demo_snapshot, want):
    """Through the server (engine core process), budget 16: the first SSE event of a long prompt's stream
    carries its first token; the text equals step 12's."""
    from step10_engine_core.test_engine_core import serve

    from .api_server import build_app
    from .core_client import AsyncMPClient

    args = EngineArgs(model=str(demo_snapshot), block_size=BLOCK, max_num_batched_tokens=16)
    tokenizer = LLM(args).engine.tokenizer
    with serve(build_app(AsyncMPClient(args))) as url:
        body = {"prompt": LONG, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        stats = httpx.get(url + "/v1/engine/stats").json()
        metrics = httpx.get(url + "/metrics").text
    import json

    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"] != ""
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == tokenizer.decode(want[2][0])
    features = stats["features"]
    assert (features["chunked_prefill"], features["max_num_batched_tokens"]) == (True, 16)
    assert features["long_prefill_token_threshold"] == "none"
    assert stats["num_steps"] > MAX_TOKENS and "num_prefill_tokens" in stats
    assert 'vllm:iteration_tokens_total_bucket{le="16.0",model_name=' in metrics


# ---- the prefix cache, preemption, aborts -----------------------------------------------------------------


def run(engine: LLMEngine, got: dict | None = None) -> dict[str, list[int]]:
    got = {} if got is None else got
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_only_full_computed_blocks_are_cached(demo_snapshot, want):
    """A chunk of 10 tokens ends in the middle of block 3: a request with the same prompt, admitted after it,
    finds the two full blocks (8 tokens), not the third."""
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=10,
    )
    prompt, params = engine.tokenizer.encode(LONG), SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    engine.add_request("a", prompt, params)
    engine.step()
    assert engine.scheduler.chunked == {engine.requests["a"]: 10}
    engine.add_request("b", prompt, params)
    b = engine.requests["b"]
    got = run(engine)
    assert b.metrics.num_cached_tokens == 8
    assert got["a"] == got["b"] == want[2][0]


def test_a_block_registered_by_another_request_while_part_way(demo_snapshot, want):
    """Two requests sharing a prefix, admitted in one step, chunks of 4: the older registers each shared
    block first; the younger computes its own copy and finds the older's registered (it stays so). Both, and
    a third request of the younger's prompt afterwards (served from the cache), equal step 12."""
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=4,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    older, younger = engine.tokenizer.encode(LONG + " The"), engine.tokenizer.encode(LONG)
    engine.add_request("older", older, params)
    engine.add_request("younger", younger, params)
    got = run(engine)
    assert engine.stats.prefix_cache_hits == 0  # nothing was computed when they were admitted
    engine.add_request("again", younger, params)
    third = engine.requests["again"]
    got = run(engine, got)
    assert got["younger"] == got["again"] == want[2][0]
    theirs = step12.LLM(model=str(demo_snapshot), block_size=BLOCK)
    assert got["older"] == greedy_ids(theirs, [LONG + " The"], params=step12.SamplingParams)[0][0]
    assert third.metrics.num_cached_tokens == (len(younger) - 1) // BLOCK * BLOCK


def test_a_request_part_way_is_preempted_first_and_recomputed(demo_snapshot, want, monkeypatch):
    """20 blocks of 4: a decoding request (3 + 30 tokens) needs blocks while a long prompt (74 tokens, 19
    blocks) computes a token a step (threshold 1); the part-way one steps back (its computed blocks cached),
    returns once the other finishes, and both equal step 12."""
    preempted = []
    original = Scheduler._preempt

    def record(self, seq, computed):
        preempted.append((seq.request_id, computed, len(seq)))
        return original(self, seq, computed)

    monkeypatch.setattr(Scheduler, "_preempt", record)
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        num_kv_blocks=20,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=1,
    )
    short = engine.tokenizer.encode(PROMPTS[1])
    engine.add_request("short", short, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request(
        "long", engine.tokenizer.encode(PROMPTS[3]), SamplingParams(max_tokens=4, temperature=0)
    )
    got = run(engine)
    assert preempted and preempted[0][0] == "long" and 0 < preempted[0][1] < preempted[0][2] - 1
    theirs = step12.LLM(model=str(demo_snapshot), block_size=BLOCK)
    p12 = step12.SamplingParams
    assert got["short"] == greedy_ids(theirs, [PROMPTS[1]], p12, max_tokens=30, ignore_eos=True)[0][0]
    assert got["long"] == want[3][0][:4]
    assert engine.stats.num_used_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_part_way_leave_every_block_free(demo_snapshot, want, seed):
    """12 requests (the prompts twice, n = 1 or 2), budget 16, threshold 5, a 60-block pool; at random steps a
    request part-way through its prompt is aborted. After the run no block is in use, nothing is left
    part-way, and every request not aborted has step 12's ids."""
    rng = random.Random(seed)
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        num_kv_blocks=60,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
        async_scheduling=bool(seed % 2),
    )
    for i, prompt in enumerate(PROMPTS * 2):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=1 + (i % 3 == 0))
        engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
    aborted, got = set(), {}
    while engine.has_unfinished_requests():
        part_way = engine.scheduler.prefilling
        if part_way and rng.random() < 0.3:
            victim = rng.choice(part_way).request_id.split("_")[-1]
            engine.abort_request(victim)
            aborted.add(victim)
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert aborted
    assert engine.stats.num_used_blocks == 0 and engine.block_manager.block_tables == {}
    assert engine.scheduler.prefilling == engine.scheduler.running == []
    for (request_id, index), ids in got.items():
        if request_id not in aborted:
            assert ids == want[int(request_id) % len(PROMPTS)][0], (request_id, index)


# ---- the budget and the threshold ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, named",
    [
        (dict(max_num_batched_tokens=3), "max_num_batched_tokens=3: must be an integer >= max_num_seqs (2)"),
        (dict(max_num_batched_tokens=1, max_num_seqs=1), "max_num_batched_tokens=1"),  # below block_size 4
        (dict(max_num_batched_tokens=-5), "max_num_batched_tokens=-5: must be an integer >= 1"),
        (dict(max_num_batched_tokens=16, long_prefill_token_threshold=17), "long_prefill_token_threshold=17"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold=-1: must be an integer >= 1"),
        (dict(long_prefill_token_threshold=0), "long_prefill_token_threshold=0: must be an integer >= 1"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "max_num_batched_tokens=64"),
        (dict(enable_chunked_prefill="yes"), "enable_chunked_prefill='yes'"),
        (
            dict(enable_chunked_prefill=False, long_prefill_token_threshold=8),
            "long_prefill_token_threshold=8",
        ),
    ],
)
def test_bad_budgets_are_refused_naming_the_field(demo_snapshot, args, named):
    with pytest.raises(ValueError, match="^" + named.replace("(", r"\(").replace(")", r"\)")):
        EngineArgs(
            model=str(demo_snapshot), block_size=BLOCK, max_num_seqs=args.pop("max_num_seqs", 2), **args
        )


def test_the_defaults_are_the_devices_and_printed(demo_snapshot, capsys):
    args = EngineArgs(model=str(demo_snapshot), max_num_seqs=600)
    assert args.max_num_batched_tokens == 600  # the CPU default (512) is below max_num_seqs
    assert EngineArgs(model=str(demo_snapshot)).max_num_batched_tokens == 512
    LLMEngine(model=str(demo_snapshot), max_num_batched_tokens=64, long_prefill_token_threshold=16)
    err = capsys.readouterr().err
    assert (
        "scheduler: chunked prefill on, max_num_batched_tokens 64 (the cpu default is 512), "
        "long_prefill_token_threshold 16\n"
    ) in err


def test_the_command_line_refuses_a_bad_budget_with_the_same_line(run_main):
    from .__main__ import main as cli_main

    status, out, err = run_main(
        cli_main, ["--model", "demo", "--port", "0", "--max-num-batched-tokens", "16", "--max-num-seqs", "32"]
    )
    assert status == 2 and out == "", err
    named = "max_num_batched_tokens=16: must be an integer >= max_num_seqs (32) and >= block_size (16)"
    assert err == f"error: {named}\n"


def test_a_prompt_longer_than_the_budget_is_chunked_not_refused(demo_snapshot):
    llm = chunked(demo_snapshot, 16)
    prompt = torch.randint(0, 8000, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.stats.num_steps >= 400 // 16


@pytest.mark.parametrize("budget, threshold, kv_cache_dtype", [(16, 7, "auto"), (37, None, "int8")])
def test_a_mixed_step_padded_to_a_token_count_says_the_same(
    demo_snapshot, want, budget, threshold, kv_cache_dtype
):
    """The pass a mixed step's CUDA graph captures, run eagerly through the Triton interpreter: padded to a
    token count (tokens in no lane) and to ``mixed_lanes`` lanes (lanes of no token), decode ids gathered on
    the device, async scheduling. The same ids as step 12 (the int8 pool: as step 13's own unpadded run)."""
    prompts = [PROMPTS[i] for i in (1, 2, 4, 5)]
    want = [[ids[:8] for ids in want[i]] for i in (1, 2, 4, 5)]  # 8 tokens: the interpreter is slow
    args = dict(
        attention_backend="triton", max_num_seqs=4, async_scheduling=True, kv_cache_dtype=kv_cache_dtype
    )
    llm = chunked(demo_snapshot, budget, threshold, **args)
    runner, padded = llm.engine.model_runner, []
    forward = runner.mixed_forward
    runner.mixed_forward = lambda num_tokens: padded.append(num_tokens) or forward(num_tokens)
    if kv_cache_dtype == "int8":
        unpadded = chunked(demo_snapshot, 10**6, kv_cache_dtype="int8", enable_chunked_prefill=False)
        want = greedy_ids(unpadded, prompts, max_tokens=8)
    assert greedy_ids(llm, prompts, max_tokens=8) == want
    assert runner.token_sizes[-1] == budget and padded and set(padded) <= set(runner.token_sizes)


# ---- on a GPU: `pytest -m gpu step13_chunked_prefill` (skipped without CUDA) -------------------------------

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("budget, threshold", [(16, 7), (64, None), (512, 64)])
def test_gpu_chunks_beside_graph_replayed_decodes(demo_snapshot, dtype, budget, threshold):
    """CUDA graphs, async scheduling and the Triton kernels: the same ids as chunking off (fp32; fp16 too,
    the batches' compositions differ but each lane's arithmetic does not), and every step replays a graph:
    decode-only steps their batch size's, steps with a prompt or a chunk their token count's; chunking off,
    those run eagerly (step 12's)."""
    args = dict(model=str(demo_snapshot), device="cuda", dtype=dtype, block_size=16)
    off = LLM(**args, enable_chunked_prefill=False)
    on = LLM(**args, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = greedy_ids(off, **params)
    assert greedy_ids(on, **params) == want
    stats, runner = on.stats, on.engine.model_runner
    assert runner.graph_runner is not None and runner.mixed_graph_runner is not None
    assert stats.num_eager_steps == 0 and stats.num_steps >= MAX_TOKENS
    assert off.engine.model_runner.mixed_graph_runner is None and off.stats.num_eager_steps > 0


def test_a_huge_budget_allocates_only_what_a_step_can_hold(demo_snapshot):
    """A budget far past any step (10**30 tokens) is allowed; the input buffers hold what a step can: at most
    max_num_seqs sequences of a window each (steps 7-12 the same)."""
    llm = chunked(demo_snapshot, 10**30, max_num_seqs=2)
    assert len(llm.engine.model_runner.input_batch.np["input_ids"]) == 2 * 512
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("step", ["step10_engine_core", "step11_speculative", "step12_quantized_kv", "here"])
@pytest.mark.parametrize("part_way", [False, True, "async"])
def test_aborting_one_choice_before_the_fork(demo_snapshot, want, step, index, part_way):
    """``abort_request(id, index)`` of a request of 3 choices before they are forked (waiting; in this step
    also part-way through its prompt, its chunk in flight or not): that choice ends, the other two finish
    with the greedy ids, and no block is left in use. Before the fix the aborted choice was forked all the
    same and held its blocks, or (index 0) the choices it carried were never scheduled."""
    import importlib

    if part_way and step != "here":
        pytest.skip("only this step has prompts part-way")
    module = importlib.import_module(__package__ if step == "here" else step)
    args = dict(max_num_batched_tokens=16) if step == "here" else {}
    if part_way == "async":  # its chunk in flight when the abort comes: the heir takes that chunk's end too
        args["async_scheduling"] = True
    engine = module.LLMEngine(model=str(demo_snapshot), block_size=BLOCK, **args)
    prompt = engine.tokenizer.encode(PROMPTS[3])
    engine.add_request("a", prompt, module.SamplingParams(max_tokens=5, temperature=0, n=3))
    if part_way:
        engine.step()
        assert engine.scheduler.prefilling
    engine.abort_request("a", index)
    got: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 200
    others = {i: got[i] for i in range(3) if i != index}
    assert got[index] == [] and all(ids == want[3][0][:5] for ids in others.values())
    assert engine.stats.num_used_blocks == 0 and engine.scheduler.running == []

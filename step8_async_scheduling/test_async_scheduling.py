"""Step 8 tests: with async scheduling the outputs are step 7's, exactly, and no KV block is left behind.

On a CPU the overlap path runs as on a GPU, with synchronous copies (``async_scheduling=True``). Every
output equals step 7's (the oracle): greedy and seeded sampling, stop strings and stop tokens,
max_tokens = 1, logprobs, penalties (the synchronous exception), streams, aborts mid-run, preemption,
requests arriving mid-run, in the engine and through the server; a sequence whose last token (max_tokens,
the window) is in flight gets no position in the next step (no lane, no block, no preemption for it);
random runs with aborts and preemption end with every block free. With CUDA (``gpu`` tests): fp16 greedy
ids equal step 7's, and a decode step's only waits are on the events of step N-1's sampled ids and of the
input copy.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import step7_cuda_graphs as step7

from .__main__ import parse_args
from .api_server import build_app
from .config import EngineArgs
from .engine import LLMEngine, uses_penalty
from .llm import LLM
from .sampling_params import SamplingParams

step8 = sys.modules[__package__]
PROMPTS = [
    "The Python interpreter",
    "x",
    "A list comprehension is a concise way to",
    "Exceptions are raised when",
    "def fibonacci(n):",
    "import os",
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SMALL_POOL = dict(max_num_seqs=4, block_size=4, num_kv_blocks=10)  # preempts with 4 requests of 12 tokens


@pytest.fixture(scope="module")
def ours(demo_snapshot) -> LLM:
    return LLM(model=str(demo_snapshot), max_num_seqs=4, async_scheduling=True)


@pytest.fixture(scope="module")
def theirs(demo_snapshot) -> step7.LLM:
    return step7.LLM(model=str(demo_snapshot), max_num_seqs=4)


@pytest.fixture(scope="module")
def tiny_engines(tiny_snapshot) -> tuple[LLMEngine, step7.LLMEngine]:
    """Step 8 (async) and step 7 on the tiny random model, with a pool of 10 blocks of 4 tokens."""
    return (
        LLMEngine(model=str(tiny_snapshot), async_scheduling=True, **SMALL_POOL),
        step7.LLMEngine(model=str(tiny_snapshot), **SMALL_POOL),
    )


def final(out) -> tuple:
    """What a finished output says, as plain values (logprobs as tuples: the two steps' classes differ)."""
    c = out.outputs[0]
    logprobs = (
        None
        if c.logprobs is None
        else [sorted((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()) for d in c.logprobs]
    )
    return c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs


def drive(engine, module, requests, aborts=(), check=None) -> dict:
    """A fixed script: ``requests`` = (id, prompt, SamplingParams kwargs, step it arrives at), ``aborts`` =
    (id, step); steps until nothing is unfinished, ``check(engine)`` after every step. Returns {id: final}
    and checks that the engine ends empty: no request, no step in flight, every block free."""
    outputs, step = {}, 0
    while step <= max(r[3] for r in requests) or engine.has_unfinished_requests():
        for request_id, prompt, params, at in requests:
            if at == step:
                engine.add_request(request_id, prompt, module.SamplingParams(**params))
        for request_id, at in aborts:
            if at == step:
                engine.abort_request(request_id)
        for out in engine.step():
            outputs[out.request_id] = final(out)
        if check is not None:
            check(engine)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and getattr(engine, "in_flight", None) is None
    return outputs


def compare(ours_out: dict, theirs_out: dict, aborted=()) -> None:
    """Equal outputs; an aborted request's tokens are a prefix of step 7's (its last one may be in flight)."""
    assert ours_out.keys() == theirs_out.keys()
    for request_id, theirs_final in theirs_out.items():
        if request_id in aborted:
            assert ours_out[request_id][2] == theirs_final[2] == "abort"
            assert theirs_final[0][: len(ours_out[request_id][0])] == ours_out[request_id][0]
        else:
            assert ours_out[request_id] == theirs_final, request_id


def greedy(n: int) -> dict:
    return dict(max_tokens=n, temperature=0, ignore_eos=True)


def test_arrivals_and_an_abort_equal_step7_async_and_serial(ours, theirs):
    """Six requests finishing at different steps, two arriving at step 3, one aborted at step 5; the steps
    really overlap (a step is in flight between calls). With async scheduling off, the same code runs
    serially and nothing is ever left in flight."""
    requests = [(f"r{i}", p, greedy(3 + 3 * i), 0) for i, p in enumerate(PROMPTS)]
    requests += [("late0", "Generators are", greedy(6), 3), ("late1", "for i in range(10):", greedy(2), 3)]
    aborts = [("r5", 5)]
    seen_in_flight = []
    check = lambda engine: seen_in_flight.append(engine.in_flight is not None)  # noqa: E731
    expected = drive(theirs.engine, step7, requests, aborts)
    compare(drive(ours.engine, step8, requests, aborts, check), expected, aborted={"r5"})
    assert sum(seen_in_flight) >= len(seen_in_flight) - 1  # all but the last call leave a step in flight
    ours.engine.async_scheduling, seen_in_flight[:] = False, []
    try:
        assert drive(ours.engine, step8, requests, aborts, check) == expected
    finally:
        ours.engine.async_scheduling = True
    assert not any(seen_in_flight)


def test_sampling_stops_and_logprobs_equal_step7(ours, theirs, monkeypatch):
    """Seeded sampling (temperature, top-k, top-p, min-p), a stop string and a stop token taken from step 7's
    own greedy text (so that they do occur), max_tokens = 1, logprobs, and penalties: a penalised request
    makes the step after it wait for its tokens, so no schedule ever sees one in flight."""
    base = theirs.generate(PROMPTS[0], step7.SamplingParams(**greedy(12)))[0].outputs[0]
    stop_string, stop_token = base.text[len(base.text) // 2 :][:3], base.token_ids[6]
    cases = [
        dict(max_tokens=10, temperature=0.9, top_k=40, top_p=0.9, seed=7),
        dict(max_tokens=10, temperature=1.2, min_p=0.05, seed=11, logprobs=3),
        dict(max_tokens=12, temperature=0, stop=[stop_string]),
        dict(max_tokens=12, temperature=0, stop_token_ids=[stop_token]),
        dict(max_tokens=1, temperature=0, logprobs=2),
        dict(max_tokens=10, temperature=0.8, seed=3, repetition_penalty=1.3),
        dict(max_tokens=10, temperature=0, presence_penalty=0.6, frequency_penalty=0.4, logprobs=1),
    ]
    scheduled_with_penalty_in_flight = []
    schedule = ours.engine.scheduler.schedule

    def recording():
        in_flight = ours.engine.in_flight
        scheduled_with_penalty_in_flight.append(
            in_flight is not None and any(uses_penalty(seq.params) for seq in in_flight.seqs)
        )
        return schedule()

    monkeypatch.setattr(ours.engine.scheduler, "schedule", recording)
    for params in cases:  # all prompts at once: each case shares batches with the others
        ours_out = ours.generate(PROMPTS[:5], SamplingParams(**params))
        theirs_out = theirs.generate(PROMPTS[:5], step7.SamplingParams(**params))
        assert [final(o) for o in ours_out] == [final(o) for o in theirs_out], params
    assert final(ours_out[0])[0] and not any(scheduled_with_penalty_in_flight)
    assert stop_string not in ours.generate(PROMPTS[0], SamplingParams(**cases[2]))[0].outputs[0].text
    streamed = list(ours.stream(PROMPTS[0], SamplingParams(**cases[2])))  # a stream: the same pieces
    assert streamed == list(theirs.stream(PROMPTS[0], step7.SamplingParams(**cases[2]))) and streamed


def test_preemption_equals_step7(tiny_engines):
    """Four requests of 12 tokens in 10 blocks of 4: sequences are preempted (one of them while its token
    is in flight: that token is still appended) and prefilled again; one is aborted."""
    ours_engine, theirs_engine = tiny_engines
    before = ours_engine.stats.num_preemptions, theirs_engine.stats.num_preemptions
    requests = [(f"p{i}", [11 + i, 12, 13, 14, 15][: 2 + i], greedy(12), 0) for i in range(4)]
    requests.append(("pl", [7, 8, 9], greedy(5), 4))
    aborts = [("p1", 6)]
    compare(
        drive(ours_engine, step8, requests, aborts), drive(theirs_engine, step7, requests, aborts), {"p1"}
    )
    assert ours_engine.stats.num_preemptions > before[0] and theirs_engine.stats.num_preemptions > before[1]


def test_finishing_at_a_block_boundary_takes_no_extra_block(tiny_engines, monkeypatch):
    """3 prompt tokens + 2 generated fill one block of 4 and would need a fifth slot only for a third token.
    The step scheduled while the second (last) token is in flight gives the sequence no position, so it
    never takes a second block, as in step 7."""
    ours_engine, theirs_engine = tiny_engines
    tables_after_schedule = []
    schedule = ours_engine.scheduler.schedule

    def recording():
        out = schedule()
        tables_after_schedule.append(len(ours_engine.block_manager.block_tables.get("edge", [])))
        return out

    monkeypatch.setattr(ours_engine.scheduler, "schedule", recording)
    requests = [("edge", [21, 22, 23], greedy(2), 0)]
    assert drive(ours_engine, step8, requests) == drive(theirs_engine, step7, requests)
    assert tables_after_schedule == [1, 1, 1]  # prefill, decode, the last read (nothing scheduled)


def lanes_and_preemptions(engine, module, requests) -> tuple[dict[str, int], int]:
    """Run ``requests`` (``drive``'s script) and count each request's lanes (the steps that computed a
    position of it) and the preemptions."""
    lanes = {}
    schedule = engine.scheduler.schedule

    def counting():
        scheduled = schedule()
        for seq in scheduled.seqs:
            lanes[seq.request_id] = lanes.get(seq.request_id, 0) + 1
        return scheduled

    engine.scheduler.schedule = counting
    before = engine.stats.num_preemptions
    try:
        drive(engine, module, requests)
    finally:
        del engine.scheduler.schedule
    return lanes, engine.stats.num_preemptions - before


def test_no_position_scheduled_past_max_tokens_or_the_window(tiny_snapshot):
    """A request whose last token (its max_tokens-th, or the one that reaches the window) is in flight gets
    no position in the next step (vLLM PR #27922): max_tokens 1, 2 and 5 take 1, 2 and 5 lanes (one
    prefill, then a decode per token but the last), as step 7 does, and so does a 62-token prompt with 2 more
    in a 64-token window. In a pool of 4 blocks the extra position would take a block and preempt the other
    request (3 prompt tokens + 2 need one block, 7 + 6 three); outputs equal step 7's."""
    serial = step7.LLMEngine(model=str(tiny_snapshot), max_num_seqs=4)
    overlapped = LLMEngine(model=str(tiny_snapshot), max_num_seqs=4, async_scheduling=True)
    requests = [(f"m{n}", [11, 12, 13], greedy(n), 0) for n in (1, 2, 5)]
    requests.append(("window", list(range(100, 162)), greedy(2), 0))  # its last token fills the window
    expected = {"m1": 1, "m2": 2, "m5": 5, "window": 2}
    assert lanes_and_preemptions(serial, step7, requests) == (expected, 0)
    assert lanes_and_preemptions(overlapped, step8, requests) == (expected, 0)
    pool = dict(max_num_seqs=2, block_size=4, num_kv_blocks=4)
    requests = [("short", [21, 22, 23], greedy(2), 0), ("long", [31, 32, 33, 34, 35, 36, 37], greedy(6), 0)]
    theirs = step7.LLMEngine(model=str(tiny_snapshot), **pool)
    ours = LLMEngine(model=str(tiny_snapshot), async_scheduling=True, **pool)
    assert lanes_and_preemptions(theirs, step7, requests) == ({"short": 2, "long": 6}, 0)
    assert lanes_and_preemptions(ours, step8, requests) == ({"short": 2, "long": 6}, 0)
    assert drive(ours, step8, requests) == drive(theirs, step7, requests)


REQUEST = st.tuples(
    st.lists(st.integers(0, 8191), min_size=1, max_size=14),  # the prompt's ids
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # the step it arrives at
    st.one_of(st.none(), st.integers(0, 12)),  # the step it is aborted at, if it is
    st.one_of(st.none(), st.integers(0, 2**16)),  # a seed (sampled at temperature 1), or greedy
)


@settings(
    max_examples=40,
    deadline=None,  # no time limits: the suite runs on loaded machines too
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(REQUEST, min_size=20, max_size=30))  # 40 runs: about 1,000 requests
def test_random_requests_leave_no_block_and_equal_step7(tiny_engines, script):
    """Random prompts, lengths, arrivals, aborts and seeds in a pool that preempts: every block is free at
    the end (``drive`` checks), and every request not aborted gives step 7's output."""
    ours_engine, theirs_engine = tiny_engines
    requests, aborts = [], []
    for i, (prompt, max_tokens, at, abort_at, seed) in enumerate(script):
        params = dict(
            max_tokens=max_tokens, ignore_eos=True, temperature=0 if seed is None else 1.0, seed=seed
        )
        requests.append((f"h{i}", prompt, params, at))
        if abort_at is not None:
            aborts.append((f"h{i}", abort_at))
    aborted = {request_id for request_id, _ in aborts}
    ours_out = drive(ours_engine, step8, requests, aborts)
    theirs_out = drive(theirs_engine, step7, requests, aborts)
    assert {k: v for k, v in ours_out.items() if k not in aborted} == {
        k: v for k, v in theirs_out.items() if k not in aborted
    }


def test_server_streams_step7s_completions(demo_snapshot, theirs):
    """Through the HTTP server (FastAPI's TestClient, no socket): three prompts in one request and a
    stream with a stop string give step 7's in-process texts; /v1/engine/stats says async scheduling is on."""
    engine = LLMEngine(model=str(demo_snapshot), max_num_seqs=4, async_scheduling=True)
    with TestClient(build_app(engine, "demo")) as client:
        features = client.get("/v1/engine/stats").json()["features"]
        body = dict(model="demo", prompt=PROMPTS[:3], max_tokens=8, temperature=0)
        texts = [c["text"] for c in sorted(client.post("/v1/completions", json=body).json()["choices"],
                                           key=lambda c: c["index"])]  # fmt: skip
        stream = dict(model="demo", prompt=PROMPTS[2], max_tokens=12, temperature=0, stream=True, stop=[" a"])
        with client.stream("POST", "/v1/completions", json=stream) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    expected = theirs.generate(PROMPTS[:3], step7.SamplingParams(max_tokens=8, temperature=0))
    assert texts == [o.outputs[0].text for o in expected]
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
    params = step7.SamplingParams(max_tokens=12, temperature=0, stop=[" a"])
    assert streamed == theirs.generate(PROMPTS[2], params)[0].outputs[0].text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert features["async_scheduling"] is True and features["cuda_graphs"] is False


def test_async_scheduling_argument(demo_snapshot):
    assert EngineArgs(model=str(demo_snapshot)).async_scheduling is False  # a CPU: nothing to overlap
    assert EngineArgs(model=str(demo_snapshot), async_scheduling=True).async_scheduling is True
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(model=str(demo_snapshot), async_scheduling="yes")
    assert parse_args([]).async_scheduling is None  # EngineArgs.from_cli_args takes it
    assert parse_args(["--async-scheduling"]).async_scheduling is True
    assert parse_args(["--no-async-scheduling"]).async_scheduling is False


# ---------------------------------------------------------------------------------------------------------
# On a GPU: async scheduling is the default there


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_greedy_equals_step7(demo_snapshot, dtype):
    """CUDA graphs, three requests arriving at step 4 (a mixed eager step). fp16: every request ends at
    the same step, so both engines run the same batches (a batch of another size may pick other GEMM
    kernels, whose fp16 rounding differs: step 8 runs a finished sequence one step longer); fp32: batches
    shrinking from 9 to 1 as requests finish one by one (rungs 16, 8, 4, 2, 1 and the sizes between)."""
    ours = LLM(model=str(demo_snapshot), device="cuda", dtype=dtype, max_num_seqs=16)
    theirs = step7.LLM(model=str(demo_snapshot), device="cuda", dtype=dtype, max_num_seqs=16)
    assert ours.engine.async_scheduling and ours.engine.model_runner.graph_runner is not None
    together = dtype == "float16"
    requests = [(f"r{i}", PROMPTS[i], greedy(24 if together else 6 + 5 * i), 0) for i in range(6)]
    requests += [(f"l{i}", PROMPTS[i], greedy(20 if together else 9 + 3 * i), 4) for i in range(3)]
    compare(drive(ours.engine, step8, requests), drive(theirs.engine, step7, requests))


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_step_waits_only_on_its_events(demo_snapshot, monkeypatch):
    """A decode step (greedy, seeded top-p, logprobs) makes no synchronising CUDA call (torch's sync debug
    mode warns at each stream or device sync and at each blocking copy); its only waits are two events:
    step N-1's sampled ids, and the input copy of step N-1 before the host buffer is written again."""
    import warnings

    engine = LLMEngine(model=str(demo_snapshot), device="cuda", max_num_seqs=8)
    kinds = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True),
    ]
    for i, params in enumerate(kinds):
        engine.add_request(f"r{i}", PROMPTS[i], params)
    for _ in range(3):  # the prefill, then decode steps with a step in flight
        engine.step()
    event_waits = []
    wait = torch.cuda.Event.synchronize
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: event_waits.append(1) or wait(self))
    for _ in range(5):
        torch.cuda.synchronize()
        event_waits.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert not [w for w in caught if "called a synchronizing" in str(w.message)]
        assert len(event_waits) == 2 and len(outputs) == 3


@pytest.mark.parametrize("steps_before", [0, 1])
def test_the_last_request_aborted_still_gets_its_abort_output(ours, steps_before):
    """The only request, aborted while waiting (no step in flight) or with a step in flight, keeps the
    engine unfinished until a step has returned its final output (finish_reason "abort"), and only that."""
    engine = ours.engine
    engine.add_request("last", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(steps_before):
        engine.step()
    engine.abort_request("last")
    assert engine.has_unfinished_requests()
    finals = [o for _ in range(3) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals] == [("last", "abort")]
    assert not engine.has_unfinished_requests()

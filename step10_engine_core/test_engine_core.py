"""Step 10 tests: the engine core in its own process gives step 9's outputs, and every fault ends cleanly.

The oracle is step 9's engine, in process. Through ``LLM`` (the core in this process and in a child) and the
server (the core in a child): greedy and seeded outputs, stop strings and tokens, n choices, logprobs,
aborts, preemption, prefix-cache hits, streamed and not. The frontend's parts alone: stop strings across
tokens, ``stream_interval``, the collector. Faults, as processes: the core killed or stopped by a signal
(streams end with an error event and ``[DONE]``, 503s, never a 500, exit 1), a step that raises, the server
killed (the core exits, no socket left), SIGTERM and SIGINT to the server, an engine that cannot start, a
client that disconnects (nothing running, no KV block in use). Waits poll for the event with a generous
bound (``SAFETY_NET_S``), never a fixed sleep.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import torch
import uvicorn
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import step9_prefix_cache

from .api_server import build_app
from .config import EngineArgs
from .core_client import AsyncMPClient, EngineDeadError, SyncMPClient
from .llm import LLM
from .messages import (
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
    input_decoder,
    input_encoder,
    output_decoder,
)
from .output_processor import OutputProcessor, RequestOutputCollector
from .sampling_params import RequestOutputKind, SamplingParams

SAFETY_NET_S = 300  # the bound of every wait for an event: a net against a hang, never a measure of speed
BLOCK = 4
PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "x",
    "Modules can import other modules.",
]
ENGINE_ARGS = dict(block_size=BLOCK, max_num_seqs=8)


def cases() -> list[tuple[str, dict]]:
    """Prompts and sampling fields: greedy, seeded, stop strings (one spanning tokens), a stop token,
    n choices, logprobs, penalties, the end of sequence, a window-long request."""
    return [
        (PROMPTS[0], dict(max_tokens=24, temperature=0)),
        (PROMPTS[1], dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)),
        (PROMPTS[2], dict(max_tokens=40, temperature=0, stop=["during", " raised"])),
        (PROMPTS[0], dict(max_tokens=40, temperature=0, stop=[" interpreter."])),  # spans two tokens
        (PROMPTS[3], dict(max_tokens=20, temperature=0, stop_token_ids=[87, 198])),
        (PROMPTS[4], dict(n=3, max_tokens=12, temperature=1.0, seed=3)),
        (PROMPTS[1], dict(max_tokens=8, temperature=0, logprobs=2)),
        (PROMPTS[2], dict(max_tokens=16, temperature=0.7, repetition_penalty=1.3, seed=1)),
        (PROMPTS[3], dict(max_tokens=30, temperature=0, presence_penalty=1.0, frequency_penalty=0.5)),
        ("x x x", dict(max_tokens=509, temperature=0, ignore_eos=True)),  # to the window
    ]


def as_tuples(outputs, tolerance: float | None = None) -> list:
    """Every field of every choice (the two steps' Logprob classes compared by their fields); with a
    tolerance, the logprobs compare within it (nats)."""

    def fields(lp) -> dict:
        value = lp.logprob if tolerance is None else pytest.approx(lp.logprob, abs=tolerance)
        return {**vars(lp), "logprob": value}

    def logprobs(c):
        return c.logprobs and [{t: fields(lp) for t, lp in entry.items()} for entry in c.logprobs]

    return [
        [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, logprobs(c)) for c in out.outputs]
        for out in outputs
    ]


@pytest.fixture(scope="module")
def oracle(demo_snapshot):
    return step9_prefix_cache.LLM(model=str(demo_snapshot), **ENGINE_ARGS)


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "multiprocess"])
def llm(request, demo_snapshot):
    llm = LLM(model=str(demo_snapshot), multiprocessing=request.param, **ENGINE_ARGS)
    yield llm
    llm.engine_core.shutdown()


# ---------------------------------------------------------------------------------------------------------
# LLM: the same outputs as step 9's, with the core in this process and in a child process
# ---------------------------------------------------------------------------------------------------------


def test_llm_outputs_equal_step9(llm, oracle):
    prompts, fields = zip(*cases())
    ours = llm.generate(list(prompts), [SamplingParams(**f) for f in fields])
    theirs = oracle.generate(list(prompts), [step9_prefix_cache.SamplingParams(**f) for f in fields])
    # A child process takes the requests as they arrive, so its first steps may batch fewer of them than
    # step 9's: a row's logits then differ in their last bits (CPU matmuls; about 5e-6 nats here)
    assert as_tuples(ours) == as_tuples(theirs, None if llm.engine is not None else 1e-4)
    stopped = [out.outputs[0] for out in ours[2:5]]
    assert [c.finish_reason for c in stopped] == ["stop"] * 3
    assert [c.stop_reason for c in stopped] == [" raised", " interpreter.", 87]
    assert len(ours[5].outputs) == 3 and len({tuple(c.token_ids) for c in ours[5].outputs}) > 1
    assert ours[-1].outputs[0].finish_reason == "length"
    assert llm.stats.num_running_reqs == 0 and llm.stats.num_used_blocks == 0


def test_llm_streams_equal_step9(llm, oracle):
    """One output per token, as step 9's: the same pieces, the text held back where a stop string may
    start; closing a stream early aborts its request in the core (nothing left running or holding blocks)."""
    for prompt, fields in cases()[:5]:
        ours = [
            (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.stream_outputs(prompt, SamplingParams(**fields))
        ]
        theirs = [
            (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in oracle.stream_outputs(prompt, step9_prefix_cache.SamplingParams(**fields))
        ]
        assert ours == theirs


def test_stats_show_what_a_stop_string_or_a_closed_stream_ended(llm):
    """A stop string ends a choice in the frontend and a closed stream its request, each after the step
    whose stats ``LLM`` holds; both are aborted in the core, and ``LLM.stats`` waits for the aborts to be
    applied (in process: one step; in a child: its next messages): nothing running, no block in use."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, stop=[" raised"])
    (out,) = llm.generate(PROMPTS[2], params)
    assert out.outputs[0].stop_reason == " raised" and len(out.outputs[0].token_ids) < 400
    assert (llm.stats.num_running_reqs, llm.stats.num_waiting_reqs, llm.stats.num_used_blocks) == (0, 0, 0)
    pieces = llm.stream(PROMPTS[0], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    assert [next(pieces) for _ in range(3)]
    assert llm.stats.num_running_reqs == 1
    pieces.close()  # aborted in the core
    assert (llm.stats.num_running_reqs, llm.stats.num_waiting_reqs, llm.stats.num_used_blocks) == (0, 0, 0)


def test_preemption_and_prefix_hits_equal_step9(demo_snapshot, llm):
    """One request of n = 4 seeded choices of a 14-token prompt in a pool of 20 blocks of 4 tokens: the four
    choices outgrow the pool (preemption all along), then the same request again (prefix-cache hits). One
    request, so the core admits it in one step however its messages arrive: ids, preemptions and hits are
    step 9's, in process and in a child process."""
    args = dict(block_size=BLOCK, num_kv_blocks=20, max_num_seqs=4)
    ours = LLM(model=str(demo_snapshot), multiprocessing=llm.engine is None, **args)
    theirs = step9_prefix_cache.LLM(model=str(demo_snapshot), **args)
    tok = ours.get_tokenizer()
    prompt = tok.encode("The standard library of Python has modules for files, dates and")[:12] + [3000, 3100]
    fields = dict(n=4, seed=5, max_tokens=16, temperature=1.0, ignore_eos=True)
    for _ in range(2):
        a = ours.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**fields))
        b = theirs.generate(
            prompt_token_ids=[prompt], sampling_params=step9_prefix_cache.SamplingParams(**fields)
        )
        assert as_tuples(a) == as_tuples(b)
    s, t = ours.stats, theirs.engine.stats
    assert s.num_preemptions == t.num_preemptions > 0 and s.num_used_blocks == 0
    assert (s.prefix_cache_hits, s.prefix_cache_queries) == (t.prefix_cache_hits, t.prefix_cache_queries)
    assert s.prefix_cache_hits > 0
    ours.engine_core.shutdown()


def test_bad_requests_are_refused_before_anything_is_queued(llm, oracle):
    """The frontend refuses them (processor.py) with step 9's words, before anything reaches the core."""

    def refusal(target, module, prompts=None, ids=None, **fields) -> str:
        params = module.SamplingParams(**fields) if fields else None
        with pytest.raises(ValueError) as e:
            target.generate(prompts, params, prompt_token_ids=ids)
        return str(e.value)

    bad = [
        dict(ids=[[1, 2, 10**6]]),
        dict(ids=[[1, 2], []]),
        dict(ids=[-1]),
        dict(prompts="x", n=9),
        dict(ids=[[5] * 512]),
        dict(ids=[[5] * 500], max_tokens=13),
        dict(prompts="x", stop_token_ids=[10**6]),
    ]
    for case in bad:
        assert refusal(llm, sys.modules[__package__], **case) == refusal(oracle, step9_prefix_cache, **case)
    assert "prompts[1]: prompt_token_ids is empty" in refusal(llm, sys.modules[__package__], ids=[[1, 2], []])
    with pytest.raises(ValueError, match="multiprocessing"):
        LLM(multiprocessing="yes")
    assert not llm.output_processor.requests


# ---------------------------------------------------------------------------------------------------------
# The frontend's parts: stop strings, stream_interval, the collector, the messages
# ---------------------------------------------------------------------------------------------------------


def feed(processor: OutputProcessor, request_id: str, ids: list[int], finish_at_end: str | None = None):
    """Feed ``ids`` to the processor one step at a time, as the core would; returns the outputs due and
    the aborts asked for."""
    outs, aborts = [], []
    for i, t in enumerate(ids):
        finish = finish_at_end if i == len(ids) - 1 else None
        done = processor.process_outputs([EngineCoreOutput(request_id, 0, [t], finish_reason=finish)])
        outs += done.request_outputs
        aborts += done.to_abort
    return outs, aborts


def test_stop_string_across_tokens_is_held_back_then_aborted(demo_snapshot):
    """A stop string that spans tokens: its beginning is held back, never streamed; the token completing it
    ends the choice (its id counts) and asks the core to abort it; the core's later tokens are dropped."""
    llm = LLM(model=str(demo_snapshot))
    tok = llm.get_tokenizer()
    ids = tok.encode(" is not available on the Python interpreter today")
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=["the Python"], output_kind=RequestOutputKind.DELTA)
    processor.add_request("r", None, [1], params)
    outs, aborts = feed(processor, "r", ids)
    text = "".join(o.outputs[0].text for o in outs)
    assert text == " is not available on " and outs[-1].outputs[0].finish_reason == "stop"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(
        tok.encode(" is not available on the Python")
    )
    assert aborts == [("r", 0)] and "r" not in processor.requests
    assert all("the" not in o.outputs[0].text for o in outs)  # " the" was held back, then dropped


def test_stream_interval_sends_every_n_tokens(demo_snapshot):
    tok = LLM(model=str(demo_snapshot)).get_tokenizer()
    ids = tok.encode(" one two three four five six seven eight nine ten")[:9]
    processor = OutputProcessor(tok, stream_interval=3)
    processor.add_request("r", None, [1], SamplingParams(output_kind=RequestOutputKind.DELTA))
    outs, _ = feed(processor, "r", ids, finish_at_end="length")
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 3, 2]  # the first at once, the last too
    assert "".join(o.outputs[0].text for o in outs) == tok.decode(ids)
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(tok, stream_interval=0)


def test_collector_merges_what_a_lagging_handler_has_not_taken(demo_snapshot):
    tok = LLM(model=str(demo_snapshot)).get_tokenizer()
    ids = tok.encode(" alpha beta gamma delta")
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1], SamplingParams(n=2, seed=0, output_kind=RequestOutputKind.DELTA))

    async def main():
        collector = RequestOutputCollector()
        taken = []
        for i, t in enumerate(ids):  # the handler keeps up: one output per step
            for out in processor.process_outputs([EngineCoreOutput("r", 0, [t])]).request_outputs:
                collector.put(out)
            taken.append(await collector.get())
        for t in ids:  # the handler lags: everything since, merged, both choices in one output
            for index in (0, 1):
                for out in processor.process_outputs([EngineCoreOutput("r", index, [t])]).request_outputs:
                    collector.put(out)
        (merged,) = await collector.get()
        collector.fail(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await collector.get()
        return taken, merged

    taken, merged = asyncio.run(main())
    assert [len(batch) for batch in taken] == [1] * len(ids)
    assert [c.index for c in merged.outputs] == [0, 1]
    assert merged.outputs[1].text == tok.decode(ids) and merged.outputs[1].token_ids == ids
    assert merged.outputs[0].token_ids == ids and merged.outputs[0].text == tok.decode(ids)


def test_several_steps_at_once_give_one_output_per_choice(demo_snapshot):
    """A frontend behind the core processes the steps waiting in one call: each choice gets one output
    holding all its new tokens, and the request's finished output comes last (choices finishing in
    different steps of the call)."""
    tok = LLM(model=str(demo_snapshot)).get_tokenizer()
    ids = tok.encode(" alpha beta gamma delta")
    processor = OutputProcessor(tok)
    processor.add_request("r", None, [1], SamplingParams(n=2, seed=0, output_kind=RequestOutputKind.DELTA))
    steps = []
    for i, t in enumerate(ids):  # choice 1 finishes one step before choice 0
        steps += [
            EngineCoreOutput("r", 0, [t], finish_reason="length" if i == len(ids) - 1 else None),
            EngineCoreOutput("r", 1, [t], finish_reason="length" if i == len(ids) - 2 else None),
        ]
    outs = processor.process_outputs(steps).request_outputs
    assert [(o.outputs[0].index, o.finished) for o in outs] == [(1, False), (0, True)]
    assert outs[1].outputs[0].token_ids == ids and outs[1].outputs[0].text == tok.decode(ids)
    assert outs[0].outputs[0].token_ids == ids[:-1] and outs[0].outputs[0].finish_reason == "length"
    assert "r" not in processor.requests


def test_a_final_only_request_crosses_once_unless_the_frontend_needs_its_tokens(demo_snapshot, oracle):
    """A FINAL_ONLY request (``LLM.generate``'s) without stop strings needs nothing from the core before it
    finishes, as step 9's ``Sequence.output`` returns nothing till then: the core sends one output, every
    token with the time it was made; with a stop string the frontend looks for, one output per token.
    Either way ``LLM.generate`` gives step 9's output, one token time per token, in order."""
    engine = LLM(model=str(demo_snapshot), **ENGINE_ARGS).engine
    final = dict(max_tokens=12, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("plain", engine.tokenizer.encode(PROMPTS[0]), SamplingParams(**final))
    engine.add_request("stop", engine.tokenizer.encode(PROMPTS[0]), SamplingParams(**final, stop=["zzz"]))
    seen = {"plain": [], "stop": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    (plain,) = seen["plain"]
    assert len(plain.new_token_ids) == 12 and plain.finish_reason == "length"
    assert len(plain.token_times) == 12 and plain.token_times == sorted(plain.token_times)
    assert [len(o.new_token_ids) for o in seen["stop"]] == [1] * 12
    assert all(o.token_times is not None for o in seen["stop"])

    llm = LLM(model=str(demo_snapshot), **ENGINE_ARGS)
    (ours,) = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0))
    (theirs,) = oracle.generate([PROMPTS[1]], step9_prefix_cache.SamplingParams(max_tokens=12, temperature=0))
    assert (
        ours.outputs[0].text == theirs.outputs[0].text
        and ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    )
    times = ours.metrics.token_times
    assert len(times) == 12 and times == sorted(times) and times[0] >= ours.metrics.arrival_time


def test_messages_are_msgspec_never_pickle(llm):
    """Every frame the core sent decodes with msgspec alone, untyped, into plain lists (array_like, the tag
    first); the inputs too; no module of the step uses pickle."""
    for path in Path(__file__).parent.glob("*.py"):
        if path.name.startswith("test_"):
            continue
        names = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        names |= {a.attr for a in ast.walk(ast.parse(path.read_text())) if isinstance(a, ast.Attribute)}
        imported = {
            alias.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        assert not ({"pickle", "cloudpickle", "send_pyobj", "recv_pyobj"} & (names | imported)), path.name
    request = EngineCoreRequest("r", [1, 2], SamplingParams(n=2, stop=["a"], seed=3))
    frame = input_encoder().encode(request)
    assert msgspec.msgpack.decode(frame)[:3] == ["add", "r", [1, 2]]
    assert input_decoder().decode(frame) == request
    assert input_decoder().decode(input_encoder().encode(EngineCoreAbort("r", 1))) == EngineCoreAbort("r", 1)
    with pytest.raises(msgspec.ValidationError):
        input_decoder().decode(msgspec.msgpack.encode(["add", "r", "not ids", {}]))
    if llm.engine is not None:
        return
    frames = []
    decoder = llm.engine_core.decoder
    recorder = type("Recorder", (), {"decode": lambda self, f: frames.append(bytes(f)) or decoder.decode(f)})
    llm.engine_core.decoder = recorder()
    try:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0, logprobs=1))
    finally:
        llm.engine_core.decoder = decoder
    assert frames and all(msgspec.msgpack.decode(f)[0] == "outputs" for f in frames)
    assert all(type(output_decoder().decode(f)).__name__ == "EngineCoreOutputs" for f in frames)


# ---------------------------------------------------------------------------------------------------------
# The core's own faults: a step that raises, a core that cannot start, SIGTERM
# ---------------------------------------------------------------------------------------------------------


class FailingStepClient(SyncMPClient):
    """A core whose third step raises (patched in the child, before its loop starts)."""

    entry = (
        "import sys; from {package} import engine_core as ec; step = ec.EngineCore.step; "
        "calls = iter(range(10**9)); "
        "ec.EngineCore.step = lambda self: step(self) if next(calls) < 2 else 1 / 0; "
        "sys.exit(ec.main())"
    )


def test_a_step_that_raises_is_reported_and_the_core_exits_1(demo_snapshot, capfd):
    client = FailingStepClient(EngineArgs(model=str(demo_snapshot)))
    client.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    with pytest.raises(EngineDeadError, match="engine step failed: division by zero"):
        for _ in range(10):
            client.get_output()
    assert client.proc.wait(SAFETY_NET_S) == 1
    assert not client.alive
    with pytest.raises(EngineDeadError):
        client.add_request(EngineCoreRequest("s", [1], SamplingParams()))
    client.shutdown()
    assert not os.path.exists(client.socket_dir)
    assert "ZeroDivisionError" in capfd.readouterr().err  # the core's traceback, on the shared stderr


class StoppingCoreClient(SyncMPClient):
    """A core that a signal stops at its first request (raised where the signal's handler raises it) and
    that then lingers with its sockets closed, as an exiting interpreter can for a second (patched in the
    child: its ``Context.term`` sleeps, SIGTERM's default action restored, so that shutdown ends it)."""

    entry = (
        "import signal, sys, time, zmq; from {package} import engine_core as ec; "
        "zmq.Context.term = lambda self: (signal.signal(signal.SIGTERM, signal.SIG_DFL), time.sleep(600)); "
        "ec.EngineCore.add_request = lambda self, r: (_ for _ in ()).throw(ec.ShutdownRequested('SIGTERM')); "
        "sys.exit(ec.main())"
    )


def test_a_send_the_stopping_core_cannot_take_is_its_death(demo_snapshot):
    """Between a stopping core's closing its sockets and its exit, a send finds no reader (``zmq.Again``):
    the client is dead from then on (EngineDeadError, ``alive`` False), as the server's 503 needs; and the
    core's last word, read from the output socket, says that SIGTERM stopped it."""
    client = StoppingCoreClient(EngineArgs(model=str(demo_snapshot)))
    try:
        client.add_request(EngineCoreRequest("r0", [1, 2], SamplingParams(max_tokens=2)))  # stops the core
        with pytest.raises(EngineDeadError, match=f"pid {client.proc.pid}"):
            for i in range(1, 10**7):  # until its input socket has closed (a safety net, not a measure)
                client.add_request(EngineCoreRequest(f"r{i}", [1, 2], SamplingParams(max_tokens=2)))
        assert not client.alive and client.proc.poll() is None  # dead to the frontend, not yet exited
        last = output_decoder().decode(client.output.recv())
        assert last.error_type == "ShutdownRequested" and "stopped by SIGTERM" in last.message
    finally:
        client.shutdown()
    assert not os.path.exists(client.socket_dir)


def test_an_engine_that_cannot_start_raises_its_error(demo_snapshot):
    """A pool too large for the machine: the core's own error, raised by the constructor, as in process;
    the child has exited and its sockets are gone. An unknown argument, a bad dtype: refused here, before
    any child starts."""
    dirs = []
    original = SyncMPClient._wait_ready

    def wait_ready(self):
        dirs.append((self.socket_dir, self.proc))
        return original(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SyncMPClient, "_wait_ready", wait_ready)
        with pytest.raises(ValueError, match="does not fit|free"):
            LLM(model=str(demo_snapshot), multiprocessing=True, num_kv_blocks=10**9)
        with pytest.raises(TypeError, match="bogus"):
            LLM(model=str(demo_snapshot), multiprocessing=True, bogus=1)
        with pytest.raises(ValueError, match="dtype"):
            LLM(model=str(demo_snapshot), multiprocessing=True, dtype="int3")
    assert len(dirs) == 1  # the pool's: the other two started no core
    for socket_dir, proc in dirs:
        assert proc.poll() is not None and not os.path.exists(socket_dir)


def test_sigterm_stops_the_core_cleanly_and_the_frontend_says_so(demo_snapshot, capfd):
    llm = LLM(model=str(demo_snapshot), multiprocessing=True)
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].finished  # the core is in its loop
    pid = llm.engine_core.proc.pid
    os.kill(pid, signal.SIGTERM)
    assert llm.engine_core.proc.wait(SAFETY_NET_S) == 0  # stopped cleanly
    # what it froze after start-up (gc.freeze) is freed at exit: with triton (nanobind bindings) loaded,
    # objects still frozen then are reported, dozens of lines of "nanobind: leaked ..."
    assert "leaked" not in capfd.readouterr().err
    with pytest.raises(EngineDeadError, match=f"pid {pid}"):
        llm.generate("x", SamplingParams(max_tokens=2))
    llm.engine_core.shutdown()
    assert not os.path.exists(llm.engine_core.socket_dir)


def test_the_core_takes_one_torch_thread_unless_omp_num_threads_says(demo_snapshot, monkeypatch, capfd):
    """As vLLM's workers: with OMP_NUM_THREADS unset the core process runs torch on one thread (a thread per
    core would wait on the frontend's and a client's work), says so once started, and shows it among its
    features (the start-up line, /v1/engine/stats); a value set is the user's choice, kept."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    client = SyncMPClient(EngineArgs(model=str(demo_snapshot)))
    client.shutdown()
    assert client.config.features["torch_threads"] == 1
    threads = torch.get_num_threads()
    assert (f"torch threads {threads} -> 1" in capfd.readouterr().err) == (threads > 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    client = SyncMPClient(EngineArgs(model=str(demo_snapshot)))
    client.shutdown()
    assert client.config.features["torch_threads"] == 2
    assert "torch threads" not in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# The server: step 9's answers; a killed core; a client that leaves


def test_the_server_unfreezes_at_shutdown_what_it_froze_at_start_up(demo_snapshot):
    """gc.freeze() once started (vLLM #12287), gc.unfreeze() when it stops: else the objects stay frozen
    to the interpreter's exit, where triton's bindings report each one as leaked."""
    app = build_app(AsyncMPClient(EngineArgs(model=str(demo_snapshot), **ENGINE_ARGS)))

    async def serve_and_stop() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    assert asyncio.run(serve_and_stop()) > 0
    assert gc.get_freeze_count() == 0


def test_a_fresh_core_reports_its_pool_before_any_request(demo_snapshot):
    """The core's ready message carries the scheduler's stats: /v1/engine/stats (the page's figures) holds
    the pool from the start, not 0 of 0 blocks, and so does ``LLM.stats`` in process and in a child."""
    client = AsyncMPClient(EngineArgs(model=str(demo_snapshot), num_kv_blocks=7))
    with serve(build_app(client)) as url:
        stats = httpx.get(f"{url}/v1/engine/stats").json()
    assert (stats["kv_blocks_used"], stats["kv_blocks_total"], stats["kv_cache_usage"]) == (0, 7, 0.0)
    assert (stats["running"], stats["waiting"], stats["steps"]) == (0, 0, 0)
    assert client.config.stats.num_blocks == 7  # what SyncMPClient hands LLM.stats, as the same message
    in_process = LLM(model=str(demo_snapshot), num_kv_blocks=7)
    assert in_process.stats.num_blocks == 7
    # one type from the scheduler to the page: every field of it in /v1/engine/stats, by its name
    assert (
        type(in_process.engine.stats) is type(in_process.stats) is type(client.config.stats) is SchedulerStats
    )
    assert msgspec.structs.asdict(client.config.stats).items() <= stats.items()


# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(app):
    """Run ``app`` with uvicorn in a thread on a free 127.0.0.1 port; yields its base URL; stops it after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SAFETY_NET_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture(scope="module")
def servers(demo_snapshot):
    """Step 10's server (its core in a child process) and step 9's, on the same engine arguments."""
    args = dict(model=str(demo_snapshot), **ENGINE_ARGS)
    ours = build_app(AsyncMPClient(EngineArgs(**args)))
    theirs = step9_prefix_cache.build_app(step9_prefix_cache.LLMEngine(**args))
    with serve(ours) as url, serve(theirs) as oracle_url:
        yield url, oracle_url, ours


def events(response) -> list:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def merged_stream(lines: list[str]) -> dict:
    """A stream's chunks per choice: text (or content) concatenated, logprobs joined, the finish; usage."""
    choices, usage = {}, None
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line)
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            into = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None})
            into["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if c.get("logprobs"):
                into["logprobs"].append(c["logprobs"])
            if c.get("finish_reason"):
                into["finish"] = (c["finish_reason"], c.get("stop_reason"))
    for into in choices.values():  # logprobs objects of a choice, joined
        lps = into.pop("logprobs")
        into["logprobs"] = {k: [x for lp in lps for x in lp[k]] for k in (lps[0] if lps else {})}
    return {"choices": choices, "usage": usage}


def bodies() -> list[tuple[str, dict]]:
    completion = [{"prompt": p, **f} for p, f in cases()[:9]]
    chat = {
        "messages": [{"role": "user", "content": "What is a list?"}],
        "max_tokens": 30,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    return [("/v1/completions", b) for b in completion] + [
        ("/v1/completions", {"prompt": ["x", "Modules"], "n": 2, "seed": 5, "max_tokens": 6, "echo": True}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "n": 2, "seed": 1, "temperature": 1.0, "top_logprobs": None}),
    ]


def approx_floats(value, tolerance: float = 1e-4):
    """``value`` with every float (the logprobs) compared within ``tolerance``."""
    if isinstance(value, float):
        return pytest.approx(value, abs=tolerance)
    if isinstance(value, dict):
        return {k: approx_floats(v, tolerance) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(approx_floats(v, tolerance) for v in value)
    return value


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_server_answers_equal_step9(servers, stream):
    """Every answer equals step 9's server's, logprobs within 1e-4 nats: the core runs torch on one thread
    (its default, as vLLM's workers) and may batch its first steps otherwise, so its logits differ in their
    last bits, as any other reduction order does on a CPU."""
    url, oracle_url, _ = servers
    for path, body in bodies():
        body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        if stream:
            with httpx.stream("POST", url + path, json=body, timeout=SAFETY_NET_S) as r:
                ours = merged_stream(events(r))
            with httpx.stream("POST", oracle_url + path, json=body, timeout=SAFETY_NET_S) as r:
                theirs = merged_stream(events(r))
        else:
            ours, theirs = (
                httpx.post(u + path, json=body, timeout=SAFETY_NET_S).json() for u in (url, oracle_url)
            )
            for answer in (ours, theirs):
                assert "error" not in answer, answer
                del answer["id"], answer["created"]
        assert ours == approx_floats(theirs), (path, body)


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(servers):
    """The core says each request's prefix-cache hits (by request, from the step that prefilled it), so
    ``usage.prompt_tokens_details.cached_tokens`` is step 9's: 0 for a prompt seen the first time, its full
    blocks but the last token's the second time; completions and chat, whole and streamed (the usage
    chunk), read with the openai SDK's types."""
    url = servers[0]
    kinds = {
        "/v1/completions": (Completion, Completion),
        "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    }
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
            if stream:
                with httpx.stream("POST", url + path, json=body, timeout=SAFETY_NET_S) as r:
                    answer = chunk.model_validate_json(events(r)[-2])
            else:
                answer = whole.model_validate_json(
                    httpx.post(url + path, json=body, timeout=SAFETY_NET_S).text
                )
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, (answer.usage.prompt_tokens - 1) // BLOCK * BLOCK], (path, stream)


def test_outputs_say_the_prompt_tokens_found_in_the_prefix_cache(llm):
    """``RequestOutput.num_cached_tokens`` (vLLM's name): 0, then the prompt's full blocks but the last
    token's, for one choice and for n, with the core in process and in a child."""
    text = (
        f"The standard library's modules, imported by {'a child' if llm.engine is None else 'this'} process"
    )
    params = SamplingParams(max_tokens=3, temperature=0)
    first, again = (llm.generate(text, params)[0] for _ in range(2))
    (choices,) = llm.generate(text, SamplingParams(n=2, max_tokens=3, seed=0))
    hits = (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert (first.num_cached_tokens, again.num_cached_tokens, choices.num_cached_tokens) == (0, hits, hits)


def continuous_usages(base_url: str, path: str, include_usage: bool) -> list:
    """The usage of every chunk of a stream of n = 2 choices x 6 tokens asked with vLLM's
    ``continuous_usage_stats`` (and OpenAI's ``include_usage`` or not), read with the openai SDK's types;
    checks what every chunk's usage must say: the prompt's tokens, the completion tokens streamed so
    far (never fewer than the chunk before), their sum; with include_usage, a last chunk without choices."""
    prompt = {"prompt": "The Python interpreter"}
    if path == "/v1/chat/completions":
        prompt = {"messages": [{"role": "user", "content": "What is a list?"}]}
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    body = {**prompt, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", base_url + path, json={**body, "stream_options": options}, timeout=SAFETY_NET_S
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(servers, path):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it) is honoured, with OpenAI's
    ``include_usage`` and without it (``continuous_usages``)."""
    for include_usage in (False, True):
        continuous_usages(servers[0], path, include_usage)


def test_an_empty_body_is_told_the_field_it_lacks(servers):
    """An empty body gets OpenAI's 400 naming the field it lacks (FastAPI says only "Field required")."""
    for path, field in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        r = httpx.post(servers[0] + path, content=b"", headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": f"The request body is empty: send a JSON object with `{field}`.",
            "type": "invalid_request_error",
            "param": field,
            "code": "missing_required_parameter",
        }


def wait_idle(url: str) -> dict:
    deadline = time.monotonic() + SAFETY_NET_S
    while True:
        s = httpx.get(f"{url}/v1/engine/stats").json()
        if (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def counter(url: str, name: str, **labels: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_disconnects_is_aborted_in_the_core(servers):
    """A client that leaves mid-stream frees its blocks in the core before its 400 tokens: nothing runs
    and no KV block is in use afterwards; a whole answer whose client gives up is aborted too."""
    url = servers[0]
    prompt = "A client that leaves"  # a prompt of its own: the others' prefix-cache hits stay step 9's
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    aborts = counter(url, "vllm:request_success_total", finished_reason="abort")
    tokens = counter(url, "vllm:generation_tokens_total")

    async def leave_after_three():
        async with httpx.AsyncClient(timeout=SAFETY_NET_S) as http:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        return

    asyncio.run(leave_after_three())
    s = wait_idle(url)
    assert (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0)
    assert counter(url, "vllm:request_success_total", finished_reason="abort") == aborts + 1
    assert counter(url, "vllm:generation_tokens_total") - tokens < 400
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    s = wait_idle(url)
    assert (s["running"], s["kv_blocks_used"]) == (0, 0)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_core_killed_or_stopped_ends_every_stream_and_health_says_503(demo_snapshot, sig):
    """kill -9, SIGTERM or SIGINT to the engine core with two streams open: each ends with an OpenAI-style
    error event naming the signal (the monitor's words, or the core's last word), then [DONE]; from the
    signal on, a new request gets 200 (the core had not stopped yet) or 503 in OpenAI's shape, never a 500
    (a send the stopping core can no longer take is its death too); then /health answers 503."""
    client = AsyncMPClient(EngineArgs(model=str(demo_snapshot)))
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with serve(build_app(client)) as url, httpx.Client(base_url=url, timeout=SAFETY_NET_S) as http:
        assert http.get("/health").status_code == 200
        with (
            http.stream("POST", "/v1/completions", json=body) as a,
            http.stream("POST", "/v1/completions", json=body) as b,
        ):
            lines_a = (line for line in a.iter_lines() if line.startswith("data: "))
            first = next(lines_a)
            os.kill(client.config.pid, sig)
            answers = []  # new requests while the core stops, until the server says it has
            while not answers or answers[-1].status_code != 503:
                answers.append(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))
                assert len(answers) < 10_000, "the server never noticed"
            streams = [[first, *lines_a], [line for line in b.iter_lines() if line.startswith("data: ")]]
        for lines in streams:
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][6:])["error"]
            assert error["type"] == "server_error" and error["code"] == "engine_dead"
            assert sig.name in error["message"]
        failed = [r.text for r in answers if r.status_code not in (200, 503)]
        assert failed == []
        assert answers[-1].json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={**body, "stream": False})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert sig.name in r.json()["error"]["message"]
    assert not os.path.exists(client.socket_dir)


# ---------------------------------------------------------------------------------------------------------
# The command line: the two processes and their exits
# ---------------------------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    """Whether a process has exited (a zombie nobody reaped counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY_NET_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Cli:
    """``python -m step10_engine_core`` as a process: its core's pid and socket directory, its URL."""

    def __init__(self, *args: str):
        root = Path(__file__).parent.parent
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __package__, "--port", "0", *args],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def start(self) -> Cli:
        # the start-up lines: serving ... on <url>, engine: <features>, engine core: pid ..., try: curl ...
        lines = "".join(self.proc.stdout.readline() for _ in range(4))
        match = re.search(r"engine core: pid (\d+), sockets in (\S+)", lines)
        if match is None:
            self.proc.kill()  # then its stderr ends, and the assertion shows it
            assert match, lines + self.proc.stderr.read()
        self.core_pid, self.socket_dir = int(match.group(1)), match.group(2)
        self.url = re.search(r"http://127\.0\.0\.1:\d+", lines).group(0)
        wait_until(self.answers, "the server never answered")
        return self

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=SAFETY_NET_S).status_code == 200
        except httpx.ConnectError:
            assert self.proc.poll() is None, self.proc.stderr.read()
            return False

    def stop(self) -> None:
        for pid in (self.proc.pid, getattr(self, "core_pid", None)):
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(SAFETY_NET_S)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_cli_exits_1_when_its_core_is_killed_or_stopped(demo_snapshot, sig):
    cli = Cli("--model", str(demo_snapshot)).start()
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=cli.url, timeout=SAFETY_NET_S) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                first = next(lines)
                os.kill(cli.core_pid, sig)
                lines = [first, *lines]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "engine_dead"
        _, err = cli.proc.communicate(timeout=SAFETY_NET_S)
    finally:
        cli.stop()
    assert cli.proc.returncode == 1, err
    assert sig.name in err and "Traceback" not in err
    assert not os.path.exists(cli.socket_dir)


@pytest.mark.slow
def test_a_killed_server_takes_its_core_along(demo_snapshot):
    """kill -9 of the server: the core sees its parent gone, removes the sockets and exits."""
    cli = Cli("--model", str(demo_snapshot)).start()
    try:
        os.kill(cli.proc.pid, signal.SIGKILL)
        cli.proc.wait(SAFETY_NET_S)
        wait_until(lambda: gone(cli.core_pid), "the engine core outlived its server")
        wait_until(lambda: not os.path.exists(cli.socket_dir), "the socket directory was left behind")
    finally:
        cli.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_both_processes_and_leaves_no_socket(demo_snapshot, sig):
    """SIGTERM or SIGINT with a stream open: step 6's graceful shutdown (the stream ends with an error event
    and [DONE], its request aborted in the core: 0 KV blocks in use), exit status 0, the core gone, no
    socket file left."""
    cli = Cli("--model", str(demo_snapshot), "--timeout-graceful-shutdown", "0").start()
    body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=cli.url, timeout=SAFETY_NET_S) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                first = next(lines)
                cli.proc.send_signal(sig)
                lines = [first, *lines]
        _, err = cli.proc.communicate(timeout=SAFETY_NET_S)
        wait_until(lambda: gone(cli.core_pid), "the engine core outlived its server")
    finally:
        cli.stop()
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "server_shutdown"
    assert cli.proc.returncode == 0, err
    assert "1 open request ended with an error, 0 KV blocks in use" in err, err
    assert not os.path.exists(cli.socket_dir) and "Traceback" not in err


def children_of(pid: int) -> list[int]:
    """Processes started with ``--parent-pid pid`` (engine cores of that frontend), alive or zombie."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if f"--parent-pid\0{pid}\0" in cmdline.read_text() and not gone(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [(["--num-kv-blocks", str(10**9)], "is free on cpu"), (["--model", "/nonexistent/model"], "nonexistent")],
    ids=["pool-too-large", "bad-model"],
)
def test_cli_an_engine_that_cannot_start_says_why_and_exits_2(demo_snapshot, args, says):
    cli = Cli("--model", str(demo_snapshot), *args)
    _, err = cli.proc.communicate(timeout=SAFETY_NET_S)
    assert cli.proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], err
    assert children_of(cli.proc.pid) == []

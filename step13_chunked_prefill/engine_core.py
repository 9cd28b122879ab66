"""The engine core: the engine's step loop in a process of its own, driven by messages (vLLM's
``EngineCoreProc``, SGLang's Scheduler process). ``EngineCore`` is the engine behind the message interface
(``InprocClient`` calls it directly); ``run_engine_core`` is the process's busy loop: between two steps it
takes whatever requests and aborts have arrived (blocking on the socket only when idle), steps, and sends
one ``EngineCoreOutputs``. It sends ``EngineCoreReady`` once loaded; ``EngineCoreDead`` and exit status 1
if the engine fails to start or a step raises; on SIGTERM or SIGINT, ``EngineCoreDead`` first, then status
0; a watchdog thread exits within a second, removing the socket directory, if its parent dies. ``main``:
``--input ADDR --output ADDR --parent-pid PID --socket-dir DIR --engine-args JSON``. Sources: vLLM's
``vllm/v1/engine/core.py``; SGLang's ``kill_itself_when_parent_died``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import torch
import zmq

from .config import EngineArgs
from .engine import LLMEngine
from .messages import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    input_decoder,
    output_encoder,
)

PARENT_CHECK_S = 0.2  # how often the watchdog looks for its parent
# a bad argument, a pool too large, a Hub model out of reach: said in one line, without a traceback
EXPECTED_STARTUP_ERRORS = (ValueError, TypeError, ConnectionError)


def engine_features(engine: LLMEngine) -> dict[str, str | bool | int]:
    """How ``engine`` runs, as it resolved its arguments: names (device, dtype, attention backend), the
    process's torch threads, True / False for each mechanism that can be on or off (speculative decoding:
    its method, or False), and the step's token budget (and threshold: "none", or tokens)."""
    args = engine.args
    return {
        "device": str(args.torch_device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "attention_backend": args.attention_backend,
        "kv_cache_dtype": args.kv_cache_dtype,
        "cuda_graphs": engine.model_runner.graph_runner is not None,  # captured at start-up
        "async_scheduling": args.async_scheduling,
        "prefix_caching": args.enable_prefix_caching,
        "chunked_prefill": args.enable_chunked_prefill,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold or "none",
        "speculative_decoding": engine.speculative.method if engine.speculative else False,
    }


class EngineCore:
    """An ``LLMEngine`` behind the message interface: ``add_request``, ``abort_request``, ``step``.

    engine_args: ``LLMEngine``'s ``EngineArgs``. Raises what ``LLMEngine``
    raises (ValueError on a bad argument or a pool too large for the device; ConnectionError if a Hub
    model cannot be fetched). A request the engine refuses (ValueError) is answered by an output with
    finish_reason "abort" and the error, in the next step's outputs.
    """

    def __init__(self, engine_args: EngineArgs):
        self.engine = LLMEngine(engine_args)
        self.num_received = 0  # requests taken since the start (the frontend counts those in transit)
        self.num_aborts_received = 0  # aborts taken since the start; those that the last step reported:
        self.num_aborts_reported = 0  # a frontend waits for its own to be applied (LLM.stats)
        self.refused: list[EngineCoreOutput] = []

    def ready(self) -> EngineCoreReady:
        """What the frontend needs of the resolved configuration."""
        args = self.engine.args
        return EngineCoreReady(
            pid=os.getpid(),
            folder=str(args.folder),
            hf_config=args.hf_config,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            features=engine_features(self.engine),
            stats=self.engine.stats,
        )

    def add_request(self, request: EngineCoreRequest, checked: bool = False) -> None:
        """Queue a request, checked again as the core's own word unless ``checked`` (in process: the
        frontend's own object, made by a ``Processor`` of this core's limits a moment ago)."""
        self.num_received += 1
        try:
            ids, params = request.prompt_token_ids, request.sampling_params
            self.engine.add_sequence(self.engine.make_sequence(request.request_id, ids, params, checked))
        except ValueError as e:  # the frontend checked it: this is the engine's own word
            self.refused.append(
                EngineCoreOutput(request.request_id, 0, [], finish_reason="abort", error=str(e))
            )

    def abort_request(self, abort: EngineCoreAbort) -> None:
        self.num_aborts_received += 1
        self.engine.abort_request(abort.request_id, abort.index)

    def has_work(self) -> bool:
        """Whether a step has something to do or to say: requests to run, a step in flight, the outputs of
        aborted or refused requests, aborts not yet reported (even of requests already finished here)."""
        return (
            self.engine.has_unfinished_requests()
            or bool(self.engine.aborted or self.refused)
            or self.num_aborts_reported < self.num_aborts_received
        )

    def step(self) -> EngineCoreOutputs:
        """One engine step (if there is anything to run) and its outputs, with the scheduler's stats and
        the prefix-cache hits of the requests it prefilled."""
        started = time.perf_counter()
        outputs, self.refused = self.refused, []
        outputs += self.engine.step()
        self.num_aborts_reported = self.num_aborts_received
        cached = {  # the requests this step prefilled (each choice of n says the same)
            (seq.parent or seq).request_id: seq.metrics.num_cached_tokens
            for seq in self.engine.scheduler.prefilled
            if seq.metrics.num_cached_tokens
        }
        return EngineCoreOutputs(
            outputs,
            self.engine.stats,
            started,
            self.num_received,
            self.num_aborts_received,
            cached,
        )


def limit_torch_threads() -> str | None:
    """One torch thread for the core process when OMP_NUM_THREADS is unset, as vLLM's workers do
    (``set_multiprocessing_worker_envs``): torch's default, a thread per core, makes its threads wait for
    each other whenever another process runs on those cores (the frontend, a client: a server on a 2-core
    CPU ran 8-13x slower). Returns the line that says so, or None (the variable is set, or one thread)."""
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or threads == 1:
        return None
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    return (
        f"engine core: torch threads {threads} -> 1, as OMP_NUM_THREADS is unset (vLLM's workers do the "
        "same: threads that share their cores with the frontend or a client wait for each other); set "
        "OMP_NUM_THREADS to choose"
    )


class ShutdownRequested(BaseException):
    """SIGTERM or SIGINT arrived: leave the loop (raised by the signal handler, wherever the loop is)."""


def run_engine_core(input_address: str, output_address: str, engine_args: dict) -> int:
    """The process's life: load the engine, say ready, then the busy loop; returns the exit status.

    0: stopped by SIGTERM or SIGINT. 1: the engine failed to start or a step raised. Either way its last
    word, ``EngineCoreDead`` (the signal, or the error), is sent before its sockets close: from then on the
    frontend's sends fail, and it must already know why."""

    def stop(signum, frame):
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads_line = limit_torch_threads()  # before the engine loads
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)  # never drop or block: the frontend's sends are the backpressure
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    encoder, decoder = output_encoder(), input_decoder()
    status, core = 0, None
    try:
        try:
            core = EngineCore(EngineArgs(**engine_args))
        except ShutdownRequested:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure to start is reported, then the exit status says it
            for sig in (signal.SIGTERM, signal.SIGINT):  # it exits with its last word: no signal cuts in
                signal.signal(sig, signal.SIG_IGN)
            if not isinstance(e, EXPECTED_STARTUP_ERRORS):
                traceback.print_exc()
            outputs.send(encoder.encode(EngineCoreDead(type(e).__name__, str(e), during_startup=True)))
            return 1
        if threads_line:  # said once loaded (a core that fails to start says only why)
            print(threads_line, file=sys.stderr, flush=True)
        outputs.send(encoder.encode(core.ready()))
        gc.collect()
        gc.freeze()  # the engine, its model and pool live on: no collection scans them again (vLLM #24008)
        poller = zmq.Poller()
        poller.register(inputs, zmq.POLLIN)
        while True:
            # idle: sleep on the socket until the frontend sends something; busy: take what has arrived
            timeout = 0 if core.has_work() else None
            if poller.poll(timeout):
                while True:
                    try:
                        message = decoder.decode(inputs.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    if isinstance(message, EngineCoreRequest):
                        core.add_request(message)
                    else:
                        core.abort_request(message)
            if core.has_work():
                outputs.send(encoder.encode(core.step()), copy=False)
    except ShutdownRequested as e:  # the last word first: requests sent from now on find no reader
        stopped = f"the engine core process (pid {os.getpid()}) was stopped by {e}"
        outputs.send(encoder.encode(EngineCoreDead(type(e).__name__, stopped, during_startup=core is None)))
        status = 0
    except Exception as e:  # noqa: BLE001 -- a step raised: tell the frontend, then exit non-zero
        traceback.print_exc()
        outputs.send(encoder.encode(EngineCoreDead(type(e).__name__, f"engine step failed: {e}")))
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the last word is out: a signal now would raise here
            signal.signal(sig, signal.SIG_IGN)
        gc.unfreeze()  # so that exit frees them (else triton's bindings report each as leaked)
        outputs.close(linger=2000)  # deliver the last word, but never hang on a dead frontend
        inputs.close(linger=0)
        context.term()
    return status


def watch_parent(parent_pid: int, socket_dir: str) -> None:
    """A daemon thread: if the parent dies (its pid is no longer ours' parent), remove the socket
    directory and exit at once, whatever the main thread is doing (loading, stepping, waiting)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        shutil.rmtree(socket_dir, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{__package__}.engine_core")
    parser.add_argument("--input", required=True, help="the ZMQ address the frontend sends to")
    parser.add_argument("--output", required=True, help="the ZMQ address the frontend reads from")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--socket-dir", required=True, help="removed if the parent dies")
    parser.add_argument("--engine-args", required=True, help="EngineArgs' arguments, as JSON")
    args = parser.parse_args(argv)
    watch_parent(args.parent_pid, args.socket_dir)
    return run_engine_core(args.input, args.output, json.loads(args.engine_args))


if __name__ == "__main__":
    sys.exit(main())

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

from . import worker
from .config import EngineArgs
from .engine import LLMEngine
from .messages import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreLoad,
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
        "tensor_parallel_size": args.tensor_parallel_size,
        "fused_kernels": args.fused_kernels,
    }


class EngineCore:
    """An ``LLMEngine`` behind the message interface: ``add_request``, ``abort_request``, ``step``.

    engine_args: ``LLMEngine``'s ``EngineArgs``. Raises what ``LLMEngine``
    raises (ValueError on a bad argument or a pool too large for the device; ConnectionError if a Hub
    model cannot be fetched). A request the engine refuses (ValueError) is answered by an output with
    finish_reason "abort" and the error, in the next step's outputs.
    """

    def __init__(self, engine_args: EngineArgs, engine_index: int = 0, num_clients: int = 1):
        self.engine = LLMEngine(engine_args)
        self.engine_index, self.num_clients = engine_index, num_clients
        self.num_received = 0  # requests taken since the start (the frontend counts those in transit)
        self.num_aborts_received = 0  # aborts taken since the start; those that the last step reported:
        self.num_aborts_reported = 0  # a frontend waits for its own to be applied (LLM.stats)
        self.refused: list[EngineCoreOutput] = []
        # several frontends: by client, requests and aborts taken (as last told it), and by request id
        # [its client, its unfinished choices]
        self.received_by, self.aborts_by = [0] * num_clients, [0] * num_clients
        self.told: list[tuple[int, int] | None] = [None] * num_clients
        self.client_of: dict[str, list[int]] = {}

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
            engine_index=self.engine_index,
        )

    def add_request(self, request: EngineCoreRequest, checked: bool = False) -> None:
        """Queue a request, checked again as the core's own word unless ``checked`` (in process: the
        frontend's own object, made by a ``Processor`` of this core's limits a moment ago)."""
        self.num_received += 1
        try:
            ids, params = request.prompt_token_ids, request.sampling_params
            if self.num_clients > 1:
                self.received_by[request.client_index] += 1
                self.client_of[request.request_id] = [request.client_index, params.n]
            self.engine.add_sequence(self.engine.make_sequence(request.request_id, ids, params, checked))
        except ValueError as e:  # the frontend checked it: this is the engine's own word
            if self.num_clients > 1:
                self.client_of[request.request_id][1] = 1  # one output says so
            self.refused.append(
                EngineCoreOutput(request.request_id, 0, [], finish_reason="abort", error=str(e))
            )

    def abort_request(self, abort: EngineCoreAbort) -> None:
        self.num_aborts_received += 1
        if self.num_clients > 1:
            self.aborts_by[abort.client_index] += 1
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
            self.engine_index,
        )

    def by_client(self, step: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        """A step's outputs split among several frontends: (client, its message) for each client with
        outputs in it, or whose counts of requests and aborts taken changed (one client: the step as it
        is). A client's message counts its own requests and aborts; the coordinator tells every client
        every core's stats."""
        if self.num_clients == 1:
            return [(0, step)]
        outputs: list[list[EngineCoreOutput]] = [[] for _ in range(self.num_clients)]
        cached: list[dict[str, int]] = [{} for _ in range(self.num_clients)]
        for request_id, n in step.num_cached_tokens.items():
            cached[self.client_of[request_id][0]][request_id] = n
        for out in step.outputs:
            entry = self.client_of[out.request_id]
            outputs[entry[0]].append(out)
            if out.finish_reason is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self.client_of[out.request_id]
        messages = []
        for client, mine in enumerate(outputs):
            counts = (self.received_by[client], self.aborts_by[client])
            if mine or counts != self.told[client]:
                self.told[client] = counts
                message = EngineCoreOutputs(
                    mine, step.stats, step.timestamp, *counts, cached[client], step.engine_index
                )
                messages.append((client, message))
        return messages


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


def run_engine_core(
    input_addresses: list[str],
    output_addresses: list[str],
    engine_args: dict,
    engine_index: int = 0,
    coordinator_address: str | None = None,
) -> int:
    """The process's life: load the engine, say ready, then the busy loop; returns the exit status.

    input_addresses, output_addresses: one of each per frontend (client), by client index. With a
    coordinator (several cores or frontends), the stats of every step go to it as well.
    0: stopped by SIGTERM or SIGINT. 1: the engine failed to start or a step raised. Either way its last
    word, ``EngineCoreDead`` (the signal, or the error), is sent to every frontend before its sockets close:
    from then on the frontends' sends fail, and they must already know why."""

    def stop(signum, frame):
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.END_PROCESS_ON_DEATH = True  # a dead tensor-parallel worker ends this process: the server sees it
    threads_line = limit_torch_threads()  # before the engine loads
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)  # fair-queued from every frontend
    inputs.setsockopt(zmq.RCVHWM, 0)  # never drop or block: the frontend's sends are the backpressure
    for address in input_addresses:
        inputs.connect(address)
    outputs = []
    for address in output_addresses:
        outputs.append(context.socket(zmq.PUSH))
        outputs[-1].setsockopt(zmq.SNDHWM, 0)
        outputs[-1].connect(address)
    loads = None
    if coordinator_address is not None:
        loads = context.socket(zmq.PUSH)
        loads.setsockopt(zmq.SNDHWM, 0)
        loads.connect(coordinator_address)
    encoder, decoder = output_encoder(), input_decoder()

    def tell_all(message) -> None:
        frame = encoder.encode(message)
        for out in outputs:
            out.send(frame)

    status, core = 0, None
    try:
        try:
            core = EngineCore(EngineArgs(**engine_args), engine_index, len(output_addresses))
        except ShutdownRequested:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure to start is reported, then the exit status says it
            for sig in (signal.SIGTERM, signal.SIGINT):  # it exits with its last word: no signal cuts in
                signal.signal(sig, signal.SIG_IGN)
            if not isinstance(e, EXPECTED_STARTUP_ERRORS):
                traceback.print_exc()
            tell_all(EngineCoreDead(type(e).__name__, str(e), during_startup=True))
            return 1
        if threads_line:  # said once loaded (a core that fails to start says only why)
            print(threads_line, file=sys.stderr, flush=True)
        tell_all(core.ready())
        if loads is not None:
            loads.send(encoder.encode(EngineCoreLoad(engine_index, core.engine.stats)))
        gc.collect()
        gc.freeze()  # the engine, its model and pool live on: no collection scans them again (vLLM #24008)
        poller = zmq.Poller()
        poller.register(inputs, zmq.POLLIN)
        while True:
            # idle: sleep on the socket until a frontend sends something; busy: take what has arrived
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
                step = core.step()
                for client, message in core.by_client(step):
                    outputs[client].send(encoder.encode(message), copy=False)
                if loads is not None:
                    loads.send(encoder.encode(EngineCoreLoad(engine_index, step.stats)), copy=False)
    except ShutdownRequested as e:  # the last word first: requests sent from now on find no reader
        stopped = f"the engine core process (pid {os.getpid()}) was stopped by {e}"
        tell_all(EngineCoreDead(type(e).__name__, stopped, during_startup=core is None))
        status = 0
    except Exception as e:  # noqa: BLE001 -- a step raised: tell the frontends, then exit non-zero
        traceback.print_exc()
        tell_all(EngineCoreDead(type(e).__name__, f"engine step failed: {e}"))
        status = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the last word is out: a signal now would raise here
            signal.signal(sig, signal.SIG_IGN)
        gc.unfreeze()  # so that exit frees them (else triton's bindings report each as leaked)
        for out in outputs:
            out.close(linger=2000)  # deliver the last word, but never hang on a dead frontend
        inputs.close(linger=0)
        if loads is not None:
            loads.close(linger=0)
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
    parser.add_argument(
        "--input", required=True, action="append", help="a ZMQ address a frontend sends to (one each)"
    )
    parser.add_argument(
        "--output", required=True, action="append", help="a ZMQ address a frontend reads from (one each)"
    )
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--socket-dir", required=True, help="removed if the parent dies")
    parser.add_argument("--engine-args", required=True, help="EngineArgs' arguments, as JSON")
    parser.add_argument("--engine-index", type=int, default=0, help="this core's index")
    parser.add_argument("--coordinator", default=None, help="the ZMQ address the stats of each step go to")
    args = parser.parse_args(argv)
    watch_parent(args.parent_pid, args.socket_dir)
    return run_engine_core(
        args.input, args.output, json.loads(args.engine_args), args.engine_index, args.coordinator
    )


if __name__ == "__main__":
    sys.exit(main())

"""The engine loop: one thread owns the engine; HTTP handlers talk to it through an inbox and asyncio queues.

``step()`` is not thread-safe and many HTTP connections call at once, so one thread, the *engine loop*
(``AsyncEngine``), owns the engine: it steps while any request is unfinished, sleeps on a ``threading.Event``
otherwise, and adds requests and aborts from a locked *inbox* between two steps, so that they join one
continuous batch. After every step it hands each request's ``DELTA`` outputs to the event loop with one
``loop.call_soon_threadsafe``, into the request's ``RequestStream`` (an ``asyncio.Queue``); closing the
stream aborts the request, whose KV blocks are freed before the next step.

Sources: vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``); Yu et al. 2022, "Orca" (OSDI).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from .engine import LLMEngine
from .metrics import ServerMetrics
from .sampling_params import SamplingParams
from .sequence import RequestOutput

DEFAULT_MAX_WAITING_REQUESTS = 256


def engine_features(engine: LLMEngine) -> dict[str, str | bool]:
    """How ``engine`` runs, as it resolved its arguments: names (device, dtype, attention backend), and
    True / False for each mechanism that can be on or off. The start-up line (``describe_features``),
    ``/v1/engine/stats`` and the web page show it."""
    args = engine.args
    return {
        "device": str(args.torch_device),
        "dtype": args.dtype,
        "attention_backend": args.attention_backend,
        "cuda_graphs": engine.model_runner.graph_runner is not None,  # captured at start-up
        "async_scheduling": args.async_scheduling,
    }


def describe_features(features: dict[str, str | bool]) -> str:
    """``features`` as words on one line, e.g. "device cpu, dtype float32, attention backend torch"."""
    return ", ".join(
        f"{name.replace('_', ' ')} {('on' if value else 'off') if isinstance(value, bool) else value}"
        for name, value in features.items()
    )


class EngineDeadError(RuntimeError):
    """The engine loop thread has stopped (an exception in ``step()``, or shutdown): no request is served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting_requests`` allows."""


class ServerShuttingDown(RuntimeError):
    """The server is shutting down (a signal) and ended this request before it finished."""


@dataclass
class EngineRequest:
    """One engine request of an HTTP request (an HTTP request with n choices or several prompts has several).

    index: the choice index it fills. Times are ``time.perf_counter`` seconds, set by the engine loop.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    submitted: float = 0.0
    first_output: float | None = None
    last_output: float | None = None
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None


@dataclass
class _Failure:
    """Put into a request's queue instead of an output when it cannot go on (engine dead, add refused)."""

    error: BaseException


@dataclass
class LoopStats:
    """What the engine loop published after its last step (read by handlers without a lock: one reference)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    steps: int = 0
    max_running: int = 0  # the largest running batch since start: concurrent requests did share steps


class AsyncEngine:
    """Runs an ``LLMEngine`` in one background thread and serves it to asyncio handlers.

    ``submit(requests)`` (in the event loop) puts engine requests into the inbox and returns a
    ``RequestStream`` that yields ``(index, RequestOutput)`` as the engine produces them (DELTA outputs);
    closing it, or cancelling its iteration, aborts the requests that have not finished. ``abort(ids)``
    can be called from any thread. The engine is only ever touched by the loop thread.

    max_waiting_requests: ``submit`` raises ``QueueFullError`` when the requests waiting (in the inbox and
    in the engine's waiting queue) plus the new ones would exceed it. If ``step()`` raises, the thread
    records the exception (``error``), fails every open request with ``EngineDeadError`` and stops;
    ``alive`` turns False and ``submit`` raises ``EngineDeadError``. On shutdown, ``end_streams`` fails
    the open streams first, and the loop aborts whatever the engine still holds before it stops.
    """

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics | None = None,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.error: BaseException | None = None
        self.stats = LoopStats()
        self.features = engine_features(engine)  # fixed once the engine is made
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, Any]] = []  # ("add", EngineRequest) | ("abort", request_id), in order
        self._pending_adds = 0  # adds in the inbox: waiting, not yet in the engine
        self._stopping = False
        self._routes: dict[str, EngineRequest] = {}  # loop thread only: request id -> its way back
        self._streams: set[RequestStream] = set()  # event loop only: streams with unfinished requests
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._publish(stepped=False)  # the pool and the counts from the start, before any request

    # ---- called from the event loop (or any thread) ----

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stopping:
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread after its current step; open requests fail with EngineDeadError."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def num_waiting(self) -> int:
        """Requests not yet running: in the inbox, plus the engine's waiting queue after the last step."""
        return self._pending_adds + self.stats.num_waiting_reqs

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ones are ignored); the loop frees their blocks before its
        next step."""
        with self._lock:
            self._inbox.extend(("abort", rid) for rid in request_ids)
        self._wake.set()

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Hand ``requests`` to the engine loop (in the event loop's thread); returns their stream.

        Raises EngineDeadError (the loop is not running) or QueueFullError (nothing was submitted).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        for r in requests:
            r.loop, r.queue, r.submitted = loop, queue, now
        with self._lock:
            if not self.alive:
                raise EngineDeadError(repr(self.error) if self.error else "not running")
            waiting = self.num_waiting()
            if waiting + len(requests) > self.max_waiting_requests:
                raise QueueFullError(
                    f"{waiting} {'request is' if waiting == 1 else 'requests are'} waiting (at most "
                    f"{self.max_waiting_requests}); this one adds {len(requests)}"
                )
            self._inbox.extend(("add", r) for r in requests)
            self._pending_adds += len(requests)
        self._wake.set()
        stream = RequestStream(self, queue, [r.request_id for r in requests])
        self._streams.add(stream)
        return stream

    def end_streams(self, error: BaseException) -> int:
        """Fail every open stream with ``error`` (in the event loop's thread): its reader raises it, and
        closing the stream aborts its requests. Returns how many streams were open."""
        streams, self._streams = self._streams, set()
        for stream in streams:
            stream.queue.put_nowait(_Failure(error))
        return len(streams)

    # ---- the loop thread ----

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a command added after the drain sets it again
                with self._lock:
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                if stopping:  # the aborts sent before the stop still free their blocks
                    self._apply([(kind, arg) for kind, arg in commands if kind == "abort"])
                    raise EngineDeadError("the server is shutting down")
                if commands:
                    self._apply(commands)
                    added = sum(1 for kind, _ in commands if kind == "add")
                    self._publish(stepped=False, added=added)  # the waiting count moves to the engine's
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()  # idle: sleep until a handler adds something
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                self._route(outputs, started, time.perf_counter())
                self._publish(stepped=True)
        except BaseException as e:  # noqa: BLE001 -- the loop must report any death, then stop
            if not isinstance(e, EngineDeadError):
                self.error = e
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine step failed: {e!r}")
            with self._lock:
                self._stopping = True
                pending = [r for kind, r in self._inbox if kind == "add"]
                self._inbox, self._pending_adds = [], 0
            self._deliver([(r, _Failure(dead)) for r in [*self._routes.values(), *pending]])
            for request_id in self._routes:  # nobody will read them: free their blocks
                with contextlib.suppress(Exception):  # the engine may be what failed
                    self.engine.abort_request(request_id)
            self._routes.clear()

    def _apply(self, commands: list[tuple[str, Any]]) -> None:
        """Add and abort requests, in the order the handlers sent them (the loop thread, between steps)."""
        refused = []
        for kind, arg in commands:
            if kind == "add":
                try:
                    self.engine.add_request(arg.request_id, arg.prompt_token_ids, arg.params)
                except ValueError as e:  # validated at the entrance already; this is the engine's own word
                    refused.append((arg, _Failure(e)))
                    continue
                self._routes[arg.request_id] = arg
            else:
                self.engine.abort_request(arg)
                if self._routes.pop(arg, None) is not None and self.metrics:
                    self.metrics.success("abort")
        self._deliver(refused)

    def _route(self, outputs: list[RequestOutput], step_started: float, now: float) -> None:
        """Send each output to its request's queue (one wake-up of the event loop per step), and measure."""
        m = self.metrics
        deliveries = []
        for out in outputs:
            r = self._routes.get(out.request_id)
            if r is None:
                continue
            completion = out.outputs[0]
            if m:
                if r.first_output is None:
                    m.ttft.observe(now - r.submitted)
                    m.queue_time.observe(max(0.0, step_started - r.submitted))
                    m.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    m.itl.observe(now - r.last_output)
                m.generation_tokens.inc(len(completion.token_ids))
                if out.finished:
                    m.e2e.observe(now - r.submitted)
                    m.success(completion.finish_reason or "stop")
            if r.first_output is None:
                r.first_output = now
            r.last_output = now
            if out.finished:
                del self._routes[out.request_id]
            deliveries.append((r, (r.index, out)))
        self._deliver(deliveries)

    @staticmethod
    def _deliver(items: list[tuple[EngineRequest, Any]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for r, item in items:
            by_loop.setdefault(r.loop, []).append((r.queue, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)

    def _publish(self, stepped: bool, added: int = 0) -> None:
        """Publish the engine's figures; ``added`` requests leave the inbox's count as they enter the
        engine's, in one move under the lock (``submit`` never sees a request in neither)."""
        s = self.engine.stats
        prev = self.stats
        stats = LoopStats(
            s.num_running_reqs,
            s.num_waiting_reqs,
            s.kv_cache_usage,
            s.num_used_blocks,
            s.num_blocks,
            s.num_preemptions,
            prev.steps + stepped,
            max(prev.max_running, s.num_running_reqs),
        )
        with self._lock:
            self._pending_adds -= added
            self.stats = stats
        if self.metrics:
            self.metrics.running.set(s.num_running_reqs)
            self.metrics.waiting.set(s.num_waiting_reqs + self._pending_adds)
            self.metrics.kv_usage.set(s.kv_cache_usage)
            if s.num_preemptions > prev.num_preemptions:
                self.metrics.preemptions.inc(s.num_preemptions - prev.num_preemptions)


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class RequestStream:
    """The outputs of one HTTP request's engine requests: ``async for index, output in stream``.

    Iteration ends when every request has finished; it raises EngineDeadError if the loop died, or the
    engine's ValueError if it refused a request. ``aclose()`` (or a cancelled iteration: the client went
    away) aborts the requests that have not finished, so their KV blocks are freed before the next step.
    """

    def __init__(self, bridge: AsyncEngine, queue: asyncio.Queue, request_ids: list[str]):
        self.bridge, self.queue, self.unfinished = bridge, queue, set(request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled: the client disconnected
            self.close()
            raise
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        index, out = item
        if out.finished:
            self.unfinished.discard(out.request_id)
            if not self.unfinished:
                self.bridge._streams.discard(self)
        return index, out

    def close(self) -> None:
        self.bridge._streams.discard(self)
        if self.unfinished:
            self.bridge.abort(sorted(self.unfinished))
            self.unfinished.clear()

    async def aclose(self) -> None:
        self.close()

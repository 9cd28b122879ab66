"""The engine, for the server: the engine core in its own process, one output task, a collector per request.

Steps 6-9 stepped the engine in a thread of the server, so the server's work on every token shared one
interpreter lock with the steps. Here the core runs in a process of its own (engine_core.py), reached
through an ``AsyncMPClient``; ``submit`` adds requests to the ``OutputProcessor`` and sends them; one task,
the *output handler*, reads each step's ``EngineCoreOutputs`` (behind the core: those waiting, together),
makes the text (output_processor.py), puts the outputs into their ``RequestOutputCollector``s and aborts
in the core what a stop string ended. A stream closed aborts its requests; the core dying fails every open
stream with ``EngineDeadError``, turns ``alive`` False (503) and calls ``on_dead`` (the command line exits
1). Source: vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``); Yu et al. 2022, "Orca" (OSDI).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from common.tokenizer import Tokenizer

from .core_client import AsyncMPClient, EngineDeadError
from .messages import EngineCoreRequest, SchedulerStats, merge_stats
from .metrics import ServerMetrics
from .output_processor import OutputProcessor, RequestOutputCollector
from .outputs import RequestOutput
from .processor import Processor
from .sampling_params import SamplingParams

DEFAULT_MAX_WAITING_REQUESTS = 256
DRAIN_TIMEOUT_S = 2.0  # at shutdown, how long the core may take to apply the last aborts
MAX_STEPS_PER_WAKEUP = 8  # steps read at once when the output handler is behind the core

__all__ = ["AsyncEngine", "EngineDeadError", "EngineRequest", "QueueFullError", "RequestStream"]


def describe_features(features: dict[str, str | bool | int]) -> str:
    """``features`` as words on one line, e.g. "device cpu, dtype float32, attention backend torch"."""
    return ", ".join(
        f"{name.replace('_', ' ')} {('on' if value else 'off') if isinstance(value, bool) else value}"
        for name, value in features.items()
    )


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting_requests`` allows."""


class ServerShuttingDown(RuntimeError):
    """The server is shutting down (a signal) and ended this request before it finished."""


@dataclass
class EngineRequest:
    """One engine request of an HTTP request (an HTTP request with several prompts has several; each holds
    the prompt's n choices).

    index: the index of the first choice it fills (choice c of its outputs fills index + c). Times are
    ``time.perf_counter`` seconds, set by the output handler; last_output: by choice, its latest output;
    num_finished: its choices that have finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    submitted: float = 0.0
    last_output: dict[int, float] = field(default_factory=dict)
    num_finished: int = 0
    collector: RequestOutputCollector | None = None
    engine: int = 0


class AsyncEngine:
    """Serves the engine core behind ``client`` to asyncio handlers (event loop only, after ``start``).

    ``submit(requests)`` returns a ``RequestStream``; closing it, or cancelling its iteration, aborts the
    requests that have not finished. ``abort(ids)`` aborts requests. max_waiting_requests: ``submit``
    raises ``QueueFullError`` when the requests waiting (on their way to the core, and in its waiting
    queue) plus the new ones would exceed it. stream_interval: DELTA outputs every N tokens (vLLM's
    name; the first token at once). If the core dies, ``error`` holds why, every open request fails
    with ``EngineDeadError``, ``alive`` turns False, ``submit`` raises ``EngineDeadError``, and ``on_dead``
    (if set) is called. On shutdown, ``end_streams`` fails the open streams first.
    """

    def __init__(
        self,
        client: AsyncMPClient,
        metrics: ServerMetrics | None = None,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
        stream_interval: int = 1,
    ):
        self.client = client
        self.config = client.config
        self.tokenizer = Tokenizer(client.config.folder)
        self.processor = Processor.for_core(self.tokenizer, client.config)  # the entrance checks
        self.output_processor = OutputProcessor(self.tokenizer, stream_interval)
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.error: BaseException | None = None
        self.stats_of: list[SchedulerStats] = list(client.stats_of)  # by core: its last word on them
        self.stats: SchedulerStats = merge_stats(self.stats_of)  # every core's together
        self.steps = 0  # messages of the core's steps, since the start
        self.max_running = 0  # the largest running batch since start: concurrent requests did share steps
        self.features = client.config.features  # how the core runs, from its ready message
        self.on_dead: Callable[[], None] | None = None
        self._stopping = False
        self._routes: dict[str, EngineRequest] = {}  # request id -> its way back, while unfinished
        self._streams: set[RequestStream] = set()  # streams with unfinished requests
        self._task: asyncio.Task | None = None
        self._stepped = asyncio.Event()  # set after every message of the core
        for engine, s in enumerate(self.stats_of):  # the pools and the counts, before any request
            self._publish(engine, s, stepped=False)
            if metrics is not None:
                metrics.cache_config(engine, client.configs[engine].block_size, s.num_blocks)

    def start(self) -> None:
        """Start the output handler (in the running event loop)."""
        if self._task is None and not self._stopping:
            self._task = asyncio.get_running_loop().create_task(self._output_handler())

    async def shutdown(self) -> None:
        """Let the core apply the aborts sent (at most ``DRAIN_TIMEOUT_S``), stop the output handler, fail
        what is still open with EngineDeadError, and stop the core process."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), DRAIN_TIMEOUT_S)
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.to_thread(self.client.shutdown)

    async def _drained(self) -> None:
        while self.alive and (
            self.output_processor.requests
            or sum(self.client.taken) < sum(self.client.sent)
            or self.stats.num_running_reqs
            or self.stats.num_waiting_reqs
        ):
            self._stepped.clear()
            await self._stepped.wait()

    @property
    def alive(self) -> bool:
        running = self._task is not None and not self._task.done()
        return running and self.client.alive and self.error is None and not self._stopping

    def num_waiting(self) -> int:
        """Requests not yet running: on their way to the cores, plus their waiting queues after their last
        steps."""
        return sum(self.client.sent) - sum(self.client.taken) + self.stats.num_waiting_reqs

    def refresh(self) -> None:
        """Take the coordinator's word on every core (several frontends): the figures of cores whose steps
        carried none of this frontend's outputs lately."""
        self.client.read_loads()
        for engine, s in enumerate(self.client.stats_of):
            if s.num_steps >= self.stats_of[engine].num_steps:  # an abort moves them without a step
                self._publish(engine, s, stepped=False)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ones are ignored); the core frees their blocks before its
        next step."""
        for request_id in request_ids:
            if self.output_processor.abort_request(request_id):
                r = self._routes.pop(request_id, None)
                if self.client.alive:
                    self.client.abort_request(request_id)
                if r is not None and self.metrics:
                    for _ in range(r.params.n - r.num_finished):  # its unfinished choices
                        self.metrics.success(r.engine, "abort")

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Send ``requests`` to the engine core (in the event loop's thread); returns their stream.

        Raises EngineDeadError (the core is not running) or QueueFullError (nothing was submitted).
        """
        if not self.alive:
            raise self.error if isinstance(self.error, EngineDeadError) else EngineDeadError("not running")
        waiting = self.num_waiting()
        if waiting + len(requests) > self.max_waiting_requests:
            raise QueueFullError(
                f"{waiting} {'request is' if waiting == 1 else 'requests are'} waiting (at most "
                f"{self.max_waiting_requests}); this one adds {len(requests)}"
            )
        collector, now = RequestOutputCollector(), time.perf_counter()
        for r in requests:
            r.collector, r.submitted = collector, now
            self.output_processor.add_request(r.request_id, None, r.prompt_token_ids, r.params)
            self._routes[r.request_id] = r
            try:
                r.engine = self.client.add_request(
                    EngineCoreRequest(r.request_id, r.prompt_token_ids, r.params)
                )
            except EngineDeadError:  # its socket closed: the core is stopping (its last word on its way)
                for sent in requests:
                    self._routes.pop(sent.request_id, None)
                    self.output_processor.abort_request(sent.request_id)
                raise
        stream = RequestStream(self, collector, {r.request_id: r.index for r in requests})
        self._streams.add(stream)
        return stream

    def end_streams(self, error: BaseException) -> int:
        """Fail every open stream with ``error``: its reader raises it (after the outputs already waiting),
        and closing the stream aborts its requests. Returns how many streams were open."""
        streams, self._streams = self._streams, set()
        for stream in streams:
            stream.collector.fail(error)
        return len(streams)

    # ---- the output handler ----

    async def _output_handler(self) -> None:
        try:
            while True:
                steps = [await self.client.get_output_async()]
                while len(steps) < MAX_STEPS_PER_WAKEUP and (more := self.client.get_output_nowait()):
                    steps.append(more)  # behind the core: the steps waiting, one output per choice for all
                for core_outputs in steps:
                    self.output_processor.set_num_cached_tokens(core_outputs.num_cached_tokens)
                done = self.output_processor.process_outputs([o for s in steps for o in s.outputs])
                for request_id, index in done.to_abort:  # a stop string: the core would go on
                    self.client.abort_request(request_id, index)
                for state, error in done.failed:  # the core refused it (its own word)
                    if (r := self._routes.pop(state.request_id, None)) is not None:
                        r.collector.fail(ValueError(error))
                self._route(done.request_outputs, steps[0].timestamp, time.perf_counter())
                for core_outputs in steps:
                    self._publish(core_outputs.engine_index, core_outputs.stats)
                self._stepped.set()
                await asyncio.sleep(0)  # the handlers take these outputs before the next steps are read
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- the core died (EngineDeadError), or this task failed
            self.error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"output handler: {e!r}")
            self._fail_all(self.error)
            self._stepped.set()
            if self.on_dead is not None and not self._stopping:
                self.on_dead()

    def _fail_all(self, error: EngineDeadError) -> None:
        for r in self._routes.values():
            r.collector.fail(error)
        self._routes.clear()
        self.output_processor.requests.clear()

    def _route(self, outputs: list[RequestOutput], step_started: float, now: float) -> None:
        """Put each output into its request's collector, and measure. step_started: when the core began
        the (first) step they come from (its clock is this machine's monotonic clock, as this process's
        ``perf_counter``)."""
        m, tokens = self.metrics, [0] * len(self.stats_of)
        for out in outputs:
            r = self._routes.get(out.request_id)
            if r is None:
                continue
            completion = out.outputs[0]
            tokens[r.engine] += len(completion.token_ids)
            if m:  # each choice as a request (as step 8's n requests, vLLM's child requests): DELTA has one
                e = r.engine
                if completion.index not in r.last_output:  # the choice's first output
                    m.ttft.labels(e).observe(now - r.submitted)
                    m.queue_time.labels(e).observe(max(0.0, step_started - r.submitted))
                    m.prompt_tokens.labels(e).inc(len(out.prompt_token_ids))
                else:
                    m.itl.labels(e).observe(now - r.last_output[completion.index])
                if completion.finished:
                    m.e2e.labels(e).observe(now - r.submitted)
                    m.success(e, completion.finish_reason or "stop")
            r.last_output[completion.index] = now
            r.num_finished += completion.finished
            if out.finished:
                del self._routes[out.request_id]
            r.collector.put(out)
        for engine, n in enumerate(tokens):
            if m and n:
                m.generation_tokens.labels(engine).inc(n)  # once per call

    def _publish(self, engine: int, s: SchedulerStats, stepped: bool = True) -> None:
        """Take the scheduler's stats of core ``engine`` after a step (``stepped``) or from the start or
        the coordinator, and move the metrics (the gauges by core; with several frontends the counters of
        the cores' own figures in frontend 0 only, as they are summed over the frontends)."""
        prev, self.stats_of[engine] = self.stats_of[engine], s
        self.stats = merge_stats(self.stats_of)
        self.steps += stepped
        self.max_running = max(self.max_running, self.stats.num_running_reqs)
        m = self.metrics
        if m is None:
            return
        m.running.labels(engine).set(s.num_running_reqs)
        m.waiting.labels(engine).set(
            self.client.sent[engine] - self.client.taken[engine] + s.num_waiting_reqs
        )
        m.kv_usage.labels(engine).set(s.kv_cache_usage)
        if self.client.client_index != 0:
            return
        if stepped and s.num_batched_tokens:
            m.iteration_tokens.labels(engine).observe(s.num_batched_tokens)
        if s.num_preemptions > prev.num_preemptions:
            m.preemptions.labels(engine).inc(s.num_preemptions - prev.num_preemptions)
        m.prefix_cache_queries.labels(engine).inc(s.prefix_cache_queries - prev.prefix_cache_queries)
        m.prefix_cache_hits.labels(engine).inc(s.prefix_cache_hits - prev.prefix_cache_hits)
        m.spec_drafts.labels(engine).inc(s.spec_decode_num_drafts - prev.spec_decode_num_drafts)
        m.spec_draft_tokens.labels(engine).inc(
            s.spec_decode_num_draft_tokens - prev.spec_decode_num_draft_tokens
        )
        m.spec_accepted_tokens.labels(engine).inc(
            s.spec_decode_num_accepted_tokens - prev.spec_decode_num_accepted_tokens
        )
        before = prev.spec_decode_num_accepted_tokens_per_pos
        for i, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            if n > (seen := before[i] if i < len(before) else 0):
                m.spec_accepted_at(engine, i, n - seen)


class RequestStream:
    """The outputs of one HTTP request's engine requests: ``async for index, output in stream``.

    Iteration ends when every request has finished; it raises EngineDeadError if the core died, or the
    core's ValueError if it refused a request. ``aclose()`` (or a cancelled iteration: the client went
    away) aborts the requests that have not finished, so their KV blocks are freed before the next step.
    """

    def __init__(self, engine: AsyncEngine, collector: RequestOutputCollector, indices: dict[str, int]):
        self.engine, self.collector, self.indices = engine, collector, indices
        self.unfinished = set(indices)
        self.ready: deque[RequestOutput] = deque()  # taken from the collector, not yet yielded

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.ready:
            if not self.unfinished:
                raise StopAsyncIteration
            try:
                self.ready.extend(await self.collector.get())
            except BaseException:  # cancelled (the client disconnected), or failed
                self.close()
                raise
        out = self.ready.popleft()
        if out.finished:
            self.unfinished.discard(out.request_id)
            if not self.unfinished:
                self.engine._streams.discard(self)
        return self.indices[out.request_id], out

    def close(self) -> None:
        self.engine._streams.discard(self)
        if self.unfinished:
            self.engine.abort(sorted(self.unfinished))
            self.unfinished.clear()

    async def aclose(self) -> None:
        self.close()

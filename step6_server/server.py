"""Step 6: an OpenAI-compatible streaming HTTP server over the engine, and a web page.

Step 5's ``LLMEngine`` serves one caller that owns it: ``add_request``, then ``step()`` in a loop. A server
has many callers at once, each on its own HTTP connection, and ``step()`` is not thread-safe. So:

- one thread, the *engine loop* (``AsyncEngine``), owns the engine. It steps while any request is
  unfinished and sleeps on a ``threading.Event`` when there is none (no busy loop). Requests reach it
  through a locked *inbox*; the loop adds them (and aborts) itself, between two steps, so concurrent HTTP
  requests join the same continuous batch.
- each HTTP request gets an ``asyncio.Queue``; after every step the loop thread hands each request's new
  ``RequestOutput`` (``RequestOutputKind.DELTA``: only the new text and ids) to the event loop with one
  ``loop.call_soon_threadsafe`` per step, and the handler turns it into JSON or a Server-Sent Event.
- a client that goes away has its request aborted at once: Starlette cancels a streaming response whose
  client disconnected, and a non-streaming handler races a disconnect listener (as vLLM's
  ``with_cancellation``); either way the handler's ``finally`` puts an abort into the inbox and the loop
  frees the request's KV blocks before its next step.

The wire format is OpenAI's (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``; field by
field as the ``openai`` SDK's types: ``Completion``, ``CompletionChoice``, ``CompletionUsage``,
``ChatCompletion``, ``ChatCompletionChunk``, ``Model``), with vLLM's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``), vLLM's ``/health`` (200 while the
engine loop lives, 503 once it died) and ``/metrics`` (Prometheus, vLLM's metric names, label
``model_name``). Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with 400
(bad input: the request never reaches the engine), 401 (``--api-key``), 404 (unknown model or path),
413 (body over the size cap), 429 (waiting queue full, with ``Retry-After``) and 503 (engine loop dead);
after a stream has started, an error is one SSE event ``data: {"error": ...}`` followed by ``data: [DONE]``.

FastAPI validates request bodies with the pydantic models below (types and ranges as ``Field``
constraints); the only checks written by hand are those that need the model: token counts against the
context window, token ids against the vocabulary. ``SamplingParams``' own ``ValueError`` is a 400 too.

Sources: OpenAI's API reference and openai-python (``src/openai/types``); vLLM's OpenAI server
(``vllm/entrypoints/openai``: protocol, serving_completion, serving_chat; ``vllm/v1/metrics/loggers.py``);
the SSE format of the WHATWG HTML standard ("Server-sent events").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import inspect
import json
import math
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import LLMEngine
from .sampling_params import RequestOutputKind, SamplingParams
from .sequence import RequestOutput

STATIC = Path(__file__).parent / "static"
LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps logprobs to this
MAX_LOGPROBS = 5  # the engine returns at most the 5 most likely tokens per position
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a 1024-token prompt is a few KiB of JSON
OWNED_BY = "step6_server"


# --------------------------------------------------------------------------------------------------------
# Errors: OpenAI's body, one exception type for every status
# --------------------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered as OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.

    status: the HTTP status (400, 401, 404, 413, 429, 500, 503). type: OpenAI's error type
    (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ``server_error``).
    param: the request field at fault, or None. code: a short machine-readable reason, or None.
    headers: extra response headers (``Retry-After`` on 429, ``WWW-Authenticate`` on 401).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class EngineDeadError(RuntimeError):
    """The engine loop thread has stopped (an exception in ``step()``, or shutdown): no request is served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_waiting_requests`` allows."""


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready; its requests were aborted."""


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_dead(error: BaseException | None) -> APIError:
    return APIError(
        503,
        f"the engine loop has stopped: {error!r}" if error else "the engine loop has stopped",
        "server_error",
        None,
        "engine_dead",
    )


# --------------------------------------------------------------------------------------------------------
# Metrics: vLLM's names, one registry per app
# --------------------------------------------------------------------------------------------------------


class ServerMetrics:
    """Prometheus metrics under vLLM's names (``vllm/v1/metrics/loggers.py``), label ``model_name``.

    Gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
    (0..1). Counters (exposed with the suffix ``_total``): ``vllm:num_preemptions``, ``vllm:prompt_tokens``,
    ``vllm:generation_tokens``, ``vllm:request_success`` (+ label ``finished_reason``: stop, length, abort).
    Histograms, seconds, measured by the server's clock (``time.perf_counter``) from the moment the handler
    submitted the request: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
    (between two outputs of a request), ``vllm:e2e_request_latency_seconds``,
    ``vllm:request_queue_time_seconds`` (submitted -> the start of the step that ran its prefill).
    Each app has its own ``CollectorRegistry``, so that several apps can live in one process (tests).
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled (engine + inbox)."
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (requests evicted and recomputed).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._model_name = model_name
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (s).",
            [
                0.001,
                0.005,
                0.01,
                0.02,
                0.04,
                0.06,
                0.08,
                0.1,
                0.25,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
                7.5,
                10.0,
                20.0,
                40.0,
                80.0,
            ],
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of a request (s).",
            [
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.075,
                0.1,
                0.15,
                0.2,
                0.3,
                0.4,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
            ],
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, submitted to finished (s).",
            [
                0.1,
                0.3,
                0.5,
                0.8,
                1.0,
                1.5,
                2.0,
                2.5,
                5.0,
                10.0,
                15.0,
                20.0,
                30.0,
                40.0,
                50.0,
                60.0,
                120.0,
                240.0,
            ],
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before the prefill (s).",
            [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0],
        )

    def success(self, finished_reason: str) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=finished_reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------------------------------------
# The engine loop: one thread owns the engine; handlers talk to it through an inbox and asyncio queues
# --------------------------------------------------------------------------------------------------------


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
    ``alive`` turns False and ``submit`` raises ``EngineDeadError``.
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
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, Any]] = []  # ("add", EngineRequest) | ("abort", request_id), in order
        self._pending_adds = 0  # adds in the inbox: waiting, not yet in the engine
        self._stopping = False
        self._routes: dict[str, EngineRequest] = {}  # loop thread only: request id -> its way back
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

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
        """Abort requests (unknown or finished ones are ignored); the loop frees their blocks before its next step."""
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
            if self.num_waiting() + len(requests) > self.max_waiting_requests:
                raise QueueFullError(
                    f"{self.num_waiting()} requests are waiting (at most "
                    f"{self.max_waiting_requests}); this one adds {len(requests)}"
                )
            self._inbox.extend(("add", r) for r in requests)
            self._pending_adds += len(requests)
        self._wake.set()
        return RequestStream(self, queue, [r.request_id for r in requests])

    # ---- the loop thread ----

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()  # before draining: a command added after the drain sets it again
                with self._lock:
                    commands, self._inbox = self._inbox, []
                    self._pending_adds -= sum(1 for kind, _ in commands if kind == "add")
                    stopping = self._stopping
                if stopping:
                    raise EngineDeadError("the server is shutting down")
                if commands:
                    self._apply(commands)
                    self._publish(stepped=False)  # the waiting count moved from the inbox to the engine
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

    def _publish(self, stepped: bool) -> None:
        s = self.engine.stats
        prev = self.stats
        self.stats = LoopStats(
            s.num_running_reqs,
            s.num_waiting_reqs,
            s.kv_cache_usage,
            s.num_used_blocks,
            s.num_blocks,
            s.num_preemptions,
            prev.steps + stepped,
            max(prev.max_running, s.num_running_reqs),
        )
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
        return index, out

    def close(self) -> None:
        if self.unfinished:
            self.bridge.abort(sorted(self.unfinished))
            self.unfinished.clear()

    async def aclose(self) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------
# Request bodies: pydantic models (types and ranges); FastAPI answers their violations as 400 (below)
# --------------------------------------------------------------------------------------------------------

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (
    NonEmptyStr
    | Annotated[list[NonEmptyStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)
Stop = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=4)] | None
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]

# the message for a field whose type is a union (pydantic reports one error per member: say it once)
UNION_HINTS = {
    "prompt": "must be a non-empty string, a non-empty list of non-empty strings, a non-empty list of token ids "
    "(integers >= 0), or a non-empty list of such lists",
    "stop": "must be a non-empty string or a list of at most 4 non-empty strings",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": ...})',
}


class _Body(BaseModel):
    # strict: "16" is not an integer, true is not a number (OpenAI's API refuses them too); unknown fields
    # are ignored, as vLLM does (OpenAI's newer fields the engine has no use for, such as "user")
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """The sampling fields the two endpoints share (OpenAI's, then vLLM's extras)."""

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, body: Any) -> Any:
        """OpenAI's fields are nullable: an explicit null takes the field's default, as leaving it out does."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    model: str | None = None  # OpenAI requires it; vLLM (and this server) default to the served model
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Seed | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Sampling):
    """POST /v1/completions (OpenAI's CreateCompletionRequest + vLLM's extras)."""

    prompt: Prompt
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (OpenAI's CreateChatCompletionRequest, text only, + vLLM's extras)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(
        None, ge=1
    )  # deprecated by OpenAI for max_completion_tokens; both accepted
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # OpenAI allows 20; the engine returns 5
    tools: list[dict] | None = None
    response_format: dict | None = None


# --------------------------------------------------------------------------------------------------------
# The chat template
# --------------------------------------------------------------------------------------------------------

CHAT_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"  # added to the request's stop strings: the model would go on writing the user's turn


def render_chat(messages: list[ChatMessage]) -> str:
    """The plain-text prompt of a conversation.

    GPT-2 is a base model: it was never trained on conversations and has no chat template, so chat is
    text continuation of a transcript. Every message is one ``Role: content`` line (system and developer
    messages as ``System:``), and the prompt ends with ``Assistant:`` for the model to continue::

        System: You are terse.
        User: What is a list?
        Assistant:

    The server adds the stop string ``"\\nUser:"`` (CHAT_STOP), so the reply ends where the model starts
    writing the user's next turn. Expect a fluent continuation, not an instruction-following answer.
    """
    lines = []
    for m in messages:
        text = m.content if isinstance(m.content, str) else "".join(part.text for part in m.content)
        lines.append(f"{CHAT_ROLES[m.role]}: {text}")
    return "\n".join(lines) + "\nAssistant:"


# --------------------------------------------------------------------------------------------------------
# Turning requests into engine requests, and outputs into OpenAI's objects
# --------------------------------------------------------------------------------------------------------


@dataclass
class Choice:
    """What one choice has accumulated: text, ids, logprobs, finish reason."""

    index: int
    prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        if out.finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def _clamp(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a token filtered out) becomes -9999.0, as vLLM does; NaN too."""
    return logprob if math.isfinite(logprob) else (logprob if logprob > 0 else LOGPROB_FLOOR)


def _token_text(tokenizer, token_id: int, logprob) -> str:
    return (
        logprob.decoded_token
        if logprob is not None and logprob.decoded_token is not None
        else tokenizer.decode([token_id])
    )


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], text_offset: int) -> dict:
    """OpenAI's completion ``logprobs`` object for some tokens: ``tokens`` (each token's text),
    ``token_logprobs`` (the sampled token's), ``top_logprobs`` (token text -> logprob for the sampled token
    and the n most likely, as vLLM), ``text_offset`` (each token's character offset in the choice's text,
    starting at ``text_offset``). Logprobs are clamped to -9999.0."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        sampled = entry.get(tid)
        text = _token_text(tokenizer, tid, sampled)
        tokens.append(text)
        token_logprobs.append(_clamp(sampled.logprob) if sampled is not None else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else math.inf)
        top.append({_token_text(tokenizer, t, lp): _clamp(lp.logprob) for t, lp in ranked})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict], top_n: int) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
    [the top_n most likely, by rank]}]}``; ``bytes`` are the token's UTF-8 bytes (a token can end inside a
    character, whose text is then U+FFFD). Logprobs are clamped to -9999.0."""

    def entry(tid: int, lp) -> dict:
        return {
            "token": _token_text(tokenizer, tid, lp),
            "logprob": _clamp(lp.logprob) if lp else None,
            "bytes": list(tokenizer.decode_bytes([tid])),
        }

    content = []
    for tid, lps in zip(token_ids, logprobs):
        ranked = sorted(
            ((t, lp) for t, lp in lps.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda kv: kv[1].rank,
        )
        content.append({**entry(tid, lps.get(tid)), "top_logprobs": [entry(t, lp) for t, lp in ranked]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict | str) -> str:
    """One Server-Sent Event: ``data: <json>`` and a blank line."""
    text = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    )
    return f"data: {text}\n\n"


class Server:
    """The handlers' shared state: the engine loop, the model's limits, the served name, the metrics."""

    def __init__(
        self,
        engine: LLMEngine,
        served_model_name: str,
        bridge: AsyncEngine,
        metrics: ServerMetrics,
        model_root: str | None,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.config.vocab_size
        self.max_model_len = engine.max_model_len
        self.served_model_name = served_model_name
        self.model_root = model_root or served_model_name
        self.bridge = bridge
        self.metrics = metrics
        self.created = int(time.time())

    # ---- the entrance: every check that needs the model, before anything reaches the engine ----

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.served_model_name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"{param}: token id {bad} is out of range: the vocabulary has {self.vocab_size} "
                f"tokens (ids 0..{self.vocab_size - 1})",
                param,
            )

    def budget(self, prompt_len: int, max_tokens: int | None, param: str, tokens_param: str) -> int:
        """The tokens to generate: ``max_tokens``, or what is left of the context window if None.
        Raises APIError 400 (code context_length_exceeded) if the prompt and the completion do not fit."""
        window = self.max_model_len
        if prompt_len >= window or (max_tokens is not None and prompt_len + max_tokens > window):
            where = "messages" if param == "messages" else "prompt"
            asked = (
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the completion)"
                if max_tokens is not None
                else f"{prompt_len} tokens in the {where}, which leaves no room for a completion"
            )
            raise bad_request(
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{asked}. Please reduce the length of the {where} or the completion.",
                param if prompt_len >= window else tokens_param,
                "context_length_exceeded",
            )
        return max_tokens if max_tokens is not None else window - prompt_len

    def sampling_params(
        self, req: _Sampling, max_tokens: int, choice: int, logprobs: int | None, extra_stop: list[str] = ()
    ) -> SamplingParams:
        """The request's ``SamplingParams`` for choice ``choice`` (seed + choice). Unset fields take vLLM's
        defaults. Raises APIError 400 on what SamplingParams refuses (its ValueError names the field)."""
        if req.stop_token_ids:
            self.check_ids(req.stop_token_ids, "stop_token_ids")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logprobs=logprobs,
                stop=stop + [s for s in extra_stop if s not in stop],
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                seed=None
                if req.seed is None
                else (req.seed + choice) % 2**64,  # wraps, as the generator's seed does
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as e:
            name = str(e).split("=", 1)[0]
            raise bad_request(str(e), name if name.isidentifier() else None) from None

    def check_common(self, req: _Sampling) -> None:
        """Fields the server accepts only in the forms it implements."""
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        if req.logit_bias:
            raise bad_request(
                "logit_bias: not supported by this server", "logit_bias", "unsupported_parameter"
            )

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Hand the requests to the engine loop; APIError 503 if the loop is dead, 429 if the queue is full."""
        try:
            return self.bridge.submit(requests)
        except QueueFullError as e:
            raise queue_full(e) from None
        except EngineDeadError:
            raise engine_dead(self.bridge.error) from None

    # ---- POST /v1/completions ----

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_common(req)
        if req.suffix:
            raise bad_request("suffix: not supported by this server", "suffix", "unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of: only best_of = n is supported", "best_of", "unsupported_parameter")
        if req.echo and req.logprobs is not None:
            raise bad_request(
                "echo with logprobs: the engine does not compute the prompt's logprobs",
                "echo",
                "unsupported_parameter",
            )
        p = req.prompt
        prompts: list[str | list[int]] = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        rid = f"cmpl-{uuid.uuid4().hex}"
        engine_requests, prompt_texts, prompt_lens = [], [], []
        for i, prompt in enumerate(prompts):
            param = "prompt"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.check_ids(ids, param)
            max_tokens = self.budget(len(ids), req.max_tokens, param, "max_tokens")
            prompt_texts.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids))
            prompt_lens.append(len(ids))
            for j in range(req.n):
                params = self.sampling_params(req, max_tokens, j, req.logprobs)
                engine_requests.append(EngineRequest(f"{rid}-{i * req.n + j}", ids, params, i * req.n + j))
        echo = {r.index: prompt_texts[r.index // req.n] if req.echo else "" for r in engine_requests}
        prompt_tokens = sum(prompt_lens)
        head = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
        }
        stream = self.submit(engine_requests)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._sse(
                stream,
                self._completion_chunks(stream, head, echo, req.logprobs, prompt_tokens, include_usage),
            )
        choices = {r.index: Choice(r.index, prompt_lens[r.index // req.n]) for r in engine_requests}
        await self._collect(stream, choices, request)
        body_choices = []
        for c in sorted(choices.values(), key=lambda c: c.index):
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(self.tokenizer, c.token_ids, c.logprobs, len(echo[c.index]))
            body_choices.append(
                {
                    "index": c.index,
                    "text": echo[c.index] + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return JSONResponse(
            {
                **head,
                "choices": body_choices,
                "usage": usage(prompt_tokens, completion_tokens),
                "system_fingerprint": None,
            }
        )

    async def _completion_chunks(
        self,
        stream,
        head: dict,
        echo: dict[int, str],
        logprobs: int | None,
        prompt_tokens: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        started: set[int] = set()
        offsets = {i: len(text) for i, text in echo.items()}  # text_offset of each choice's next token
        completion_tokens = 0
        extra = {"usage": None} if include_usage else {}
        async for index, out in stream:
            c = out.outputs[0]
            completion_tokens += len(c.token_ids)
            text = c.text
            if index not in started:
                started.add(index)
                text = echo[index] + text
            if not text and not c.finish_reason and logprobs is None:
                continue  # a token whose text is held back (a possible stop string, a partial character)
            lp = None
            if logprobs is not None:
                lp = completion_logprobs(self.tokenizer, c.token_ids, c.logprobs or [], offsets[index])
                offsets[index] += sum(len(t) for t in lp["tokens"])
            choice = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            yield sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    # ---- POST /v1/chat/completions ----

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_common(req)
        if req.tools:
            raise bad_request(
                "tools: not supported by this server (GPT-2 has no tool calling)",
                "tools",
                "unsupported_parameter",
            )
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise bad_request(
                'response_format: only {"type": "text"} is supported',
                "response_format",
                "unsupported_parameter",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        ids = self.tokenizer.encode(render_chat(req.messages))
        max_tokens = self.budget(len(ids), max_tokens, "messages", tokens_param)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        engine_requests = [
            EngineRequest(f"{rid}-{j}", ids, self.sampling_params(req, max_tokens, j, top_n, [CHAT_STOP]), j)
            for j in range(req.n)
        ]
        head = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.served_model_name,
        }
        stream = self.submit(engine_requests)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return await self._sse(
                stream,
                self._chat_chunks(
                    stream, {**head, "object": "chat.completion.chunk"}, req.n, top_n, len(ids), include_usage
                ),
            )
        choices = {j: Choice(j, len(ids)) for j in range(req.n)}
        await self._collect(stream, choices, request)
        body_choices = []
        for c in choices.values():
            lp = chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, top_n) if top_n is not None else None
            body_choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text, "refusal": None, "tool_calls": []},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return JSONResponse(
            {
                **head,
                "choices": body_choices,
                "usage": usage(len(ids), completion_tokens),
                "system_fingerprint": None,
            }
        )

    async def _chat_chunks(
        self, stream, head: dict, n: int, top_n: int | None, prompt_tokens: int, include_usage: bool
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}
        for j in range(n):  # the first chunk of every choice carries the role, as OpenAI's
            yield sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": j,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **extra,
                }
            )
        completion_tokens = 0
        async for index, out in stream:
            c = out.outputs[0]
            completion_tokens += len(c.token_ids)
            if not c.text and not c.finish_reason and top_n is None:
                continue
            lp = (
                chat_logprobs(self.tokenizer, c.token_ids, c.logprobs or [], top_n)
                if top_n is not None
                else None
            )
            delta = {"content": c.text} if c.text or not c.finish_reason else {}
            yield sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": index,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    ],
                    **extra,
                }
            )
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    # ---- the two ways an answer leaves: a whole JSON body, or Server-Sent Events ----

    async def _collect(self, stream, choices: dict[int, Choice], request: Request) -> None:
        """Fill ``choices`` from the stream; abort the requests if the client disconnects meanwhile."""

        async def consume() -> None:
            async with contextlib.aclosing(stream) as outputs:
                async for index, out in outputs:
                    choices[index].add(out)

        try:
            await cancel_on_disconnect(request, consume())
        except EngineDeadError:
            raise engine_dead(self.bridge.error) from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def _sse(self, stream: RequestStream, events: AsyncIterator[str]) -> Response:
        """A ``text/event-stream`` response: ``events`` then ``data: [DONE]``.

        An error after the stream has started is one ``data: {"error": ...}`` event, then ``[DONE]``.
        Starlette cancels the body when the client disconnects; the ``finally`` aborts the requests.
        """

        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except EngineDeadError:
                yield sse(engine_dead(self.bridge.error).body())
            except ValueError as e:  # the engine refused a request that passed the entrance
                yield sse(bad_request(str(e)).body())
            except Exception as e:  # noqa: BLE001 -- the stream has started: report, then end it cleanly
                yield sse(
                    APIError(500, f"internal error: {e!r}", "server_error", None, "internal_error").body()
                )
            finally:
                await events.aclose()
                await stream.aclose()
            yield sse("[DONE]")

        return EventStreamResponse(body(), on_close=stream.close)


class EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse as ``text/event-stream``, calling ``on_close`` however it ends: done,
    failed, or cancelled because the client disconnected (the body generator may be left suspended at a
    ``yield`` then; ``on_close`` does not wait for the garbage collector to close it)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def queue_full(e: QueueFullError) -> APIError:
    return APIError(
        429,
        f"The server is busy: {e}. Retry later.",
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


async def cancel_on_disconnect(request: Request, work: Awaitable) -> Any:
    """Await ``work``, cancelling it if the client disconnects first (vLLM's ``with_cancellation``).

    Raises ClientDisconnected if the client went away (there is nobody to answer)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


# --------------------------------------------------------------------------------------------------------
# The gate in front of the app: API key (401) and body size (413), before anything is parsed
# --------------------------------------------------------------------------------------------------------


class Gate:
    """ASGI middleware: requests under ``/v1/`` need ``Authorization: Bearer <api_key>`` when an API key is
    set (compared with ``hmac.compare_digest``, in constant time), except ``/v1/engine/stats`` (the JSON twin
    of the open ``/metrics``); a body over ``max_body_bytes`` is refused with 413 before it is parsed."""

    OPEN = {"/v1/engine/stats"}

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.api_key is not None and path.startswith("/v1/") and path not in self.OPEN:
            given = headers.get("authorization", "")
            token = given[7:] if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                error = APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error.response()(scope, receive, send)
        too_large = APIError(
            413,
            f"The request body is over {self.max_body_bytes} bytes.",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await too_large.response()(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # read the body (chunked bodies have no length), counting, then replay it to the app
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await too_large.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: the disconnect that StreamingResponse listens for

        return await self.app(scope, replay, send)


# --------------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------------


def _param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"`` (union member tags dropped)."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif i == 0 or (
            p.isidentifier() and p in {"role", "content", "include_usage", "type", "text", "name"}
        ):
            out += ("." if out else "") + p
        else:
            break
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 as OpenAI's 400: the first problem, naming the field (and its value where short)."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return bad_request(
            f"The body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
            None,
            "json_invalid",
        )
    if first["type"] in ("model_attributes_type", "dict_type") and len(first["loc"]) <= 1:
        return bad_request("The body must be a JSON object.", None, "invalid_type")
    param = _param(tuple(first["loc"]))
    leaf = param.split(".")[-1].split("[")[0] if param else None
    same_field = [e for e in errors if _param(tuple(e["loc"])) == param]
    if leaf in UNION_HINTS and len(same_field) > 1 and first["type"] != "missing":
        message = f"{param}: {UNION_HINTS[leaf]}"
    else:
        shown = first.get("input")
        value = (
            f"={json.dumps(shown)}"
            if isinstance(shown, (int, float, str, bool))
            and len(str(shown)) <= 40
            and first["type"] != "missing"
            else ""
        )
        message = f"{param}{value}: {first['msg']}" if param else first["msg"]
    kinds = [e["type"] for e in same_field] or [first["type"]]  # a union field: one error per member
    code = (
        "missing_required_parameter"
        if first["type"] == "missing"
        else "invalid_type"
        if all(k.endswith("_type") for k in kinds)
        else "invalid_value"
    )
    return bad_request(message, param, code)


def build_app(
    engine: LLMEngine,
    served_model_name: str = "demo",
    api_key: str | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_root: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (which it now owns: one thread steps it) as ``served_model_name``.

    api_key: if set, ``/v1/`` requests need ``Authorization: Bearer <api_key>`` (401 otherwise).
    max_waiting_requests: requests waiting for a place in the batch beyond which new ones get 429.
    max_body_bytes: request bodies over this get 413. model_root: shown as ``root`` in ``/v1/models``.
    The engine loop starts with the app (lifespan startup) and stops with it; ``app.state.server`` holds
    the handlers' state (``.bridge`` is the ``AsyncEngine``, ``.metrics`` the ``ServerMetrics``).
    Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/engine/stats,
    GET /health, GET /metrics, GET / (the web page).
    """
    if max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests={max_waiting_requests}: must be >= 0")
    metrics = ServerMetrics(served_model_name)
    bridge = AsyncEngine(engine, metrics, max_waiting_requests)
    server = Server(engine, served_model_name, bridge, metrics, model_root)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.start()
        try:
            yield
        finally:
            await asyncio.to_thread(bridge.shutdown)

    app = FastAPI(
        title="step6_server",
        summary="An OpenAI-compatible server over the staged GPT-2 engine",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server
    app.add_middleware(Gate, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(
            status_code=499
        )  # nginx's "client closed request": nobody reads it, nothing is logged

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 400 here is FastAPI's "error parsing the body" (not UTF-8, nested too deep): not JSON it can read
        code = {400: "json_invalid", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            "invalid_request_error",
            None,
            code,
        ).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": server.created,
            "owned_by": OWNED_BY,
            "root": server.model_root,
            "parent": None,
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/v1/engine/stats")
    async def engine_stats() -> dict:
        """The engine's figures as JSON (what the web page polls): the last step's batch and KV cache."""
        s = bridge.stats
        return {
            "model": served_model_name,
            "alive": bridge.alive,
            "running": s.num_running_reqs,
            "waiting": bridge.num_waiting(),
            "kv_cache_usage": s.kv_cache_usage,
            "kv_blocks_used": s.num_used_blocks,
            "kv_blocks_total": s.num_blocks,
            "num_preemptions": s.num_preemptions,
            "steps": s.steps,
            "max_running": s.max_running,
            "max_model_len": server.max_model_len,
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if bridge.alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    return app


# --------------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, exit status 2 (argparse prints the usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(
        prog=f"python -m {__package__ or 'step6_server'}",
        description="Serve the engine over OpenAI's HTTP API, with a web page at /.",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    parser.add_argument(
        "--model", default="demo", help="'demo' (bundled), a Hub id or alias such as gpt2, or a local folder"
    )
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ requests"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="most requests running at once (default 8)"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help=f"waiting requests beyond which new ones get 429 (default {DEFAULT_MAX_WAITING_REQUESTS})",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks in the pool")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="KV-cache pool size in bytes")
    parser.add_argument(
        "--attention-backend",
        default=None,
        choices=["auto", "triton", "torch"],
        help="attention implementation (engines that have a choice)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default warning; info logs every request)",
    )
    args = parser.parse_args(argv)
    for name in ("port",):
        if not 0 <= args.port <= 65535:
            parser.error(f"argument --port: {args.port} is not a TCP port (0..65535)")
    for name in ("max_num_seqs", "block_size", "max_body_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be >= 1")
    if args.max_waiting_requests < 0:
        parser.error("argument --max-waiting-requests: must be >= 0")
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLMEngine arguments of the command line; ``attention_backend`` only if this engine takes it."""
    kwargs = dict(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
    )
    if args.attention_backend is not None:
        if "attention_backend" not in inspect.signature(LLMEngine).parameters:
            raise ValueError("--attention-backend: this engine has a single attention implementation")
        kwargs["attention_backend"] = args.attention_backend
    return kwargs


def main(argv: list[str] | None = None) -> int:
    """``python -m step6_server``: load the model, bind, print the page's URL and a curl line, serve.

    Exit status: 0 after a clean shutdown, 2 on bad flags or a model/port that cannot be used (one line on
    stderr), 130 on Ctrl-C.
    """
    import uvicorn

    args = parse_args(argv)
    try:
        engine = LLMEngine(**engine_kwargs(args))
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except (ValueError, ConnectionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    app = build_app(
        engine,
        name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        model_root=str(args.model),
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"serving {name} on {url}  (web page: {url}/ , metrics: {url}/metrics)", flush=True)
    print(
        f"try: curl -N {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "The Python interpreter", "max_tokens": 32, "stream": true}}\'',
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=2))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on the first Ctrl-C, then raises it again
        return 130
    finally:
        app.state.server.bridge.shutdown(timeout=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the two endpoints share: the entrance checks that need the model, and how an answer leaves.

``OpenAIServing`` holds the handlers' state (the engine, the tokenizer, the context window, the served
name). Every check that needs the model happens here, before anything reaches the engine: the model name
(404), token ids against the vocabulary, prompt + ``max_tokens`` against the context window, and
``SamplingParams``' own ``ValueError`` (400). An answer leaves whole (``collect``) or as Server-Sent Events
(``event_stream``), where an error after the start is one ``data: {"error": ...}`` event, then
``data: [DONE]``; each event built as bytes by orjson (sglang #1694). Sources: vLLM's
``vllm/entrypoints/openai/serving_engine.py``, the WHATWG HTML standard's Server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    QueueFullError,
    RequestStream,
    ServerShuttingDown,
)
from .metrics import ServerMetrics
from .outputs import CompletionOutput
from .processor import check_token_ids
from .protocol import APIError, SamplingFields, bad_request
from .sampling_params import RequestOutputKind, SamplingParams


class ClientDisconnected(Exception):
    """The client went away before its (non-streaming) answer was ready; its requests were aborted."""


def engine_dead(error: BaseException | None) -> APIError:
    return APIError(
        503,
        f"the engine core has stopped: {error}" if error else "the engine core has stopped",
        "server_error",
        None,
        "engine_dead",
    )


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down: this request was stopped before it finished.",
        "server_error",
        None,
        "server_shutdown",
    )


def queue_full(e: QueueFullError) -> APIError:
    return APIError(
        429,
        f"The server is busy: {e}. Retry later.",
        "rate_limit_error",
        None,
        "rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


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

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        if c.finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def sse(data: dict | str) -> bytes:
    """One Server-Sent Event: ``data: <json>`` and a blank line, as UTF-8 bytes (orjson: compact, the
    characters unescaped, as step 9's ``json.dumps``)."""
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


class OpenAIServing:
    """The handlers' shared state (the engine, the model's limits, the served name, the metrics), the
    checks at the entrance, and the two ways an answer leaves (``collect``, ``event_stream``)."""

    def __init__(
        self,
        served_model_name: str,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        model_root: str | None,
    ):
        self.tokenizer = engine.tokenizer
        self.processor = engine.processor
        self.vocab_size = engine.config.hf_config.vocab_size
        self.max_model_len = engine.config.max_model_len
        self.max_num_seqs = engine.config.max_num_seqs
        self.served_model_name = served_model_name
        self.model_root = model_root or served_model_name
        self.engine = engine
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
        """APIError 400 naming the first id outside the vocabulary (the engine's check and message)."""
        try:
            check_token_ids(ids, self.vocab_size, param)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def budget(self, prompt_len: int, max_tokens: int | None, param: str, tokens_param: str) -> int:
        """The tokens to generate: ``max_tokens``, or what the prompt leaves of the window if None (OpenAI's
        chat default). Raises APIError 400 (code context_length_exceeded) if the prompt and the completion
        do not fit: the engine's rule and message (``Processor.check_length``), as the Python API's."""
        try:
            self.processor.check_length(prompt_len, max_tokens)
        except ValueError as e:
            at_fault = param if prompt_len >= self.max_model_len else tokens_param
            raise bad_request(str(e), at_fault, "context_length_exceeded") from None
        return max_tokens if max_tokens is not None else self.max_model_len - prompt_len

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int,
        logprobs: int | None,
        extra_stop: list[str] = (),
    ) -> SamplingParams:
        """The request's ``SamplingParams``, its ``n`` choices included (the engine seeds choice i with
        seed + i). Unset fields take vLLM's defaults. Raises APIError 400 on what SamplingParams refuses
        (its ValueError names the field)."""
        if req.stop_token_ids:
            self.check_ids(req.stop_token_ids, "stop_token_ids")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            return SamplingParams(
                n=req.n,
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
                seed=None if req.seed is None else req.seed % 2**64,  # wraps, as the generator's seed does
                output_kind=RequestOutputKind.DELTA,
            )
        except ValueError as e:
            name = str(e).split("=", 1)[0]
            raise bad_request(str(e), name if name.isidentifier() else None) from None

    def check_common(self, req: SamplingFields) -> None:
        """Fields the server accepts only in the forms it implements."""
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        if req.logit_bias:
            raise bad_request(
                "logit_bias: not supported by this server", "logit_bias", "unsupported_parameter"
            )

    def check_admissible(self, num_prompts: int, n: int) -> None:
        """A request makes one engine request per prompt (its n choices run inside it), all waiting at
        first: more than the waiting limit could never be queued, however long the client waited; and the
        n choices of a prompt run together, so n may not exceed the engine's ``max_num_seqs``. APIError 400
        naming the limit (a 429 would tell the client to retry what can never succeed)."""
        if n > self.max_num_seqs:
            raise bad_request(
                f"n={n}: the choices of a prompt run together, and this server runs at most "
                f"max_num_seqs={self.max_num_seqs} sequences at once",
                "n",
            )
        limit = self.engine.max_waiting_requests
        if num_prompts > limit:
            raise bad_request(
                f"This request makes {num_prompts} engine requests (one per prompt), more than this server "
                f"ever queues (max_waiting_requests={limit}): send fewer prompts.",
                "prompt",
            )

    def response_head(self, response_id: str, obj: str) -> dict:
        """The fields every response object (and every chunk) of one request starts with."""
        return {
            "id": response_id,
            "object": obj,
            "created": int(time.time()),
            "model": self.served_model_name,
        }

    def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Hand the requests to the engine; APIError 503 if the engine core is dead, 429 if the queue is
        full."""
        try:
            return self.engine.submit(requests)
        except QueueFullError as e:
            raise queue_full(e) from None
        except EngineDeadError as e:  # the core's death, or a send it could not take
            raise engine_dead(self.engine.error or e) from None

    # ---- the two ways an answer leaves: a whole JSON body, or Server-Sent Events ----

    async def collect(self, stream, choices: dict[int, Choice], request: Request) -> int:
        """Fill ``choices`` from the stream; abort the requests if the client disconnects meanwhile. Returns
        the prompt tokens its requests found in the prefix cache (usage's cached_tokens)."""
        cached: dict[int, int] = {}  # by request (the index of its first choice)

        async def consume() -> None:
            async with contextlib.aclosing(stream) as outputs:
                async for index, out in outputs:
                    cached[index] = out.num_cached_tokens
                    for c in out.outputs:
                        choices[index + c.index].add(c)

        try:
            await cancel_on_disconnect(request, consume())
        except EngineDeadError:
            raise engine_dead(self.engine.error) from None
        except ServerShuttingDown:
            raise shutting_down() from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        return sum(cached.values())

    async def event_stream(self, stream: RequestStream, events: AsyncIterator[bytes]) -> Response:
        """A ``text/event-stream`` response: ``events`` then ``data: [DONE]``.

        An error after the stream has started is one ``data: {"error": ...}`` event, then ``[DONE]``.
        Starlette cancels the body when the client disconnects; the ``finally`` aborts the requests.
        """

        async def body() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield event
            except EngineDeadError:
                yield sse(engine_dead(self.engine.error).body())
            except ServerShuttingDown:
                yield sse(shutting_down().body())
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

    def __init__(self, content: AsyncIterator[bytes], on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


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

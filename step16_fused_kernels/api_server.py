"""The app: an OpenAI-compatible HTTP server over the engine, its middleware and its routes.

OpenAI's wire format (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) with vLLM's extra
sampling fields, vLLM's ``/health`` (503 once the engine core died) and ``/metrics`` (Prometheus, vLLM's
names). Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 (bad input, before the
engine), 401 (``--api-key``), 404, 413 (body too large), 429 (queue full, ``Retry-After``), 503 (engine
dead). A request's path: ``Gate`` (API key, body size) -> FastAPI (protocol.py) -> the endpoint
(serving_completion.py, serving_chat.py) -> ``AsyncEngine`` (async_engine.py: the engine core in its own
process, the text made here) -> one JSON body or Server-Sent Events (serving_engine.py). Sources: vLLM's
``vllm/entrypoints/openai/api_server.py``; FastAPI.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
from pathlib import Path

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import DEFAULT_MAX_WAITING_REQUESTS, AsyncEngine
from .core_client import AsyncMPClient
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error
from .serving_chat import create_chat_completion
from .serving_completion import create_completion
from .serving_engine import ClientDisconnected, OpenAIServing

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a 1024-token prompt is a few KiB of JSON
SMALLEST_BODY = b'{"prompt":"x"}'  # a cap below its size would refuse every request
OWNED_BY = __package__  # the step serving: /v1/models' owned_by, the app's and the page's titles


# --------------------------------------------------------------------------------------------------------
# The gate in front of the app: API key (401), body size (413) and type, before anything is parsed
# --------------------------------------------------------------------------------------------------------


class Gate:
    """ASGI middleware: requests under ``/v1/`` need ``Authorization: Bearer <api_key>`` when an API key is
    set (compared with ``hmac.compare_digest``, in constant time), except ``/v1/engine/stats`` (the JSON twin
    of the open ``/metrics``); a body over ``max_body_bytes`` is refused with 413 before it is parsed; a
    body sent with a Content-Type that is not JSON's, or none (``curl -d`` sends
    application/x-www-form-urlencoded), is read as JSON, the API's only body format: the type sent is
    kept in ``scope["state"]`` for the error message if the body does not parse."""

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
        sent = headers.get("content-type")
        if sent is None or not is_json(sent):
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
            scope.setdefault("state", {})["sent_content_type"] = sent or "none"
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


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<something>+json``, with or without parameters."""
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


# --------------------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------------------


def build_app(
    engine_core: AsyncMPClient,
    served_model_name: str = "demo",
    api_key: str | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_root: str | None = None,
    stream_interval: int = 1,
) -> FastAPI:
    """The FastAPI app serving the engine core behind ``engine_core`` (a started ``AsyncMPClient``, which
    the app now owns: it stops the core when it stops) as ``served_model_name``.

    api_key: if set, ``/v1/`` requests need ``Authorization: Bearer <api_key>`` (401 otherwise).
    max_waiting_requests: requests waiting for a place in the batch beyond which new ones get 429 (one
    that alone makes more engine requests gets 400). Raises ValueError for limits that admit nothing.
    max_body_bytes: request bodies over this get 413. model_root: shown as ``root`` in ``/v1/models``.
    stream_interval: a stream's event every N tokens (the first at once; vLLM's name; >= 1).
    The output handler starts with the app (lifespan startup); the core stops with it;
    ``app.state.server`` holds the handlers' state (``.engine`` is the ``AsyncEngine``, ``.metrics`` the
    ``ServerMetrics``).
    Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model},
    GET /v1/engine/stats, GET /health, GET /metrics, GET / (the web page); every GET answers HEAD.
    """
    if max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests={max_waiting_requests}: must be >= 1 (0 admits nothing)")
    if max_body_bytes < len(SMALLEST_BODY):
        raise ValueError(f"max_body_bytes={max_body_bytes}: must be >= {len(SMALLEST_BODY)} (admits nothing)")
    metrics = ServerMetrics(served_model_name)
    engine = AsyncEngine(engine_core, metrics, max_waiting_requests, stream_interval)
    server = OpenAIServing(served_model_name, engine, metrics, model_root)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        gc.collect()
        gc.freeze()  # what start-up made lives on: no collection scans it again (vLLM #12287)
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            gc.unfreeze()  # so that exit frees it (else triton's bindings report each object as leaked)

    app = FastAPI(
        title=__package__,
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
        route = request.scope.get("route")  # its body model: the fields an empty body lacks
        body = route.body_field.field_info.annotation if getattr(route, "body_field", None) else None
        return validation_error(exc, getattr(request.state, "sent_content_type", None), body).response()

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
            headers=exc.headers,  # a 405 names the methods allowed (Allow), as HTTP requires
        ).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, body, request)

    card = {
        "id": served_model_name,
        "object": "model",
        "created": server.created,
        "owned_by": OWNED_BY,
        "root": server.model_root,
        "parent": None,
        "max_model_len": server.max_model_len,
    }

    # every GET route answers HEAD too (load balancers probe with it): the same status and headers
    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str) -> dict:
        """One model's card (the SDK's ``models.retrieve``); 404 ``model_not_found`` for another id."""
        server.check_model(model)
        return card

    @app.api_route("/v1/engine/stats", methods=["GET", "HEAD"])
    async def engine_stats() -> dict:
        """The engine's figures as JSON (what the web page polls): every field of the core's last
        ``SchedulerStats`` by its name, the rates made of them, and the page's names."""
        engine.refresh()
        s = engine.stats
        return {
            "model": served_model_name,
            "alive": engine.alive,
            "features": engine.features,
            **msgspec.structs.asdict(s),  # a counter added to SchedulerStats shows here as it is
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "spec_decode_acceptance_rate": s.spec_decode_acceptance_rate,
            "spec_decode_mean_acceptance_length": s.spec_decode_mean_acceptance_length,
            "running": s.num_running_reqs,
            "waiting": engine.num_waiting(),  # the core's waiting queue, and the requests on their way to it
            "kv_blocks_used": s.num_used_blocks,
            "kv_blocks_total": s.num_blocks,
            "steps": engine.steps,
            "max_running": engine.max_running,
            "max_model_len": server.max_model_len,
            "engines": [  # each core: its own figures, as last heard (the fields above: all of them)
                {
                    "engine": i,
                    "pid": config.pid,
                    "device": config.features["device"],
                    **msgspec.structs.asdict(engine.stats_of[i]),
                }
                for i, config in enumerate(engine.client.configs)
            ],
        }

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        engine.refresh()
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    return app

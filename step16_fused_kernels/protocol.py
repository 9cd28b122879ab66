"""OpenAI's wire format: the request bodies (pydantic models), the error body, and the response pieces.

FastAPI validates request bodies with the pydantic models below (types and ranges as ``Field`` constraints);
``validation_error`` turns their violations into OpenAI's 400, naming the field. Checks that need the model
are in serving_engine.py. Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``; responses
are dicts built field by field as the ``openai`` SDK's types (``Completion``, ``ChatCompletion``,
``ChatCompletionChunk``, ``Model``), their shared pieces here. Sources: OpenAI's API reference, openai-python
(``src/openai/types``), vLLM's ``vllm/entrypoints/openai/protocol.py``.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps logprobs to this
MAX_LOGPROBS = 5  # the engine returns at most the 5 most likely tokens per position


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


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# --------------------------------------------------------------------------------------------------------
# Request bodies: pydantic models (types and ranges); FastAPI answers their violations as 400 (below)
# --------------------------------------------------------------------------------------------------------

NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = int  # checked against the vocabulary, naming the id, where the model is known (serving_engine.py)
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
    "prompt": "must be a non-empty string, a non-empty list of non-empty strings, a non-empty list of "
    "token ids (integers), or a non-empty list of such lists",
    "stop": "must be a non-empty string or a list of at most 4 non-empty strings",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": ...})',
}


class _Body(BaseModel):
    # strict: "16" is not an integer, true is not a number (OpenAI's API refuses them too); unknown fields
    # are ignored, as vLLM does (OpenAI's newer fields the engine has no use for, such as "user")
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)  # NaN, Infinity: refused


class StreamOptions(_Body):
    """OpenAI's ``include_usage`` (a last chunk with the usage); vLLM's ``continuous_usage_stats`` (every
    chunk carries the usage so far, as guidellm asks)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """The sampling fields the two endpoints share (OpenAI's, then vLLM's extras)."""

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, body: Any) -> Any:
        """OpenAI's fields are nullable: an explicit null takes the field's default, as leaving it out
        does."""
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    model: str | None = None  # OpenAI requires it; vLLM (and this server) default to the served model
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: the most likely token (below)
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

    @model_validator(mode="after")
    def top_p_0_is_the_most_likely_token(self) -> SamplingFields:
        """OpenAI accepts top_p in 0..1; 0 is the narrowest nucleus, the most likely token alone. The
        engine's range is vLLM's, (0, 1], so 0 becomes its equivalent there: top_k = 1 (top_p off)."""
        if self.top_p == 0:
            self.top_p, self.top_k = None, 1
        return self


class CompletionRequest(SamplingFields):
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


class ChatCompletionRequest(SamplingFields):
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


def _param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"`` (union member tags
    dropped)."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif i == 0 or (
            p.isidentifier()
            and p in {"role", "content", "include_usage", "continuous_usage_stats", "type", "text", "name"}
        ):
            out += ("." if out else "") + p
        else:
            break
    return out or None


def validation_error(
    exc: RequestValidationError, sent_content_type: str | None = None, body: type[BaseModel] | None = None
) -> APIError:
    """FastAPI's 422 as OpenAI's 400: the first problem, naming the field (and its value where short).

    sent_content_type: the request's Content-Type if it was not JSON's (the body was read as JSON anyway);
    named in the message when the body does not parse. body: the endpoint's body model, whose required
    fields an empty body is told it lacks (FastAPI reports only that the body is missing)."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "missing" and tuple(first["loc"]) == ("body",):  # no body at all
        required = [name for name, f in body.model_fields.items() if f.is_required()] if body else []
        fields = " and ".join(f"`{name}`" for name in required) or "the request's fields"
        return bad_request(
            f"The request body is empty: send a JSON object with {fields}.",
            required[0] if required else None,
            "missing_required_parameter",
        )
    if first["type"] == "json_invalid":
        sent = (
            f" (sent as Content-Type: {sent_content_type}; this API reads every body as JSON)"
            if sent_content_type
            else ""
        )
        return bad_request(
            f"The body is not valid JSON{sent}: {first.get('ctx', {}).get('error', first['msg'])}",
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


# --------------------------------------------------------------------------------------------------------
# Response pieces: logprobs objects, usage
# --------------------------------------------------------------------------------------------------------


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with cached_tokens, the prompt tokens found in the prefix cache, as
    ``prompt_tokens_details.cached_tokens`` (OpenAI's field, which vLLM fills the same way)."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts

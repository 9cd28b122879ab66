"""POST /v1/chat/completions: messages -> a transcript prompt -> a ``ChatCompletion`` or its chunks (SSE).

GPT-2 is a base model with no chat template: ``render_chat`` writes the conversation as a plain
transcript, and the reply is the model's continuation of it. Source: vLLM's
``vllm/entrypoints/openai/serving_chat.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .async_engine import EngineRequest
from .protocol import ChatCompletionRequest, ChatMessage, bad_request, chat_logprobs, usage
from .serving_engine import Choice, OpenAIServing, sse

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


async def create_chat_completion(
    serving: OpenAIServing, req: ChatCompletionRequest, request: Request
) -> Response:
    serving.check_common(req)
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
    serving.check_admissible(1, req.n)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    ids = serving.tokenizer.encode(render_chat(req.messages))
    max_tokens = serving.budget(len(ids), max_tokens, "messages", tokens_param)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    engine_requests = [  # one, of n choices: the transcript is prefilled once
        EngineRequest(f"{rid}-0", ids, serving.sampling_params(req, max_tokens, top_n, [CHAT_STOP]), 0)
    ]
    head = serving.response_head(rid, "chat.completion")
    stream = serving.submit(engine_requests)
    if req.stream:
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        return await serving.event_stream(
            stream,
            chat_chunks(
                serving,
                stream,
                {**head, "object": "chat.completion.chunk"},
                req.n,
                top_n,
                len(ids),
                include_usage,
                continuous_usage,
            ),
        )
    choices = {j: Choice(j, len(ids)) for j in range(req.n)}
    cached_tokens = await serving.collect(stream, choices, request)
    body_choices = []
    for c in choices.values():
        lp = chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs, top_n) if top_n is not None else None
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
            "usage": usage(len(ids), completion_tokens, cached_tokens),
            "system_fingerprint": None,
        }
    )


async def chat_chunks(
    serving: OpenAIServing,
    stream,
    head: dict,
    n: int,
    top_n: int | None,
    prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[bytes]:
    extra = {"usage": None} if include_usage else {}
    if continuous_usage:  # vLLM's continuous_usage_stats: the usage so far, in every chunk
        extra = {"usage": usage(prompt_tokens, 0)}
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
    completion_tokens = cached_tokens = 0
    async for _, out in stream:
        cached_tokens = out.num_cached_tokens
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            if not c.text and not c.finish_reason and top_n is None:
                continue
            lp = (
                chat_logprobs(serving.tokenizer, c.token_ids, c.logprobs or [], top_n)
                if top_n is not None
                else None
            )
            delta = {"content": c.text} if c.text or not c.finish_reason else {}
            if continuous_usage:
                extra = {"usage": usage(prompt_tokens, completion_tokens)}
            yield sse(
                {
                    **head,
                    "choices": [
                        {
                            "index": c.index,
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
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})

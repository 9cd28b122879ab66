"""POST /v1/completions: prompts -> engine requests -> a ``Completion`` body or ``Completion`` chunks (SSE).

A request with several prompts and ``n`` choices makes one engine request of n choices per prompt (the
prompt prefilled once); choice index = prompt index * n + choice, as OpenAI's. Source: vLLM's
``vllm/entrypoints/openai/serving_completion.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .async_engine import EngineRequest
from .protocol import CompletionRequest, bad_request, completion_logprobs, usage
from .serving_engine import Choice, OpenAIServing, sse


async def create_completion(serving: OpenAIServing, req: CompletionRequest, request: Request) -> Response:
    serving.check_common(req)
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
    serving.check_admissible(len(prompts), req.n)
    rid = f"cmpl-{uuid.uuid4().hex}"
    engine_requests, prompt_texts, prompt_lens = [], [], []
    for i, prompt in enumerate(prompts):
        param = "prompt"
        ids = serving.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        serving.check_ids(ids, param)
        max_tokens = serving.budget(len(ids), req.max_tokens, param, "max_tokens")
        prompt_texts.append(prompt if isinstance(prompt, str) else serving.tokenizer.decode(ids))
        prompt_lens.append(len(ids))
        params = serving.sampling_params(req, max_tokens, req.logprobs)
        engine_requests.append(
            EngineRequest(f"{rid}-{i}", ids, params, i * req.n)
        )  # its first choice's index
    indices = [i * req.n + j for i in range(len(prompts)) for j in range(req.n)]
    echo = {k: prompt_texts[k // req.n] if req.echo else "" for k in indices}
    prompt_tokens = sum(prompt_lens)
    head = serving.response_head(rid, "text_completion")
    stream = serving.submit(engine_requests)
    if req.stream:
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        return await serving.event_stream(
            stream,
            completion_chunks(
                serving,
                stream,
                head,
                echo,
                req.logprobs,
                prompt_tokens,
                include_usage,
                continuous_usage,
            ),
        )
    choices = {k: Choice(k, prompt_lens[k // req.n]) for k in indices}
    cached_tokens = await serving.collect(stream, choices, request)
    body_choices = []
    for c in sorted(choices.values(), key=lambda c: c.index):
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs, len(echo[c.index]))
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
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
            "system_fingerprint": None,
        }
    )


async def completion_chunks(
    serving: OpenAIServing,
    stream,
    head: dict,
    echo: dict[int, str],
    logprobs: int | None,
    prompt_tokens: int,
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncIterator[bytes]:
    started: set[int] = set()
    offsets = {i: len(text) for i, text in echo.items()}  # text_offset of each choice's next token
    completion_tokens = 0
    cached: dict[int, int] = {}  # prompt tokens found in the prefix cache, by request (its first choice)
    extra = {"usage": None} if include_usage else {}
    async for first, out in stream:
        cached[first] = out.num_cached_tokens
        for c in out.outputs:
            index = first + c.index
            completion_tokens += len(c.token_ids)
            text = c.text
            if index not in started:
                started.add(index)
                text = echo[index] + text
            if not text and not c.finish_reason and logprobs is None:
                continue  # a token whose text is held back (a possible stop string, a partial character)
            lp = None
            if logprobs is not None:
                lp = completion_logprobs(serving.tokenizer, c.token_ids, c.logprobs or [], offsets[index])
                offsets[index] += sum(len(t) for t in lp["tokens"])
            choice = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if continuous_usage:  # vLLM's continuous_usage_stats: the usage so far, in every chunk
                extra = {"usage": usage(prompt_tokens, completion_tokens)}
            yield sse({**head, "choices": [choice], **extra})
    if include_usage:
        yield sse(
            {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, sum(cached.values()))}
        )

"""Step 6 tests: the HTTP server is a faithful door to the engine.

- What comes over HTTP (the unmodified ``openai`` SDK, streaming or not, completions and chat) is exactly
  what the in-process engine makes for the same prompt, field by field in OpenAI's wire format.
- Concurrent clients share the engine's continuous batch and still get their solo output; clients that
  disconnect have their requests aborted at once, so the KV cache ends empty and the server healthy.
- Bad input never reaches the engine: every malformed or out-of-range field is a 400 naming it (and
  401, 404, 413, 429, 503 where they apply) with OpenAI's error body.
- /health, /metrics (vLLM's names), and the web page in a real headless Chromium. The servers run in this
  process (uvicorn in a thread, on a free loopback port); nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from openai.types import Completion, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .__main__ import bind, make_parser, parse_args
from .__main__ import main as cli_main
from .api_server import build_app
from .async_engine import AsyncEngine, EngineRequest, QueueFullError
from .engine import LLMEngine
from .llm import LLM
from .protocol import ChatMessage, chat_logprobs, completion_logprobs
from .sampling_params import Logprob, SamplingParams
from .serving_chat import CHAT_STOP, render_chat

PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "x",
    "Modules can import other modules.",
    "A dictionary maps keys to values. Keys must be hashable",
]
MAX_NUM_SEQS = 16
# The bound of every wait for an event here (a server up, an engine idle): a safety net against a hang,
# never a measure of speed (a loaded machine can take minutes).
SAFETY_NET_S = 300
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


# ---------------------------------------------------------------------------------------------------------
# Fixtures: one engine and one server for the session; an in-process LLM as the oracle
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(app):
    """Run ``app`` with uvicorn in a thread on a free 127.0.0.1 port; yields its base URL; stops it after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + SAFETY_NET_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start (within {SAFETY_NET_S} s)")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class Served:
    url: str
    app: object

    @property
    def bridge(self):
        return self.app.state.server.bridge

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats").json()


@pytest.fixture(scope="session")
def engine(demo_snapshot) -> LLMEngine:
    return LLMEngine(model=str(demo_snapshot), max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=MAX_NUM_SEQS * 32)


@pytest.fixture(scope="session")
def served(engine):
    app = build_app(engine, "demo")
    with serve(app) as url:
        yield Served(url, app)


@pytest.fixture(scope="session")
def llm(demo_snapshot) -> LLM:
    """The in-process oracle: its own engine (the server's belongs to the server's loop thread)."""
    return LLM(model=str(demo_snapshot))


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(llm: LLM, prompt: str, max_tokens: int, **kw) -> str:
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]
    return out.outputs[0].text


def wait_idle(served: Served, timeout: float = SAFETY_NET_S) -> dict:
    """Poll the engine's figures until nothing runs, waits or holds a KV block (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        s = served.stats()
        if (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------------
# Same output as in process, through the unmodified SDK
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_in_process_engine(client, llm, stream):
    """Greedy text over HTTP equals LLM.generate's for the same prompt (the parity tier of step 6)."""
    for prompt in PROMPTS[:3]:
        expected = greedy(llm, prompt, 24)
        if not stream:
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
            assert isinstance(r, Completion) and r.object == "text_completion"
            assert r.choices[0].text == expected
            assert r.choices[0].finish_reason in ("stop", "length")
            assert r.usage.prompt_tokens == len(llm.engine.tokenizer.encode(prompt))
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        else:
            chunks = list(
                client.completions.create(
                    model="demo",
                    prompt=prompt,
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == expected
            assert all(c.usage is None for c in chunks[:-1])
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
            assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("stop", "length")
            assert all(c.choices[0].finish_reason is None for c in chunks[:-2])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_in_process_engine_on_the_template(client, llm, stream):
    """Chat is the rendered transcript continued greedily, stopping at the user's next turn."""
    messages = [
        {"role": "system", "content": "You answer questions about Python."},
        {"role": "user", "content": "What is a list comprehension?"},
    ]
    prompt = render_chat([ChatMessage(**m) for m in messages])
    assert prompt.endswith("User: What is a list comprehension?\nAssistant:")
    expected = greedy(llm, prompt, 32, stop=[CHAT_STOP])
    if not stream:
        r = client.chat.completions.create(
            model="demo", messages=messages, max_completion_tokens=32, temperature=0
        )
        assert isinstance(r, ChatCompletion) and r.object == "chat.completion"
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == expected
        assert r.usage.prompt_tokens == len(llm.engine.tokenizer.encode(prompt))
    else:
        chunks = list(
            client.chat.completions.create(
                model="demo",
                messages=messages,
                max_tokens=32,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert all(isinstance(c, ChatCompletionChunk) and c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_wire_format_validates_against_the_sdk_types(served):
    """Every body parses with the openai SDK's own pydantic models (strict validation, not construct)."""
    base = served.url
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 5, "logprobs": 2}
    Completion.model_validate(httpx.post(f"{base}/v1/completions", json=body).json())
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 2,
    }
    ChatCompletion.model_validate(httpx.post(f"{base}/v1/chat/completions", json=chat).json())
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        ChatCompletionChunk.model_validate(json.loads(e))
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list"
    card = Model.model_validate(models["data"][0])
    assert card.id == "demo" and models["data"][0]["max_model_len"] == 512


def continuous_usages(base_url: str, path: str, include_usage: bool) -> list:
    """The usage of every chunk of a stream of n = 2 choices x 6 tokens asked with vLLM's
    ``continuous_usage_stats`` (and OpenAI's ``include_usage`` or not), read with the openai SDK's types;
    checks what every chunk's usage must say: the prompt's tokens, the completion tokens streamed so
    far (never fewer than the chunk before), their sum; with include_usage, a last chunk without choices."""
    prompt = {"prompt": "The Python interpreter"}
    if path == "/v1/chat/completions":
        prompt = {"messages": [{"role": "user", "content": "What is a list?"}]}
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    body = {**prompt, "max_tokens": 6, "n": 2, "seed": 1, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + path, json={**body, "stream_options": options}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(chunk.get("usage") for chunk in chunks), chunks
    for chunk in chunks if path == "/v1/chat/completions" else []:  # (the SDK's Completion wants a
        ChatCompletionChunk.model_validate(chunk)  # finish_reason in every chunk: its usage alone, below)
    usages = [CompletionUsage.model_validate(chunk["usage"]) for chunk in chunks]
    assert [chunk["choices"] == [] for chunk in chunks] == [False] * (len(chunks) - include_usage) + [
        True
    ] * include_usage
    assert {u.prompt_tokens for u in usages} == {usages[-1].prompt_tokens} and usages[-1].prompt_tokens > 0
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 2 * 6
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    return usages


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served, path):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it) is honoured, with OpenAI's
    ``include_usage`` and without it (``continuous_usages``)."""
    for include_usage in (False, True):
        continuous_usages(served.url, path, include_usage)


def test_n_choices_use_seed_plus_index(client):
    """n choices are n engine requests; choice i is seeded with seed + i, so it equals a solo request."""
    kw = dict(model="demo", prompt=PROMPTS[1], max_tokens=12, temperature=1.0)
    r = client.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    again = client.completions.create(n=3, seed=7, **kw)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    assert client.completions.create(seed=9, **kw).choices[0].text == r.choices[2].text
    assert r.usage.completion_tokens >= 3  # summed over the choices; the prompt counted once
    # several prompts: choice index = prompt index * n + i
    two = client.completions.create(model="demo", prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy


def test_completion_logprobs_object(client, llm):
    r = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text  # greedy, no stop string: every token is in the text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the most likely
    # streamed: the same tokens, offsets continuing across chunks
    chunks = list(
        client.completions.create(
            model="demo", prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3, stream=True
        )
    )
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs_object(client):
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_minus_infinity_logprobs_stay_valid_json(llm):
    """A filtered-out token has logprob -inf: clamped to -9999.0, as vLLM, so the JSON stays valid."""
    tok = llm.engine.tokenizer
    entry = {5: Logprob(-math.inf, 1, None), 6: Logprob(-0.1, 2, None)}
    c = completion_logprobs(tok, [5], [entry], 0)
    h = chat_logprobs(tok, [5], [entry], 2)
    assert c["token_logprobs"] == [-9999.0] and h["content"][0]["logprob"] == -9999.0
    json.dumps([c, h], allow_nan=False)


def test_echo_stop_and_penalties(client, llm):
    expected = greedy(llm, PROMPTS[2], 24)
    r = client.completions.create(model="demo", prompt=PROMPTS[2], max_tokens=24, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[2] + expected
    stop = expected[len(expected) // 2 : len(expected) // 2 + 3]
    if stop.strip():
        r = client.completions.create(
            model="demo", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop]
        )
        assert r.choices[0].text == expected[: expected.index(stop)]
        assert r.choices[0].finish_reason == "stop"
    # vLLM's extras and the penalties reach the engine (they validate and run)
    r = client.completions.create(
        model="demo",
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=0.7,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "stop_token_ids": [0],
        },
    )
    assert r.usage.completion_tokens >= 1


# ---------------------------------------------------------------------------------------------------------
# One batch for many clients; disconnects abort at once
# ---------------------------------------------------------------------------------------------------------


def test_32_concurrent_streams_each_get_their_solo_output(served, llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    lengths = [6 + (7 * i) % 15 for i in range(32)]
    solo = [greedy(llm, p, n) for p, n in zip(prompts, lengths)]
    running_seen: list[int] = []

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> str:
        stream = await client.completions.create(
            model="demo", prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def sample(http: httpx.AsyncClient, done: asyncio.Event) -> None:
        while not done.is_set():
            running_seen.append((await http.get(f"{served.url}/v1/engine/stats")).json()["running"])
            await asyncio.sleep(0.005)

    async def main() -> list[str]:
        done = asyncio.Event()
        async with (
            openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client,
            httpx.AsyncClient() as http,
        ):
            sampler = asyncio.create_task(sample(http, done))
            texts = await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))
            done.set()
            await sampler
        return texts

    texts = asyncio.run(main())
    assert texts == solo
    assert max(running_seen) > 1, "the concurrent requests never shared a step"
    assert served.stats()["max_running"] > 1


async def _stream_and_maybe_leave(
    http: httpx.AsyncClient, url: str, body: dict, leave_after: int | None
) -> str:
    """Stream a completion; with ``leave_after``, close the connection after that many events."""
    text, events = "", 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
            events += 1
            if leave_after is not None and events >= leave_after:
                return text  # leaving the block closes the connection mid-stream
    return text


def counter(url: str, name: str, **labels: str) -> float:
    """A counter's value in /metrics, the sample with these labels (0 before its first increment)."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_disconnected_stream_is_aborted_at_once(served):
    """A client that leaves mid-stream frees its blocks right away, not after its 400 tokens."""
    body = {
        "model": "demo",
        "prompt": PROMPTS[0],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            await _stream_and_maybe_leave(http, served.url, body, leave_after=3)

    def aborts_and_tokens() -> tuple[float, float]:
        return (
            counter(served.url, "vllm:request_success_total", finished_reason="abort"),
            counter(served.url, "vllm:generation_tokens_total"),
        )

    aborts, tokens = aborts_and_tokens()
    asyncio.run(main())
    s = wait_idle(served)
    assert (s["running"], s["kv_blocks_used"]) == (0, 0)
    # "at once" in tokens, not seconds (a loaded machine is slow): aborted before its 400 tokens
    after, tokens_after = aborts_and_tokens()
    assert after == aborts + 1 and tokens_after - tokens < 400
    # a non-streaming request whose client gives up is aborted too (the handler watches for the disconnect)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{served.url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    s = wait_idle(served)
    assert (s["running"], s["kv_blocks_used"]) == (0, 0)
    last, tokens_last = aborts_and_tokens()
    assert last == after + 1 and tokens_last - tokens_after < 400


def test_200_requests_with_a_fifth_disconnecting_leave_no_blocks(served):
    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=250)) as http:
            jobs = []
            for i in range(200):
                leave = i % 5 == 0
                body = {
                    "model": "demo",
                    "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}",
                    "temperature": 0.8,
                    "seed": i,
                    "max_tokens": 200 if leave else 8,
                    "ignore_eos": leave,
                    "stream": True,
                }
                jobs.append(_stream_and_maybe_leave(http, served.url, body, 2 if leave else None))
            return await asyncio.gather(*jobs)

    texts = asyncio.run(main())
    assert sum(1 for t in texts if t) >= 160
    s = wait_idle(served)
    assert (s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0)
    assert httpx.get(f"{served.url}/health").status_code == 200


# ---------------------------------------------------------------------------------------------------------
# Bad input: OpenAI's error body, the field named, and nothing reaches the engine
# ---------------------------------------------------------------------------------------------------------

C, H = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
LONG = "word " * 600  # > 512 tokens
BAD = [
    # (id, path, body (dict, or raw bytes), status, param, code)
    ("temperature>2", C, {"prompt": "x", "temperature": 3}, 400, "temperature", "invalid_value"),
    ("temperature<0", C, {"prompt": "x", "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ("top_p<0", C, {"prompt": "x", "top_p": -0.1}, 400, "top_p", "invalid_value"),
    ("top_p>1", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("n=0", C, {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("n=129", C, {"prompt": "x", "n": 129}, 400, "n", "invalid_value"),
    ("logprobs=6", C, {"prompt": "x", "logprobs": 6}, 400, "logprobs", "invalid_value"),
    ("logprobs<0", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", "invalid_value"),
    ("max_tokens=0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens str", C, {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens", "invalid_type"),
    ("presence>2", C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ("frequency<-2", C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ("top_k<-1", C, {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("min_p>1", C, {"prompt": "x", "min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("repetition=0", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("seed str", C, {"prompt": "x", "seed": "1"}, 400, "seed", "invalid_type"),
    ("seed 2**64", C, {"prompt": "x", "seed": 2**64}, 400, "seed", "invalid_value"),
    ("stop x5", C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("stop empty", C, {"prompt": "x", "stop": ""}, 400, "stop", "invalid_value"),
    (
        "stop_token_ids<0",
        C,
        {"prompt": "x", "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    (
        "stop_token_ids vocab",
        C,
        {"prompt": "x", "stop_token_ids": [10**6]},
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    ("stream str", C, {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("ignore_eos int", C, {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos", "invalid_type"),
    ("prompt missing", C, {"max_tokens": 3}, 400, "prompt", "missing_required_parameter"),
    ("prompt empty", C, {"prompt": ""}, 400, "prompt", None),
    ("prompt []", C, {"prompt": []}, 400, "prompt", None),
    ("prompt [[]]", C, {"prompt": [[]]}, 400, "prompt", None),
    ("prompt bool", C, {"prompt": True}, 400, "prompt", None),
    ("prompt id<0", C, {"prompt": [1, -2]}, 400, "prompt", "invalid_value"),
    ("prompt id>=vocab", C, {"prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    ("prompt too long", C, {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    (
        "prompt+max_tokens",
        C,
        {"prompt": "word " * 100, "max_tokens": 500},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "stream_options alone",
        C,
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    ("echo+logprobs", C, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo", "unsupported_parameter"),
    ("logit_bias", C, {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
    ("malformed JSON", C, b'{"prompt": "x",', 400, None, "json_invalid"),
    ("empty body", C, b"", 400, "prompt", "missing_required_parameter"),
    ("empty chat body", H, b"", 400, "messages", "missing_required_parameter"),
    ("body not object", C, b'["x"]', 400, None, "invalid_type"),
    ("unknown model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("messages missing", H, {"max_tokens": 3}, 400, "messages", "missing_required_parameter"),
    ("messages []", H, {"messages": []}, 400, "messages", "invalid_value"),
    ("role", H, {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages[0].role", "invalid_value"),
    ("content int", H, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
    (
        "top_logprobs=6",
        H,
        {"messages": MSG, "logprobs": True, "top_logprobs": 6},
        400,
        "top_logprobs",
        "invalid_value",
    ),
    ("top_logprobs alone", H, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    ("logprobs str", H, {"messages": MSG, "logprobs": "true"}, 400, "logprobs", "invalid_type"),
    (
        "max_completion_tokens=0",
        H,
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        "chat too long",
        H,
        {"messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "chat+max_tokens",
        H,
        {"messages": MSG, "max_tokens": 600},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("tools", H, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", "unsupported_parameter"),
    ("chat unknown model", H, {"messages": MSG, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("unknown path", "/v1/embeddings", {"input": "x"}, 404, None, "not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_its_status_and_error_body(served, path, body, status, param, code):
    steps = served.bridge.stats.steps
    if isinstance(body, bytes):
        r = httpx.post(served.url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(served.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if code == "context_length_exceeded":  # the window and the prompt's length (and max_tokens, if given)
        assert "512" in error["message"] and re.search(
            r"prompt of \d+ tokens|\(\d+ in the prompt", error["message"]
        )
    elif param and status == 400:
        assert param.split("[")[0] in error["message"]
    assert served.bridge.stats.steps == steps, "a refused request reached the engine"


@pytest.mark.parametrize(
    "prompt, bad", [([-1], -1), ([8192], 8192), ([[5], [7, 10**6]], 10**6), ([3, -(2**40)], -(2**40))]
)
def test_every_token_id_out_of_range_is_named_with_the_vocabulary(served, prompt, bad):
    """An id below 0 gets the message an id past the vocabulary gets (the demo's 8192 tokens): the id and
    the range, param "prompt", before the engine sees the request."""
    steps = served.bridge.stats.steps
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "invalid_value")
    assert f"token id {bad} is out of range" in error["message"] and "(ids 0..8191)" in error["message"]
    assert served.bridge.stats.steps == steps


def test_context_error_is_the_python_apis_and_the_sdk_raises_bad_request(client, llm):
    """Prompt + max_tokens beyond the window: the server refuses with the Python API's rule and message
    (both numbers and the limit), and the SDK raises its BadRequestError."""
    prompt = "word " * 100
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=prompt, max_tokens=500)
    with pytest.raises(ValueError) as in_process:
        llm.generate(prompt, SamplingParams(max_tokens=500))
    n = len(llm.tokenizer.encode(prompt))
    assert (
        e.value.body["message"]
        == str(in_process.value)
        == (
            f"max_tokens=500: the request needs {n + 500} tokens ({n} in the prompt, 500 in the completion), "
            "more than max_model_len=512 (context window: 512 tokens)"
        )
    )
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"


def test_the_package_names_the_server(served):
    """api_server.py, the page and the command line are the same files in steps 6 to 9: the step's name
    comes from ``__package__`` (the app's title, the models' owned_by, the page's title, the CLI's prog)."""
    assert served.app.title == __package__
    assert httpx.get(f"{served.url}/v1/models").json()["data"][0]["owned_by"] == __package__
    page = httpx.get(f"{served.url}/").text
    assert "card.owned_by" in page and __package__ not in page
    assert make_parser().prog == f"python -m {__package__}"


def test_a_number_that_is_not_finite_is_refused_as_such(served):
    """Python's JSON reader takes NaN and Infinity: they get 400 saying the number must be finite (not that
    it is over a bound it does not compare with)."""
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}'):
        r = httpx.post(
            f"{served.url}/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        error = r.json()["error"]
        assert r.status_code == 400 and "finite" in error["message"], error


def test_method_not_allowed_and_body_too_large(served):
    r = httpx.get(f"{served.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "x" * (2 << 20)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


GET_ROUTES = ["/health", "/metrics", "/v1/models", "/v1/models/demo", "/v1/engine/stats", "/"]


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_answers_like_get_without_a_body(served, path):
    """Load-balancer probes send HEAD: every GET route answers it with GET's status and headers, no body."""
    got, head = httpx.get(served.url + path), httpx.head(served.url + path)
    assert head.status_code == got.status_code == 200
    assert head.content == b""
    assert head.headers.get("content-type") == got.headers.get("content-type")
    assert head.headers.get("content-length") == got.headers.get("content-length")


@pytest.mark.parametrize(
    "method,path,allowed",
    [
        ("GET", "/v1/completions", {"POST"}),
        ("PUT", "/v1/chat/completions", {"POST"}),
        ("POST", "/health", {"GET", "HEAD"}),
        ("DELETE", "/v1/models", {"GET", "HEAD"}),
        ("POST", "/", {"GET", "HEAD"}),
    ],
)
def test_every_405_carries_an_allow_header(served, method, path, allowed):
    r = httpx.request(method, served.url + path)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in r.headers["Allow"].split(",")} == allowed


def test_models_retrieve(client, served):
    """The SDK's models.retrieve: GET /v1/models/{model}; an unknown id is OpenAI's 404 model_not_found."""
    card = client.models.retrieve("demo")
    assert isinstance(card, Model) and card.id == "demo" and card.object == "model"
    listed = httpx.get(f"{served.url}/v1/models").json()["data"][0]
    assert httpx.get(f"{served.url}/v1/models/demo").json() == listed
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
    assert set(e.value.body) == {"message", "type", "param", "code"}


def test_a_json_body_without_a_json_content_type_is_read_as_json(served):
    """curl -d sends application/x-www-form-urlencoded; the body is still JSON, and is read as JSON."""
    body = {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    expected = httpx.post(f"{served.url}/v1/completions", json=body).json()["choices"][0]["text"]
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = httpx.post(f"{served.url}/v1/completions", content=json.dumps(body), headers=headers)
        assert r.status_code == 200, (content_type, r.text)
        assert r.json()["choices"][0]["text"] == expected
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(f"{served.url}/v1/completions", content="prompt=x&max_tokens=4", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    assert "application/x-www-form-urlencoded" in r.json()["error"]["message"]


def test_top_p_0_means_the_most_likely_token(client, llm):
    """top_p=0 is inside OpenAI's 0..1: the narrowest nucleus, the most likely token, i.e. greedy."""
    expected = greedy(llm, PROMPTS[1], 12)
    for seed in (1, 2):
        r = client.completions.create(
            model="demo", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0, seed=seed
        )
        assert r.choices[0].text == expected
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)  # the engine's own range stays (0, 1]: the server maps 0 at its entrance


# ---------------------------------------------------------------------------------------------------------
# 401, 429, 503: engines that stall or die (test doubles with the engine's interface)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_blocks: int = 1
    num_preemptions: int = 0
    num_batched_tokens: int = 0


class StalledEngine:
    """Accepts requests and never schedules them (they wait forever); or, with ``fail``, raises in step()."""

    def __init__(self, real: LLMEngine, fail: bool = False):
        self.tokenizer, self.config, self.max_model_len = real.tokenizer, real.config, real.max_model_len
        self.args = real.args
        self.check_length = real.check_length  # the entrance's rule for a request's length
        self.waiting: list[str] = []
        self.fail = fail

    def add_request(self, request_id, prompt, sampling_params=None):
        self.waiting.append(request_id)

    def abort_request(self, request_id):
        self.waiting = [r for r in self.waiting if r != request_id]

    def has_unfinished_requests(self):
        return bool(self.waiting)

    def step(self):
        if self.fail:
            raise RuntimeError("boom: the device fell off the bus")
        time.sleep(0.005)
        return []

    @property
    def stats(self):
        return _Stats(num_waiting_reqs=len(self.waiting))


def test_api_key_and_waiting_queue_limit(engine):
    app = build_app(StalledEngine(engine), "demo", api_key="s3cret", max_waiting_requests=2)
    body = {"model": "demo", "prompt": "x", "max_tokens": 4, "stream": True}
    with serve(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # open without a key, as vLLM
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models").status_code == 401
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert sdk.models.list().data[0].id == "demo"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()

        async def main():
            auth = {"Authorization": "Bearer s3cret"}
            async with httpx.AsyncClient(headers=auth, timeout=10) as http:
                async with (
                    http.stream("POST", f"{url}/v1/completions", json=body) as a,
                    http.stream("POST", f"{url}/v1/completions", json=body) as b,
                ):
                    assert a.status_code == b.status_code == 200
                    deadline = time.monotonic() + SAFETY_NET_S
                    while app.state.server.bridge.stats.num_waiting_reqs < 2:  # both in the engine now
                        assert time.monotonic() < deadline, "the two requests never reached the engine"
                        await asyncio.sleep(0.01)
                    r = await http.post(f"{url}/v1/completions", json=body)
                    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                    assert r.json()["error"]["type"] == "rate_limit_error"
                    assert (
                        "2 requests are waiting (at most 2); this one adds 1" in r.json()["error"]["message"]
                    )
                    assert (await http.get(f"{url}/v1/engine/stats")).json()["waiting"] == 2
                # both clients left: their requests are aborted, the queue has room again
                deadline = time.monotonic() + SAFETY_NET_S
                while (await http.get(f"{url}/v1/engine/stats")).json()["waiting"] != 0:
                    assert time.monotonic() < deadline, "the clients left, their requests still wait"
                    await asyncio.sleep(0.01)

        asyncio.run(main())


def test_the_queue_full_message_counts_in_words(engine):
    """One request waiting is "1 request is waiting", as "2 requests are waiting" is two."""
    bridge = AsyncEngine(StalledEngine(engine), max_waiting_requests=1)
    params = SamplingParams(max_tokens=1)

    async def main():
        bridge.start()
        bridge.submit([EngineRequest("a", [1], params)])
        deadline = time.monotonic() + SAFETY_NET_S
        while bridge.stats.num_waiting_reqs < 1:  # in the engine now
            assert time.monotonic() < deadline, "the request never reached the engine"
            await asyncio.sleep(0.01)
        with pytest.raises(QueueFullError) as e:
            bridge.submit([EngineRequest("b", [1], params)])
        assert str(e.value) == "1 request is waiting (at most 1); this one adds 1"

    try:
        asyncio.run(main())
    finally:
        bridge.shutdown()


def test_a_request_on_its_way_into_the_engine_still_counts_as_waiting(engine):
    """While the loop thread adds a request to the engine (out of the inbox, not yet in the engine's
    published figures), it still counts as waiting: the waiting limit holds at every moment."""
    entered, release = threading.Event(), threading.Event()

    class SlowToAdd(StalledEngine):
        def add_request(self, *args):
            entered.set()
            release.wait(SAFETY_NET_S)
            super().add_request(*args)

    bridge = AsyncEngine(SlowToAdd(engine), max_waiting_requests=1)
    params = SamplingParams(max_tokens=1)

    async def main():
        bridge.start()
        bridge.submit([EngineRequest("a", [1], params)])
        assert await asyncio.to_thread(entered.wait, SAFETY_NET_S)  # the loop is adding it now
        try:
            assert bridge.num_waiting() == 1
            with pytest.raises(QueueFullError):
                bridge.submit([EngineRequest("b", [1], params)])
        finally:
            release.set()

    try:
        asyncio.run(main())
    finally:
        bridge.shutdown()


def test_a_request_that_can_never_be_admitted_is_400_not_429(engine, served):
    """More engine requests (prompts x n) than the waiting limit can never be queued, however long the
    client waits: 400 naming the limit, not a retryable 429; 429 only when waiting for others helps."""
    app = build_app(StalledEngine(engine), "demo", max_waiting_requests=2)
    with serve(app) as url:
        for path, body, param in [
            ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
            ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
            ("/v1/completions", {"prompt": ["a", "b"], "n": 2}, "n"),
            ("/v1/chat/completions", {"messages": MSG, "n": 3}, "n"),
        ]:
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == "invalid_value"
            assert "max_waiting_requests" in error["message"] and "2" in error["message"]
        assert httpx.get(f"{url}/v1/engine/stats").json()["waiting"] == 0
    # the reported case, through the SDK that retries 429s: 3 prompts x n=128 on an idle server (limit 256)
    sdk = openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=2)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="demo", prompt=PROMPTS[:3], n=128, max_tokens=1)
    assert "384" in e.value.body["message"] and "256" in e.value.body["message"]
    with pytest.raises(ValueError, match="max_waiting_requests"):
        build_app(StalledEngine(engine), "demo", max_waiting_requests=0)


def test_a_dead_engine_loop_means_503(engine):
    app = build_app(StalledEngine(engine, fail=True), "demo")
    body = {"model": "demo", "prompt": "x", "max_tokens": 4}
    with serve(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # idle: nothing has stepped yet
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "boom" in error["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{url}/v1/engine/stats").json()["alive"] is False


# ---------------------------------------------------------------------------------------------------------
# Health, metrics, the page, the command line
# ---------------------------------------------------------------------------------------------------------


def test_a_fresh_server_reports_its_pool_and_features_before_any_request(demo_snapshot):
    """/v1/engine/stats (what the page shows) holds the KV-cache pool from the start, not 0 of 0 blocks, and
    how the engine runs (step 6: the device, dtype and attention backend)."""
    engine = LLMEngine(model=str(demo_snapshot), num_kv_blocks=7)
    app = build_app(engine, "demo")
    with serve(app) as url:
        stats = httpx.get(f"{url}/v1/engine/stats").json()
    assert (stats["kv_blocks_used"], stats["kv_blocks_total"], stats["kv_cache_usage"]) == (0, 7, 0.0)
    assert (stats["running"], stats["waiting"], stats["steps"]) == (0, 0, 0)
    assert stats["features"] == {"device": "cpu", "dtype": "float32", "attention_backend": "torch"}


def test_health_and_metrics(served, client):
    assert httpx.get(f"{served.url}/health").status_code == 200
    client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    text = httpx.get(f"{served.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
    ):
        assert re.search(rf'^{re.escape(name)}{{.*model_name="demo"', text, re.M), name
    assert re.search(
        r'^vllm:request_success_total\{finished_reason="(stop|length)",model_name="demo"\} [1-9]', text, re.M
    )
    tokens = float(
        re.search(r'^vllm:generation_tokens_total\{model_name="demo"\} (\S+)', text, re.M).group(1)
    )
    assert tokens >= 4


def test_web_page_streams_a_completion(served, llm):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    from playwright.sync_api import expect, sync_playwright

    expected = greedy(llm, "The Python interpreter", 24)
    expect.set_options(timeout=SAFETY_NET_S * 1000)  # expect() waits for the page to show it, up to this
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            page.set_default_timeout(SAFETY_NET_S * 1000)
            page.goto(served.url + "/")
            box = lambda selector: page.locator(selector).bounding_box()  # noqa: E731
            assert box("#stop")["y"] == box("#generate")["y"]  # the buttons stay side by side
            expect(page.locator("#running")).to_have_text(re.compile(r"^\d+$"))
            expect(page.locator("#features")).to_have_text(
                "device cpu, dtype float32, attention backend torch"
            )
            expect(page).to_have_title(f"{__package__}: GPT-2, streamed")  # from /v1/models' owned_by
            page.fill("#prompt", "The Python interpreter")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "24")
            page.evaluate(
                """() => {  // every status the page shows, in order
                    window.statuses = [];
                    new MutationObserver(() => window.statuses.push(document.getElementById("status")
                        .textContent)).observe(document.getElementById("status"), {childList: true});
                }"""
            )
            page.click("#generate")
            expect(page.locator("#status")).to_have_text("done")
            # "queued" until the first token arrives (the request waits, then is prefilled), then "streaming"
            assert page.evaluate("window.statuses") == ["queued", "streaming", "done"]
            assert page.locator("#completion").text_content() == expected
            assert page.evaluate("window.chunksReceived") > 1  # it arrived piece by piece
            expect(page.locator("#ttft")).to_have_text(re.compile(r"^\d+ ms$"))
            expect(page.locator("#tok-s")).to_have_text(re.compile(r"^\d+(\.\d)?$"))
            expect(page.locator("#kv-usage")).to_have_text(re.compile(r"^\d+\.\d % \(\d+ of \d+ blocks\)$"))
            expect(page.locator("#waiting")).to_have_text(re.compile(r"^\d+$"))
            expect(page.locator("#tokens")).to_have_text(re.compile(r"^[1-9]\d*$"))
            # a request refused before any token: the error, and no token count ("–", not "0")
            error = {
                "error": {"message": "refused here", "type": "BadRequestError", "param": None, "code": 400}
            }
            page.route("**/v1/completions", lambda route: route.fulfill(status=400, json=error))
            page.click("#generate")
            expect(page.locator("#status")).to_have_text("error")
            expect(page.locator("#error")).to_have_text("refused here")
            for figure in ("#ttft", "#tokens", "#tok-s"):
                expect(page.locator(figure)).to_have_text("–")
        finally:
            browser.close()


def _cli(*args: str, **kw) -> subprocess.Popen:
    root = Path(__file__).parent.parent  # the folder that holds this package
    return subprocess.Popen(
        [sys.executable, "-m", __package__, *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "70000"],
        ["--max-num-seqs", "0"],
        ["--bogus"],
        ["--dtype", "int3"],
        ["--max-waiting-requests", "-1"],
        ["--max-waiting-requests", "0"],  # limits that admit nothing
        ["--num-kv-blocks", "0"],
        ["--kv-cache-memory", "0"],
        ["--max-body-bytes", "10"],
    ],
)
def test_cli_bad_flags_one_line_exit_2(args, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_cli_help_shows_every_default(capsys):
    """Every flag's help says its default: argparse adds it, or the help says it where the default is None
    (resolved later, or unset); the engine's flags come from EngineArgs (config.py)."""
    parser = make_parser()
    formatter = parser.formatter_class(parser.prog)
    for action in parser._actions:
        assert action.dest == "help" or "default" in formatter._get_help_string(action), action.option_strings
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--device DEVICE [^-]*\(default: cpu\)", text), text
    assert re.search(r"--dtype \{bfloat16,float16,float32\} [^-]*\(default: float32\)", text), text
    assert "engine arguments (EngineArgs)" in text


def test_cli_a_port_in_use_is_reported_before_the_model_loads(run_main):
    """The port is bound first: a busy port is one line naming it, exit 2, before any model is read
    (the model given here does not exist: its error would come first otherwise). In this process: main
    returns before it serves (test_cli_bad_flag_as_a_process checks the exit status of the process)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status, _, err = run_main(cli_main, ["--model", "/nonexistent/model/folder", "--port", str(port)])
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert f"port {port}" in err and "in use" in err and "nonexistent" not in err


def test_a_client_that_connects_before_uvicorn_serves_waits_instead_of_being_refused():
    """The URL is printed before uvicorn's loop starts accepting: the bound socket already listens, so a
    client that connects in between is queued in the backlog (on a busy machine the gap is long enough to
    be hit: "connection refused" before the socket listened)."""
    with bind("127.0.0.1", 0) as sock:
        with socket.create_connection(sock.getsockname()[:2], timeout=SAFETY_NET_S):
            pass  # connected: no ConnectionRefusedError, with nobody accepting yet


def test_cli_bad_flag_as_a_process():
    proc = _cli("--port", "-1")
    _, err = proc.communicate(timeout=SAFETY_NET_S)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1


def test_cli_serves_then_quits_quietly_on_ctrl_c(demo_snapshot):
    proc = _cli("--model", str(demo_snapshot), "--port", "0", "--served-model-name", "tiny")
    try:
        first = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", first).group(0)
        assert proc.stdout.readline() == "engine: device cpu, dtype float32, attention backend torch\n"
        assert "curl" in proc.stdout.readline()
        deadline = time.monotonic() + SAFETY_NET_S
        while True:  # the lines come before uvicorn listens: wait until the port answers
            try:
                health = httpx.get(f"{url}/health", timeout=SAFETY_NET_S)
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server never answered"
                time.sleep(0.05)
        assert health.status_code == 200
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            timeout=SAFETY_NET_S,
        )
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        # h11 parses the request even where httptools is installed: an unknown method reaches the app (405)
        assert httpx.request("FOO", f"{url}/health", timeout=SAFETY_NET_S).status_code == 405
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=SAFETY_NET_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130)
    assert "Traceback" not in err


def test_sigterm_with_streams_open_ends_them_with_an_error_event(demo_snapshot):
    """A signal with streams open: the server stops accepting, ends each unfinished stream with an
    OpenAI-style error event and [DONE] (a running one and one queued behind it), aborts them in the
    engine (no KV block left in use), logs one line and exits 0, without a traceback."""
    proc = _cli(
        "--model",
        str(demo_snapshot),
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "1",  # the second stream waits behind the first
        "--timeout-graceful-shutdown",
        "0",  # no grace: end the open streams as soon as the signal arrives
    )
    body = {"model": "tiny", "prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline()).group(0)
        proc.stdout.readline()
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as running:
                running_events = (line for line in running.iter_lines() if line.startswith("data: "))
                first = next(running_events)  # a token has arrived: this request is running
                with http.stream("POST", "/v1/completions", json=body) as queued:
                    assert queued.status_code == 200  # submitted: waiting behind the running one
                    proc.send_signal(signal.SIGTERM)
                    queued_events = [line for line in queued.iter_lines() if line.startswith("data: ")]
                running_events = [first, *running_events]
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    for events in (running_events, queued_events):
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["type"] == "server_error" and error["code"] == "server_shutdown"
    assert (
        len(running_events) > 2 and json.loads(running_events[0][6:])["choices"][0]["finish_reason"] is None
    )
    assert len(queued_events) == 2  # it never ran: the error, then [DONE]
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Exception in ASGI" not in err, err
    logged = [line for line in err.splitlines() if "shut" in line]
    assert len(logged) == 1 and "2 open requests ended" in logged[0] and "0 KV blocks in use" in logged[0], (
        err
    )


def test_null_fields_take_their_defaults(served):
    """OpenAI's request fields are nullable: a client that sends null (as some do) gets the default."""
    nulls = {
        "n": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "temperature": None,
        "top_p": None,
        "stop": None,
        "seed": None,
        "logprobs": None,
        "stream": None,
        "echo": None,
        "user": None,
        "logit_bias": None,
    }
    body = {"model": "demo", "prompt": "The Python interpreter", "max_tokens": 4, "temperature": 0}
    base_url = served.url
    with_nulls = httpx.post(
        f"{base_url}/v1/completions", json={**nulls, **body, "temperature": 0}, timeout=60
    )
    plain = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert with_nulls.status_code == 200, with_nulls.text
    assert with_nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    default_length = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": None, "ignore_eos": True}, timeout=60
    )
    assert default_length.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens

"""Step 6 soak test: 1,000 requests through a real server, a fifth of the clients leaving at random points.

uvicorn serves the app in a thread on a free 127.0.0.1 port (a client leaving is a real FIN or RST);
``max_num_seqs`` 4 and 8 KV blocks make a queue and preemptions; 32 clients send at once. The seeded plan:
completions and chat, streamed and whole, n of 1 to 3, 4 to 12 tokens, greedy or seeded; a fifth leave
(mid-body, before the answer, after the headers, mid-stream, during a whole answer). Afterwards nothing
runs, waits or holds a KV block; every completed response equals its solo ``LLM`` output (a partial
stream is a prefix of it); no 500, error event or error log; the server still answers. Run it with
``pytest -m slow step6_server -k soak``. Waits are bounded (a hang fails), never asserted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch
import uvicorn

from .api_server import build_app
from .engine import LLMEngine
from .llm import LLM
from .protocol import ChatMessage
from .sampling_params import SamplingParams
from .serving_chat import CHAT_STOP, render_chat

SEED = 20250618  # the plan's random seed
NUM_REQUESTS = 1000
NUM_CLIENTS = 32
MAX_NUM_SEQS = 4  # small: most of the 32 clients' engine requests wait in the queue
NUM_KV_BLOCKS = 8  # 128 token slots for 4 sequences of up to 3 blocks each: some are preempted
LEAVE_FRACTION = 0.2
SAMPLED_FRACTION = 0.05  # seeded sampling (temperature 0.8); the rest is greedy
STALL_S = 120  # no request ending for this long is a hang (a safety net: under load the soak only slows)

PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "x",
    "Modules can import other modules.",
    "A dictionary maps keys to values. Keys must be hashable",
    "The for statement iterates over",
    "def main():",
    "Strings are immutable sequences of",
    "import os",
]
CHATS = [
    [{"role": "user", "content": "What is a list comprehension?"}],
    [
        {"role": "system", "content": "You answer questions about Python."},
        {"role": "user", "content": "How do I open a file?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is a tuple?"},
    ],
    [{"role": "user", "content": "Explain exceptions."}],
]
MAX_TOKENS = (4, 8, 12)
SAMPLED = dict(prompts=PROMPTS[:2], chats=CHATS[:1], seeds=(100, 200), max_tokens=8, temperature=0.8)
LEAVES = ("mid_body", "before_answer", "before_first_token", "mid_stream", "mid_whole")


# ---------------------------------------------------------------------------------------------------------
# The plan: what each of the 1,000 requests asks, and whether (and where) its client leaves
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One HTTP request of the soak.

    prompts: a completion's prompt texts (1 or 2), or a chat's rendered transcript (the oracle's prompt).
    seed: None for greedy (temperature 0); else sampled at SAMPLED's temperature, choice i with seed + i.
    leave: None (read the whole answer) or one of LEAVES; leave_after: events read before leaving
    (mid_stream); leave_delay_s: how long a whole answer is waited for before leaving (mid_whole);
    reset: leave with a TCP reset (SO_LINGER 0) instead of a plain close (the leaves on a plain socket).
    """

    chat: bool
    stream: bool
    prompts: tuple[str, ...]
    messages: tuple[dict, ...] | None
    n: int
    max_tokens: int
    seed: int | None
    leave: str | None
    leave_after: int = 0
    leave_delay_s: float = 0.0
    reset: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self) -> dict:
        body: dict = {"model": "demo", "n": self.n, "stream": self.stream}
        if self.seed is None:
            body["temperature"] = 0
        else:
            body.update(temperature=SAMPLED["temperature"], seed=self.seed)
        if self.chat:
            body["messages"] = list(self.messages)
            body["max_completion_tokens" if self.n % 2 else "max_tokens"] = self.max_tokens
        else:
            body["prompt"] = self.prompts[0] if len(self.prompts) == 1 else list(self.prompts)
            body["max_tokens"] = self.max_tokens
        if self.stream and self.n > 1:
            body["stream_options"] = {"include_usage": True}
        return body

    def keys(self) -> dict[int, tuple]:
        """Choice index -> the oracle's key (prompt, max_tokens, seed, chat): choice = prompt * n + i."""
        return {
            p * self.n + i: (prompt, self.max_tokens, None if self.seed is None else self.seed + i, self.chat)
            for p, prompt in enumerate(self.prompts)
            for i in range(self.n)
        }


def make_plan(rng: random.Random) -> list[Planned]:
    """NUM_REQUESTS requests drawn from ``rng``: 30 % chat, 5 % sampled, LEAVE_FRACTION leaving."""
    plan = []
    for _ in range(NUM_REQUESTS):
        chat = rng.random() < 0.3
        sampled = rng.random() < SAMPLED_FRACTION
        leave = rng.choice(LEAVES) if rng.random() < LEAVE_FRACTION else None
        if leave in ("before_first_token", "mid_stream"):
            stream = True
        elif leave == "mid_whole":
            stream = False
        else:
            stream = rng.random() < 0.5
        if chat:
            messages = rng.choice(SAMPLED["chats"] if sampled else CHATS)
            prompts = (render_chat([ChatMessage(**m) for m in messages]),)
        else:
            messages = None
            pool = SAMPLED["prompts"] if sampled else PROMPTS
            prompts = tuple(rng.sample(pool, 2)) if rng.random() < 0.1 else (rng.choice(pool),)
        plan.append(
            Planned(
                chat=chat,
                stream=stream,
                prompts=prompts,
                messages=None if messages is None else tuple(messages),
                n=rng.randint(1, 3),
                max_tokens=SAMPLED["max_tokens"] if sampled else rng.choice(MAX_TOKENS),
                seed=rng.choice(SAMPLED["seeds"]) if sampled else None,
                leave=leave,
                leave_after=rng.randint(1, 4),
                leave_delay_s=rng.uniform(0.0, 0.3),
                reset=rng.random() < 0.5,
            )
        )
    return plan


@dataclass
class Solo:
    text: str
    finish_reason: str
    num_tokens: int


def solo_outputs(llm: LLM, keys: set[tuple]) -> dict[tuple, Solo]:
    """Each distinct request alone through the in-process engine, once."""
    out = {}
    for key in sorted(keys, key=repr):
        prompt, max_tokens, seed, chat = key
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if seed is None else SAMPLED["temperature"],
            seed=seed,
            stop=[CHAT_STOP] if chat else [],
        )
        c = llm.generate([prompt], params)[0].outputs[0]
        out[key] = Solo(c.text, c.finish_reason, len(c.token_ids))
    return out


# ---------------------------------------------------------------------------------------------------------
# The clients
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a client got. texts/finish: per choice index; done: the whole answer arrived (a 200 body, or
    a stream through ``[DONE]``); errors: error bodies or events; answered: a leaving client had already
    received bytes of the answer when it left."""

    status: int | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    done: bool = False
    errors: list = field(default_factory=list)
    answered: bool = False


def _read_event(outcome: Outcome, data: dict, chat: bool) -> None:
    """Add one SSE event's JSON (a chunk, the usage chunk, or an error) to ``outcome``."""
    if "error" in data:
        outcome.errors.append(data["error"])
        return
    for c in data["choices"]:
        piece = (c["delta"].get("content") or "") if chat else c["text"]
        outcome.texts[c["index"]] = outcome.texts.get(c["index"], "") + piece
        outcome.finish[c["index"]] = c["finish_reason"]
    if data.get("usage"):
        outcome.completion_tokens = data["usage"]["completion_tokens"]


async def request_whole(http: httpx.AsyncClient, p: Planned) -> Outcome:
    r = await http.post(p.path, json=p.body())
    outcome = Outcome(status=r.status_code)
    data = r.json()
    if r.status_code != 200:
        outcome.errors.append(data)
        return outcome
    for c in data["choices"]:
        outcome.texts[c["index"]] = c["message"]["content"] if p.chat else c["text"]
        outcome.finish[c["index"]] = c["finish_reason"]
    outcome.completion_tokens = data["usage"]["completion_tokens"]
    outcome.done = True
    return outcome


async def request_streamed(http: httpx.AsyncClient, p: Planned, leave_after: int | None = None) -> Outcome:
    """Stream the answer; with ``leave_after``, close the connection after that many events."""
    outcome, events = Outcome(), 0
    async with http.stream("POST", p.path, json=p.body()) as r:
        outcome.status = r.status_code
        if r.status_code != 200:
            outcome.errors.append(json.loads(await r.aread()))
            return outcome
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                break
            _read_event(outcome, json.loads(line[6:]), p.chat)
            events += 1
            if leave_after is not None and events >= leave_after:
                outcome.answered = True
                return outcome  # leaving the block closes the connection in mid-stream
    return outcome


async def leave_raw(port: int, p: Planned) -> Outcome:
    """Send the request on a plain socket and leave: half-way through the body (mid_body), once it is sent
    (before_answer), after the response's headers (before_first_token), or after ``leave_delay_s`` unless
    the answer came first (mid_whole)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(p.body()).encode()
    head = (
        f"POST {p.path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    outcome = Outcome()
    try:
        writer.write(head.encode() + (body[: len(body) // 2] if p.leave == "mid_body" else body))
        await writer.drain()
        if p.leave == "before_first_token":
            received = await reader.readuntil(b"\r\n\r\n")
            outcome.status = int(received.split()[1])
            outcome.answered = True
        elif p.leave == "mid_whole":
            with contextlib.suppress(TimeoutError):
                outcome.answered = bool(await asyncio.wait_for(reader.read(1), p.leave_delay_s))
    finally:
        if p.reset:  # SO_LINGER 0: close() sends a TCP reset, not a FIN
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return outcome


async def run_one(http: httpx.AsyncClient, port: int, p: Planned) -> Outcome:
    if p.leave == "mid_stream":
        return await request_streamed(http, p, leave_after=p.leave_after)
    if p.leave is not None:
        return await leave_raw(port, p)
    return await (request_streamed(http, p) if p.stream else request_whole(http, p))


async def soak(url: str, port: int, plan: list[Planned], bridge) -> tuple[list[Outcome], int]:
    """The plan through NUM_CLIENTS concurrent clients; returns the outcomes (in plan order) and the most
    requests seen waiting at once. Raises AssertionError if no request ends for STALL_S seconds (a hang:
    under load the soak slows down, it does not stop)."""
    todo = list(enumerate(plan))[::-1]
    outcomes: list[Outcome | None] = [None] * len(plan)
    most_waiting, last_end = 0, time.monotonic()
    done = asyncio.Event()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal last_end
        while todo:
            i, p = todo.pop()
            outcomes[i] = await run_one(http, port, p)
            last_end = time.monotonic()

    async def watch() -> None:
        nonlocal most_waiting
        while not done.is_set():
            most_waiting = max(most_waiting, bridge.num_waiting())
            if time.monotonic() - last_end > STALL_S:
                left = sum(o is None for o in outcomes)
                raise AssertionError(f"no request ended in {STALL_S} s, {left} not done: {bridge.stats}")
            await asyncio.sleep(0.02)

    limits = httpx.Limits(max_connections=2 * NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        clients = asyncio.gather(*(client(http) for _ in range(NUM_CLIENTS)))
        watcher = asyncio.create_task(watch())
        await asyncio.wait({clients, watcher}, return_when=asyncio.FIRST_COMPLETED)
        done.set()
        if watcher.done():  # it only ends early by raising: the soak stalled
            clients.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await clients
        await watcher
        await clients
    return outcomes, most_waiting


# ---------------------------------------------------------------------------------------------------------
# The server, and what it says about itself
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve_in_thread(app):
    """uvicorn in a thread on a free 127.0.0.1 port; yields (its uvicorn.Server, base URL, port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # safety net
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield server, f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


LOGGERS = ("uvicorn.error", "asyncio")  # an exception in the app; a task's exception never retrieved


class Records(logging.Handler):
    """Collects the log records of a logger (uvicorn logs an exception in the app as an error)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text: ``name{labels..., model_name="demo"} value`` (0 if absent)."""
    wanted = {**labels, "model_name": "demo"}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == wanted:
            return float(m.group(2))
    return 0.0


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` has passed (False): a safety net against
    a hang, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------------------------------------
# The soak
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the soak (the server's engine loop and the oracle), restored after: on 2
    shared cores, two OpenMP threads that spin-wait for each other make a step far slower under load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.slow
def test_soak_1000_requests_a_fifth_leaving_no_leak_and_solo_outputs(demo_snapshot, one_torch_thread):
    plan = make_plan(random.Random(SEED))
    llm = LLM(model=str(demo_snapshot))
    solo = solo_outputs(llm, {k for p in plan for k in p.keys().values()})
    engine = LLMEngine(model=str(demo_snapshot), max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=NUM_KV_BLOCKS)
    app = build_app(engine, "demo")
    bridge = app.state.server.bridge
    logged = Records()
    try:
        with serve_in_thread(app) as (server, url, port):
            for name in LOGGERS:  # after uvicorn's Config, which configures (and clears) its loggers
                logging.getLogger(name).addHandler(logged)
            started = time.monotonic()
            outcomes, most_waiting = asyncio.run(soak(url, port, plan, bridge))
            duration = time.monotonic() - started
            # every HTTP request's handler has returned (a leaving client's aborts are in the inbox) ...
            assert wait_until(lambda: not server.server_state.tasks), "a request's handler never returned"
            # ... and the engine loop has applied them (if it never does, the asserts below show what is left)
            stats_url = f"{url}/v1/engine/stats"
            idle = (0, 0, 0)
            wait_until(
                lambda: (
                    tuple(httpx.get(stats_url).json()[k] for k in ("running", "waiting", "kv_blocks_used"))
                    == idle
                )
            )
            stats = httpx.get(stats_url).json()
            text = httpx.get(f"{url}/metrics").text
            healthy = httpx.get(f"{url}/health").status_code
            after = httpx.post(
                f"{url}/v1/completions",
                json={"model": "demo", "prompt": PROMPTS[0], "n": 2, "max_tokens": 8, "temperature": 0},
                timeout=60,
            )
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(logged)

    leaving = [(p, o) for p, o in zip(plan, outcomes) if p.leave]
    staying = [(p, o) for p, o in zip(plan, outcomes) if not p.leave]
    finished = sum(metric(text, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length"))
    aborted = metric(text, "vllm:request_success_total", finished_reason="abort")
    scheduled = metric(text, "vllm:request_queue_time_seconds_count")  # engine requests that ran a step
    print(
        f"\nsoak: {len(plan)} requests ({sum(p.n * len(p.prompts) for p in plan)} engine requests) in "
        f"{duration:.0f} s; {len(leaving)} clients left "
        f"({', '.join(f'{k} {sum(p.leave == k for p, _ in leaving)}' for k in LEAVES)}); "
        f"{aborted:.0f} engine requests aborted, {aborted + finished - scheduled:.0f} of them while queued; "
        f"at most {most_waiting} waiting; {stats['steps']} steps, {stats['num_preemptions']} preemptions; "
        f"{len(solo)} solo outputs"
    )

    # nothing runs, waits or holds a block: the engine's figures and the metrics
    assert (stats["running"], stats["waiting"], stats["kv_blocks_used"]) == idle
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:num_requests_waiting") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    # ... and the engine itself, once its loop has stopped: every block free, once, and nobody owns one
    assert engine.requests == {} and not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.block_tables == {}
    assert sorted(engine.block_manager.free_blocks) == list(range(engine.block_manager.num_blocks))

    # a queue formed and clients left it: engine requests aborted before their first step
    assert most_waiting > 0
    assert aborted + finished - scheduled > 0, "no request was aborted while queued"

    # every client that stayed got a 200 and its whole answer, each choice equal to its solo output
    for p, o in staying:
        assert o.status == 200 and o.done and not o.errors, (p, o)
        expected = {i: solo[key] for i, key in p.keys().items()}
        assert o.texts == {i: s.text for i, s in expected.items()}, p
        assert o.finish == {i: s.finish_reason for i, s in expected.items()}, p
        if o.completion_tokens is not None:
            assert o.completion_tokens == sum(s.num_tokens for s in expected.values()), p
    # what a leaving client read before it left is correct too: a prefix of its solo output, no errors
    for p, o in leaving:
        assert not o.errors and o.status in (None, 200), (p, o)
        for i, text in o.texts.items():
            assert solo[p.keys()[i]].text.startswith(text), (p, o)
    assert any(o.answered for p, o in leaving if p.leave == "mid_stream")

    # no 500 anywhere, nothing logged, and the server still serves
    assert not logged.records, [r.getMessage() for r in logged.records]
    assert healthy == 200
    assert after.status_code == 200
    assert [c["text"] for c in after.json()["choices"]] == [solo_text(llm, PROMPTS[0], 8)] * 2


def solo_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0].text

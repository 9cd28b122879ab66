"""Step 14 tests: several engine cores and several frontends give step 13's outputs, and every fault ends
cleanly.

The oracle is step 13's engine, in process. Through ``LLM(data_parallel_size=2)``: greedy and seeded
outputs, stop strings, n choices, logprobs, prefix hits, aborts, the stats of both cores; requests spread
over the cores by ``waiting * 4 + running``. Through the command line with two frontends and two cores:
the same answers from either frontend, the metrics of both cores summed over both frontends, both cores in
``/v1/engine/stats``. Faults, as processes: a core killed (its stream ends with an error event and
``[DONE]``, every process exits, exit 1), a frontend killed, SIGTERM, a port in use. Waits poll for the
event with a generous bound (``SAFETY_NET_S``), never a fixed sleep.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import step13_chunked_prefill

from .config import EngineArgs
from .launcher import Addresses
from .llm import LLM
from .messages import SchedulerStats, merge_stats
from .sampling_params import SamplingParams

SAFETY_NET_S = 300  # the bound of every wait for an event: a net against a hang, never a measure of speed
ENGINE_ARGS = dict(block_size=4, max_num_seqs=8)
PROMPTS = [
    "The Python interpreter",
    "A list comprehension is",
    "Exceptions are raised when an error occurs.",
    "x",
    "Modules can import other modules.",
]
CASES = [
    (PROMPTS[0], dict(max_tokens=24, temperature=0)),
    (PROMPTS[1], dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7)),
    (PROMPTS[2], dict(max_tokens=40, temperature=0, stop=["during", " raised"])),
    (PROMPTS[0], dict(max_tokens=40, temperature=0, stop=[" interpreter."])),  # spans two tokens
    (PROMPTS[3], dict(max_tokens=20, temperature=0, stop_token_ids=[87, 198])),
    (PROMPTS[4], dict(n=3, max_tokens=12, temperature=1.0, seed=3)),
    (PROMPTS[1], dict(max_tokens=8, temperature=0, logprobs=2)),
    (PROMPTS[2], dict(max_tokens=16, temperature=0.7, repetition_penalty=1.3, seed=1)),
]


def as_tuples(outputs) -> list:
    """Every field of every choice; logprobs within 1e-4 nats (each core runs torch on one thread)."""

    def logprobs(c):
        return c.logprobs and [
            {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in entry.items()} for entry in c.logprobs
        ]

    return [
        [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, logprobs(c)) for c in out.outputs]
        for out in outputs
    ]


@pytest.fixture(scope="module")
def oracle(demo_snapshot):
    return step13_chunked_prefill.LLM(model=str(demo_snapshot), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def llm(demo_snapshot):
    llm = LLM(model=str(demo_snapshot), data_parallel_size=2, **ENGINE_ARGS)
    yield llm
    llm.engine_core.shutdown()


def run(llm_or_oracle, module, cases=CASES):
    prompts, fields = zip(*cases)
    return llm_or_oracle.generate(list(prompts), [module.SamplingParams(**f) for f in fields])


# ---------------------------------------------------------------------------------------------------------
# LLM over two cores
# ---------------------------------------------------------------------------------------------------------


def test_two_cores_give_step13s_outputs_and_share_the_requests(llm, oracle):
    assert as_tuples(run(llm, sys.modules[__package__])) == as_tuples(run(oracle, step13_chunked_prefill))
    # the requests were spread: both cores prefilled some (each core's own counters)
    sent = llm.engine_core.sent
    assert len(sent) == 2 and min(sent) >= 3 and sum(sent) >= len(CASES)
    per_core = llm._stats
    assert all(s.prefix_cache_queries > 0 for s in per_core)
    assert llm.stats.prefix_cache_queries == sum(s.prefix_cache_queries for s in per_core)
    assert llm.stats.num_blocks == 2 * per_core[0].num_blocks and llm.stats.num_running_reqs == 0


def test_prefix_hits_and_streams_equal_step13(llm, oracle):
    """A prompt seen before hits the cache of the core that prefilled it, if it lands there: the outputs
    are step 13's either way; a stream closed early is aborted in its core (nothing runs after)."""
    shared = "Modules can import other modules. " * 4
    cases = [(shared + p, dict(max_tokens=6, temperature=0)) for p in PROMPTS]
    assert as_tuples(run(llm, sys.modules[__package__], cases)) == as_tuples(
        run(oracle, step13_chunked_prefill, cases)
    )
    assert llm.stats.prefix_cache_hits > 0
    stream = llm.stream_outputs(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    next(stream)
    stream.close()
    assert llm.stats.num_running_reqs == 0 and llm.stats.num_used_blocks == 0
    assert llm.engine_core.engine_of == {}


def test_the_least_loaded_core_gets_each_new_request(llm):
    """``waiting * 4 + running``, counting as waiting what was sent and not yet taken: with core 0 holding
    four requests, the next four go to core 1."""
    client = llm.engine_core
    before = list(client.sent)
    idle = merge_stats([client.stats_of[0]])
    client.stats_of = [
        SchedulerStats(**{**{f: getattr(idle, f) for f in idle.__struct_fields__}, "num_running_reqs": 4}),
        idle,
    ]
    client.taken = list(client.sent)
    assert [client.choose_engine() for _ in range(1)] == [1]
    client.sent[1] += 1  # one on its way to core 1: 4 vs 4 -> the lowest index
    assert client.choose_engine() == 0
    client.sent = before


def test_prefix_routing_sends_prompts_of_one_first_block_to_one_core(demo_snapshot, oracle, llm):
    """``dp_routing="prefix"``: after one prompt, six more with the same first block all go to its core (load
    routing spreads a batch: the first test), where the prefix cache holds it; the outputs are step 13's."""
    shared = "Modules can import other modules. " * 3
    prompts = [shared + x for x in "BCDEFG"]
    params = SamplingParams(max_tokens=4, temperature=0)
    oracle_params = step13_chunked_prefill.SamplingParams(max_tokens=4, temperature=0)
    expected = [o.outputs[0].text for o in oracle.generate(prompts, oracle_params)]
    routed = LLM(model=str(demo_snapshot), data_parallel_size=2, dp_routing="prefix", **ENGINE_ARGS)
    try:
        routed.generate([shared + "A"], params)
        assert [o.outputs[0].text for o in routed.generate(prompts, params)] == expected
        assert routed.engine_core.sent == [7, 0]
        shared_blocks = len(routed.get_tokenizer().encode(shared)) // ENGINE_ARGS["block_size"] - 1
        assert routed.stats.prefix_cache_hits >= 6 * shared_blocks * ENGINE_ARGS["block_size"]
    finally:
        routed.engine_core.shutdown()


def test_tcp_addresses_take_consecutive_ports():
    a = Addresses("/unused", ("10.0.0.1", 5000), num_clients=2, num_engines=3)
    assert [a.output(0), a.input(0, 0), a.input(0, 2), a.output(1), a.input(1, 0)] == [
        "tcp://10.0.0.1:5000",
        "tcp://10.0.0.1:5001",
        "tcp://10.0.0.1:5003",
        "tcp://10.0.0.1:5004",
        "tcp://10.0.0.1:5005",
    ]
    assert (a.loads, a.publish) == ("tcp://10.0.0.1:5008", "tcp://10.0.0.1:5009")
    assert Addresses("/run/x").output(0) == "ipc:///run/x/output-0"


def test_the_coordinator_publishes_every_cores_latest_stats(tmp_path):
    """Two cores' stats in, one publication of both out, the newest of each; a frontend that subscribes
    late gets them within a heartbeat."""
    import zmq

    from .coordinator import HEARTBEAT_S
    from .messages import EngineCoreLoad, loads_decoder, output_encoder

    a = Addresses(str(tmp_path), num_engines=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", f"{__package__}.coordinator", "--loads", a.loads, "--publish", a.publish]
        + ["--engines", "2", "--parent-pid", str(os.getpid()), "--socket-dir", str(tmp_path)],
        cwd=Path(__file__).parent.parent,
    )
    context = zmq.Context()
    try:
        push, sub = context.socket(zmq.PUSH), context.socket(zmq.SUB)
        push.connect(a.loads)
        idle = SchedulerStats(0, 0, 0.0, 0, 10, 0, 0, 0, 0, 0, 0, 0, 0)
        for engine, running in ((0, 1), (1, 2), (0, 3)):
            push.send(
                output_encoder().encode(
                    EngineCoreLoad(
                        engine,
                        SchedulerStats(
                            **{
                                **{f: getattr(idle, f) for f in idle.__struct_fields__},
                                "num_running_reqs": running,
                            }
                        ),
                    )
                )
            )
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(a.publish)  # after the loads: only the heartbeat can reach it
        seen = []  # publications until one holds both cores' newest (an earlier one may hold fewer)
        while not seen or seen[-1] != [3, 2]:
            assert sub.poll(int(1000 * (SAFETY_NET_S + HEARTBEAT_S))), seen
            published = loads_decoder().decode(sub.recv())
            seen.append([s and s.num_running_reqs for s in published.stats])
        assert all(s in ([1, None], [3, None], [1, 2], [3, 2]) for s in seen), seen
    finally:
        context.destroy(linger=0)
        proc.terminate()
        assert proc.wait(SAFETY_NET_S) == 0


def test_data_parallel_arguments_are_checked(demo_snapshot):
    with pytest.raises(ValueError, match="data_parallel_size=2: .* multiprocessing=True"):
        EngineArgs(model=str(demo_snapshot), data_parallel_size=2, multiprocessing=False)
    with pytest.raises(ValueError, match="data_parallel_size=0: must be an integer >= 1"):
        EngineArgs(model=str(demo_snapshot), data_parallel_size=0)
    args = EngineArgs(model=str(demo_snapshot), data_parallel_size=3)
    assert args.multiprocessing is True and [args.core_device(i) for i in range(3)] == ["cpu"] * 3


def test_merged_stats_add_counts_and_weigh_the_usage_by_blocks():
    def stats(used, blocks, per_pos):
        return SchedulerStats(1, 2, used / blocks, used, blocks, 0, 3, 1, 5, 5, 10, 4, 2, 1, 2, 1, per_pos, 0)

    merged = merge_stats([stats(10, 100, [1, 2]), stats(30, 300, [5])])
    assert (merged.num_running_reqs, merged.num_waiting_reqs, merged.num_used_blocks) == (2, 4, 40)
    assert merged.kv_cache_usage == pytest.approx(40 / 400)
    assert merged.spec_decode_num_accepted_tokens_per_pos == [6, 2] and merged.num_steps == 10


# ---------------------------------------------------------------------------------------------------------
# The command line: two frontends, two cores, one port
# ---------------------------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    """Whether a process has exited (a zombie nobody reaped counts as exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY_NET_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Cli:
    """``python -m step14_data_parallel`` as a process: its cores' and frontends' pids, its socket
    directory, its URL."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __package__, "--port", "0", *args],
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def start(self, launched: bool) -> Cli:
        """Read the start-up lines (a launcher, for several frontends or remote cores, adds the frontends'
        pids), then wait for /health."""
        lines = "".join(self.proc.stdout.readline() for _ in range(4 + launched))
        match = re.search(r"engine cores?: pid ([\d, ]+), sockets in (\S+)", lines)
        if match is None:
            self.proc.kill()
            assert match, lines + self.proc.stderr.read()
        self.core_pids = [int(p) for p in match.group(1).split(", ")]
        self.socket_dir = match.group(2)
        found = re.search(r"api servers: pid ([\d, ]+)", lines)
        self.frontend_pids = [int(p) for p in found.group(1).split(", ")] if found else [self.proc.pid]
        self.url = re.search(r"http://127\.0\.0\.1:\d+", lines).group(0)
        wait_until(self.answers, "the server never answered")
        return self

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=SAFETY_NET_S).status_code == 200
        except httpx.ConnectError:
            assert self.proc.poll() is None, self.proc.stderr.read()
            return False

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.core_pids, *self.frontend_pids]

    def stop(self) -> None:
        """SIGTERM to the parent (it removes its directories), then SIGKILL to whatever is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(SAFETY_NET_S)
        for pid in self.pids():
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(SAFETY_NET_S)


@pytest.fixture(scope="module")
def server(demo_snapshot):
    cli = Cli("--model", str(demo_snapshot), "--api-server-count", "2", "--data-parallel-size", "2")
    cli.start(launched=True)
    yield cli
    cli.stop()


def completion(url: str, prompt: str, **fields) -> dict:
    body = {"prompt": prompt, **fields}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=SAFETY_NET_S).json()


def test_two_frontends_and_two_cores_answer_as_step13(server, demo_snapshot):
    """Twenty requests at once over fresh connections (the kernel hands each to either frontend), every
    answer step 13's; both cores ran some, both frontends served some, and /metrics (from whichever
    frontend) sums both frontends' counts, by core."""
    oracle = step13_chunked_prefill.LLM(model=str(demo_snapshot))
    params = step13_chunked_prefill.SamplingParams(max_tokens=10, temperature=0)
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(20)]
    expected = [o.outputs[0].text for o in oracle.generate(prompts, params)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: completion(server.url, p, max_tokens=10, temperature=0), prompts))
    assert [a["choices"][0]["text"] for a in answers] == expected
    for fields in (
        dict(n=2, seed=5, temperature=1.0, max_tokens=8),
        dict(stop=[" the"], max_tokens=30, temperature=0),
    ):
        (want,) = oracle.generate([PROMPTS[1]], step13_chunked_prefill.SamplingParams(**fields))
        got = completion(server.url, PROMPTS[1], **fields)["choices"]
        assert [(c["text"], c["finish_reason"]) for c in got] == [
            (c.text, c.finish_reason) for c in want.outputs
        ]
    stats = httpx.get(f"{server.url}/v1/engine/stats", timeout=SAFETY_NET_S).json()
    assert [e["engine"] for e in stats["engines"]] == [0, 1]
    assert [e["pid"] for e in stats["engines"]] == server.core_pids
    metrics = httpx.get(f"{server.url}/metrics", timeout=SAFETY_NET_S).text
    success = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'vllm:request_success_total\{engine="(\d)",finished_reason="length".*\} (\S+)', metrics
        )
    }
    assert sum(success.values()) >= 20 and set(success) == {"0", "1"}, metrics
    assert re.search(
        r'vllm:cache_config_info\{block_size="16",engine="1",.*num_gpu_blocks="\d+"\} 1.0', metrics
    )
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{engine="1",model_name=' in metrics


def test_a_stop_string_and_an_abort_reach_the_core_that_holds_the_request(server):
    for _ in range(4):  # over both frontends and both cores
        body = {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0, "stop": [" raised"], "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=SAFETY_NET_S) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=SAFETY_NET_S) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))  # then disconnect

    def idle() -> bool:
        engines = httpx.get(f"{server.url}/v1/engine/stats", timeout=SAFETY_NET_S).json()["engines"]
        return all(e["num_running_reqs"] == 0 and e["num_used_blocks"] == 0 for e in engines)

    wait_until(idle, "a request left running in a core")


def test_the_page_shows_every_core(server):
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install chromium, or set CHROMIUM=/path/to/chrome)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=SAFETY_NET_S * 1000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            core = r"core {} \(cpu\): \d+ running, \d+ waiting, KV \d+\.\d %"
            expect(page.locator("#engines")).to_have_text(re.compile(f"^{core.format(0)}; {core.format(1)}$"))
        finally:
            browser.close()


@pytest.mark.slow
@pytest.mark.parametrize("frontends", [1, 2])
def test_a_core_killed_ends_the_streams_and_every_process(demo_snapshot, frontends):
    cli = Cli(
        "--model", str(demo_snapshot), "--data-parallel-size", "2", "--api-server-count", str(frontends)
    )
    cli.start(launched=frontends > 1)
    try:
        with contextlib.ExitStack() as streams:
            lines = []
            for _ in cli.core_pids:  # a stream on each core (the second goes to the idle one)
                http = streams.enter_context(httpx.Client(timeout=SAFETY_NET_S))
                body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
                r = streams.enter_context(http.stream("POST", f"{cli.url}/v1/completions", json=body))
                events = (line for line in r.iter_lines() if line.startswith("data: "))
                lines.append((events, next(events)))
            os.kill(cli.core_pids[1], signal.SIGKILL)
            ends = [[first, *events] for events, first in lines]
        _, err = cli.proc.communicate(timeout=SAFETY_NET_S)
        wait_until(lambda: all(gone(pid) for pid in cli.pids()), "a process outlived the server")
    finally:
        cli.stop()
    for end in ends:
        assert end[-1] == "data: [DONE]" and json.loads(end[-2][6:])["error"]["code"] == "engine_dead"
    assert cli.proc.returncode == 1 and "SIGKILL" in err, err
    assert not os.path.exists(cli.socket_dir)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill-frontend", "SIGTERM"])
def test_a_frontend_killed_or_a_signal_stops_every_process(demo_snapshot, how):
    """Two frontends over two cores (kill -9 of a frontend), or over one (SIGTERM): every process goes."""
    cores = "2" if how == "kill-frontend" else "1"
    cli = Cli("--model", str(demo_snapshot), "--data-parallel-size", cores, "--api-server-count", "2")
    cli.start(launched=True)
    try:
        if how == "SIGTERM":
            cli.proc.send_signal(signal.SIGTERM)
        else:
            os.kill(cli.frontend_pids[0], signal.SIGKILL)
        _, err = cli.proc.communicate(timeout=SAFETY_NET_S)
        wait_until(lambda: all(gone(pid) for pid in cli.pids()), "a process outlived the server")
    finally:
        cli.stop()
    assert cli.proc.returncode == (0 if how == "SIGTERM" else 1), err
    assert not os.path.exists(cli.socket_dir) and "Traceback" not in err, err


@pytest.mark.slow
def test_cores_that_cannot_start_say_why_once_and_exit_2(demo_snapshot):
    """Two frontends, two cores, a pool too large: each core tells each frontend; one line, exit 2."""
    proc = subprocess.run(
        [sys.executable, "-m", __package__, "--model", str(demo_snapshot), "--port", "0"]
        + ["--api-server-count", "2", "--data-parallel-size", "2", "--num-kv-blocks", str(10**9)],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=SAFETY_NET_S,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: num_kv_blocks=") and "the KV cache would need" in line, line


def test_a_port_in_use_is_one_line_and_exit_2(demo_snapshot):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = str(busy.getsockname()[1])
    try:
        proc = subprocess.run(
            [sys.executable, "-m", __package__, "--port", port, "--api-server-count", "2"],
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            timeout=SAFETY_NET_S,
        )
    finally:
        busy.close()
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports that are free on 127.0.0.1 now."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


@pytest.mark.slow
def test_a_headless_core_serves_the_frontends_over_tcp(demo_snapshot):
    """Core 0 with the frontend, core 1 started --headless: both take requests over tcp://127.0.0.1, the
    answers are step 13's; SIGTERM stops each side with exit 0."""
    port = str(free_ports(3))
    common = ["--model", str(demo_snapshot), "--data-parallel-size", "2", "--data-parallel-rpc-port", port]
    common += ["--api-server-count", "1"]  # the same on both sides: it says which ports are whose
    cli = Cli(*common, "--data-parallel-size-local", "1")
    headless = subprocess.Popen(
        [sys.executable, "-m", __package__, *common, "--headless", "--data-parallel-start-rank", "1"],
        cwd=Path(__file__).parent.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "waiting for 1 headless engine core" in cli.proc.stdout.readline()
        cli.start(launched=True)
        assert headless.stdout.readline().startswith("headless: engine cores [1] (pid ")
        oracle = step13_chunked_prefill.LLM(model=str(demo_snapshot))
        prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(12)]
        params = step13_chunked_prefill.SamplingParams(max_tokens=8, temperature=0)
        expected = [o.outputs[0].text for o in oracle.generate(prompts, params)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda p: completion(cli.url, p, max_tokens=8, temperature=0), prompts))
        assert [a["choices"][0]["text"] for a in answers] == expected
        engines = httpx.get(f"{cli.url}/v1/engine/stats", timeout=SAFETY_NET_S).json()["engines"]
        assert all(e["prefix_cache_queries"] > 0 for e in engines), engines
        cli.proc.send_signal(signal.SIGTERM)
        headless.send_signal(signal.SIGTERM)
        assert cli.proc.wait(SAFETY_NET_S) == 0 and headless.wait(SAFETY_NET_S) == 0
    finally:
        cli.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait()


def test_a_headless_core_that_reaches_no_frontend_says_so(demo_snapshot):
    port = free_ports(4)
    proc = subprocess.run(
        [sys.executable, "-m", __package__, "--model", str(demo_snapshot), "--headless"]
        + [
            "--data-parallel-size",
            "2",
            "--data-parallel-start-rank",
            "1",
            "--data-parallel-rpc-port",
            str(port),
        ]
        + ["--data-parallel-connect-timeout", "0.5"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=SAFETY_NET_S,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"error: no frontend answered at tcp://127.0.0.1:{port} within 0.5 s (Connection refused)"
    )


# ---- on a GPU: `pytest -m gpu step14_data_parallel` (skipped without CUDA) --------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_two_cores_on_one_device_give_step13s_ids(demo_snapshot, dtype="float32"):
    """Two cores on cuda:0 (each its own pool, CUDA graphs, async scheduling, Triton kernels): the greedy
    ids of step 13 on the same device, both cores used; a bare ``cuda`` with more cores than GPUs is
    refused, naming both numbers."""
    args = dict(model=str(demo_snapshot), dtype=dtype, block_size=16)
    prompts = [f"{PROMPTS[i % 5]} {i}" for i in range(16)]
    oracle = step13_chunked_prefill.LLM(device="cuda", **args)
    want = [
        o.outputs[0].token_ids
        for o in oracle.generate(prompts, step13_chunked_prefill.SamplingParams(max_tokens=32, temperature=0))
    ]
    del oracle
    llm = LLM(device="cuda:0", data_parallel_size=2, **args)
    try:
        got = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
        assert [o.outputs[0].token_ids for o in got] == want
        assert min(llm.engine_core.sent) > 0 and llm.stats.num_running_reqs == 0
    finally:
        llm.engine_core.shutdown()
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"data_parallel_size={too_many}: .* has {too_many - 1} CUDA"):
        EngineArgs(model=str(demo_snapshot), device="cuda", data_parallel_size=too_many)

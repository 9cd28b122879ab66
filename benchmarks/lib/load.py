"""Load for the serving benchmarks: a workload driven through an engine in this process, or through a server
over HTTP, with the same request records and figures (throughput, TTFT, ITL, latency percentiles).

``run_in_process`` steps an ``LLMEngine`` itself, ``run_http`` streams ``POST /v1/completions`` with httpx,
``ServerProcess`` starts ``python -m <step package>`` on a free loopback port, ``poisson`` draws arrival
times, ``summarise`` turns a run into its figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import harness, workloads

REPO = Path(__file__).resolve().parents[2]


def in_thread(fn, *args):
    """``fn(*args)`` in a fresh thread, as the server steps its engine in its engine-loop thread.

    On a CPU, torch ran the same steps up to 4x faster in a non-main thread than in the main thread of a
    busy 2-core machine (its intra-op thread pool behaves differently); driving both engines from a
    thread of their own keeps that difference out of the comparison.
    """
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError(f"{fn.__name__} failed (see the traceback above)")
    return out[0]


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of n requests: the first at 0, then exponential gaps of mean 1 / rate seconds."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ---- the two drivers: each returns {"wall_s", "steps", "requests": [records]} ------------------------------


def _record(
    r: workloads.Request, arrival: float, token_times: list[float], generated: int, text: str
) -> dict:
    return {
        "index": r.index,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": generated,
        "arrival_s": arrival,
        "first_token_s": token_times[0],
        "finished_s": token_times[-1],
        "itl_s": [b - a for a, b in zip(token_times, token_times[1:])],
        "text": text,
    }


def run_in_process(engine, module, requests, arrivals=None, concurrency=None) -> dict:
    """Drive the engine directly: requests join between steps when they arrive (``arrivals``, seconds) or,
    with ``concurrency``, as soon as fewer than that are in flight."""
    params = {
        r.index: module.SamplingParams(
            max_tokens=r.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=module.RequestOutputKind.DELTA,
        )
        for r in requests
    }
    pending = list(zip(requests, arrivals or [0.0] * len(requests)))
    by_id = {str(r.index): r for r in requests}
    arrived: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    texts: dict[str, list[str]] = {}
    in_flight, steps, records = 0, 0, []
    t0 = time.perf_counter()
    while pending or in_flight:
        now = time.perf_counter() - t0
        while pending and pending[0][1] <= now and (concurrency is None or in_flight < concurrency):
            r, at = pending.pop(0)
            engine.add_request(str(r.index), r.prompt_token_ids, params[r.index])
            arrived[str(r.index)] = at if arrivals else now
            in_flight += 1
        if not in_flight:
            time.sleep(max(0.0, t0 + pending[0][1] - time.perf_counter()))
            continue
        outs = engine.step()
        steps += 1
        now = time.perf_counter() - t0
        for o in outs:
            c = o.outputs[0]
            times.setdefault(o.request_id, []).append(now)
            counts[o.request_id] = counts.get(o.request_id, 0) + len(c.token_ids)
            texts.setdefault(o.request_id, []).append(c.text)
            if o.finished:
                in_flight -= 1
                records.append(
                    _record(
                        by_id[o.request_id],
                        arrived[o.request_id],
                        times[o.request_id],
                        counts[o.request_id],
                        "".join(texts[o.request_id]),
                    )
                )
    return {
        "wall_s": time.perf_counter() - t0,
        "steps": steps,
        "requests": sorted(records, key=lambda x: x["index"]),
    }


async def sse_lines(response):
    """The lines of a Server-Sent Events stream, split at LF (a CR before it dropped), as the SSE format
    splits them. Not httpx's ``aiter_lines``: it also splits at U+0085, U+2028 and U+2029, which a JSON
    string holds unescaped, so that a random model's text cut one event in two (a JSON error, on an H100)."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


async def run_http(url: str, requests, arrivals=None, concurrency=None) -> dict:
    """The same load over HTTP: one streaming request per workload request, Poisson-timed or ``concurrency``
    at a time; token times are the arrival times of the SSE events. ``steps``: the server's engine steps
    over the run (``/v1/engine/stats`` before and after)."""
    import httpx

    gate = asyncio.Semaphore(concurrency or len(requests))
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)

    async def one(http: httpx.AsyncClient, r, at: float, t0: float) -> dict:
        if arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with gate:
            sent = time.perf_counter() - t0
            body = {
                "prompt": r.prompt_token_ids,
                "max_tokens": r.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            token_times, generated, text = [], 0, []
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise ConnectionError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
                async for line in sse_lines(response):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise ConnectionError(event["error"]["message"])
                    if event["choices"]:
                        token_times.append(time.perf_counter() - t0)
                        text.append(event["choices"][0]["text"])
                    if event.get("usage"):
                        generated = event["usage"]["completion_tokens"]
        return _record(r, at if arrivals else sent, token_times, generated, "".join(text))

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        steps_before = (await http.get(f"{url}/v1/engine/stats")).json()["steps"]
        t0 = time.perf_counter()
        records = await asyncio.gather(
            *(one(http, r, at, t0) for r, at in zip(requests, arrivals or [0.0] * len(requests)))
        )
        wall = time.perf_counter() - t0
        steps = (await http.get(f"{url}/v1/engine/stats")).json()["steps"] - steps_before
    return {"wall_s": wall, "steps": steps, "t0": t0, "requests": sorted(records, key=lambda x: x["index"])}


def summarise(run: dict) -> dict:
    """One run's figures: throughput, requests/s, engine steps, TTFT / ITL / latency percentiles (seconds),
    and its request records (without their texts and token gaps)."""
    recs = run["requests"]
    generated = sum(r["generated_tokens"] for r in recs)
    ttft = [r["first_token_s"] - r["arrival_s"] for r in recs]
    itl = [x for r in recs for x in r["itl_s"]]
    latency = [r["finished_s"] - r["arrival_s"] for r in recs]
    figures = {
        "wall_s": run["wall_s"],
        "steps": run["steps"],
        "requests_served": len(recs),
        "generated_tokens": generated,
        "throughput_tok_s": generated / run["wall_s"],
        "requests_per_s": len(recs) / run["wall_s"],
    }
    for label, values in (("ttft", ttft), ("itl", itl), ("latency", latency)):
        for q in (50, 95, 99):
            figures[f"{label}_p{q}_s"] = harness.percentile(values, q)
    return {**figures, "requests": [{k: v for k, v in r.items() if k not in ("itl_s", "text")} for r in recs]}


class ServerProcess:
    """``python -m <package>`` (step 6's server or a later step's) on a free loopback port for the duration
    of a ``with`` block; yields its URL. ``extra``: more command-line flags. profile_to: run it under
    ``benchmarks.lib.profiled`` (cProfile, switched on and off by SIGUSR1 / SIGUSR2; ``proc`` is the
    process), the stats written to this file when it exits.

    Raises ConnectionError if the server does not start (its stderr in the message)."""

    def __init__(
        self,
        folder: Path,
        device: str,
        package: str = "step6_server",
        extra: tuple[str, ...] = (),
        max_num_seqs: int = 16,
        block_size: int = 16,
        profile_to: Path | None = None,
    ):
        self.package = package
        self.args = [
            sys.executable,
            "-m",
            *(("benchmarks.lib.profiled", str(profile_to)) if profile_to else ()),
            package,
            "--model",
            str(folder),
            "--device",
            device,
            "--port",
            "0",
            "--max-num-seqs",
            str(max_num_seqs),
            "--block-size",
            str(block_size),
            "--max-waiting-requests",
            "100000",
            *extra,  # later flags win: --max-num-seqs, --dtype, ...
        ]

    def __enter__(self) -> str:
        self.stderr = tempfile.TemporaryFile(
            mode="w+"
        )  # a file, not a pipe: a pipe nobody reads can fill and block
        self.proc = subprocess.Popen(
            self.args,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = (
            self.proc.stdout.readline()
        )  # "serving <model> on http://127.0.0.1:<port> ...", once it listens
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        if not found:
            self.proc.kill()
            self.proc.wait()
            self.stderr.seek(0)
            raise ConnectionError(f"{self.package} did not start: {line}{self.stderr.read()[-2000:]}")
        return found.group(0)

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()

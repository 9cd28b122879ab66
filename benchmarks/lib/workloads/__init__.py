"""The request workloads that the serving benchmarks share: committed JSON files, lengths only.

A workload is a list of requests, each a prompt length, a number of tokens to generate (``max_tokens``,
generated exactly: the benchmarks pass ``ignore_eos``) and an arrival time in seconds after the start.
Every benchmark, and every later step, reads the same file: ``mixed.json`` (64 requests at time 0,
lengths log-uniform, so that a static batch visibly wastes work) and ``staggered.json`` (its first 32
arriving as a Poisson process at 2 requests per second). Prompt token ids are not stored: ``requests()``
draws them from ``token_id_seed`` and the model's vocabulary size, so one file serves every vocabulary.
``python -m benchmarks.lib.workloads`` writes the files again from the seeded recipes below (the same bytes);
a test checks that the committed files equal them. Details: benchmarks/README.md ("Workloads").
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

FOLDER = Path(__file__).resolve().parent
NAMES = ("mixed", "staggered")

# The recipes of the committed files. Changing one changes what every benchmark measures: write the
# files again (python -m benchmarks.lib.workloads) and say so in the commit.
MIXED = {
    "num_requests": 64,
    "prompt_tokens": [8, 256],  # log-uniform, inclusive
    "max_tokens": [8, 128],  # log-uniform, inclusive
    "seed": 0,  # lengths
    "token_id_seed": 1000,  # prompt token ids: request i draws from torch.Generator().manual_seed(1000 + i)
}
# The first 32 mixed requests (half: each run waits for the arrivals, so it costs at least their span)
STAGGERED = {"requests_of": "mixed", "num_requests": 32, "arrival_rate_per_s": 2.0, "seed": 1}


@dataclass(frozen=True)
class Request:
    """One request of a workload, ready for an engine: ``index`` in the workload, the prompt's token ids,
    the tokens to generate (exactly: run with ``ignore_eos``) and the arrival time (s after the start)."""

    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def make(name: str) -> dict:
    """The workload ``name`` ("mixed" or "staggered") built from its recipe: what the JSON file holds.

    Raises ValueError on an unknown name.
    """
    if name == "mixed":
        rng = random.Random(MIXED["seed"])
        requests = []
        for _ in range(MIXED["num_requests"]):
            prompt = _log_uniform(rng, *MIXED["prompt_tokens"])
            requests.append({"prompt_tokens": prompt, "max_tokens": _log_uniform(rng, *MIXED["max_tokens"])})
        return {
            "name": "mixed",
            "description": "requests of widely spread lengths, all arriving at time 0",
            "recipe": {
                **MIXED,
                "distribution": "log-uniform: round(exp(uniform(ln lo, ln hi))), lengths drawn "
                "prompt then max_tokens per request from random.Random(seed)",
            },
            "token_id_seed": MIXED["token_id_seed"],
            "requests": [{"index": i, **r, "arrival_s": 0.0} for i, r in enumerate(requests)],
        }
    if name == "staggered":
        base = make(STAGGERED["requests_of"])
        rng = random.Random(STAGGERED["seed"])
        t = 0.0
        requests = []
        for r in base["requests"][: STAGGERED["num_requests"]]:
            requests.append({**r, "arrival_s": round(t, 4)})
            t += rng.expovariate(STAGGERED["arrival_rate_per_s"])  # the first request arrives at 0
        return {
            "name": "staggered",
            "description": "the mixed workload's first requests, arriving over time as a Poisson process",
            "recipe": {
                **STAGGERED,
                "arrivals": "first at 0 s, then exponential gaps of mean 1 / rate "
                "(random.Random(seed).expovariate(rate)), rounded to 0.1 ms",
            },
            "token_id_seed": base["token_id_seed"],
            "arrival_rate_per_s": STAGGERED["arrival_rate_per_s"],
            "requests": requests,
        }
    raise ValueError(f"workload {name!r}: must be one of {NAMES}")


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniform: round(exp(uniform(ln lo, ln hi)))."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def path(name: str) -> Path:
    """The committed file of workload ``name``: ``benchmarks/lib/workloads/<name>.json``."""
    return FOLDER / f"{name}.json"


def load(name: str) -> dict:
    """The workload ``name`` as committed (see the module docstring for the layout).

    Raises ValueError on an unknown name, FileNotFoundError if its file is missing.
    """
    if name not in NAMES:
        raise ValueError(f"workload {name!r}: must be one of {NAMES}")
    return json.loads(path(name).read_text(encoding="utf-8"))


def write(folder: Path = FOLDER) -> list[Path]:
    """Write every workload's JSON file from its recipe into ``folder``; returns the paths."""
    out = []
    for name in NAMES:
        target = Path(folder) / f"{name}.json"
        target.write_text(_dumps(make(name)), encoding="utf-8")
        out.append(target)
    return out


def _dumps(workload: dict) -> str:
    """Indented JSON with one request per line, so that a diff of the file reads request by request."""
    head = json.dumps({k: v for k, v in workload.items() if k != "requests"}, indent=1)
    rows = ",\n".join("  " + json.dumps(r) for r in workload["requests"])
    return head[:-2] + ',\n "requests": [\n' + rows + "\n ]\n}\n"


def take(
    workload: dict, n: int | None = None, max_prompt_tokens: int | None = None, max_tokens: int | None = None
) -> dict:
    """A smaller copy of a workload: its first ``n`` requests, lengths capped (for --quick and tests).

    The copy records what was taken in ``derived``, so a result's JSON says exactly what ran. Token ids
    stay those of the full workload's requests (the first ``max_prompt_tokens`` of each prompt).
    """
    small = copy.deepcopy(workload)
    small["requests"] = small["requests"][:n]
    for r in small["requests"]:
        if max_prompt_tokens is not None:
            r["prompt_tokens"] = min(r["prompt_tokens"], max_prompt_tokens)
        if max_tokens is not None:
            r["max_tokens"] = min(r["max_tokens"], max_tokens)
    small["derived"] = {
        "from": workload["name"],
        "first_n": n,
        "max_prompt_tokens": max_prompt_tokens,
        "max_tokens": max_tokens,
    }
    return small


def requests(workload: dict, vocab_size: int, context_window: int | None = None) -> list[Request]:
    """The workload's requests with their prompt token ids, for a model of ``vocab_size`` tokens.

    Request i's ids: ``torch.Generator().manual_seed(token_id_seed + index)``, uniform in
    [0, vocab_size - 1) (never the end-of-text id, the last one), the first ``prompt_tokens`` of 256
    draws, so a shortened prompt is a prefix of the full one. Raises ValueError if a request does not
    fit ``context_window`` (prompt + max_tokens tokens).
    """
    out = []
    for r in workload["requests"]:
        total = r["prompt_tokens"] + r["max_tokens"]
        if context_window is not None and total > context_window:
            raise ValueError(
                f"workload {workload['name']!r}, request {r['index']}: {r['prompt_tokens']} prompt + "
                f"{r['max_tokens']} new tokens do not fit the context window of {context_window}"
            )
        generator = torch.Generator().manual_seed(workload["token_id_seed"] + r["index"])
        draws = max(256, r["prompt_tokens"])
        ids = torch.randint(0, vocab_size - 1, (draws,), generator=generator)[: r["prompt_tokens"]].tolist()
        out.append(Request(r["index"], ids, r["max_tokens"], r["arrival_s"]))
    return out


def equal(num_requests: int, prompt_tokens: int, max_tokens: int, token_id_seed: int) -> dict:
    """``num_requests`` requests of one length, all at time 0, in the layout of the committed files (named
    ``equal-<num_requests>``; ``requests()`` draws their prompt ids from ``token_id_seed``)."""
    return {
        "name": f"equal-{num_requests}",
        "token_id_seed": token_id_seed,
        "requests": [
            {"index": i, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "arrival_s": 0.0}
            for i in range(num_requests)
        ],
    }


def summary(workload: dict) -> dict:
    """Totals of a workload, for tables and the JSON: requests, prompt and max_tokens sums and ranges."""
    rs = workload["requests"]
    prompts, news = [r["prompt_tokens"] for r in rs], [r["max_tokens"] for r in rs]
    return {
        "requests": len(rs),
        "prompt_tokens": sum(prompts),
        "max_tokens": sum(news),
        "prompt_tokens_range": [min(prompts), max(prompts)],
        "max_tokens_range": [min(news), max(news)],
        "last_arrival_s": max(r["arrival_s"] for r in rs),
    }

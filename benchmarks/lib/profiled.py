"""A process under cProfile for part of its life, and what a profile says: top functions, shares by category.

``python -m benchmarks.lib.profiled OUT PACKAGE ARGS...`` runs ``python -m PACKAGE ARGS`` (a server) with
cProfile off; SIGUSR1 switches it on, SIGUSR2 off, so that the profile covers a load and not the start-up
(as ``python -m cProfile -o OUT -m PACKAGE`` would), and the stats are written to OUT when the process
exits, a graceful SIGINT / SIGTERM shutdown included. ``top_functions`` and ``shares`` read such stats.
"""

from __future__ import annotations

import cProfile
import pstats
import re
import runpy
import signal
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2]) + "/"


def main() -> None:
    out, package, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    profiler = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())
    sys.argv = [package, *args]
    status = 0
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # the server's own exit status, after its shutdown
        status = e.code
    finally:
        profiler.disable()
        profiler.dump_stats(out)
    sys.exit(status)


def _name(file: str, line: int, func: str) -> str:
    file = file.removeprefix(ROOT).split("site-packages/")[-1]
    return f"{file}:{line}({func})" if line else func


def top_functions(stats: pstats.Stats | cProfile.Profile, key: str, n: int) -> list[dict]:
    """The ``n`` functions with the largest ``key`` ("tottime": own time, "cumtime": with callees), as
    {"function" (file:line(name), the file relative to the repository or to site-packages), "calls",
    "primitive_calls", "tottime_s", "cumtime_s"}."""
    stats = pstats.Stats(stats) if isinstance(stats, cProfile.Profile) else stats
    rows = [
        {
            "function": _name(*where),
            "calls": calls,
            "primitive_calls": primitive,
            "tottime_s": tottime,
            "cumtime_s": cumtime,
        }
        for where, (primitive, calls, tottime, cumtime, _) in stats.stats.items()
    ]
    return sorted(rows, key=lambda r: r[f"{key}_s"], reverse=True)[:n]


def shares(stats: pstats.Stats, categories: list[tuple[str, str]]) -> dict[str, float]:
    """Own time (seconds) per category: a function goes to the first category whose regular expression
    matches its ``file:line(name)``; one that none matches (a builtin, a generic helper) is split over its
    callers in proportion to the time each call site took (with callees), and goes where they go
    (``"other"`` when nothing matches up the chain). ``stats``: a ``pstats.Stats`` (its ``stats`` table)."""
    compiled = [(label, re.compile(pattern)) for label, pattern in categories]
    memo: dict = {}

    def weights(func, seen) -> dict[str, float]:
        """Where one second of ``func``'s own time goes: {category: fraction}."""
        if func in memo:
            return memo[func]
        name = _name(*func)
        label = next((label for label, pattern in compiled if pattern.search(name)), None)
        if label is not None:
            result = {label: 1.0}
        else:
            callers = {c: t for c, t in stats.stats[func][4].items() if c not in seen and c in stats.stats}
            key = 3 if any(t[3] for t in callers.values()) else 1  # by the call site's time, else calls
            total = sum(t[key] for t in callers.values())
            result = {}
            for caller, t in callers.items():
                for k, v in weights(caller, seen | {func}).items():
                    result[k] = result.get(k, 0.0) + v * t[key] / total
            result = result or {"other": 1.0}
        memo[func] = result
        return result

    out: dict[str, float] = {label: 0.0 for label, _ in categories} | {"other": 0.0}
    for func, (_, _, tottime, _, _) in stats.stats.items():
        for label, fraction in weights(func, frozenset()).items():
            out[label] += tottime * fraction
    return out


if __name__ == "__main__":
    main()

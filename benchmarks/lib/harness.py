"""What every benchmark shares: the machine record, timing, alternation, medians, ratios, JSON, tables.

The rules (also in benchmarks/README.md): warm up, since the first call of an engine pays for lazy
initialisation (allocator, thread pool, kernel selection); several runs, and the median, which one slow run
does not move; engines compared in the same run, alternating (run i calls every engine once, starting with a
different one each run), so that a slow phase of the machine falls on all of them alike; a comparison is the
median of per-run ratios, not the ratio of two medians; every raw figure, the machine, the versions and the
exact workload go into the JSON.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"
ROOT = RESULTS.parent.parent  # the repository
# the variable that names the commit of the code that runs, where git cannot tell (a copy of the tree
# whose .git is stale, as the GPU machine's): BENCHMARK_COMMIT=$(git rev-parse HEAD) python -m benchmarks ...
COMMIT_VARIABLE = "BENCHMARK_COMMIT"


def machine_info(device: str, dtype: str) -> dict:
    """The machine and software a result was measured on: CPU model, cores, torch threads, GPU name,
    platform, Python / torch / transformers versions, git commit, dtype, date (UTC, ISO 8601); on a GPU
    also the CUDA version torch was built with, the GPU's memory (bytes) and multiprocessors."""
    import transformers

    info = {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": torch.cuda.get_device_name(torch.device(device))
        if torch.device(device).type == "cuda"
        else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "git_commit": _git_commit(),
        "dtype": dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        info |= {
            "cuda": torch.version.cuda,
            "gpu_memory_bytes": props.total_memory,
            "gpu_multiprocessors": props.multi_processor_count,
        }
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    """The commit of the code that runs: ``$BENCHMARK_COMMIT`` if set, else the repository's HEAD."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously); nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str | torch.device = "cpu") -> tuple[float, object]:
    """Call ``fn()``; return (wall seconds by ``time.perf_counter``, its result), the device synchronised."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def copy_bandwidth(device: str | torch.device, nbytes: int = 2**28, repeats: int = 10) -> float:
    """The device's memory bandwidth as a copy sees it, bytes per second counting bytes read and written:
    ``repeats`` copies of an ``nbytes`` buffer (256 MiB: far more than any cache) into another, after one
    untimed copy. The ceiling for memory-bound work: bytes it must move / this = the least time it takes
    (4.06e12 measured on the H200 here)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(repeats)], device)
    return 2 * nbytes * repeats / seconds


def alternate(
    engines: dict[str, Callable[[], dict]], runs: int, warmup: int = 1, runs_of: dict[str, int] | None = None
) -> dict[str, list[dict]]:
    """Measure several engines on one workload, alternating them inside each run.

    engines: name -> a call that runs the workload once and returns its figures (e.g. ``{"wall_s": ...}``).
    Each engine is first called ``warmup`` times (discarded); then run i calls every engine once, in the
    order rotated by i (A B C, B C A, C A B, ...). ``runs_of`` gives an engine fewer runs (a slow
    baseline): it takes part in runs 0..runs_of[name]-1 only. Returns name -> the figures of each run.
    """
    names = list(engines)
    for name in names:
        for _ in range(warmup):
            engines[name]()
    results: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(runs):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            if i < (runs_of or {}).get(name, runs):
                results[name].append(engines[name]())
    return results


def median(values: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between the closest ranks (numpy's default),
    or None for no values. p50 is the median; p95 of 64 values lies between the 60th and 61st smallest."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def medians(runs: list[dict]) -> dict:
    """Per figure, the median over runs, for every figure that is a number in all runs."""

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    keys = [k for k in (runs[0] if runs else {}) if all(number(r.get(k)) for r in runs)]
    return {k: median([r[k] for r in runs]) for k in keys}


def ratio(a: list[dict], b: list[dict], key: str) -> dict:
    """Engine a over engine b on figure ``key``, run by run (pairs of the same run index).

    Returns {"per_run": [a_i / b_i ...], "median": median of those}; runs that only one side has are
    left out (see ``alternate``'s ``runs_of``).
    """
    per_run = [x[key] / y[key] for x, y in zip(a, b)]
    return {"per_run": per_run, "median": median(per_run)}


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` as indented JSON (its paths made ``portable``), making the folder if needed. Returns
    ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(portable(data), indent=1) + "\n", encoding="utf-8")
    return path


STDLIB = sysconfig.get_paths()["stdlib"] + "/"
# an absolute path inside a string: a "/" that starts a word, then at least one folder
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/(?:[\w.+@-]+/)+[\w.+@-]*")


def portable(data):
    """``data`` (JSON-like: dicts, lists, strings, numbers) with every absolute path of this machine in its
    strings and keys made machine-independent: a path in the repository relative to it
    (``demo/checkpoint``), a Python library file from its ``site-packages/`` or standard library folder on
    (``asyncio/events.py``), any other path its last two parts (``.../bench-tiny0/model``). A record
    names what ran, not where it lay."""

    def path(match: re.Match) -> str:
        found = match.group(0)
        if "site-packages/" in found:
            return found.split("site-packages/", 1)[1]
        if found.startswith(STDLIB) or re.search(r"/lib/python3\.\d+/", found):
            return re.split(r"/lib/python3\.\d+/", found, maxsplit=1)[-1]
        if Path(found).is_relative_to(ROOT):
            return Path(found).relative_to(ROOT).as_posix() or "."
        return ".../" + "/".join(Path(found).parts[-2:])

    if isinstance(data, str):
        return _ABSOLUTE_PATH.sub(path, data)
    if isinstance(data, dict):
        return {portable(k): portable(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [portable(v) for v in data]
    return data


def free(device: str | torch.device) -> None:
    """Give the memory of dropped objects back (garbage collection, then CUDA's cache on a GPU), so that the
    next point's tensors or engines fit."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def save_figure(fig, path: Path, dpi: int = 100) -> Path:
    """Write a matplotlib figure to ``path`` (making the folder if needed) and free it. Returns ``path``."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def result_path(name: str, device: str, suffix: str, out_dir: Path = RESULTS) -> Path:
    """``<out_dir>/<name>-<device type>.<suffix>``, e.g. ``results/kvcache-cpu.json`` (cuda:1 -> cuda)."""
    return Path(out_dir) / f"{name}-{torch.device(device).type}.{suffix}"


def run_models(result: dict, models: Sequence[str], bench_model: Callable[[str], dict]) -> None:
    """Run ``bench_model(name)`` for every model, filing each result (and its duration) under
    result["models"]."""
    for name in models:
        print(f"== {name}", flush=True)
        model_started = time.perf_counter()
        result["models"][name] = bench_model(name)
        result["models"][name]["elapsed_s"] = time.perf_counter() - model_started


def finish(
    name: str,
    device: str,
    result: dict,
    started: float,
    plot: Callable[[dict, Path], Path],
    report: Callable[[dict], str],
    out_dir: Path = RESULTS,
) -> dict:
    """The end of every benchmark: record the elapsed time, write the JSON and the PNG, print the table.

    A --quick run writes into ``<out_dir>/quick/`` (git-ignored), so that it never replaces the
    recorded results that the READMEs quote. Returns the result as written (``portable``).
    """
    if result["workload"].get("quick"):
        out_dir = out_dir / "quick"
    result = portable(result)
    result["elapsed_s"] = time.perf_counter() - started
    json_path = write_json(result_path(name, device, "json", out_dir), result)
    png_path = plot(result, result_path(name, device, "png", out_dir))
    print()
    print(report(result))
    print(f"\nwrote {json_path} and {png_path} ({result['elapsed_s']:.0f} s)")
    return result


def replot(
    name: str,
    device: str,
    plot: Callable[[dict, Path], Path],
    report: Callable[[dict], str],
    quick: bool = False,
    out_dir: Path = RESULTS,
) -> dict:
    """Draw the PNG again from a benchmark's recorded JSON (``python -m benchmarks <name> --replot``), and
    print its table: for a change to the plot or the report, without measuring again. The JSON is left
    as it is. Raises ValueError if there is no recorded result."""
    out_dir = out_dir / "quick" if quick else out_dir
    json_path = result_path(name, device, "json", out_dir)
    if not json_path.is_file():
        raise ValueError(f"no recorded result to plot: {json_path} does not exist (run the benchmark first)")
    result = json.loads(json_path.read_text(encoding="utf-8"))
    png_path = plot(result, result_path(name, device, "png", out_dir))
    print(report(result))
    print(f"\nwrote {png_path} from {json_path}")
    return result


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table, right-aligned columns; None shows as "-", floats with 3 significant digits."""

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def target_line(label: str, value: float | None, target: str, unit: str = "x", full_size: bool = True) -> str:
    """One line for a performance target such as ``">= 4"`` (also ``<=``, ``<``, ``>``): the figure, the
    target, met or MISSED. ``unit`` follows the numbers: "x" for a ratio, or e.g. " blocks".

    full_size: False when the workload point that the target is defined at did not run (``--quick``, a
    smaller sweep): the figure is shown at the size that ran, neither met nor MISSED but "not measured at
    full size", since a target says nothing about a smaller workload."""
    op, bound = target.split()
    compare = {">=": float.__ge__, "<=": float.__le__, ">": float.__gt__, "<": float.__lt__}[op]
    met = value is not None and compare(float(value), float(bound))
    shown = "n/a" if value is None else f"{value:.2f}{unit}"
    verdict = ("met   " if met else "MISSED") if full_size else "-     "
    line = f"{verdict}  {label}: {shown} (target {target}{unit})"
    return line if full_size else f"{line}: not measured at full size"


def log_axis(axis, values: Sequence[float] | None = None) -> None:
    """Readable ticks on a log-scaled matplotlib axis (``ax.xaxis`` or ``ax.yaxis``): labelled ticks at 1, 2
    and 5 x 10^k, written as plain numbers (0.5, 20, 5000, 20k, 1M), unlabelled minor ticks between. Given the
    plotted ``values`` and less than a decade of range, also 3 and 7 x 10^k, so that at least three
    ticks carry a label."""
    from matplotlib import ticker

    narrow = values is not None and max(values) / min(values) < 10
    subs = (1.0, 2.0, 3.0, 5.0, 7.0) if narrow else (1.0, 2.0, 5.0)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(
        ticker.FuncFormatter(
            lambda v, _: f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k" if v >= 1e4 else f"{v:g}"
        )
    )
    axis.set_minor_locator(ticker.LogLocator(base=10, subs=[s for s in range(2, 10) if s not in subs]))
    axis.set_minor_formatter(ticker.NullFormatter())

"""python -m benchmarks <name>: run one benchmark, write benchmarks/results/<name>-<device>.json and .png.

A benchmark is a module of this package with ``NAME``, ``DEFAULT_MODELS``,
``main(models, device, runs, quick) -> dict``, ``plot(result, path)`` and ``report(result)`` (for
``--replot``), and optionally ``DEFAULT_RUNS`` (else 5); adding one is adding its module and a line to
``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

from .lib import harness
from .lib.models import MODELS

# name -> (module, the step it measures, the question it answers). Modules are imported only when run, so
# --help is fast. The order is the steps'; benchmarks/README.md opens with the same table.
BENCHMARKS = {
    "kvcache": (
        "benchmarks.kvcache",
        "2",
        "what the KV cache buys: ms/token vs length, TTFT, KV bytes/token (vs step 1, HF)",
    ),
    "static_batch": (
        "benchmarks.static_batch",
        "3",
        "what static batching buys and wastes: tok/s vs batch, a mixed workload (vs step 2, HF)",
    ),
    "continuous": (
        "benchmarks.continuous",
        "4",
        "what continuous batching and paged KV buy: tok/s, latency, TTFT, memory (vs step 3, HF)",
    ),
    "attention": (
        "benchmarks.attention",
        "5",
        "the Triton kernels alone: prefill, paged decode, write_kv, KV memory (vs PyTorch)",
    ),
    "gpu": (
        "benchmarks.gpu",
        "2-8",
        "what each step buys on a GPU: ms/token at B=1, tok/s vs B, dtypes (vs HF, HF static cache)",
    ),
    "server_overhead": (
        "benchmarks.server_overhead",
        "6",
        "what the HTTP server costs on top of its engine: tok/s, TTFT, ITL, 16 streams, Poisson",
    ),
    "cuda_graphs": (
        "benchmarks.cuda_graphs",
        "7",
        "where a decode step's time goes, replayed vs eager; what the capture ladder costs",
    ),
    "async_scheduling_profile": (
        "benchmarks.async_scheduling_profile",
        "8",
        "how long the GPU idles between decode steps, step 7 vs 8 (torch.profiler)",
    ),
    "server_by_step": (
        "benchmarks.server_by_step",
        "6-9",
        "what each mechanism buys an HTTP client: tok/s, TTFT, ITL at 1, 16, 64 streams",
    ),
    "prefix_cache": (
        "benchmarks.prefix_cache",
        "9",
        "what the prefix cache buys on a shared prefix, and costs when nothing is shared (vs step 8)",
    ),
    "engine_core": (
        "benchmarks.engine_core",
        "10",
        "the engine core in its own process: server tok/s, TTFT, ITL at 1-256 streams vs in process",
    ),
    "speculative": (
        "benchmarks.speculative",
        "11",
        "what speculation buys (n-gram, the demo draft): tok/s, ms/token, acceptance at B = 1-256",
    ),
    "quantized_kv": (
        "benchmarks.quantized_kv",
        "12",
        "what an 8-bit KV cache costs and buys: held-out perplexity, top-1; kernel, tok/s, a fixed pool",
    ),
    "chunked_prefill": (
        "benchmarks.chunked_prefill",
        "13",
        "what chunked prefill buys running streams under a burst and Poisson arrivals, what it costs (vs 12)",
    ),
    "data_parallel": (
        "benchmarks.data_parallel",
        "14",
        "N frontends and M engine cores behind one port: tok/s, TTFT, ITL at 16-512 streams vs in process",
    ),
    "tensor_parallel": (
        "benchmarks.tensor_parallel",
        "15",
        "what t ranks cost and buy: tok/s at t = 1, 2, the all-reduces per step and their time; a cost model",
    ),
    "fused_kernels": (
        "benchmarks.fused_kernels",
        "16",
        "what five fused kernels a layer buy a decode step: kernels, GPU and host ms/step, ms/token, "
        "tok/s (vs step 15, torch.compile)",
    ),
    "ladder": (
        "benchmarks.ladder",
        "5-16",
        "no step slower than the one before: every step's LLM.generate at B = 1, 64, 256 vs HF static cache",
    ),
}

# the options only some benchmarks take (flag, the argument of their ``main``), passed on when given
ONLY = (
    ("--dtype", "dtypes"),
    ("--workload", "workloads"),
    ("--profile-frontend", "profile_frontend"),
    ("--tiles", "tiles"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    listing = "\n".join(
        f"  {name:<25} step {step:<4} {question}" for name, (_, step, question) in BENCHMARKS.items()
    )
    models = "\n".join(f"  {name:<18} {summary}" for name, summary in MODELS.items())
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__.splitlines()[0],
        epilog=f"benchmarks (benchmarks/README.md: the --quick commands, the minutes each takes):\n{listing}"
        f"\n\nmodels:\n{models}\n  (or a local snapshot folder)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name", choices=BENCHMARKS, metavar="name", help="the benchmark to run (listed below)"
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="MODEL",
        help="a model to run on (repeatable); default: the benchmark's own list",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="measured runs per point, after a warm-up (default: the benchmark's own, 5 or 3)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 run and shorter lengths: checks that it works"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: draw the PNG again from the recorded JSON (of --quick with --quick) "
        "and print its table",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        dest="dtypes",
        metavar="DTYPE",
        choices=["float16", "bfloat16", "float32"],
        help="gpu only: run only this dtype's points (repeatable) and merge them into the recorded "
        "JSON, replacing that dtype's earlier points",
    )
    parser.add_argument(
        "--workload",
        action="append",
        dest="workloads",
        metavar="WORKLOAD",
        choices=["short", "long"],
        help="gpu only: run only this workload's points (repeatable), merged like --dtype",
    )
    parser.add_argument(
        "--profile-frontend",
        action="store_true",
        help="engine_core only: step 10's frontend alone and its server under cProfile at 64 streams, "
        "instead of the sweep",
    )
    parser.add_argument(
        "--tiles",
        action="store_true",
        help="fused_kernels only: sweep fused_linear's tile options at GPT-2 124M's products (1, 16 and 64 "
        "rows) instead of the engines",
    )
    args = parser.parse_args(argv)
    if args.runs is not None and args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.tiles and (args.quick or args.models or args.runs is not None):
        parser.error("--tiles sweeps one fixed set of shapes: it takes no --quick, --model or --runs")
    if not args.replot:  # the device must exist before anything is measured (imported now: --help stays fast)
        from step1_generate.config import check_device  # every engine checks its device so

        try:
            check_device(args.device)
        except ValueError as e:
            parser.error(f"--{e}")
    for flag, dest in ONLY:
        if getattr(args, dest) and args.replot:
            parser.error(f"{flag} measures: it does not go with --replot")
        if (
            getattr(args, dest)
            and dest
            not in inspect.signature(importlib.import_module(BENCHMARKS[args.name][0]).main).parameters
        ):
            parser.error(f"{flag}: the {args.name} benchmark does not take it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.name][0])
    runs = args.runs if args.runs is not None else getattr(module, "DEFAULT_RUNS", 5)
    try:
        if args.replot:
            harness.replot(module.NAME, args.device, module.plot, module.report, quick=args.quick)
            return 0
        extra = {dest: getattr(args, dest) for _, dest in ONLY if getattr(args, dest)}
        module.main(models=args.models, device=args.device, runs=runs, quick=args.quick, **extra)
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

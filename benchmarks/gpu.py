"""Steps 2 to 5, 7 and 8 on a GPU against Hugging Face's generate, end to end through ``LLM.generate``.

GPT-2 124M's shape, random weights, greedy, ``ignore_eos``, B = 1, 8, 64, 256 requests at once, workloads
``short`` (32 + 128 tokens) and ``long`` (512 + 256), fp16, fp32 and bf16 (``MATRIX``); engines ``hf``,
``hf_static`` (compiled static cache), ``step2`` (B = 1) to ``step8`` (``ENGINES``): tok/s and ms/token; then
cProfile at B = 256 and the dtype study (``DTYPE_STUDY``). ``--dtype`` and ``--workload`` run one part and
merge it into the recorded JSON. Details: benchmarks/README.md.

    python -m benchmarks gpu --device cuda --runs 2 --dtype float16 --workload short   # one part, merged
    python -m benchmarks gpu --quick                  # CPU, tiny sizes, fp32, B = 1 and 4
"""

from __future__ import annotations

import cProfile
import dataclasses
import importlib
import importlib.util
import json
import time
from pathlib import Path

import torch

from common.weights import load_config

from .lib import drivers, harness, workloads
from .lib.models import hf_model, raise_recompile_limit, snapshot
from .lib.profiled import top_functions

NAME = "gpu"
DEFAULT_MODELS = ["gpt2-124m-random"]
DEFAULT_RUNS = 3
BATCH_SIZES = [1, 8, 64, 256]
WORKLOADS = {
    "short": {"prompt_tokens": 32, "max_tokens": 128},
    "long": {"prompt_tokens": 512, "max_tokens": 256},
}
HF_STATIC_RECOMPILE_LIMIT = 64  # torch._dynamo's default (8) would fall back to eager after 8 shapes
ENGINE_NAMES = ("hf", "hf_static", "step2", "step3", "step4", "step5", "step7", "step8")
# dtype -> workload -> the engines that run it (step5, step7, step8 where their packages exist). A whole run
# takes about 18 minutes on an H200 without hf_static (which compiles at every point; step 8 adds a few);
# `--dtype` and `--workload` run a part and merge it into the recorded JSON. hf_static runs in the serving
# dtype only.
MATRIX = {
    dtype: {"short": engines, "long": engines}
    for dtype, engines in (
        ("float16", ENGINE_NAMES),
        ("float32", tuple(e for e in ENGINE_NAMES if e != "hf_static")),
        ("bfloat16", tuple(e for e in ENGINE_NAMES if e != "hf_static")),
    )
}
STEP_PACKAGES = {
    "step2": "step2_kvcache",
    "step3": "step3_static_batch",
    "step4": "step4_paged_continuous",
    "step5": "step5_flash_gpu",
    "step7": "step7_cuda_graphs",
    "step8": "step8_async_scheduling",
}
STEP2_MAX_BATCH = 1  # step 2 serves one request at a time: it runs at B = 1 only
BLOCK_SIZE = 16
TOKEN_ID_SEED = 3000
PROFILE = {
    "engines": ("step4", "step5", "step7", "step8"),
    "dtype": "float16",
    "batch_size": 256,
    "workload": "short",
    "steps": 64,
    "top": 25,
}
# The dtype study: greedy agreement of a low-precision engine with its fp32 self, on the trained demo
# checkpoint (random weights have near-ties everywhere); speed per dtype is in the matrix's points.
DTYPE_STUDY = {
    "engine": "step5",
    "model": "demo",
    "reference": "float32",
    "dtypes": ("float16", "bfloat16"),
    "prompts": 16,
    "prompt_tokens": 32,
    "max_tokens": 128,
    "top": 5,
}
QUICK = {
    "batch_sizes": [1, 4],
    "workloads": {
        "short": {"prompt_tokens": 8, "max_tokens": 8},
        "long": {"prompt_tokens": 32, "max_tokens": 16},
    },
    "matrix": {"float32": {"short": ENGINE_NAMES, "long": ENGINE_NAMES}},
    "profile": {**PROFILE, "dtype": "float32", "batch_size": 4, "steps": 8},
    "dtype_study": {
        **DTYPE_STUDY,
        "dtypes": ("bfloat16",),
        "prompts": 2,
        "prompt_tokens": 8,
        "max_tokens": 8,
    },
}
CONFIG_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "head_dim")
ENGINES = {
    "hf": "transformers GPT2LMHeadModel.generate(do_sample=False, use_cache=True, max_new_tokens = "
    "min_new_tokens = max_tokens) on the B requests as one batch, left padding + attention_mask; "
    "torch.inference_mode",
    "hf_static": "hf with cache_implementation='static' (transformers compiles the decode forward on a "
    "GPU: torch.compile, mode reduce-overhead); compiled in the point's untimed warm-up run",
    "step2": "step2_kvcache.LLM.generate: one request at a time (B = 1 only)",
    "step3": "step3_static_batch.LLM(max_batch_size=B).generate: one static batch",
    "step4": f"step4_paged_continuous.LLM(max_num_seqs=B, block_size={BLOCK_SIZE}, num_kv_blocks = B x the "
    "blocks of the longest request of all workloads, max_num_batched_tokens = B x the longest prompt of "
    "all workloads: every prompt is admitted in the first step, as HF and step 3 prefill them in one "
    "forward pass).generate: no preemption",
    "step5": "step5_flash_gpu.LLM with step4's arguments (attention_backend: its default).generate",
    "step7": "step7_cuda_graphs.LLM with step4's arguments (CUDA graphs captured at start-up).generate",
    "step8": "step8_async_scheduling.LLM with step4's arguments (CUDA graphs; async_scheduling: its default, "
    "on with CUDA, off on a CPU).generate",
}


def main(
    models: list[str] | None = None,
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    quick: bool = False,
    dtypes: list[str] | None = None,
    workloads: list[str] | None = None,
) -> dict:
    """The CLI entry (``python -m benchmarks gpu --device cuda``): the full or quick workloads on each model.

    dtypes (``--dtype``, repeatable), workloads (``--workload``, repeatable): run only these dtypes' and
    workloads' points and merge them into the recorded JSON, where they replace the same (dtype, workload)
    points of earlier runs (see ``run``'s merge); the profiles run with float16 and the short workload, the
    dtype study with float16 and all workloads. Raises ValueError for a dtype or workload the matrix lacks.
    """
    matrix, profile, study = (
        (QUICK["matrix"], QUICK["profile"], QUICK["dtype_study"]) if quick else (MATRIX, PROFILE, DTYPE_STUDY)
    )
    if dtypes:
        unknown = sorted(set(dtypes) - set(matrix))
        if unknown:
            runs = "--quick runs" if quick else "the matrix has"
            raise ValueError(f"--dtype {', '.join(unknown)}: {runs} {', '.join(matrix)} only")
        matrix = {d: w for d, w in matrix.items() if d in dtypes}
        profile = profile if profile["dtype"] in matrix else None
        study = study if "float16" in dtypes else None
    if workloads:
        known = {w for by_workload in matrix.values() for w in by_workload}
        unknown = sorted(set(workloads) - known)
        if unknown:
            raise ValueError(f"--workload {', '.join(unknown)}: the workloads are {', '.join(sorted(known))}")
        matrix = {d: {w: e for w, e in ws.items() if w in workloads} for d, ws in matrix.items()}
        profile = profile if profile and profile["workload"] in workloads else None
        study = study if len(workloads) == len(known) else None
    if quick:
        return run(
            models or DEFAULT_MODELS,
            device,
            runs=1,
            batch_sizes=QUICK["batch_sizes"],
            lengths=QUICK["workloads"],
            matrix=matrix,
            profile=profile,
            dtype_study=study,
            quick=True,
            merge=bool(dtypes or workloads),
        )
    return run(
        models or DEFAULT_MODELS,
        device,
        runs=runs,
        matrix=matrix,
        profile=profile,
        dtype_study=study,
        merge=bool(dtypes or workloads),
    )


def run(
    models: list[str],
    device: str = "cuda",
    runs: int = DEFAULT_RUNS,
    batch_sizes: list[int] = BATCH_SIZES,
    lengths: dict[str, dict] = WORKLOADS,
    matrix: dict[str, dict[str, tuple[str, ...]]] = MATRIX,
    profile: dict | None = PROFILE,
    dtype_study: dict | None = DTYPE_STUDY,
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
    merge: bool = False,
) -> dict:
    """Every workload, dtype and batch size on each model; write ``<out_dir>/gpu-<device>.json`` and ``.png``.

    models: benchmark model names or snapshot folders. runs: measured runs per point, after a warm-up.
    batch_sizes: the B of each point (step 2 runs at B = 1 only). lengths: workload name ->
    {"prompt_tokens", "max_tokens"} of every request. matrix: dtype -> workload name -> the engines that run
    it (step5 only where its package exists). profile: the cProfile runs ({"engines", "dtype", "batch_size",
    "workload", "steps", "top"}; None: no profile); they run where their dtype and batch size come up.
    dtype_study: see ``dtype_study`` (None: none). merge: keep what the recorded JSON holds beyond this run
    (see ``merge_into``) instead of replacing it. Returns the result dict that was written (see
    benchmarks/README.md for its layout).
    """
    started = time.perf_counter()
    result = {
        "benchmark": NAME,
        "machine": {
            **harness.machine_info(device, ", ".join(matrix)),
            "copy_bandwidth_bytes_per_s": harness.copy_bandwidth(device),
            "sdpa_backends_enabled": {
                b: getattr(torch.backends.cuda, f"{b}_sdp_enabled")()
                for b in ("cudnn", "flash", "mem_efficient", "math")
            },
        },
        "workload": {
            "sampling": "greedy (temperature 0), ignore_eos: every request generates exactly max_tokens",
            "batch_sizes": batch_sizes,
            "workloads": {
                name: {
                    **w,
                    "requests": "B per point, all submitted at once; prompt ids: "
                    f"torch.Generator().manual_seed({TOKEN_ID_SEED} + i), uniform in [0, vocab_size - 1)",
                }
                for name, w in lengths.items()
            },
            "matrix": {
                dtype: {wname: list(engines) for wname, engines in by_workload.items()}
                for dtype, by_workload in matrix.items()
            },
            "step2_max_batch": STEP2_MAX_BATCH,
            "runs": runs,
            "warmup": "before each point, every engine once on the same requests, untimed: every shape of "
            "the point seen once (cuDNN's attention plans a new shape on its first call)",
            "quick": quick,
            "engines": ENGINES,
            "profile": profile,
            "dtype_study": dtype_study,
            "memory_floor": "a decode step of B requests reads every weight once and each request's KV cache "
            "at the mean context (prompt + max_tokens / 2): B / ((weight bytes + B x KV bytes) / copy "
            "bandwidth) tok/s",
            "timing": "time.perf_counter around the whole generate call, torch.cuda.synchronize before and "
            "after; engines alternated within each run (order rotated per run); medians over runs; ratios "
            "are medians of per-run ratios",
        },
        "models": {},
    }

    def run(name: str) -> dict:
        return bench_model(
            name,
            device,
            runs,
            batch_sizes,
            lengths,
            matrix,
            profile,
            result["machine"]["copy_bandwidth_bytes_per_s"],
        )

    harness.run_models(result, models, run)
    if dtype_study:
        print(f"== dtype study: {dtype_study['engine']} on {dtype_study['model']}", flush=True)
        result["dtype_study"] = run_dtype_study(dtype_study, device)
    recorded = harness.result_path(NAME, device, "json", out_dir / "quick" if quick else out_dir)
    if merge and recorded.is_file():
        result = merge_into(json.loads(recorded.read_text()), harness.portable(result))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def part(dtype: str, workload: str) -> str:
    """The name of one part of the matrix, as ``earlier_runs`` lists it: "float16 short"."""
    return f"{dtype} {workload}"


def run_parts(run: dict) -> list[str]:
    """The parts of an ``earlier_runs`` entry (entries written before parts existed name their dtypes: all
    workloads of those)."""
    return run.get("parts") or [part(d, w) for d in run.get("dtypes", []) for w in WORKLOADS]


def merge_into(old: dict, new: dict) -> dict:
    """``new`` (a run of some parts of the matrix: (dtype, workload) pairs) with what ``old`` (the recorded
    result) has beyond it: the points of the parts ``new`` did not run, its profiles and dtype study where
    ``new`` has none, its models that ``new`` did not run. Where points came from another run,
    ``earlier_runs`` lists that run's parts and machine (its own earlier runs carried along)."""
    ran = {part(d, w) for d, by_workload in new["workload"]["matrix"].items() for w in by_workload}
    kept = {
        part(p["dtype"], p["workload"]) for model in old["models"].values() for p in model["points"]
    } - ran
    out = {**new, "models": {**old["models"], **new["models"]}}
    matrix: dict[str, dict] = {}
    for d, by_workload in old["workload"]["matrix"].items():
        for w, engines in by_workload.items():
            if part(d, w) in kept:
                matrix.setdefault(d, {})[w] = engines
    for d, by_workload in new["workload"]["matrix"].items():
        matrix.setdefault(d, {}).update(by_workload)
    out["workload"] = {**new["workload"], "matrix": matrix}
    for name, model in new["models"].items():
        before = old["models"].get(name, {})
        out["models"][name] = {
            **model,
            "points": [p for p in before.get("points", []) if part(p["dtype"], p["workload"]) in kept]
            + model["points"],
            "profiles": model["profiles"] or before.get("profiles", {}),
        }
    if "dtype_study" not in new and "dtype_study" in old:
        out["dtype_study"] = old["dtype_study"]
        out["workload"]["dtype_study"] = old["workload"].get("dtype_study")
    if not any(model["profiles"] for model in new["models"].values()):
        out["workload"]["profile"] = old["workload"].get("profile")
    earlier = [
        {**{k: v for k, v in r.items() if k != "dtypes"}, "parts": [x for x in run_parts(r) if x in kept]}
        for r in old.get("earlier_runs", [])
    ]
    from_old = sorted(kept - {x for r in earlier for x in r["parts"]})  # the old run's own points still kept
    earlier.append(
        {
            "parts": from_old,
            "machine": old["machine"],
            "runs": old["workload"]["runs"],
            "elapsed_s": old.get("elapsed_s"),
        }
    )
    out["earlier_runs"] = [r for r in earlier if r["parts"]]
    return out


def step_modules() -> tuple[dict[str, object], dict[str, str]]:
    """The step packages that exist, imported (name -> module), and those skipped (name -> why)."""
    modules, skipped = {}, {}
    for name, package in STEP_PACKAGES.items():
        if importlib.util.find_spec(package) is None:
            skipped[name] = f"the package {package} does not exist (yet)"
        else:
            modules[name] = importlib.import_module(package)
    return modules, skipped


def bench_model(
    name: str,
    device: str,
    runs: int,
    batch_sizes: list[int],
    lengths: dict[str, dict],
    matrix: dict[str, dict[str, tuple[str, ...]]],
    profile: dict | None,
    bandwidth: float,
) -> dict:
    """Every point on one model: every run's figures, their medians, the ratios, the floor, the profile."""
    import transformers

    modules, skipped = step_modules()
    folder = snapshot(name)
    config = load_config(folder)
    with torch.device("meta"):  # shapes only, no memory: the parameter count (the tied lm_head counted once)
        hf_config = transformers.GPT2Config.from_pretrained(folder)
        parameters = sum(p.numel() for p in transformers.GPT2LMHeadModel(hf_config).parameters())
    longest = max(w["prompt_tokens"] + w["max_tokens"] for w in lengths.values())
    longest_prompt = max(w["prompt_tokens"] for w in lengths.values())
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    out = {
        "snapshot": str(folder),
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "parameters": parameters,
        "skipped": skipped,
        "points": [],
        "profiles": {},
    }

    for dtype, by_workload in matrix.items():
        engines = {e for wanted in by_workload.values() for e in wanted if e.startswith("hf") or e in modules}
        item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        hf = hf_model(folder, device, dtype) if engines & {"hf", "hf_static"} else None
        if "hf_static" in engines:
            raise_recompile_limit(HF_STATIC_RECOMPILE_LIMIT)
        step2 = (
            modules["step2"].LLM(model=str(folder), device=device, dtype=dtype)
            if "step2" in engines
            else None
        )
        for b in batch_sizes:
            llms = {"step2": step2} if step2 is not None and b <= STEP2_MAX_BATCH else {}
            if "step3" in engines:
                llms["step3"] = modules["step3"].LLM(
                    model=str(folder), device=device, dtype=dtype, max_batch_size=b
                )
            for e in ("step4", "step5", "step7", "step8"):
                if e in engines:
                    llms[e] = modules[e].LLM(
                        model=str(folder),
                        device=device,
                        dtype=dtype,
                        block_size=BLOCK_SIZE,
                        max_num_seqs=b,
                        num_kv_blocks=b * blocks_per_seq,
                        max_num_batched_tokens=max(b * longest_prompt, config.n_positions),
                    )
            for wname, wanted in by_workload.items():
                w = lengths[wname]
                print(
                    f"  {dtype}, B = {b}, {wname}: {w['prompt_tokens']} + {w['max_tokens']} tokens",
                    end="",
                    flush=True,
                )
                equal = workloads.equal(b, w["prompt_tokens"], w["max_tokens"], TOKEN_ID_SEED)
                reqs = workloads.requests(equal, config.vocab_size, config.n_positions)
                point_started = time.perf_counter()
                point = measure(
                    hf,
                    [e for e in ("hf", "hf_static") if e in wanted],
                    {e: llm for e, llm in llms.items() if e in wanted},
                    modules,
                    reqs,
                    b,
                    runs,
                    device,
                )
                if "step7" in llms and llms["step7"].engine.model_runner.graph_runner is not None:
                    point["capture"] = dataclasses.asdict(
                        llms["step7"].engine.model_runner.graph_runner.stats
                    )
                print(
                    ": "
                    + ", ".join(f"{e} {m['throughput_tok_s']:.0f}" for e, m in point["median"].items())
                    + f" tok/s ({time.perf_counter() - point_started:.1f} s)",
                    flush=True,
                )
                floor = memory_floor(parameters, config, item, b, w, bandwidth)
                for e, m in point["median"].items():
                    m["share_of_memory_floor"] = m["throughput_tok_s"] / floor["throughput_tok_s"]
                out["points"].append(
                    {"workload": wname, "dtype": dtype, "batch_size": b, **point, "memory_floor": floor}
                )
            for e in (
                profile["engines"]
                if profile and (dtype, b) == (profile["dtype"], profile["batch_size"])
                else ()
            ):
                if e not in llms:
                    continue
                w = lengths[profile["workload"]]
                equal = workloads.equal(b, w["prompt_tokens"], w["max_tokens"], TOKEN_ID_SEED)
                print(f"  profile: {e}, {profile['steps']} steps", flush=True)
                reqs = workloads.requests(equal, config.vocab_size)
                out["profiles"][e] = profile_engine(
                    llms[e].engine, modules[e], reqs, profile["steps"], profile["top"], device
                )
            del llms
            harness.free(device)
        del hf, step2
        harness.free(device)
    return out


def measure(
    hf,
    hf_engines: list[str],
    llms: dict,
    modules: dict,
    reqs: list[workloads.Request],
    b: int,
    runs: int,
    device: str,
) -> dict:
    """One point: the engines (``hf_engines`` of "hf", "hf_static" on the HF model ``hf``, and ``llms``:
    step name -> its ``LLM``) each run once on the requests untimed, then alternated over ``runs`` runs."""
    cache = {"hf": None, "hf_static": "static"}
    calls = {
        e: lambda e=e: hf_figures(drivers.run_hf(hf, reqs, b, device, cache_implementation=cache[e]))
        for e in hf_engines
    }
    calls |= {e: lambda e=e, llm=llm: time_generate(llm, modules[e], reqs, device) for e, llm in llms.items()}
    raw = harness.alternate(calls, runs, warmup=1)
    ratios = {f"{e}/hf": (e, "hf", "throughput_tok_s") for e in raw if e != "hf" and "hf" in raw}
    pairs = [("step5", "step4"), ("step7", "hf_static"), ("step7", "step3"), ("step7", "step5")]
    pairs += [("step8", "hf_static"), ("step8", "step7")]
    ratios |= {f"{a}/{b}": (a, b, "throughput_tok_s") for a, b in pairs if {a, b} <= set(raw)}
    return drivers.compare(raw, ratios)


def figures(wall_s: float, generated: list[int]) -> dict:
    """One run's figures from its wall time and the tokens each request generated."""
    return {
        "wall_s": wall_s,
        "requests": len(generated),
        "generated_tokens": sum(generated),
        "throughput_tok_s": sum(generated) / wall_s,
        "ms_per_token": 1e3 * wall_s / max(generated),
    }


def hf_figures(run: dict) -> dict:
    """``figures`` of a ``drivers.run_hf`` run (generate returns exactly max_tokens per row:
    min_new_tokens)."""
    return figures(run["wall_s"], [r["generated_tokens"] for r in run["requests"]])


def time_generate(llm, module, reqs: list[workloads.Request], device: str) -> dict:
    """The requests through a step's ``LLM.generate`` in one call, timed with the device synchronised."""
    params = [drivers.params_for(module, r) for r in reqs]
    prompts = [r.prompt_token_ids for r in reqs]
    wall, outs = harness.timed(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params), device)
    return figures(wall, [len(out.outputs[0].token_ids) for out in outs])


def memory_floor(
    parameters: int, config, element_size: int, b: int, workload: dict, bandwidth: float
) -> dict:
    """The least time a decode step of ``b`` requests can take on this memory: it reads every weight once
    and each request's KV cache at the workload's mean context (prompt + max_tokens / 2), bytes moved over
    the measured copy bandwidth (bytes / s). Returns the bytes per step, and the throughput (tok/s) and
    ms per token that this allows."""
    weight_bytes = parameters * element_size
    kv_bytes = (
        2
        * config.n_layer
        * config.n_embd
        * element_size
        * (workload["prompt_tokens"] + workload["max_tokens"] / 2)
    )
    step_s = (weight_bytes + b * kv_bytes) / bandwidth
    return {
        "bytes_per_step": weight_bytes + b * kv_bytes,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_request": kv_bytes,
        "throughput_tok_s": b / step_s,
        "ms_per_token": 1e3 * step_s,
    }


def profile_engine(engine, module, reqs: list[workloads.Request], steps: int, top: int, device: str) -> dict:
    """cProfile over ``steps`` calls of ``engine.step()`` (an ``LLMEngine`` of step 4 on), counted from the
    submission of ``reqs`` (as ``LLM.generate`` submits them: outputs only when finished), the device
    synchronised at the end. The requests left are aborted afterwards. Returns the steps, the wall time
    under the profiler (inflated by it), and the ``top`` functions by own time and by cumulative time."""
    for i, r in enumerate(reqs):
        params = dataclasses.replace(
            drivers.params_for(module, r), output_kind=module.RequestOutputKind.FINAL_ONLY
        )
        engine.add_request(f"profile-{i}", r.prompt_token_ids, params)
    profiler = cProfile.Profile()
    done = 0
    harness.synchronize(device)
    start = time.perf_counter()
    profiler.enable()
    while done < steps and engine.has_unfinished_requests():
        engine.step()
        done += 1
    harness.synchronize(device)
    profiler.disable()
    wall = time.perf_counter() - start
    stats = engine.stats
    for i in range(len(reqs)):
        engine.abort_request(f"profile-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "requests": len(reqs),
        "steps": done,
        "wall_s_profiled": wall,
        "running_at_end": stats.num_running_reqs,
        "top_tottime": top_functions(profiler, "tottime", top),
        "top_cumtime": top_functions(profiler, "cumtime", top),
    }


DTYPE_STUDY_PROMPTS = [
    "The Python interpreter",
    "A list comprehension is a concise way to",
    "Exceptions are raised",
    "def fibonacci(n):",
    "The standard library",
    "In Python, a dictionary",
    "Generators are",
    "import os",
    "Classes bundle data and",
    "The with statement",
    "A decorator is a function that",
    "Strings are immutable",
    "The global interpreter lock",
    "for i in range(10):",
    "Type hints",
    "Virtual environments",
]


def run_dtype_study(spec: dict, device: str) -> dict:
    """Greedy agreement per dtype: ``spec["engine"]`` on ``spec["model"]`` (a trained checkpoint) generates
    ``max_tokens`` greedy tokens (ignore_eos) after each of ``prompts`` prompts (``DTYPE_STUDY_PROMPTS``,
    cut or padded with the demo tokenizer's ids to ``prompt_tokens``), in the reference dtype and in each of
    ``dtypes``. Per dtype: how many outputs are identical to the reference's, the first position where each
    other one differs, and whether the root README's fp16 tier holds there: each side's token is among the
    other side's ``top`` most likely, by step 0's model (fp32, and cast to the dtype) on the reference's
    prefix."""
    module = importlib.import_module(STEP_PACKAGES[spec["engine"]])
    step0 = importlib.import_module("step0_model")
    folder = snapshot(spec["model"])
    params = module.SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    reference = module.LLM(model=str(folder), device=device, dtype=spec["reference"])
    tok = reference.get_tokenizer()
    prompts = []
    for i in range(spec["prompts"]):
        ids = tok.encode(DTYPE_STUDY_PROMPTS[i % len(DTYPE_STUDY_PROMPTS)])
        filler = (
            tok.encode(" " + DTYPE_STUDY_PROMPTS[(i + 1) % len(DTYPE_STUDY_PROMPTS)]) * spec["prompt_tokens"]
        )
        prompts.append((ids + filler)[: spec["prompt_tokens"]])
    ref_ids = [
        o.outputs[0].token_ids for o in reference.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    del reference
    oracle = step0.GPT.from_pretrained(str(folder), device=device)  # fp32
    out = {
        "prompt_token_ids_source": "DTYPE_STUDY_PROMPTS, each followed by the next one repeated, cut to "
        "prompt_tokens",
        "dtypes": {},
    }
    for dtype in spec["dtypes"]:
        llm = module.LLM(model=str(folder), device=device, dtype=dtype)
        low_ids = [
            o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
        ]
        del llm
        low_oracle = step0.GPT.from_pretrained(str(folder), device=device, dtype=getattr(torch, dtype))
        firsts, holds = [], 0
        for prompt, a, b in zip(prompts, ref_ids, low_ids):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                continue
            firsts.append(i)
            ids = torch.tensor([prompt + a[:i]], device=device)
            with torch.inference_mode():
                ref_top = oracle(ids)[0, -1].topk(spec["top"]).indices.tolist()
                low_top = low_oracle(ids)[0, -1].topk(spec["top"]).indices.tolist()
            holds += b[i] in ref_top and a[i] in low_top
        firsts.sort()
        out["dtypes"][dtype] = {
            "prompts": len(prompts),
            "identical": len(prompts) - len(firsts),
            "diverged": len(firsts),
            "first_divergence": firsts,
            "first_divergence_min": firsts[0] if firsts else None,
            "first_divergence_median": firsts[len(firsts) // 2] if firsts else None,
            "tier_holds": holds,
        }
        del low_oracle
        harness.free(device)
    return out


def report(result: dict) -> str:
    """The readable summary printed at the end: per model, per workload and dtype, a table of ms per token
    at B = 1 and tok/s at every B; then the profile's top functions."""
    lines = []
    machine, w = result["machine"], result["workload"]
    lines.append(
        f"gpu on {machine['device']} ({machine.get('gpu') or machine['cpu']}), torch {machine['torch']}, "
        f"transformers {machine['transformers']}, copy bandwidth "
        f"{machine['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, {w['runs']} run(s), medians"
    )
    for r in result.get("earlier_runs", []):
        m = r["machine"]
        lines.append(
            f"  {', '.join(run_parts(r))}: from an earlier run ({m['date']}, {m.get('gpu') or m['cpu']}, "
            f"torch {m['torch']}, {r['runs']} run(s))"
        )
    for name, model in result["models"].items():
        lines.append(f"\n## {name}: {model['parameters'] / 1e6:.1f}M parameters")
        for engine, why in model["skipped"].items():
            lines.append(f"({engine} skipped: {why})")
        for (wname, dtype), points in panels(model).items():
            wl = w["workloads"][wname]
            sizes = [p["batch_size"] for p in points]
            lines.append(
                f"\n{wname} ({wl['prompt_tokens']} + {wl['max_tokens']} tokens), {dtype}: ms/token at B = 1, "
                "tok/s at each B (share of the memory floor at the largest B)"
            )
            rows = []
            for engine in engines_of(points):
                by_b = {p["batch_size"]: p["median"].get(engine) for p in points}
                one = by_b.get(1)
                last = next((by_b[b] for b in reversed(sizes) if by_b[b]), None)
                rows.append(
                    [
                        engine,
                        one and one["ms_per_token"],
                        *[by_b[b] and by_b[b]["throughput_tok_s"] for b in sizes],
                        f"{100 * last['share_of_memory_floor']:.0f}%" if last else None,
                    ]
                )
            floor = [p["memory_floor"] for p in points]
            rows.append(
                [
                    "memory floor",
                    floor[0]["ms_per_token"] if sizes[0] == 1 else None,
                    *[f["throughput_tok_s"] for f in floor],
                    None,
                ]
            )
            lines.append(
                harness.table(["engine", "ms/token B=1", *[f"tok/s B={b}" for b in sizes], "of floor"], rows)
            )
            ratios = points[-1]["ratios"]
            if ratios:
                lines.append(
                    f"throughput at B = {sizes[-1]}, medians of per-run ratios: "
                    + ", ".join(f"{label} {r['median']:.2f}x" for label, r in ratios.items())
                )
        for engine, prof in model.get("profiles", {}).items():
            p = w["profile"]
            lines.append(
                f"\nprofile: {engine}, {p['dtype']}, B = {prof['requests']}, {prof['steps']} steps of "
                f"{p['workload']} ({prof['wall_s_profiled']:.2f} s under cProfile), top 10 by own time"
            )
            lines.append(
                harness.table(
                    ["function", "calls", "tottime s", "cumtime s"],
                    [
                        [r["function"][-70:], r["calls"], r["tottime_s"], r["cumtime_s"]]
                        for r in prof["top_tottime"][:10]
                    ],
                )
            )
    study = result.get("dtype_study")
    if study:
        s = w["dtype_study"]
        lines.append(
            f"\ndtype study: {s['engine']} on {s['model']}, {s['prompts']} prompts x "
            f"{s['max_tokens']} greedy "
            f"tokens against {s['reference']}"
        )
        lines.append(
            harness.table(
                ["dtype", "identical", "first divergence (median, min)", f"top-{s['top']} tier holds"],
                [
                    [
                        d,
                        f"{r['identical']}/{r['prompts']}",
                        f"{r['first_divergence_median']}, {r['first_divergence_min']}"
                        if r["diverged"]
                        else "-",
                        f"{r['tier_holds']}/{r['diverged']}" if r["diverged"] else "-",
                    ]
                    for d, r in study["dtypes"].items()
                ],
            )
        )
    return "\n".join(lines)


def panels(model: dict) -> dict[tuple[str, str], list[dict]]:
    """The points grouped by (workload, dtype), in the order they ran, each group ordered by B."""
    out: dict[tuple[str, str], list[dict]] = {}
    for p in model["points"]:
        out.setdefault((p["workload"], p["dtype"]), []).append(p)
    return {k: sorted(v, key=lambda p: p["batch_size"]) for k, v in out.items()}


def engines_of(points: list[dict]) -> list[str]:
    """The engines that ran at any of the points, in ``ENGINE_NAMES`` order."""
    return [e for e in ENGINE_NAMES if any(e in p["median"] for p in points)]


def plot(result: dict, path: Path) -> Path:
    """Per model, one panel per workload and dtype: throughput against B (log-log) for every engine, the
    memory floor dashed; each engine's ms per token at B = 1 in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    colors = {
        "hf": "C7",
        "hf_static": "C8",
        "step2": "C0",
        "step3": "C1",
        "step4": "C2",
        "step5": "C3",
        "step7": "C4",
        "step8": "C5",
    }
    grid = [
        (name, key, points)
        for name, model in result["models"].items()
        for key, points in panels(model).items()
    ]
    ncols = min(3, len(grid))
    nrows = -(-len(grid) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(grid) :]:
        ax.set_axis_off()
    for ax, (name, (wname, dtype), points) in zip(axes.flat, grid):
        values = []
        for engine in engines_of(points):
            pts = [p for p in points if engine in p["median"]]
            ys = [p["median"][engine]["throughput_tok_s"] for p in pts]
            values += ys
            one = next((p["median"][engine]["ms_per_token"] for p in pts if p["batch_size"] == 1), None)
            label = engine if one is None else f"{engine} ({one:.3g} ms/token at B=1)"
            ax.plot([p["batch_size"] for p in pts], ys, marker="o", label=label, color=colors[engine])
        sizes = [p["batch_size"] for p in points]
        floor = [p["memory_floor"]["throughput_tok_s"] for p in points]
        ax.plot(
            sizes,
            floor,
            linestyle="--",
            color="k",
            linewidth=1,
            label="memory floor (bytes / copy bandwidth)",
        )
        wl = result["workload"]["workloads"][wname]
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="B (requests at once)",
            ylabel="generated tokens / s",
            title=f"{name}: {wname}, {wl['prompt_tokens']} + {wl['max_tokens']} tokens, {dtype}",
        )
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        harness.log_axis(ax.yaxis, values + floor)
        ax.grid(which="major", alpha=0.3)
        ax.legend(fontsize=8)
    machine = result["machine"]
    runs = (
        ""
        if not result.get("earlier_runs")
        else ("; each panel from one run: compare engines within a panel, not across panels")
    )
    fig.suptitle(
        f"GPU benchmark, {machine['device']} ({machine.get('gpu') or machine['cpu']}), "
        f"torch {machine['torch']}, "
        f"median of {result['workload']['runs']} run(s){runs}"
    )
    fig.tight_layout()
    return harness.save_figure(fig, path)

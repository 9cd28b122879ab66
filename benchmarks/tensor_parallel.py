"""Step 15's benchmark: what splitting the model over t ranks (tensor parallelism) costs and buys.

Step 15's ``LLMEngine`` at t = 1 and 2 (CUDA: each t the GPUs and n_head allow) and step 14's, in process,
alternated: B requests of 32 random ids, exactly 64 greedy tokens; tok/s. torch.profiler on rank 0 over
decode steps: the collectives per step, their time, its share of the step. A cost model: GPT-2 124M-1.5B,
fp16, batch 1, H100: weight reads saved against the all-reduces added. Details: benchmarks/README.md.

    python -m benchmarks tensor_parallel                  # CPU, the demo, fp32 (2 ranks on 2 cores)
    python -m benchmarks tensor_parallel --device cuda    # gpt2-124m-random, fp16, t up to the GPUs
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import time
from pathlib import Path

import torch

from common.weights import load_config
from step15_tensor_parallel.parallel_state import ALL_GATHER

from .lib import harness
from .lib.models import snapshot

NAME = "tensor_parallel"
DEFAULT_MODELS = ["demo"]  # on cuda: gpt2-124m-random (see main)
DEFAULT_RUNS = 9
TP_SIZES = {"cpu": (1, 2), "cuda": (1, 2, 4, 8)}  # on cuda: those that the GPUs and the model's n_head allow
TOKEN_ID_SEED = 15000
BLOCK_SIZE = 16
SIZES = {
    # batches, prompt tokens, new tokens; profile: B, decode steps to warm up, then timed, then profiled
    "full": {"batches": [1, 8], "prompt_tokens": 32, "max_tokens": 64, "profile": (8, 3, 10)},
    "quick": {"batches": [1, 2], "prompt_tokens": 32, "max_tokens": 16, "profile": (2, 2, 3)},
}
TARGET = ">= 0.97"  # step 15 at t = 1 against step 14 (no tax)
# The cost model: GPT-2's shapes (layers, width, heads), fp16, batch 1, on an H100.
COST_MODELS = {
    "gpt2 (124M)": (12, 768, 12),
    "gpt2-large (774M)": (36, 1280, 20),
    "gpt2-xl (1.5B)": (48, 1600, 25),
}
VOCAB, POSITIONS = 50257, 1024
HBM_BYTES_PER_S = 3.35e12  # H100 SXM's HBM3, the datasheet's figure
# one all-reduce of a small message (batch 1: C fp16 values, 1.5-3.2 KB) over NVLink: 4-10 us on an H100
# (sglang PR #2904, custom all-reduce against NCCL); latency-bound, so one constant for every t
ALLREDUCE_US = 8
COST_TP = (2, 4, 8)
# the collectives: kind -> the names that torch.distributed's dispatcher (``c10d::...``, counted: one per
# call, on the caller's thread) and the backend (``gloo:...``, ``nccl:...``: the collective itself, on its
# own thread, waits for the peers included) record; and the call this module wraps (``tp.<name>``: how long
# rank 0's thread is held by the call, record_function)
KINDS = {"allreduce": "all_reduce", "allgather": ALL_GATHER, "broadcast": "broadcast"}


def main(
    models: list[str] | None = None, device: str = "cpu", runs: int = DEFAULT_RUNS, quick: bool = False
) -> dict:
    """The CLI entry (``python -m benchmarks tensor_parallel``)."""
    cuda = device.startswith("cuda")
    models = models or (["gpt2-124m-random"] if cuda and not quick else DEFAULT_MODELS)
    return run(models, device, 1 if quick else runs, SIZES["quick" if quick else "full"], quick)


def run(
    models: list[str],
    device: str = "cpu",
    runs: int = DEFAULT_RUNS,
    sizes: dict = SIZES["full"],
    quick: bool = False,
    out_dir: Path = harness.RESULTS,
) -> dict:
    """Every point on each model, the cost model; write ``<out_dir>/tensor_parallel-<device>.json``/.png."""
    started = time.perf_counter()
    cuda = device.startswith("cuda")
    dtype = "float16" if cuda else "float32"
    if not cuda and "OMP_NUM_THREADS" not in os.environ:  # as the engine core and the workers: one thread
        torch.set_num_threads(1)
    result = {
        "benchmark": NAME,
        "machine": harness.machine_info(device, dtype),
        "workload": {
            **{k: v for k, v in sizes.items() if k != "profile"},
            "tp_sizes": "TP_SIZES that fit: t <= the GPUs from the device on (CUDA), t divides n_head",
            "engines": {
                "step14": "step14_data_parallel.LLMEngine",
                "tp<t>": "step15_tensor_parallel.LLMEngine(tensor_parallel_size=t), rank 0 in this process, "
                "t - 1 worker processes",
                "arguments": f"multiprocessing=False, enable_prefix_caching=False, block_size={BLOCK_SIZE}, "
                "max_num_seqs = the largest B, num_kv_blocks for every request; the rest their defaults",
            },
            "prompts": f"uniform over the vocabulary but its last id, random.Random({TOKEN_ID_SEED} + run): "
            "new every run, the same for every engine",
            "sampling": "greedy, ignore_eos: every request generates exactly max_tokens",
            "timing": "every request added, then LLMEngine.step until none is left (prefill included); "
            "tok/s = generated tokens / wall; engines alternated, the order rotated per run, after one "
            "untimed run each; medians over runs, ratios medians of per-run ratios; with more than one "
            "t > 1, one round per t (a process holds one group at a time), step14 and tp1 in each",
            "profile": {
                "batch": sizes["profile"][0],
                "warmup_steps": sizes["profile"][1],
                "steps": sizes["profile"][2],
                "how": "rank 0 under torch.profiler (CPU activities): the decode steps after the prefill "
                "and the warm-up; step_ms from as many unprofiled decode steps just before",
            },
            "torch_threads": torch.get_num_threads(),
            "cores": "on a CPU of 2 cores, t = 2 puts one rank on each, beside this process's own host "
            "work and gloo's threads: t = 1 uses one core, t = 2 both",
            "runs": runs,
            "quick": quick,
        },
        "models": {},
        "cost_model": cost_model(),
    }
    harness.run_models(result, models, lambda name: bench_model(name, device, dtype, runs, sizes))
    return harness.finish(NAME, device, result, started, plot, report, out_dir)


def tp_sizes(device: str, n_head: int) -> list[int]:
    """The t that run: ``TP_SIZES`` of the device's type; on CUDA only those with t GPUs from the device's
    index on; every one a divisor of n_head."""
    if device.startswith("cuda"):
        free = torch.cuda.device_count() - (torch.device(device).index or 0)
        return [t for t in TP_SIZES["cuda"] if t <= free and n_head % t == 0]
    return [t for t in TP_SIZES["cpu"] if n_head % t == 0]


def bench_model(name: str, device: str, dtype: str, runs: int, sizes: dict) -> dict:
    """One model: a round per t > 1 (step14, tp1, tp<t> alternated at each B, then tp<t> profiled)."""
    import step14_data_parallel as step14
    import step15_tensor_parallel as step15

    folder = snapshot(name)
    config = load_config(folder)
    batches, prompt, new = sizes["batches"], sizes["prompt_tokens"], sizes["max_tokens"]
    profile_b, warm, steps = sizes["profile"]
    most = max(*batches, profile_b)
    longest = prompt + max(new, 1 + warm + 2 * steps + 2)
    args = dict(
        model=str(folder),
        device=device,
        dtype=dtype,
        multiprocessing=False,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        max_num_seqs=most,
        num_kv_blocks=most * -(-longest // BLOCK_SIZE),
    )
    sizes_run = tp_sizes(device, config.n_head)
    out = {
        "snapshot": str(folder),
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "tp_sizes": sizes_run,
        "rounds": {},
    }
    step14_engine = step14.LLMEngine(**args)
    tp1 = step15.LLMEngine(**args, tensor_parallel_size=1)
    for t in [t for t in sizes_run if t > 1] or [1]:
        print(f"  round t = {t}", flush=True)
        engines = {"step14": (step14, step14_engine), "tp1": (step15, tp1)}
        if t > 1:
            engines[f"tp{t}"] = (step15, step15.LLMEngine(**args, tensor_parallel_size=t))
        gc.collect()
        gc.freeze()  # a collection over the engines' objects would land on whichever runs then
        try:
            points = {}
            for b in batches:
                points[str(b)] = measure(engines, device, runs, b, prompt, new, config.vocab_size, t)
                print(f"    B={b}: " + summary_line(points[str(b)]), flush=True)
            profile = None
            if t > 1:
                module, engine = engines[f"tp{t}"]
                profile = profile_decode(engine, module, device, config, profile_b, prompt, warm, steps)
                print(f"    profile: {profile_line(profile)}", flush=True)
        finally:
            gc.unfreeze()
            if t > 1:
                engines[f"tp{t}"][1].shutdown()  # the group goes: the next round opens its own
        out["rounds"][str(t)] = {"points": points, "profile": profile}
        harness.free(device)
    return out


def prompts_for(run: int, b: int, p: int, vocab_size: int) -> list[list[int]]:
    """``b`` prompts of ``p`` ids from random.Random(TOKEN_ID_SEED + run) (run -1: the warm-up), never the
    last id (GPT-2's end of text)."""
    ids = random.Random(TOKEN_ID_SEED + run)
    return [[ids.randrange(vocab_size - 1) for _ in range(p)] for _ in range(b)]


def generate(module, engine, prompts: list[list[int]], max_tokens: int, device: str) -> tuple[float, int]:
    """Add every prompt (greedy, ``ignore_eos``), step until none is left: (wall seconds, tokens)."""
    params = module.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    base = f"{time.monotonic_ns()}-"
    harness.synchronize(device)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(base + str(i), ids, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    harness.synchronize(device)
    return time.perf_counter() - start, tokens


def measure(engines: dict, device: str, runs: int, b: int, p: int, g: int, vocab: int, t: int) -> dict:
    """One batch size: the engines alternated; per run tok/s; tp1 / step14 and tp<t> / tp1."""

    def call(name: str):
        module, engine = engines[name]
        count = iter(range(-1, 10**6))

        def once() -> dict:
            wall, tokens = generate(module, engine, prompts_for(next(count), b, p, vocab), g, device)
            return {"wall_s": wall, "generated_tokens": tokens, "tok_per_s": tokens / wall}

        return once

    raw = harness.alternate({name: call(name) for name in engines}, runs, warmup=1)
    ratios = {"tp1/step14": harness.ratio(raw["tp1"], raw["step14"], "tok_per_s")}
    if t > 1:
        ratios[f"tp{t}/tp1"] = harness.ratio(raw[f"tp{t}"], raw["tp1"], "tok_per_s")
    return {
        "batch": b,
        "runs": raw,
        "median": {e: harness.medians(r) for e, r in raw.items()},
        "ratios": ratios,
    }


@contextlib.contextmanager
def annotated_collectives():
    """While in it, each ``torch.distributed`` collective of ``KINDS`` runs inside a
    ``record_function("tp.<name>")``: the profiler then shows how long each call holds rank 0's thread
    (step 15 calls them through the module, so the wrapper is what it calls)."""
    import torch.distributed as dist
    from torch.profiler import record_function

    saved = {name: getattr(dist, name) for name in KINDS.values()}

    def wrapped(name: str, fn):
        def call(*args, **kwargs):
            with record_function(f"tp.{name}"):
                return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, wrapped(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def profile_decode(engine, module, device: str, config, b: int, p: int, warm: int, steps: int) -> dict:
    """``b`` requests prefilled, ``warm`` decode steps, ``steps`` timed decode steps (step_ms), then
    ``steps`` under torch.profiler on rank 0 (CPU activities). Per decode step: the collectives of each
    kind (the dispatcher's ``c10d::`` events), the backend's time in them (``gloo:``/``nccl:``: on its own
    thread, the wait for the peers included) and rank 0's thread held by the calls (``tp.``), the step's
    profiled wall; every collective event's name with its count per step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    params = module.SamplingParams(max_tokens=1 + warm + 2 * steps + 2, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts_for(10**6, b, p, config.vocab_size)):
        engine.add_request(f"profile-{i}", ids, params)
    engine.step()  # the prefill of every prompt (within the token budget)
    for _ in range(warm):
        engine.step()
    harness.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    harness.synchronize(device)
    step_ms = 1e3 * (time.perf_counter() - start) / steps
    with annotated_collectives(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function(f"decode_step_{i}"):
                engine.step()
            harness.synchronize(device)
    while engine.has_unfinished_requests():  # the rest, unprofiled
        engine.step()
    out = {"batch": b, "steps": steps, "step_ms": step_ms}
    names: dict[str, int] = {}
    wall_us = 0.0
    for e in prof.events():
        us = e.time_range.end - e.time_range.start
        if e.name.startswith("decode_step_"):
            wall_us += us
            continue
        where = next((k for k in ("c10d::", "tp.", "gloo:", "nccl:") if e.name.startswith(k)), None)
        for kind, call in KINDS.items():
            short = call.split("_into")[0].split("_single")[0].replace("_", "")  # allreduce, allgather, ...
            if where is None or short not in e.name.replace("_", "").lower():
                continue
            names[e.name] = names.get(e.name, 0) + 1
            key = {"c10d::": "per_step", "tp.": "call_ms_per_step"}.get(where, "ms_per_step")
            out[f"{kind}_{key}"] = (
                out.get(f"{kind}_{key}", 0) + (1 if where == "c10d::" else us / 1e3) / steps
            )
    for kind in KINDS:
        for key in (f"{kind}_per_step", f"{kind}_ms_per_step", f"{kind}_call_ms_per_step"):
            out.setdefault(key, 0)
    out["step_ms_profiled"] = wall_us / 1e3 / steps
    out["allreduce_share"] = out["allreduce_ms_per_step"] / out["step_ms_profiled"]
    out["allreduce_call_share"] = out["allreduce_call_ms_per_step"] / out["step_ms_profiled"]
    out["allreduce_us_each"] = (
        1e3 * out["allreduce_ms_per_step"] / out["allreduce_per_step"] if out["allreduce_per_step"] else None
    )
    out["expected_allreduce_per_step"] = 2 * config.n_layer + 1
    out["event_names_per_step"] = {n: c / steps for n, c in sorted(names.items())}
    return out


def weight_bytes_per_rank(n_layer: int, n_embd: int, t: int, dtype_bytes: int = 2) -> float:
    """The weights one rank reads in a decode step, bytes: the sharded ones (the embedding's vocabulary,
    padded to a multiple of t; c_attn and c_fc with their biases; both c_proj weights) over t, the
    replicated ones (positions, layer norms, the row-parallel biases) whole. t = 1: GPT-2's parameters."""
    L, C = n_layer, n_embd
    vocab = -(-VOCAB // t) * t
    sharded = vocab * C + L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C)
    replicated = POSITIONS * C + L * (4 * C + 2 * C) + 2 * C
    return dtype_bytes * (sharded / t + replicated)


def cost_model() -> dict:
    """Computed, not measured: for each GPT-2 size in fp16 at batch 1 on an H100, the weight-read time
    per decode step at t = 1, 2, 4, 8 (bytes per rank / HBM bandwidth) against the all-reduces the split
    adds ((2 n_layer + 1) x ``ALLREDUCE_US``): it pays where the read time saved exceeds them."""
    out = {
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "allreduce_us": ALLREDUCE_US,
        "dtype_bytes": 2,
        "batch": 1,
        "source": "HBM: H100 SXM datasheet; all-reduce: 4-10 us for a small message on an H100 (sglang PR "
        "#2904), latency-bound at batch 1",
        "not_counted": "the logits' all-gather and the step's broadcast (more collectives: tensor "
        "parallelism pays even less), compute, kernel launches",
        "models": {},
    }
    for name, (L, C, heads) in COST_MODELS.items():
        read_1 = 1e6 * weight_bytes_per_rank(L, C, 1) / HBM_BYTES_PER_S
        model = {
            "n_layer": L,
            "n_embd": C,
            "n_head": heads,
            "params": weight_bytes_per_rank(L, C, 1) / 2,
            "read_us_t1": read_1,
            "allreduce_per_step": 2 * L + 1,
            "tp": {},
        }
        for t in COST_TP:
            read_t = 1e6 * weight_bytes_per_rank(L, C, t) / HBM_BYTES_PER_S
            saved, added = read_1 - read_t, (2 * L + 1) * ALLREDUCE_US
            model["tp"][str(t)] = {
                "bytes_per_rank": weight_bytes_per_rank(L, C, t),
                "read_us": read_t,
                "saved_us": saved,
                "collective_us": added,
                "step_us": read_t + added,
                "pays": saved > added,
                "divides_heads": heads % t == 0,
            }
        model["pays_from_t"] = next((int(t) for t, x in model["tp"].items() if x["pays"]), None)
        out["models"][name] = model
    return out


def summary_line(point: dict) -> str:
    return ", ".join(f"{e} {m['tok_per_s']:.0f}" for e, m in point["median"].items()) + " tok/s"


def profile_line(p: dict) -> str:
    return (
        f"{p['allreduce_per_step']:.0f} all-reduces, {p['allgather_per_step']:.0f} all-gather, "
        f"{p['broadcast_per_step']:.0f} broadcasts per step; all-reduce "
        f"{p['allreduce_ms_per_step']:.2f} ms of {p['step_ms_profiled']:.2f} ms "
        f"({100 * p['allreduce_share']:.0f} %)"
    )


def report(result: dict) -> str:
    machine, quick = result["machine"], result["workload"]["quick"]
    lines = []
    for name, model in result["models"].items():
        lines.append(
            f"{name} ({machine['device']}, {machine['dtype']}, torch threads {machine['torch_threads']})"
        )
        for t, rnd in model["rounds"].items():
            rows = []
            for point in rnd["points"].values():
                m, r = point["median"], point["ratios"]
                tp = f"tp{t}"
                rows.append(
                    [
                        point["batch"],
                        f"{m['step14']['tok_per_s']:,.0f}",
                        f"{m['tp1']['tok_per_s']:,.0f}",
                        f"{m[tp]['tok_per_s']:,.0f}" if tp in m and t != "1" else "",
                        f"{r['tp1/step14']['median']:.3f}x",
                        f"{r[f'{tp}/tp1']['median']:.2f}x" if f"{tp}/tp1" in r else "",
                    ]
                )
            headers = ["B", "step14 tok/s", "tp1 tok/s", f"tp{t} tok/s", "tp1/step14", f"tp{t}/tp1"]
            lines += [f"round t = {t}", harness.table(headers, rows)]
            for point in rnd["points"].values():
                lines.append(
                    harness.target_line(
                        f"step 15 at t = 1 / step 14, B = {point['batch']}",
                        point["ratios"]["tp1/step14"]["median"],
                        TARGET,
                        full_size=not quick,
                    )
                )
            p = rnd["profile"]
            if p:
                rows = [
                    [
                        kind,
                        f"{p[f'{kind}_per_step']:.1f}",
                        f"{p[f'{kind}_ms_per_step']:.2f}",
                        f"{p[f'{kind}_call_ms_per_step']:.2f}",
                    ]
                    for kind in KINDS
                ]
                lines += [
                    f"t = {t}, B = {p['batch']}: collectives per decode step on rank 0 ({p['steps']} steps "
                    f"profiled; expected all-reduces 2 x {model['n_layer']} + 1 = "
                    f"{p['expected_allreduce_per_step']})",
                    harness.table(["collective", "per step", "ms in backend", "ms rank 0 held"], rows),
                    f"decode step {p['step_ms']:.2f} ms ({p['step_ms_profiled']:.2f} ms profiled); "
                    f"all-reduce {p['allreduce_ms_per_step']:.2f} ms of it "
                    f"({100 * p['allreduce_share']:.0f} %), {p['allreduce_us_each']:.0f} us each",
                    "events: " + ", ".join(f"{n} x{c:g}" for n, c in p["event_names_per_step"].items()),
                ]
        if machine["device"] == "cpu":
            lines.append(
                f"a CPU of {machine['cpu_cores']} cores: t = 2 runs a rank on each, beside this process's "
                "host work and gloo's threads; the collectives go through gloo over loopback TCP"
            )
    cm = result["cost_model"]
    rows = []
    for name, m in cm["models"].items():
        for t, x in m["tp"].items():
            rows.append(
                [
                    name,
                    t,
                    f"{x['bytes_per_rank'] / 2**20:,.0f}",
                    f"{m['read_us_t1']:.0f}",
                    f"{x['read_us']:.0f}",
                    f"{x['saved_us']:.0f}",
                    f"{m['allreduce_per_step']} x {cm['allreduce_us']} = {x['collective_us']:.0f}",
                    "yes" if x["pays"] else "no",
                    "" if x["divides_heads"] else f"no ({m['n_head']} heads)",
                ]
            )
    headers = ["model", "t", "MiB/rank", "read us t=1", "read us", "saved us", "all-reduce us", "pays",
               "t | n_head"]  # fmt: skip
    lines += [
        f"cost model: fp16, batch 1, H100 HBM {cm['hbm_bytes_per_s'] / 1e12:.2f} TB/s, all-reduce "
        f"{cm['allreduce_us']} us (not counted: {cm['not_counted']})",
        harness.table(headers, rows),
        "at batch 1 the split pays where the weight reads it saves, (1 - 1/t) of them, outlast its "
        "(2 n_layer + 1) all-reduces: "
        + "; ".join(
            f"{name} from t = {m['pays_from_t']}"
            if m["pays_from_t"]
            else f"{name} at no t up to {COST_TP[-1]}"
            for name, m in cm["models"].items()
        ),
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(len(models) + 1, 2, figsize=(11, 4 * (len(models) + 1)), squeeze=False)
    machine = f"{result['machine']['device']}, {result['machine']['dtype']}"
    for row, (name, model) in zip(axes, models.items()):
        ax, prof_ax = row
        engines: dict[str, dict[int, float]] = {}
        for rnd in model["rounds"].values():
            for point in rnd["points"].values():
                for e, m in point["median"].items():
                    engines.setdefault(e, {}).setdefault(point["batch"], m["tok_per_s"])
        batches = sorted({b for v in engines.values() for b in v})
        width = 0.8 / len(engines)
        for i, (e, by_b) in enumerate(engines.items()):
            xs = [j + i * width for j, b in enumerate(batches) if b in by_b]
            ax.bar(xs, [by_b[b] for b in batches if b in by_b], width, label=e)
        ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(batches))])
        ax.set_xticklabels([f"B = {b}" for b in batches])
        ax.set_ylabel("tok/s")
        ax.set_title(f"{name}: tok/s ({machine})")
        ax.legend()
        profiles = {t: r["profile"] for t, r in model["rounds"].items() if r["profile"]}
        labels = [f"t = {t}" for t in profiles]
        bottom = [0.0] * len(profiles)
        for kind in KINDS:
            ms = [p[f"{kind}_ms_per_step"] for p in profiles.values()]
            prof_ax.bar(labels, ms, bottom=bottom, label=f"{kind} (backend)")
            bottom = [b + m for b, m in zip(bottom, ms)]
        rest = [max(p["step_ms_profiled"] - b, 0) for p, b in zip(profiles.values(), bottom)]
        prof_ax.bar(labels, rest, bottom=bottom, label="the rest of the step", color="lightgrey")
        prof_ax.set_ylabel("ms per decode step (profiled)")
        prof_ax.set_title(f"{name}: a decode step on rank 0")
        prof_ax.legend(fontsize=8)
    cm = result["cost_model"]
    ax, ax2 = axes[-1]
    for name, m in cm["models"].items():
        ts = [int(t) for t in m["tp"]]
        line = ax.plot(ts, [x["saved_us"] for x in m["tp"].values()], "o-", label=f"{name}: read time saved")
        ax.plot(ts, [x["collective_us"] for x in m["tp"].values()], "s--", color=line[0].get_color(),
                label=f"{name}: all-reduces added")  # fmt: skip
        ax2.plot([1, *ts], [m["read_us_t1"], *(x["step_us"] for x in m["tp"].values())], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(map(int, COST_TP)), [str(t) for t in COST_TP])
    ax.set_xlabel("t (ranks)")
    ax.set_ylabel("us per decode step")
    ax.set_title(f"cost model: H100, fp16, batch 1, all-reduce {cm['allreduce_us']} us")
    ax.legend(fontsize=7)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks([1, *COST_TP], ["1", *map(str, COST_TP)])
    ax2.set_xlabel("t (ranks)")
    ax2.set_ylabel("us per decode step: reads + all-reduces")
    ax2.set_title("cost model: a decode step's floor")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return harness.save_figure(fig, path)

"""Serving a workload: drive each engine through a list of requests and measure what a client sees.

The drivers of ``static_batch`` and ``continuous`` (``run_step2``, ``run_step3``, ``run_step4``,
``run_hf``). Each takes a list of ``workloads.Request``, generates exactly ``max_tokens`` per request
(greedy, ``ignore_eos``), shows a request to the engine only once its arrival time has passed, and returns
one record per request (arrival, start, first token, last token: seconds since the start of the run, by
``time.perf_counter``; its padding and wasted positions). ``summarise`` turns the records into one run's
figures: throughput, latency and TTFT from each request's own arrival, and computed over requested
positions (prompt + generated + padding + wasted + recomputed, over prompt + generated).
Details: benchmarks/README.md ("Serving a workload").
"""

from __future__ import annotations

import time

import torch

from . import harness
from .workloads import Request


def params_for(module, r: Request):
    """The request's ``SamplingParams`` of a step module: exactly ``max_tokens`` new tokens, greedy."""
    return module.SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)


def _wait_until(t0: float, arrival_s: float) -> None:
    delay = t0 + arrival_s - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _record(
    r: Request,
    started_s: float,
    first_token_s: float | None,
    finished_s: float,
    generated: int,
    padding: int | None = 0,
    wasted: int | None = 0,
) -> dict:
    return {
        "index": r.index,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": generated,
        "arrival_s": r.arrival_s,
        "started_s": started_s,
        "first_token_s": first_token_s,
        "finished_s": finished_s,
        "padding_tokens": padding,
        "wasted_tokens": wasted,
    }


def run_step2(llm, module, requests: list[Request], device: str = "cpu") -> dict:
    """Step 2 (``step2_kvcache.LLM``, batch 1): every request in one ``generate`` call, served one after
    another. All requests must arrive at 0. Returns {"wall_s", "requests": [records]}."""
    if any(r.arrival_s for r in requests):
        raise ValueError("run_step2 serves requests that all arrive at time 0")
    harness.synchronize(device)
    t0 = time.perf_counter()
    outs = llm.generate(
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        sampling_params=[params_for(module, r) for r in requests],
    )
    harness.synchronize(device)
    wall = time.perf_counter() - t0
    records = []
    for r, out in zip(requests, outs):
        m = out.metrics
        # the request starts when the previous one has finished (or at 0): its prefill begins then
        started = records[-1]["finished_s"] if records else 0.0
        records.append(
            _record(r, started, m.token_times[0] - t0, m.token_times[-1] - t0, len(out.outputs[0].token_ids))
        )
    return {"wall_s": wall, "requests": records}


def run_step3(llm, module, requests: list[Request], batch_size: int, device: str = "cpu") -> dict:
    """Step 3 (``step3_static_batch.LLM`` with ``max_batch_size >= batch_size``): static batches of up to
    ``batch_size`` requests in arrival order, each formed from the requests that have arrived when the
    previous batch ends (one ``generate`` call per batch: one static batch).

    Returns {"wall_s", "requests": [records (padding and wasted None)], "batches": [{"start_s", "end_s",
    "requests" (indices), "capacity" (tokens per row), "kv_bytes" (its KVCache's nbytes), "tokens_stored"
    (real tokens in the cache when it ends: prompt + generated - 1 per row, no padding), "padding_tokens",
    "wasted_tokens" (the engine's counters, ``num_padding_tokens`` and ``num_wasted_tokens``, over the
    batch)}], "kv_peak_bytes" (the largest batch's reservation: one batch runs at a time),
    "kv_peak_tokens_stored", "kv_waste_mean_slots" and "kv_waste_max_slots" (per row: capacity - the real
    tokens it stored)}.
    """
    engine = llm.engine
    if engine.max_batch_size < batch_size:
        raise ValueError(f"batch_size={batch_size} > the engine's max_batch_size={engine.max_batch_size}")
    window = llm.config.n_positions
    pending = sorted(requests, key=lambda r: r.arrival_s)
    records, batches = [], []
    harness.synchronize(device)
    t0 = time.perf_counter()
    while pending:
        _wait_until(t0, pending[0].arrival_s)
        now = time.perf_counter() - t0
        batch = [r for r in pending[:batch_size] if r.arrival_s <= now]
        pending = pending[len(batch) :]
        padding, wasted = engine.num_padding_tokens, engine.num_wasted_tokens  # running totals
        start = time.perf_counter() - t0
        outs = llm.generate(
            prompt_token_ids=[r.prompt_token_ids for r in batch],
            sampling_params=[params_for(module, r) for r in batch],
        )
        harness.synchronize(device)
        end = time.perf_counter() - t0
        generated = [len(out.outputs[0].token_ids) for out in outs]
        for r, out, n in zip(batch, outs, generated):
            m = out.metrics
            records.append(_record(r, start, m.token_times[0] - t0, m.token_times[-1] - t0, n, None, None))
        # the engine's reservation: every row holds the longest prompt + the largest generation budget
        longest = max(r.prompt_tokens for r in batch)
        capacity = longest + max(min(window, r.prompt_tokens + r.max_tokens) - r.prompt_tokens for r in batch)
        kv = module.kv_cache.KVCache(
            llm.config, capacity, "meta", engine.dtype, [0] * len(batch)
        )  # sizes only
        batches.append(
            {
                "start_s": start,
                "end_s": end,
                "requests": [r.index for r in batch],
                "capacity": capacity,
                "kv_bytes": kv.nbytes,
                "tokens_stored": sum(r.prompt_tokens + n - 1 for r, n in zip(batch, generated)),
                "padding_tokens": engine.num_padding_tokens - padding,
                "wasted_tokens": engine.num_wasted_tokens - wasted,
            }
        )
    # a row's waste: the slots it reserved (capacity) minus the real tokens it stored by the batch's end
    stored = {rec["index"]: rec["prompt_tokens"] + rec["generated_tokens"] - 1 for rec in records}
    waste = [b["capacity"] - stored[i] for b in batches for i in b["requests"]]
    return {
        "wall_s": max(b["end_s"] for b in batches),
        "requests": records,
        "batches": batches,
        "kv_peak_bytes": max(b["kv_bytes"] for b in batches),  # one batch at a time
        "kv_peak_tokens_stored": max(b["tokens_stored"] for b in batches),
        "kv_waste_mean_slots": sum(waste) / len(waste),
        "kv_waste_max_slots": max(waste),
    }


def run_step4(engine, module, requests: list[Request], device: str = "cpu") -> dict:
    """Step 4 (``step4_paged_continuous.LLMEngine``): requests added between ``step()`` calls as their
    arrival times pass; the engine steps while it has work and the driver sleeps until the next arrival
    when it has none.

    Also measures the paged KV cache after every step: blocks held (by the running requests, plus those of
    the requests that finished in that step, as they held them during it), real tokens stored, and each
    request's waste (block slots held - tokens stored, sampled at every step). Returns {"wall_s",
    "requests": [records], "steps", "max_running", "mean_running", "num_preemptions", "batched_tokens",
    "kv_block_size", "kv_bytes_per_block", "kv_pool_blocks", "kv_pool_bytes", "kv_peak_blocks",
    "kv_peak_bytes", "kv_peak_tokens_stored", "kv_waste_mean_slots", "kv_waste_max_slots"}.
    """
    blocks = engine.block_manager
    bs = blocks.block_size
    pending = sorted(requests, key=lambda r: r.arrival_s)
    by_id = {str(r.index): r for r in requests}
    started: dict[str, float] = {}
    outputs: dict[str, object] = {}
    preemptions_before = engine.stats.num_preemptions
    steps = batched = running_sum = max_running = 0
    peak_blocks = peak_tokens = 0
    waste_sum = waste_samples = waste_max = 0
    harness.synchronize(device)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            engine.add_request(str(r.index), r.prompt_token_ids, params_for(module, r))
        if not engine.has_unfinished_requests():
            _wait_until(t0, pending[0].arrival_s)
            continue
        step_start = time.perf_counter() - t0
        outs = engine.step()
        steps += 1
        batched += engine.stats.num_batched_tokens
        running_sum += len(outs)
        max_running = max(max_running, len(outs))
        # KV cache during this step: running requests hold ceil(stored / bs) blocks for their stored
        # tokens (all but the newest token, which is not in the cache yet); the finished ones held theirs
        held = {
            seq.request_id: (len(blocks.block_tables[seq.request_id]), len(seq) - 1)
            for seq in engine.scheduler.running
        }
        for out in outs:
            started.setdefault(out.request_id, step_start)
            if out.finished:
                outputs[out.request_id] = out
                stored = len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1
                held[out.request_id] = (blocks.blocks_for(stored), stored)
        peak_blocks = max(peak_blocks, sum(b for b, _ in held.values()))
        peak_tokens = max(peak_tokens, sum(t for _, t in held.values()))
        for b, t in held.values():
            waste_sum += b * bs - t
            waste_samples += 1
            waste_max = max(waste_max, b * bs - t)
    harness.synchronize(device)
    wall = time.perf_counter() - t0
    records = []
    for request_id, r in by_id.items():
        out = outputs[request_id]
        m = out.metrics
        # continuous batching: no padding, and a finished request leaves the batch at once (no waste)
        records.append(
            _record(
                r,
                started[request_id],
                m.token_times[0] - t0,
                m.finished_time - t0,
                len(out.outputs[0].token_ids),
            )
        )
    records.sort(key=lambda rec: rec["index"])
    bytes_per_block = module.PagedKVCache.block_bytes(engine.config, bs, engine.dtype)
    return {
        "wall_s": wall,
        "requests": records,
        "steps": steps,
        "max_running": max_running,
        "mean_running": running_sum / steps,
        "num_preemptions": engine.stats.num_preemptions - preemptions_before,
        # positions the forward passes took: prompt + generated - 1 per request, plus recomputation
        "batched_tokens": batched,
        "kv_block_size": bs,
        "kv_bytes_per_block": bytes_per_block,
        "kv_pool_blocks": blocks.num_blocks,
        "kv_pool_bytes": engine.kv_cache.nbytes,
        "kv_peak_blocks": peak_blocks,
        "kv_peak_bytes": peak_blocks * bytes_per_block,
        "kv_peak_tokens_stored": peak_tokens,
        "kv_waste_mean_slots": waste_sum / waste_samples,
        "kv_waste_max_slots": waste_max,
    }


@torch.inference_mode()
def run_hf(
    model,
    requests: list[Request],
    batch_size: int,
    device: str = "cpu",
    cache_implementation: str | None = None,
) -> dict:
    """Hugging Face ``GPT2LMHeadModel.generate`` (greedy, KV cache on) in batches of ``batch_size`` in
    arrival order; ``batch_size`` 1 is one request after another. A batch is left-padded to its longest
    prompt, with an attention mask, and every row generates the batch's largest max_tokens
    (``min_new_tokens = max_new_tokens``), as a static batch does: the rows' extra tokens are waste.
    All requests must arrive at 0. cache_implementation: generate's ("static": a preallocated cache, and
    on a GPU the decode forward compiled; None: the default dynamic cache). Returns {"wall_s", "requests":
    [records]} (first_token_s is None).
    """
    if any(r.arrival_s for r in requests):
        raise ValueError("run_hf serves requests that all arrive at time 0")
    pad_id = model.config.eos_token_id  # any id: padding is masked out
    records = []
    harness.synchronize(device)
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        longest = max(r.prompt_tokens for r in batch)
        new = max(r.max_tokens for r in batch)
        pads = [longest - r.prompt_tokens for r in batch]
        rows = list(zip(pads, batch))
        input_ids = torch.tensor(
            [[pad_id] * n + r.prompt_token_ids for n, r in rows], device=device
        )  # [B, T]
        attention_mask = torch.tensor(
            [[0] * n + [1] * r.prompt_tokens for n, r in rows], device=device
        )  # [B, T]
        start = time.perf_counter() - t0
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            use_cache=True,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
            **({"cache_implementation": cache_implementation} if cache_implementation else {}),
        )
        harness.synchronize(device)
        end = time.perf_counter() - t0
        for n, r in zip(pads, batch):
            records.append(_record(r, start, None, end, r.max_tokens, n, new - r.max_tokens))
    return {"wall_s": time.perf_counter() - t0, "requests": records}


def summarise(run: dict) -> dict:
    """The figures of one run, from its records (see the module docstring); the run's own extra figures
    (numbers: steps, batched_tokens, max_running ...) and its records are kept alongside.

    throughput_tok_s: generated tokens / wall_s; latency: finished_s - arrival_s; ttft: first_token_s -
    arrival_s (None where the engine gives no first-token time); computed_over_requested as above, with
    step 4's recomputed positions (``batched_tokens`` beyond prompt + generated - 1 per request).
    """
    recs = run["requests"]
    generated = sum(r["generated_tokens"] for r in recs)
    requested = sum(r["prompt_tokens"] + r["generated_tokens"] for r in recs)
    unused = [r["padding_tokens"] + r["wasted_tokens"] for r in recs if r["padding_tokens"] is not None]
    unused += [b["padding_tokens"] + b["wasted_tokens"] for b in run.get("batches", [])]  # step 3: per batch
    computed = requested + sum(unused)
    if "batched_tokens" in run:  # step 4: what its forward passes took, beyond the work asked for
        computed += max(0, run["batched_tokens"] - (requested - len(recs)))
    latencies = [r["finished_s"] - r["arrival_s"] for r in recs]
    ttfts = [r["first_token_s"] - r["arrival_s"] for r in recs if r["first_token_s"] is not None]
    figures = {
        "wall_s": run["wall_s"],
        "requests_served": len(recs),
        "generated_tokens": generated,
        "throughput_tok_s": generated / run["wall_s"],
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_p50_s": harness.percentile(latencies, 50),
        "latency_p95_s": harness.percentile(latencies, 95),
        "ttft_p50_s": harness.percentile(ttfts, 50),
        "ttft_p95_s": harness.percentile(ttfts, 95),
        "requested_tokens": requested,
        "computed_tokens": computed,
        "computed_over_requested": computed / requested,
    }
    extras = {k: v for k, v in run.items() if k not in figures}
    return {**figures, **extras}


def batch_waste(run: dict, batch: dict) -> tuple[int, int]:
    """(padding, wasted) positions of one of step 3's static batches, as its engine counted them. Results
    recorded before the engine counted per batch carry them on the batch's request records instead."""
    if "padding_tokens" in batch:
        return batch["padding_tokens"], batch["wasted_tokens"]
    members = [r for r in run["requests"] if r["index"] in batch["requests"]]
    return sum(r["padding_tokens"] for r in members), sum(r["wasted_tokens"] for r in members)


def compare(
    raw: dict[str, list[dict]], ratios: dict[str, tuple[str, str, str]], keep_records: bool = True
) -> dict:
    """One workload point from ``harness.alternate``'s figures: every run, the medians, and the ratios.

    ratios: label -> (engine a, engine b, figure), e.g. ``"step3/step2": ("step3", "step2",
    "throughput_tok_s")``: the median of a's run i over b's run i. keep_records: keep each run's request
    records and batches (False: only the figures, for sweeps).
    """
    if not keep_records:
        raw = {
            e: [{k: v for k, v in r.items() if k not in ("requests", "batches")} for r in runs]
            for e, runs in raw.items()
        }
    return {
        "runs": raw,
        "median": {engine: harness.medians(runs) for engine, runs in raw.items()},
        "ratios": {label: harness.ratio(raw[a], raw[b], key) for label, (a, b, key) in ratios.items()},
    }


def warm_up(calls: dict[str, object]) -> None:
    """Call each engine once, untimed (lazy initialisation, allocator, thread pool) before measuring."""
    for call in calls.values():
        call()


def warmup_requests(requests: list[Request], n: int | None = None, max_tokens: int = 4) -> list[Request]:
    """A cheap warm-up: the first ``n`` requests (all if None), all at time 0, generating at most
    ``max_tokens`` tokens: the same prompts and batch shapes as the measured runs, a fraction of the time."""
    return [Request(r.index, r.prompt_token_ids, min(r.max_tokens, max_tokens)) for r in requests[:n]]

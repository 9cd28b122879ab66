"""The engines on a CUDA GPU give the CPU's answers, and keep the GPU fed. Skipped without CUDA (CI has none).

fp32 on the GPU: greedy ids identical to the CPU's. fp16 (README.md's tier): at the first token where the
fp16 run and the fp32 reference differ, each side's token is among the other side's top-5 candidates.
Host synchronisation: one engine step of the batching engines (steps 3, 4, 5 and 7, whose decode steps
replay CUDA graphs) waits for the GPU exactly once, when the sampled ids of the whole batch come back
(SYNC_BUDGET). Step 8's steps wait on events only (its own test, test_async_scheduling.py).
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = [
    "step1_generate",
    "step2_kvcache",
    "step3_static_batch",
    "step4_paged_continuous",
    "step5_flash_gpu",
    "step7_cuda_graphs",
    "step8_async_scheduling",
    "step9_prefix_cache",
    "step10_engine_core",
    "step11_speculative",
    "step12_quantized_kv",
    "step13_chunked_prefill",
]
PROMPTS = ["The Python interpreter", "x", "A list comprehension is a concise way to", "Exceptions are raised"]


@pytest.mark.parametrize("step", STEPS)
def test_fp32_gpu_greedy_equals_cpu(step, demo_snapshot):
    module = importlib.import_module(step)
    params = module.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cpu = module.LLM(model=str(demo_snapshot)).generate(PROMPTS, params)
    gpu = module.LLM(model=str(demo_snapshot), device="cuda").generate(PROMPTS, params)
    for a, b in zip(cpu, gpu):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("step", STEPS)
def test_seeded_sampling_on_gpu_is_reproducible(step, demo_snapshot):
    module = importlib.import_module(step)
    llm = module.LLM(model=str(demo_snapshot), device="cuda")
    params = module.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=3)
    assert (
        llm.generate(PROMPTS, params)[0].outputs[0].text == llm.generate(PROMPTS, params)[0].outputs[0].text
    )


def top5_agree(step, demo_snapshot, dtype: str) -> None:
    module = importlib.import_module(step)
    reference = module.LLM(model=str(demo_snapshot), device="cuda")
    low = module.LLM(model=str(demo_snapshot), device="cuda", dtype=dtype)
    params = module.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt, a, b in zip(PROMPTS, reference.generate(PROMPTS, params), low.generate(PROMPTS, params)):
        if a.outputs[0].token_ids == b.outputs[0].token_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)) if x != y)
        prefix = reference.tokenizer.encode(prompt) + a.outputs[0].token_ids[:i]
        ids = torch.tensor([prefix], device="cuda")
        ref_model = importlib.import_module("step0_model").GPT.from_pretrained(
            str(demo_snapshot), device="cuda"
        )
        with torch.inference_mode():
            ref_top = ref_model(ids)[0, -1].topk(5).indices.tolist()
            low_top = ref_model.to(getattr(torch, dtype))(ids)[0, -1].topk(5).indices.tolist()
        assert b.outputs[0].token_ids[i] in ref_top and a.outputs[0].token_ids[i] in low_top, (prompt, i)


@pytest.mark.parametrize(
    "step",
    [
        "step2_kvcache",
        "step4_paged_continuous",
        "step7_cuda_graphs",
        "step8_async_scheduling",
        "step9_prefix_cache",
        "step10_engine_core",
        "step11_speculative",
        "step12_quantized_kv",
        "step13_chunked_prefill",
    ],
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_agrees_in_top5(step, dtype, demo_snapshot):
    top5_agree(step, demo_snapshot, dtype)


def test_step10_engine_core_process_on_gpu_equals_step9(demo_snapshot):
    """The engine core in a child process on CUDA (CUDA graphs, async scheduling): step 9's greedy ids (fp32:
    the child may batch the first step's requests differently, which moves fp16 logits in their last bits)."""
    step9, step10 = (importlib.import_module(s) for s in ("step9_prefix_cache", "step10_engine_core"))
    args = dict(model=str(demo_snapshot), device="cuda")
    fields = dict(max_tokens=40, temperature=0, ignore_eos=True)
    theirs = step9.LLM(**args).generate(PROMPTS, step9.SamplingParams(**fields))
    llm = step10.LLM(multiprocessing=True, **args)
    ours = llm.generate(PROMPTS, step10.SamplingParams(**fields))
    llm.engine_core.shutdown()
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]


def test_step11_speculation_on_gpu_equals_no_speculation(demo_snapshot):
    """Prompt-lookup speculation on CUDA (verification through the Triton kernel, eagerly; plain decode steps
    in CUDA graphs): greedy ids equal the same engine's without speculation (fp32), drafts were accepted,
    no KV block is left held; seeded sampling is reproducible."""
    step11 = importlib.import_module("step11_speculative")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [*PROMPTS, "def f(x): return x\ndef g(x): return x\ndef h(x): return"]
    params = step11.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    theirs = step11.LLM(model=str(demo_snapshot), device="cuda", block_size=4).generate(prompts, params)
    llm = step11.LLM(model=str(demo_snapshot), device="cuda", block_size=4, speculative_config=spec)
    ours = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert llm.stats.spec_decode_num_accepted_tokens > 0 and llm.stats.num_used_blocks == 0
    sampled = step11.SamplingParams(max_tokens=32, temperature=0.9, top_p=0.9, seed=3)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == [
        o.outputs[0].token_ids for o in llm.generate(prompts, sampled)
    ]
    draft = {"method": "draft_model", "model": str(demo_snapshot), "num_speculative_tokens": 3}
    llm = step11.LLM(model=str(demo_snapshot), device="cuda", block_size=4, speculative_config=draft)
    ours = llm.generate(prompts, params)  # the demo drafting for itself, through the Triton kernel
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert llm.stats.spec_decode_acceptance_rate > 0.9


def test_step12_draft_model_over_an_8_bit_target_pool(demo_snapshot):
    """Step 12's draft model (its own pool in the model's dtype, its decode passes in CUDA graphs) drafting
    for a target with an int8 pool: greedy ids equal the same int8 engine's without speculation (fp32), the
    draft's passes replayed, nearly every draft of the demo drafting for itself accepted."""
    step12 = importlib.import_module("step12_quantized_kv")
    args = dict(model=str(demo_snapshot), device="cuda", block_size=4, kv_cache_dtype="int8")
    params = step12.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    theirs = step12.LLM(**args).generate(PROMPTS, params)
    draft = {"method": "draft_model", "model": str(demo_snapshot), "num_speculative_tokens": 4}
    llm = step12.LLM(**args, speculative_config=draft, multiprocessing=False)
    proposer = llm.engine.proposer
    assert proposer.kv_cache.k[0].dtype == torch.float32 and proposer.graph_runner is not None
    ours = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    assert llm.stats.spec_decode_acceptance_rate > 0.8 and llm.stats.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_step12_8_bit_kv_on_gpu(demo_snapshot, mode):
    """An 8-bit pool on CUDA (the Triton kernel dequantizing, decode replayed from CUDA graphs, async
    scheduling): fp32 greedy ids equal the torch backend's on the same pool for 24 tokens and auto's for 16
    (the CPU margin); fp16 stays finite; the kernel equals its reference at GPT-2's shapes (fp16, 1e-2). The
    write kernel against the torch write, bit for bit: step 12's own GPU tests."""
    step12 = importlib.import_module("step12_quantized_kv")
    kernels = importlib.import_module("step12_quantized_kv.kernels")
    quantize = importlib.import_module("step12_quantized_kv.kv_quant").quantize
    args = dict(model=str(demo_snapshot), device="cuda", block_size=16)
    params = step12.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = {
        name: [o.outputs[0].token_ids for o in step12.LLM(**args, **kw).generate(PROMPTS, params)]
        for name, kw in {
            "triton": dict(kv_cache_dtype=mode),
            "torch": dict(kv_cache_dtype=mode, attention_backend="torch"),
            "auto": {},
        }.items()
    }
    assert ids["triton"] == ids["torch"]
    assert [i[:16] for i in ids["triton"]] == [i[:16] for i in ids["auto"]]
    logprobs = step12.SamplingParams(max_tokens=24, temperature=0, logprobs=1, ignore_eos=True)
    outs = step12.LLM(**args, dtype="float16", kv_cache_dtype=mode).generate(PROMPTS, logprobs)
    assert all(
        torch.isfinite(torch.tensor(lp.logprob))
        for o in outs
        for d in o.outputs[0].logprobs
        for lp in d.values()
    )
    torch.manual_seed(0)
    blocks, H, D, S, L = 64 * 64, 12, 64, 64, 1000  # 64 sequences of 1,000 tokens in blocks of 16
    kq, ks = quantize(torch.randn(blocks * 16, H, D, device="cuda"), kernels.QUANTIZED_DTYPES[mode == "fp8"])
    vq, vs = quantize(torch.randn(blocks * 16, H, D, device="cuda"), kq.dtype)
    k, v = kq.view(blocks, 16, H, D), vq.view(blocks, 16, H, D)
    k_scale, v_scale = ks.view(blocks, 16, H), vs.view(blocks, 16, H)
    tables = torch.randperm(blocks, device="cuda")[: S * 64].view(S, 64)
    q = torch.randn(S, H, D, device="cuda", dtype=torch.float16)
    seq_lens, qsl = torch.full((S,), L, device="cuda"), torch.arange(S + 1, device="cuda")
    call = (q, k, v, tables, seq_lens, qsl, 1)
    out = kernels.paged_attention(*call, k_scale=k_scale, v_scale=v_scale)
    ref = kernels.paged_attention_reference(*call, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


SYNC_BUDGET = (
    1  # per engine step: the one .tolist() of the batch's sampled ids (and logprobs, packed with them)
)


def syncs_in_one_step(step) -> int:
    """How many times one engine step (``step()``) makes the host wait for the GPU (torch's sync debug mode
    warns at each such call)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # each sync warns "called a synchronizing CUDA operation"; the first use of the mode in a process also
    # warns that it "does not yet detect all synchronizing operations", which is not a sync
    return sum("called a synchronizing" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    "step", ["step3_static_batch", "step4_paged_continuous", "step5_flash_gpu", "step7_cuda_graphs"]
)
def test_one_host_sync_per_engine_step(step, demo_snapshot):
    module = importlib.import_module(step)
    llm = module.LLM(model=str(demo_snapshot), device="cuda")
    engine = llm.engine
    mixed = [
        module.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        module.SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
        module.SamplingParams(
            max_tokens=40, temperature=1.0, top_k=20, repetition_penalty=1.2, ignore_eos=True
        ),
        module.SamplingParams(
            max_tokens=40, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, ignore_eos=True
        ),
    ]
    logprobs = module.SamplingParams(max_tokens=5, temperature=0, logprobs=2)
    if step == "step3_static_batch":  # no request API before step 4: the engine runs a list, a step per item
        requests = [*zip(PROMPTS, mixed), (PROMPTS[0], logprobs)]  # one batch, logprobs asked from the start
        steps = engine.run([engine.make_sequence(f"r{i}", *request) for i, request in enumerate(requests)])
        advance = lambda: next(steps)  # noqa: E731
    else:
        for i, (prompt, params) in enumerate(zip(PROMPTS, mixed)):
            engine.add_request(f"r{i}", prompt, params)
        advance = engine.step
    advance()  # the prefill; warm-up
    advance()
    counts = [syncs_in_one_step(advance) for _ in range(5)]  # decode steps
    assert counts == [SYNC_BUDGET] * 5, counts
    if step != "step3_static_batch":
        engine.add_request("late", PROMPTS[0], logprobs)
        assert syncs_in_one_step(advance) == SYNC_BUDGET  # a request asking for logprobs, and a prefill

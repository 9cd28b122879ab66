"""The engines on a CUDA GPU give the CPU's answers. Skipped without CUDA (CI has none).

fp32 on the GPU: greedy ids identical to the CPU's. fp16 (README.md's tier): at the first token where the
fp16 run and the fp32 reference differ, each side's token is among the other side's top-5 candidates.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = ["step1_generate", "step2_kvcache", "step3_static_batch", "step4_paged_continuous"]
PROMPTS = ["The Python interpreter", "x", "A list comprehension is a concise way to", "Exceptions are raised"]


@pytest.mark.parametrize("step", STEPS)
def test_fp32_gpu_greedy_equals_cpu(step, demo_snapshot):
    module = importlib.import_module(step)
    params = module.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cpu = module.LLM(model=str(demo_snapshot)).generate(PROMPTS, params)
    gpu = module.LLM(model=str(demo_snapshot), device="cuda").generate(PROMPTS, params)
    for a, b in zip(cpu, gpu):
        assert a.token_ids == b.token_ids


@pytest.mark.parametrize("step", STEPS)
def test_seeded_sampling_on_gpu_is_reproducible(step, demo_snapshot):
    module = importlib.import_module(step)
    llm = module.LLM(model=str(demo_snapshot), device="cuda")
    params = module.SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, seed=3)
    assert llm.generate(PROMPTS, params)[0].text == llm.generate(PROMPTS, params)[0].text


def top5_agree(step, demo_snapshot, dtype: str) -> None:
    module = importlib.import_module(step)
    reference = module.LLM(model=str(demo_snapshot), device="cuda")
    low = module.LLM(model=str(demo_snapshot), device="cuda", dtype=dtype)
    params = module.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt, a, b in zip(PROMPTS, reference.generate(PROMPTS, params), low.generate(PROMPTS, params)):
        if a.token_ids == b.token_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        prefix = reference.tokenizer.encode(prompt) + a.token_ids[:i]
        ids = torch.tensor([prefix], device="cuda")
        ref_model = importlib.import_module("step0_model").GPT.from_pretrained(str(demo_snapshot), device="cuda")
        with torch.inference_mode():
            ref_top = ref_model(ids)[0, -1].topk(5).indices.tolist()
            low_top = ref_model.to(low.model.wte.weight.dtype)(ids)[0, -1].topk(5).indices.tolist()
        assert b.token_ids[i] in ref_top and a.token_ids[i] in low_top, (prompt, i)


@pytest.mark.parametrize("step", ["step2_kvcache", "step4_paged_continuous"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_agrees_in_top5(step, dtype, demo_snapshot):
    top5_agree(step, demo_snapshot, dtype)

"""Step 5 tests: the engine with the Triton attention backend gives step 4's outputs.

On a machine without CUDA the kernels run through Triton's interpreter (the root conftest.py switches it
on), on short requests: greedy ids equal step 4's, also with preemption, block boundaries and a batch that
mixes prefills and decodes. With CUDA (``gpu`` tests): fp32 greedy ids equal step 4's on the GPU, and fp16 /
bf16 are within the top-5 tier of README.md. The kernels themselves are tested in test_kernels.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import step4_paged_continuous

from .__main__ import main as cli_main
from .config import EngineArgs, choose_attention_backend
from .engine import LLMEngine
from .kernels import triton_usable
from .llm import LLM
from .sampling_params import SamplingParams

PROMPTS = [
    "The Python interpreter",
    "x",
    "A list comprehension is a concise way to",
    "Exceptions are raised when",
]
needs_triton = pytest.mark.skipif(
    not triton_usable("cuda" if torch.cuda.is_available() else "cpu"),
    reason="Triton's interpreter was not switched on before triton was imported",
)


def step4_outputs(demo_snapshot, prompts, params, **engine_args):
    llm = step4_paged_continuous.LLM(model=str(demo_snapshot), **engine_args)
    p4 = step4_paged_continuous.SamplingParams(**params)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p4)]


def test_backend_choice(tmp_path):
    assert choose_attention_backend("auto", torch.device("cpu")) == "torch"
    assert choose_attention_backend("torch", torch.device("cpu")) == "torch"
    if torch.cuda.is_available():
        assert choose_attention_backend("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError) as error:  # refused before the model is looked for (here there is none)
        EngineArgs(model=str(tmp_path / "nothing-here"), attention_backend="flash")
    assert str(error.value) == "attention_backend='flash': must be one of ['auto', 'triton', 'torch']"


@needs_triton
def test_triton_refuses_bfloat16_on_the_cpu(demo_snapshot):
    """Triton's interpreter computes bf16 dot products wrongly (garbage text, no error): refused up front."""
    assert choose_attention_backend("triton", torch.device("cpu"), torch.float16) == "triton"
    with pytest.raises(ValueError, match="bfloat16.*interpreter"):
        LLMEngine(model=str(demo_snapshot), attention_backend="triton", dtype="bfloat16")
    assert LLMEngine(model=str(demo_snapshot), dtype="bfloat16").attention_backend == "torch"  # auto: fine


def test_torch_backend_is_step4(demo_snapshot):
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(model=str(demo_snapshot), attention_backend="torch")
    assert llm.engine.attention_backend == "torch"
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**params))]
    assert ours == step4_outputs(demo_snapshot, PROMPTS, params)


@needs_triton
@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_backend_greedy_equals_step4(demo_snapshot, block_size):
    """A mixed batch: prompts of 1 to 9 tokens, prefilled together, then decoded across block boundaries;
    with block size 4 and a pool of 12 blocks, requests are also preempted and prefilled again."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    engine_args = dict(block_size=block_size, max_num_seqs=4)
    if block_size == 4:
        engine_args["num_kv_blocks"] = 12
    llm = LLM(model=str(demo_snapshot), device=device, attention_backend="triton", **engine_args)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**params))]
    assert ours == step4_outputs(demo_snapshot, PROMPTS, params, **engine_args)
    if block_size == 4:
        assert llm.engine.stats.num_preemptions > 0


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_stale_values_in_the_pool_never_reach_a_request(demo_snapshot, backend, stale):
    """Every slot of the pool holds NaN, then Inf, before the first request (an earlier fp16 request can
    leave such values in blocks later reused): each backend's greedy ids equal step 4's on a clean pool,
    for prompts of 1 to 9 tokens decoded across block boundaries, preempted and recomputed in reused
    blocks (12 blocks of 4 tokens)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = dict(max_tokens=10, temperature=0, ignore_eos=True)
    engine_args = dict(block_size=4, num_kv_blocks=12, max_num_seqs=4)
    llm = LLM(model=str(demo_snapshot), device=device, attention_backend=backend, **engine_args)
    for pool in llm.engine.kv_cache.k + llm.engine.kv_cache.v:  # [num_blocks, block_size, H, D] per layer
        pool.fill_(stale)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**params))]
    assert llm.engine.stats.num_preemptions > 0
    assert ours == step4_outputs(demo_snapshot, PROMPTS, params, **engine_args)


def test_triton_backend_refused_where_it_cannot_run(demo_snapshot, monkeypatch):
    from . import config

    monkeypatch.setattr(config, "kernels", None)  # as if Triton were not installed
    with pytest.raises(ValueError, match="Triton"):
        LLMEngine(model=str(demo_snapshot), attention_backend="triton")
    assert LLMEngine(model=str(demo_snapshot), attention_backend="auto").attention_backend == "torch"


def test_cli_attention_backend(demo_snapshot, run_main):
    args = ["The Python interpreter", "x", "--max-tokens", "4", "--attention-backend", "torch"]
    status, _, stderr = run_main(cli_main, args)  # in this process
    assert status == 0, stderr
    assert "torch attention" in stderr
    status, stdout, _ = run_main(cli_main, ["hi", "--attention-backend", "flash"])
    assert status == 2 and stdout == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp32_greedy_equals_step4(demo_snapshot):
    params = dict(max_tokens=32, temperature=0, ignore_eos=True)
    llm = LLM(model=str(demo_snapshot), device="cuda")
    assert llm.engine.attention_backend == "triton"
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**params))]
    assert ours == step4_outputs(demo_snapshot, PROMPTS, params, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_half_precision_in_top5_tier(demo_snapshot, dtype):
    """At the first token where the half-precision run differs from fp32, each side's token is in the other
    side's top-5 (README.md's tier), the logits computed by step 0 in each dtype."""
    from step0_model import GPT as Step0GPT

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    reference = LLM(model=str(demo_snapshot), device="cuda").generate(PROMPTS, params)
    low = LLM(model=str(demo_snapshot), device="cuda", dtype=dtype).generate(PROMPTS, params)
    model = Step0GPT.from_pretrained(str(demo_snapshot), device="cuda")
    low_model = Step0GPT.from_pretrained(str(demo_snapshot), device="cuda", dtype=getattr(torch, dtype))
    for a, b in zip(reference, low):
        a_ids, b_ids = a.outputs[0].token_ids, b.outputs[0].token_ids
        if a_ids == b_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y)
        ids = torch.tensor([a.prompt_token_ids + a_ids[:i]], device="cuda")
        with torch.inference_mode():
            assert b_ids[i] in model(ids)[0, -1].topk(5).indices.tolist()
            assert a_ids[i] in low_model(ids)[0, -1].topk(5).indices.tolist()


NO_COMPILE_WHILE_SERVING = """
import sys, torch, triton
from step5_flash_gpu import LLMEngine, SamplingParams
engine = LLMEngine(model=sys.argv[1], device="cuda", dtype="float16", max_num_seqs=8)  # warms the kernels up
compiled = []
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
g = torch.Generator().manual_seed(0)
for i, n in enumerate([1, 5, 17, 40, 64, 65, 100, 300]):  # every tile configuration, batches of every size
    prompt = torch.randint(0, 8000, (n,), generator=g).tolist()
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=8 + 25 * i, temperature=0, ignore_eos=True))
    engine.step()
while engine.has_unfinished_requests():
    engine.step()
print(len(compiled), compiled[:3])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_compiles_nothing_while_serving(demo_snapshot):
    """In a fresh process (Triton compiles on first use per process): after LLMEngine's warm-up, requests of
    every prompt length band and batches that grow and shrink launch only kernels compiled already."""
    if not hasattr(getattr(__import__("triton"), "knobs", None), "runtime"):
        pytest.skip("this Triton version has no compile hook to count compilations with")
    run = subprocess.run(
        [sys.executable, "-c", NO_COMPILE_WHILE_SERVING, str(demo_snapshot)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "0", run.stdout

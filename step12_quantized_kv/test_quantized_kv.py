"""Step 12 tests: an 8-bit KV cache changes what the pool holds, barely what the model says.

Quantize / dequantize at the edges (zeros, one huge outlier, negative maxima, a block filled token by token)
within each mode's error bound; the Triton kernel (interpreter) equal to the plain-PyTorch reference on int8
and fp8 pools (prefill and decode, paged, block sizes 4 / 8 / 16, lanes crossing blocks); a pool of stale
NaN / Inf never read; the capacity arithmetic; "auto" exactly step 11; int8 and fp8 greedy continuations of
the demo checkpoint equal auto's over 48 tokens; prefix caching, copy-on-write (n > 1), preemption and
speculative decoding on 8-bit blocks equal the same engine without them; int8 and fp8 through the server.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

import step11_speculative

from . import kernels
from .config import EngineArgs, check_kv_cache_dtype
from .engine import LLMEngine
from .kv_cache import PagedKVCache
from .kv_quant import SCALE_DTYPE, dequantize, qmax, quantize
from .llm import LLM
from .sampling_params import SamplingParams

BLOCK = 4
MODES = ["int8", "fp8"]
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
PROMPTS = [
    "The Python interpreter",
    "x",
    "A list comprehension is a concise way to",
    "def f(x): return x\ndef g(x): return x\ndef h(x): return",
    "import os\nimport sys\nimport os\nimport sys\nimport",
    "Exceptions are raised when an error occurs. Exceptions are",
]
# Measured (demo checkpoint, fp32, torch backend): int8 and fp8 each agree with auto on all 6 prompts x 48
# greedy tokens; asserted over the first 32 of each, the margin.
AGREE_TOKENS = 32


def greedy_ids(llm, prompts=PROMPTS, params=SamplingParams, **fields) -> list[list[int]]:
    """Each prompt's greedy ids (48 tokens unless told); ``params``: the SamplingParams of llm's step."""
    p = params(**{"max_tokens": 48, "temperature": 0, **fields})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p)]


@pytest.fixture(scope="module")
def auto(demo_snapshot):
    return LLM(model=str(demo_snapshot), block_size=BLOCK)


@pytest.fixture(scope="module", params=MODES)
def quant(request, demo_snapshot):
    return LLM(model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype=request.param)


# ---- quantize / dequantize ---------------------------------------------------------------------------------


def error_bound(x: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """The most |x - dequantize(quantize(x))| each element may be off: int8 rounds to half a step
    (scale / 2); e4m3 keeps 3 mantissa bits (2^-4 of |x|), 2^-9 of the scale below its normal range; plus
    float16's rounding of the scale (2^-11 of the row's amax)."""
    s = scale.float()[..., None]
    amax = x.abs().amax(-1, keepdim=True)
    step = 0.5 * s if mode == "int8" else x.abs() * 2**-4 + s * 2**-9
    return step * 1.001 + amax * 2**-10


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_is_within_the_bound(mode):
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 3, 64)[:, None, None]  # [N, H, D], amax 1e-3 .. 1e3
    values, scale = quantize(x, DTYPES[mode])
    assert values.dtype == DTYPES[mode] and scale.dtype == SCALE_DTYPE and scale.shape == (64, 4)
    back = dequantize(values, scale, torch.float32)
    assert ((back - x).abs() <= error_bound(x, scale, mode)).all()
    rel = ((back - x).norm(dim=-1) / x.norm(dim=-1)).max().item()
    assert rel < (0.01 if mode == "int8" else 0.04)  # relative error of a token-head's vector


@pytest.mark.parametrize("mode", MODES)
def test_zeros_get_scale_zero_and_no_nan(mode):
    x = torch.zeros(3, 2, 8)
    x[1, 1] = torch.linspace(-1, 1, 8)
    values, scale = quantize(x, DTYPES[mode])
    back = dequantize(values, scale, torch.float32)
    assert scale[0].eq(0).all() and scale[1, 0] == 0 and scale[1, 1] > 0
    assert torch.isfinite(back).all() and back[0].eq(0).all()
    assert (back - x).abs().max() <= 1 / 127


@pytest.mark.parametrize("mode", MODES)
def test_one_huge_outlier_keeps_itself_and_costs_the_rest_resolution(mode):
    x = torch.randn(1, 1, 64)
    x[0, 0, 7] = 1e4
    values, scale = quantize(x, DTYPES[mode])
    back = dequantize(values, scale, torch.float32)
    assert abs(back[0, 0, 7].item() - 1e4) <= 1e4 * 2**-10  # the outlier: the top of the range, exact-ish
    assert ((back - x).abs() <= error_bound(x, scale, mode)).all()  # the rest: within a step of the scale


@pytest.mark.parametrize("mode", MODES)
def test_float16s_largest_values_come_back_finite(mode):
    """+-65504 (float16's largest) over a scale that float16 rounds up (65504 / 127 -> 516): back in
    float16 they are themselves, not inf."""
    x = torch.tensor([[[65504.0, -65504.0, 1.0, 0.0]]], dtype=torch.float16)
    values, scale = quantize(x, DTYPES[mode])
    back = dequantize(values, scale, torch.float16)
    assert torch.isfinite(back).all() and back[0, 0, :2].tolist() == [65504.0, -65504.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_negative_maximum_maps_to_the_bottom_of_the_range(mode):
    x = torch.tensor([[[0.5, -3.0, 1.0, 2.9]]])
    values, scale = quantize(x, DTYPES[mode])
    assert values.float()[0, 0, 1].item() == pytest.approx(-qmax(DTYPES[mode]), rel=2**-8)
    assert dequantize(values, scale, torch.float32)[0, 0, 1].item() == pytest.approx(-3.0, rel=2**-9)


@pytest.mark.parametrize("mode", MODES)
def test_a_block_filled_token_by_token_keeps_each_tokens_scale(tiny_snapshot, mode):
    """Writing token t never changes the values or the scale of tokens before it in the same block (a scale
    per token and head: no rescaling of what is stored), and each slot holds its own token's quantization."""
    from common.weights import load_config

    config = load_config(tiny_snapshot)
    cache = PagedKVCache(config, 3, 8, "cpu", torch.float32, mode)
    torch.manual_seed(1)
    k = torch.randn(8, config.n_head, config.head_dim) * torch.arange(1, 9)[:, None, None]  # growing amax
    v = -k
    for t in range(8):
        before = cache.k[0][1].clone(), cache.k_scale[0][1].clone()
        cache.write(0, k[t : t + 1], v[t : t + 1], torch.tensor([8 + t]))
        assert torch.equal(cache.k[0][1][:t].view(torch.uint8), before[0][:t].view(torch.uint8))
        assert torch.equal(cache.k_scale[0][1][:t], before[1][:t])
    want_values, want_scale = quantize(k, DTYPES[mode])
    assert torch.equal(cache.k[0][1].view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(cache.k_scale[0][1], want_scale)
    kb, vb = cache.gather(0, torch.tensor([[1]]))
    assert torch.allclose(kb[0], -vb[0]) and torch.allclose(kb[0], k, rtol=0.07, atol=0.05)


def test_copy_on_write_copies_the_scales(tiny_snapshot):
    from common.weights import load_config

    config = load_config(tiny_snapshot)
    cache = PagedKVCache(config, 4, 4, "cpu", torch.float32, "int8")
    x = torch.randn(4, config.n_head, config.head_dim)
    for layer in range(config.n_layer):
        cache.write(layer, x, 2 * x, torch.arange(4, 8))  # block 1
    cache.copy_blocks([(1, 3)])
    for layer in range(config.n_layer):
        assert torch.equal(cache.k[layer][3], cache.k[layer][1])
        assert torch.equal(cache.k_scale[layer][3], cache.k_scale[layer][1]) and cache.k_scale[layer][3].all()
        assert torch.equal(cache.v_scale[layer][3], cache.v_scale[layer][1])


# ---- the capacity arithmetic -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp8_e4m3"])
def test_a_byte_budget_holds_about_1_9x_the_tokens_of_fp16(demo_snapshot, mode):
    budget = 64 * 2**20
    fp16 = EngineArgs(model=str(demo_snapshot), dtype="float16", kv_cache_memory=budget)
    q = EngineArgs(model=str(demo_snapshot), dtype="float16", kv_cache_memory=budget, kv_cache_dtype=mode)
    c = fp16.hf_config
    assert q.num_kv_blocks / fp16.num_kv_blocks >= 1.88  # 2 x D bytes vs D + 2: 128 / 66 = 1.94 for GPT-2
    per_block = PagedKVCache.block_bytes(c, 16, torch.float16, mode)
    assert per_block == 2 * c.n_layer * 16 * c.n_head * (c.head_dim + 2)
    cache = PagedKVCache(c, 5, 16, "cpu", torch.float16, mode)
    assert cache.nbytes == 5 * per_block  # what the formula counts is what is allocated
    gpt2_ratio = (2 * 64) / (64 + SCALE_DTYPE.itemsize)
    assert gpt2_ratio >= 1.9


def test_a_bad_kv_cache_dtype_is_refused(demo_snapshot, monkeypatch):
    with pytest.raises(ValueError, match="kv_cache_dtype='int4'"):
        EngineArgs(model=str(demo_snapshot), kv_cache_dtype="int4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        check_kv_cache_dtype("fp8", "triton", torch.device("cuda"))
    check_kv_cache_dtype("int8", "triton", torch.device("cuda"))  # int8 runs on an A100
    check_kv_cache_dtype("fp8", "torch", torch.device("cpu"))  # torch converts e4m3 on the CPU


# ---- the Triton kernel on 8-bit pools ----------------------------------------------------------------------


def quantized_pool(mode, lens, block_size, H=2, D=32, stale=float("nan")):
    """An 8-bit pool holding S sequences of ``lens`` tokens in shuffled blocks, every slot not written
    filled with ``stale`` (values and scales): (k, v, k_scale, v_scale, block_tables)."""
    torch.manual_seed(len(lens) + block_size)
    widths = [math.ceil(L / block_size) for L in lens]
    num_blocks = sum(widths) + 2
    k, v = (torch.full((num_blocks, block_size, H, D), stale).to(DTYPES[mode]) for _ in range(2))
    k_scale, v_scale = (torch.full((num_blocks, block_size, H), stale, dtype=SCALE_DTYPE) for _ in range(2))
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int64)
    used = 0
    for s, L in enumerate(lens):
        tables[s, : widths[s]] = order[used : used + widths[s]]
        used += widths[s]
        slots = tables[s, torch.arange(L) // block_size] * block_size + torch.arange(L) % block_size
        for pool, scales in ((k, k_scale), (v, v_scale)):
            values, scale = quantize(torch.randn(L, H, D) * 3, DTYPES[mode])
            pool.view(-1, H, D)[slots] = values
            scales.view(-1, H)[slots] = scale
    return k, v, k_scale, v_scale, tables


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_triton_equals_the_reference_on_8_bit_pools(mode, block_size):
    """Prefills (one with cached context), decodes and lanes crossing blocks in one launch: the kernel's
    K scale on the scores and V scale on the probabilities equal dequantize-then-attend."""
    lens, query_lens = [37, 9, 20, 5, 18], [37, 4, 1, 1, 1]  # a prompt, a chunk over cache, three decodes
    k, v, ks, vs, tables = quantized_pool(mode, lens, block_size)
    H, D = k.shape[2], k.shape[3]
    torch.manual_seed(2)
    q = torch.randn(sum(query_lens), H, D)
    seq_lens = torch.tensor(lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    out = kernels.paged_attention(q, k, v, tables, seq_lens, qsl, 37, k_scale=ks, v_scale=vs)
    ref = kernels.paged_attention_reference(q, k, v, tables, seq_lens, qsl, 37, k_scale=ks, v_scale=vs)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # decodes alone, the decode tile (16 rows)
    dq = q[-3:].contiguous()
    dqsl = torch.arange(4)
    out = kernels.paged_attention(dq, k, v, tables[2:], seq_lens[2:], dqsl, 1, k_scale=ks, v_scale=vs)
    ref = kernels.paged_attention_reference(
        dq, k, v, tables[2:], seq_lens[2:], dqsl, 1, k_scale=ks, v_scale=vs
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_triton_on_an_8_bit_pool_in_float16():
    k, v, ks, vs, tables = quantized_pool("int8", [21, 3], 8)
    q = torch.randn(4, 2, 32, dtype=torch.float16)
    seq_lens, qsl = torch.tensor([21, 3]), torch.tensor([0, 1, 4])
    out = kernels.paged_attention(q, k, v, tables, seq_lens, qsl, 3, k_scale=ks, v_scale=vs)
    ref = kernels.paged_attention_reference(q, k, v, tables, seq_lens, qsl, 3, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def test_the_kernel_refuses_inconsistent_scales():
    k, v, ks, vs, tables = quantized_pool("int8", [5], 4)
    q, seq_lens, qsl = torch.randn(1, 2, 32), torch.tensor([5]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="give both"):
        kernels.paged_attention(q, k, v, tables, seq_lens, qsl, 1, k_scale=ks)
    with pytest.raises(ValueError, match="k_cache and v_cache must have q's dtype"):
        kernels.paged_attention(q, k, v, tables, seq_lens, qsl, 1)
    with pytest.raises(ValueError, match="v_scale must be"):
        kernels.paged_attention(q, k, v, tables, seq_lens, qsl, 1, k_scale=ks, v_scale=vs[:, :2])


def projected_kv(config, N: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [N, H, D] as the model makes them: views into one [N, 3C] projection (rows of stride 3C), with
    a token of zeros, a huge outlier, a negative maximum and values on rounding ties (x.5 steps)."""
    torch.manual_seed(3)
    qkv = (torch.randn(N, 3 * config.n_embd) * torch.logspace(-4, 2, N)[:, None]).to(dtype)
    k, v = (
        t.view(N, config.n_head, config.head_dim) for t in qkv[:, config.n_embd :].split(config.n_embd, 1)
    )
    k[2], v[2] = 0.0, 0.0
    k[3, 0, 5] = 1e3
    v[4, 1] = -torch.arange(config.head_dim, dtype=dtype)
    k[5, 1] = torch.arange(config.head_dim, dtype=dtype) * (127 / 63) / 2  # many values at x.5 steps
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_write_kernel_stores_what_the_torch_write_stores(tiny_snapshot, dtype):
    """kv_write.py's kernel (int8, interpreter) against PagedKVCache.write: values and scales bit for bit."""
    from common.weights import load_config

    from .kv_write import CPU_FP8_WRITE, write_kv_quantized

    config = load_config(tiny_snapshot)
    k, v = projected_kv(config, 9, dtype)
    slots = torch.randperm(24)[:9]
    ours, theirs = (PagedKVCache(config, 6, 4, "cpu", dtype, "int8") for _ in range(2))
    theirs.write(0, k, v, slots)
    write_kv_quantized(ours.k[0], ours.v[0], ours.k_scale[0], ours.v_scale[0], k, v, slots)
    for a, b in zip(
        (ours.k[0], ours.v[0], ours.k_scale[0], ours.v_scale[0]),
        (theirs.k[0], theirs.v[0], theirs.k_scale[0], theirs.v_scale[0]),
    ):
        assert torch.equal(a, b)
    fp8 = PagedKVCache(config, 6, 4, "cpu", dtype, "fp8")
    with pytest.raises(ValueError, match="interpreter"):
        write_kv_quantized(fp8.k[0], fp8.v[0], fp8.k_scale[0], fp8.v_scale[0], k, v, slots)
    assert "PagedKVCache.write" in CPU_FP8_WRITE


def test_the_pool_picks_the_write(tiny_snapshot, monkeypatch):
    """``PagedKVCache.write`` is the one entry point: the Triton kernel for an 8-bit pool under the Triton
    backend on CUDA (``write_kernel``), else the torch ops; the model only calls the pool."""
    import inspect

    from common.weights import load_config

    from . import kv_cache, model

    config = load_config(tiny_snapshot)
    assert not PagedKVCache(config, 2, 4, "cpu", torch.float32, "int8", "triton").write_kernel  # no CUDA
    pool = PagedKVCache(config, 2, 4, "cpu", torch.float32, "int8", "triton")
    pool.write_kernel = True
    calls = []
    monkeypatch.setattr(kv_cache.kv_write, "write_kv_quantized", lambda *args: calls.append(args))
    k = torch.randn(3, config.n_head, config.head_dim)
    pool.write(1, k, k, torch.arange(3))
    assert len(calls) == 1 and calls[0][0] is pool.k[1] and calls[0][3] is pool.v_scale[1]
    assert "kv_write" not in inspect.getsource(model)


# ---- the engine --------------------------------------------------------------------------------------------


def test_auto_is_step_11_exactly(demo_snapshot, auto):
    theirs = step11_speculative.LLM(model=str(demo_snapshot), block_size=BLOCK)
    assert greedy_ids(auto) == greedy_ids(theirs, params=step11_speculative.SamplingParams)
    assert auto.engine.kv_cache.k_scale[0] is None and auto.engine.kv_cache.k[0].dtype == torch.float32


def test_8_bit_greedy_continuations_agree_with_auto(auto, quant):
    cache = quant.engine.kv_cache
    assert cache.quantized and cache.k[0].dtype in (torch.int8, torch.float8_e4m3fn)
    want, got = greedy_ids(auto), greedy_ids(quant)
    for w, g in zip(want, got):
        assert g[:AGREE_TOKENS] == w[:AGREE_TOKENS]


def fill_stale(cache: PagedKVCache, value: float) -> None:
    for t in cache.k + cache.v + cache.k_scale + cache.v_scale:
        t.copy_(torch.full(t.shape, value).to(t.dtype))


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_stale_nan_or_inf_in_unwritten_slots_is_never_read(demo_snapshot, quant, stale):
    """Every slot, scales included, holds NaN (or Inf; int8 holds its cast) before the run: the outputs are
    the clean pool's."""
    dirty = LLM(model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype=quant.engine.args.kv_cache_dtype)
    fill_stale(dirty.engine.kv_cache, stale)
    outs = dirty.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=1))
    assert all(math.isfinite(lp.logprob) for o in outs for d in o.outputs[0].logprobs for lp in d.values())
    assert [o.outputs[0].token_ids for o in outs] == greedy_ids(quant, max_tokens=24)


def test_prefix_caching_and_copy_on_write_on_8_bit_blocks(demo_snapshot, quant):
    """Greedy with and without the prefix cache are equal on 8-bit blocks (the cached blocks' scales are
    read back as written); n = 3 greedy choices forked off one prefill (copy-on-write of the shared last
    block, scales along) each equal the single choice."""
    mode = quant.engine.args.kv_cache_dtype
    uncached = LLM(
        model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype=mode, enable_prefix_caching=False
    )
    want = greedy_ids(uncached, max_tokens=24)
    assert greedy_ids(quant, max_tokens=24) == want
    assert greedy_ids(quant, max_tokens=24) == want  # the second run reads cached blocks
    assert quant.engine.stats.prefix_cache_hits > 0
    prompt = "A list comprehension is a concise way to"  # 9 tokens: its last block (1 of 4) is shared
    outs = quant.generate([prompt], SamplingParams(max_tokens=16, temperature=0, n=3))
    assert [c.token_ids for c in outs[0].outputs] == [want[2][:16]] * 3


def test_preemption_and_speculation_on_8_bit_blocks(demo_snapshot, quant):
    """A pool of 24 blocks of 4 tokens for 6 requests: preempted requests recompute their 8-bit blocks; with
    n-gram drafts verified over 8-bit blocks (rejected positions rewritten, scales too): the same ids."""
    mode = quant.engine.args.kv_cache_dtype
    want = greedy_ids(quant, max_tokens=40)
    engine = LLMEngine(
        model=str(demo_snapshot),
        block_size=BLOCK,
        num_kv_blocks=24,
        max_num_seqs=6,
        kv_cache_dtype=mode,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    params = SamplingParams(max_tokens=40, temperature=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), engine.tokenizer.encode(prompt), params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.stats.num_preemptions > 0 and engine.stats.spec_decode_num_drafts > 0
    assert [got[str(i)] for i in range(len(PROMPTS))] == want


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_triton_backend_equals_the_torch_backend_in_the_engine(demo_snapshot, mode):
    """The kernel (interpreter) and the torch backend's dequantize-then-attend give the same greedy ids."""
    args = dict(model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype=mode)
    triton_llm = LLM(**args, attention_backend="triton")
    torch_llm = LLM(**args, attention_backend="torch")
    assert greedy_ids(triton_llm, PROMPTS[:3], max_tokens=12) == greedy_ids(
        torch_llm, PROMPTS[:3], max_tokens=12
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_gpt2_124m_shapes_stay_finite_over_the_full_window(tmp_path, mode):
    """Random weights at GPT-2 124M's shapes, a 1,024-token prompt: logits finite at every step (8-bit keys
    and values of every layer, over the whole window)."""
    from conftest import write_random_snapshot

    folder = write_random_snapshot(
        tmp_path / "gpt2-shapes", n_positions=1024, n_embd=768, n_layer=12, n_head=12
    )
    llm = LLM(model=str(folder), kv_cache_dtype=mode, max_num_seqs=1)
    outs = llm.generate(
        prompt_token_ids=[torch.randint(0, 8000, (1020,)).tolist()],
        sampling_params=SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True),
    )
    assert len(outs[0].outputs[0].token_ids) == 4
    assert all(math.isfinite(lp.logprob) for d in outs[0].outputs[0].logprobs for lp in d.values())


@pytest.mark.parametrize("mode", MODES)
def test_8_bit_engines_through_the_server(demo_snapshot, mode):
    from step10_engine_core.test_engine_core import serve

    from .api_server import build_app
    from .core_client import AsyncMPClient

    args = EngineArgs(model=str(demo_snapshot), block_size=BLOCK, kv_cache_dtype=mode)
    llm = LLM(args)
    want = [
        o.outputs[0].text for o in llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0))
    ]
    with serve(build_app(AsyncMPClient(args))) as url:
        for prompt, text in zip(PROMPTS[:2], want):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            got = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
            assert got == text
        assert httpx.get(url + "/v1/engine/stats").json()["features"]["kv_cache_dtype"] == mode

"""Step 16 tests: the fused decode kernels compute what step 15's operations compute.

Each flavour of ``fused_linear`` (LayerNorm prologue, embeddings, bias, GELU, residual, the KV write in the
model's dtype and in 8 bits) against ``fused_linear_reference`` through Triton's interpreter (fp32 within
1e-4, fp16 within 1e-2, 8-bit pools bit for bit); a decode step's logits and pool through ``forward_fused``
against step 15's pass; then the engine: every output of ``LLM`` equals step 15's (greedy, seeded, stop
strings, n, logprobs, an 8-bit pool, two ranks), decode steps above ``MAX_BATCH`` and every
other step run step 15's path, and the argument's checks. On a GPU: real sizes; 64 prompts' greedy ids
in fp32 equal to step 15's; fp16 logits no further from fp32 than step 15's; PDL in a CUDA graph.
"""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

import step15_tensor_parallel
from conftest import write_random_snapshot

from . import fused_kernels
from .config import EngineArgs
from .fused_kernels import fused_linear, fused_linear_reference
from .kv_cache import PagedKVCache
from .llm import LLM
from .model import GPT, AttentionMetadata
from .sampling_params import SamplingParams

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}
CACHE_DTYPES = [None, torch.int8, torch.float8_e4m3fn]  # None: the model's dtype


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within the dtype's tolerance, relative to the larger values (absolute below 1)."""
    scale = b.float().abs().max().clamp(min=1.0)
    return bool(((a.float() - b.float()).abs().max() / scale) <= TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------------------
# The kernel against its reference, each flavour (the interpreter, small shapes)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def operands():
    """x [3, 48], a weight [48, 40] in GPT-2's [in, out] layout, bias, LayerNorm parameters: fp32."""
    g = torch.Generator().manual_seed(0)
    M, K, N = 3, 48, 40
    return dict(
        x=torch.randn(M, K, generator=g),
        w=torch.randn(N, K, generator=g).t().contiguous() * 0.2,
        b=torch.randn(N, generator=g),
        ln_w=torch.randn(K, generator=g),
        ln_b=torch.randn(K, generator=g),
    )


@pytest.mark.parametrize("split_k", [1, 3], ids=["one-split", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_each_flavour_equals_its_reference(operands, dtype, split_k):
    """Also with K cut into 3 slices of 16 (split-K): the tile counters back at zero after each launch, and
    the same bits on a second run (the slices summed in a fixed order)."""
    x, w, b, ln_w, ln_b = (operands[k].to(dtype) for k in ("x", "w", "b", "ln_w", "ln_b"))
    ln, tiles = (ln_w, ln_b, 1e-5), dict(block_k=16, split_k=split_k)
    for kwargs in [{}, {"ln": ln}, {"ln": ln, "gelu": True}]:  # (d): ln_2, product, bias, GELU
        out = fused_linear(x, w, b, **kwargs, **tiles)
        assert close(out, fused_linear_reference(x, w, b, **kwargs), dtype)
        assert torch.equal(out, fused_linear(x, w, b, **kwargs, **tiles))
    assert close(fused_linear(x, w, **tiles), fused_linear_reference(x, w), dtype)  # no bias: the LM head
    # (c), (e): the residual added, in place
    residual = torch.randn(3, 40, dtype=dtype)
    expected = fused_linear_reference(x, w, b, residual=residual.clone())
    out = fused_linear(x, w, b, residual=residual, **tiles)
    assert out.data_ptr() == residual.data_ptr() and close(residual, expected, dtype)
    # layer 0's prologue: token plus position embeddings, kept as the residual stream
    wte, wpe = torch.randn(50, 48, dtype=dtype), torch.randn(20, 48, dtype=dtype)
    embed = (torch.tensor([3, 7, 49]), torch.tensor([0, 5, 19]), wpe)
    kept, kept_ref = torch.empty(3, 48, dtype=dtype), torch.empty(3, 48, dtype=dtype)
    out = fused_linear(wte, w, b, ln=ln, embed=embed, residual=kept, **tiles)
    assert close(out, fused_linear_reference(wte, w, b, ln=ln, embed=embed, residual=kept_ref), dtype)
    assert torch.equal(kept, kept_ref)
    if split_k > 1:
        assert not fused_kernels.tile_counters(torch.device("cpu"), 1).any()


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_qkv_kernel_writes_the_pool_as_step15_does(operands, dtype, cache_dtype):
    """(a): q returned, k and v at their slots; 8 bits: the same bits and scales as kv_quant.quantize; K in
    three slices (split-K)."""
    H, D, C = 2, 16, 32
    g = torch.Generator().manual_seed(1)
    x, ln_w, ln_b = (operands[k].to(dtype) for k in ("x", "ln_w", "ln_b"))
    w = (torch.randn(3 * C, 48, generator=g) * 0.2).t().contiguous().to(dtype)
    b = torch.randn(3 * C, generator=g).to(dtype)
    quantized = cache_dtype is not None

    def pool():
        caches = [torch.zeros(4, 4, H, D, dtype=cache_dtype or dtype) for _ in range(2)]
        scales = [torch.zeros(4, 4, H, dtype=torch.float16) if quantized else None for _ in range(2)]
        return caches + scales

    ours, theirs, slots = pool(), pool(), torch.tensor([5, 0, 13])
    q = fused_linear(x, w, b, ln=(ln_w, ln_b, 1e-5), kv=(*ours, slots), block_k=16, split_k=3)
    q_ref = fused_linear_reference(x, w, b, ln=(ln_w, ln_b, 1e-5), kv=(*theirs, slots))
    assert q.shape == (3, C) and close(q, q_ref, dtype)
    for a, r in zip(ours, theirs):
        if r is None:
            continue
        if quantized:  # the rounding of the products may differ by an ulp: the bits must still agree
            assert (a.view(torch.uint8) == r.view(torch.uint8)).float().mean() > 0.99
        else:
            assert close(a, r, dtype)
    written = torch.zeros(16, dtype=torch.bool)
    written[slots] = True
    assert ours[0].view(16, H, D)[~written].float().abs().max() == 0  # no other slot touched


def test_bad_inputs_are_refused_before_any_launch(operands):
    """Shapes, dtypes, layouts, aliasing, the 8-bit pool's scales, the tile options: a ValueError each."""
    x, w, b = operands["x"], operands["w"], operands["b"]
    with pytest.raises(ValueError, match=r"x \[M, 48\] and weight \[48, N\]"):
        fused_linear(x[:, :40], w, b)
    with pytest.raises(ValueError, match=r"bias must be a tensor of shape \[40\]"):
        fused_linear(x, w, b[:7])
    with pytest.raises(
        ValueError, match=r"residual must be a tensor of shape \[3, 40\] on cpu, got \[3, 7\]"
    ):
        fused_linear(x, w, b, residual=torch.zeros(3, 7))
    with pytest.raises(ValueError, match="embed needs residual"):
        fused_linear(x, w, b, embed=(torch.tensor([0]), torch.tensor([0]), x))
    pool = [torch.zeros(2, 4, 2, 16) for _ in range(2)] + [None, None]
    with pytest.raises(ValueError, match=r"kv: weight's N = 40 must be 3 x the pool's H \* D = 32"):
        fused_linear(x, w, b, kv=(*pool, torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match="bfloat16 dot products wrongly"):  # the interpreter's bug
        fused_linear(x.bfloat16(), w.bfloat16())
    square = torch.randn(3, 48)
    with pytest.raises(ValueError, match="residual must not share memory with x"):
        fused_linear(square, torch.randn(48, 48), residual=square)
    w96, slots = torch.randn(48, 96), torch.tensor([0, 1, 2])
    strided = torch.zeros(2, 4, 16, 2).transpose(2, 3)  # [2, 4, 2, 16], not contiguous
    with pytest.raises(ValueError, match="kv: v_cache must be contiguous"):
        fused_linear(x, w96, kv=(pool[0], strided, None, None, slots))
    with pytest.raises(ValueError, match="kv and residual cannot go together"):
        fused_linear(x, w96, kv=(*pool, slots), residual=torch.zeros(3, 96))
    int8 = [torch.zeros(2, 4, 2, 16, dtype=torch.int8) for _ in range(2)]
    with pytest.raises(ValueError, match=r"kv: k_scale must be a tensor of shape \[2, 4, 2\]"):
        fused_linear(x, w96, kv=(*int8, None, None, slots))
    for tiles, error in [
        ({"split_k": 0}, "split_k=0: must be a positive integer"),
        ({"block_n": 24}, "block_n=24: must be a power of two >= 16"),
        ({"splitk": 4}, r"unknown tile options \['splitk'\]"),
    ]:
        with pytest.raises(ValueError, match=error):
            fused_linear(x, w, b, **tiles)


def test_which_shapes_run_fused():
    assert fused_kernels.unsupported(768, 64, quantized=True) is None
    assert "multiple of 16" in fused_kernels.unsupported(40, 8, quantized=False)
    assert fused_kernels.unsupported(32, 8, quantized=False) is None  # the tiny model, unquantized
    assert "power of two >= 16" in fused_kernels.unsupported(32, 8, quantized=True)
    assert "power of two >= 16" in fused_kernels.unsupported(96, 48, quantized=True)
    assert not fused_kernels.pdl_supported(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# A decode step of the model: fused against step 15's pass
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head16_snapshot(tmp_path_factory):
    """A tiny random GPT-2 with heads of 16 (the 8-bit fused write needs a power of two >= 16)."""
    return write_random_snapshot(
        tmp_path_factory.mktemp("head16"), n_positions=64, n_embd=64, n_layer=2, n_head=4
    )


BS = 4  # the decode step's block size
SLOTS = [1 * BS + 0, 2 * BS + 0, 5 * BS + 0]  # each new token's: position len - 1


def decode_step(model: GPT, kv_cache_dtype: str, fused: bool, device: str = "cpu") -> tuple:
    """Three sequences (lengths 5, 1 and 9, the new token last) in a pool whose earlier slots hold keys: one
    decode step through ``model`` (its device and dtype), fused or step 15's pass -> (logits [3, V], pool,
    the step as a function of no arguments, for a CUDA graph)."""
    config, dtype = model.config, next(model.parameters()).dtype
    cache = PagedKVCache(config, 8, BS, device, dtype, kv_cache_dtype, "triton")
    g = torch.Generator().manual_seed(2)
    for layer in range(config.n_layer):  # earlier tokens' keys and values, through the pool's write
        k, v = (torch.randn(32, config.n_head, config.head_dim, generator=g).to(device, dtype) for _ in "kv")
        cache.write(layer, k, v, torch.arange(32, device=device))
    t = dict(device=device)
    seq_lens, slots = torch.tensor([5, 1, 9], **t), torch.tensor(SLOTS, **t)
    ids, positions = torch.tensor([11, 22, 33], **t), seq_lens - 1
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=[0, 1, 2, 3],
        query_start_loc_t=torch.arange(4, **t),
        logits_indices=torch.arange(3, **t),
        num_prefills=0,
        seq_lens=seq_lens,
        block_tables=torch.tensor([[0, 1, 0], [2, 0, 0], [3, 4, 5]], **t),
        max_query_len=1,
        attention_backend="triton",
        decode_mask=None,
        fused=fused,
    )

    def step():
        with torch.inference_mode():
            return model(ids, positions, cache, meta)

    return step(), cache, step


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_decode_step_gives_step15s_logits_and_pool(head16_snapshot, kv_cache_dtype):
    """The logits [3, V] within 1e-4 and the pool's new slots as step 15's pass writes them."""
    model = GPT.from_pretrained(str(head16_snapshot))
    logits, cache, _ = decode_step(model, kv_cache_dtype, fused=False)
    fused_logits, fused_cache, _ = decode_step(model, kv_cache_dtype, fused=True)
    assert fused_logits.shape == (3, model.config.vocab_size)
    assert (fused_logits - logits).abs().max() < 1e-4
    for layer in range(model.config.n_layer):
        for a, b in [(cache.k[layer], fused_cache.k[layer]), (cache.v[layer], fused_cache.v[layer])]:
            a, b = a.flatten(0, 1)[SLOTS].float(), b.flatten(0, 1)[SLOTS].float()
            assert (a - b).abs().max() <= (1.0 if kv_cache_dtype == "int8" else 1e-5)  # int8: an ulp at most


# ---------------------------------------------------------------------------------------------------------
# The engine: step 15's outputs
# ---------------------------------------------------------------------------------------------------------

PROMPTS = ["The Python interpreter", "A list comprehension is", "Exceptions are raised when", "The Python"]
CASES = [
    (PROMPTS[0], dict(max_tokens=10, temperature=0)),
    (PROMPTS[1], dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=7)),
    (PROMPTS[2], dict(max_tokens=12, temperature=0, stop=[" the"])),
    (PROMPTS[3], dict(n=3, max_tokens=6, temperature=1.0, seed=3)),
    (PROMPTS[1], dict(max_tokens=4, temperature=0, logprobs=2)),
]


def outputs(llm, module, cases=CASES) -> list:
    prompts, fields = zip(*cases)
    done = llm.generate(list(prompts), [module.SamplingParams(**f) for f in fields])
    return [
        [
            (c.text, c.token_ids, c.finish_reason, c.logprobs and [sorted(e) for e in c.logprobs])
            for c in out.outputs
        ]
        for out in done
    ]


@pytest.fixture
def fused_sizes(monkeypatch) -> list[int]:
    """The batch of every fused pass that runs in this process (rank 0's), in order."""
    sizes, forward_fused = [], GPT.forward_fused

    def counted(self, input_ids, *rest):
        sizes.append(input_ids.shape[0])
        return forward_fused(self, input_ids, *rest)

    monkeypatch.setattr(GPT, "forward_fused", counted)
    return sizes


@pytest.mark.parametrize(
    "extra",
    [{}, {"kv_cache_dtype": "int8"}, {"tensor_parallel_size": 2}],
    ids=["defaults", "int8", "two-ranks"],
)
def test_the_engine_gives_step15s_outputs(head16_snapshot, extra, fused_sizes):
    """Greedy, seeded, stop strings, n (forks sharing blocks), logprobs; with an 8-bit pool greedy and n,
    short; over two ranks greedy, short. Step 15's oracle runs its torch backend (the interpreter's attention
    is the slow part of these tests); the decode steps here run fused (counted), prefills and mixed steps
    do not."""
    args = dict(model=str(head16_snapshot), block_size=4, max_num_seqs=8, **extra)
    short = [(PROMPTS[0], dict(max_tokens=6, temperature=0)), (PROMPTS[3], dict(n=2, max_tokens=4, seed=3))]
    cases = CASES if not extra else short if "kv_cache_dtype" in extra else short[:1]
    expected = outputs(step15_tensor_parallel.LLM(**args), step15_tensor_parallel, cases)
    llm = LLM(attention_backend="triton", fused_kernels=True, **args)
    try:
        assert outputs(llm, sys.modules[__package__], cases) == expected
    finally:
        llm.engine_core.shutdown()
    if "tensor_parallel_size" not in extra:  # rank 0 runs in this process: its passes are counted
        assert fused_sizes and set(fused_sizes) <= {1, 2, 4, 8}  # padded decode batches only


def test_decode_steps_above_max_batch_run_step15s_path(tiny_snapshot, monkeypatch, fused_sizes):
    """MAX_BATCH 2: the decode steps of four sequences (a rung of 4) run unfused, those of two fused; the
    ids are step 15's either way."""
    monkeypatch.setattr(fused_kernels, "MAX_BATCH", 2)
    args = dict(model=str(tiny_snapshot), max_num_seqs=4)
    prompts, lengths = [f"{p} and" for p in PROMPTS], [8, 8, 2, 2]  # four decodes a step, then two
    params = [dict(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    oracle = step15_tensor_parallel.LLM(**args)
    expected = oracle.generate(prompts, [step15_tensor_parallel.SamplingParams(**p) for p in params])
    llm = LLM(attention_backend="triton", fused_kernels=True, **args)
    ours = llm.generate(prompts, [SamplingParams(**p) for p in params])
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]
    assert fused_sizes and set(fused_sizes) <= {1, 2}  # the batches of 4 ran unfused


def test_the_argument(tiny_snapshot):
    model = str(tiny_snapshot)
    assert EngineArgs(model=model).fused_kernels is False  # the CPU's default: the torch backend
    assert EngineArgs(model=model, attention_backend="triton").fused_kernels is False  # on: CUDA's default
    assert EngineArgs(model=model, attention_backend="triton", fused_kernels=True).fused_max_batch == 64
    with pytest.raises(ValueError, match=r"fused_kernels=True: needs attention_backend='triton'"):
        EngineArgs(model=model, fused_kernels=True)
    with pytest.raises(ValueError, match=r"fused_kernels=True: .*head_dim = 8 must be a power of two >= 16"):
        EngineArgs(model=model, attention_backend="triton", kv_cache_dtype="int8", fused_kernels=True)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--no-fused-kernels"]).fused_kernels is False
    assert parser.parse_args(["--fused-kernels"]).fused_kernels is True


# ---------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_kernels_at_gpt2_sizes(dtype, rows):
    """Every product of GPT-2 124M (C = 768) at real sizes against its reference; the 8-bit write bitwise."""
    C, V, dev = 768, 50257, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, C, device=dev, dtype=dtype, generator=g)
    ln = (
        torch.randn(C, device=dev, dtype=dtype, generator=g),
        torch.randn(C, device=dev, dtype=dtype, generator=g),
        1e-5,
    )
    for K, N, kwargs in [(C, 4 * C, {"ln": ln, "gelu": True}), (4 * C, C, {}), (C, V, {"ln": ln})]:
        w = (torch.randn(N, K, device=dev, dtype=dtype, generator=g) * K**-0.5).t()
        w = w if N == V else w.contiguous()  # the LM head: wte.t()
        inputs = x if K == C else torch.randn(rows, K, device=dev, dtype=dtype, generator=g)
        b = None if N == V else torch.randn(N, device=dev, dtype=dtype, generator=g)
        expected = fused_linear_reference(inputs, w, b, **kwargs)
        assert close(fused_linear(inputs, w, b, **kwargs), expected, dtype)
        split = fused_linear(inputs, w, b, **kwargs, split_k=4)  # split-K: the same sum on every run
        assert close(split, expected, dtype)
        assert torch.equal(split, fused_linear(inputs, w, b, **kwargs, split_k=4))
    w = (torch.randn(3 * C, C, device=dev, dtype=dtype, generator=g) * C**-0.5).t().contiguous()
    b = torch.randn(3 * C, device=dev, dtype=dtype, generator=g)
    for cache_dtype in CACHE_DTYPES:
        pools = []
        for _ in range(2):
            caches = [torch.zeros(8, 16, 12, 64, device=dev, dtype=cache_dtype or dtype) for _ in range(2)]
            scales = [torch.zeros(8, 16, 12, device=dev, dtype=torch.float16) if cache_dtype else None] * 2
            pools.append(caches + [s.clone() if s is not None else None for s in scales])
        slots = torch.randperm(128, device=dev, generator=g)[:rows]
        q = fused_linear(x, w, b, ln=ln, kv=(*pools[0], slots))
        assert close(q, fused_linear_reference(x, w, b, ln=ln, kv=(*pools[1], slots)), dtype)
        for a, r in zip(pools[0], pools[1]):
            if r is not None:
                assert (a.view(torch.uint8) == r.view(torch.uint8)).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_ids_equal_step15s_in_fp32(demo_snapshot):
    """64 prompts, fp32, the fused decode steps in CUDA graphs (batches of up to 64, padded)."""
    args = dict(model=str(demo_snapshot), device="cuda", dtype="float32", max_num_seqs=64)
    prompts = [f"{PROMPTS[i % 4]} {i}" * (1 + i % 3) for i in range(64)]
    params = [dict(max_tokens=16 + i % 24, temperature=0, ignore_eos=True) for i in range(64)]
    oracle = step15_tensor_parallel.LLM(**args)
    expected = oracle.generate(prompts, [step15_tensor_parallel.SamplingParams(**p) for p in params])
    del oracle
    llm = LLM(**args)
    assert llm.engine.args.fused_kernels
    ours = llm.generate(prompts, [SamplingParams(**p) for p in params])
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp16_logits_stray_from_fp32_no_more_than_step15s(demo_snapshot):
    """The decode step in fp16, fused and step 15's, against step 15's pass in fp32: the fused logits' mean
    and largest distance from fp32 no larger than step 15's fp16 pass's (a tenth of slack: rounding)."""
    model = GPT.from_pretrained(str(demo_snapshot)).to("cuda")
    reference = decode_step(model, "auto", fused=False, device="cuda")[0].float()
    model = model.half()
    distance = {}
    for fused in (False, True):
        delta = (decode_step(model, "auto", fused=fused, device="cuda")[0].float() - reference).abs()
        distance[fused] = (delta.mean().item(), delta.max().item())
    assert 0 < distance[True][0] <= 1.1 * distance[False][0], distance
    assert distance[True][1] <= 1.1 * distance[False][1], distance


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="PDL: sm_90 on"
)
def test_gpu_pdl_launches_in_a_cuda_graph_give_the_same_bits(demo_snapshot, monkeypatch):
    """The fused step with programmatic dependent launch, eager and captured in a CUDA graph, replayed: the
    same logits, bit for bit, as plain launches (PDL changes when a kernel starts, not what it computes)."""
    model = GPT.from_pretrained(str(demo_snapshot)).to("cuda").half()
    plain = decode_step(model, "auto", fused=True, device="cuda")[0]
    monkeypatch.setattr(fused_kernels, "PDL", True)
    if not fused_kernels.pdl_supported(torch.device("cuda")):
        pytest.skip("this Triton has no programmatic dependent launch (gdc_wait)")
    logits, _, step = decode_step(model, "auto", fused=True, device="cuda")
    assert torch.equal(logits, plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        with torch.inference_mode():  # the step ran in inference mode: its output is an inference tensor
            captured.fill_(float("nan"))  # a replay that wrote nothing would not equal the plain logits
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, plain)

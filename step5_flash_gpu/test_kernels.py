"""Step 5 kernel tests: the Triton kernel of kernels.py gives the plain PyTorch reference's output.

The reference (``paged_attention_reference``) gathers each sequence's blocks and runs textbook causal
attention in fp32. The kernel matches it for every head (offset differently, so a mix-up shows), head sizes
that are and are not powers of two, block sizes 8/16/32, lengths around a block boundary, random block
tables, batches mixing prefills (with and without cached context) and decodes, and decodes only, within
fp32 1e-4 and fp16 1e-2 (the root README's parity tiers); test_flash_decoding.py reuses its helpers.
Without CUDA the small cases run through Triton's interpreter, which must be on before the process first
imports triton (kernels.py): this file turns it on, or reruns them in a fresh process if triton came first;
with CUDA they run compiled, and the ``gpu`` tests add real sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`, which kernels does

import triton  # noqa: E402

from .kernels import paged_attention, paged_attention_reference, triton_usable  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# bf16 keeps 8 significant bits: the kernel's output and the reference's, each rounded to bf16 once, can
# differ by one unit in the last place, 2**-7 of the value (0.03125 at |value| in [4, 8), seen on an H200).
RTOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2**-7}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def usable_device() -> str:
    """The device the kernels run on here; skips where they cannot run in this process."""
    if not triton_usable(DEVICE):
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1: test_small_cases_in_fresh_process runs these"
        )
    return DEVICE


@pytest.fixture
def device() -> str:
    return usable_device()


def make_batch(cases, n_head, head_dim, block_size, dtype, device, seed=0, spare_blocks=7):
    """A paged batch: cases = [(query_len, seq_len), ...], one per sequence, in batch order.

    The pool holds twice the blocks needed plus spares, filled with random keys and values (the new tokens'
    included, as if already written); each sequence gets blocks drawn from a random permutation of the
    pool, and its block-table row is padded with random valid ids. Values get + 0.5 x head index.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-L // block_size) for _, L in cases]
    M = max(blocks_per_seq) + 1  # one padding entry at least
    num_blocks = 2 * sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, n_head, head_dim)
    k_cache = torch.randn(shape, generator=g)
    v_cache = torch.randn(shape, generator=g) + 0.5 * torch.arange(n_head)[:, None]  # every head different
    ids = torch.randperm(num_blocks, generator=g)
    block_tables = torch.randint(0, num_blocks, (len(cases), M), generator=g)
    taken = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = ids[taken : taken + n]
        taken += n
    query_lens = [t for t, _ in cases]
    query_start_loc = torch.tensor([0] + query_lens).cumsum(0)
    q = torch.randn(sum(query_lens), n_head, head_dim, generator=g)
    to = dict(device=device)
    return dict(
        q=q.to(dtype=dtype, **to),
        k_cache=k_cache.to(dtype=dtype, **to),
        v_cache=v_cache.to(dtype=dtype, **to),
        block_tables=block_tables.to(dtype=torch.int32, **to),
        seq_lens=torch.tensor([L for _, L in cases], dtype=torch.int32, **to),
        query_start_loc=query_start_loc.to(dtype=torch.int32, **to),
        max_query_len=max(query_lens),
    )


def mixed_cases(bs: int) -> list[tuple[int, int]]:
    """(query_len, seq_len): prefills from scratch and after cached context, decodes, around block
    boundaries."""
    return [
        (1, 1),  # a one-token prompt
        (bs - 1, bs - 1),
        (1, bs),  # decodes
        (bs, bs),
        (bs + 1, bs + 1),
        (5, bs + 3),  # a prefill after bs - 2 cached tokens (a prefix hit, a chunked prompt)
        (1, bs + 1),
        (bs + 2, 3 * bs + 5),  # crosses several blocks after 2 bs + 3 cached tokens
        (1, 4 * bs + 7),
    ]


def check(batch, atol, attention=paged_attention, **kwargs):
    """``attention(**batch, **kwargs)`` equals the reference within atol (and bf16's rtol), head by head."""
    out = attention(**batch, **kwargs)
    ref = paged_attention_reference(**batch)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    rtol = RTOL[ref.dtype]
    excess = (out.float() - ref.float()).abs() - rtol * ref.float().abs()  # [N, H, D], error beyond rtol
    err = excess.amax(dim=(0, 2))  # [H], worst of each head
    assert (err <= atol).all(), f"max abs error (beyond rtol {rtol}) per head {err.tolist()} > {atol}"


MIXED = [(D, bs, torch.float32) for D in (64, 48) for bs in (8, 16, 32)]
MIXED += [(64, 32, torch.float16), (48, 16, torch.float16)]


@pytest.mark.parametrize("head_dim,block_size,dtype", MIXED)
def test_mixed_batch_matches_reference(device, head_dim, block_size, dtype):
    """Prefills (with and without context) and decodes in one launch, every head, shuffled block tables."""
    batch = make_batch(mixed_cases(block_size), 3, head_dim, block_size, dtype, device)
    check(batch, TOL[dtype])


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 64), (32, 16), (64, 32)])
def test_tile_sizes(device, block_m, block_n):
    """Query tiles shorter than a prompt (several tiles per sequence), key tiles smaller and larger than a
    block."""
    batch = make_batch(mixed_cases(16) + [(40, 40)], 2, 80, 16, torch.float32, device, seed=1)
    check(batch, 1e-4, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch(device, dtype):
    """A batch of decodes only (one query row per tile), lengths around block boundaries."""
    cases = [(1, L) for L in (1, 15, 16, 17, 83)]
    batch = make_batch(cases, 2, 48, 16, dtype, device, seed=2)
    check(batch, TOL[dtype], block_n=16)


def test_strided_inputs(device):
    """q as a view into a fused [N, 3, H, D] projection, a pool viewed with its own strides (stride() is
    used), and int64 block tables, lengths and offsets."""
    batch = make_batch(mixed_cases(8), 2, 64, 8, torch.float32, device, seed=3)
    for name in ("block_tables", "seq_lens", "query_start_loc"):
        batch[name] = batch[name].long()
    qkv = torch.randn(batch["q"].shape[0], 3, *batch["q"].shape[1:], device=device)
    qkv[:, 0] = batch["q"]
    ref = paged_attention_reference(**batch)
    batch["q"] = qkv[:, 0]  # [N, H, D] with row stride 3 H D
    pool = torch.zeros(*batch["k_cache"].shape[:3], 2 * batch["k_cache"].shape[3], device=device)
    pool[..., ::2] = batch["k_cache"]
    batch["k_cache"] = pool[..., ::2]  # last-dim stride 2
    out = paged_attention(**batch)
    assert (out - ref).abs().max() <= 1e-4


def test_bad_inputs_raise(device):
    batch = make_batch([(2, 5)], 2, 16, 8, torch.float32, device)
    with pytest.raises(ValueError):
        paged_attention(**{**batch, "q": batch["q"][:, :1]})  # head count differs from the pool's
    with pytest.raises(ValueError):
        paged_attention(**{**batch, "seq_lens": batch["seq_lens"].float()})


def strided(t: torch.Tensor, gap: int) -> torch.Tensor:
    """t's values in a view whose last dimension has stride 2, the elements between them set to ``gap``."""
    buffer = torch.full((*t.shape[:-1], 2 * t.shape[-1]), gap, dtype=t.dtype, device=t.device)
    buffer[..., ::2] = t
    return buffer[..., ::2]


# An integer tensor argument the way a caller may get it wrong: a stride-2 view with the right values (the
# gaps hold 0, harmless to read: a kernel that ignored the stride gives wrong rows, not a crash), another
# integer dtype, a float dtype, another device.
MISUSES = {
    "stride 2": lambda t: strided(t, 0),
    "int16": lambda t: t.to(torch.int16),
    "float": lambda t: t.float(),
    "other device": lambda t: t.to("meta"),
}


def honoured_or_refused(call, name: str, check_result) -> None:
    """``call()`` either raises ValueError naming ``name`` or returns what ``check_result`` accepts."""
    try:
        result = call()
    except ValueError as e:
        assert name in str(e), f"the error does not name {name}: {e}"
    else:
        check_result(result)


@pytest.mark.parametrize("misuse", MISUSES)
@pytest.mark.parametrize("name", ["block_tables", "seq_lens", "query_start_loc"])
def test_integer_arguments_honoured_or_refused(device, name, misuse):
    """Every integer tensor argument, strided, of another dtype or on another device: the kernel reads it
    right (the reference's output) or raises ValueError naming it; never a wrong answer without an error."""
    batch = make_batch([(3, 3), (1, 9), (2, 12)], 2, 16, 8, torch.float32, device, seed=11)
    ref = paged_attention_reference(**batch)
    bad = {**batch, name: MISUSES[misuse](batch[name])}
    honoured_or_refused(
        lambda: paged_attention(**bad),
        name,
        lambda out: torch.testing.assert_close(out, ref, atol=1e-4, rtol=0),
    )


# ---------------------------------------------------------------------------------------------------------
# How the interpreter gets switched on (only meaningful without CUDA)

ROOT = Path(__file__).resolve().parents[1]  # the folder holding this package
MODULE = f"{__package__}.kernels"
SNIPPET = f"""
import torch
from {MODULE} import paged_attention, paged_attention_reference
k = torch.randn(3, 8, 2, 16); v = torch.randn(3, 8, 2, 16); q = torch.randn(4, 2, 16)
args = (q, k, v, torch.tensor([[2, 0]]), torch.tensor([12]), torch.tensor([0, 4]), 4)
print(float((paged_attention(*args) - paged_attention_reference(*args)).abs().max()))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is for machines without CUDA")
def test_interpreter_switch_on():
    """kernels.py switches the interpreter on if it imports triton first; an earlier `import triton` needs the
    variable set beforehand (as a root conftest.py would), and without it the error says so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {
        "kernels first": ("", env),
        "triton first, variable set": ("import triton\n", {**env, "TRITON_INTERPRET": "1"}),
        "triton first, no variable": ("import triton\n", env),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", pre + SNIPPET],
            cwd=ROOT,
            env=e,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name, (pre, e) in runs.items()
    }
    # timeout: a safety net against a hang, not a measure (three processes at once on a loaded machine)
    results = {name: p.communicate(timeout=600) + (p.returncode,) for name, p in procs.items()}
    for name in ("kernels first", "triton first, variable set"):
        out, err, rc = results[name]
        assert rc == 0 and float(out.split()[-1]) < 1e-5, f"{name}: {err}"
    out, err, rc = results["triton first, no variable"]
    assert rc != 0 and "TRITON_INTERPRET=1" in err


@pytest.mark.skipif(
    torch.cuda.is_available() or triton_usable("cpu"), reason="the small cases ran in this process"
)
def test_small_cases_in_fresh_process():
    """Another test module imported triton before the interpreter was switched on: rerun the small cases of
    this file and of test_flash_decoding.py, which takes its device from here."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not gpu",
        str(Path(__file__)),
        str(Path(__file__).with_name("test_flash_decoding.py")),
    ]
    r = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# Real sizes, on the GPU: GPT-2 small's 12 heads x 64


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_mixed_batch_real_sizes(dtype):
    """256 sequences: 16 prefills (some after cached context, up to 1100 tokens) and 240 decodes up to
    1100."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for i in range(16):
        L = int(torch.randint(1, 1101, (1,), generator=g))
        cases.append(
            (L if i % 2 else max(1, L // 3), L)
        )  # odd: whole prompt; even: the last third after context
    cases += [(1, int(L)) for L in torch.randint(1, 1101, (240,), generator=g)]
    cases += [(1, 1), (1, 1024), (1024, 1024), (1, 1025)]
    batch = make_batch(cases, 12, 64, 16, dtype, "cuda", seed=6)
    check(batch, TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [1, 8, 256])
def test_gpu_decode_batch(num_seqs):
    """Decode-only batches, contexts up to 4096 (past GPT-2's window: the kernel has no length limit),
    fp16."""
    check(decode_batch(num_seqs), 1e-2)


def decode_batch(num_seqs: int) -> dict:
    """num_seqs decodes of random lengths up to 4096 (the first 4096), 12 heads x 64, fp16, on the GPU."""
    g = torch.Generator().manual_seed(num_seqs)
    cases = [(1, int(L)) for L in torch.randint(1, 4097, (num_seqs,), generator=g)]
    cases[0] = (1, 4096)
    return make_batch(cases, 12, 64, 16, torch.float16, "cuda", seed=7)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim,block_size", [(48, 8), (80, 32), (128, 16)])
def test_gpu_other_shapes(head_dim, block_size):
    """Padded head sizes and other block sizes, compiled."""
    cases = mixed_cases(block_size) + [(700, 1300), (1, 2000)]
    check(make_batch(cases, 12, head_dim, block_size, torch.float16, "cuda", seed=8), 1e-2)


def past_int32_offsets(batch: dict) -> dict:
    """``batch`` with its pool's blocks moved to the end of a pool of more than 2**31 elements per layer, so
    that every block it reads lies past int32 element offsets. Skips without the GPU memory.

    bs 16 x H 12 x D 64 = 12288 elements per block, so block ids above 174762 overflow int32 offsets;
    K and V take 2 x 4.3 GB in fp16. Only the batch's blocks are filled (torch.empty for the rest).
    """
    used, bs, H, D = batch["k_cache"].shape
    num_blocks = 2**31 // (bs * H * D) + 512  # the last 512 blocks start past element 2**31
    assert used <= 512
    if torch.cuda.mem_get_info()[0] < 2 * num_blocks * bs * H * D * 2 + 2**30:
        pytest.skip("not enough free GPU memory for a pool past 2**31 elements")
    k_cache = torch.empty(num_blocks, bs, H, D, device="cuda", dtype=batch["k_cache"].dtype)
    v_cache = torch.empty_like(k_cache)
    base = num_blocks - used  # the batch's blocks become the big pool's last ones
    k_cache[base:] = batch["k_cache"]
    v_cache[base:] = batch["v_cache"]
    big = {**batch, "k_cache": k_cache, "v_cache": v_cache, "block_tables": batch["block_tables"] + base}
    assert int(big["block_tables"].min()) * bs * H * D >= 2**31  # every block read lies past int32 offsets
    return big


@gpu
@needs_cuda
def test_gpu_int64_offsets():
    """A pool of more than 2**31 elements per layer: a prefill and decodes read blocks near its end."""
    small = make_batch([(1, 300), (200, 500), (1, 17)], 12, 64, 16, torch.float16, "cuda", seed=9)
    big = past_int32_offsets(small)
    assert (paged_attention(**big) - paged_attention_reference(**small)).abs().max() <= 1e-2


@gpu
@needs_cuda
def test_gpu_no_recompilation_as_the_batch_changes():
    """Once a tile configuration has compiled, batches of other sizes, block-table widths and int-tensor
    alignments (the engine's are slices of one packed copy) compile nothing: a compilation would stall a
    serving step for about a second."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton version has no compile hook to count compilations with")

    def decodes(S, L, offset):  # S decodes of L tokens; the int tensors start `offset` elements into a buffer
        batch = make_batch([(1, L)] * S, 12, 64, 16, torch.float16, "cuda", seed=S)
        for name in ("block_tables", "seq_lens", "query_start_loc"):
            t = batch[name]
            buffer = torch.zeros(offset + t.numel(), dtype=t.dtype, device="cuda")
            buffer[offset:] = t.flatten()
            batch[name] = buffer[offset:].view(t.shape)
        return batch

    paged_attention(**decodes(256, 100, 0))  # the decode tile configuration, compiled once
    compiled = []
    hook, knobs.runtime.jit_post_compile_hook = (
        knobs.runtime.jit_post_compile_hook,
        lambda **kw: compiled.append(kw),
    )
    try:
        for S, L, offset in [(1, 16, 1), (16, 33, 0), (17, 300, 1), (200, 1000, 3), (32, 1, 2)]:
            batch = decodes(S, L, offset)
            check(batch, 1e-2)
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert [kw["repr"] for kw in compiled] == []


def test_warm_up_runs_every_variant(device):
    """warm_up launches the kernel at query lengths 1, 64 and 128 (each tile configuration: what the engine
    can launch), whatever the block size, and nothing else."""
    from . import kernels

    seen = []
    real = kernels.paged_attention
    kernels.paged_attention = lambda q, *args, **kw: seen.append(q.shape[0]) or real(q, *args, **kw)
    try:
        for block_size in (8, 32):
            kernels.warm_up(2, 16, block_size, torch.float32, device)
    finally:
        kernels.paged_attention = real
    assert seen == 2 * [1, 64, 128]


def test_bfloat16_refused_on_the_cpu():
    """Through Triton's interpreter a bf16 tl.dot multiplies bit patterns (garbage, ~1e8 off): refused."""
    batch = make_batch([(3, 3), (1, 9)], 2, 16, 8, torch.bfloat16, "cpu", seed=1)
    with pytest.raises(ValueError, match="bfloat16"):
        paged_attention(**batch)

"""Tests of the exercise module flash_decoding.py: split-K decode attention and the KV write as a kernel.

Flash-decoding must give the reference's output (``paged_attention_reference``) with any split count,
empty splits included, and ``choose_num_splits`` must split only where the H200's measurements say it
pays; ``write_kv`` must leave the pool exactly as step 4's indexing does. The batches, the tolerances,
the device (the interpreter on a CPU) and the GPU helpers come from test_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from .flash_decoding import choose_num_splits, flash_decoding_attention
from .kernels import paged_attention_reference
from .kv_write import write_kv
from .test_kernels import (
    MISUSES,
    TOL,
    check,
    decode_batch,
    gpu,
    honoured_or_refused,
    make_batch,
    needs_cuda,
    past_int32_offsets,
    strided,
    usable_device,
)


@pytest.fixture
def device() -> str:
    return usable_device()


@pytest.mark.parametrize(
    "dtype,num_splits",
    [(torch.float32, n) for n in (None, 1, 2, 3, 8)] + [(torch.float16, 1), (torch.float16, 3)],
)
def test_decode_paths(device, dtype, num_splits):
    """All-decode batches: the plain kernel (1), flash-decoding (k > 1, some splits empty), the automatic
    choice (None: 1 at these lengths)."""
    cases = [(1, L) for L in (1, 15, 16, 17, 83)]
    batch = make_batch(cases, 2, 48, 16, dtype, device, seed=2)
    check(batch, TOL[dtype], flash_decoding_attention, num_splits=num_splits, block_n=16)


def test_choose_num_splits():
    """Split only all-decode batches that leave SMs idle (132 assumed on CPU), and only contexts of 2,048
    tokens and more (the H200's measurements: below that the plain kernel was faster)."""
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 12, 1, 4096, cpu) == 16
    assert choose_num_splits(8, 12, 1, 4096, cpu) == 16  # measured fastest there: 55 us, 2 splits 119 us
    assert choose_num_splits(1, 12, 1, 2048, cpu) == 8  # 2048 // 256 splits of 256 keys
    assert choose_num_splits(1, 12, 1, 3000, cpu) == 8  # 11 rounded down to a power of two
    assert choose_num_splits(1, 12, 1, 2047, cpu) == 1  # GPT-2's whole window (1,024) never splits
    assert choose_num_splits(8, 12, 1, 1024, cpu) == 1
    # as a context grows, only the split counts come up: a handful of compiled kernels, not one per length
    splits = {choose_num_splits(s, 12, 1, n, cpu) for s in (1, 2, 4, 8) for n in range(1, 8193, 7)}
    assert splits == {1, 8, 16}
    assert choose_num_splits(10, 12, 1, 4096, cpu) == 16  # 120 programs leave 12 of 132 SMs idle
    assert choose_num_splits(11, 12, 1, 4096, cpu) == 1  # 132 programs fill them
    assert choose_num_splits(256, 12, 1, 4096, cpu) == 1  # the plain grid fills the GPU
    assert choose_num_splits(1, 12, 7, 4096, cpu) == 1  # not all decodes


def test_splits_need_decodes(device):
    batch = make_batch([(2, 5)], 2, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="max_query_len 1"):
        flash_decoding_attention(**batch, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv(device, dtype, block_size):
    """write_kv stores exactly what step 4's indexing stores, from strided k/v, and skips slot -1."""
    g = torch.Generator().manual_seed(4)
    num_blocks, H, D, N = 6, 3, 48, 9
    k_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, H, D, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(N, 2, H, D, generator=g).to(device=device, dtype=dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=g)[:N].to(device)
    slots[4] = -1  # a padding token
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    want_k.view(-1, H, D)[slots[keep]] = k[keep]
    want_v.view(-1, H, D)[slots[keep]] = v[keep]
    write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("misuse", MISUSES)
@pytest.mark.parametrize("name", ["block_tables", "seq_lens", "query_start_loc"])
def test_split_integer_arguments_honoured_or_refused(device, name, misuse):
    """As test_kernels.py checks the kernel's: the split path reads each integer argument right or raises
    ValueError naming it."""
    batch = make_batch([(1, 9), (1, 30)], 2, 16, 8, torch.float32, device, seed=12)
    ref = paged_attention_reference(**batch)
    bad = {**batch, name: MISUSES[misuse](batch[name])}
    honoured_or_refused(
        lambda: flash_decoding_attention(**bad, num_splits=2),
        name,
        lambda out: torch.testing.assert_close(out, ref, atol=1e-4, rtol=0),
    )


@pytest.mark.parametrize("misuse", [*MISUSES, "2-D"])
def test_slot_mapping_honoured_or_refused(device, misuse):
    """slot_mapping strided (gaps of -1, a skipped slot), of another dtype, on another device or [N, 1]:
    write_kv writes exactly step 4's slots or raises ValueError naming it."""
    g = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(4, 8, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 5, 2, 16, generator=g).to(device)
    slots = torch.randperm(32, generator=g)[:5].to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, 2, 16)[slots] = k
    want_v.view(-1, 2, 16)[slots] = v
    bad = (
        slots[:, None]
        if misuse == "2-D"
        else strided(slots, -1)
        if misuse == "stride 2"
        else MISUSES[misuse](slots)
    )

    def written(_):
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)

    honoured_or_refused(lambda: write_kv(k_cache, v_cache, k, v, bad), "slot_mapping", written)


# ---------------------------------------------------------------------------------------------------------
# Real sizes, on the GPU: GPT-2 small's 12 heads x 64


@gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [1, 8, 256])
@pytest.mark.parametrize("num_splits", [None, 4, 16])
def test_gpu_decode_paths(num_seqs, num_splits):
    """Decode-only batches, contexts up to 4096, flash-decoding forced and chosen, fp16."""
    check(decode_batch(num_seqs), 1e-2, flash_decoding_attention, num_splits=num_splits)


@gpu
@needs_cuda
def test_gpu_write_kv_real_sizes():
    H, D, bs, num_blocks, N = 12, 64, 16, 4096, 3000
    k_cache = torch.randn(num_blocks, bs, H, D, device="cuda", dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    k, v = torch.randn(2, N, H, D, device="cuda", dtype=torch.float16)
    slots = torch.randperm(num_blocks * bs, device="cuda")[:N]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, H, D)[slots] = k
    want_v.view(-1, H, D)[slots] = v
    write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@gpu
@needs_cuda
def test_gpu_int64_offsets():
    """A pool of more than 2**31 elements per layer: split decodes read, and write_kv writes, blocks near
    its end."""
    decodes = make_batch([(1, 300), (1, 17)], 12, 64, 16, torch.float16, "cuda", seed=10)
    big = past_int32_offsets(decodes)
    out = flash_decoding_attention(**big, num_splits=4)
    assert (out - paged_attention_reference(**decodes)).abs().max() <= 1e-2
    k_cache, v_cache = big["k_cache"], big["v_cache"]
    num_blocks, bs, H, D = k_cache.shape
    slots = (num_blocks - 1) * bs + torch.arange(bs, device="cuda")
    kv = torch.randn(2, bs, H, D, device="cuda", dtype=torch.float16)
    write_kv(k_cache, v_cache, kv[0], kv[1], slots)
    assert torch.equal(k_cache[-1], kv[0]) and torch.equal(v_cache[-1], kv[1])

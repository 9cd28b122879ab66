"""Fused Triton kernels for decode steps: each matrix product of a layer in one launch, with the work around.

A decode step's products are matrix-vector products (a few rows against a weight matrix), so each reads its
weight once and does little else; what costs is the number of launches (step 7's README). ``fused_linear``
does one product with what sits before and after it: a LayerNorm in its prologue (each program normalises the
rows it reads), optionally the token and position embeddings too (layer 0); the bias, GELU, the residual, or
the KV-cache write (8-bit too, kv_write.py's ``quantize_rows``) in its epilogue. With programmatic dependent
launch (PDL, compute capability 9.0 on) a kernel starts while the one before finishes, reads its first weight
tile, then waits (``gdc_wait``) for its inputs. Shapes: M rows (sequences), K inputs, N outputs.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as in kernels.py: read by the first `import triton`
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import kv_quant  # noqa: E402
from .kernels import CPU_BF16_UNSUPPORTED, QUANTIZED_DTYPES, _check_usable  # noqa: E402
from .kv_write import quantize_rows  # noqa: E402

# The most sequences a decode step may have to run fused (larger steps run step 15's path): issue 46's guess
# until a GPU has measured where the fused step stops beating step 15's (README.md, "The numbers").
MAX_BATCH = 64
SQRT_2_OVER_PI = 0.7978845608028654  # GELU's tanh approximation (GPT-2's gelu_new)
# launch with programmatic dependent launch where the device has it: off until it has been measured on a GPU
# (README.md, "The numbers"); the benchmark runs step 16 with it on and off
PDL = False


def unsupported(columns: int, head_dim: int, quantized: bool) -> str | None:
    """Why a model whose q, k and v have ``columns`` each (a rank's H * D) cannot run fused, or None: the
    tiles are 16 columns, and with an 8-bit pool one head (a power of two from 16 on)."""
    if columns % 16:
        return f"a rank's H * D = {columns} must be a multiple of 16 (the kernels' column tile)"
    if quantized and (head_dim < 16 or head_dim & (head_dim - 1)):
        return f"with an 8-bit KV cache, head_dim = {head_dim} must be a power of two >= 16 (a tile a head)"
    return None


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch: ``PDL`` on, a CUDA device of
    compute capability 9.0 or more (Hopper on), a Triton that knows ``launch_pdl``."""
    if not PDL or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    return hasattr(tl.extra.cuda, "gdc_wait")


@triton.jit
def _gelu_tanh(y):
    """0.5 y (1 + tanh(sqrt(2 / pi) (y + 0.044715 y^3))), fp32; tanh(u) = 1 - 2 / (exp(2u) + 1)."""
    u = SQRT_2_OVER_PI * (y + 0.044715 * y * y * y)
    return 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))


@triton.jit
def _load_rows(x_ptr, wpe_ptr, tokens, positions, rows, ks, mask, stride_xm, stride_pm, EMBED: tl.constexpr):
    """The input rows' columns ``ks``: [BLOCK_M, BLOCK_K] in fp32 (0 where masked). EMBED: x_ptr is the
    token embedding, each row the sum of its token's row and its position's (rounded to the model's dtype, as
    torch adds two tensors of it)."""
    if EMBED:
        token = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
        position = tl.load(wpe_ptr + positions[:, None] * stride_pm + ks[None, :], mask=mask, other=0.0)
        x = (token.to(tl.float32) + position.to(tl.float32)).to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_kv(
    cache_ptr,
    scale_ptr,
    y,
    slots,
    at,
    head,
    mask,
    row_mask,
    C_KV,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    FP8: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Keys or values y [BLOCK_M, BLOCK_N] (columns ``at`` of a slot's [H * D] row) at each row's slot of one
    layer's pool [num_slots, H * D]; KV_QUANT: the tile is one head's (BLOCK_N = D), stored in 8 bits with
    its scale per row at [num_slots, H] (kv_write.py's bits)."""
    if KV_QUANT:
        y, scale = quantize_rows(y, QMAX, INV_QMAX, SCALE_MAX, FP8)  # [BLOCK_M, D], [BLOCK_M]
        tl.store(scale_ptr + slots * (C_KV // HEAD_DIM) + head, scale, mask=row_mask)
    tl.store(cache_ptr + slots[:, None] * C_KV + at[None, :], y.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["ids_ptr", "pos_ptr", "slot_ptr"])
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    res_ptr,
    ln_w_ptr,
    ln_b_ptr,
    ids_ptr,
    pos_ptr,
    wpe_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    K_SPLIT,
    C_KV,
    eps,
    stride_xm,
    stride_wk,
    stride_wn,
    stride_om,
    stride_rm,
    stride_pm,
    LN: tl.constexpr,
    EMBED: tl.constexpr,
    BIAS: tl.constexpr,
    GELU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    KV: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[rows, cols] = epilogue(prologue(x[rows]) @ W[:, cols]) for one tile of BLOCK_M rows and BLOCK_N
    output columns and one slice of K; grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K). W is [K, N] (any
    strides), x [M, K].

    Prologue: LN normalises each row over K (mean, then the variance of the centred values: two passes over
    the row, fp32, as torch's LayerNorm), times ln_w plus ln_b, rounded to the model's dtype; EMBED reads the
    rows as token plus position embeddings, and the first column tile's programs store them into res (the
    residual stream). Epilogue, each rounded to the dtype as torch's separate operations round: + bias; GELU;
    + res[rows] (out may be res: each element is read and written by one program). KV: the columns are q | k
    | v of C_KV each; q goes to out, k and v to the caches at each row's slot (KV_QUANT: one head a tile, its
    8-bit values and scale, ``quantize_rows``)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = pid_k * K_SPLIT  # split-K: this program's inputs are k_start .. k_end (else all of K)
    k_end = tl.minimum(K, k_start + K_SPLIT)
    # the first weight tile needs nothing from the kernel before: read it while that one finishes
    w = tl.load(
        w_ptr + (k_start + ks)[:, None] * stride_wk + cols[None, :] * stride_wn,
        mask=((k_start + ks)[:, None] < k_end) & col_mask[None, :],
        other=0.0,
    )
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before has finished: its outputs (our inputs) are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start and read its first weight tile
    tokens = rows
    positions = rows
    if EMBED:
        tokens = tl.load(ids_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        positions = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if LN:
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k0 + ks < K)[None, :]
            mean += tl.sum(
                _load_rows(
                    x_ptr, wpe_ptr, tokens, positions, rows, k0 + ks, mask, stride_xm, stride_pm, EMBED
                ),
                1,
            )
        mean = mean / K
        var = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k0 + ks < K)[None, :]
            x = _load_rows(
                x_ptr, wpe_ptr, tokens, positions, rows, k0 + ks, mask, stride_xm, stride_pm, EMBED
            )
            centred = tl.where(mask, x - mean[:, None], 0.0)
            var += tl.sum(centred * centred, 1)
        rstd = 1.0 / tl.sqrt_rn(var / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        mask = row_mask[:, None] & (kk < k_end)[None, :]
        x = _load_rows(x_ptr, wpe_ptr, tokens, positions, rows, kk, mask, stride_xm, stride_pm, EMBED)
        if EMBED:  # the residual stream starts here: the first column tile's programs keep it
            if pid_n == 0:
                tl.store(res_ptr + rows[:, None] * stride_rm + kk[None, :], x, mask=mask)
        if LN:
            gamma = tl.load(ln_w_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            beta = tl.load(ln_b_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
            x = tl.where(mask, x, 0.0)
        a = x.to(w_ptr.dtype.element_ty)  # what torch's product reads: the model's dtype
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        kn = kk + BLOCK_K  # the next weight tile (past K: masked, unread)
        w = tl.load(
            w_ptr + kn[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=(kn[:, None] < k_end) & col_mask[None, :],
            other=0.0,
        )
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K > 1:  # each split's partial sum to the workspace; the split that finishes last adds them all
        tile = ws_ptr + rows[:, None] * N + cols[None, :]  # the workspace: [SPLIT_K, M, N] fp32
        tl.store(tile + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stored before the count is raised
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1  # the others' partials are visible
        if last:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # in a fixed order: the same sum on every run
                acc += tl.load(tile + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)  # zero again for the next launch
    else:
        last = pid_n >= 0  # the one program of its tile
    if last:
        _epilogue(
            acc,
            bias_ptr,
            out_ptr,
            res_ptr,
            slot_ptr,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            rows,
            cols,
            row_mask,
            col_mask,
            mask,
            pid_n,
            C_KV,
            stride_om,
            stride_rm,
            BIAS,
            GELU,
            RESIDUAL,
            KV,
            KV_QUANT,
            HEAD_DIM,
            QMAX,
            INV_QMAX,
            SCALE_MAX,
            FP8,
            BLOCK_N,
        )


@triton.jit
def _epilogue(
    acc,
    bias_ptr,
    out_ptr,
    res_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    rows,
    cols,
    row_mask,
    col_mask,
    mask,
    pid_n,
    C_KV,
    stride_om,
    stride_rm,
    BIAS: tl.constexpr,
    GELU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    KV: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr,
    INV_QMAX: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The product acc [BLOCK_M, BLOCK_N] (fp32) -> + bias, GELU, + residual, stored; or q stored and k, v
    written to the pool (see ``_fused_linear_kernel``)."""
    y = acc
    if BIAS:
        y += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the product's output, in the model's dtype
    if GELU:
        y = _gelu_tanh(y)
    if RESIDUAL:
        y += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if KV:
        part = (pid_n * BLOCK_N) // C_KV  # 0: q, 1: k, 2: v (a tile lies in one)
        at = cols - part * C_KV  # the column within the part: head * D + d
        if part == 0:
            tl.store(out_ptr + rows[:, None] * stride_om + at[None, :], y, mask=mask)
        else:
            slots = tl.load(slot_ptr + rows, mask=row_mask, other=0).to(tl.int64)  # [BLOCK_M]
            head = (pid_n * BLOCK_N - part * C_KV) // HEAD_DIM  # KV_QUANT: the tile's one head
            if part == 1:
                _store_kv(
                    k_cache_ptr,
                    k_scale_ptr,
                    y,
                    slots,
                    at,
                    head,
                    mask,
                    row_mask,
                    C_KV,
                    HEAD_DIM,
                    QMAX,
                    INV_QMAX,
                    SCALE_MAX,
                    FP8,
                    KV_QUANT,
                )
            else:
                _store_kv(
                    v_cache_ptr,
                    v_scale_ptr,
                    y,
                    slots,
                    at,
                    head,
                    mask,
                    row_mask,
                    C_KV,
                    HEAD_DIM,
                    QMAX,
                    INV_QMAX,
                    SCALE_MAX,
                    FP8,
                    KV_QUANT,
                )
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=mask)


def _config(M: int, N: int, K: int, head_dim: int | None, columns: int | None, gpu: bool) -> dict:
    """Tile sizes by shape (a fixed table, not yet measured on a GPU: README.md): every row in one tile up to
    64 rows (each weight read once), narrow column tiles so that a small N still spreads over the GPU, one
    head a tile when the epilogue quantizes keys (its scale is the head's). Through the interpreter, where
    each program costs the host, the widest tiles: a tile of q, k or v lies in one (``columns``)."""
    if gpu:
        block_n, block_k = head_dim or (16 if N <= 4096 else 64), 128
    else:
        block_n = head_dim or (columns & -columns if columns else min(triton.next_power_of_2(N), 8192))
        block_k = min(triton.next_power_of_2(K), 1024, 2**19 // block_n)  # Triton: at most 2^20 a tile
    block_m = min(max(16, triton.next_power_of_2(M)), 64)
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=2, split_k=1)


# split-K's tile counters, by device: zero between launches (the last split of a tile sets its counter back)
_counters: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT_TILES = 4096


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed int32 counters split-K needs on ``device``, allocated on first use, which must come before
    any CUDA-graph capture (a capture would record their zeroing). Raises RuntimeError otherwise, ValueError
    for more than ``MAX_SPLIT_TILES`` tiles."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"split_k: {tiles} tiles, at most {MAX_SPLIT_TILES}")
    if device not in _counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "split_k's counters must be allocated before a CUDA-graph capture: warm up first"
            )
        _counters[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _counters[device]


def _check_linear_inputs(x, weight, bias, ln, embed, residual, kv) -> tuple:
    """``fused_linear``'s arguments checked before any launch: (M, K, N, head_dim or None, C_kv or None).
    Raises ValueError naming the argument. Not checked (it would read the device): that ids, positions and
    slots lie inside their tables and pool, as the engine's do."""

    def tensor(name, t, shape, dtype=None, contiguous=False):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.device != x.device:
            got = f"{list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape {list(shape)} on {x.device}, got {got}")
        if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
        if contiguous and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")

    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 2
        or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    ):
        raise ValueError(f"x must be a 2-D float32/float16/bfloat16 tensor, got {getattr(x, 'shape', x)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [K, N], got {getattr(weight, 'shape', weight)}")
    (K, N), dtype = weight.shape, x.dtype
    if x.shape[1] != K or weight.dtype != dtype:
        raise ValueError(
            f"x [M, {K}] and weight [{K}, N] of one dtype expected, got {list(x.shape)} "
            f"{x.dtype} and {list(weight.shape)} {weight.dtype}"
        )
    if x.device.type == "cpu" and dtype == torch.bfloat16:
        raise ValueError(CPU_BF16_UNSUPPORTED)
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dimension")
    M = x.shape[0]
    if embed is not None:
        if not isinstance(embed, tuple) or len(embed) != 3:
            raise ValueError("embed must be (ids [M], positions [M], wpe [P, K])")
        ids, positions, wpe = embed
        M = ids.shape[0] if isinstance(ids, torch.Tensor) else -1
        tensor("embed's ids", ids, (M,), (torch.int32, torch.int64), contiguous=True)
        tensor("embed's positions", positions, (M,), (torch.int32, torch.int64), contiguous=True)
        if not isinstance(wpe, torch.Tensor) or wpe.dim() != 2:
            raise ValueError("embed's wpe must be a 2-D tensor [P, K]")
        tensor("embed's wpe", wpe, (wpe.shape[0], K), dtype)
        if wpe.stride(1) != 1:
            raise ValueError("embed's wpe must be contiguous along its last dimension")
        if residual is None:
            raise ValueError("embed needs residual: the [M, K] buffer the embedded rows are kept in")
    if bias is not None:
        tensor("bias", bias, (N,), dtype)
    if ln is not None:
        if not isinstance(ln, tuple) or len(ln) != 3 or not isinstance(ln[2], float):
            raise ValueError("ln must be (weight [K], bias [K], eps: float)")
        tensor("ln's weight", ln[0], (K,), dtype, contiguous=True)
        tensor("ln's bias", ln[1], (K,), dtype, contiguous=True)
    if residual is not None:
        if kv is not None and embed is None:
            raise ValueError("kv and residual cannot go together: the QKV product adds no residual")
        tensor("residual", residual, (M, K if embed is not None else N), dtype)
        if residual.stride(1) != 1:
            raise ValueError("residual must be contiguous along its last dimension")
        if embed is None and residual.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError("residual must not share memory with x: the kernel writes it while reading x")
    head_dim = C_kv = None
    if kv is not None:
        if not isinstance(kv, tuple) or len(kv) != 5:
            raise ValueError("kv must be (k_cache, v_cache, k_scale, v_scale, slot_mapping)")
        k_cache, v_cache, k_scale, v_scale, slots = kv
        if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
            raise ValueError("kv: k_cache must be a pool [num_blocks, block_size, H, D]")
        C_kv = k_cache.shape[2] * k_cache.shape[3]
        if N != 3 * C_kv:
            raise ValueError(f"kv: weight's N = {N} must be 3 x the pool's H * D = {C_kv}")
        quantized = k_cache.dtype in QUANTIZED_DTYPES
        if not quantized and k_cache.dtype != dtype:
            raise ValueError(f"kv: a pool of {k_cache.dtype} for a model in {dtype}")
        tensor("kv: k_cache", k_cache, k_cache.shape, k_cache.dtype, contiguous=True)
        tensor("kv: v_cache", v_cache, k_cache.shape, k_cache.dtype, contiguous=True)
        tensor("kv: slot_mapping", slots, (M,), (torch.int32, torch.int64), contiguous=True)
        if quantized:
            head_dim = k_cache.shape[3]
            for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
                tensor(f"kv: {name}", scale, k_cache.shape[:3], torch.float16, contiguous=True)
        elif k_scale is not None or v_scale is not None:
            raise ValueError("kv: scales are for an 8-bit pool only")
    return M, K, N, head_dim, C_kv


def _check_tiles(tiles: dict) -> dict:
    """The tile overrides of ``fused_linear``: known names, powers of two (block_m, block_n, block_k >= 16),
    positive counts. Raises ValueError."""
    known = {"block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k"}
    if unknown := set(tiles) - known:
        raise ValueError(f"unknown tile options {sorted(unknown)}: expected some of {sorted(known)}")
    for name, value in tiles.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer")
        if name.startswith("block_") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}={value}: must be a power of two >= 16")
    return tiles


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ln: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    embed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    kv: tuple | None = None,
    use_pdl: bool | None = None,
    **tiles,
) -> torch.Tensor:
    """y = epilogue(prologue(x) @ weight) in one kernel launch (see ``_fused_linear_kernel``).

    x: [M, K] float32/float16/bfloat16; with ``embed`` = (ids [M] int, positions [M] int, wpe [P, K]),
    x is the token embedding [V, K] and the rows are x[ids] + wpe[positions], kept in ``residual`` [M, K].
    weight: [K, N] in x's dtype, any strides (GPT-2's Conv1D layout is contiguous; the tied LM head:
    wte.t()).
    bias: [N] or None. ln: (weight [K], bias [K], eps): LayerNorm before the product. gelu: tanh GELU after
    the bias. residual: [M, N], added after (the result is written into it, in place, and returned).
    kv: (k_cache, v_cache, k_scale, v_scale, slot_mapping [M]) with weight's N = 3 C (q | k | v, C = H * D
    of the pools [num_blocks, block_size, H, D]; scales None unless 8-bit): k and v go to the pool at the
    slots, q [M, C] is returned. use_pdl: default ``pdl_supported``. tiles: block_m, block_n, block_k,
    num_warps, num_stages, split_k (K in that many slices, summed in a fixed order) override ``_config``.
    Returns [M, N] (or q). Raises ValueError on inconsistent shapes, dtypes or devices; RuntimeError on CPU
    tensors without Triton's interpreter. Ids, positions and slots must lie inside their tables and pool (not
    checked: that would read the device).
    """
    M, K, N, head_dim, C_kv = _check_linear_inputs(x, weight, bias, ln, embed, residual, kv)
    _check_usable(x.device)
    device, dtype = x.device, x.dtype
    cfg = _config(M, N, K, head_dim, C_kv, device.type == "cuda") | _check_tiles(tiles)
    if kv is not None and C_kv % cfg["block_n"]:
        raise ValueError(f"kv: block_n={cfg['block_n']} must divide H * D = {C_kv}")
    if head_dim is not None and cfg["block_n"] != head_dim:
        raise ValueError(
            f"kv: an 8-bit pool's tile is one head: block_n={cfg['block_n']}, head_dim={head_dim}"
        )
    if residual is not None and embed is None:
        out = residual  # added to in place
    else:
        out = torch.empty((M, C_kv if kv is not None else N), device=device, dtype=dtype)
    if M == 0:
        return out
    use_pdl = pdl_supported(device) if use_pdl is None else use_pdl
    ids, positions, wpe = embed if embed is not None else (x, x, x)  # unread without EMBED
    k_cache, v_cache, k_scale, v_scale, slots = kv if kv is not None else (x, x, None, None, x)
    cache_dtype = k_cache.dtype
    quantized = kv is not None and cache_dtype in QUANTIZED_DTYPES
    ln_w, ln_b, eps = ln if ln is not None else (x, x, 0.0)
    # split-K: each program sums a slice of K of a multiple of block_k; the last slice's program adds them
    k_split = triton.cdiv(triton.cdiv(K, cfg["split_k"]), cfg["block_k"]) * cfg["block_k"]
    splits = triton.cdiv(K, k_split)
    grid = (triton.cdiv(N, cfg["block_n"]), triton.cdiv(M, cfg["block_m"]), splits)
    workspace = counters = x  # unread with one split
    if splits > 1:
        workspace = torch.empty((splits, M, N), device=device, dtype=torch.float32)
        counters = tile_counters(device, grid[0] * grid[1])
    _fused_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        out,
        residual if residual is not None else out,
        ln_w,
        ln_b,
        ids,
        positions,
        wpe,
        slots,
        k_cache,
        v_cache,
        k_scale if quantized else x,
        v_scale if quantized else x,
        workspace,
        counters,
        M,
        N,
        K,
        k_split,
        C_kv or N,
        eps,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        residual.stride(0) if residual is not None else out.stride(0),
        wpe.stride(0),
        LN=ln is not None,
        EMBED=embed is not None,
        BIAS=bias is not None,
        GELU=gelu,
        RESIDUAL=residual is not None and embed is None,
        KV=kv is not None,
        KV_QUANT=quantized,
        HEAD_DIM=head_dim or 16,
        QMAX=kv_quant.qmax(cache_dtype) if quantized else 1.0,
        INV_QMAX=kv_quant.inv_qmax(cache_dtype) if quantized else 1.0,
        SCALE_MAX=kv_quant.scale_max(cache_dtype) if quantized else 1.0,
        FP8=quantized and cache_dtype != torch.int8,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        # fp32: three tf32 products keep fp32's accuracy on tensor cores (kernels.py); the interpreter: ieee
        DOT_PRECISION="ieee" if device.type != "cuda" else "tf32x3" if dtype == torch.float32 else "tf32",
        SPLIT_K=splits,
        USE_PDL=use_pdl,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        enable_fp_fusion=False,  # each multiply and add rounds as torch's separate operations do
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def fused_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ln: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    embed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    kv: tuple | None = None,
) -> torch.Tensor:
    """``fused_linear`` in torch operations, step 15's: the same arguments, the same results (within
    rounding: the products sum in another order)."""
    if embed is not None:
        ids, positions, wpe = embed
        x = x[ids] + wpe[positions]  # [M, K]
        residual.copy_(x)
    if ln is not None:
        x = torch.nn.functional.layer_norm(x, (x.shape[1],), ln[0], ln[1], ln[2])
    y = torch.nn.functional.linear(x, weight.t(), bias)  # [M, N]
    if gelu:
        y = torch.nn.functional.gelu(y, approximate="tanh")
    if residual is not None and embed is None:
        return residual.add_(y)
    if kv is None:
        return y
    k_cache, v_cache, k_scale, v_scale, slots = kv
    H, D = k_cache.shape[2:]
    q, k, v = y.split(H * D, dim=1)
    for cache, scale, t in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        t = t.reshape(-1, H, D)
        if scale is not None:
            t, s = kv_quant.quantize(t, cache.dtype)
            scale.view(-1, H)[slots] = s
        cache.view(-1, H, D)[slots] = t
    return q

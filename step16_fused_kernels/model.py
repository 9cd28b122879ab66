"""GPT-2, the forward pass, in plain PyTorch.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners": embeddings, pre-LayerNorm blocks
(causal self-attention, then a tanh-GELU MLP, each added to the residual), a final LayerNorm, a tied LM head.
A flattened batch of N new tokens of S sequences, no padding (new prompts, the running sequences' newest
tokens): keys and values go to the paged KV cache at the engine's slots; attention reads each sequence's back
through its block table (kernels.py's Triton kernel on a GPU, step 4's gather and SDPA elsewhere); only each
sequence's last token gets logits. Tensor parallelism (parallel_layers.py): each rank holds H / t heads
and a slice of every matrix. Step 16: a small decode step in five kernels a layer (``forward_fused``).
Shapes: N tokens, S sequences, T tokens of one, L its length, C = n_embd, H = n_head, D = C / H, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.weights import GPT2Config, load_config, open_safetensors, resolve_model

from .kv_cache import PagedKVCache
from .parallel_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard
from .parallel_state import SINGLE, TensorParallel

try:
    from . import fused_kernels, kernels
except ImportError:  # Triton is not installed: only the "torch" attention backend
    fused_kernels = kernels = None

# GPT-2 was written with a "Conv1D" layer that stores its weight as [in, out]; nn.Linear stores [out, in].
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Tensors of HF checkpoints that are not parameters: the causal-mask buffers of old checkpoints.
IGNORED_HF_TENSORS = (".attn.bias", ".attn.masked_bias")
# The LM head is the token embedding itself (weight tying): a checkpoint may store it under either name,
# or both.
TIED_HF_TENSORS = {"lm_head.weight": "wte.weight"}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where token t attends to tokens 0..t (Vaswani et al. 2017)."""

    def __init__(self, config: GPT2Config, tp: TensorParallel = SINGLE):
        super().__init__()
        self.n_head = config.n_head // tp.world_size  # this rank's heads
        self.head_dim = config.head_dim
        C = config.n_embd
        self.c_attn = ColumnParallelLinear(C, 3 * C, tp, parts=3)  # q, k, v of this rank's heads, one matmul
        self.c_proj = RowParallelLinear(C, C, tp)  # the heads' outputs summed over the ranks

    def forward(
        self, x: torch.Tensor, kv_cache: PagedKVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        N, C = x.shape[0], self.n_head * self.head_dim  # C / t of this rank's heads
        q, k, v = self.c_attn(x).split(C, dim=1)  # 3 x [N, C / t]
        q = q.view(N, self.n_head, self.head_dim)  # [N, H / t, D]
        k = k.view(N, self.n_head, self.head_dim)  # [N, H / t, D]
        v = v.view(N, self.n_head, self.head_dim)  # [N, H / t, D]
        kv_cache.write(layer, k, v, meta.slot_mapping)  # into the pool, at each new token's slot
        if meta.attention_backend == "triton":  # one kernel launch for the whole batch, keys read in place
            y = kernels.paged_attention(
                q,
                kv_cache.k[layer],
                kv_cache.v[layer],
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc_t,
                meta.max_query_len,
                k_scale=kv_cache.k_scale[layer],  # 8 bits: dequantized in the kernel (None: auto)
                v_scale=kv_cache.v_scale[layer],
            )  # [N, H, D]
        else:
            y = paged_attention(q, k, v, kv_cache, layer, meta)  # [N, H, D]
        return self.c_proj(y.reshape(N, C))


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPT2Config, tp: TensorParallel = SINGLE):
        super().__init__()
        self.c_fc = ColumnParallelLinear(config.n_embd, 4 * config.n_embd, tp)  # [N, 4C / t]
        self.c_proj = RowParallelLinear(4 * config.n_embd, config.n_embd, tp)  # summed over the ranks
        self.approximate = config.activation  # "tanh" for GPT-2's gelu_new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))  # [N, C]


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config, tp: TensorParallel = SINGLE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, tp)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config, tp)

    def forward(
        self, x: torch.Tensor, kv_cache: PagedKVCache, layer: int, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, layer, meta)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class AttentionMetadata:
    """Where the N tokens of a flattened batch come from and where their keys and values go (vLLM's name).

    The batch holds S sequences, the num_prefills prefills first, then the decodes (one token each).
    slot_mapping: [N] int64, the cache slot of each new token (block * block_size + offset).
    query_start_loc: S + 1 offsets: sequence i's new tokens are batch rows
    query_start_loc[i]:query_start_loc[i+1].
    query_start_loc_t: the same offsets as an [S + 1] int64 tensor on the device, for the kernels.
    logits_indices: [S] int64, the row of each sequence's last new token (the one whose logits are sampled).
    seq_lens: [S] int64, each sequence's length after this step (cached tokens + its new ones).
    block_tables: [S, M] int64, each sequence's block ids, short rows padded with block 0.
    max_query_len: the most new tokens of one sequence in this batch. attention_backend: "triton" or "torch".
    decode_mask: "torch" only (else None): [S_d, 1, 1, M * block_size], the model's dtype: 0 for each decode's
    keys, -inf past its length (see ``decode_attention_mask``), made once per step for every layer.
    prefill_seq_lens: "torch" only (else None): seq_lens of the prefills as host ints (a prefill with cached
    context reads that many keys back from the cache).
    fused: a decode-only step (one new token a sequence, N = S) that runs in the fused kernels (step 16).
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    query_start_loc_t: torch.Tensor
    logits_indices: torch.Tensor
    num_prefills: int
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    attention_backend: str
    decode_mask: torch.Tensor | None
    prefill_seq_lens: list[int] | None = None
    fused: bool = False


def decode_attention_mask(seq_lens: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of S_d decodes whose keys were gathered into rows of ``num_keys``:
    [S_d, 1, 1, num_keys] in ``dtype``, 0 where the key position < the sequence's length (``seq_lens``
    [S_d], its new token included), -inf past it. Additive rather than boolean, so that attention does not
    convert it again in every layer."""
    keep = torch.arange(num_keys, device=seq_lens.device)[None, :] < seq_lens[:, None]  # [S_d, num_keys]
    mask = torch.full(keep.shape, float("-inf"), dtype=dtype, device=seq_lens.device).masked_fill_(keep, 0.0)
    return mask[:, None, None, :]


def written_slots(block_tables: torch.Tensor, decode_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of every key position of S_d decodes: [S_d, M * block_size] int64, from their block
    tables [S_d, M]; a position past a sequence's length (-inf in ``decode_mask``) gets the slot of the
    sequence's position 0, which it owns and has written, so the mask hides a real key.

    The slots past a length (the last block's tail, the block the padding entries name) hold whatever
    earlier owners left, NaN or Inf included (an fp16 overflow), and a masked key's zero weight does not
    cancel them (0 x NaN = NaN): the sequence's output would turn NaN. Indexing the pool by slot copies
    as much as gathering whole blocks does, with no second pass to clean the copy."""
    offsets = torch.arange(block_size, device=block_tables.device)  # [block_size]
    slots = (block_tables[:, :, None] * block_size + offsets).flatten(1)  # [S_d, M * block_size]
    return torch.where(decode_mask[:, 0, 0] == 0, slots, slots[:, :1])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of every new token over its own sequence: step 4's plain-PyTorch backend ("torch").

    q, k, v: [N, H, D], the new tokens' (already written into kv_cache). Returns [N, H, D].
    A prefill runs one sequence at a time: its tokens attend to each other with the usual causal mask, or,
    if its leading blocks came from the prefix cache or the pool is 8-bit, to all its L keys, read back
    (dequantized) through its block table (new token i, at L - T + i, sees keys 0 .. L - T + i); a forked
    choice has none. The decodes run
    together, one query each, over keys and values read back from the cache through their block tables,
    with the keys past each sequence's length masked out; only slots a sequence has written are read
    (``written_slots``).
    """
    ys = []  # each sequence's output rows, in batch order
    P = meta.num_prefills
    for i in range(P):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if a == b:  # a forked choice: no new token
            continue
        # cached context, or 8-bit keys (read back as the kernel reads them): every key read back, a copy
        if (L := meta.prefill_seq_lens[i]) > b - a or kv_cache.quantized:
            pos, bs = torch.arange(L, device=q.device), kv_cache.block_size  # [L] key positions
            slots = meta.block_tables[i, pos // bs] * bs + pos % bs  # [L]
            ki, vi = (t.transpose(0, 1) for t in kv_cache.read(layer, slots))  # [H, L, D] each, dequantized
            visible = pos[None, :] <= (L - (b - a) + torch.arange(b - a, device=q.device))[:, None]  # [T, L]
            y = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), ki, vi, attn_mask=visible)  # [H, T, D]
            ys.append(y.transpose(0, 1))  # [T, H, D]
            continue
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, T, D]
        ys.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))  # [T, H, D]
    if P < len(meta.query_start_loc) - 1:
        a = meta.query_start_loc[P]
        # each key position's slot, or past a sequence's length one it has written: [S_d, M * block_size]
        slots = written_slots(meta.block_tables[P:], meta.decode_mask, kv_cache.block_size)
        k_all, v_all = kv_cache.read(layer, slots)  # [S_d, M * block_size, H, D] each, a copy, dequantized
        ys.append(
            F.scaled_dot_product_attention(
                q[a:, :, None, :],  # [S_d, H, 1, D]
                k_all.transpose(1, 2),  # [S_d, H, M * block_size, D]
                v_all.transpose(1, 2),
                attn_mask=meta.decode_mask,  # [S_d, 1, 1, M * block_size]
            )[:, :, 0]
        )  # [S_d, H, D]
    return torch.cat(ys)  # [N, H, D]


class GPT(nn.Module):
    """The GPT-2 language model: token ids in, next-token logits out; with ``tp`` (t ranks) this rank's
    shard, every rank running the same pass (the LayerNorms and the position embedding whole on each)."""

    def __init__(self, config: GPT2Config, tp: TensorParallel = SINGLE):
        super().__init__()
        if config.n_head % tp.world_size:
            raise ValueError(
                f"tensor_parallel_size={tp.world_size}: must divide the model's n_head={config.n_head}"
            )
        self.config, self.tp = config, tp
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, tp)  # also the LM head
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)  # learned position embedding
        self.h = nn.ModuleList(Block(config, tp) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Next-token logits of every sequence in a flattened batch.

        input_ids, positions: [N] int64, the new tokens and their positions in their own sequences.
        Returns [S, V]: the logits after each sequence's last new token (gathered on every rank). The new
        tokens' keys and values (this rank's heads) are written into kv_cache. ``meta.fused``: the same
        through ``forward_fused``.
        """
        if meta.fused:
            return self.forward_fused(input_ids, positions, kv_cache, meta)
        x = self.wte(input_ids) + self.wpe(positions)  # [N, C]
        for layer, block in enumerate(self.h):
            x = block(x, kv_cache, layer, meta)  # [N, C]
        x = self.ln_f(x[meta.logits_indices])  # [S, C], each sequence's last token
        return self.wte.logits(x)  # [S, V], the LM head tied to the token embedding

    def forward_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``forward`` of a decode step (N = S sequences, one new token each) in fused kernels, five a layer:
        (a) ln_1, the QKV product and its bias, k and v into the pool (layer 0: the embeddings first);
        (b) the paged attention of kernels.py; (c) the output projection, its bias and the residual;
        (d) ln_2, the first MLP product, its bias and GELU; (e) the second, its bias and the residual; then
        ln_f with the LM head. With t ranks, each row-parallel product's all-reduce comes before its bias
        and residual, and the embeddings and the LM head are step 15's. Returns [S, V]."""
        N, t, C = input_ids.shape[0], self.tp.world_size, self.config.n_embd
        eps = self.config.layer_norm_epsilon
        embedded = t == 1  # the embeddings in layer 0's first kernel, which writes them into x
        if embedded:
            x = torch.empty(N, C, device=input_ids.device, dtype=self.wpe.weight.dtype)  # the residual stream
        else:
            x = self.wte(input_ids) + self.wpe(positions)  # [N, C]
        for layer, block in enumerate(self.h):
            attn, mlp = block.attn, block.mlp
            embed = (input_ids, positions, self.wpe.weight) if embedded and layer == 0 else None
            pool = kv_cache.k[layer], kv_cache.v[layer], kv_cache.k_scale[layer], kv_cache.v_scale[layer]
            q = fused_kernels.fused_linear(  # [N, C / t]; k, v into the pool
                self.wte.weight if embed else x,
                attn.c_attn.weight.t(),  # [C, 3C / t]
                attn.c_attn.bias,
                ln=(block.ln_1.weight, block.ln_1.bias, eps),
                embed=embed,
                residual=x if embed else None,
                kv=(*pool, meta.slot_mapping),
            )
            y = kernels.paged_attention(
                q.view(N, attn.n_head, attn.head_dim),
                kv_cache.k[layer],
                kv_cache.v[layer],
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc_t,
                1,
                k_scale=kv_cache.k_scale[layer],
                v_scale=kv_cache.v_scale[layer],
            )  # [N, H / t, D]
            self._row_parallel(y.view(N, -1), attn.c_proj, x)  # x += attention's output
            h = fused_kernels.fused_linear(  # [N, 4C / t]
                x, mlp.c_fc.weight.t(), mlp.c_fc.bias, ln=(block.ln_2.weight, block.ln_2.bias, eps), gelu=True
            )
            self._row_parallel(h, mlp.c_proj, x)  # x += the MLP's output
        if t > 1:
            return self.wte.logits(self.ln_f(x))  # [S, V], gathered
        return fused_kernels.fused_linear(
            x, self.wte.weight.t(), ln=(self.ln_f.weight, self.ln_f.bias, eps)
        )  # [S, V]

    def _row_parallel(self, inputs: torch.Tensor, linear: RowParallelLinear, x: torch.Tensor) -> None:
        """x += inputs W^T + b, the residual added in the product's kernel; with t ranks, the partial
        products all-reduced first, then the bias and the residual (step 15's order)."""
        if self.tp.world_size == 1:
            fused_kernels.fused_linear(inputs, linear.weight.t(), linear.bias, residual=x)
            return
        partial = fused_kernels.fused_linear(inputs, linear.weight.t())  # [N, C], this rank's sum
        x.add_(self.tp.all_reduce(partial) + linear.bias)

    def load_hf_weights(self, hf_tensors: dict) -> None:
        """Copy a Hugging Face GPT-2 state dict into this model: this rank's shard of each tensor.

        Names map one to one after dropping the ``transformer.`` prefix that ``GPT2LMHeadModel``
        checkpoints carry (``GPT2Model`` checkpoints, like OpenAI's on the Hub, have none); the tied LM
        head may come as ``wte.weight``, as ``lm_head.weight`` or as both; Conv1D weights are transposed.
        Raises ValueError on a missing, unexpected or wrongly shaped tensor, and on two tensors for one
        parameter that differ (an ``lm_head.weight`` unlike ``wte.weight`` is an untied LM head).
        ``hf_tensors``: tensors, or safetensors slices (``open_safetensors``): only the shards are read.
        """
        own = dict(self.named_parameters())
        modules = dict(self.named_modules())
        rank, t = self.tp.rank, self.tp.world_size

        def read(name: str, tensor) -> torch.Tensor:  # this rank's shard (as stored), else the whole
            module_name, _, param = name.rpartition(".")
            module = modules.get(module_name)
            dim = getattr(module, "SHARD_DIMS", {}).get(param)
            if name not in own or dim is None or t == 1:
                return tensor[:]  # a safetensors slice read whole (a tensor: a view of it)
            stored = 1 - dim if name.endswith(CONV1D_WEIGHTS) else dim  # Conv1D stores [in, out]
            shape = tensor.get_shape() if hasattr(tensor, "get_shape") else list(tensor.shape)
            padded = getattr(module, "padded", None)  # the vocabulary: padded to a multiple of t
            full = module.vocab_size if padded else own[name].shape[dim] * t
            if len(shape) != own[name].dim() or shape[stored] != full:
                return tensor[:]  # not this model's shape: the shape check below names it
            return shard(tensor, stored, rank, t, module.parts, padded)

        found: dict[str, tuple[str, torch.Tensor]] = {}  # our name -> (HF name, tensor)
        for hf_name, tensor in hf_tensors.items():
            name = hf_name.removeprefix("transformer.")
            if name.endswith(IGNORED_HF_TENSORS):  # e.g. "h.0.attn.bias", not "h.0.attn.c_attn.bias"
                continue
            name = TIED_HF_TENSORS.get(name, name)
            if name in found:  # saved twice: the LM head beside the embedding, or with and without the prefix
                first_name, first = found[name]
                first, tensor = read(name, first), read(name, tensor)  # this rank's shard of each
                if not torch.equal(first, tensor):
                    untied = (
                        ": an untied LM head, which GPT-2's tied weights cannot represent"
                        if name == "wte.weight"
                        else ""
                    )
                    raise ValueError(f"checkpoint tensors {first_name!r} and {hf_name!r} differ{untied}")
                continue
            found[name] = (hf_name, tensor)  # read below, once
        for name, (hf_name, tensor) in found.items():
            if name not in own:
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
            tensor = read(name, tensor)
            if name.endswith(CONV1D_WEIGHTS):
                # [in, out] -> [out, in] as a view: memory keeps Conv1D's order, which this CPU's BLAS
                # reads faster at batch 1 than nn.Linear's own (step 2's README has the numbers).
                tensor = tensor.t()
            if tensor.shape != own[name].shape:
                expected = list(own[name].shape)
                raise ValueError(
                    f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected {expected}"
                    + (f" (rank {rank}'s shard of {t})" if t > 1 else "")
                )
            own[name].data = tensor.to(device=own[name].device, dtype=own[name].dtype, copy=True)
        missing = sorted(set(own) - set(found))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @classmethod
    def from_pretrained(
        cls,
        model: str = "demo",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
    ) -> GPT:
        """Build the model of a snapshot (see ``common.weights.resolve_model``) and load its weights (with
        ``tp``, this rank's shards only).

        The modules are created on the "meta" device (no memory, no random init) and then given
        uninitialised storage, which the checkpoint's tensors fill. Returns the model in eval mode.
        Raises ValueError (bad spec, folder or checkpoint) or ConnectionError (Hub unreachable).
        """
        folder = resolve_model(model)
        with torch.device("meta"):
            gpt = cls(load_config(folder), tp)
        gpt = gpt.to_empty(device=device).to(dtype)
        gpt.load_hf_weights(open_safetensors(folder))
        return gpt.eval()

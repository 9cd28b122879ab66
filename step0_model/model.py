"""GPT-2, the forward pass, in plain PyTorch.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners": embeddings, pre-LayerNorm blocks
(causal self-attention, then a tanh-GELU MLP, each added to the residual), a final LayerNorm, a tied LM head.

Shapes: B batch, T tokens, C = n_embd, H = n_head, D = C / H head size, V = vocab_size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.weights import GPT2Config, load_config, load_safetensors, resolve_model

# GPT-2 was written with a "Conv1D" layer that stores its weight as [in, out]; nn.Linear stores [out, in].
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Tensors of HF checkpoints that are not parameters: the causal-mask buffers of old checkpoints.
IGNORED_HF_TENSORS = (".attn.bias", ".attn.masked_bias")
# The LM head is the token embedding itself (weight tying): a checkpoint may store it under either name,
# or both.
TIED_HF_TENSORS = {"lm_head.weight": "wte.weight"}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where token t attends to tokens 0..t (Vaswani et al. 2017)."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v projections in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x [B, T, C]
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )  # [B, H, T, D], softmax(q k^T / sqrt(D)) v
        y = y.transpose(1, 2).reshape(B, T, C)  # [B, T, C], heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network: C -> 4C -> GELU -> C."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.approximate = config.activation  # "tanh" for GPT-2's gelu_new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))  # [B, T, C]


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """The GPT-2 language model: token ids in, next-token logits out."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding, also the LM head
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)  # learned position embedding
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits for every position, or only the last.

        input_ids: [B, T] int64 token ids, T <= n_positions. Returns [B, T, V] logits, where
        logits[b, t] scores the token that follows input_ids[b, :t+1]; with last_only, [B, 1, V] for the
        last position, all that generation needs (the LM head is GPT-2's largest matmul: V = 50257).
        """
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device)  # [T]
        x = self.wte(input_ids) + self.wpe(positions)  # [B, T, C]
        for block in self.h:
            x = block(x)  # [B, T, C]
        if last_only:
            x = x[:, -1:]  # [B, 1, C]
        x = self.ln_f(x)  # [B, T, C]
        return F.linear(x, self.wte.weight)  # [B, T, V], the LM head tied to the token embedding

    def load_hf_weights(self, hf_tensors: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face GPT-2 state dict into this model.

        Names map one to one after dropping the ``transformer.`` prefix that ``GPT2LMHeadModel``
        checkpoints carry (``GPT2Model`` checkpoints, like OpenAI's on the Hub, have none); the tied LM
        head may come as ``wte.weight``, as ``lm_head.weight`` or as both; Conv1D weights are transposed.
        Raises ValueError on a missing, unexpected or wrongly shaped tensor, and on two tensors for one
        parameter that differ (an ``lm_head.weight`` unlike ``wte.weight`` is an untied LM head).
        """
        own = dict(self.named_parameters())
        found: dict[str, tuple[str, torch.Tensor]] = {}  # our name -> (HF name, tensor)
        for hf_name, tensor in hf_tensors.items():
            name = hf_name.removeprefix("transformer.")
            if name.endswith(IGNORED_HF_TENSORS):  # e.g. "h.0.attn.bias", not "h.0.attn.c_attn.bias"
                continue
            name = TIED_HF_TENSORS.get(name, name)
            if name in found:  # saved twice: the LM head beside the embedding, or with and without the prefix
                first_name, first = found[name]
                if not torch.equal(first, tensor):
                    untied = (
                        ": an untied LM head, which GPT-2's tied weights cannot represent"
                        if name == "wte.weight"
                        else ""
                    )
                    raise ValueError(f"checkpoint tensors {first_name!r} and {hf_name!r} differ{untied}")
                continue
            found[name] = (hf_name, tensor)
        for name, (hf_name, tensor) in found.items():
            if name not in own:
                raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
            if name.endswith(CONV1D_WEIGHTS):
                # [in, out] -> [out, in] as a view: memory keeps Conv1D's order, which this CPU's BLAS
                # reads faster at batch 1 than nn.Linear's own (step 2's README has the numbers).
                tensor = tensor.t()
            if tensor.shape != own[name].shape:
                raise ValueError(
                    f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected {list(own[name].shape)}"
                )
            own[name].data = tensor.to(device=own[name].device, dtype=own[name].dtype, copy=True)
        missing = sorted(set(own) - set(found))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @classmethod
    def from_pretrained(
        cls, model: str = "demo", device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> GPT:
        """Build the model of a snapshot (see ``common.weights.resolve_model``) and load its weights.

        The modules are created on the "meta" device (no memory, no random init) and then given
        uninitialised storage, which the checkpoint's tensors fill. Returns the model in eval mode.
        Raises ValueError (bad spec, folder or checkpoint) or ConnectionError (Hub unreachable).
        """
        folder = resolve_model(model)
        with torch.device("meta"):
            gpt = cls(load_config(folder))
        gpt = gpt.to_empty(device=device).to(dtype)
        gpt.load_hf_weights(load_safetensors(folder))
        return gpt.eval()

"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

It turns the sequences of this step into the model's input tensors, runs the forward pass and samples one
token per sequence. With a KV cache the prompt goes through the model once (prefill) and every later pass
takes only the newest token (decode): n tokens after a p-token prompt cost p + n positions, not step 1's
p + (p+1) + ... + (p+n-1).
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .kv_cache import KVCache
from .model import GPT
from .sampler import sample
from .sampling_params import Logprob
from .sequence import Sequence


class ModelRunner:
    """Runs ``model`` on ``device`` for the sequences the engine picks, and samples their next tokens."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, device: torch.device):
        self.model = model
        self.config = model.config  # the cache's shape
        self.tokenizer = tokenizer
        self.device = device

    def allocate_kv_cache(self, seqs: list[Sequence]) -> KVCache:
        """A new, empty KV cache for the sequence that starts now, sized for its prompt + max_tokens."""
        (seq,) = seqs
        return KVCache(self.config, seq.max_len, self.device, self.model.wte.weight.dtype)

    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], kv_cache: KVCache
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One forward pass for ``seqs`` over their ``kv_cache``, then one sampled token per sequence (and
        its logprobs if asked)."""
        input_ids = self.prepare_inputs(seqs, kv_cache)
        # [B, V]: the scores of the token after the last one
        logits = self.model(input_ids, kv_cache, last_only=True)[:, -1]
        return self.sample(seqs, logits)

    def prepare_inputs(self, seqs: list[Sequence], kv_cache: KVCache) -> torch.Tensor:
        """The model's input: [1, T], the whole prompt on the first step (prefill), then [1, 1], only the
        newest token (decode): the cache holds the rest."""
        (seq,) = seqs
        if kv_cache.length == 0:
            return self.to_device([seq.token_ids])  # [1, T]: the prompt (prefill)
        return self.to_device([seq.token_ids[-1:]])  # [1, 1]: only the new token (decode)

    def to_device(self, data: list) -> torch.Tensor:
        """A tensor of host data on the device, copied without making the host wait for the GPU (through
        pinned memory: a copy from ordinary memory would first wait for all queued GPU work)."""
        tensor = torch.tensor(data)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One token per row of ``logits`` [B, V], each with its own sequence's parameters and generator:
        the sampler takes one row at a time."""
        token_ids, logprobs = [], []
        decode = lambda token_id: self.tokenizer.decode([token_id])  # noqa: E731
        for seq, row in zip(seqs, logits):
            token_id, lp = sample(row, seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids)
            token_ids.append(token_id)
            logprobs.append(lp.as_dict(decode) if lp is not None else None)
        return token_ids, logprobs

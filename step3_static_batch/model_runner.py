"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

It turns the sequences of this step into the model's input tensors, runs the forward pass and samples one
token per sequence. With a KV cache the prompt goes through the model once (prefill) and every later pass
takes only the newest token (decode): n tokens after a p-token prompt cost p + n positions, not step 1's
p + (p+1) + ... + (p+n-1).

Static batching: a batch's sequences run together, one row each, prompts left-padded to the longest (the
model masks the padding out); the batch keeps its rows until the last one finishes, a finished row still
feeding its last token, computed for nothing.
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
        """A new, empty KV cache for the batch that starts now: one row per sequence, the prompts left-padded
        to the longest, room for the longest-running row's prompt + max_tokens."""
        longest = max(len(seq) for seq in seqs)
        num_pads = [longest - len(seq) for seq in seqs]
        capacity = longest + max(seq.max_len - len(seq) for seq in seqs)
        return KVCache(self.config, capacity, self.device, self.model.wte.weight.dtype, num_pads)

    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], kv_cache: KVCache
    ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One forward pass for ``seqs`` over their ``kv_cache``, then one sampled token per sequence (and
        its logprobs if asked)."""
        input_ids = self.prepare_inputs(seqs, kv_cache)
        # [B, V]: the scores of the token after the last one
        logits = self.model(input_ids, kv_cache, kv_cache.num_pads_t, last_only=True)[:, -1]
        return self.sample(seqs, logits)

    def prepare_inputs(self, seqs: list[Sequence], kv_cache: KVCache) -> torch.Tensor:
        """The model's input: [B, T], the left-padded prompts on the first step (prefill), then [B, 1], each
        row's newest token (decode): the cache holds the rest."""
        if kv_cache.length == 0:
            pad_id = self.tokenizer.eos_token_id  # any id: padding is masked out
            rows = [[pad_id] * n + seq.token_ids for n, seq in zip(kv_cache.num_pads, seqs)]
            return self.to_device(rows)  # [B, T]: the prompts (prefill)
        # [B, 1]: each row's newest token (a finished row repeats its last one, computed for nothing)
        return self.to_device([seq.token_ids[-1:] for seq in seqs])

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
        """One token per row of ``logits`` [B, V], each with its own sequence's parameters and generator."""
        out = sample(
            logits,
            [seq.params for seq in seqs],
            [seq.generator for seq in seqs],
            [seq.prompt_token_ids for seq in seqs],
            [seq.output_token_ids for seq in seqs],
        )
        decode = lambda token_id: self.tokenizer.decode([token_id])  # noqa: E731
        return out.token_ids, [row.as_dict(decode) if row is not None else None for row in out.logprobs]

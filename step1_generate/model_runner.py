"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

It turns the sequences that run in this step into the model's input tensors, runs the forward pass,
and samples one token per sequence from the logits. This step feeds the whole sequence (prompt and
everything generated so far) every time: generating n tokens after a prompt of p tokens costs
p + (p+1) + ... + (p+n-1) token positions, O(n^2) work. Step 2 removes that with a KV cache.
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .model import GPT
from .sampler import sample
from .sampling_params import Logprob
from .sequence import Sequence


class ModelRunner:
    """Runs ``model`` on ``device`` for the sequences the engine picks, and samples their next tokens."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, device: torch.device):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One forward pass for ``seqs``, then one sampled token per sequence (and its logprobs if asked)."""
        input_ids = self.prepare_inputs(seqs)
        # [B, V]: the scores of the token after the last one
        logits = self.model(input_ids, last_only=True)[:, -1]
        return self.sample(seqs, logits)

    def prepare_inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """The model's input: [1, T], the one sequence's every token, every time."""
        (seq,) = seqs
        return self.to_device([seq.token_ids])  # [1, T]

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

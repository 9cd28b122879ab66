"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

It turns the sequences of this step into the model's input tensors, runs the forward pass and samples one
token per sequence. With a KV cache the prompt goes through the model once (prefill) and every later pass
takes only the newest token (decode): n tokens after a p-token prompt cost p + n positions, not step 1's
p + (p+1) + ... + (p+n-1).

Continuous batching over a paged KV cache: one flat batch of new tokens per step, no padding (the whole
prompts of sequences that start or restart, each decoding one's newest token), each with its position and
cache slot (the slot mapping); the decodes carry the block tables that attention reads their cache through.
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .block_manager import BlockManager
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata, decode_attention_mask
from .sampler import sample
from .sampling_params import Logprob
from .scheduler import SchedulerOutput
from .sequence import Sequence


class ModelRunner:
    """Runs ``model`` on ``device`` for the sequences the engine picks, and samples their next tokens."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        device: torch.device,
        kv_cache: PagedKVCache,
        block_manager: BlockManager,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.kv_cache = kv_cache  # the pool every sequence's blocks live in
        self.block_manager = block_manager  # who owns which block

    @torch.inference_mode()
    def run(self, scheduled: SchedulerOutput) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One forward pass over the step's prefills and decodes, then one sampled token per sequence
        (and its logprobs, if asked for), in the order prefills + decodes."""
        input_ids, positions, meta = self.prepare_inputs(scheduled)
        logits = self.model(input_ids, positions, self.kv_cache, meta)  # [S, V], one row per sequence
        return self.sample(scheduled.seqs, logits)

    def prepare_inputs(
        self, scheduled: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the step's sequences into one batch: token ids, positions and slot mapping [N] each,
        where each sequence starts, and, for the decodes, their lengths and block tables. Everything
        goes to the device in one copy."""
        blocks = self.block_manager
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        for seq in scheduled.prefills:  # every token of the sequence (prompt, and output if it was preempted)
            token_ids += seq.token_ids
            positions += range(len(seq))
            slots += blocks.slots(seq.request_id, 0, len(seq))
            query_start_loc.append(query_start_loc[-1] + len(seq))
        for seq in scheduled.decodes:  # only the newest token, at position len - 1
            token_ids.append(seq.token_ids[-1])
            positions.append(len(seq) - 1)
            slots += blocks.slots(seq.request_id, len(seq) - 1, len(seq))
            query_start_loc.append(query_start_loc[-1] + 1)
        seq_lens = [len(seq) for seq in scheduled.decodes]
        tables = [blocks.block_tables[seq.request_id] for seq in scheduled.decodes]
        width = max((len(t) for t in tables), default=1)
        padded_tables = [
            x for t in tables for x in t + [0] * (width - len(t))
        ]  # short rows padded with block 0
        N, S_d = len(token_ids), len(seq_lens)  # new tokens, decodes
        # one host-to-device copy for the whole step
        packed = self.to_device(
            token_ids + positions + slots + query_start_loc[1:] + seq_lens + padded_tables
        )
        input_ids, positions_t, slot_mapping, ends, decode_seq_lens, decode_block_tables = packed.split(
            [N, N, N, len(query_start_loc) - 1, S_d, S_d * width]
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            logits_indices=ends - 1,  # each sequence's last new token
            num_prefills=len(scheduled.prefills),
            decode_block_tables=decode_block_tables.view(S_d, width),
            decode_mask=decode_attention_mask(
                decode_seq_lens, width * self.kv_cache.block_size, self.kv_cache.dtype
            ),
        )
        return input_ids, positions_t, meta

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

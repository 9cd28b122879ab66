"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

A step's sequences are one flat batch of new tokens over the paged KV cache (starting prompts, decoding
sequences' newest tokens), its inputs in persistent buffers copied once per step (input_batch.py). A
decode-only step is padded to a rung of the capture ladder and replays its CUDA graph (cuda_graph.py), or the
same padded pass eagerly (a CPU, ``enforce_eager``); prefill steps run eagerly.
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .block_manager import BlockManager, blocks_for
from .cuda_graph import CaptureStats, CUDAGraphRunner, capture_sizes, padded_size
from .input_batch import InputBatch
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
        attention_backend: str,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        scratch_block: int,
    ):
        self.attention_backend = attention_backend  # "triton" or "torch"
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.kv_cache = kv_cache  # the pool every sequence's blocks live in
        self.block_manager = block_manager  # who owns which block
        self.capture_sizes = capture_sizes(max_num_seqs)  # the ladder a decode-only batch is padded to
        self.max_blocks = blocks_for(model.config.n_positions, kv_cache.block_size)  # block-table width
        most = min(max_num_batched_tokens, max_num_seqs * model.config.n_positions)  # a step's most tokens
        self.input_batch = InputBatch(
            max_num_seqs, most, self.max_blocks, kv_cache.block_size, scratch_block, device
        )
        self.graph_runner: CUDAGraphRunner | None = None  # set by capture_cudagraphs

    @torch.inference_mode()
    def run(self, scheduled: SchedulerOutput) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """One forward pass over the step's prefills and decodes, then one sampled token per sequence
        (and its logprobs, if asked for), in the order prefills + decodes. A decode-only batch is padded
        to its rung and replays that rung's graph, if captured; the padding lanes' logits are dropped."""
        S, P = len(scheduled.seqs), len(scheduled.prefills)
        num_lanes = padded_size(self.capture_sizes, S) if P == 0 else S
        N, query_start_loc = self.input_batch.prepare(
            scheduled, self.block_manager.block_tables, num_lanes
        )  # the step's one host-to-device copy
        if P == 0 and self.graph_runner is not None:
            logits = self.graph_runner.replay(num_lanes)  # [num_lanes, V]
        elif P == 0:
            logits = self.decode_forward(num_lanes)  # what the graph would replay, eagerly
        else:
            width = max(self.input_batch.num_blocks[self.input_batch.np["rows"][:S]])
            logits = self.execute_model(N, S, P, query_start_loc, width)  # [S, V]
        return self.sample(scheduled.seqs, logits[:S])

    def decode_forward(self, num_lanes: int) -> torch.Tensor:
        """The forward pass of a decode-only batch of ``num_lanes`` lanes over the persistent buffers,
        block tables at their full width: the function that ``capture_cudagraphs`` captures. [num_lanes, V]"""
        return self.execute_model(num_lanes, num_lanes, 0, list(range(num_lanes + 1)), self.max_blocks)

    def execute_model(self, N: int, S: int, P: int, query_start_loc: list[int], width: int) -> torch.Tensor:
        """The forward pass over the first N tokens and S lanes of the device buffers (P prefills first),
        each lane's block-table row gathered by the device and cut to ``width`` blocks. Returns [S, V]."""
        dev = self.input_batch.gpu
        starts = dev["query_start_loc"][: S + 1]
        seq_lens = dev["seq_lens"][:S]
        block_tables = self.input_batch.block_table_gpu[dev["rows"][:S], :width]  # [S, width]
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:N],
            query_start_loc=query_start_loc,
            query_start_loc_t=starts,
            logits_indices=starts[1:] - 1,  # each sequence's last new token
            num_prefills=P,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            attention_backend=self.attention_backend,
            decode_mask=decode_attention_mask(
                seq_lens[P:], width * self.kv_cache.block_size, self.kv_cache.dtype
            )
            if self.attention_backend == "torch"
            else None,
        )
        return self.model(dev["input_ids"][:N], dev["positions"][:N], self.kv_cache, meta)  # [S, V]

    def capture_cudagraphs(self) -> CaptureStats:
        """Capture ``decode_forward`` at every batch size of the ladder (CUDA only); from now on decode-only
        steps replay. Returns the graphs' sizes, capture time and memory."""
        self.input_batch.fill_padding(max(self.capture_sizes))  # warm-ups write the scratch slot only
        self.graph_runner = CUDAGraphRunner(
            self.decode_forward,
            self.capture_sizes,
            self.model.config.vocab_size,
            self.kv_cache.dtype,
            self.device,
        )
        return self.graph_runner.capture()

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

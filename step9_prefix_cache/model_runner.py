"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

A step's sequences are one flat batch of new tokens over the paged KV cache (starting prompts, decoding
sequences' newest tokens), its inputs in persistent buffers copied once per step (input_batch.py). A
decode-only step is padded to a rung of the capture ladder and replays its CUDA graph (cuda_graph.py), or the
same padded pass eagerly (a CPU, ``enforce_eager``); prefill steps run eagerly.

Async scheduling: ``launch`` enqueues a step and returns: the forward, ``sample_on_device``, the ids
scattered into ``InputBatch.last_token`` (where the next step's decode lanes gather theirs), a non-blocking
copy to pinned memory and its event, awaited by ``AsyncModelRunnerOutput.get_output`` (vLLM's names).
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .block_manager import BlockManager, blocks_for
from .cuda_graph import CaptureStats, CUDAGraphRunner, capture_sizes, padded_size
from .input_batch import InputBatch
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata, decode_attention_mask
from .sampler import sample_on_device, to_host
from .sampling_params import Logprob, SamplingParams
from .scheduler import SchedulerOutput
from .sequence import Sequence


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens, on their way to the host (vLLM's name).

    seqs: the step's sequences in lane order (prefills, then decodes). packed: ``sample_on_device``'s
    output [S, 1 or 3 + 2n], copied into pinned host memory by a non-blocking copy on a CUDA device (then
    ``copied`` is the event recorded after it), or the CPU tensor itself (the "copy" was synchronous).
    """

    def __init__(self, seqs: list[Sequence], packed: torch.Tensor, tokenizer: Tokenizer):
        self.seqs = seqs
        self.params: list[SamplingParams] = [seq.params for seq in seqs]
        self.tokenizer = tokenizer
        self.copied: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            self.packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.packed.copy_(packed, non_blocking=True)  # [S, C] device -> host, the host does not wait
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(packed.device))
        else:
            self.packed = packed  # [S, C]

    def get_output(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """Wait for the copy (the step's one wait for the device), then one token per sequence, in
        ``seqs`` order, and its logprobs if asked for."""
        if self.copied is not None:
            self.copied.synchronize()
        out = to_host(self.packed, self.params)
        decode = lambda token_id: self.tokenizer.decode([token_id])  # noqa: E731
        return out.token_ids, [row.as_dict(decode) if row is not None else None for row in out.logprobs]


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
    def launch(self, scheduled: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Enqueue one step on the device and return without waiting for it: one forward pass over the
        step's prefills and decodes, sampling, each sampled id scattered into ``last_token`` at its
        sequence's row, the copy of the sampled ids to the host. A decode-only batch is padded to its rung
        and replays that rung's graph, if captured; the padding lanes' logits are dropped."""
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
        seqs = scheduled.seqs
        packed = sample_on_device(
            logits[:S],
            [seq.params for seq in seqs],
            [seq.generator for seq in seqs],
            [seq.prompt_token_ids for seq in seqs],
            [seq.output_token_ids for seq in seqs],
        )  # [S, 1 or 3 + 2n] float32, on the device
        rows = self.input_batch.gpu["rows"][:S]  # [S] each lane's row
        self.input_batch.last_token.index_copy_(0, rows, packed[:, 0].long())  # the next step's input ids
        return AsyncModelRunnerOutput(seqs, packed, self.tokenizer)

    def decode_forward(self, num_lanes: int) -> torch.Tensor:
        """The forward pass of a decode-only batch of ``num_lanes`` lanes over the persistent buffers,
        block tables at their full width: the function that ``capture_cudagraphs`` captures. [num_lanes, V]"""
        return self.execute_model(num_lanes, num_lanes, 0, list(range(num_lanes + 1)), self.max_blocks)

    def execute_model(self, N: int, S: int, P: int, query_start_loc: list[int], width: int) -> torch.Tensor:
        """The forward pass over the first N tokens and S lanes of the device buffers (P prefills first),
        each lane's block-table row gathered by the device and cut to ``width`` blocks. Returns [S, V]."""
        dev = self.input_batch.gpu
        D = S - P  # decode (and padding) lanes: their input ids, sampled on the device, gathered by row
        dev["input_ids"][N - D : N] = self.input_batch.last_token[dev["rows"][P:S]]  # [D]
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
            prefill_seq_lens=self.input_batch.np["seq_lens"][:P].tolist()
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

"""The model runner: one step's sequences in, their next tokens out (vLLM's name).

A step's sequences are one flat batch of new tokens over the paged KV cache (prompts or chunks, decodes'
newest tokens), inputs in persistent buffers copied once per step (input_batch.py). A uniform step (decode-
only, or every lane a verification of 1 + k tokens) is padded to a rung of the capture ladder and replays
its CUDA graph (cuda_graph.py), or the same pass eagerly; so does a mixed step with chunked prefill and the
Triton kernel, padded to a token count. Async scheduling: ``launch`` enqueues a step and returns: the
forward, ``sample_on_device``, the ids scattered into ``InputBatch.last_token``, a non-blocking copy to
pinned memory and its event (``AsyncModelRunnerOutput.get_output``). Tensor parallelism: a pass is a
``StepPlan`` that rank 0 broadcasts and every worker's runner follows (``follow``) on its shard.
"""

from __future__ import annotations

import torch

from common.tokenizer import Tokenizer

from .block_manager import BlockManager, blocks_for
from .cuda_graph import CaptureStats, CUDAGraphRunner, capture_sizes, padded_size, token_sizes
from .input_batch import InputBatch, is_uniform
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata, decode_attention_mask
from .parallel_state import (
    CAPTURE,
    DECODE,
    EAGER,
    MIXED,
    SHUTDOWN,
    SINGLE,
    VERIFY,
    StepPlan,
    TensorParallel,
    broadcast_plan,
    receive_plan,
)
from .rejection_sampler import rejection_sample
from .sampler import sample_on_device, to_host
from .sampling_params import Logprob, SamplingParams
from .scheduler import SchedulerOutput
from .sequence import Sequence

# A padded mixed step's tile (``kernels._attention_config``): the decodes' 16 rows for every lane, so that a
# decode does not fill one row of a long prompt's tile; chosen by profile (benchmarks/NOTES.md, step 13)
MIXED_QUERY_LEN = 16


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens, on their way to the host (vLLM's name).

    seqs: the step's sampled sequences in lane order (prefills, then decodes). packed: ``sample_on_device``'s
    output [S, 1 or 3 + 2n]; verifies: the step's verified sequences; verified: ``rejection_sample``'s
    [B, 2] (or None); each copied into pinned host memory by a non-blocking copy on a CUDA device (then
    ``copied`` is the event recorded after them), or the CPU tensor itself (the "copy" was synchronous).
    replayed: whether the step's forward pass replayed a CUDA graph.
    """

    def __init__(
        self,
        seqs: list[Sequence],
        packed: torch.Tensor,
        tokenizer: Tokenizer,
        verifies: list[Sequence] = (),
        verified: torch.Tensor | None = None,
        replayed: bool = False,
    ):
        self.seqs = seqs
        self.verifies, self.replayed = verifies, replayed
        self.params: list[SamplingParams] = [seq.params for seq in seqs]
        self.tokenizer = tokenizer
        self.copied: torch.cuda.Event | None = None
        self.packed, self.verified = (to_pinned(t) for t in (packed, verified))  # [S, C], [B, 2]
        if packed.device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(packed.device))

    def get_output(self) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """Wait for the copy (the step's one wait for the device), then one token per sequence, in
        ``seqs`` order, and its logprobs if asked for."""
        if self.copied is not None:
            self.copied.synchronize()
        out = to_host(self.packed, self.params)
        decode = lambda token_id: self.tokenizer.decode([token_id])  # noqa: E731
        return out.token_ids, [row.as_dict(decode) if row is not None else None for row in out.logprobs]

    def get_verified(self) -> list[list[int]]:
        """Each verified sequence's [drafts accepted, the target's token after them], in ``verifies`` order
        (waits for the copy too)."""
        if self.verified is None:
            return []
        if self.copied is not None:
            self.copied.synchronize()
        return self.verified.tolist()


def to_pinned(t: torch.Tensor | None) -> torch.Tensor | None:
    """A CUDA tensor's copy in pinned host memory, by a non-blocking copy (the host does not wait); a CPU
    tensor (or None) as it is."""
    if t is None or t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


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
        num_speculative_tokens: int = 0,
        enable_chunked_prefill: bool = False,
        tp: TensorParallel = SINGLE,
        fused_max_batch: int = 0,
    ):
        self.tp = tp  # rank 0 (the engine's) broadcasts each pass; a worker's (block_manager None) follows
        self.attention_backend = attention_backend  # "triton" or "torch"
        self.fused_max_batch = fused_max_batch  # decode steps of at most this many lanes run fused (0: none)
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.kv_cache = kv_cache  # the pool every sequence's blocks live in
        self.block_manager = block_manager  # who owns which block
        self.capture_sizes = capture_sizes(max_num_seqs)  # the ladder a uniform batch is padded to
        self.max_blocks = blocks_for(model.config.n_positions, kv_cache.block_size)  # block-table width
        self.num_speculative_tokens = k = num_speculative_tokens  # k: a uniform verification lane's drafts
        most = min(max_num_batched_tokens, max_num_seqs * model.config.n_positions)  # a step's most tokens
        num_tokens = max(most, max_num_seqs * (1 + k))  # or the largest rung's verification
        self.input_batch = InputBatch(
            max_num_seqs, num_tokens, self.max_blocks, kv_cache.block_size, scratch_block, device
        )
        self.token_index = torch.arange(num_tokens, device=device)  # [T]: a verification's logits rows
        self.graph_runner: CUDAGraphRunner | None = None  # decode steps' graphs, set by capture_cudagraphs
        self.verify_graph_runner: CUDAGraphRunner | None = None  # uniform verification steps' graphs
        # a mixed step's padded pass (one graph per token count): the Triton kernel reads its lanes through
        # pointers, so a token count fixes the launch; the torch backend's lanes are host ints
        self.token_sizes = (
            token_sizes(most) if enable_chunked_prefill and attention_backend == "triton" else []
        )
        self.mixed_lanes = max_num_seqs  # a padded mixed step's lanes: every one a sequence may take
        self.mixed_graph_runner: CUDAGraphRunner | None = None
        self.num_uniform_verify_steps = 0  # verification steps padded to a rung (replayed or eager)

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Enqueue one step on the device and return without waiting for it: one forward pass over the
        step's prefills and decodes, sampling, each sampled id scattered into ``last_token`` at its
        sequence's row, the copy of the sampled ids to the host. Verification lanes get logits at every
        position, judged by the rejection sampler; their last emitted id goes into ``last_token`` as well.

        A uniform step (``is_uniform``: decode-only, or every lane a verification of k drafts) is padded
        to its rung and replays that rung's graph, if captured, or runs the same padded pass eagerly; the
        padding lanes' logits are dropped. A mixed step with no verification (prompts or chunks, decodes)
        of at most ``max(token_sizes)`` tokens is padded to a token count and ``mixed_lanes`` lanes, and
        likewise replays or runs eagerly. Any other step runs eagerly over its own lanes. A chunk's lane
        gets no logits (it is never sampled)."""
        chunks = scheduled.chunks
        S, P = len(scheduled.seqs), len(scheduled.prefills) + len(chunks) + len(scheduled.verifies)
        query_len = 1 + self.num_speculative_tokens if scheduled.verifies else 1  # each lane's new tokens
        uniform = is_uniform(scheduled, query_len)
        num_tokens = 0 if uniform or scheduled.verifies else scheduled.num_batched_tokens  # a mixed step's
        mixed = 0 < num_tokens <= max(self.token_sizes, default=0)
        num_lanes = padded_size(self.capture_sizes, S) if uniform else self.mixed_lanes if mixed else S
        N, query_start_loc = self.input_batch.prepare(
            scheduled,
            self.block_manager.block_tables,
            num_lanes,
            query_len if uniform else 1,
            padded_size(self.token_sizes, num_tokens) if mixed else None,
        )  # the step's one host-to-device copy
        graphs = self.verify_graph_runner if scheduled.verifies else self.graph_runner
        if uniform:  # the rung's graph, or what it would replay, eagerly
            plan = StepPlan(VERIFY if scheduled.verifies else DECODE, num_lanes * query_len)
        elif mixed:  # the sampled lanes' logits first (``InputBatch.logits_indices``), then padding rows
            graphs = self.mixed_graph_runner
            plan = StepPlan(MIXED, N)
        else:
            width = max(self.input_batch.num_blocks[self.input_batch.np["rows"][:S]])
            plan = StepPlan(EAGER, 0, N, S, P, width, 0, query_start_loc)
            if scheduled.verifies or chunks:  # the sampled lanes' last tokens, then every verification token
                plan.rows = self.input_batch.logits_indices(scheduled, query_start_loc)  # [S-C-B+sum(1+k)]
        plan.blocks_to_copy = list(scheduled.blocks_to_copy.values())  # done (engine.py): the workers' too
        logits = self.run_plan(plan)  # [S * query_len, V], [mixed_lanes, V] or [S or rows, V]
        if uniform:
            logits = logits[: S * query_len]  # the padding lanes' dropped
        self.num_uniform_verify_steps += bool(uniform and scheduled.verifies)
        # the sampled lanes' logits rows come first, then the verifications' (``InputBatch.logits_indices``)
        seqs = scheduled.prefills + scheduled.decodes
        S, verified = len(seqs), None
        if scheduled.verifies:
            verified = rejection_sample(
                logits[S:],
                [seq.spec_token_ids for seq in scheduled.verifies],
                [seq.params for seq in scheduled.verifies],
                [seq.generator for seq in scheduled.verifies],
                [seq.spec_probs for seq in scheduled.verifies],
            )  # [B, 2]: accepted count, the token after them
            rows = self.input_batch.gpu["rows"][len(scheduled.prefills) + len(chunks) : P]  # [B]
            self.input_batch.last_token.index_copy_(0, rows, verified[:, 1])
        replayed = (uniform or mixed) and graphs is not None
        if not seqs:  # chunks and verifications only: nothing to sample
            nothing = torch.zeros(0, 1, device=self.device)  # [0, 1]
            return AsyncModelRunnerOutput([], nothing, self.tokenizer, scheduled.verifies, verified, replayed)
        packed = sample_on_device(
            logits[:S],
            [seq.params for seq in seqs],
            [seq.generator for seq in seqs],
            [seq.prompt_token_ids for seq in seqs],
            [seq.output_token_ids for seq in seqs],
        )  # [S, 1 or 3 + 2n] float32, on the device
        rows = self.input_batch.gpu["rows"][:S]  # [S] each lane's row
        if scheduled.verifies or chunks:  # the sampled lanes: the prefills', the decodes' (not those between)
            lanes = self.input_batch.gpu["rows"]
            rows = torch.cat([lanes[: len(scheduled.prefills)], lanes[P : P + len(scheduled.decodes)]])  # [S]
        self.input_batch.last_token.index_copy_(0, rows, packed[:, 0].long())  # the next step's input ids
        return AsyncModelRunnerOutput(seqs, packed, self.tokenizer, scheduled.verifies, verified, replayed)

    def run_plan(self, plan: StepPlan) -> torch.Tensor:
        """The forward pass ``plan`` names: a captured graph's replay if there is one, else the same pass
        eagerly (``decode_forward``, ``verify_forward``, ``mixed_forward``), or an eager pass over the
        step's own lanes. Rank 0 of a group broadcasts the plan and the inputs first. Returns the logits."""
        if self.tp.world_size > 1 and self.tp.rank == 0:
            if self.attention_backend == "torch" and plan.kind in (EAGER, VERIFY):  # prefills' host lengths
                lanes = plan.P if plan.kind == EAGER else plan.size // (1 + self.num_speculative_tokens)
                plan.prefill_seq_lens = self.input_batch.np["seq_lens"][:lanes].tolist()
            broadcast_plan(plan, [self.input_batch.buffer.gpu, self.input_batch.last_token])
        if plan.kind == DECODE:
            graphs, forward = self.graph_runner, self.decode_forward
        elif plan.kind == VERIFY:
            q = 1 + self.num_speculative_tokens
            graphs, forward = self.verify_graph_runner, lambda size: self.verify_forward(size // q)
        elif plan.kind == MIXED:
            graphs, forward = self.mixed_graph_runner, self.mixed_forward
        else:
            rows = None
            if len(plan.rows):
                rows = torch.as_tensor(plan.rows).to(self.device, non_blocking=True)  # [R]
            return self.execute_model(plan.N, plan.S, plan.P, plan.query_start_loc, plan.width, rows)
        return graphs.replay(plan.size) if graphs is not None else forward(plan.size)

    def follow(self) -> None:
        """A worker's life (tensor parallelism, rank > 0): run every pass that rank 0 broadcasts, on this
        rank's shard and KV cache, copy-on-write copies first; capture the graphs when rank 0 does; return
        when rank 0 says SHUTDOWN. The logits are dropped: rank 0 samples."""
        inputs = [self.input_batch.buffer.gpu, self.input_batch.last_token]
        while (plan := receive_plan(inputs)).kind != SHUTDOWN:
            if plan.kind == CAPTURE:
                self.capture_cudagraphs()
                continue
            self.kv_cache.copy_blocks(plan.blocks_to_copy)
            self.input_batch.np["seq_lens"][: len(plan.prefill_seq_lens)] = plan.prefill_seq_lens
            self.run_plan(plan)

    def decode_forward(self, num_lanes: int) -> torch.Tensor:
        """The forward pass of a decode-only batch of ``num_lanes`` lanes over the persistent buffers,
        block tables at their full width: the function that ``capture_cudagraphs`` captures. [num_lanes, V]"""
        return self.execute_model(num_lanes, num_lanes, 0, list(range(num_lanes + 1)), self.max_blocks)

    def verify_forward(self, num_lanes: int) -> torch.Tensor:
        """The forward pass of a uniform verification batch: ``num_lanes`` lanes of q = 1 + k tokens each
        (a sequence's last token and its k drafts; a padding lane's q tokens over its own keys) over the
        persistent buffers, every lane a prefill over cached context, block tables at their full width,
        logits at every token (rows from the persistent ``token_index``: no copy from the host). The
        function that ``capture_cudagraphs`` captures for verification. [num_lanes * q, V]"""
        q = 1 + self.num_speculative_tokens
        N = num_lanes * q
        qsl = list(range(0, N + 1, q))  # [num_lanes + 1]
        return self.execute_model(N, num_lanes, num_lanes, qsl, self.max_blocks, self.token_index[:N])

    def mixed_forward(self, num_tokens: int) -> torch.Tensor:
        """The forward pass of a mixed step padded to ``num_tokens`` tokens and ``mixed_lanes`` lanes
        (``InputBatch.write_lanes``), block tables at their full width: the function that
        ``capture_cudagraphs`` captures for mixed steps. Decode ids are gathered from ``last_token`` by the
        row each one's input id names (-1 - row); every lane is a "prefill" to the kernel. The tile is the
        short queries' (``MIXED_QUERY_LEN``), for all lanes. [mixed_lanes, V]: the sampled rows first."""
        ids = self.input_batch.gpu["input_ids"][:num_tokens]  # [num_tokens]
        ids.copy_(torch.where(ids < 0, self.input_batch.last_token[(-1 - ids).clamp(min=0)], ids))
        L, rows = self.mixed_lanes, self.input_batch.gpu["logits_rows"][: self.mixed_lanes]
        qsl = [0] * (L + 1)  # host offsets: unread by the Triton kernel (it reads the device's)
        return self.execute_model(num_tokens, L, L, qsl, self.max_blocks, rows, MIXED_QUERY_LEN)

    def execute_model(
        self,
        N: int,
        S: int,
        P: int,
        query_start_loc: list[int],
        width: int,
        rows: torch.Tensor | None = None,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """The forward pass over the first N tokens and S lanes of the device buffers (P prefills and
        verifications first), each lane's block-table row gathered by the device and cut to ``width``
        blocks. Returns [S, V], or with ``rows`` (token indices [R] on the device) the logits of those
        tokens [R, V]. ``max_query_len`` (the kernel's tile) defaults to the longest lane's."""
        dev = self.input_batch.gpu
        D = S - P  # decode (and padding) lanes: their input ids, sampled on the device, gathered by row
        dev["input_ids"][N - D : N] = self.input_batch.last_token[dev["rows"][P:S]]  # [D]
        starts = dev["query_start_loc"][: S + 1]
        seq_lens = dev["seq_lens"][:S]
        block_tables = self.input_batch.block_table_gpu[dev["rows"][:S], :width]  # [S, width]
        fused = P == 0 and N == S <= self.fused_max_batch  # a decode step (one token a lane), run fused
        meta = AttentionMetadata(
            slot_mapping=dev["slot_mapping"][:N],
            query_start_loc=query_start_loc,
            query_start_loc_t=starts,
            logits_indices=rows
            if rows is not None
            else self.token_index[:S]  # every lane's one token: no kernel in the graph
            if fused
            else starts[1:] - 1,  # each lane's last new token
            num_prefills=P,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=max_query_len or max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            attention_backend=self.attention_backend,
            decode_mask=decode_attention_mask(
                seq_lens[P:], width * self.kv_cache.block_size, self.kv_cache.dtype
            )
            if self.attention_backend == "torch"
            else None,
            prefill_seq_lens=self.input_batch.np["seq_lens"][:P].tolist()
            if self.attention_backend == "torch"
            else None,
            fused=fused,
        )
        return self.model(dev["input_ids"][:N], dev["positions"][:N], self.kv_cache, meta)  # [S, V]

    def capture_cudagraphs(self) -> list[tuple[str, CaptureStats]]:
        """Capture ``decode_forward`` at every batch size of the ladder (CUDA only); from now on decode-only
        steps replay. With speculation and the Triton backend, ``verify_forward`` too, in a second runner
        whose sizes count tokens (rung * (1 + k)); from now on uniform verification steps replay (vLLM
        captures FULL graphs of "uniform decode" batches of query length 1 + k: cudagraph_dispatcher.py).
        With chunked prefill and the Triton backend, ``mixed_forward`` at every count of ``token_sizes``.
        The torch backend's prefill attention reads host lengths, so with it those stay eager.
        Returns each runner's (what it captured, stats): the graphs' sizes, capture time and memory."""
        if self.tp.world_size > 1 and self.tp.rank == 0:  # the workers capture theirs in step
            broadcast_plan(StepPlan(CAPTURE), [])
        B, q = max(self.capture_sizes), 1 + self.num_speculative_tokens
        V, dtype = self.model.config.vocab_size, self.kv_cache.dtype
        self.input_batch.fill_padding(B)  # warm-ups write the scratch slot only
        self.graph_runner = CUDAGraphRunner(self.decode_forward, self.capture_sizes, V, dtype, self.device)
        stats = [("batch sizes", self.graph_runner.capture())]
        if q > 1 and self.attention_backend == "triton":
            self.input_batch.fill_padding(B, q)  # every lane a padding lane of q tokens
            sizes = [b * q for b in self.capture_sizes]  # tokens; the logits buffer is [B * q, V]
            self.verify_graph_runner = CUDAGraphRunner(
                lambda n: self.verify_forward(n // q), sizes, V, dtype, self.device
            )
            stats.append(("verification, tokens", self.verify_graph_runner.capture()))
        if self.token_sizes:
            L = self.mixed_lanes  # every lane of no token, every token in no lane:
            self.input_batch.fill_padding(L, num_tokens=max(self.token_sizes))
            runner = CUDAGraphRunner(self.mixed_forward, self.token_sizes, V, dtype, self.device, L)
            self.mixed_graph_runner = runner
            stats.append(("mixed steps, tokens", runner.capture()))
        return stats

"""The draft-model proposer: a smaller GPT-2 with the target's tokenizer drafts k tokens (vLLM's name).

The same model code as the target (model.py), its own paged KV cache and block tables. Per engine step all
sequences go through the same decode passes, one token a lane, over persistent buffers (on a GPU, CUDA
graphs on the target's ladder of batch sizes): one or two over each lane's last tokens (two after k drafts
were accepted), the last drafting d1, then k - 1 passes, each over the draft before. A sequence the draft
has not seen (its first step, or one after steps without drafts) is brought up to its last token by an eager
prefill first. Greedy requests draft the argmax; sampled ones draw from the draft's warped law q, kept in
``Sequence.spec_probs`` for the rejection sampler. A draft's key counts once its verification accepts it
(``rollback``, from the engine), so that no rejected draft's stays through a pause in drafting.
"""

from __future__ import annotations

import numpy as np
import torch

from .block_manager import blocks_for
from .cuda_graph import CUDAGraphRunner, capture_sizes, padded_size
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata, decode_attention_mask
from .rejection_sampler import warp
from .sampler import exponential_race
from .sampling_params import is_greedy
from .sequence import Sequence

MAX_CATCH_UP = 2  # tokens a step feeds a lane by decode passes; more (a first step) go by an eager prefill


class DraftModelProposer:
    """Drafts with the model in ``folder`` on the target's device, dtype, attention backend and block size,
    in a pool of ``num_blocks`` blocks of its own (and a scratch block), for up to ``max_num_seqs``
    sequences a step (``propose_all``, ``rollback``, ``release``; ``capture_cudagraphs`` on a CUDA device)."""

    def __init__(
        self,
        folder,
        device,
        dtype,
        attention_backend: str,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
    ):
        try:
            self.model = GPT.from_pretrained(str(folder), device=device, dtype=dtype)
        except ValueError as e:  # weights that do not match its config.json, a damaged file
            raise ValueError(f"speculative_config.model (the draft in {folder}): {e}") from None
        self.device, self.attention_backend, self.block_size = device, attention_backend, block_size
        self.kv_cache = PagedKVCache(self.model.config, num_blocks + 1, block_size, device, dtype)
        self.scratch_slot = num_blocks * block_size  # where padding lanes write
        self.free_blocks = list(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}  # tokens of each sequence (no drafts) whose keys it holds
        # tokens whose keys the last proposal wrote (its drafts' included), until its verification (rollback)
        self.num_written: dict[str, int] = {}
        self.capture_sizes = capture_sizes(max_num_seqs)  # the ladder a pass is padded to
        self.max_blocks = blocks_for(self.model.config.n_positions, block_size)  # block-table width
        B = max(self.capture_sizes)
        # the decode passes' persistent inputs, [B] each (block tables [B, max_blocks]); padding: position 0
        self.input_ids = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((B,), self.scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(B, dtype=torch.long, device=device)
        self.tables = torch.full((B, self.max_blocks), num_blocks, dtype=torch.long, device=device)
        self.lanes = torch.arange(B + 1, device=device)  # query offsets and logits rows of a decode pass
        self.graph_runner: CUDAGraphRunner | None = None

    @torch.inference_mode()
    def propose_all(self, seqs: list[Sequence], ks: list[int]) -> None:
        """Set each sequence's ``spec_token_ids`` (k drafts, or none where k < 1 or the pool is full) and
        ``spec_probs`` ([k, V] float32 on the device for a sampled request, else None). Sequences not given
        (finished, preempted, not speculating this step) give their draft blocks back."""
        live = {seq.request_id for seq in seqs}
        for seq_id in [s for s in self.block_tables if s not in live]:
            self.release(seq_id)
        lanes = []
        for seq, k in zip(seqs, ks):
            seq.spec_token_ids, seq.spec_probs = [], None
            table = self.block_tables.setdefault(seq.request_id, [])
            self.num_computed.setdefault(seq.request_id, 0)  # below len(seq): a step feeds its last token
            self.num_written.pop(seq.request_id, None)  # drafts never verified (dropped for want of room)
            need = blocks_for(len(seq) + k - 1, self.block_size) - len(table)
            if k >= 1 and need <= len(self.free_blocks):
                table += [self.free_blocks.pop() for _ in range(max(need, 0))]
                lanes.append((seq, k))
        if not lanes:
            return
        behind = [seq for seq, _ in lanes if len(seq) - self.num_computed[seq.request_id] > MAX_CATCH_UP]
        if behind:
            self.prefill(behind)
        lane_seqs = [seq for seq, _ in lanes]
        ks = np.array([k for _, k in lanes])
        catch_up = max(len(seq) - self.num_computed[seq.request_id] for seq in lane_seqs)  # 1 or 2
        plan, tables = self.plan(lane_seqs, ks, catch_up)
        num_lanes = len(tables)  # the rung the step's lanes are padded to
        width = max(len(self.block_tables[seq.request_id]) for seq in lane_seqs)  # blocks of the longest
        self.tables[:num_lanes].copy_(tables)  # the step's copies from the host: its tables and its plan
        plan = plan.to(self.device)  # [4, P, num_lanes]: positions, slots, seq_lens, catch-up input ids
        params = [seq.params for seq in lane_seqs]
        sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
        drafts, probs = [], [[] for _ in lanes]  # the pass's ids [S] per draft; q rows [V] per lane
        ids = None
        for p in range(plan.shape[1]):
            self.positions[:num_lanes].copy_(plan[0, p])
            self.slot_mapping[:num_lanes].copy_(plan[1, p])
            self.seq_lens[:num_lanes].copy_(plan[2, p])
            if p < catch_up:
                self.input_ids[:num_lanes].copy_(plan[3, p])
            else:  # each lane's draft of the pass before
                self.input_ids[: len(lanes)].copy_(ids)
            logits = self.run(num_lanes, width)[: len(lanes)]  # [S, V]
            j = p - catch_up + 2  # the draft this pass makes, 1..k (< 1: a catch-up pass before the last)
            if j < 1:
                continue
            warped = warp(logits, params)  # [S, V]
            ids = warped.argmax(dim=-1)  # [S] the greedy lanes' drafts
            now = [r for r in sampled if j <= ks[r]]
            if now:
                ids[now] = exponential_race(warped, now, [lane_seqs[r].generator for r in now])
                q = warped[now].softmax(dim=-1)  # [R, V] the law each sampled draft came from
                for n, r in enumerate(now):
                    probs[r].append(q[n])
            drafts.append(ids)
        host = torch.stack(drafts, dim=1).tolist()  # [S, max k]: the proposer's one wait
        for (seq, k), row, lane_probs in zip(lanes, host, probs):
            seq.spec_token_ids = row[:k]
            seq.spec_probs = torch.stack(lane_probs) if lane_probs else None  # [k, V]
            self.num_computed[seq.request_id] = len(seq)  # its own tokens; its drafts' keys wait for rollback
            self.num_written[seq.request_id] = len(seq) + k - 1  # d_k itself is never fed

    def plan(self, seqs: list[Sequence], ks: np.ndarray, catch_up: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's decode passes, lane by lane: ``catch_up`` passes over each lane's last tokens (the
        most any lane has not seen; a key the draft holds is computed again, the same), the last of them
        drafting d1, then max(ks) - 1 passes over drafts 1 .. k - 1. Returns the plan [4, P, num_lanes]
        int64 (position, slot, length after the pass, catch-up input id; a lane idle in a pass, past its k,
        and a padding lane feed position 0 into the scratch slot) and the block tables [num_lanes,
        max_blocks] (padding: the scratch block)."""
        S, bs, C = len(seqs), self.block_size, catch_up
        num_lanes, P = padded_size(self.capture_sizes, S), C + int(ks.max()) - 1
        tables = np.full((num_lanes, self.max_blocks), self.scratch_slot // bs, dtype=np.int64)
        for i, seq in enumerate(seqs):
            t = self.block_tables[seq.request_id]
            tables[i, : len(t)] = t
        lengths = np.array([len(seq) for seq in seqs])  # [S]
        offsets = np.arange(P)[:, None]  # [P, 1]
        positions = lengths - C + offsets  # [P, S] catch-up: L - C .. L - 1, then drafts: L .. L + k - 2
        active = offsets <= C + ks - 2  # [P, S] lanes past their k idle
        plan = np.zeros((4, P, num_lanes), dtype=np.int64)
        plan[0, :, :S] = np.where(active, positions, 0)
        rows = np.broadcast_to(np.arange(S), (P, S))
        blocks = tables[rows, plan[0, :, :S] // bs]
        plan[1] = self.scratch_slot
        plan[1, :, :S] = np.where(active, blocks * bs + plan[0, :, :S] % bs, self.scratch_slot)
        plan[2] = 1
        plan[2, :, :S] = plan[0, :, :S] + 1
        for c in range(C):  # the catch-up passes' input ids, known on the host
            plan[3, c, :S] = [seq.token_ids[x] for seq, x in zip(seqs, plan[0, c, :S])]
        return torch.from_numpy(plan), torch.from_numpy(tables)

    def run(self, num_lanes: int, width: int) -> torch.Tensor:
        """One decode pass over the first ``num_lanes`` lanes of the buffers (a rung): its CUDA graph's
        replay, or the same pass eagerly, its block tables cut to ``width`` blocks (the step's longest).
        Logits [num_lanes, V]."""
        if self.graph_runner is not None:
            return self.graph_runner.replay(num_lanes)
        return self.decode_forward(num_lanes, width)

    def decode_forward(self, num_lanes: int, width: int | None = None) -> torch.Tensor:
        """The draft's forward pass of one token a lane over the persistent buffers, block tables cut to
        ``width`` blocks (None: their full width, the function ``capture_cudagraphs`` captures).
        [num_lanes, V]"""
        width = width or self.max_blocks
        seq_lens, tables = self.seq_lens[:num_lanes], self.tables[:num_lanes, :width]
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_lanes],
            query_start_loc=list(range(num_lanes + 1)),
            query_start_loc_t=self.lanes[: num_lanes + 1],
            logits_indices=self.lanes[:num_lanes],
            num_prefills=0,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=1,
            attention_backend=self.attention_backend,
            decode_mask=decode_attention_mask(seq_lens, width * self.block_size, self.kv_cache.dtype)
            if self.attention_backend == "torch"
            else None,
        )
        return self.model(self.input_ids[:num_lanes], self.positions[:num_lanes], self.kv_cache, meta)

    def prefill(self, seqs: list[Sequence]) -> None:
        """One eager pass over each sequence's tokens from what the draft holds to the one before its last
        (every lane a prefill over cached context, step 9's path), so that a decode pass feeds its last."""
        bs, qsl, ids, pos, lens = self.block_size, [0], [], [], []
        for seq in seqs:
            start, end = self.num_computed[seq.request_id], len(seq) - 1
            pos += range(start, end)
            ids += seq.token_ids[start:end]
            qsl.append(len(pos))
            lens.append(end)
            self.num_computed[seq.request_id] = end
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long)  # [N]
        width = max(len(self.block_tables[s.request_id]) for s in seqs)
        tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in (self.block_tables[s.request_id] for s in seqs)]
        )
        lane = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(qsl).diff())  # [N] each token's
        slots = tables[lane, positions // bs] * bs + positions % bs  # [N]
        starts = torch.tensor(qsl, dtype=torch.long).to(dev)
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=qsl,
            query_start_loc_t=starts,
            logits_indices=starts[1:] - 1,
            num_prefills=len(seqs),
            seq_lens=torch.tensor(lens, dtype=torch.long).to(dev),
            block_tables=tables.to(dev),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            attention_backend=self.attention_backend,
            decode_mask=None,
            prefill_seq_lens=lens if self.attention_backend == "torch" else None,
        )
        self.model(torch.tensor(ids, dtype=torch.long).to(dev), positions.to(dev), self.kv_cache, meta)

    def capture_cudagraphs(self):
        """Capture ``decode_forward`` at every rung (CUDA only): from now on every pass replays. Returns
        the ``CaptureStats``."""
        self.graph_runner = CUDAGraphRunner(
            self.decode_forward,
            self.capture_sizes,
            self.model.config.vocab_size,
            self.kv_cache.dtype,
            self.device,
        )
        return self.graph_runner.capture()

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """A verification's outcome is known: the draft keeps keys for the sequence's first ``num_tokens``
        tokens at most, its tokens before the drafts and the accepted drafts (the token the target chose
        after them is fed at the next proposal); the rejected drafts' keys are no longer counted. The
        engine calls it for every verified sequence, so that one that stops drafting for a while (the batch
        at ``disable_by_batch_size``) never takes a rejected draft's key for its own token's. vLLM does the
        same in its scheduler (``update_from_output``: the computed tokens less the rejected drafts).
        Unknown ids are ignored."""
        if seq_id in self.num_computed:
            written = self.num_written.pop(seq_id, self.num_computed[seq_id])
            self.num_computed[seq_id] = min(written, num_tokens)

    def release(self, seq_id: str) -> None:
        """A sequence has finished: its draft blocks go back."""
        if seq_id in self.block_tables:
            self.free_blocks += self.block_tables.pop(seq_id)
            del self.num_computed[seq_id]
            self.num_written.pop(seq_id, None)

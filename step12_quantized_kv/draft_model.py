"""The draft-model proposer: a smaller GPT-2 with the target's tokenizer drafts k tokens (vLLM's name).

The same model code as the target (model.py), its own paged KV cache and block tables. Per engine step
and sequence: one pass over the tokens the draft has not seen yet (its first time: the whole sequence;
then the accepted tokens since), which drafts d1, then k - 1 one-token passes, each over the draft before.
All sequences go together, each pass one flat batch, every lane a prefill over cached context (step 9's
path, through the Triton kernel on a GPU). Greedy requests draft the argmax; sampled ones draw from the
draft's warped law q (the sampler's stages), kept in ``Sequence.spec_probs`` for the rejection sampler.
Before each step the draft's length rolls back to the sequence's accepted tokens.
"""

from __future__ import annotations

import torch

from .block_manager import blocks_for
from .kv_cache import PagedKVCache
from .model import GPT, AttentionMetadata
from .rejection_sampler import warp
from .sampler import exponential_race
from .sampling_params import is_greedy
from .sequence import Sequence


class DraftModelProposer:
    """Drafts with the model in ``folder`` on the target's device, dtype, attention backend and block size,
    in a pool of ``num_blocks`` blocks of its own (``propose_all``, ``release``)."""

    def __init__(self, folder, device, dtype, attention_backend: str, block_size: int, num_blocks: int):
        self.model = GPT.from_pretrained(str(folder), device=device, dtype=dtype)
        self.device, self.attention_backend, self.block_size = device, attention_backend, block_size
        self.kv_cache = PagedKVCache(self.model.config, num_blocks, block_size, device, dtype)
        self.free_blocks = list(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}  # tokens of each sequence whose keys the draft holds

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
            # its keys past the accepted tokens are stale: rejected drafts, or drafts never verified (dropped
            # for want of room, or preempted); the pass starts at its last token, or earlier
            self.num_computed[seq.request_id] = min(self.num_computed.get(seq.request_id, 0), len(seq) - 1)
            need = blocks_for(len(seq) + k - 1, self.block_size) - len(table)
            if k >= 1 and need <= len(self.free_blocks):
                table += [self.free_blocks.pop() for _ in range(max(need, 0))]
                lanes.append((seq, k))
        if not lanes:
            return
        drafts: list[list[torch.Tensor]] = [[] for _ in lanes]  # per lane, k ids [1] on the device
        probs: list[list[torch.Tensor]] = [[] for _ in lanes]
        for j in range(max(k for _, k in lanes)):
            now = [i for i, (_, k) in enumerate(lanes) if j < k]
            logits = self.forward([lanes[i][0] for i in now], j, [drafts[i][-1] if j else None for i in now])
            params = [lanes[i][0].params for i in now]
            warped = warp(logits, params)  # [S, V]
            ids = warped.argmax(dim=-1)  # [S] greedy lanes' drafts
            sampled = [r for r, p in enumerate(params) if not is_greedy(p)]
            if sampled:
                gens = [lanes[now[r]][0].generator for r in sampled]
                ids[sampled] = exponential_race(warped, sampled, gens)
                q = warped[sampled].softmax(dim=-1)  # [R, V] the law each sampled draft came from
                for n, r in enumerate(sampled):
                    probs[now[r]].append(q[n])
            for r, i in enumerate(now):
                drafts[i].append(ids[r : r + 1])
        host = torch.cat([t for lane in drafts for t in lane]).tolist()  # the proposer's one wait
        at = 0
        for (seq, k), lane_probs in zip(lanes, probs):
            seq.spec_token_ids, at = host[at : at + k], at + k
            seq.spec_probs = torch.stack(lane_probs) if lane_probs else None  # [k, V]
            self.num_computed[seq.request_id] = len(seq) + k - 1  # d_k itself is never fed

    def forward(self, seqs: list[Sequence], j: int, last: list[torch.Tensor | None]) -> torch.Tensor:
        """Pass j over the sequences: j = 0, each one's tokens from what the draft holds to its last; j > 0,
        its draft j (``last``, on the device) at position len + j - 1. Returns the logits [S, V] of each
        lane's last token."""
        bs, qsl, ids, pos, lens = self.block_size, [0], [], [], []
        for seq in seqs:
            start = self.num_computed[seq.request_id] if j == 0 else len(seq) + j - 1
            end = len(seq) + j  # the lane's length after this pass
            pos += range(start, end)
            if j == 0:
                ids += seq.token_ids[start:end]
            qsl.append(len(pos))
            lens.append(end)
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long)  # [N]
        width = max(len(self.block_tables[s.request_id]) for s in seqs)
        tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in (self.block_tables[s.request_id] for s in seqs)]
        )
        lane = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(qsl).diff())  # [N] each token's
        slots = tables[lane, positions // bs] * bs + positions % bs  # [N]
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev) if j == 0 else torch.cat(last)  # [N]
        starts = torch.tensor(qsl, dtype=torch.long).to(dev)
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=qsl,
            query_start_loc_t=starts,
            logits_indices=starts[1:] - 1,
            num_prefills=len(seqs),  # every lane a prefill over cached context
            seq_lens=torch.tensor(lens, dtype=torch.long).to(dev),
            block_tables=tables.to(dev),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            attention_backend=self.attention_backend,
            decode_mask=None,
            prefill_seq_lens=lens if self.attention_backend == "torch" else None,
        )
        return self.model(input_ids, positions.to(dev), self.kv_cache, meta)  # [S, V]

    def release(self, seq_id: str) -> None:
        """A sequence has finished: its draft blocks go back."""
        if seq_id in self.block_tables:
            self.free_blocks += self.block_tables.pop(seq_id)
            del self.num_computed[seq_id]

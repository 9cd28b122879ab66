"""The scheduler: which requests run in the next forward pass.

Continuous batching (Yu et al. 2022, "Orca", OSDI): at every step each running request decodes one token,
finished requests leave at once, and waiting requests join while there is room: ``max_num_seqs`` running
requests, ``max_num_batched_tokens`` tokens in one forward pass, and free KV-cache blocks (vLLM's names).
When a running request needs a block and none is free, the most recently admitted one is *preempted*: its
blocks go back and it returns to the front of the waiting queue with the tokens it generated, prefilled
again when it is readmitted (preemption by recompute, as in vLLM), so it carries on where it stopped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step's work. prefills: sequences whose tokens all go through the model (new, or readmitted
    after preemption); decodes: running sequences that feed their newest token; preempted: sequences
    sent back to the waiting queue in this step."""

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        """Every scheduled sequence, prefills first: the row order of the step's batch and its logits."""
        return self.prefills + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(seq) for seq in self.prefills) + len(self.decodes)


@dataclass
class SchedulerStats:
    """The scheduler after a step (vLLM's names): requests running and waiting, the share of KV-cache
    blocks in use (0..1) and their counts, preemptions since the start, tokens in the last forward pass."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_batched_tokens: int


class Scheduler:
    """First-come-first-served continuous batching with preemption by recompute.

    waiting: requests not holding any block, oldest first (preempted ones go back to the front).
    running: requests holding blocks, in admission order (the last one is preempted first).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_batched_tokens = 0  # in the last step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and reserve the cache blocks they will write."""
        out = SchedulerOutput()
        blocks = self.block_manager
        # 1. Every running sequence decodes one token, oldest first; its token may need a new block.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if len(seq) >= seq.max_len:  # its last token is in flight (async scheduling): no position left
                i += 1
            elif blocks.append(seq.request_id, len(seq)):
                out.decodes.append(seq)
                i += 1
            else:  # no block free: the newest running sequence steps back (seq itself, if it is the newest)
                out.preempted.append(self._preempt(self.running.pop()))
        # 2. Admit waiting requests in arrival order while all three limits allow; no overtaking. Not when
        # memory is short (someone was preempted): admitting anyone now would only preempt again.
        budget = self.max_num_batched_tokens - len(out.decodes)
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(seq) > budget or not blocks.can_allocate(len(seq)):
                break
            self.waiting.popleft()
            blocks.allocate(seq.request_id, len(seq))
            self.running.append(seq)
            out.prefills.append(seq)
            budget -= len(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
        self.num_batched_tokens = out.num_batched_tokens
        return out

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: it leaves the batch and its blocks are free at once. With async scheduling
        it may have been preempted while its last token was in flight: then it leaves the waiting queue,
        holding no blocks."""
        if seq.request_id not in self.block_manager.block_tables:  # preempted: waiting, no blocks
            self.waiting.remove(seq)
            return
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)

    def abort(self, seq: Sequence) -> None:
        """Remove a request, waiting or running, freeing its blocks at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.finish(seq)
        elif seq.request_id in self.block_manager.block_tables:  # an interrupt (Ctrl-C) inside schedule()
            self.block_manager.free(seq.request_id)

    def make_stats(self) -> SchedulerStats:
        blocks = self.block_manager
        used = blocks.num_blocks - blocks.num_free_blocks
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=used / blocks.num_blocks,
            num_used_blocks=used,
            num_blocks=blocks.num_blocks,
            num_preemptions=self.num_preemptions,
            num_batched_tokens=self.num_batched_tokens,
        )

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free(seq.request_id)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

"""The scheduler: which requests run in the next forward pass.

Continuous batching (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based
Generative Models", OSDI) schedules at the granularity of one token, not one batch: at every step each
running request decodes one token, finished requests leave at once, and waiting requests join as soon
as there is room, so nobody waits for the slowest member of a batch. Room means three limits:
``max_num_seqs`` running requests, ``max_num_batched_tokens`` tokens in one forward pass, and free
KV-cache blocks (vLLM's names).

When a running request needs a new block and none is free, the most recently admitted request is
*preempted*: it gives all its blocks back and returns to the front of the waiting queue, keeping the
tokens it has generated. When it is admitted again, its prompt and those tokens are prefilled again
(preemption by recompute, as in vLLM), and it carries on exactly where it stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .block_manager import BlockManager

if TYPE_CHECKING:
    from .engine import Sequence


@dataclass
class SchedulerOutput:
    """One step's work. prefills: sequences whose tokens all go through the model (new, or readmitted
    after preemption); decodes: running sequences that feed their newest token; preempted: sequences
    sent back to the waiting queue in this step."""

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(seq) for seq in self.prefills) + len(self.decodes)


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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and reserve the cache blocks they will write."""
        out = SchedulerOutput()
        blocks = self.block_manager
        # 1. Every running sequence decodes one token, oldest first; its token may need a new block.
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            while not blocks.can_append(seq.request_id, len(seq)) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if blocks.can_append(seq.request_id, len(seq)):
                blocks.append(seq.request_id, len(seq))
                out.decodes.append(seq)
            else:  # seq is the newest running sequence: it steps back itself
                out.preempted.append(self._preempt(self.running.pop()))
        if out.preempted:  # memory is short: admitting anyone now would only preempt again
            return out
        # 2. Admit waiting requests in arrival order while all three limits allow; no overtaking.
        budget = self.max_num_batched_tokens - len(out.decodes)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(seq) > budget or not blocks.can_allocate(len(seq)):
                break
            self.waiting.popleft()
            blocks.allocate(seq.request_id, len(seq))
            self.running.append(seq)
            out.prefills.append(seq)
            budget -= len(seq)
        return out

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: it leaves the batch and its blocks are free at once."""
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is, freeing its blocks; returns it, or None if unknown."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free(seq.request_id)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

"""The scheduler: which requests run in the next forward pass.

Continuous batching (Yu et al. 2022, "Orca", OSDI): at every step each running request decodes one token,
finished requests leave at once, and waiting requests join while there is room: ``max_num_seqs`` running
requests, ``max_num_batched_tokens`` tokens in one forward pass, and free KV-cache blocks (vLLM's names).
When a running request needs a block and none is free, the most recently admitted one is *preempted*: its
blocks go back and it returns to the front of the waiting queue with the tokens it generated, prefilled
again when it is readmitted (preemption by recompute, as in vLLM), so it carries on where it stopped.
Prefix caching: a request is admitted with the leading full blocks of its tokens found cached and prefills
the rest; a request of n choices is admitted with room for all n and prefilled once (block_manager.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .messages import SchedulerStats
from .sequence import Sequence
from .spec_decode import SpecDecodingStats


@dataclass
class SchedulerOutput:
    """One step's work. prefills: sequences whose uncached tokens go through the model (new, or readmitted
    after preemption); verifies: running sequences that feed their newest token and their drafts
    (``spec_token_ids``); decodes: running sequences that feed their newest token; preempted: sequences
    sent back to the waiting queue in this step. blocks_to_copy: sequence id -> (source, destination)
    block, the copies-on-write to make before this step writes."""

    prefills: list[Sequence] = field(default_factory=list)
    verifies: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def seqs(self) -> list[Sequence]:
        """Every scheduled sequence, prefills, verifications, decodes: the lane order of the step's batch."""
        return self.prefills + self.verifies + self.decodes

    @property
    def num_batched_tokens(self) -> int:
        chunks = self.prefills + self.verifies  # the tokens from num_computed_tokens on, drafts included
        return sum(len(seq) + len(seq.spec_token_ids) - seq.num_computed_tokens for seq in chunks) + len(
            self.decodes
        )


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
        self.prefilled: list[Sequence] = []  # the last step's prefills
        self.spec = SpecDecodingStats()  # the verifications' counters (the engine records them)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, drafted: bool = False) -> SchedulerOutput:
        """Pick this step's sequences and reserve the cache blocks they will write. drafted: whether the
        running sequences hold drafts (``spec_token_ids``) to verify in this step."""
        out = SchedulerOutput()
        blocks = self.block_manager
        for seq in self.prefilled:  # the last step (launched) writes their full blocks: they join the cache
            if not seq.finished:
                blocks.cache_blocks(seq, len(seq) - 1)
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
        # 2. Drafts take what is left once every running sequence has room for its token: the token budget
        # and the free blocks, oldest first; a sequence they do not fit decodes without them.
        if drafted:
            self._verify_drafts(out)
        out.blocks_to_copy, blocks.blocks_to_copy = blocks.blocks_to_copy, {}
        # 3. Admit waiting requests in arrival order while all three limits allow; no overtaking. Not when
        # memory is short (someone was preempted): admitting anyone now would only preempt again.
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        # A request's cached leading blocks cost no tokens; its n choices need n places in the batch.
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = blocks.find_cached_blocks(seq)
            new_tokens = len(seq) - len(cached) * blocks.block_size
            if (
                new_tokens > budget
                or len(self.running) + 1 + len(seq.forks) > self.max_num_seqs
                or not blocks.can_allocate(seq, cached)
            ):
                break
            self.waiting.popleft()
            for choice in blocks.allocate(seq, cached):  # seq, then its other choices (forked off its blocks)
                self.running.append(choice)
                out.prefills.append(choice)
                if choice.metrics.first_scheduled_time is None:
                    choice.metrics.first_scheduled_time = time.perf_counter()
            budget -= new_tokens
        self.num_batched_tokens = out.num_batched_tokens
        self.prefilled = out.prefills
        return out

    def finish(self, seq: Sequence) -> None:
        """A sequence is done: it leaves the batch, the full blocks it computed join the cache, and its
        blocks are free at once. With async scheduling it may have been preempted while its last token was
        in flight: then it leaves the waiting queue, holding no blocks."""
        if seq.request_id not in self.block_manager.block_tables:  # preempted: waiting, no blocks
            self.waiting.remove(seq)
            return
        self.running.remove(seq)
        self.block_manager.cache_blocks(seq, len(seq) - 1)  # every token but its last is written
        self.block_manager.free(seq.request_id)

    def abort(self, seq: Sequence) -> None:
        """Remove a request, waiting or running, freeing its blocks at once (registering none: an abort
        may interrupt a step whose keys and values were never written); a choice of n not forked yet is
        never forked (``_unfork``)."""
        self._unfork(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
        elif seq.request_id in self.block_manager.block_tables:  # an interrupt (Ctrl-C) inside schedule()
            self.block_manager.free(seq.request_id)

    def _unfork(self, seq: Sequence) -> None:
        """An aborted choice of n > 1 that is not forked yet must never be: one carried by another choice
        (``forks``) leaves it; one that carries others (choice 0, waiting) hands them its place in the queue,
        the first of them carrying the rest."""
        if seq.forks:
            heir, *rest = seq.forks
            seq.forks, heir.forks = [], rest
            self.waiting[self.waiting.index(seq)] = heir
        elif seq.parent is not None:
            for choice in seq.parent.choices:
                if seq in choice.forks:
                    choice.forks.remove(seq)

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
            prefix_cache_queries=blocks.num_queried_tokens,
            prefix_cache_hits=blocks.num_hit_tokens,
            num_cached_blocks=len(blocks.cached_blocks),
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec.num_accepted_tokens_per_pos),
            num_eager_verify_steps=self.spec.num_eager_verify_steps,
        )

    def _verify_drafts(self, out: SchedulerOutput) -> None:
        """Move the decodes whose drafts fit (in the token budget, and in blocks of their own) to
        ``out.verifies``; the others drop their drafts."""
        spare, decodes = self.max_num_batched_tokens - len(out.decodes), out.decodes
        out.decodes = []
        for seq in decodes:
            k = len(seq.spec_token_ids)
            if k and k <= spare and self.block_manager.extend(seq.request_id, len(seq) + k):
                seq.num_computed_tokens = len(seq) - 1  # its last token and its drafts go through the model
                out.verifies.append(seq)
                spare -= k
            else:
                seq.spec_token_ids, seq.spec_probs = [], None  # no room for its drafts: a plain decode
                out.decodes.append(seq)

    def _preempt(self, seq: Sequence) -> Sequence:
        seq.spec_token_ids, seq.spec_probs = [], None
        self.block_manager.cache_blocks(seq, len(seq) - 1)  # its full blocks stay cached for its return
        self.block_manager.free(seq.request_id)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

"""The scheduler: which requests run in the next forward pass, under one token budget per step.

Continuous batching (Yu et al. 2022, "Orca", OSDI) with chunked prefill (Agrawal et al. 2024,
"Sarathi-Serve", OSDI; vLLM v1's scheduler): each step's ``max_num_batched_tokens`` go to the running requests
first (a token each, and drafts), then to prompts part-way, then to the waiting queue in arrival order, a
chunk each of at most ``long_prefill_token_threshold`` tokens. A request holds its prompt's blocks from its
admission, and joins the running batch (is sampled) in the step that computes its last prompt token; a chunk
before that says nothing. With no block free, the newest prompt part-way, else the newest running request,
is *preempted*: its blocks go back, it is recomputed when readmitted (vLLM's preemption by recompute). Prefix
caching: a request starts past its leading full blocks found cached; n choices fork off its blocks.
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
    """One step's work. prefills: sequences whose uncached tokens up to their last go through the model
    (new, readmitted after preemption, or the last chunk of a prompt), sampled; chunks: sequences part-way
    through their prompt, each computing its tokens from ``num_computed_tokens`` to the end given here (a
    chunk short of its last token: never sampled); verifies: running sequences that feed their newest token
    and their drafts (``spec_token_ids``); decodes: running sequences that feed their newest token;
    preempted: sequences sent back to the waiting queue in this step. blocks_to_copy: sequence id ->
    (source, destination) block, the copies-on-write to make before this step writes."""

    prefills: list[Sequence] = field(default_factory=list)
    chunks: dict[Sequence, int] = field(default_factory=dict)
    verifies: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def seqs(self) -> list[Sequence]:
        """Every scheduled sequence, prefills, chunks, verifications, decodes: the lane order of the step's
        batch."""
        return self.prefills + list(self.chunks) + self.verifies + self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        """The prompt tokens the step computes: the prefills' from ``num_computed_tokens`` on, the chunks'."""
        return sum(len(seq) - seq.num_computed_tokens for seq in self.prefills) + sum(
            end - seq.num_computed_tokens for seq, end in self.chunks.items()
        )

    @property
    def num_batched_tokens(self) -> int:
        verifies = sum(len(seq) + len(seq.spec_token_ids) - seq.num_computed_tokens for seq in self.verifies)
        return self.num_prefill_tokens + verifies + len(self.decodes)  # drafts included


class Scheduler:
    """First-come-first-served continuous batching with preemption by recompute.

    waiting: requests not holding any block, oldest first (preempted ones go back to the front).
    prefilling: requests holding blocks, part-way through their prompt, in admission order (preempted
    before any running one, the last first). running: requests past their prompt, in the order they got
    there (the last one is preempted first). long_prefill_token_threshold: the most prompt tokens a request
    computes in one step (None: the budget only). enable_chunked_prefill False: a prompt is computed whole
    in the step that admits it, if the budget has room for it (step 12).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else None
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_batched_tokens = 0  # in the last step
        self.num_prefill_tokens = 0  # in the last step, prompt tokens (the rest: decodes and verifications)
        self.num_steps = self.num_eager_steps = 0  # steps launched, of them not replaying a CUDA graph
        self.prefilled: list[Sequence] = []  # the last step's prefills
        self.chunked: dict[Sequence, int] = {}  # the last step's chunks, and where each ends
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
        for seq, end in self.chunked.items():  # and the chunks' tokens: computed up to their end
            if not seq.finished:
                seq.num_computed_tokens = end
                blocks.cache_blocks(seq, end)
        # 1. Every running sequence decodes one token, oldest first; its token may need a new block.
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if len(seq) >= seq.max_len:  # its last token is in flight (async scheduling): no position left
                i += 1
            elif blocks.append(seq.request_id, len(seq)):
                out.decodes.append(seq)
                i += 1
            else:  # no block free: the newest prompt part-way steps back (its computed chunks cached), else
                # the newest running sequence (seq itself, if it is the newest)
                part_way = bool(self.prefilling)
                victim = self.prefilling.pop() if part_way else self.running.pop()
                computed = victim.num_computed_tokens if part_way else len(victim) - 1
                out.preempted.append(self._preempt(victim, computed))
        # 2. Drafts take what is left once every running sequence has room for its token: the token budget
        # and the free blocks, oldest first; a sequence they do not fit decodes without them.
        if drafted:
            self._verify_drafts(out)
        out.blocks_to_copy, blocks.blocks_to_copy = blocks.blocks_to_copy, {}
        # 3. The prompts part-way, oldest first: a chunk each, while the budget lasts.
        budget = self.max_num_batched_tokens - out.num_batched_tokens
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            budget -= self._schedule_chunk(seq, budget, out)
        # 4. Admit waiting requests in arrival order while all three limits allow; no overtaking. Not when
        # memory is short (someone was preempted): admitting anyone now would only preempt again.
        # A request's cached leading blocks cost no tokens; its n choices need n places in the batch.
        seats = len(self.running) + sum(1 + len(seq.forks) for seq in self.prefilling)
        while self.waiting and not out.preempted and seats < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            cached = blocks.find_cached_blocks(seq)
            new_tokens = len(seq) - len(cached) * blocks.block_size
            if (
                (new_tokens > budget and not self.enable_chunked_prefill)
                or seats + 1 + len(seq.forks) > self.max_num_seqs
                or not blocks.can_allocate(seq, cached)
            ):
                break
            self.waiting.popleft()
            blocks.allocate(seq, cached)  # every block of its tokens; its choices fork after its last chunk
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
            self.prefilling.append(seq)
            seats += 1 + len(seq.forks)
            budget -= self._schedule_chunk(seq, budget, out)
        self.num_batched_tokens = out.num_batched_tokens
        self.num_prefill_tokens = out.num_prefill_tokens
        self.prefilled, self.chunked = out.prefills, out.chunks
        return out

    def _schedule_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Schedule the next chunk of a prompt part-way (``prefilling``): what is left of it, cut at the
        threshold and at ``budget``. A chunk that reaches its last token makes it a prefill: it joins the
        running batch, its other choices forked off its blocks after it. Returns the chunk's tokens."""
        left = len(seq) - seq.num_computed_tokens
        n = min(left, budget, self.long_prefill_token_threshold or left)
        if n < left:
            out.chunks[seq] = seq.num_computed_tokens + n
            return n
        self.prefilling.remove(seq)
        forks, seq.forks = seq.forks, []
        for fork in forks:
            self.block_manager.fork(seq, fork)
        for choice in [seq, *forks]:
            self.running.append(choice)
            out.prefills.append(choice)
            if choice.metrics.first_scheduled_time is None:
                choice.metrics.first_scheduled_time = time.perf_counter()
        return n

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
        """Remove a request, waiting, part-way through its prompt or running, freeing its blocks at once
        (registering none: an abort may interrupt a step whose keys and values were never written); a
        choice of n not forked yet is never forked (``_unfork``)."""
        self._unfork(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilling:
            self.prefilling.remove(seq)
            self.block_manager.free(seq.request_id)
        elif seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.request_id)
        elif seq.request_id in self.block_manager.block_tables:  # an interrupt (Ctrl-C) inside schedule()
            self.block_manager.free(seq.request_id)

    def _unfork(self, seq: Sequence) -> None:
        """An aborted choice of n > 1 that is not forked yet must never be: one carried by another choice
        (``forks``) leaves it; one that carries others (choice 0, waiting or part-way) hands them its place,
        its blocks and its computed tokens, the first of them carrying the rest."""
        if seq.forks:
            heir, *rest = seq.forks
            seq.forks, heir.forks = [], rest
            heir.num_computed_tokens, heir.block_hashes = seq.num_computed_tokens, seq.block_hashes
            for queue in (self.waiting, self.prefilling):
                if seq in queue:
                    queue[queue.index(seq)] = heir
            self.block_manager.hand_over(seq.request_id, heir.request_id)
            if seq in self.chunked:
                self.chunked[heir] = self.chunked.pop(seq)
        elif seq.parent is not None:
            for choice in seq.parent.choices:
                if seq in choice.forks:
                    choice.forks.remove(seq)

    def make_stats(self) -> SchedulerStats:
        blocks = self.block_manager
        used = blocks.num_blocks - blocks.num_free_blocks
        return SchedulerStats(
            num_running_reqs=len(self.running) + len(self.prefilling),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=used / blocks.num_blocks,
            num_used_blocks=used,
            num_blocks=blocks.num_blocks,
            num_preemptions=self.num_preemptions,
            num_batched_tokens=self.num_batched_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_steps=self.num_steps,
            num_eager_steps=self.num_eager_steps,
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

    def _preempt(self, seq: Sequence, computed: int) -> Sequence:
        """Send a sequence back to the waiting queue; the full blocks of its first ``computed`` tokens stay
        cached for its return."""
        seq.spec_token_ids, seq.spec_probs = [], None
        self.block_manager.cache_blocks(seq, computed)
        self.block_manager.free(seq.request_id)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

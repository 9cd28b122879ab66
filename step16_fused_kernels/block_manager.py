"""The block manager: which KV-cache blocks are free, and which blocks each sequence owns.

The bookkeeping half of PagedAttention (Kwon et al. 2023, SOSP; the name is vLLM's): a free list and a
block table per sequence; ``block_size`` is decided here, once. A sequence gets blocks on demand, one
whenever its next token starts a new block, and gives them all back when it finishes, is aborted or
is preempted. Nothing here touches tensors; the pool itself is ``PagedKVCache``.
Shared blocks (vLLM's prefix caching): a written full block is registered under a hash chained over its
prefix and stays cached when freed, until evicted; a new sequence takes its prompt's cached leading blocks.
A block is hashed when a lookup first reaches it, so a request that shares nothing hashes one block only.
The n choices of a prompt share its blocks by fork; the first to write into the shared last block copies it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: Python's hash of its parent's (None for a first block) and its
    token ids. Not collision-resistant, nor need it be: it only finds a candidate, which a hit confirms
    on the block's tokens and parent (``_registered``), so a collision costs a hit, never a wrong one."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    """One block of the pool. ref_count: the sequences holding it (0: in the free queue). Set while the
    block is registered in the cache: block_hash, token_ids, registration (a number no other registration
    has), parent (the registration of the block before it in its chain; 0 for a prompt's first block).
    taken: when ``_pop_free`` last handed it out to be written (``BlockManager.num_taken`` then)."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    registration: int = 0
    parent: int = 0
    taken: int = 0


class Unhashed(NamedTuple):
    """Written full blocks of a sequence that wait to be hashed (a run): its blocks ``first``, ``first`` + 1,
    ... (``block_ids``), its ``token_ids`` up to their end, its ``block_hashes`` (where their hashes go),
    ``filed``: ``num_taken`` when the run was filed. A block handed out again since ends the run."""

    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    block_hashes: list[int]
    first: int
    filed: int


class BlockManager:
    """Allocates blocks of ``block_size`` token slots out of a pool of ``num_blocks``, sharing full blocks
    of equal prefixes when ``enable_prefix_caching``.

    free_blocks: the ids of blocks nobody holds, least recently freed first (the eviction order); a cached
    one keeps its hash until it is handed out. cached_blocks: block hash -> the block registered under it.
    unhashed: each live registration -> the runs of written blocks that follow its block, not hashed yet.
    block_tables[seq_id]: a sequence's blocks, in position order. chains[seq_id]: the registrations of its
    leading full blocks, as far as found at its admission or registered at once (its first).
    num_queried_tokens, num_hit_tokens: prompt tokens of the sequences admitted (at their first admission)
    and of them those found cached (vLLM's queries and hits). ``allocate`` raises RuntimeError when the
    free blocks do not suffice (see ``can_allocate``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}
        self.unhashed: dict[int, tuple[Unhashed, ...]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.chains: dict[str, list[int]] = {}
        self.num_registrations = 0
        self.num_taken = 0  # blocks handed out by _pop_free so far
        self.copy_on_write: set[str] = set()  # sequences whose partly filled last block others share
        self.blocks_to_copy: dict[str, tuple[int, int]] = {}  # append's copies-on-write, until taken
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return blocks_for(num_tokens, self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The leading full blocks of the sequence's tokens found in the cache (block ids, in order). The
        block holding the last token never is: that token is computed again, so that a prompt found whole
        still gets its logits (vLLM's rule; nano-vllm issue #144)."""
        if not self.enable_prefix_caching:
            return []
        token_ids = seq.token_ids
        found, parent = [], 0  # parent: the registration of the block before (0: none)
        for j in range((len(token_ids) - 1) // self.block_size):
            tokens, block_hash = self._hash(token_ids, seq.block_hashes, j)
            block = self._registered(tokens, block_hash, parent)
            if block is None:
                break
            found.append(block.block_id)
            parent = block.registration
            self._hash_runs(parent)  # the written blocks that follow it wait: hashed now
        return found

    def can_allocate(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether the sequence fits, given its cached leading blocks ``cached``: its other blocks come out
        of the free queue, and so do the cached blocks that no sequence holds now."""
        new = self.blocks_for(len(seq)) - len(cached)
        idle = len(self.free_blocks.keys() & cached)
        return new + idle <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int]) -> None:
        """Give a new sequence its blocks: the cached ones ``cached`` (one reference more each), then fresh
        blocks for the rest of its tokens, which are all its prefill computes (``num_computed_tokens``), in
        one step or in chunks; the other choices waiting inside it (``seq.forks``) are forked off its blocks
        once its last token is computed (``fork``). Counts the query and hits (cache on) at its first
        admission only, as its choices' ``metrics.num_cached_tokens``: a preempted sequence that finds its
        own blocks again is no hit (vLLM #25780)."""
        if seq.request_id in self.block_tables:
            raise RuntimeError(f"sequence {seq.request_id} already has blocks")
        chain = []
        for block_id in cached:
            self._share(block_id)
            chain.append(self.blocks[block_id].registration)
        num_tokens, num_hit_tokens = len(seq), len(cached) * self.block_size
        self.block_tables[seq.request_id] = cached + self._take(self.blocks_for(num_tokens) - len(cached))
        self.chains[seq.request_id] = chain
        seq.num_computed_tokens = num_hit_tokens
        if self.enable_prefix_caching and seq.metrics.first_scheduled_time is None:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens
            for choice in [seq, *seq.forks]:  # what the request's usage reports
                choice.metrics.num_cached_tokens = num_hit_tokens

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """Give ``child`` (another choice of seq's request, parallel_sampling.py) every block of ``seq`` by
        reference: its prefill computes nothing, its logits are seq's last token's. The partly filled last
        block is copied when one of them writes to it."""
        for block_id in self.block_tables[seq.request_id]:
            self._share(block_id)
        self.block_tables[child.request_id] = list(self.block_tables[seq.request_id])
        self.chains[child.request_id] = list(self.chains[seq.request_id])
        child.block_hashes = list(seq.block_hashes)
        child.num_computed_tokens = len(child)
        if len(seq) % self.block_size:  # both write into the shared last block next: copy-on-write
            self.copy_on_write.update((seq.request_id, child.request_id))

    def hand_over(self, seq_id: str, heir_id: str) -> None:
        """The blocks of sequence ``seq_id`` (if it holds any) become ``heir_id``'s, the same prompt's other
        choice, not forked yet: it takes the place of the choice aborted part-way (``Scheduler._unfork``)."""
        if seq_id in self.block_tables:
            self.block_tables[heir_id] = self.block_tables.pop(seq_id)
            self.chains[heir_id] = self.chains.pop(seq_id)

    def append(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for the sequence to hold ``num_tokens`` tokens (one more than it held: a decode),
        taking a block if its last one is full. A forked choice's first write, into the partly filled last
        block it shares, takes a block of its own instead: (source, destination) goes into
        ``blocks_to_copy``, to be copied before the step writes (copy-on-write). Returns False, taking
        nothing, if none is free."""
        table = self.block_tables[seq_id]
        if self.copy_on_write and seq_id in self.copy_on_write:  # its write lands in the shared block
            shared = self.blocks[table[-1]]
            if shared.ref_count > 1:  # the last holder writes in place
                if not self.free_blocks:
                    return False
                own = self._pop_free()
                shared.ref_count -= 1  # still held by the others
                table[-1] = own
                self.blocks_to_copy[seq_id] = (shared.block_id, own)
            self.copy_on_write.discard(seq_id)
            return True
        if num_tokens <= len(table) * self.block_size:
            return True
        if not self.free_blocks:
            return False
        table.append(self._pop_free())
        return True

    def extend(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for the sequence to hold ``num_tokens`` tokens, several more than it holds (a
        verification: its newest token and its drafts), taking the blocks past its last one, all or none:
        returns False, taking nothing, if too few are free. Called after ``append`` made room for the
        newest token (and its copy-on-write)."""
        table = self.block_tables[seq_id]
        new = self.blocks_for(num_tokens) - len(table)
        if new > len(self.free_blocks):
            return False
        table.extend(self._pop_free() for _ in range(new))
        return True

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Give back the sequence's blocks past its first ``num_tokens`` tokens: those that held only
        rejected drafts (never registered: a verification's blocks are its own), to the front of the free
        queue, since they hold nothing worth keeping."""
        table = self.block_tables[seq_id]
        while len(table) > self.blocks_for(num_tokens):
            block_id = table.pop()
            self.blocks[block_id].ref_count = 0
            self.free_blocks[block_id] = None
            self.free_blocks.move_to_end(block_id, last=False)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Cache the full blocks among the sequence's first ``num_tokens`` tokens, which the caller knows a
        launched step has written (a later step reads them after it, on the same stream). Hashing is the
        cost, and most blocks are never looked up: its first block is registered now, where every lookup
        starts; the rest wait in ``unhashed`` under its chain's last registration, to be registered when a
        lookup reaches that block (``find_cached_blocks``)."""
        chain, n = self.chains[seq.request_id], num_tokens // self.block_size
        if not self.enable_prefix_caching or len(chain) >= n:
            return
        table = self.block_tables[seq.request_id]
        if not chain:
            tokens, block_hash = self._hash(seq.token_ids, seq.block_hashes, 0)
            chain.append(self._register(table[0], tokens, block_hash, 0))
        runs = self.unhashed.get(chain[-1])
        if len(chain) < n and runs is not None:  # None: that registration is gone, nothing can reach these
            tokens = tuple(seq.token_ids[: n * self.block_size])
            run = Unhashed(tuple(table[len(chain) : n]), tokens, seq.block_hashes, len(chain), self.num_taken)
            if runs and runs[-1].block_hashes is seq.block_hashes:  # its last chunk's run: this one goes on
                runs = runs[:-1]
            self.unhashed[chain[-1]] = runs + (run,)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's reference to each of its blocks (finished, aborted or preempted); a block
        nobody holds goes to the end of the free queue, keeping its hash. Its last blocks are freed first,
        so they are evicted before its first ones, which more prompts share."""
        blocks, free_blocks = self.blocks, self.free_blocks
        for block_id in reversed(self.block_tables.pop(seq_id)):
            block = blocks[block_id]
            block.ref_count -= 1
            if not block.ref_count:
                free_blocks[block_id] = None
        self.chains.pop(seq_id)
        self.copy_on_write.discard(seq_id)

    def _hash(self, token_ids: list[int] | tuple[int, ...], block_hashes: list[int], j: int) -> tuple:
        """Block j's tokens and chained hash; each block is hashed once (kept in ``block_hashes``)."""
        tokens = tuple(token_ids[j * self.block_size : (j + 1) * self.block_size])
        if j == len(block_hashes):
            block_hashes.append(hash_block(block_hashes[-1] if j else None, tokens))
        return tokens, block_hashes[j]

    def _registered(self, tokens: tuple[int, ...], block_hash: int, parent: int) -> Block | None:
        """The block registered under ``block_hash`` if it holds these tokens after registration ``parent``:
        by induction over a chain, the whole prefix is confirmed, not only the hash."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.parent == parent and block.token_ids == tokens else None

    def _register(self, block_id: int, tokens: tuple[int, ...], block_hash: int, parent: int) -> int:
        """Register a written full block (tokens hashed block_hash, after registration parent); returns its
        registration. A block found registered (another sequence computed it too) stays so, and its
        registration is returned; another chain's block under the same hash (a collision) is replaced."""
        if (other := self.cached_blocks.get(block_hash)) is not None:
            if (block := self._registered(tokens, block_hash, parent)) is not None:
                return block.registration
            self.blocks[other].block_hash = None  # a collision: replaced
            del self.unhashed[self.blocks[other].registration]  # no lookup can reach what follows it
        block = self.blocks[block_id]
        self.num_registrations += 1
        block.block_hash, block.token_ids = block_hash, tokens
        block.registration, block.parent = self.num_registrations, parent
        self.cached_blocks[block_hash] = block_id
        self.unhashed[block.registration] = ()
        return block.registration

    def _hash_runs(self, parent: int) -> None:
        """Register the runs filed after registration parent, newest first: of two written copies of a
        block, the one freed last is evicted last."""
        if runs := self.unhashed.get(parent):
            self.unhashed[parent] = ()
            for run in reversed(runs):
                self._hash_run(run, parent)

    def _hash_run(self, run: Unhashed, parent: int) -> None:
        """Register a run's blocks, after registration parent, until one handed out again (rewritten)."""
        for j, block_id in enumerate(run.block_ids, run.first):
            if self.blocks[block_id].taken > run.filed:
                return
            parent = self._register(block_id, *self._hash(run.token_ids, run.block_hashes, j), parent)

    def _share(self, block_id: int) -> None:
        """One reference more to a block; a cached block that nobody held leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take(self, n: int) -> list[int]:
        """n blocks off the free queue; nothing is taken if fewer are free (RuntimeError)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: {n} needed, {self.num_free_blocks} free")
        return [self._pop_free() for _ in range(n)]

    def _pop_free(self) -> int:
        """The block at the front of the free queue, held once; a cached one is evicted: its hash is
        dropped before anything rewrites it."""
        block_id = self.free_blocks.popitem(False)[0]  # last=False: the front
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            del self.unhashed[block.registration]  # no lookup can reach what follows it now
            block.block_hash = None
        self.num_taken += 1
        block.taken, block.ref_count = self.num_taken, 1
        return block_id

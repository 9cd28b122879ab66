"""The block manager: which KV-cache blocks are free, which blocks each sequence holds, and which hold a
known prefix: blocks shared by content (prefix caching) and by fork (``SamplingParams.n``).

The bookkeeping half of PagedAttention (Kwon et al. 2023, SOSP): a free queue and a block table per
sequence. Prefix caching (vLLM's automatic prefix caching, nano-vllm's block manager): a full block that a
launched step writes is registered under a hash chained over every token up to its end, and stays so after
its last owner leaves (cached, in the free queue, evicted least recently freed first); a new sequence takes
the leading full blocks of its prompt found cached, each confirmed on the whole chain. A forked choice holds
its prompt's blocks by reference; the first to write into the shared last block gets a copy (copy-on-write).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """The chained hash of a full block: sha256 over its parent's hash (b"" for the first block) and its
    token ids (int64). 32 bytes; collision-resistant (vLLM's sha256 option), so a match names the prefix."""
    n = len(token_ids)
    int64s = _INT64S.get(n) or _INT64S.setdefault(n, struct.Struct(f"<{n}q"))
    return hashlib.sha256((parent_hash or b"") + int64s.pack(*token_ids)).digest()


_INT64S: dict[int, struct.Struct] = {}  # n -> the packer of n int64s (a block's token ids)


@dataclass(slots=True)
class Block:
    """One block of the pool. ref_count: the sequences holding it (0: in the free queue). Set while the
    block is registered in the cache: block_hash, token_ids, registration (a number no other registration
    has), parent (the registration of the block before it in its chain; 0 for a prompt's first block)."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    registration: int = 0
    parent: int = 0


class BlockManager:
    """Allocates blocks of ``block_size`` token slots out of a pool of ``num_blocks``, sharing full blocks
    of equal prefixes when ``enable_prefix_caching``.

    free_blocks: the ids of blocks no sequence holds, least recently freed first (the eviction order); a
    cached one keeps its hash until it is handed out. cached_blocks: block hash -> the block registered
    under it. block_tables[seq_id]: a sequence's blocks, in position order. chains[seq_id]: the
    registrations that hold its leading full blocks, as far as registered or found (its own blocks, or
    another sequence's of the same chain); its hashes are ``Sequence.block_hashes``, each hashed once.
    num_queried_tokens, num_hit_tokens: prompt tokens of the sequences admitted (at their first admission),
    and those of them found cached (vLLM's prefix-cache queries and hits). ``allocate`` raises RuntimeError
    when the free blocks do not suffice (callers check ``can_allocate`` first).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.chains: dict[str, list[int]] = {}
        self.num_registrations = 0
        self.copy_on_write: set[str] = set()  # sequences whose partly filled last block others share
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted when needed)."""
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return blocks_for(num_tokens, self.block_size)

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The leading full blocks of the sequence's tokens found in the cache (block ids, in order).

        The block holding the last token is never taken from the cache: that token is computed again, so
        that a prompt found whole still gets its logits (vLLM's rule; nano-vllm issue #144). A match is
        confirmed on the whole chain (``_cached``), so a hash collision cannot give a wrong hit."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        parent = 0
        for j in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])
            block = self._cached(self._block_hash(seq, j, tokens), tokens, parent)
            if block is None:
                break
            found.append(block.block_id)
            parent = block.registration
        return found

    def can_allocate(self, seq: Sequence, cached: list[int]) -> bool:
        """Whether the sequence fits, given its cached leading blocks ``cached``: its other blocks come out
        of the free queue, and so do the cached blocks that no sequence holds now."""
        new = self.blocks_for(len(seq)) - len(cached)
        idle = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return new + idle <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached: list[int]) -> list[Sequence]:
        """Give a new sequence its blocks: the cached ones ``cached`` (one reference more each), then fresh
        blocks for the rest of its tokens, which are all its prefill computes (``num_computed_tokens``).
        The other choices of a request of n > 1 waiting inside it (``seq.forks``) are forked off its blocks.
        Returns the sequences admitted: seq, then those. Counts the prefix-cache query and hits (with the
        cache on) at its first admission only: a preempted sequence that finds its own blocks again is no
        hit (vLLM #25780)."""
        if seq.request_id in self.block_tables:
            raise RuntimeError(f"sequence {seq.request_id} already has blocks")
        for block_id in cached:
            self._share(block_id)
        fresh = self._take(self.blocks_for(len(seq)) - len(cached))
        self.block_tables[seq.request_id] = list(cached) + fresh
        self.chains[seq.request_id] = [self.blocks[b].registration for b in cached]
        seq.num_computed_tokens = len(cached) * self.block_size
        # with the cache off nothing is looked up (vLLM counts nothing); the scheduler marks an admission
        if self.enable_prefix_caching and seq.metrics.first_scheduled_time is None:
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += len(cached) * self.block_size
        forks, seq.forks = seq.forks, []
        for fork in forks:
            self.fork(seq, fork)
        return [seq, *forks]

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

    def append(self, seq: Sequence, blocks_to_copy: dict[str, tuple[int, int]]) -> bool:
        """Make room for the sequence's decode, which writes position len(seq) - 1: a new block if that
        position starts one, or, if it lands in a block that others share (a fork's partly filled last
        block), a block of its own: (source, destination) goes into ``blocks_to_copy``, copied before the
        step writes (copy-on-write). Returns False, taking nothing, if the block it needs is not free."""
        table = self.block_tables[seq.request_id]
        if len(seq) > len(table) * self.block_size:
            if not self.free_blocks:
                return False
            table.append(self._pop_free())
        elif self.copy_on_write and seq.request_id in self.copy_on_write:
            shared = self.blocks[table[-1]]
            if shared.ref_count > 1:  # the last holder writes in place
                if not self.free_blocks:
                    return False
                own = self._pop_free()
                shared.ref_count -= 1  # still held by the others
                table[-1] = own
                blocks_to_copy[seq.request_id] = (shared.block_id, own)
            self.copy_on_write.discard(seq.request_id)
        return True

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among the sequence's first ``num_tokens`` tokens, which the caller knows
        a launched step has written (a later step reads them after it, on the same stream), extending its
        chain. A block whose chain is registered under another block stays unregistered (two sequences
        computed it at once) and the chain goes on from that block; another chain's block under the same
        hash (a collision) is replaced."""
        if not self.enable_prefix_caching:
            return
        chain, table, size = self.chains[seq.request_id], self.block_tables[seq.request_id], self.block_size
        cached, hashes = self.cached_blocks, seq.block_hashes
        for j in range(len(chain), num_tokens // size):  # ``_block_hash`` and ``_cached``, inline
            tokens = tuple(seq.token_ids[j * size : (j + 1) * size])
            if j == len(hashes):
                hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
            block_hash, parent = hashes[j], chain[-1] if chain else 0
            block = None if (block_id := cached.get(block_hash)) is None else self.blocks[block_id]
            if block is None or block.parent != parent or block.token_ids != tokens:
                if block is not None:  # another chain's block under this hash: replaced
                    self._uncache(block)
                block = self.blocks[table[j]]
                self.num_registrations += 1
                block.block_hash, block.token_ids = block_hash, tokens
                block.registration, block.parent = self.num_registrations, parent
                cached[block_hash] = block.block_id
            chain.append(block.registration)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's reference to each of its blocks (finished, aborted or preempted); a block
        nobody holds goes to the end of the free queue, keeping its hash. Its last blocks are freed first,
        so they are evicted before its first ones, which more prompts share."""
        for block_id in reversed(self.block_tables.pop(seq_id)):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
        self.chains.pop(seq_id)
        self.copy_on_write.discard(seq_id)

    def _block_hash(self, seq: Sequence, j: int, tokens: tuple[int, ...]) -> bytes:
        """The chained hash of the sequence's full block j (``tokens``), hashed once: kept in
        ``seq.block_hashes``, which callers extend in order (block j after block j - 1)."""
        hashes = seq.block_hashes
        if j == len(hashes):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes[j]

    def _cached(self, block_hash: bytes, tokens: tuple[int, ...], parent: int) -> Block | None:
        """The block registered under ``block_hash`` if it holds this chain's block: ``tokens``, after the
        registration ``parent`` (the block matched before it; 0 for a first block). By induction from the
        first block the whole prefix is confirmed, not only the hash (which only finds the candidate); a
        registration, once dropped, is never anyone's parent again."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.parent == parent and block.token_ids == tokens else None

    def _uncache(self, block: Block) -> None:
        """Drop the block's registration: its hash leaves the cache, so nothing finds it, nor (its number
        never registered again) any block registered after it as its parent."""
        del self.cached_blocks[block.block_hash]
        block.block_hash = None

    def _share(self, block_id: int) -> None:
        """One reference more to a block; a cached block that nobody held leaves the free queue."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take(self, n: int) -> list[int]:
        """n blocks off the front of the free queue, each held once; a cached one is evicted: its hash is
        dropped before anything rewrites it. Nothing is taken if fewer are free (RuntimeError)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: {n} needed, {self.num_free_blocks} free")
        return [self._pop_free() for _ in range(n)]

    def _pop_free(self) -> int:
        """The block at the front of the free queue, held once; a cached one is evicted (its hash dropped
        before anything rewrites it). The caller checks that one is free."""
        block_id = self.free_blocks.popitem(last=False)[0]
        block = self.blocks[block_id]
        if block.block_hash is not None:
            self._uncache(block)
        block.ref_count = 1
        return block_id

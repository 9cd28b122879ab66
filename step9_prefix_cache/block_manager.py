"""The block manager: which KV-cache blocks are free, which blocks each sequence holds, and which blocks
hold a known prefix (automatic prefix caching).

The bookkeeping half of PagedAttention (Kwon et al. 2023, SOSP; the name is vLLM's): a free queue and a
block table per sequence; ``block_size`` is decided here, once. A sequence gets blocks on demand, one
whenever its next token starts a new block, and gives them back when it finishes, is aborted or is
preempted. Nothing here touches tensors; the pool itself is ``PagedKVCache``.

Prefix caching (vLLM's automatic prefix caching; nano-vllm's block manager): a *full* block is named by a
hash chained over every token up to its end, ``hash(block j) = sha256(hash(block j - 1) + its token ids)``,
so that equal tokens after different prefixes never match. Once its keys and values are computed, a full
block is registered under its hash, and it stays registered after its last owner leaves: a free but
cached block, still in the free queue, evicted (its hash dropped) only when the queue hands it out again,
least recently freed first. A new sequence gets every leading full block of its prompt found in the
cache, reference-counted, and computes only the rest. Blocks are shared by reference (``ref_count``): a
block in use is never in the free queue, so never evicted. The one block that sequences share while it is
still being written is a forked prompt's partly filled last block (``fork``, ``SamplingParams.n``): the
first choice to write into it gets a copy of its own (copy-on-write, ``append``).
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


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """The chained hash of a full block: sha256 over its parent's hash (b"" for the first block) and its
    token ids (int64). 32 bytes; collision-resistant (vLLM's sha256 option), so a match names the prefix."""
    return hashlib.sha256((parent_hash or b"") + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


@dataclass
class Block:
    """One block of the pool. ref_count: the sequences holding it (0: in the free queue). block_hash,
    token_ids, parent: set while the block is registered in the cache: its hash, its tokens, and the
    registered block before it in its chain (None for a prompt's first block). Dropping a registration
    replaces the block's ``Block`` (same id and count), so no block registered after it matches again."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent: Block | None = None


class BlockManager:
    """Allocates blocks of ``block_size`` token slots out of a pool of ``num_blocks``, sharing full blocks
    of equal prefixes when ``enable_prefix_caching``.

    free_blocks: the ids of blocks no sequence holds, least recently freed first (the eviction order); a
    cached one keeps its hash until it is handed out. cached_blocks: block hash -> the block registered
    under it. block_tables[seq_id]: a sequence's blocks, in position order. block_hashes[seq_id]: the hash
    chain of its leading full blocks, as far as they are registered (or found registered); chains[seq_id]:
    the registered blocks that hold them (its own, or another sequence's with the same chain).
    num_queried_tokens, num_hit_tokens: prompt tokens of the sequences admitted (at their first admission),
    and those of them found cached (vLLM's prefix-cache queries and hits). ``allocate``, ``append`` and
    ``fork`` raise RuntimeError when the free blocks do not suffice (callers check ``can_allocate`` /
    ``can_append`` first).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.block_hashes: dict[str, list[bytes]] = {}
        self.chains: dict[str, list[Block]] = {}
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
        block_hash, parent = None, None
        for j in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.token_ids[j * self.block_size : (j + 1) * self.block_size])
            block_hash = hash_block(block_hash, tokens)
            parent = self._cached(block_hash, tokens, parent)
            if parent is None:
                break
            found.append(parent.block_id)
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
        self.block_hashes[seq.request_id] = [self.blocks[b].block_hash for b in cached]
        self.chains[seq.request_id] = [self.blocks[b] for b in cached]
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
        self.block_hashes[child.request_id] = list(self.block_hashes[seq.request_id])
        self.chains[child.request_id] = list(self.chains[seq.request_id])
        child.num_computed_tokens = len(child)

    def can_append(self, seq_id: str, num_tokens: int) -> bool:
        """Whether ``append`` finds the block it may need (a new one, or a copy) free."""
        return not self._append_needs_block(seq_id, num_tokens) or self.num_free_blocks > 0

    def append(self, seq_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Make room for the sequence to hold ``num_tokens`` tokens (one more than it held: a decode,
        which writes position num_tokens - 1): a new block if that position starts one; if it lands in a
        block that other sequences share, a copy of that block for this one (copy-on-write). Returns the
        copy to make before the write, (source, destination) block ids, or None. Raises RuntimeError if no
        block is free (check ``can_append``)."""
        table = self.block_tables[seq_id]
        if num_tokens > len(table) * self.block_size:
            table.extend(self._take(1))
        elif self._append_needs_block(seq_id, num_tokens):
            shared = self.blocks[table[-1]]
            (own,) = self._take(1)
            shared.ref_count -= 1  # still held by the others
            table[-1] = own
            return shared.block_id, own
        return None

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose keys and values are computed (its first
        ``seq.num_computed_tokens`` tokens), extending its hash chain. A block whose chain is already
        registered under another block stays unregistered (two sequences computed it at once), and the
        chain goes on from that block; another chain's block under the same hash (a collision) is
        replaced."""
        if not self.enable_prefix_caching:
            return
        hashes, chain, table, size = (
            self.block_hashes[seq.request_id],
            self.chains[seq.request_id],
            self.block_tables[seq.request_id],
            self.block_size,
        )
        for j in range(len(hashes), seq.num_computed_tokens // size):
            tokens = tuple(seq.token_ids[j * size : (j + 1) * size])  # appended tokens only: no placeholder
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
            parent = chain[-1] if chain else None
            block = self._cached(hashes[-1], tokens, parent)
            if block is None:
                self._uncache(hashes[-1])
                block = self.blocks[table[j]]
                block.block_hash, block.token_ids, block.parent = hashes[-1], tokens, parent
                self.cached_blocks[block.block_hash] = block.block_id
            chain.append(block)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's reference to each of its blocks (finished, aborted or preempted); a block
        nobody holds goes to the end of the free queue, keeping its hash. Its last blocks are freed first,
        so they are evicted before its first ones, which more prompts share."""
        for block_id in reversed(self.block_tables.pop(seq_id)):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        self.block_hashes.pop(seq_id)
        self.chains.pop(seq_id)

    def _append_needs_block(self, seq_id: str, num_tokens: int) -> bool:
        """Whether writing position num_tokens - 1 needs a free block: a new one if the position starts a
        block, a copy if it lands in a block that others share."""
        table = self.block_tables[seq_id]
        return num_tokens > len(table) * self.block_size or self.blocks[table[-1]].ref_count > 1

    def _cached(self, block_hash: bytes, tokens: tuple[int, ...], parent: Block | None) -> Block | None:
        """The block registered under ``block_hash`` if it holds this chain's block: ``tokens``, after
        ``parent`` (the block matched before it; None for a first block). By induction from the first
        block the whole prefix is confirmed, not only the hash (which only finds the candidate)."""
        block_id = self.cached_blocks.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.parent is parent and block.token_ids == tokens else None

    def _uncache(self, block_hash: bytes) -> None:
        """Drop the registration under ``block_hash``, if any. The block gets a new ``Block``: the old one
        may be the parent of blocks registered after it, which must never match again."""
        block_id = self.cached_blocks.pop(block_hash, None)
        if block_id is not None:
            self.blocks[block_id] = Block(block_id, self.blocks[block_id].ref_count)

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
        taken = []
        for _ in range(n):
            block_id = self.free_blocks.popitem(last=False)[0]
            if self.blocks[block_id].block_hash is not None:  # evicted
                self._uncache(self.blocks[block_id].block_hash)
            block = self.blocks[block_id]
            block.ref_count = 1
            taken.append(block.block_id)
        return taken

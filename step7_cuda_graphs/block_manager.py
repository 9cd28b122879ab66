"""The block manager: which KV-cache blocks are free, and which blocks each sequence owns.

The bookkeeping half of PagedAttention (Kwon et al. 2023, SOSP; the name is vLLM's): a free list and a
block table per sequence; ``block_size`` is decided here, once. A sequence gets blocks on demand, one
whenever its next token starts a new block, and gives them all back when it finishes, is aborted or
is preempted. Nothing here touches tensors; the pool itself is ``PagedKVCache``.
"""

from __future__ import annotations

from collections import deque


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocates blocks of ``block_size`` token slots out of a pool of ``num_blocks``.

    free_blocks: the ids of unowned blocks (first in, first out); every other block belongs to exactly
    one sequence (nothing shares blocks in this engine). block_tables[seq_id]: the blocks of a sequence,
    in position order. ``allocate`` raises RuntimeError on a request for more blocks than are free
    (callers check ``can_allocate`` first).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens (a prefill) fits in the free blocks."""
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens."""
        if seq_id in self.block_tables:
            raise RuntimeError(f"sequence {seq_id} already has blocks")
        self.block_tables[seq_id] = self._take(self.blocks_for(num_tokens))

    def append(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for the sequence to hold ``num_tokens`` tokens (one more than it held: a decode),
        taking a block if its last one is full. Returns False, taking nothing, if none is free."""
        table = self.block_tables[seq_id]
        if num_tokens <= len(table) * self.block_size:
            return True
        if not self.free_blocks:
            return False
        table.append(self.free_blocks.popleft())
        return True

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence (finished, aborted or preempted)."""
        self.free_blocks.extend(self.block_tables.pop(seq_id))

    def _take(self, n: int) -> list[int]:
        """n blocks off the free list; nothing is taken if fewer are free (RuntimeError)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: {n} needed, {self.num_free_blocks} free")
        return [self.free_blocks.popleft() for _ in range(n)]

"""The block manager: which KV-cache blocks are free, and which blocks each sequence owns.

The bookkeeping half of PagedAttention (Kwon et al. 2023, SOSP; the name is vLLM's): a free list, a
reference count per block, and a block table per sequence. A sequence gets blocks on demand, one
whenever its next token starts a new block, and gives them all back when it finishes, is aborted or
is preempted. Nothing here touches tensors; the pool itself is ``PagedKVCache``.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    """Allocates blocks of ``block_size`` token slots out of a pool of ``num_blocks``.

    free_blocks: the ids of unowned blocks (first in, first out). ref_counts[b]: how many sequences own
    block b. block_tables[seq_id]: the blocks of a sequence, in position order. Raises RuntimeError on a
    request for more blocks than are free (callers check ``can_allocate`` / ``can_append`` first).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens (a prefill) fits in the free blocks."""
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Give a new sequence the blocks for its first ``num_tokens`` tokens."""
        if seq_id in self.block_tables:
            raise RuntimeError(f"sequence {seq_id} already has blocks")
        self.block_tables[seq_id] = []
        self._grow(seq_id, self.blocks_for(num_tokens))

    def can_append(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the sequence can grow to ``num_tokens`` tokens (at most one new block per step)."""
        return self.blocks_for(num_tokens) - len(self.block_tables[seq_id]) <= self.num_free_blocks

    def append(self, seq_id: str, num_tokens: int) -> None:
        """Make room for the sequence to hold ``num_tokens`` tokens, taking a block if it needs one."""
        self._grow(seq_id, self.blocks_for(num_tokens) - len(self.block_tables[seq_id]))

    def free(self, seq_id: str) -> None:
        """Release every block of the sequence (finished, aborted or preempted)."""
        for block in self.block_tables.pop(seq_id):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)

    def slot(self, seq_id: str, position: int) -> int:
        """The flat cache slot of the token at ``position``: block * block_size + offset."""
        block = self.block_tables[seq_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _grow(self, seq_id: str, n: int) -> None:
        if n > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: {n} needed, {self.num_free_blocks} free")
        for _ in range(n):
            block = self.free_blocks.popleft()
            self.ref_counts[block] += 1
            self.block_tables[seq_id].append(block)

"""CUDA graphs: the decode step's forward pass captured once per batch size, then replayed.

A decode step of GPT-2 124M launches about 160 small kernels, each costing the host more time to launch from
Python than the GPU to run; a CUDA graph records them once (stream capture) and replays them with one call
(step 7's README has the timings). It replays fixed kernels on fixed addresses, so its inputs live in
persistent buffers (input_batch.py) and one graph is captured per batch size of a ladder (``capture_sizes``:
vLLM's, 1, 2, 4, 8, then every ``CAPTURE_STEP``) that a batch is padded up to; lengths and block tables are
data, so one graph serves every context length; step 13: mixed steps too, at token counts (``token_sizes``).
The sampler runs outside. Graphs are captured largest first into one memory pool and share one logits
buffer. Sources: PyTorch's "CUDA Graphs" notes; nano-vllm's ``capture_cudagraph``; vLLM's dispatcher."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

CAPTURE_STEP = 16  # rungs above 8: every 16 sequences (the padding cost is measured in README.md)
TOKEN_STEP = 256  # a mixed step's token counts above 256: every 256 tokens
MAX_GRAPH_TOKENS = 8192  # mixed steps of more tokens run eagerly (their launches cost little beside them)


def capture_sizes(max_num_seqs: int, step: int = CAPTURE_STEP) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every ``step`` up to ``max_num_seqs``, which is
    always a rung itself, so that every batch size from 1 to it has a rung at or above it."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + [b for b in range(step, max_num_seqs, step) if b > 8] + [max_num_seqs]


def token_sizes(max_num_tokens: int, step: int = TOKEN_STEP) -> list[int]:
    """The token counts that get a mixed step's graph: 16, 32 .. 256 (doubling), then every ``step`` up to
    ``max_num_tokens`` (a rung itself) or ``MAX_GRAPH_TOKENS``, whichever is less."""
    most = min(max_num_tokens, MAX_GRAPH_TOKENS)
    small = [t for t in (16, 32, 64, 128, 256) if t < most]
    return small + [t for t in range(2 * step, most, step) if t > 256] + [most]


def padded_size(sizes: list[int], num_seqs: int) -> int:
    """The smallest rung of ``sizes`` (sorted) that holds ``num_seqs`` sequences. Raises ValueError above
    the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    if i == len(sizes):
        raise ValueError(f"{num_seqs} sequences: the largest batch size of the ladder is {sizes[-1]}")
    return sizes[i]


@dataclass
class CaptureStats:
    """What capturing took: the graphs' batch sizes, seconds (warm-up included), and bytes of device
    memory the process took meanwhile (the shared pool, the logits buffer, library workspaces)."""

    sizes: list[int]
    seconds: float
    memory_bytes: int


class CUDAGraphRunner:
    """One CUDA graph of ``forward`` per batch size of ``sizes``, replayed on demand.

    forward(b) -> logits [b, V]: one decode step's forward pass over the first b lanes of the persistent
    input buffers, which must hold valid inputs (padding lanes) whenever it runs outside a replay; with
    ``rows`` (a mixed step's graphs, b tokens), [rows, V] from every size.
    logits: the graphs' shared output [max(sizes) or rows, V] in ``dtype``; ``replay(b)`` returns its first
    b (or rows) rows, overwritten by the next replay. Raises RuntimeError from ``capture`` if a kernel cannot
    be captured.
    """

    def __init__(
        self,
        forward: Callable[[int], torch.Tensor],
        sizes: list[int],
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
        rows: int | None = None,
    ):
        self.forward = forward
        self.rows = rows
        self.sizes = sorted(sizes)
        self.vocab_size, self.dtype, self.device = vocab_size, dtype, device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None
        self.stats: CaptureStats | None = None

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Capture every graph: one eager warm-up pass per size on a side stream (library handles and
        workspaces, Triton's compiled kernels, the allocator's blocks are set up outside the capture),
        then the captures, largest first, into one memory pool. Returns (and keeps) the ``CaptureStats``."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as each capture does: the difference below is then what the graphs hold
        free_before, started = torch.cuda.mem_get_info(self.device)[0], time.perf_counter()
        rows = self.rows or max(self.sizes)
        self.logits = torch.empty(rows, self.vocab_size, dtype=self.dtype, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in self.sizes:
                self.output(b).copy_(self.forward(b))
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.output(b).copy_(self.forward(b))  # [b or rows, V]
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.stats = CaptureStats(
            sizes=self.sizes,
            seconds=time.perf_counter() - started,
            memory_bytes=free_before - torch.cuda.mem_get_info(self.device)[0],
        )
        return self.stats

    def replay(self, b: int) -> torch.Tensor:
        """Run the graph of batch size ``b`` (a rung) on the buffers' current contents: logits [b, V] (or
        [rows, V])."""
        self.graphs[b].replay()
        return self.output(b)

    def output(self, b: int) -> torch.Tensor:
        """The logits rows of the graph of size ``b``: the first b, or ``rows``."""
        return self.logits[: self.rows or b]

"""The sharded layers of tensor parallelism (Shoeybi et al. 2019, Megatron-LM; nano-vllm's
``layers/linear.py`` and ``layers/embed_head.py``): a column-parallel layer keeps its rank's slice of the
outputs (no communication), a row-parallel layer its slice of the inputs (partial sums, one all-reduce, the
bias added once, after it). Attention and the MLP each pair the two: one all-reduce per pair. The embedding
keeps its rank's slice of the vocabulary, zero for the others' ids, one all-reduce; the tied LM head's
logits of each slice are gathered. ``shard`` reads only a rank's part of a checkpoint tensor. t = 1: plain
linear layers. Shapes: C in, O out, t ranks; a rank holds O / t rows (column) or C / t columns (row) of W.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .parallel_state import TensorParallel


def shard(
    tensor, dim: int, rank: int, world_size: int, parts: int = 1, padded: int | None = None
) -> torch.Tensor:
    """Rank ``rank``'s slice of ``tensor`` along ``dim``: the dimension holds ``parts`` blocks side by side
    (q, k and v in one: 3), each cut into ``world_size`` pieces, and the rank's piece of every block is
    kept, in order. ``tensor``: a torch tensor or a safetensors slice (only the rank's rows are read).
    ``padded``: the dimension's length after padding with zero rows (a vocabulary that ``world_size`` does
    not divide). Raises ValueError if the pieces do not divide evenly."""
    shape = list(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor.get_shape()
    length = padded or shape[dim]
    if length % (parts * world_size):
        raise ValueError(f"dimension {dim} of {length} does not split into {parts} x {world_size} pieces")
    block, piece = length // parts, length // (parts * world_size)
    pieces = []
    for p in range(parts):
        start = p * block + rank * piece
        stop = min(start + piece, shape[dim])  # past the stored rows: padding
        index = (slice(None),) * dim + (slice(start, max(start, stop)),)
        read = tensor[index]
        if read.shape[dim] < piece:  # the padding rows of a padded vocabulary: zeros
            fill = list(read.shape)
            fill[dim] = piece - read.shape[dim]
            read = torch.cat([read, read.new_zeros(fill)], dim)
        pieces.append(read)
    return pieces[0] if parts == 1 else torch.cat(pieces, dim)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, W [O, C] cut by its rows (the outputs): this rank's [O / t, C], its slice of y
    [N, O / t]. ``parts``: outputs that are ``parts`` blocks side by side (q, k, v: 3), each cut alike."""

    SHARD_DIMS = {"weight": 0, "bias": 0}  # the dimension each parameter is cut along

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, parts: int = 1):
        super().__init__()
        self.tp, self.parts = tp, parts
        self.weight = nn.Parameter(torch.empty(out_features // tp.world_size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [N, O / t]


class RowParallelLinear(nn.Module):
    """y = x W^T + b, W [O, C] cut by its columns (the inputs): this rank's [O, C / t] times its slice of x
    [N, C / t] is a partial sum; one all-reduce adds the ranks' (Megatron's "g"), then the bias, once.
    Returns [N, O] on every rank."""

    SHARD_DIMS, parts = {"weight": 1}, 1  # the bias: whole on every rank, added after the sum

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.world_size))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        return self.tp.all_reduce(F.linear(x, self.weight)) + self.bias  # [N, O]


class VocabParallelEmbedding(nn.Module):
    """The token embedding, its rows (the vocabulary, padded to a multiple of t) cut over the ranks: rank r
    holds ids [r V / t, (r + 1) V / t); an id elsewhere looks up zeros, and one all-reduce adds the ranks'
    rows. The tied LM head (``logits``): each rank's logits of its ids, gathered. [N] ids -> [N, C]."""

    SHARD_DIMS, parts = {"weight": 0}, 1

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.padded = -(-vocab_size // tp.world_size) * tp.world_size  # a multiple of t
        self.per_rank = self.padded // tp.world_size
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.per_rank  # [N], this rank's row of each id
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)  # [N, C]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[S, C] -> [S, V]: the LM head tied to this embedding, the ranks' slices gathered."""
        logits = F.linear(x, self.weight)  # [S, V / t] (padded)
        if self.tp.world_size == 1:
            return logits
        logits = self.tp.all_gather(logits)  # [S, V] (padded)
        return logits[:, : self.vocab_size] if self.padded > self.vocab_size else logits  # padding dropped

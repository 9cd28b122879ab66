"""Persistent input buffers: the model's inputs live in tensors allocated once and updated in place.

One int64 buffer, allocated once, holds every input of a step, on the host (pinned with CUDA, a numpy view)
and on the device, for a CUDA graph replays fixed addresses (vLLM v1's persistent batch). A running sequence
owns a *row* of a persistent block table, written when it joins and at each new block; per step the host
writes the lanes' fields, one copy moves them. Padding lanes own nothing (``PADDING_ROW``, the scratch slot;
q tokens at 0..q - 1, q = 1 + k in a uniform verification, else 1; none in a mixed step padded to a token
count, whose last tokens are in no lane). Shapes: T tokens, R rows, M blocks a row. Step 8: decode lanes'
ids are gathered on the device, ``input_ids[lane] = last_token[rows[lane]]`` (the sampler fills
``last_token`` [R + 1] by row); ``prepare`` waits for the last copy's event before writing.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from .scheduler import SchedulerOutput

PADDING_ROW = 0  # block-table row of the padding lanes; sequences get rows 1..R


def is_uniform(scheduled: SchedulerOutput, query_len: int) -> bool:
    """Whether every lane of the step feeds ``query_len`` new tokens and none is a prefill or a chunk: a
    decode-only step
    (query_len 1) or a *uniform verification* step (1 + k: every lane a verification of k drafts), the
    steps that are padded to a rung of the capture ladder (vLLM's "uniform decode" batches,
    ``uniform_decode_query_len`` in ``vllm/v1/cudagraph_dispatcher.py``)."""
    if scheduled.prefills or scheduled.chunks or (scheduled.verifies and scheduled.decodes):
        return False
    if scheduled.decodes:
        return query_len == 1
    return all(1 + len(seq.spec_token_ids) == query_len for seq in scheduled.verifies)


class CpuGpuBuffer:
    """One int64 buffer of ``size`` elements in two places (vLLM's name): ``cpu`` on the host (pinned on a
    CUDA device, so that the copy does not make the host wait), ``np`` its numpy view (for cheap writes),
    and ``gpu`` on ``device`` (a separate tensor on a CPU too, so that the copy path is the same).
    ``copied``: on a CUDA device, the event recorded after the last copy (a CPU copies synchronously)."""

    def __init__(self, size: int, device: torch.device):
        self.cpu = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.gpu = torch.zeros(size, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def copy_to_gpu(self, n: int) -> None:
        """Copy the first ``n`` elements host -> device, asynchronously (from pinned memory)."""
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.gpu.device))

    def wait_copied(self) -> None:
        """Wait until the last copy has read the host buffer, so that the host may write it again."""
        if self.copied is not None:
            self.copied.synchronize()


class InputBatch:
    """The persistent inputs of the model runner: per-lane fields of the step and per-row block tables.

    Fields, numpy views into one host buffer (``.np[name]``) and device views into its twin (``.gpu[name]``):
    input_ids, positions, slot_mapping [T]; query_start_loc [R + 1]; seq_lens, rows [R] (lane -> its row);
    logits_rows [R] (a padded mixed step's sampled tokens, ``write_lanes``);
    block_table [(R + 1) * M], seen as [R + 1, M] through ``block_table_np`` / ``block_table_gpu``.
    ``last_token`` [R + 1]: on the device only, each row's newest sampled token id (the runner writes it).
    ``row_of`` maps a running sequence's id to its row; ``num_blocks[row]`` counts the entries written.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ):
        T, R, M = max(max_num_tokens, max_num_seqs), max_num_seqs, max_blocks_per_seq
        sizes = {
            "input_ids": T,
            "positions": T,
            "slot_mapping": T,
            "query_start_loc": R + 1,
            "seq_lens": R,
            "rows": R,
            "logits_rows": R,
            "block_table": (R + 1) * M,  # last: a step copies the buffer up to the highest row it uses
        }
        self.buffer = CpuGpuBuffer(sum(sizes.values()), device)
        self.np, self.gpu, start = {}, {}, 0
        for name, size in sizes.items():
            self.np[name] = self.buffer.np[start : start + size]
            self.gpu[name] = self.buffer.gpu[start : start + size]
            start += size
        self.table_offset = start - sizes["block_table"]
        self.block_table_np = self.np["block_table"].reshape(R + 1, M)  # [R + 1, M]
        self.block_table_gpu = self.gpu["block_table"].view(R + 1, M)  # [R + 1, M]
        self.last_token = torch.zeros(R + 1, dtype=torch.int64, device=device)  # [R + 1]; row 0: padding
        self.block_table_np[PADDING_ROW] = scratch_block
        self.num_blocks = np.zeros(R + 1, dtype=np.int64)  # entries written per row
        self.num_blocks[PADDING_ROW] = M
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(1, R + 1))  # a heap: the lowest free row first keeps the copy short
        self.block_size, self.max_blocks = block_size, M
        self.scratch_slot = scratch_block * block_size  # offset 0 of the scratch block

    def update_rows(self, scheduled: SchedulerOutput, block_tables: dict[str, list[int]]) -> None:
        """Bring the rows up to date with the step: sequences no longer scheduled (finished, aborted,
        preempted) give their row back; each prefill and chunk (new, readmitted, or part-way) gets a row
        (or keeps its own) with its whole block table; a decode whose sequence gained a block has the new
        entries written, and one whose last block was copied on write has that entry rewritten."""
        live = {seq.request_id for seq in scheduled.seqs}
        for seq_id in [s for s in self.row_of if s not in live]:
            heapq.heappush(self.free_rows, self.row_of.pop(seq_id))
        for seq in scheduled.prefills + list(scheduled.chunks):
            row = self.row_of.get(seq.request_id)
            if row is None:
                row = self.row_of[seq.request_id] = heapq.heappop(self.free_rows)
            table = block_tables[seq.request_id]
            self.block_table_np[row, : len(table)] = table
            self.num_blocks[row] = len(table)
        for seq in scheduled.verifies + scheduled.decodes:
            row, table = self.row_of[seq.request_id], block_tables[seq.request_id]
            if len(table) > self.num_blocks[row]:  # it took a block this step: write that entry only
                self.block_table_np[row, self.num_blocks[row] : len(table)] = table[self.num_blocks[row] :]
                self.num_blocks[row] = len(table)
        for seq_id, (_, own) in scheduled.blocks_to_copy.items():  # the shared block's entry: its own copy
            table = block_tables[seq_id]  # (not always the last: a verification may take blocks after it)
            self.block_table_np[self.row_of[seq_id], table.index(own)] = own

    def trim(self, seq_id: str, num_blocks: int) -> None:
        """The sequence gave its blocks past its first ``num_blocks`` back (``BlockManager.trim``): the
        entries past them are stale, and the next block it takes is written at ``num_blocks``."""
        row = self.row_of[seq_id]
        self.num_blocks[row] = min(self.num_blocks[row], num_blocks)

    def prepare(
        self,
        scheduled: SchedulerOutput,
        block_tables: dict[str, list[int]],
        num_lanes: int,
        query_len: int = 1,
        num_tokens: int | None = None,
    ) -> tuple[int, list[int]]:
        """Write the step's inputs into the host buffer and copy them to the device in one copy.

        The lanes are the scheduled sequences in order (prefills, chunks, verifications, decodes), then
        ``num_lanes`` - S padding lanes of ``query_len`` tokens each: 1 in a decode-only step, 1 + k in a
        uniform verification step (every lane a verification of k drafts: the caller's ``is_uniform``).
        With ``num_tokens`` (a mixed step's graph, no verification): padding lanes of no token, the tokens
        up to ``num_tokens`` in no lane (scratch slot), each decode's input id written as -1 - its row (the
        device gathers it from ``last_token``), the sampled tokens' indices in ``logits_rows``.
        Returns the number of new tokens N (padding included) and query_start_loc as a host list
        [num_lanes + 1]. Raises ValueError if prefills are padded without ``num_tokens``.
        """
        S = len(scheduled.seqs)
        if (scheduled.prefills or scheduled.chunks) and num_lanes != S and num_tokens is None:
            raise ValueError(f"num_lanes={num_lanes}: prefills are not padded (S={S})")
        self.buffer.wait_copied()  # the previous step's copy has read the host buffer: it may be written
        self.update_rows(scheduled, block_tables)
        return self.write_lanes(scheduled, num_lanes, query_len, num_tokens)

    def write_lanes(
        self, scheduled: SchedulerOutput, num_lanes: int, query_len: int = 1, num_tokens: int | None = None
    ) -> tuple[int, list[int]]:
        """``prepare`` after the rows are up to date: the per-lane fields, then the one copy."""
        chunks = scheduled.chunks
        P, S = len(scheduled.prefills) + len(chunks) + len(scheduled.verifies), len(scheduled.seqs)
        f, bs = self.np, self.block_size
        qsl, t = [0], 0
        # the tokens not in the cache, positions c .. L - 1: a chunk's end at L; a verification's are its last
        # and its drafts
        for i, seq in enumerate(scheduled.prefills + list(chunks) + scheduled.verifies):
            c, L, row = (
                seq.num_computed_tokens,
                chunks.get(seq, len(seq) + len(seq.spec_token_ids)),
                self.row_of[seq.request_id],
            )
            n, pos = L - c, np.arange(c, L)  # a forked choice has none: its logits are the row before's
            f["input_ids"][t : t + n] = seq.token_ids[c:L] + seq.spec_token_ids
            f["positions"][t : t + n] = pos
            f["slot_mapping"][t : t + n] = self.block_table_np[row, pos // bs] * bs + pos % bs
            f["seq_lens"][i], f["rows"][i] = L, row
            t += n
            qsl.append(t)
        D = S - P  # the decodes, one lane each: the newest token (its id gathered by the device) at L - 1
        if D:
            rows = np.array([self.row_of[seq.request_id] for seq in scheduled.decodes])
            lens = np.array([len(seq) for seq in scheduled.decodes])
            f["positions"][t : t + D] = lens - 1
            f["slot_mapping"][t : t + D] = self.block_table_np[rows, (lens - 1) // bs] * bs + (lens - 1) % bs
            f["seq_lens"][P:S], f["rows"][P:S] = lens, rows
            if num_tokens is not None:  # a mixed step's decode ids: gathered by the graph (-1 - row: which)
                f["input_ids"][t : t + D] = -1 - rows
        qsl += range(t + 1, t + D + 1)
        t, q = t + D, query_len  # padding lanes: own nothing (a decode's token 0: last_token's row 0)
        if num_tokens is None:  # q tokens each
            pad = slice(t, t + (num_lanes - S) * q)
            f["positions"][pad] = np.arange(pad.stop - t) % q  # [(num_lanes - S) * q]: 0..q - 1 each
            f["seq_lens"][S:num_lanes] = q
            qsl += range(t + q, pad.stop + 1, q)
        else:  # none; the tokens t .. num_tokens - 1 in no lane (attention leaves them, the rows run on)
            pad = slice(t, num_tokens)
            f["positions"][pad], f["seq_lens"][S:num_lanes] = 0, 0
            qsl += [t] * (num_lanes - S)
            sampled = self.logits_indices(scheduled, qsl[: S + 1])  # [S - C]
            f["logits_rows"][:num_lanes] = 0  # padding lanes' rows: token 0, its logits dropped
            f["logits_rows"][: len(sampled)] = sampled
        f["input_ids"][pad], f["slot_mapping"][pad] = 0, self.scratch_slot
        f["rows"][S:num_lanes] = PADDING_ROW
        f["query_start_loc"][: num_lanes + 1] = qsl
        highest_row = int(f["rows"][:num_lanes].max(initial=PADDING_ROW))
        self.buffer.copy_to_gpu(self.table_offset + (highest_row + 1) * self.max_blocks)
        return pad.stop, qsl

    def logits_indices(self, scheduled: SchedulerOutput, query_start_loc: list[int]) -> np.ndarray:
        """The tokens whose logits a step with chunks or verifications (not padded) computes, in the order
        the model runner reads them: each sampled lane's last token (the prefills', then the decodes'), then
        every token of the verification lanes (their newest and their drafts); none of a chunk's.
        [S - C - B + sum(1 + k)]"""
        a = len(scheduled.prefills)
        c = a + len(scheduled.chunks)
        b = c + len(scheduled.verifies)
        qsl = np.asarray(query_start_loc)  # [S + 1]
        return np.concatenate([qsl[1 : a + 1] - 1, qsl[b + 1 :] - 1, np.arange(qsl[c], qsl[b])])

    def fill_padding(self, num_lanes: int, query_len: int = 1, num_tokens: int | None = None) -> None:
        """Make every one of ``num_lanes`` lanes a padding lane of ``query_len`` tokens (or, with
        ``num_tokens``, of none, the tokens in no lane), on the host and the device: the inputs a graph is
        captured with (its warm-up runs write only the scratch slot)."""
        self.write_lanes(SchedulerOutput(), num_lanes, query_len, num_tokens)

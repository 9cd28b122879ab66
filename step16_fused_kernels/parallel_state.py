"""Tensor parallelism's process group (vLLM's ``parallel_state.py``, Megatron-LM's ``mpu``): t ranks, one a
device, joined by torch.distributed, one group with NCCL for CUDA tensors and gloo for CPU tensors (gloo
only on a CPU). Rank 0 is the engine (it schedules and samples); ranks 1..t-1 are workers (worker.py) that
run the same forward passes on their shards. The collectives of the sharded model (an all-reduce after each
row-parallel layer and the embedding, the logits' all-gather) and each step's broadcast (``StepPlan``): its
host ints on the CPU (gloo), then the input buffer and the sampled ids on the device's backend. Rank 0's
store listens on ``MASTER_ADDR`` (127.0.0.1) only, at ``MASTER_PORT`` if set, else on a free port.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from common.weights import GPT2Config

STORE_TIMEOUT = timedelta(minutes=10)  # how long a worker tries to reach rank 0's store
# how long a collective may wait: a worker waits for rank 0's next step as long as the server idles (deaths
# are seen by the processes' watchdogs, not by timeouts)
GROUP_TIMEOUT = timedelta(days=365)
# a step's kinds: the forward pass it runs (model_runner.py), the graphs to capture, the end of the workers
EAGER, DECODE, VERIFY, MIXED, CAPTURE, SHUTDOWN = range(6)
HEADER = 11  # a plan's fixed part: kind, size, N, S, P, width, max_query_len, its four lists' lengths
# the all-gather of one tensor: its newer name, else the older (deprecated, and warns, in newer torch)
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the group: ``rank`` of ``world_size`` (1: no group, no collective)."""

    rank: int = 0
    world_size: int = 1

    def heads_config(self, config: GPT2Config) -> GPT2Config:
        """``config`` as this rank's KV cache sees it: n_head / t heads of the same head_dim."""
        t = self.world_size
        return dataclasses.replace(config, n_head=config.n_head // t, n_embd=config.n_embd // t)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (a row-parallel layer's partial sums); returns it."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[S, V / t] on each rank -> [S, V]: the ranks' columns side by side, in rank order (the logits of
        each rank's slice of the vocabulary)."""
        if self.world_size == 1:
            return x
        S, t = x.shape[0], self.world_size
        out = torch.empty((t * S, x.shape[1]), dtype=x.dtype, device=x.device)  # [t * S, V / t]
        getattr(dist, ALL_GATHER)(out, x.contiguous())
        return out.view(t, S, -1).permute(1, 0, 2).reshape(S, -1)  # [S, V]


SINGLE = TensorParallel()  # no tensor parallelism: the model on one device, as in step 14


@dataclass
class StepPlan:
    """One step as the workers must run it: ``kind`` (EAGER, DECODE, VERIFY, MIXED; CAPTURE, SHUTDOWN), its
    ``size`` (a graph's lanes or tokens), and for an eager pass N tokens, S lanes, P prefills, the block
    tables' ``width``, ``max_query_len`` (0: the longest lane's); ``query_start_loc`` [S + 1],
    ``prefill_seq_lens`` [P] (the torch backend's host ints), ``rows`` (the logits' rows, or empty: each
    lane's last token) and ``blocks_to_copy`` (copy-on-write pairs, applied before the pass)."""

    kind: int
    size: int = 0
    N: int = 0
    S: int = 0
    P: int = 0
    width: int = 0
    max_query_len: int = 0
    query_start_loc: list[int] = field(default_factory=list)
    prefill_seq_lens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The header [HEADER] (the numbers, then the lists' lengths) and the payload (the lists, one
        after the other; empty for a graph's step) as int64 CPU tensors."""
        pairs = [x for pair in self.blocks_to_copy for x in pair]
        lists = [self.query_start_loc, self.prefill_seq_lens, self.rows, pairs]
        fixed = [self.kind, self.size, self.N, self.S, self.P, self.width, self.max_query_len]
        header = torch.tensor(fixed + [len(x) for x in lists], dtype=torch.int64)
        return header, torch.tensor([x for xs in lists for x in xs], dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
        """The plan ``encode`` made."""
        *fixed, a, b, c, d = header.tolist()
        values = payload.tolist()
        lists = [values[:a], values[a : a + b], values[a + b : a + b + c], values[a + b + c : a + b + c + d]]
        pairs = list(zip(lists[3][::2], lists[3][1::2]))
        return cls(*fixed, *lists[:3], pairs)


def broadcast_plan(plan: StepPlan, tensors: list[torch.Tensor]) -> None:
    """Rank 0: send ``plan`` (its host ints, over gloo), then ``tensors`` (the step's inputs, on their
    device's backend) to every worker; the workers' ``receive_plan``."""
    header, payload = plan.encode()
    dist.broadcast(header, 0)
    if payload.numel():
        dist.broadcast(payload, 0)
    for t in tensors:
        dist.broadcast(t, 0)


def receive_plan(tensors: list[torch.Tensor]) -> StepPlan:
    """A worker: the next ``StepPlan`` from rank 0, and its inputs into ``tensors`` (``broadcast_plan``)."""
    header = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(header, 0)
    payload = torch.empty(int(header[-4:].sum()), dtype=torch.int64)
    if payload.numel():
        dist.broadcast(payload, 0)
    plan = StepPlan.decode(header, payload)
    if plan.kind not in (CAPTURE, SHUTDOWN):
        for t in tensors:
            dist.broadcast(t, 0)
    return plan


def time_all_reduce(tp: TensorParallel, rows: int, width: int, dtype: torch.dtype, device) -> float:
    """Microseconds of one all-reduce of [rows, width] ``dtype`` on ``device``: the median of 11, after 3
    untimed, every rank calling it at once (at start-up: what each of a step's 2L + 1 costs)."""
    x = torch.zeros(rows, width, dtype=dtype, device=device)  # zeros: sums that never overflow
    sync = torch.cuda.synchronize if x.device.type == "cuda" else lambda: None
    times = []
    for i in range(14):
        sync()
        start = time.perf_counter()
        tp.all_reduce(x)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[5] * 1e6


def backend(device: torch.device) -> str:
    """The group's backends: NCCL for CUDA tensors with gloo for the host's, or gloo alone on a CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def store_address() -> tuple[str, int]:
    """Where rank 0's store listens: ``MASTER_ADDR`` (default 127.0.0.1: an address of this machine) and
    ``MASTER_PORT`` (default, or empty: 0, a free port, which rank 0 passes to its workers). Raises
    ValueError naming the variable if the port is not a number in 0..65535."""
    host, port = os.environ.get("MASTER_ADDR") or "127.0.0.1", os.environ.get("MASTER_PORT") or "0"
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"MASTER_PORT={port!r}: must be a port number, 0..65535 (0: a free one)")
    return host, int(port)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:(N + rank)`` for ``cuda:N`` (bare ``cuda``: N = 0), else ``device``."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def open_store(rank: int, world_size: int, host: str, port: int) -> dist.TCPStore:
    """Rank 0: open the group's store on a socket bound to ``host:port`` only (0: a free port;
    ``store.port`` says which), not on every interface as TCPStore binds its own (vllm #15988: the store
    has no authentication); a worker: connect to it. Raises ValueError if rank 0 cannot listen there (the
    port in use, or ``host`` not an address of this machine), or if this process already belongs to a
    torch.distributed group. With a loopback ``host``, gloo and NCCL are kept on the loopback too."""
    if dist.is_initialized():
        raise ValueError("tensor_parallel_size > 1: this process already has a torch.distributed group")
    if is_loopback(host):  # read when each rank joins; a worker inherits them
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    listener = None
    try:
        if rank == 0:
            listener = socket.create_server((host, port))
            port = listener.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0,
            timeout=STORE_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=listener.detach() if listener else None,  # the store's now
        )
    except (RuntimeError, OSError) as e:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
        where = "listen" if rank == 0 else "reach rank 0's store"
        raise ValueError(
            f"tensor parallelism: cannot {where} at {host}:{port} ({e}); MASTER_ADDR must be an address of "
            "this machine, and MASTER_PORT a free port (or unset)"
        ) from None
    return store


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_group(rank: int, world_size: int, device: torch.device, store: dist.TCPStore) -> None:
    """Join the default torch.distributed group as ``rank`` of ``world_size``, on ``device``; returns once
    every rank has joined."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend(device), store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )

"""The workers of tensor parallelism: ranks 1..t-1 of an engine's group, each a process of its own with its
shard of the model and of the KV cache on its own device (vLLM's ``MultiprocExecutor`` and ``WorkerProc``,
nano-vllm's ranks > 0). ``Workers`` (rank 0, in the engine) starts them, waits for each to load its shard,
watches them and stops them; ``main`` is a worker's life: load, join the group, follow rank 0's steps
(``ModelRunner.follow``). A worker exits when rank 0's process dies; a worker that dies stops the engine.
``main``: ``--rank R --store HOST:PORT --parent-pid PID --ready-fd FD --engine-args JSON``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from .config import EngineArgs
from .kv_cache import PagedKVCache
from .launcher import how_it_ended
from .model import GPT, kernels
from .model_runner import ModelRunner
from .parallel_state import (
    SHUTDOWN,
    StepPlan,
    TensorParallel,
    broadcast_plan,
    join_group,
    open_store,
    rank_device,
    time_all_reduce,
)

PARENT_CHECK_S = 0.2  # how often a worker looks for its parent
DEATH_GRACE_S = 2.0  # after a worker's death: how long the engine may take to say so before it is ended
# an engine core's process ends when a worker dies (its frontends see it go: the server stops), set by
# engine_core.py; in a user's process the engine refuses its steps instead (unless stuck in a collective)
END_PROCESS_ON_DEATH = False
STOP_TIMEOUT_S = 5.0  # how long a worker may take to stop after SHUTDOWN or SIGTERM before it is killed


class Workers:
    """Rank 0's side of a group of ``args.tensor_parallel_size`` ranks: opens the group's store, starts
    ranks 1..t-1 (``start``), waits for each to load its shard (``wait_loaded``: raises ValueError with the
    worker's own error, or how it died), then joins the group with them (``join``) and watches them
    (``watch``: a worker that dies stops the engine); ``shutdown`` stops them (SHUTDOWN, then SIGKILL)."""

    def __init__(self, args: EngineArgs, host: str, port: int):
        self.args, self.world_size = args, args.tensor_parallel_size
        self.tp = TensorParallel(0, self.world_size)
        self.store = open_store(0, self.world_size, host, port)
        self.address = f"{host}:{self.store.port}"
        self.procs: list[subprocess.Popen] = []
        self.ready: list[int] = []  # each worker's end of its pipe, read by wait_loaded
        # shutting down; a worker's death reported by the engine; a step under way (the engine's flag)
        self.stopping = self.reported = self.busy = False
        self.failure: str | None = None  # why no step can run any more (a worker died; shut down)

    def start(self) -> None:
        """Start the worker processes (they load their shards meanwhile)."""
        given = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args) if f.init}
        engine_args = json.dumps({**given, "model": str(self.args.folder), "kv_cache_memory": None})
        for rank in range(1, self.world_size):
            read, write = os.pipe()
            code = f"import sys; from {__package__}.worker import main; sys.exit(main())"
            command = [sys.executable, "-c", code, "--rank", str(rank), "--store", self.address]
            command += [
                "--parent-pid",
                str(os.getpid()),
                "--ready-fd",
                str(write),
                "--engine-args",
                engine_args,
            ]
            self.procs.append(subprocess.Popen(command, pass_fds=[write]))
            os.close(write)
            self.ready.append(read)

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard. Raises ValueError (after stopping the others) with
        the first one's error, or its exit status if it died without a word."""
        ready, self.ready = self.ready, []
        for rank, (proc, fd) in enumerate(zip(self.procs, ready), 1):
            with os.fdopen(fd) as pipe:
                word = pipe.readline().strip()
            if word != "loaded":
                status = proc.wait()
                self.shutdown()
                raise ValueError(
                    f"tensor-parallel rank {rank} failed to start: {word or how_it_ended(status)}"
                )

    def join(self) -> None:
        """Join the group (every worker has loaded), in a thread while this one watches the workers: a
        worker that died before joining would keep the join waiting. Raises ValueError if one dies
        meanwhile. Then the watchdog (``watch``) runs until ``shutdown``."""
        failed: list[BaseException] = []

        def run() -> None:
            try:
                join_group(0, self.world_size, self.args.torch_device, self.store)
            except BaseException as e:  # noqa: BLE001 -- raised below, in the caller's thread
                failed.append(e)

        joining = threading.Thread(target=run, name="tensor-parallel-join", daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(PARENT_CHECK_S)
            if joining.is_alive() and (exited := self.exited()) is not None:
                self.shutdown()
                raise ValueError(f"{exited} before it joined the group")
        if failed:
            raise failed[0]
        threading.Thread(target=self.watch, name="tensor-parallel-watchdog", daemon=True).start()

    def exited(self) -> str | None:
        """The first worker that has exited, and how, in words ("tensor-parallel rank 1 (pid 12) killed
        by SIGKILL"), or None while all run."""
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how_it_ended(proc.returncode)}"
        return None

    def dead(self) -> str | None:
        """The engine's question after a collective failed: ``exited``, waiting up to ``DEATH_GRACE_S``
        for the worker to be reaped; the answer is the engine's to report (the watchdog then lets the
        process live)."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while (exited := self.exited()) is None and time.monotonic() < deadline:
            time.sleep(PARENT_CHECK_S)
        self.reported = exited is not None
        return exited

    def watch(self) -> None:
        """A daemon thread: if a worker exits while the engine runs, say which on stderr, stop the
        others, and from then on refuse every step (``failure``). Unless the engine reports the death
        itself within ``DEATH_GRACE_S`` (its collective failed: gloo's do), end this process if it is an
        engine core's (``END_PROCESS_ON_DEATH``) or a step is under way (``busy``): a collective with a
        dead rank can wait forever (NCCL's)."""
        while not self.stopping:
            if (exited := self.exited()) is not None:
                self.failure = exited
                print(f"{exited}: stopping the engine", file=sys.stderr, flush=True)
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.kill()
                deadline = time.monotonic() + DEATH_GRACE_S
                while not self.reported and time.monotonic() < deadline:
                    time.sleep(PARENT_CHECK_S)
                if not self.reported and (END_PROCESS_ON_DEATH or self.busy):
                    os._exit(1)
                return
            time.sleep(PARENT_CHECK_S)

    def shutdown(self) -> None:
        """Stop the workers: once joined, SHUTDOWN to the group and a wait of up to ``STOP_TIMEOUT_S``
        for each; then SIGKILL to any left (before joining, at once: they wait for rank 0)."""
        if self.stopping:
            return
        joined, self.stopping = torch.distributed.is_initialized(), True
        self.failure = self.failure or "the engine has been shut down (its tensor-parallel workers stopped)"
        if joined:
            try:
                broadcast_plan(StepPlan(SHUTDOWN), [])
            except RuntimeError:  # a worker is gone already
                pass
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S if joined else 0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self.ready:  # those not read: a start that failed
            with contextlib.suppress(OSError):
                os.close(fd)
        if joined:
            torch.distributed.destroy_process_group()


def watch_parent(parent_pid: int) -> None:
    """A daemon thread: exit at once if rank 0's process (the parent) dies, whatever the main thread is
    doing (loading, waiting in a collective)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_worker(rank: int, address: str, engine_args: dict, ready_fd: int) -> int:
    """A worker's life: its shard loaded (or its error said on ``ready_fd``, status 1), the group joined,
    its KV cache and runner made, then rank 0's steps until SHUTDOWN (status 0)."""
    if "OMP_NUM_THREADS" not in os.environ:  # as the engine core's: threads that share cores wait
        torch.set_num_threads(1)
    with os.fdopen(ready_fd, "w") as ready:
        try:
            args = EngineArgs(**engine_args)
            tp = TensorParallel(rank, args.tensor_parallel_size)
            device = rank_device(args.torch_device, rank)
            model = GPT.from_pretrained(str(args.folder), device=str(device), dtype=args.torch_dtype, tp=tp)
        except Exception as e:  # noqa: BLE001 -- said to rank 0, which raises it
            ready.write(f"{type(e).__name__}: {e}\n")
            return 1
        ready.write("loaded\n")
    host, port = address.rsplit(":", 1)
    join_group(rank, tp.world_size, device, open_store(rank, tp.world_size, host, int(port)))
    config = tp.heads_config(model.config)
    kv_cache = PagedKVCache(
        config,
        args.num_kv_blocks + 1,
        args.block_size,
        device,
        args.torch_dtype,
        args.kv_cache_dtype,
        args.attention_backend,
    )
    if args.attention_backend == "triton" and device.type == "cuda":
        kernels.warm_up(
            config.n_head, config.head_dim, args.block_size, args.torch_dtype, device, kv_cache.cache_dtype
        )
    spec = args.speculative
    runner = ModelRunner(
        model,
        None,  # no tokenizer, no block manager: rank 0 schedules and samples
        device,
        kv_cache,
        None,
        args.attention_backend,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        scratch_block=args.num_kv_blocks,
        num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
        enable_chunked_prefill=args.enable_chunked_prefill,
        tp=tp,
        fused_max_batch=args.fused_max_batch,
    )
    try:
        with torch.inference_mode():
            for rows in (1, args.max_num_seqs):  # rank 0 times them (engine.py): in step
                time_all_reduce(tp, rows, model.config.n_embd, args.torch_dtype, device)
            runner.follow()
    except RuntimeError as e:  # a collective failed: rank 0 or another worker is gone (one line, not a trace)
        print(f"tensor-parallel rank {rank}: the group failed: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{__package__}.worker")
    parser.add_argument("--rank", type=int, required=True, help="this worker's rank (1 .. t - 1)")
    parser.add_argument("--store", required=True, help="HOST:PORT of rank 0's store")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--ready-fd", type=int, required=True, help="where to say 'loaded' (or the error)")
    parser.add_argument("--engine-args", required=True, help="EngineArgs' arguments, as JSON")
    args = parser.parse_args(argv)
    watch_parent(args.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: rank 0 decides
    status = run_worker(args.rank, args.store, json.loads(args.engine_args), args.ready_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    # without the interpreter's teardown: under load, torch.distributed's C++ threads, torn down with it,
    # can abort the process ("terminate called without an active exception") after its work is done
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())

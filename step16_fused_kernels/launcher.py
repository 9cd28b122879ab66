"""The processes of a server (vLLM's ``CoreEngineProcManager`` and ``APIServerProcessManager``): the sockets'
addresses (``ipc://`` in a private directory, or ``tcp://`` for cores on other machines), the engine cores
and the coordinator started, watched and stopped (``EngineCoreProcs``), and the two supervisors of the
command line: ``Launcher`` (N frontends on one listening socket, M cores, one port) and ``Headless`` (cores
only, connecting to another machine's frontends). Every child runs in a session of its own and exits when
its parent dies; nothing is left behind: no process, no socket file, no metrics file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from .config import EngineArgs
from .messages import EngineCoreDead, output_encoder

SHUTDOWN_TIMEOUT_S = 5.0  # how long a SIGTERM'd child may take to stop before it is killed
SIGNALS = {"SIGINT", "SIGTERM"}  # the signals that stop a server, by name


def how_it_ended(status: int) -> str:
    """A child's exit status in words: "exited with status 1", "killed by SIGKILL"."""
    return f"killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"


def core_args(args: EngineArgs, engine: int = 0) -> str:
    """``args`` as JSON, for core ``engine``'s process to make them again as this process resolved them:
    the model as its snapshot folder (no second lookup), the pool as its number of blocks, its device
    (``core_device``), one core."""
    given = {arg.name: getattr(args, arg.name) for arg in dataclasses.fields(args) if arg.init}
    return json.dumps(
        {
            **given,
            "model": str(args.folder),
            "kv_cache_memory": None,
            "device": args.core_device(engine),
            "data_parallel_size": 1,
        }
    )


class Addresses:
    """The sockets of one server: client c binds ``input(c, e)`` (its PUSH to core e) and ``output(c)`` (its
    PULL from every core); the coordinator binds ``loads`` and ``publish``. ``ipc://`` files in
    ``socket_dir`` (private: mode 0700), or, with ``tcp=(host, port)`` (cores on other machines:
    ``--headless``), ports from ``port`` on: client c's output at ``port + c * (M + 1)``, its inputs after
    it, then the coordinator's two, for ``num_clients`` clients and ``num_engines`` cores (M)."""

    def __init__(
        self,
        socket_dir: str,
        tcp: tuple[str, int] | None = None,
        num_clients: int = 1,
        num_engines: int = 1,
    ):
        self.socket_dir, self.tcp = socket_dir, tcp
        self.num_clients, self.num_engines = num_clients, num_engines

    def _at(self, name: str, offset: int) -> str:
        if self.tcp is None:
            return f"ipc://{os.path.join(self.socket_dir, name)}"
        host, port = self.tcp
        return f"tcp://{f'[{host}]' if ':' in host else host}:{port + offset}"

    def input(self, client: int, engine: int) -> str:
        return self._at(f"input-{client}-{engine}", client * (self.num_engines + 1) + 1 + engine)

    def output(self, client: int) -> str:
        return self._at(f"output-{client}", client * (self.num_engines + 1))

    @property
    def loads(self) -> str:
        return self._at("loads", self.num_clients * (self.num_engines + 1))

    @property
    def publish(self) -> str:
        return self._at("publish", self.num_clients * (self.num_engines + 1) + 1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each process, then SIGKILL to those still running after ``SHUTDOWN_TIMEOUT_S``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tell_dead(addresses: list[str], message: str) -> None:
    """Send ``EngineCoreDead(message)`` to the frontends reading ``addresses``, for a core that died without
    a word; a frontend gone meanwhile is skipped."""
    context = zmq.Context()
    frame = output_encoder().encode(EngineCoreDead("EngineDeadError", message))
    for address in addresses:
        wake = context.socket(zmq.PUSH)
        try:
            wake.connect(address)
            wake.send(frame)
        except zmq.ZMQError:  # shut down meanwhile: nobody is waiting
            pass
        wake.close(linger=1000)
    context.term()


def addresses_for(args: argparse.Namespace, socket_dir: str) -> Addresses:
    """The sockets of a server of these flags: TCP when some cores run on other machines, else ipc."""
    tcp = None
    if args.headless or args.data_parallel_size_local < args.data_parallel_size:
        tcp = (args.data_parallel_address, args.data_parallel_rpc_port)
    return Addresses(socket_dir, tcp, args.api_server_count, args.data_parallel_size)


class EngineCoreProcs:
    """The engine core processes of ``engine_args`` (``data_parallel_size``; core e on
    ``core_device(e)``) for ``num_clients`` frontends, and the coordinator (coordinator.py) if there are
    several frontends, each in a session of its own (a terminal's Ctrl-C reaches the frontends only), each
    exiting when this process dies. ``watch(on_death)`` calls ``on_death(message)`` from a thread when one
    exits unasked; ``shutdown`` stops them all (SIGTERM, then SIGKILL). Raises nothing itself: a core that
    fails to start says why to the frontends."""

    # what a child runs (python -c; not -m: the package, imported first, would import the module twice)
    entry = "import sys; from {package}.{module} import main; sys.exit(main())"

    def __init__(
        self,
        engine_args: EngineArgs,
        num_clients: int,
        addresses: Addresses,
        ranks: range | None = None,
    ):
        a, cores = addresses, engine_args.data_parallel_size
        ranks = range(cores) if ranks is None else ranks  # the cores this machine runs (--headless: some)
        self.closing = threading.Event()  # shutdown asked for: an exit is no death
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        root = str(Path(__file__).resolve().parent.parent)  # the folder holding this package and common/
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        common = ["--parent-pid", str(os.getpid()), "--socket-dir", a.socket_dir]
        try:
            if num_clients > 1 and 0 in ranks:  # the coordinator lives with the frontends and core 0
                argv = [*common, "--loads", a.loads, "--publish", a.publish, "--engines", str(cores)]
                self._start("coordinator", "coordinator", argv)
            for local, engine in enumerate(ranks):  # on this machine's devices from cuda:0 (a bare cuda)
                argv = [
                    *common,
                    "--engine-args",
                    core_args(engine_args, local),
                    "--engine-index",
                    str(engine),
                ]
                for client in range(num_clients):
                    argv += ["--input", a.input(client, engine), "--output", a.output(client)]
                if num_clients > 1:
                    argv += ["--coordinator", a.loads]
                self._start("engine core" if cores == 1 else f"engine core {engine}", "engine_core", argv)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, name: str, module: str, argv: list[str]) -> None:
        code = self.entry.format(package=__package__, module=module)
        self.procs.append(
            subprocess.Popen([sys.executable, "-c", code, *argv], env=self.env, start_new_session=True)
        )
        self.names.append(name)

    def exited(self) -> str | None:
        """How the first process to have exited did, or None while all run."""
        for proc, name in zip(self.procs, self.names):
            if proc.poll() is not None:
                return f"the {name} process exited with status {proc.returncode}"
        return None

    def watch(self, on_death: Callable[[str], None]) -> None:
        """A daemon thread per process: if it exits and shutdown did not ask for it, ``on_death`` (once)."""
        told = threading.Lock()

        def wait(proc: subprocess.Popen, name: str) -> None:
            status = proc.wait()
            if self.closing.is_set() or not told.acquire(blocking=False):
                return
            on_death(f"the {name} process (pid {proc.pid}) {how_it_ended(status)}")

        for proc, name in zip(self.procs, self.names):
            threading.Thread(target=wait, args=(proc, name), name=f"{name} monitor", daemon=True).start()

    def shutdown(self) -> None:
        self.closing.set()
        _stop(self.procs)


class Supervisor:
    """What ``Launcher`` and ``Headless`` share: the reasons to stop, in order (a signal's name, or a
    death in words), SIGINT and SIGTERM taken as such while ``signals()`` holds, and ``wait`` for the
    first reason."""

    def __init__(self):
        self.events: list[str] = []
        self.wake = threading.Event()

    def stop_on(self, why: str) -> None:
        self.events.append(why)
        self.wake.set()

    @contextlib.contextmanager
    def signals(self):
        previous = {
            s: signal.signal(s, lambda n, f: self.stop_on(signal.Signals(n).name))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def wait(self) -> str:
        """The first reason to stop, once there is one (a signal interrupts the wait every 0.5 s)."""
        while not self.wake.wait(0.5):
            pass
        return self.events[0]


class Launcher(Supervisor):
    """Several frontends (``--api-server-count N``): this process binds the port once, starts the engine
    cores and the coordinator (``EngineCoreProcs``) and N frontend processes that inherit the listening
    socket (the kernel hands each connection to one of them: no port race, vllm #40443), prints the URL
    once every frontend is ready, and watches them all: a core that dies is told to every frontend (its
    streams end with an error event, ``/health`` 503, it exits 1); a frontend that exits stops the rest;
    SIGINT or SIGTERM is passed to the frontends (each ends its streams after the grace period), then the
    cores stop. Exit status: 0 after a signal (130 after two), 1 if a core or frontend died, 2 if one failed
    to start. Prometheus's multiprocess directory and the socket directory are removed at exit. announce:
    ``__main__.announce``, called with the start-up lines' figures once every frontend is ready."""

    def __init__(self, args: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket, announce):
        super().__init__()
        self.args, self.engine_args, self.sock, self.announce = args, engine_args, sock, announce
        self.count = args.api_server_count
        self.socket_dir = tempfile.mkdtemp(prefix="engine-core-")  # mode 0700
        self.metrics_dir = tempfile.mkdtemp(prefix="metrics-")
        self.frontends: list[subprocess.Popen] = []
        self.procs: EngineCoreProcs | None = None
        self.death: str | None = None  # a core's or the coordinator's death, as its monitor said

    def run(self) -> int:
        try:
            with self.signals():
                return self._run()
        finally:
            for proc in self.frontends:  # those still running after the grace period
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            if self.procs is not None:
                self.procs.shutdown()
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _run(self) -> int:
        a = addresses_for(self.args, self.socket_dir)
        self.procs = EngineCoreProcs(
            self.engine_args, self.count, a, range(self.args.data_parallel_size_local)
        )
        self.outputs = [a.output(j) for j in range(self.count)]
        if a.tcp is not None:
            remote = self.args.data_parallel_size - self.args.data_parallel_size_local
            print(f"waiting for {remote} headless engine core(s) to connect to {a.output(0)} ...", flush=True)
        self.procs.watch(self.core_died)  # the frontends end their streams, then exit 1
        ready_r, ready_w = os.pipe()
        fd = self.sock.fileno()
        env = {**self.procs.env, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        code = f"import sys; from {__package__}.__main__ import frontend_main; sys.exit(frontend_main())"
        for j in range(self.count):
            hidden = ["--frontend", f"{j},{self.count},{self.engine_args.data_parallel_size}"]
            hidden += ["--frontend-fds", f"{fd},{ready_w}", "--socket-dir", self.socket_dir]
            self.frontends.append(
                subprocess.Popen(
                    [sys.executable, "-c", code, *sys.argv[1:], *hidden],
                    env=env,
                    pass_fds=(fd, ready_w),
                    start_new_session=True,
                )
            )
        os.close(ready_w)
        for j, proc in enumerate(self.frontends):
            threading.Thread(target=self._watch, args=(j, proc), daemon=True).start()
        ready = 0
        while ready < self.count and not self.events:  # each frontend writes one byte once it serves
            if select.select([ready_r], [], [], 0.1)[0]:
                chunk = os.read(ready_r, self.count)
                if not chunk:  # EOF: every frontend is gone (its watch thread says how)
                    self.wake.wait()
                ready += len(chunk)
        os.close(ready_r)
        if ready == self.count and not self.events:
            features = {"data_parallel_size": self.engine_args.data_parallel_size, "api_servers": self.count}
            cores = [p.pid for p, name in zip(self.procs.procs, self.procs.names) if name != "coordinator"]
            self.announce(self.args, self.sock, features, cores, self.socket_dir)
            print(f"api servers: pid {', '.join(str(p.pid) for p in self.frontends)}", flush=True)
        why = self.wait()
        forwarded, deadline = 0, time.monotonic() + self.args.timeout_graceful_shutdown + 10
        while any(p.poll() is None for p in self.frontends) and time.monotonic() < deadline:
            received = sum(e in SIGNALS for e in self.events)
            while forwarded < max(received, 1):  # each ends its streams (a second signal: at once)
                for proc in self.frontends:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                forwarded += 1
            time.sleep(0.05)
        if why in SIGNALS:
            return 130 if sum(e in SIGNALS for e in self.events) > 1 else 0
        if ready < self.count and any(p.poll() == 2 for p in self.frontends):
            return 2  # a frontend could not start: it said why
        print(f"error: {self.death or why}; the server stops (exit status 1)", file=sys.stderr, flush=True)
        return 1

    def core_died(self, message: str) -> None:
        """A monitor's word (a thread): tell every frontend, which ends its streams and exits 1."""
        self.death = message
        tell_dead(self.outputs, message)

    def _watch(self, j: int, proc: subprocess.Popen) -> None:
        status = proc.wait()
        if not self.events:
            self.stop_on(f"API server {j} (pid {proc.pid}) {how_it_ended(status)}")


class Headless(Supervisor):
    """``--headless``: run engine cores only (``--data-parallel-size-local`` of them from
    ``--data-parallel-start-rank``), which connect over TCP to the frontends at ``--data-parallel-address``
    (the same ``--api-server-count``, ``--data-parallel-size`` and port as theirs). First checks that the
    frontends' first port answers, for at most ``--data-parallel-connect-timeout`` seconds (else one line,
    exit 1); then runs until a signal (exit 0) or a core's exit (exit 1)."""

    def __init__(self, args: argparse.Namespace, engine_args: EngineArgs):
        super().__init__()
        self.args, self.engine_args = args, engine_args
        self.socket_dir = tempfile.mkdtemp(prefix="engine-core-")
        self.procs: EngineCoreProcs | None = None

    def run(self) -> int:
        try:
            with self.signals():
                return self._run()
        finally:
            if self.procs is not None:
                self.procs.shutdown()
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _run(self) -> int:
        a = addresses_for(self.args, self.socket_dir)
        if not self.reach(a.output(0)):
            return 1
        start = self.args.data_parallel_start_rank
        ranks = range(start, start + self.args.data_parallel_size_local)
        self.procs = EngineCoreProcs(self.engine_args, self.args.api_server_count, a, ranks)
        self.procs.watch(self.stop_on)
        pids = ", ".join(str(p.pid) for p in self.procs.procs)
        print(f"headless: engine cores {list(ranks)} (pid {pids}) serving the frontends at {a.output(0)}")
        why = self.wait()
        if why in SIGNALS:
            return 0
        print(f"error: {why}", file=sys.stderr, flush=True)
        return 1

    def reach(self, address: str) -> bool:
        """Whether the frontends' first TCP port accepts a connection within the timeout (tried every
        0.2 s); if not, says so in one line."""
        host, port = address[len("tcp://") :].rsplit(":", 1)
        timeout = self.args.data_parallel_connect_timeout
        deadline, error = time.monotonic() + timeout, None
        while time.monotonic() < deadline and not self.events:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
                return True
            except OSError as e:
                error = e.strerror or str(e)
                time.sleep(0.2)
        print(f"error: no frontend answered at {address} within {timeout:g} s ({error})", file=sys.stderr)
        return False

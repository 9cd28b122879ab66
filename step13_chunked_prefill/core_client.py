"""The frontend's side of the engine core: start it, send it requests and aborts, read its outputs, notice at
once when it dies (vLLM's ``EngineCoreClient``): ``InprocClient`` (the core in this process, called
directly: ``LLM`` on a CPU), ``SyncMPClient`` (in a child process, for ``LLM``), ``AsyncMPClient`` (the same
for the server's event loop, zmq.asyncio). Starting: two ``ipc://`` sockets in a private directory
(``mkdtemp``: mode 0700), the child in a session of its own with the engine's arguments as JSON, its
``EngineCoreReady`` awaited (its start-up error raised here). The client is dead from the core's last word
(``EngineCoreDead``), a send it cannot take (its socket closed), or the monitor thread, which waits on the
child: a death nobody asked for (``kill -9``) wakes the reader with an ``EngineCoreDead`` (vllm #21728).
``shutdown`` (also at exit) stops the child (SIGTERM, then SIGKILL) and removes the directory. The MP
clients are not thread-safe: one thread (or event loop) uses each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import zmq
import zmq.asyncio

from .config import EngineArgs
from .engine_core import EngineCore
from .messages import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    input_encoder,
    output_decoder,
    output_encoder,
)

SHUTDOWN_TIMEOUT_S = 5.0  # how long a SIGTERM'd core may take to stop before it is killed
STARTUP_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "ConnectionError": ConnectionError}


def core_args(args: EngineArgs) -> str:
    """``args`` as JSON, for the core process to make them again as this process resolved them: the model
    as its snapshot folder (no second lookup), the pool as its number of blocks."""
    given = {arg.name: getattr(args, arg.name) for arg in dataclasses.fields(args) if arg.init}
    return json.dumps({**given, "model": str(args.folder), "kv_cache_memory": None})


class EngineDeadError(RuntimeError):
    """The engine core has died (killed, crashed, a step raised) or was shut down: no request is served."""


class EngineCoreClient:
    """What the frontend calls (the clients below): config, add_request, abort_request, get_output,
    shutdown, alive."""

    config: EngineCoreReady

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The engine core in this process (vLLM's ``InprocClient``): every call is a direct call, and
    ``get_output`` runs one engine step. ``core.engine`` is the ``LLMEngine``. Raises what ``LLMEngine``
    raises."""

    def __init__(self, engine_args: EngineArgs):
        self.core = EngineCore(engine_args)
        self.config = self.core.ready()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request, checked=True)  # by this process's Processor, with the core's limits

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        self.core.abort_request(EngineCoreAbort(request_id, index))

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def shutdown(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return True


class BackgroundResources:
    """What the monitor thread, the finalizer and the client share (vLLM's name; never the client itself,
    so that a client nobody holds is collected and its process stopped): the child, the sockets, the socket
    directory, whether shutdown was asked for, and why the core is dead (None while it lives)."""

    def __init__(self, proc: subprocess.Popen, context: zmq.Context, sockets: list, socket_dir: str):
        self.proc, self.context, self.sockets, self.socket_dir = proc, context, sockets, socket_dir
        self.closing = threading.Event()  # shutdown asked for: the child's exit is no death
        self.dead: EngineDeadError | None = None


def _shutdown(resources: BackgroundResources) -> None:
    """Stop the child (SIGTERM, then SIGKILL), close the sockets, remove the directory. Idempotent."""
    resources.closing.set()
    proc = resources.proc
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sock in resources.sockets:
        sock.close(linger=0)
    resources.context.term()
    shutil.rmtree(resources.socket_dir, ignore_errors=True)


def _monitor(resources: BackgroundResources, output_address: str) -> None:
    """The monitor thread: wait for the child to exit; unless shutdown asked for it, mark the client dead
    and wake the output socket's reader with an ``EngineCoreDead``."""
    status = resources.proc.wait()
    if resources.closing.is_set():
        return
    how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
    if resources.dead is None:  # else a failed send found it first, or the core's last word was read
        resources.dead = EngineDeadError(f"the engine core process (pid {resources.proc.pid}) {how}")
    try:
        wake = resources.context.socket(zmq.PUSH)
        wake.connect(output_address)
        wake.send(output_encoder().encode(EngineCoreDead("EngineDeadError", str(resources.dead))))
        wake.close(linger=1000)
    except zmq.ZMQError:  # shut down meanwhile: nobody is waiting
        pass


class MPClient(EngineCoreClient):
    """The engine core in a child process (vLLM's ``MPClient``), started here; see the module's docstring.

    engine_args: the engine's ``EngineArgs``, checked here already. Raises, if the core fails to start,
    its own error: ValueError (a pool too large for the device), ConnectionError (a Hub model out of
    reach); RuntimeError if it exits without a word.
    """

    # what the child runs (python -c; not -m: the package, imported first, would import the module twice)
    entry = "import sys; from {package}.engine_core import main; sys.exit(main())"

    def __init__(self, engine_args: EngineArgs):
        self.socket_dir = tempfile.mkdtemp(prefix="engine-core-")  # mode 0700: this user's only
        self.input_address = f"ipc://{os.path.join(self.socket_dir, 'input')}"
        self.output_address = f"ipc://{os.path.join(self.socket_dir, 'output')}"
        context = zmq.Context()
        self.input = context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # queue, never block or drop
        self.input.bind(self.input_address)
        self.output = context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.bind(self.output_address)
        self.encoder, self.decoder = input_encoder(), output_decoder()
        self._resources = BackgroundResources(None, context, [self.input, self.output], self.socket_dir)
        self._finalizer = weakref.finalize(self, _shutdown, self._resources)
        root = str(Path(__file__).resolve().parent.parent)  # the folder holding this package and common/
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        try:
            self._resources.proc = self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    self.entry.format(package=__package__),
                    "--input",
                    self.input_address,
                    "--output",
                    self.output_address,
                    "--parent-pid",
                    str(os.getpid()),
                    "--socket-dir",
                    self.socket_dir,
                    "--engine-args",
                    core_args(engine_args),
                ],
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the frontend only; it stops the core
            )
            self.config = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(
            target=_monitor,
            args=(self._resources, self.output_address),
            name="engine-core-monitor",
            daemon=True,
        ).start()

    def _wait_ready(self) -> EngineCoreReady:
        """The core's ``EngineCoreReady``; raises its startup error (see the class's docstring)."""
        while True:
            if self.output.poll(100):
                message = self.decoder.decode(self.output.recv())
                if isinstance(message, EngineCoreReady):
                    return message
                if isinstance(message, EngineCoreDead):
                    self.proc.wait(SHUTDOWN_TIMEOUT_S)  # it exits after its last word
                    kind = STARTUP_ERRORS.get(message.error_type)
                    if kind is not None:
                        raise kind(message.message)
                    raise RuntimeError(
                        f"the engine core failed to start: {message.error_type}: {message.message}"
                    )
            elif self.proc.poll() is not None and not self.output.poll(
                1000
            ):  # its last word may be on its way
                raise RuntimeError(
                    f"the engine core process exited with status {self.proc.returncode} before it was ready"
                )

    @property
    def alive(self) -> bool:
        return self._resources.dead is None and not self._resources.closing.is_set()

    @property
    def dead_error(self) -> EngineDeadError:
        return self._resources.dead or EngineDeadError("the engine core was shut down")

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead core holds nothing to abort
            self._send(EngineCoreAbort(request_id, index))

    def _send(self, message) -> None:
        """Queue ``message`` for the core; raises EngineDeadError if it is dead, or if it cannot take the
        message: its input socket has closed (``zmq.Again``: a stopping core closes it before it exits)."""
        if not self.alive:
            raise self.dead_error
        try:
            self.input.send(self.encoder.encode(message), zmq.NOBLOCK, copy=False)  # no HWM: never blocks
        except zmq.ZMQError as e:
            if self._resources.dead is None:
                self._resources.dead = EngineDeadError(
                    f"the engine core process (pid {self.proc.pid}) takes no more requests ({e})"
                )
            raise self._resources.dead from None

    def _received(self, frame) -> EngineCoreOutputs:
        """The outputs of one message; raises EngineDeadError on the core's last word (or the monitor's)."""
        message = self.decoder.decode(frame)
        if isinstance(message, EngineCoreOutputs):
            return message
        if isinstance(message, EngineCoreDead):  # the core's last word says best why (or the monitor's)
            self._resources.dead = EngineDeadError(message.message)
            raise self._resources.dead
        raise RuntimeError(f"unexpected message from the engine core: {type(message).__name__}")

    def shutdown(self) -> None:
        """Stop the core process and remove its sockets (at most ``SHUTDOWN_TIMEOUT_S`` plus a kill)."""
        self._finalizer()


class SyncMPClient(MPClient):
    """The core in a child process, for ``LLM``: ``get_output`` blocks until the next step's message."""

    def get_output(self) -> EngineCoreOutputs:
        if not self.alive:
            raise self.dead_error
        return self._received(self.output.recv())


class AsyncMPClient(MPClient):
    """The core in a child process, for the server's event loop: ``await get_output_async()``. Start it
    (which waits for the core to load) before the event loop runs; use it from the loop's thread."""

    _async_output: zmq.asyncio.Socket | None = None

    async def get_output_async(self) -> EngineCoreOutputs:
        if not self.alive:
            raise self.dead_error
        if self._async_output is None:  # the output socket, seen from the running event loop
            self._async_output = zmq.asyncio.Socket.from_socket(self.output)
            self._resources.sockets.insert(0, self._async_output)
        return self._received(await self._async_output.recv(copy=False))

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        """The next step's outputs if they have arrived already, else None."""
        try:
            frame = self.output.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._received(frame)

"""The frontend's side of the engine cores: start them, send them requests and aborts, read their outputs,
notice at once when one dies (vLLM's ``EngineCoreClient``): ``InprocClient`` (one core in this process,
called directly: ``LLM`` on a CPU), ``SyncMPClient`` (in child processes, for ``LLM``), ``AsyncMPClient``
(the same for the server's event loop, zmq.asyncio). A client that starts its cores does so with
``launcher.EngineCoreProcs``. It binds one PUSH socket per core and one PULL for every core's outputs
(``ipc://`` in a private directory: ``mkdtemp``, mode 0700), awaits each core's ``EngineCoreReady``, and
sends each new request to the core with the lowest ``waiting * 4 + running``. A client is dead from a
core's last word (``EngineCoreDead``), a send it cannot take, or a monitor's word that a core died unasked
(``kill -9``; vllm #21728). The MP clients are not thread-safe.
"""

from __future__ import annotations

import collections
import functools
import shutil
import tempfile
import threading
import weakref

import zmq
import zmq.asyncio

from .config import EngineArgs
from .engine_core import EngineCore
from .launcher import Addresses, EngineCoreProcs, tell_dead
from .messages import (
    EngineCoreAbort,
    EngineCoreDead,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    SchedulerStats,
    input_encoder,
    loads_decoder,
    output_decoder,
)

PREFIX_SLACK = 4 * 8  # --dp-routing prefix: a core's score may exceed the lowest by this (8 waiting)
PREFIX_ROUTES = 1 << 16  # --dp-routing prefix: the first blocks remembered (the oldest forgotten first)
STARTUP_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "ConnectionError": ConnectionError}


class EngineDeadError(RuntimeError):
    """The engine core has died (killed, crashed, a step raised) or was shut down: no request is served."""


class EngineCoreClient:
    """What the frontend calls (the clients below): config, add_request, abort_request, get_output,
    shutdown, alive."""

    config: EngineCoreReady  # core 0's; configs: every core's, by index
    configs: list[EngineCoreReady]

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send a request to a core; returns the core's index."""
        raise NotImplementedError

    def abort_request(self, request_id: str, index: int | None = None) -> int | None:
        """Abort a request in its core; returns the core's index, or None if nothing was sent."""
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
        self.configs = [self.config]

    def add_request(self, request: EngineCoreRequest) -> int:
        self.core.add_request(request, checked=True)  # by this process's Processor, with the core's limits
        return 0

    def abort_request(self, request_id: str, index: int | None = None) -> int | None:
        self.core.abort_request(EngineCoreAbort(request_id, index))
        return 0

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def shutdown(self) -> None:
        self.core.engine.shutdown()  # its tensor-parallel workers, if any

    @property
    def alive(self) -> bool:
        return True


def _bind(sock: zmq.Socket, address: str) -> None:
    """``sock.bind(address)``; raises OSError naming the address (a TCP port in use, or not a port)."""
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind {address}: {e.strerror}") from None


class BackgroundResources:
    """What the monitor threads, the finalizer and the client share (vLLM's name; never the client itself,
    so that a client nobody holds is collected and its processes stopped): the processes it started (or
    None), the sockets, the socket directory it owns (or None), whether shutdown was asked for, and why the
    cores are dead (None while they live)."""

    def __init__(self, context: zmq.Context, sockets: list, socket_dir: str | None):
        self.procs: EngineCoreProcs | None = None
        self.context, self.sockets, self.socket_dir = context, sockets, socket_dir
        self.closing = threading.Event()  # shutdown asked for: the children's exit is no death
        self.dead: EngineDeadError | None = None


def _shutdown(resources: BackgroundResources) -> None:
    """Stop the children (SIGTERM, then SIGKILL), close the sockets, remove the directory. Idempotent."""
    resources.closing.set()
    if resources.procs is not None:
        resources.procs.shutdown()
    for sock in resources.sockets:
        sock.close(linger=0)
    resources.context.term()
    if resources.socket_dir is not None:
        shutil.rmtree(resources.socket_dir, ignore_errors=True)


def _on_death(resources: BackgroundResources, output_address: str, message: str) -> None:
    """A monitor's word: unless shutdown asked for it, mark the client dead and wake its reader."""
    if resources.closing.is_set():
        return
    if resources.dead is None:  # else a failed send found it first, or the core's last word was read
        resources.dead = EngineDeadError(message)
    tell_dead([output_address], str(resources.dead))


class MPClient(EngineCoreClient):
    """The engine cores in child processes (vLLM's ``MPClient``); see the module's docstring.

    engine_args: the engine's ``EngineArgs``, checked here already: this client starts the cores itself
    (one frontend), in a directory of its own. None: the server's launcher started ``num_engines`` cores
    for ``num_clients`` frontends at ``addresses`` and watches them; this one is ``client_index``, routing
    by ``dp_routing`` (``EngineArgs.dp_routing``). Raises,
    if a core fails to start, its own error: ValueError (a pool too large for the device), ConnectionError
    (a Hub model out of reach); RuntimeError if one exits without a word.
    """

    def __init__(
        self,
        engine_args: EngineArgs | None,
        client_index: int = 0,
        num_clients: int = 1,
        addresses: Addresses | None = None,
        num_engines: int = 1,
        dp_routing: str = "load",
    ):
        owner = engine_args is not None
        self.socket_dir = tempfile.mkdtemp(prefix="engine-core-") if owner else addresses.socket_dir  # 0700
        a = addresses or Addresses(self.socket_dir)
        self.client_index = client_index
        self.num_engines = engine_args.data_parallel_size if owner else num_engines
        context = zmq.Context()
        self.inputs = []  # by engine
        for engine in range(self.num_engines):
            self.inputs.append(context.socket(zmq.PUSH))
            self.inputs[-1].setsockopt(zmq.SNDHWM, 0)  # queue, never block or drop
        self.output = context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        try:
            for engine, sock in enumerate(self.inputs):
                _bind(sock, a.input(client_index, engine))
            _bind(self.output, a.output(client_index))
        except OSError:
            for sock in [*self.inputs, self.output]:
                sock.close(linger=0)
            context.term()
            raise
        self.output_address = a.output(client_index)
        self.loads = None  # the coordinator's publications (several frontends)
        if num_clients > 1:
            self.loads = context.socket(zmq.SUB)
            self.loads.setsockopt(zmq.SUBSCRIBE, b"")
            self.loads.connect(a.publish)
        self.encoder, self.decoder, self.loads_decoder = input_encoder(), output_decoder(), loads_decoder()
        sockets = [*self.inputs, self.output, *([self.loads] if self.loads is not None else [])]
        self._resources = BackgroundResources(context, sockets, self.socket_dir if owner else None)
        self._finalizer = weakref.finalize(self, _shutdown, self._resources)
        # what routing knows, by engine: its last stats heard (from its messages or the coordinator), the
        # requests sent to it and, as it last said, taken; aborts sent to it; by request: [engine, choices
        # unfinished]
        self.stats_of: list[SchedulerStats | None] = [None] * self.num_engines
        self.sent, self.taken = [0] * self.num_engines, [0] * self.num_engines
        self.engine_of: dict[str, list[int]] = {}
        routing = engine_args.dp_routing if owner else dp_routing
        self.prefix_routing = self.num_engines > 1 and routing == "prefix"
        self.first_blocks: collections.OrderedDict[tuple[int, ...], int] = collections.OrderedDict()
        self.procs = None
        try:
            if owner:
                self._resources.procs = self.procs = EngineCoreProcs(engine_args, 1, a)
            self.configs = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.config = self.configs[0]
        self.stats_of = [c.stats for c in self.configs]
        if owner:
            self.procs.watch(functools.partial(_on_death, self._resources, self.output_address))

    def _wait_ready(self) -> list[EngineCoreReady]:
        """Every core's ``EngineCoreReady``, by index; raises a core's startup error (see the class)."""
        ready: list[EngineCoreReady | None] = [None] * self.num_engines
        while None in ready:
            if self.output.poll(100):
                message = self.decoder.decode(self.output.recv())
                if isinstance(message, EngineCoreReady):
                    ready[message.engine_index] = message
                elif isinstance(message, EngineCoreDead):
                    kind = STARTUP_ERRORS.get(message.error_type)
                    if kind is not None and message.during_startup:
                        raise kind(message.message)
                    raise RuntimeError(
                        f"the engine core failed to start: {message.error_type}: {message.message}"
                    )
            elif self.procs is not None and (exited := self.procs.exited()) and not self.output.poll(1000):
                raise RuntimeError(f"{exited} before it was ready")  # its last word may be on its way
        return ready

    @property
    def pids(self) -> list[int]:
        """The engine cores' process ids, by index."""
        return [c.pid for c in self.configs]

    @property
    def alive(self) -> bool:
        return self._resources.dead is None and not self._resources.closing.is_set()

    @property
    def dead_error(self) -> EngineDeadError:
        return self._resources.dead or EngineDeadError("the engine core was shut down")

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send ``request`` to the least loaded core (``choose_engine``); returns its index."""
        engine = self.choose_engine(request.prompt_token_ids) if self.num_engines > 1 else 0
        request.client_index = self.client_index
        self._send(engine, request)
        self.sent[engine] += 1
        if self.num_engines > 1:
            self.engine_of[request.request_id] = [engine, request.sampling_params.n]
        return engine

    def choose_engine(self, prompt_token_ids: list[int] = ()) -> int:
        """The core with the lowest ``waiting * 4 + running`` (vLLM's ``DPLBAsyncMPClient``), counting as
        waiting the requests sent to it that it had not taken when it last said; ties: the lowest index.
        With prefix routing, the core that last took a prompt of the same first full block, unless its
        score is over the lowest by more than ``PREFIX_SLACK``."""
        self.read_loads()

        def score(engine: int) -> int:
            s, in_transit = self.stats_of[engine], self.sent[engine] - self.taken[engine]
            return 4 * (s.num_waiting_reqs + in_transit) + s.num_running_reqs

        best = min(range(self.num_engines), key=score)
        block = self.config.block_size
        if not self.prefix_routing or len(prompt_token_ids) < block:
            return best
        key = tuple(prompt_token_ids[:block])
        seen = self.first_blocks.pop(key, None)
        if seen is not None and score(seen) <= score(best) + PREFIX_SLACK:
            best = seen
        self.first_blocks[key] = best  # the newest last: the oldest is forgotten first
        if len(self.first_blocks) > PREFIX_ROUTES:
            self.first_blocks.popitem(last=False)
        return best

    def read_loads(self) -> None:
        """Take the coordinator's publications that have arrived (several frontends): each core's stats,
        where newer than those heard from its own messages."""
        if self.loads is None:
            return
        while True:
            try:
                published = self.loads_decoder.decode(self.loads.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            for engine, stats in enumerate(published.stats):
                if stats is not None and stats.num_steps >= self.stats_of[engine].num_steps:
                    self.stats_of[engine] = stats

    def abort_request(self, request_id: str, index: int | None = None) -> int | None:
        """Abort a request in the core that holds it; returns that core's index, or None if nothing was
        sent (every choice had finished, or the cores are dead)."""
        engine = 0
        if self.num_engines > 1:
            if (entry := self.engine_of.get(request_id)) is None:
                return None
            engine = entry[0]
        try:
            self._send(engine, EngineCoreAbort(request_id, index, self.client_index))
        except EngineDeadError:  # a dead core holds nothing to abort
            return None
        return engine

    def _send(self, engine: int, message) -> None:
        """Queue ``message`` for core ``engine``; raises EngineDeadError if the cores are dead, or if it
        cannot take the message: its input socket has closed (``zmq.Again``: a stopping core closes it
        before it exits)."""
        if not self.alive:
            raise self.dead_error
        try:
            self.inputs[engine].send(self.encoder.encode(message), zmq.NOBLOCK, copy=False)  # never blocks
        except zmq.ZMQError as e:
            if self._resources.dead is None:
                self._resources.dead = EngineDeadError(
                    f"the engine core process (pid {self.pids[engine]}) takes no more requests ({e})"
                )
            raise self._resources.dead from None

    def _received(self, frame) -> EngineCoreOutputs:
        """The outputs of one message; raises EngineDeadError on a core's last word (or a monitor's)."""
        message = self.decoder.decode(frame)
        if isinstance(message, EngineCoreOutputs):
            engine = message.engine_index
            self.stats_of[engine], self.taken[engine] = message.stats, message.num_received
            if self.num_engines > 1:  # forget the requests whose every choice has finished
                for out in message.outputs:
                    if out.finish_reason is not None and (entry := self.engine_of.get(out.request_id)):
                        entry[1] -= 1
                        if entry[1] <= 0 or out.error is not None:
                            del self.engine_of[out.request_id]
            return message
        if isinstance(message, EngineCoreDead):  # the core's last word says best why (or the monitor's)
            self._resources.dead = EngineDeadError(message.message)
            raise self._resources.dead
        raise RuntimeError(f"unexpected message from the engine core: {type(message).__name__}")

    def shutdown(self) -> None:
        """Stop the cores this client started and remove their sockets (at most
        ``launcher.SHUTDOWN_TIMEOUT_S`` plus a kill); a launched frontend closes its own sockets only."""
        self._finalizer()


class SyncMPClient(MPClient):
    """The cores in child processes, for ``LLM``: ``get_output`` blocks until a core's next step's message."""

    def get_output(self) -> EngineCoreOutputs:
        if not self.alive:
            raise self.dead_error
        return self._received(self.output.recv())


class AsyncMPClient(MPClient):
    """The cores in child processes, for the server's event loop: ``await get_output_async()``. Start it
    (which waits for the cores to load) before the event loop runs; use it from the loop's thread."""

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

"""The command line: serve the engine over HTTP with OpenAI's API, the engine cores in processes of their own.

    python -m <step> --model demo            # http://127.0.0.1:8000, the web page at /
    python -m <step> --model gpt2 --device cuda --dtype float16 --port 8080
    python -m <step> --api-server-count 4 --data-parallel-size 2   # 4 frontends, 2 cores, one port
    python -m <step> --data-parallel-size 2 --data-parallel-size-local 1 --data-parallel-address 10.0.0.1
    python -m <step> --headless --data-parallel-size 2 --data-parallel-start-rank 1 \
        --data-parallel-address 10.0.0.1                            # core 1, on another machine

Run it from the repository root; `--help` lists every option with its default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import sys
import threading
import time

try:  # torch and the web stack load here: Ctrl-C meanwhile exits quietly with 130, as later in the start-up
    import uvicorn

    from .api_server import DEFAULT_MAX_BODY_BYTES, SMALLEST_BODY, build_app
    from .async_engine import DEFAULT_MAX_WAITING_REQUESTS, AsyncEngine, ServerShuttingDown, describe_features
    from .config import EngineArgs
    from .core_client import AsyncMPClient
    from .launcher import Headless, Launcher, addresses_for
except KeyboardInterrupt:
    print(file=sys.stderr)
    sys.exit(130)

DEFAULT_GRACE_S = 2.0  # after a signal, how long open requests may take to finish before they are ended


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line on stderr, exit status 2 (argparse prints the usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default where it has one (not None)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def make_parser() -> argparse.ArgumentParser:
    """The command line's flags: the server's, then the engine's (``EngineArgs.add_cli_args``); --help
    shows each one's default."""
    parser = _Parser(
        prog=f"python -m {__package__}",
        description="Serve the engine over OpenAI's HTTP API, with a web page at /.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port)")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ requests (default: none, open)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="waiting requests beyond which new ones get 429; a request that alone makes more engine "
        "requests gets 400",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="a stream's event every N tokens of a choice, the first at once (vLLM's name; 1: every token)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="largest request body accepted"
    )
    parser.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="after Ctrl-C or SIGTERM, how long open requests may run on before each is ended with an "
        "error event",
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="frontend processes (HTTP, tokenizer, detokenizer) sharing the one listening socket (vLLM's "
        "name); each sends its requests to every engine core",
    )
    dp = parser.add_argument_group("engine cores on other machines (over TCP; vLLM's names)")
    dp.add_argument(
        "--data-parallel-size-local",
        type=int,
        default=None,
        help="engine cores this machine runs (default: all of --data-parallel-size; fewer: the others "
        "connect from other machines with --headless, over TCP)",
    )
    dp.add_argument(
        "--data-parallel-address",
        default="127.0.0.1",
        help="the frontends' machine: where they bind their TCP sockets, and where headless cores connect; "
        "anyone who can reach these ports can send requests and read outputs (step 14's README)",
    )
    dp.add_argument(
        "--data-parallel-rpc-port",
        type=int,
        default=13345,
        help="the first of the TCP ports: (M + 1) per frontend, then 2 for the coordinator",
    )
    dp.add_argument(
        "--headless", action="store_true", help="run engine cores only, connecting to the frontends"
    )
    dp.add_argument(
        "--data-parallel-start-rank", type=int, default=0, help="--headless: the first core's index"
    )
    dp.add_argument(
        "--data-parallel-connect-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--headless: how long to wait for the frontends' machine to answer before giving up",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info logs every request)",
    )
    EngineArgs.add_cli_args(parser)  # --model, --device, --dtype, ...: the engine's arguments
    return parser


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """The command line (of ``parser``, default ``make_parser()``), checked: bad flags and limits that admit
    nothing exit with status 2."""
    parser = parser or make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a TCP port (0..65535)")
    if args.max_waiting_requests < 1:  # refused here, before the model loads (the engine's: by their flags)
        parser.error(
            f"argument --max-waiting-requests: must be >= 1 ({args.max_waiting_requests} admits none)"
        )
    if args.api_server_count < 1:
        parser.error(f"argument --api-server-count: must be >= 1, not {args.api_server_count}")
    cores, start = args.data_parallel_size, args.data_parallel_start_rank
    if not args.headless and start != 0:
        parser.error(
            "argument --data-parallel-start-rank: only with --headless (the frontends run core 0 on)"
        )
    if not 0 <= start < cores:
        parser.error(
            f"argument --data-parallel-start-rank: {start} is not a core's index (0 .. {cores - 1}, as "
            f"--data-parallel-size is {cores})"
        )
    if args.data_parallel_size_local is None:
        args.data_parallel_size_local = cores - start if args.headless else cores
    local = args.data_parallel_size_local
    if not 1 <= local <= cores - start:
        parser.error(
            f"argument --data-parallel-size-local: {local} cores from index {start} are not among the "
            f"{cores} of --data-parallel-size"
        )
    last = args.data_parallel_rpc_port + args.api_server_count * (cores + 1) + 1  # the coordinator's
    if not 0 < args.data_parallel_rpc_port or last > 65535:
        parser.error(
            f"argument --data-parallel-rpc-port: {args.data_parallel_rpc_port} to {last} (for "
            f"{args.api_server_count} API server(s) and {cores} core(s)) are not all TCP ports"
        )
    if not 0 < args.data_parallel_connect_timeout < float("inf"):
        parser.error(
            f"argument --data-parallel-connect-timeout: must be > 0 seconds, not "
            f"{args.data_parallel_connect_timeout}"
        )
    if args.stream_interval < 1:
        parser.error(f"argument --stream-interval: must be >= 1, not {args.stream_interval}")
    if args.multiprocessing is False:
        parser.error("argument --no-multiprocessing: the server runs the engine core in a process of its own")
    if not args.timeout_graceful_shutdown >= 0:
        parser.error("argument --timeout-graceful-shutdown: must be >= 0 seconds")
    if args.max_body_bytes < len(SMALLEST_BODY):
        parser.error(
            f"argument --max-body-bytes: must be >= {len(SMALLEST_BODY)}, the size of the smallest "
            f"request ({SMALLEST_BODY.decode()})"
        )
    return args


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening: a client that connects after the URL is printed but
    before uvicorn accepts waits in the backlog instead of being refused. Raises OSError naming the port."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {port} on {host} is already in use: choose another with --port (0: any free port)"
            ) from None
        raise OSError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    sock.listen()  # uvicorn calls listen again with its own backlog
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with a shutdown that ends open streams cleanly, and an exit when the engine dies.

    On SIGINT or SIGTERM uvicorn stops accepting connections; open requests then have ``grace`` seconds
    to finish, after which each one still open is ended (``AsyncEngine.end_streams``): a stream with an
    OpenAI-style error event and ``data: [DONE]``, a whole answer with 503, and its engine requests are
    aborted. A second signal ends them at once. The signal is not raised again afterwards (uvicorn does,
    which turns SIGTERM into a kill): a signal is how this server is meant to stop. If the engine core
    dies, the open streams have already ended with an error event (async_engine.py), and the server stops
    at once (``engine_died``).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.signals: list[int] = []
        self.ended = 0  # open requests ended by the shutdown
        self.engine_died = False
        engine.on_dead = self.on_engine_dead

    def on_engine_dead(self) -> None:
        self.engine_died = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        ending = asyncio.ensure_future(self._end_streams_after_grace())
        try:
            await super().shutdown(sockets)  # stop accepting, then wait for the open requests
        finally:
            ending.cancel()

    async def _end_streams_after_grace(self) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and len(self.signals) < 2:
            await asyncio.sleep(0.05)
        self.ended = self.engine.end_streams(ServerShuttingDown("the server is shutting down"))


def main(argv: list[str] | None = None) -> int:
    """``python -m <step>``: bind the port, start the engine core process (it loads the model), print the
    page's URL and a curl line, serve.

    Exit status: 0 after a clean shutdown (Ctrl-C or SIGTERM: see ``Server``), 1 if the engine core died
    while serving, 2 on bad flags or a model/port that cannot be used, or an engine core that failed to
    start (one line on stderr), 130 after a second Ctrl-C.
    """
    args = parse_args(argv)
    try:
        if args.headless:
            return Headless(args, EngineArgs.from_cli_args(args)).run()
        sock = bind(args.host, args.port)  # first: a busy port is reported before a model loads for nothing
        engine_args = EngineArgs.from_cli_args(args)
        if args.api_server_count > 1 or args.data_parallel_size_local < args.data_parallel_size:
            return Launcher(args, engine_args, sock, announce).run()
        engine_core = AsyncMPClient(engine_args)
    except (ValueError, TypeError, ConnectionError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    return serve(args, sock, engine_core)


def serve(
    args: argparse.Namespace, sock: socket.socket, engine_core: AsyncMPClient, quiet: bool = False
) -> int:
    """Serve on ``sock`` until a signal or the cores' death; the exit status of ``main``. quiet: print
    nothing at start (a frontend of several: the launcher says it once)."""
    name = args.served_model_name or args.model
    app = build_app(
        engine_core,
        name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        model_root=str(args.model),
        stream_interval=args.stream_interval,
    )
    if not quiet:
        announce(args, sock, app.state.server.engine.features, engine_core.pids, engine_core.socket_dir)
    engine = app.state.server.engine
    grace = args.timeout_graceful_shutdown
    # uvicorn's own timeout is only a safety net: the streams are ended after the grace period
    # h11 parses HTTP even where httptools is installed: it bounds a request's head (httptools buffers a
    # header of any size) and answers HTTP/1.0 clients without chunked framing
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=grace + 5, http="h11")
    server = Server(config, engine, grace)
    try:
        server.run(sockets=[sock])
    finally:
        engine_core.shutdown()  # the app stopped it already, unless uvicorn never started
    if server.engine_died:
        print(f"error: {engine.error}; the server stops (exit status 1)", file=sys.stderr, flush=True)
        return 1
    if server.signals:
        print(
            f"shut down on {signal.Signals(server.signals[0]).name}: {server.ended} open "
            f"request{'' if server.ended == 1 else 's'} ended with an error, "
            f"{engine.stats.num_used_blocks} KV blocks in use",
            file=sys.stderr,
            flush=True,
        )
    return 130 if len(server.signals) > 1 else 0


def announce(args, sock: socket.socket, features: dict, core_pids: list[int], socket_dir: str) -> None:
    """The start-up lines: the URL, how the engine runs, the core processes, a curl line to try."""
    name = args.served_model_name or args.model
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"serving {name} on {url}  (web page: {url}/ , metrics: {url}/metrics)", flush=True)
    print(f"engine: {describe_features(features)}", flush=True)
    cores = ", ".join(map(str, core_pids))
    print(f"engine core{'s' if len(core_pids) > 1 else ''}: pid {cores}, sockets in {socket_dir}", flush=True)
    print(
        f"try: curl -N {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "The Python interpreter", "max_tokens": 32, "stream": true}}\'',
        flush=True,
    )


def frontend_main(argv: list[str] | None = None) -> int:
    """One frontend of several (started by ``Launcher``): the command line's flags and the hidden
    ``--frontend INDEX,COUNT,CORES --frontend-fds LISTEN,READY --socket-dir DIR``; serves on the inherited
    listening socket once every core is ready. Exit status as ``main``'s."""
    parser = make_parser()
    parser.add_argument("--frontend", required=True)
    parser.add_argument("--frontend-fds", required=True)
    parser.add_argument("--socket-dir", required=True)
    args = parse_args(argv, parser)
    index, count, cores = map(int, args.frontend.split(","))
    listen_fd, ready_fd = map(int, args.frontend_fds.split(","))
    sock = socket.socket(fileno=listen_fd)
    parent = os.getppid()

    def watch_parent() -> None:  # the launcher killed (kill -9): no frontend, no metrics file left behind
        while os.getppid() == parent:
            time.sleep(0.2)
        shutil.rmtree(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""), ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch_parent, daemon=True).start()
    try:
        addresses = addresses_for(args, args.socket_dir)
        engine_core = AsyncMPClient(None, index, count, addresses, cores, args.dp_routing)
    except (ValueError, TypeError, ConnectionError, OSError, RuntimeError) as e:
        if index == 0 or isinstance(e, OSError):  # a core's error reaches every frontend: said once
            print(f"error: {e}", file=sys.stderr)
        return 2
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    return serve(args, sock, engine_core, quiet=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the server handles signals itself: no traceback
        print(file=sys.stderr)
        sys.exit(130)

"""The command line: serve the engine over HTTP with OpenAI's API.

    python -m <step> --model demo            # http://127.0.0.1:8000, the web page at /
    python -m <step> --model gpt2 --device cuda --dtype float16 --port 8080

Run it from the repository root; `--help` lists every option with its default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
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
    from .engine import LLMEngine
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
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info logs every request)",
    )
    EngineArgs.add_cli_args(parser)  # --model, --device, --dtype, ...: the engine's arguments
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: bad flags and limits that admit nothing exit with status 2."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: {args.port} is not a TCP port (0..65535)")
    if args.max_waiting_requests < 1:  # refused here, before the model loads (the engine's: by their flags)
        parser.error(
            f"argument --max-waiting-requests: must be >= 1 ({args.max_waiting_requests} admits none)"
        )
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
    """uvicorn's server with a shutdown that ends open streams cleanly.

    On SIGINT or SIGTERM uvicorn stops accepting connections; open requests then have ``grace`` seconds
    to finish, after which each one still open is ended (``AsyncEngine.end_streams``): a stream with an
    OpenAI-style error event and ``data: [DONE]``, a whole answer with 503, and its engine requests are
    aborted. A second signal ends them at once. The signal is not raised again afterwards (uvicorn does,
    which turns SIGTERM into a kill): a signal is how this server is meant to stop.
    """

    def __init__(self, config: uvicorn.Config, bridge: AsyncEngine, grace: float):
        super().__init__(config)
        self.bridge, self.grace = bridge, grace
        self.signals: list[int] = []
        self.ended = 0  # open requests ended by the shutdown

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
        self.ended = self.bridge.end_streams(ServerShuttingDown("the server is shutting down"))


def main(argv: list[str] | None = None) -> int:
    """``python -m <step>``: bind the port, load the model, print the page's URL and a curl line, serve.

    Exit status: 0 after a clean shutdown (Ctrl-C or SIGTERM: see ``Server``), 2 on bad flags or a
    model/port that cannot be used (one line on stderr), 130 after a second Ctrl-C.
    """
    args = parse_args(argv)
    try:
        sock = bind(args.host, args.port)  # first: a busy port is reported before a model loads for nothing
        engine = LLMEngine(EngineArgs.from_cli_args(args))
    except (ValueError, ConnectionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    name = args.served_model_name or args.model
    app = build_app(
        engine,
        name,
        api_key=args.api_key,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
        model_root=str(args.model),
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"serving {name} on {url}  (web page: {url}/ , metrics: {url}/metrics)", flush=True)
    print(f"engine: {describe_features(app.state.server.bridge.features)}", flush=True)
    print(
        f"try: curl -N {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f'-d \'{{"model": "{name}", "prompt": "The Python interpreter", "max_tokens": 32, "stream": true}}\'',
        flush=True,
    )
    bridge = app.state.server.bridge
    grace = args.timeout_graceful_shutdown
    # uvicorn's own timeout is only a safety net: the streams are ended after the grace period
    # h11 parses HTTP even where httptools is installed: it bounds a request's head (httptools buffers a
    # header of any size) and answers HTTP/1.0 clients without chunked framing
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=grace + 5, http="h11")
    server = Server(config, bridge, grace)
    try:
        server.run(sockets=[sock])
    finally:
        bridge.shutdown(timeout=2)
    if server.signals:
        print(
            f"shut down on {signal.Signals(server.signals[0]).name}: {server.ended} open "
            f"request{'' if server.ended == 1 else 's'} ended with an error, "
            f"{engine.stats.num_used_blocks} KV blocks in use",
            file=sys.stderr,
            flush=True,
        )
    return 130 if len(server.signals) > 1 else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before the server handles signals itself: no traceback
        print(file=sys.stderr)
        sys.exit(130)

"""The coordinator: one process that hears every engine core's stats after each of its steps and publishes
them all to every frontend, at most every ``PUBLISH_INTERVAL_S`` (and every second while nothing changes, for
a frontend that joined late), so that each frontend routes a new request on every core's load, not only
on the requests it sent itself. Cores PUSH ``EngineCoreLoad``; frontends SUB to ``EngineLoads``. It exits
when its parent dies, or on SIGTERM / SIGINT. ``main``: ``--loads ADDR --publish ADDR --engines M
--parent-pid PID --socket-dir DIR``. Source: vLLM's ``DPCoordinator`` (``vllm/v1/engine/coordinator.py``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import zmq

from .engine_core import ShutdownRequested, watch_parent
from .messages import EngineLoads, load_decoder, output_encoder

PUBLISH_INTERVAL_S = 0.1  # vLLM's coordinator publishes every 100 ms
HEARTBEAT_S = 1.0  # publish the same again after this long, for a frontend that subscribed since


def run_coordinator(loads_address: str, publish_address: str, num_engines: int) -> int:
    """Bind both addresses, then relay: returns 0 once stopped by a signal."""

    def stop(signum, frame):
        raise ShutdownRequested(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    context = zmq.Context()
    loads = context.socket(zmq.PULL)
    loads.setsockopt(zmq.RCVHWM, 0)
    loads.bind(loads_address)
    publish = context.socket(zmq.PUB)
    publish.bind(publish_address)
    decoder, encoder = load_decoder(), output_encoder()
    latest: list = [None] * num_engines
    changed, published = False, 0.0
    try:
        while True:
            wait = PUBLISH_INTERVAL_S if changed else HEARTBEAT_S
            if loads.poll(max(0, int(1000 * (published + wait - time.monotonic())))):
                while True:
                    try:
                        load = decoder.decode(loads.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    latest[load.engine_index], changed = load.stats, True
            now = time.monotonic()
            if now - published >= (PUBLISH_INTERVAL_S if changed else HEARTBEAT_S):
                publish.send(encoder.encode(EngineLoads(latest)))
                changed, published = False, now
    except ShutdownRequested:
        return 0
    finally:
        loads.close(linger=0)
        publish.close(linger=0)
        context.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"{__package__}.coordinator")
    parser.add_argument("--loads", required=True, help="the ZMQ address the cores send their stats to")
    parser.add_argument("--publish", required=True, help="the ZMQ address the frontends subscribe to")
    parser.add_argument("--engines", type=int, required=True, help="how many engine cores")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--socket-dir", required=True, help="removed if the parent dies")
    args = parser.parse_args(argv)
    watch_parent(args.parent_pid, args.socket_dir)
    return run_coordinator(args.loads, args.publish, args.engines)


if __name__ == "__main__":
    sys.exit(main())

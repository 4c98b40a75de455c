"""``pdserve top``: a live view of a running cluster (like htop). ``main`` polls
GetClusterStatus (each call with a deadline) and redraws the renderings of ``views.py`` with
``rich.live.Live``."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
from rich.console import Console, RenderableType

from pdserve.cluster.auth import SecurityConfigError
from pdserve.cluster.client import add_connection_arguments, connection_from_args
from pdserve.cluster.rpc import router_pb2 as pb

from .views import DEFAULT_EVENTS, DEFAULT_INTERVAL_S, MIN_DEADLINE_S, Rates, compute_rates, render_top

# ---------------------------------------------------------------------- the live loop

class TopState:
    """The last snapshot, the rates against the one before, and the last error: what one frame
    shows. ``record`` takes either a ClusterStatus or the exception a poll raised."""

    def __init__(self, *, address: str = "", events: int = DEFAULT_EVENTS,
                 interval_s: float | None = None) -> None:
        self.address, self.events, self.interval_s = address, events, interval_s
        self.status: Any | None = None
        self.at: float | None = None
        self.rates: Rates | None = None
        self.error: str | None = None

    def record(self, result: Any, at: float) -> None:
        if isinstance(result, BaseException):
            self.error = describe_error(result)
            return
        elapsed = at - self.at if self.at is not None else None
        self.rates = compute_rates(self.status, result, elapsed)
        self.status, self.at, self.error = result, at, None

    def render(self, now: float | None = None) -> RenderableType:
        return render_top(self.status, self.rates, address=self.address, events=self.events,
                          error=self.error, now=now, interval_s=self.interval_s)


def describe_error(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{getattr(code(), 'name', code())}: {details() or ''}".strip()
    return f"{type(exc).__name__}: {exc}"


def poll_once(stub: Any, deadline_s: float, metadata: Any = None) -> Any:
    """One GetClusterStatus call; returns the status, or the exception it raised."""
    try:
        return stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=deadline_s, metadata=metadata)
    except grpc.RpcError as exc:  # UNAVAILABLE, DEADLINE_EXCEEDED, ...
        return exc


def run_top(poll: Callable[[], Any], state: TopState, *, interval_s: float, once: bool,
            console: Console, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """``once``: two polls ``interval_s`` apart (so rates have values), one frame printed; exit
    status 1 when the last poll failed. Otherwise redraw forever (Ctrl-C ends it: 0)."""
    if once:
        state.record(poll(), clock())
        sleep(interval_s)
        state.record(poll(), clock())
        console.print(state.render())
        return 1 if state.error else 0

    from rich.live import Live

    try:
        with Live(state.render(), console=console, auto_refresh=False, transient=False) as live:
            while True:
                started = clock()
                state.record(poll(), clock())
                live.update(state.render(), refresh=True)
                sleep(max(interval_s - (clock() - started), 0.0))
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve top",
        description="A live view of a running cluster: per worker KV occupancy, requests and "
                    "tokens/s; transfers/s, GB/s and pauses/min; router totals and KV paths; "
                    "the last KV transfers, pauses and resumes. Ctrl-C quits.",
        epilog="run: requests past their first token; wait: queued or before prefill / KV "
               "transfer; paused: evicted and awaiting re-prefill. Rates come from two "
               "snapshots over the real time between them; transfers are counted on generation "
               "workers only (each transfer once).")
    parser.add_argument("--host", default="127.0.0.1", help="the router's host; https://NAME for TLS")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S,
                        help="seconds between polls (default %(default)s)")
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS,
                        help="recent events shown (default %(default)s; 0 hides them)")
    parser.add_argument("--once", action="store_true",
                        help="print one view (two polls --interval apart) and exit; exit status 1 "
                             "when the router did not answer")
    add_connection_arguments(parser)
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")

    from pdserve.cluster.rpc import router_pb2_grpc

    try:
        connection = connection_from_args(args, f"{args.host}:{args.port}")
    except SecurityConfigError as exc:
        parser.error(str(exc))
    address = connection.target
    deadline = max(MIN_DEADLINE_S, args.interval)
    state = TopState(address=address, events=max(args.events, 0), interval_s=args.interval)
    # A router that comes back is seen within about one interval: gRPC's reconnect backoff would
    # otherwise grow to two minutes while it was away.
    backoff_ms = int(max(1000.0, args.interval * 1000))
    channel = connection.channel([("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
                                  ("grpc.min_reconnect_backoff_ms", min(backoff_ms, 1000)),
                                  ("grpc.max_reconnect_backoff_ms", backoff_ms)])
    try:
        stub = router_pb2_grpc.RouterStub(channel)
        return run_top(lambda: poll_once(stub, deadline, connection.metadata), state, interval_s=args.interval,
                       once=args.once, console=Console())
    except KeyboardInterrupt:
        return 0
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())

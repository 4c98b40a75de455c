"""A disaggregated worker as a plain OS process, without Ray: a WorkerHost served over
``multiprocessing.connection`` on 127.0.0.1 (one thread per connection, so a long KV send never
blocks other calls). The Ray actors are the production wrapper; this one lets the disaggregated
lifecycle be driven and faulted with real processes (kill -9 mid-transfer) in tests.

    python -m pdserve.workers.process.rpc_worker --role context --worker-id ctx-0 --model DIR \\
        --engine '{"tokens_per_block": 4}' [--peers '{"ctx-0": "127.0.0.1:PORT"}']

prints one JSON line ``{"address": "127.0.0.1:PORT"}`` when it is ready.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from multiprocessing.connection import Client, Listener
from typing import Any


from pdserve.transport.requests import WireRequest, WireUpdate

from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.build import build_worker_core
from pdserve.workers.process.host import Faults, RequestStream, WorkerHost
from pdserve.workers.engine.transceiver import ControlMessage

AUTHKEY = b"pdserve-rpc-worker"
CALL_TIMEOUT_S = 60.0

ROLES = {"context": "CONTEXT_ONLY", "generation": "GENERATION_ONLY", "both": "CONTEXT_AND_GENERATION"}


class RpcWorkerClient:
    """Calls into a worker process; one connection per call, every call with a deadline."""

    def __init__(self, address: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        host, port = address.rsplit(":", 1)
        self.address = (host, int(port))
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with Client(self.address, authkey=AUTHKEY) as conn:
            conn.send((method, args))
            if not conn.poll(timeout):
                raise TimeoutError(f"{method} on {self.address} did not answer within {timeout} s")
            ok, value = conn.recv()
        if not ok:
            kind, message = value
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return value


class RpcControlPlane:
    """KV control messages as ``kv_control`` calls on the context workers' RPC servers; the
    call itself runs in the wait, on the host's control pool."""

    def __init__(self, peers: dict[str, str], transfer_timeout_s: float) -> None:
        self.peers = peers
        self.transfer_timeout_s = transfer_timeout_s

    def send(self, message: ControlMessage):
        address = self.peers.get(message.ctx_worker_id)
        if address is None:
            raise RuntimeError(f"unknown context worker {message.ctx_worker_id!r}")
        return lambda: RpcWorkerClient(address).call(
            "kv_control", message.payload, timeout_s=self.transfer_timeout_s + 15.0)


class RpcWorkerServer:
    def __init__(self, host: WorkerHost, peers: dict[str, str], address: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.host = host
        self.peers = peers
        self.listener = Listener((address, port), authkey=AUTHKEY)
        self.address = "%s:%d" % self.listener.address
        self._streams: dict[int, RequestStream] = {}
        self._done = threading.Event()

    def serve_forever(self) -> None:
        threading.Thread(target=self._accept, daemon=True, name="rpc-accept").start()
        self._done.wait()

    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            try:
                method, args = conn.recv()
                value = getattr(self, f"rpc_{method}")(*args)
                conn.send((True, value))
            except Exception as exc:  # the caller gets the error; the worker stays up
                try:
                    conn.send((False, (type(exc).__name__, str(exc))))
                except OSError:
                    pass

    # ---- methods ------------------------------------------------------------------------------
    def rpc_submit(self, wire: WireRequest) -> int:
        self._streams[wire.request_id] = self.host.stream(wire)
        return wire.request_id

    def rpc_collect(self, request_id: int, timeout_s: float) -> list[WireUpdate]:
        """Every update of a submitted request until it finishes."""
        stream = self._streams[request_id]
        try:
            return stream.collect(timeout_s)
        finally:
            if stream.finished:
                self._streams.pop(request_id, None)

    def rpc_abort(self, request_id: int) -> bool:
        return bool(self.host.call(lambda: self.host.abort_now(request_id)))

    def rpc_status(self) -> dict:
        return self.host.call(self.host.status_map)  # type: ignore[return-value]

    def rpc_request_states(self) -> dict[int, str]:
        return self.host.call(self.host.core.request_states)  # type: ignore[return-value]

    def rpc_kv_control(self, payload: bytes) -> bytes | None:
        return self.host.kv_control.serve(payload)

    def rpc_set_peer(self, worker_id: str, address: str) -> bool:
        """A context worker (re)started at a new address."""
        self.peers[worker_id] = address
        return True

    def rpc_ping(self) -> str:
        return "pong"

    def rpc_shutdown(self) -> bool:
        self._done.set()
        return True


def build_host(args: argparse.Namespace, peers: dict[str, str]) -> WorkerHost:
    config = EngineConfig.from_kwargs(json.loads(args.engine))
    faults = Faults(stall_send_s=args.stall_send_s)
    _, core = build_worker_core(
        args.worker_id, args.role, args.model, config, lease_s=args.lease_s,
        transfer_timeout_s=args.transfer_timeout_s, stall_send_s=lambda: faults.stall_send_s)
    return WorkerHost(core, worker_id=args.worker_id, role=args.role, config=config,
                      control=RpcControlPlane(peers, args.transfer_timeout_s), faults=faults)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.workers.process.rpc_worker")
    parser.add_argument("--role", choices=sorted(ROLES), required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", default="{}", help="engine keyword arguments as JSON")
    parser.add_argument("--peers", default="{}", help="context worker id -> RPC address, as JSON")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--transfer-timeout-s", type=float, default=30.0)
    parser.add_argument("--stall-send-s", type=float, default=0.0, help="test hook: stall each send")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    peers: dict[str, str] = json.loads(args.peers)
    host = build_host(args, peers)
    server = RpcWorkerServer(host, peers, port=args.port)
    print(json.dumps({"address": server.address}), flush=True)
    server.serve_forever()
    host.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

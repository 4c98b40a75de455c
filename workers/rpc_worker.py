"""A disaggregated worker as a plain OS process, without Ray: a WorkerLoop served over
``multiprocessing.connection`` on 127.0.0.1 (one thread per connection, so a long KV send never
blocks other calls). The Ray actors are the production wrapper; this one lets the disaggregated
lifecycle be driven and faulted with real processes (kill -9 mid-transfer) in tests.

    python -m pdserve.workers.rpc_worker --role context --worker-id ctx-0 --model DIR \\
        --engine '{"tokens_per_block": 4}' [--peers '{"ctx-0": "127.0.0.1:PORT"}']

prints one JSON line ``{"address": "127.0.0.1:PORT"}`` when it is ready.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from typing import Any


from .config import EngineConfig
from .engine import build_executor
from .sampling import SamplingParams
from .transceiver import KVTransceiver
from .wire import request_from_wire, update_to_wire
from .worker_loop import WorkerLoop

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


class RpcWorkerServer:
    def __init__(self, loop: WorkerLoop, peers: dict[str, str], host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.loop = loop
        self.peers = peers
        self.listener = Listener((host, port), authkey=AUTHKEY)
        self.address = "%s:%d" % self.listener.address
        self._streams: dict[int, Any] = {}
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
    def rpc_submit(self, request: dict, params: dict) -> int:
        stream = self.loop.submit(request_from_wire(request), SamplingParams(**params))
        self._streams[request["request_id"]] = stream
        return request["request_id"]

    def rpc_collect(self, request_id: int, timeout_s: float) -> list[dict]:
        """Every update of a submitted request until it finishes."""
        stream = self._streams[request_id]
        try:
            updates = stream.collect(timeout_s)
        finally:
            if stream.finished:
                self._streams.pop(request_id, None)
        return [update_to_wire(u) for u in updates]

    def rpc_abort(self, request_id: int) -> bool:
        return self.loop.abort(request_id)

    def rpc_status(self) -> dict:
        return self.loop.status()

    def rpc_request_states(self) -> dict[int, str]:
        return self.loop.call(self.loop.executor.request_states)  # type: ignore[return-value]

    def rpc_kv_control(self, payload: bytes) -> bytes | None:
        return self.loop.handle_kv_control(payload)

    def rpc_set_peer(self, worker_id: str, address: str) -> bool:
        """A context worker (re)started at a new address."""
        self.peers[worker_id] = address
        return True

    def rpc_ping(self) -> str:
        return "pong"

    def rpc_shutdown(self) -> bool:
        self._done.set()
        return True


def build_loop(args: argparse.Namespace, peers: dict[str, str]) -> WorkerLoop:
    engine = EngineConfig.from_kwargs(json.loads(args.engine))

    def transceiver_factory(pool) -> KVTransceiver:
        from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig

        sender = receiver = None
        if args.role in ("context", "both"):
            hook = None
            if args.stall_send_s > 0:
                def hook(descriptor, chunk_index, _s=args.stall_send_s):  # fault injection
                    if chunk_index == 0:
                        time.sleep(_s)
            sender = KVSender(args.worker_id, pool, send_hook=hook,
                              config=TransportConfig(default_timeout_s=args.lease_s))
        if args.role in ("generation", "both"):
            receiver = KVReceiver(args.worker_id, pool,
                                  config=TransportConfig(default_timeout_s=args.transfer_timeout_s))
        return KVTransceiver(args.worker_id, sender=sender, receiver=receiver,
                             lease_s=args.lease_s, transfer_timeout_s=args.transfer_timeout_s)

    _, executor = build_executor(args.model, engine, transceiver_factory=transceiver_factory)

    def deliver(ctx_worker_id: str, payload: bytes) -> bytes | None:
        address = peers.get(ctx_worker_id)
        if address is None:
            raise RuntimeError(f"unknown context worker {ctx_worker_id!r}")
        return RpcWorkerClient(address).call("kv_control", payload,
                                             timeout_s=args.transfer_timeout_s + 15.0)

    return WorkerLoop(executor, name=args.worker_id, deliver=deliver).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.workers.rpc_worker")
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
    loop = build_loop(args, peers)
    server = RpcWorkerServer(loop, peers, port=args.port)
    print(json.dumps({"address": server.address}), flush=True)
    server.serve_forever()
    loop.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

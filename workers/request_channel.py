"""The router's request channel into a worker: one TCP connection per router, msgpack frames
both ways. This is the request data path; Ray stays the control plane (placement, restarts,
status, KV control messages).

Why not a Ray call per request: a Ray streaming-generator call costs about 1.3 ms on this machine
before any work is done, and each further update is another object; a socket write is tens of
microseconds. vLLM (API server <-> engine core) and SGLang (tokenizer manager <-> scheduler) put
ZeroMQ sockets on this path for the same reason.

Frames (msgpack maps; the stream carries them back to back, ``msgpack.Unpacker`` splits them):
  router -> worker  {"op": "hello", "token": T}          first frame; a wrong token closes it
                    {"op": "generate", "wire": {...}}    the request as ``request_from_wire`` reads it
                    {"op": "abort", "id": N}
                    {"op": "status", "id": S}            answered with a status between two steps
  worker -> router  {"id": N, "u": {...}}                one update (``update_to_wire``)
                    {"id": N, "rejected": "why"}         the request itself is invalid (ValueError)
                    {"id": N, "error": "why"}            the worker could not take it
                    {"id": S, "status": {...}}           the answer to a status op
                    {"hb": 1, "status": {...}}           heartbeat, every HEARTBEAT_S

Heartbeats are written by the step loop's thread, so they prove the loop itself is alive: the
router can then wait as long as a request's deadline allows for a request that is only queued
(a generation request waiting for KV, say) and still notice a worker that hangs. Each carries
the worker's status (load, KV blocks, counters, invariant checks) and the transfer, pause and
resume events since the previous one: the router's load view, health and GetClusterStatus come
from here, not from Ray calls, so the dashboard's task table is not flooded with status polls.

Ownership: a request belongs to the connection that brought it. When that connection ends
(router gone, socket broken), every request it still owns is aborted, so nothing runs unowned.
Updates are written by the step loop's thread, batched per step (one ``sendall`` per connection
per step); a write that cannot finish within WRITE_TIMEOUT_S means the router stopped reading,
and the connection is closed (its requests are aborted).
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable

import msgpack

from pdserve.transport.channel_frames import frame_unpacker, pack_frame

from .worker_loop import WorkerLoop

log = logging.getLogger("pdserve.request_channel")

HELLO_TIMEOUT_S = 5.0  # a connection must say hello this soon
HEARTBEAT_S = 0.5  # also the age of the router's load view of this worker
WRITE_TIMEOUT_S = 10.0  # a router that reads nothing for this long is treated as gone
READ_BYTES = 1 << 16

# (request, sampling params, deadline or None, forced tokens) from a wire dict; raises ValueError
FromWire = Callable[[dict[str, Any]], tuple[Any, Any, "float | None", tuple[int, ...]]]
ToWire = Callable[[Any], dict[str, Any]]  # a RequestUpdate as a msgpack-able dict


def _set_socket_options(sock: socket.socket) -> None:
    # Small frames must leave at once: Nagle plus delayed ACKs would add tens of milliseconds.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _Connection:
    """One router connection: the requests it owns and the frames waiting to be written."""

    def __init__(self, server: "RequestChannelServer", sock: socket.socket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.owned: set[int] = set()  # request ids submitted here and not finished
        self.pending: list[bytes] = []  # frames to write at the next flush
        self.lock = threading.Lock()  # guards owned, pending and the socket's write side
        self.closed = False

    def queue(self, frame: dict[str, Any], *, finished_id: int | None = None) -> None:
        data = pack_frame(frame)
        with self.lock:
            if finished_id is not None:
                self.owned.discard(finished_id)
            if not self.closed:
                self.pending.append(data)

    def flush(self) -> None:
        with self.lock:
            if self.closed or not self.pending:
                return
            data = b"".join(self.pending)
            self.pending.clear()
            try:
                self.sock.sendall(data)
            except OSError as exc:  # timed out or broken: the stream is unusable now
                log.warning("request channel to %s: write failed (%r); closing it", self.peer, exc)
                self._close_locked()
                failed = True
            else:
                failed = False
        if failed:
            self.server._connection_ended(self)

    def close(self) -> None:
        with self.lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            self.pending.clear()
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


class RequestChannelServer:
    """Accepts router connections and feeds their requests to a WorkerLoop."""

    def __init__(self, loop: WorkerLoop, from_wire: FromWire, to_wire: ToWire, *,
                 host: str = "127.0.0.1", name: str = "worker",
                 on_submit: Callable[[Any], None] | None = None,
                 heartbeat_status: Callable[[], dict[str, Any]] | None = None) -> None:
        self.loop = loop
        self.from_wire = from_wire
        self.to_wire = to_wire
        self.name = name
        self.on_submit = on_submit  # e.g. advertise the prompt's cached blocks
        self.heartbeat_status = heartbeat_status  # on the loop thread, once per heartbeat
        self.token = secrets.token_hex(16)  # handed out over Ray (authenticated), checked on hello
        self._listener = socket.create_server((host, 0))
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._next_heartbeat = 0.0
        loop.add_flush_hook(self._flush_all)
        loop.add_tick_hook(self._heartbeat)
        self._accept_thread = threading.Thread(target=self._accept, name=f"{name}-channel-accept",
                                               daemon=True)
        self._accept_thread.start()

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._stopping = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.close()
            self._connection_ended(conn)

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    # ------------------------------------------------------------------ threads

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            _set_socket_options(sock)
            sock.settimeout(WRITE_TIMEOUT_S)
            conn = _Connection(self, sock, f"{addr[0]}:{addr[1]}")
            threading.Thread(target=self._read, args=(conn,), name=f"{self.name}-channel-read",
                             daemon=True).start()

    def _read(self, conn: _Connection) -> None:
        frames = frame_unpacker()
        hello_by = time.monotonic() + HELLO_TIMEOUT_S
        registered = False
        try:
            while True:
                try:
                    data = conn.sock.recv(READ_BYTES)
                except TimeoutError:
                    if not registered and time.monotonic() > hello_by:
                        log.warning("request channel: %s sent no hello; closing", conn.peer)
                        return
                    continue  # an idle router is fine; the timeout only bounds writes
                if not data:
                    return  # the router closed it
                frames.feed(data)
                for frame in frames:
                    if not registered:
                        if not (isinstance(frame, dict) and frame.get("op") == "hello"
                                and secrets.compare_digest(str(frame.get("token", "")), self.token)):
                            log.warning("request channel: %s failed the hello; closing", conn.peer)
                            return
                        with self._lock:
                            if self._stopping:
                                return
                            self._connections.add(conn)
                        registered = True
                        continue
                    self._on_frame(conn, frame)
        except (OSError, ValueError, msgpack.ExtraData, msgpack.FormatError,
                msgpack.StackError, msgpack.BufferFull) as exc:
            if not conn.closed:
                log.warning("request channel from %s ended: %r", conn.peer, exc)
        finally:
            conn.close()
            if registered:
                self._connection_ended(conn)

    def _on_frame(self, conn: _Connection, frame: Any) -> None:
        op = frame.get("op") if isinstance(frame, dict) else None
        if op == "generate":
            self._generate(conn, frame.get("wire"))
        elif op == "abort":
            rid = frame.get("id")
            if isinstance(rid, int):
                self._post(lambda: self.loop.abort_now(rid))
        elif op == "status":
            sid = frame.get("id")
            if isinstance(sid, int) and self.heartbeat_status is not None:
                self._post(lambda: self._answer_status(conn, sid))
        else:
            raise ValueError(f"unknown request channel frame {frame!r:.200}")

    def _generate(self, conn: _Connection, wire: Any) -> None:
        rid = wire.get("request_id") if isinstance(wire, dict) else None
        if not isinstance(rid, int):
            raise ValueError("a generate frame without an integer request_id")
        try:
            request, params, deadline, forced = self.from_wire(wire)
        except (ValueError, TypeError, KeyError) as exc:
            conn.queue({"id": rid, "rejected": f"{type(exc).__name__}: {exc}"})
            conn.flush()
            return
        with conn.lock:
            conn.owned.add(rid)

        def sink(update) -> None:  # on the loop thread; written at the end of the step
            conn.queue({"id": rid, "u": self.to_wire(update)},
                       finished_id=rid if update.finished else None)

        def rejected(exc: BaseException) -> None:
            kind = "rejected" if isinstance(exc, ValueError) else "error"
            conn.queue({"id": rid, kind: str(exc)}, finished_id=rid)

        try:
            self.loop.submit_nowait(request, params, sink, rejected, deadline=deadline,
                                    forced_tokens=forced)
        except RuntimeError as exc:  # the step loop is dead: this worker takes nothing
            conn.queue({"id": rid, "error": str(exc)}, finished_id=rid)
            conn.flush()
            return
        if self.on_submit is not None:
            self.on_submit(request)

    def _answer_status(self, conn: _Connection, sid: int) -> None:
        """On the loop thread, between steps: a status as fresh as the last step."""
        conn.queue({"id": sid, "status": self.heartbeat_status()})
        conn.flush()

    def _post(self, fn: Callable[[], object]) -> None:
        try:
            self.loop.post(fn)
        except RuntimeError:  # the step loop is dead: the process is on its way out anyway
            pass

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + HEARTBEAT_S
        with self._lock:
            conns = list(self._connections)
        if not conns:
            return
        frame: dict[str, Any] = {"hb": 1}
        if self.heartbeat_status is not None:
            frame["status"] = self.heartbeat_status()
        for conn in conns:
            conn.queue(frame)
        self._flush_all()

    def _flush_all(self) -> None:
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            conn.flush()

    def _connection_ended(self, conn: _Connection) -> None:
        with self._lock:
            if conn not in self._connections:
                return
            self._connections.discard(conn)
        with conn.lock:
            orphans = sorted(conn.owned)
            conn.owned.clear()
        if orphans:
            log.warning("%s: request channel from %s closed; aborting %d request(s) it owned",
                        self.name, conn.peer, len(orphans))
        for rid in orphans:
            self._post(lambda rid=rid: self.loop.abort_now(rid))

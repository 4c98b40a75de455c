"""The worker end of the router's request channel: one TCP connection per router, frames of
``transport/requests.py`` both ways. This is the request data path; Ray stays the control
plane (placement, restarts, KV control messages).

Why not a Ray call per request: a Ray streaming-generator call costs about 1.3 ms on this machine
before any work is done, and each further update is another object; a socket write is tens of
microseconds. vLLM (API server <-> engine core) and SGLang (tokenizer manager <-> scheduler) put
ZeroMQ sockets on this path for the same reason.

Heartbeats are written by the step loop's thread (a tick hook), so they prove the loop itself is
alive: the router can then wait as long as a request's deadline allows for a request that is
only queued (a generation request waiting for KV, say) and still notice a worker that hangs.
Each carries the worker's status and the transfer, pause and resume events since the previous
one: the router's load view, health and GetClusterStatus come from here, not from Ray calls, so
the dashboard's task table is not flooded with status polls.

Ownership: a request belongs to the connection that brought it. When that connection ends
(router gone, socket broken), every request it still owns is aborted, so nothing runs unowned.
Updates are written by the loop thread, batched per step (one ``sendall`` per connection per
step); a write that cannot finish within WRITE_TIMEOUT_S means the router stopped reading, and
the connection is closed (its requests are aborted).
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Callable, Protocol

from pdserve.scheduler.kv_events import BlocksStored, KVEventLog
from pdserve.transport.requests import (
    PROTOCOL_VERSION,
    Abort,
    Frame,
    FrameReader,
    Generate,
    Heartbeat,
    HelloAck,
    KvEvents,
    KvSnapshot,
    KvPeers,
    KvSnapshotQuery,
    ProtocolError,
    Refused,
    StatusQuery,
    StatusReply,
    Update,
    WireRequest,
    WireUpdate,
    WorkerStatus,
    check_hello,
    encode_frame,
)

log = logging.getLogger("pdserve.request_channel")

HELLO_TIMEOUT_S = 5.0  # a connection must say hello this soon
HEARTBEAT_S = 0.5  # also the age of the router's load view of this worker
WRITE_TIMEOUT_S = 10.0  # a router that reads nothing for this long is treated as gone
READ_BYTES = 1 << 16


class ChannelHost(Protocol):
    """What the server needs of the worker it serves (``host.WorkerHost`` is one), and all it
    may touch: the server is built by the process shell that built the host (``ray_worker.py``)
    and handed the host as this, so neither module imports the other and the server never
    reaches into the engine core.

    Thread rules (the host's): ``submit``, ``abort``, ``connect_kv_peers``, ``post`` and the
    hook registrations are callable from any thread; ``status``, ``kv_snapshot`` and the hooks
    themselves run on the step loop's thread."""

    @property
    def worker_id(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    @property
    def kv_events(self) -> KVEventLog | None:
        """The prefix cache's event log (None: block reuse is off, no events)."""
        ...

    def pair_version(self) -> int: ...
    def add_flush_hook(self, hook: Callable[[], None]) -> None: ...
    def add_tick_hook(self, hook: Callable[[], None]) -> None: ...
    def submit(self, wire: WireRequest, sink: Callable[[WireUpdate], None]) -> bool: ...
    def abort(self, request_id: int) -> None: ...
    def connect_kv_peers(self, peers: dict[str, str]) -> None: ...
    def post(self, fn: Callable[[], object]) -> None: ...
    def status(self, *, drain_events: bool) -> WorkerStatus: ...
    def kv_snapshot(self) -> list[BlocksStored]: ...


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

    def queue(self, frame: Frame, *, finished_id: int | None = None) -> None:
        data = encode_frame(frame)
        with self.lock:
            if finished_id is not None:
                self.owned.discard(finished_id)
            if not self.closed:
                self.pending.append(data)

    def sink(self, update: WireUpdate) -> None:
        """A request's updates, on the loop thread; written at the end of the step."""
        self.queue(Update(update), finished_id=update.request_id if update.finished else None)

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
    """Accepts router connections and feeds their requests to the host."""

    def __init__(self, host: ChannelHost, *, host_address: str = "127.0.0.1") -> None:
        self.host = host
        self.name = host.worker_id
        self.token = secrets.token_hex(16)  # handed out over Ray (authenticated), checked on hello
        self._listener = socket.create_server((host_address, 0))
        self.endpoint = f"{host_address}:{self._listener.getsockname()[1]}"
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._next_heartbeat = 0.0
        self._ready_sent: tuple = ()
        # KV events: batches numbered per worker process (the router checks there is no gap).
        self._kv_events = host.kv_events
        self._kv_seq = 0
        host.add_flush_hook(self._flush_all)
        host.add_tick_hook(self._heartbeat)
        host.add_tick_hook(self._kv_events_tick)
        self._accept_thread = threading.Thread(target=self._accept, name=f"{self.name}-channel-accept",
                                               daemon=True)
        self._accept_thread.start()

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
        frames = FrameReader()
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
                    if registered:
                        self._on_frame(conn, frame)
                    elif not self._register(conn, frame):
                        return
                    else:
                        registered = True
        except (OSError, ProtocolError) as exc:
            if not conn.closed:
                log.warning("request channel from %s ended: %r", conn.peer, exc)
        finally:
            conn.close()
            if registered:
                self._connection_ended(conn)

    def _register(self, conn: _Connection, frame: Frame) -> bool:
        why = check_hello(frame, self.token, secrets.compare_digest)
        if why is None:
            # The ack goes out before the connection joins the heartbeat list: it must be the
            # first frame the router reads.
            conn.queue(HelloAck(PROTOCOL_VERSION, self.name))
            conn.flush()
            with self._lock:
                if self._stopping:
                    return False
                self._connections.add(conn)
                # A new router (or a restarted worker's first one) hears a status at once, not
                # at the next heartbeat slot: it is what makes this worker healthy there.
                self._next_heartbeat = 0.0
            return True
        log.warning("request channel: %s refused: %s", conn.peer, why)
        conn.queue(Refused(why))
        conn.flush()
        return False

    def _on_frame(self, conn: _Connection, frame: Frame) -> None:
        if isinstance(frame, Generate):
            rid = frame.request.request_id
            with conn.lock:
                conn.owned.add(rid)
            if not self.host.submit(frame.request, conn.sink):
                conn.flush()  # answered at once (refused): no step will flush it
        elif isinstance(frame, Abort):
            self.host.abort(frame.request_id)
        elif isinstance(frame, KvPeers):
            self.host.connect_kv_peers(dict(frame.peers))  # thread-safe; pairs open on their threads
        elif isinstance(frame, KvSnapshotQuery):
            try:
                self.host.post(lambda: self._answer_kv_snapshot(conn))
            except RuntimeError:  # the step loop is dead: the process is on its way out
                pass
        elif isinstance(frame, StatusQuery):
            qid = frame.query_id
            try:
                self.host.post(lambda: self._answer_status(conn, qid))
            except RuntimeError:  # the step loop is dead: the process is on its way out
                pass
        else:
            raise ProtocolError(f"a worker does not take {type(frame).__name__} frames")

    def _answer_status(self, conn: _Connection, query_id: int) -> None:
        """On the loop thread, between steps: a status as fresh as the last step."""
        conn.queue(StatusReply(query_id, self.host.status(drain_events=True)))
        conn.flush()

    def _queue_kv_events(self) -> bool:
        """On the loop thread: the cache's events since the last batch, to every connection.
        A log that overflowed sends the whole cache instead (a snapshot the router replaces
        its view with). Returns whether anything was queued."""
        log = self._kv_events
        if log is None:
            return False
        events, overflowed = log.drain()
        if not events and not overflowed:
            return False
        with self._lock:
            conns = list(self._connections)
        if overflowed:  # a snapshot names the next batch's seq; it takes no number itself
            frame = KvSnapshot(self._kv_seq, self.host.kv_snapshot())
        else:
            frame = KvEvents(self._kv_seq, events)
            self._kv_seq += 1
        for conn in conns:
            conn.queue(frame)
        return True

    def _kv_events_tick(self) -> None:
        if self._queue_kv_events():  # events outside a step's updates (e.g. a receive)
            self._flush_conns()

    def _answer_kv_snapshot(self, conn: _Connection) -> None:
        """On the loop thread: what is pending goes out first as a numbered batch, so the
        snapshot (which already contains its effect) names the batch after it and nothing is
        applied twice; other connections see no gap."""
        self._queue_kv_events()
        conn.queue(KvSnapshot(self._kv_seq, self.host.kv_snapshot() if self._kv_events is not None else []))
        self._flush_conns()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        ready = (self.host.ready, self.host.pair_version())
        if now < self._next_heartbeat and ready == self._ready_sent:
            return
        # out of turn when readiness changed (a generation worker's KV pairs are set up, or
        # one went down or came back): the router routes by it from that heartbeat on
        self._ready_sent = ready
        self._next_heartbeat = now + HEARTBEAT_S
        with self._lock:
            conns = list(self._connections)
        if not conns:
            return
        frame = Heartbeat(self.host.status(drain_events=True))
        for conn in conns:
            conn.queue(frame)
        self._flush_conns()

    def _flush_all(self) -> None:
        """After a step's updates: this step's KV events join the same write."""
        self._queue_kv_events()
        self._flush_conns()

    def _flush_conns(self) -> None:
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
            self.host.abort(rid)

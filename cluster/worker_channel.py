"""The router's end of a worker's request channel (``transport/requests.py`` has the frames,
``workers/process/channel_server.py`` why the path is a socket, not a Ray call): one asyncio connection
per worker process, one reader task that hands each update to the attempt it belongs to.

``connect`` sends the hello (protocol version and token) and waits for the worker's ack; a
worker that speaks another version, or refuses the token, raises ``ChannelRefused``.

A closed connection (the worker died, or the socket broke) ends every attempt on it at once with
CLOSED, long before any timeout; the router then treats the worker as failed for those attempts.

Heartbeats carry the worker's ``WorkerStatus``; the newest is kept in ``status`` (with
``status_at``) and handed to ``on_status``, which is how the router learns loads and events
without Ray calls.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Callable

from pdserve.transport.requests import (
    PROTOCOL_VERSION,
    Abort,
    Frame,
    FrameReader,
    Generate,
    Heartbeat,
    Hello,
    HelloAck,
    KvEvents,
    KvPeers,
    KvSnapshot,
    KvSnapshotQuery,
    ProtocolError,
    Refused,
    StatusQuery,
    StatusReply,
    Update,
    WireRequest,
    WorkerStatus,
    encode_frame,
)

log = logging.getLogger("pdserve.worker_channel")

READ_BYTES = 1 << 16


class ChannelClosed(ConnectionError):
    """The connection to the worker ended; ``str`` says why."""


class ChannelRefused(ConnectionError):
    """The worker refused the hello (another protocol version, or a wrong token)."""


CLOSED = object()  # put on an attempt's queue when the connection ends (else: WireUpdate)
_status_ids = itertools.count(1)


class WorkerChannel:
    def __init__(self, worker_id: str, endpoint: str, token: str,
                 on_status: Callable[[str, WorkerStatus], None] | None = None,
                 on_kv: Callable[["WorkerChannel", KvEvents | KvSnapshot], None] | None = None,
                 on_closed: Callable[["WorkerChannel"], None] | None = None) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.token = token
        self.on_status = on_status
        self.on_kv = on_kv  # KV events and snapshots, in arrival order
        self.on_closed = on_closed  # once, when the connection ends
        self.closed_reason: str | None = None
        self.last_heard = time.monotonic()  # any bytes from the worker (heartbeats included)
        self.status: WorkerStatus | None = None  # the newest heartbeat's status
        self.status_at = 0.0  # time.monotonic() it arrived
        self.connected_at = time.monotonic()
        self._attempts: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    @property
    def open(self) -> bool:
        return self._writer is not None and self.closed_reason is None

    async def connect(self, timeout_s: float) -> None:
        """Open the connection and shake hands, all within ``timeout_s``."""
        host, port = self.endpoint.rsplit(":", 1)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                sock = writer.get_extra_info("socket")
                if sock is not None:  # small frames must leave at once (no Nagle delay)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                writer.write(encode_frame(Hello(PROTOCOL_VERSION, self.token)))
                frames = FrameReader()
                ack = await self._first_frame(reader, frames)
            except BaseException:
                writer.close()
                raise
        if isinstance(ack, Refused):
            writer.close()
            raise ChannelRefused(f"{self.worker_id} ({self.endpoint}) refused the request "
                                 f"channel: {ack.reason}")
        if not isinstance(ack, HelloAck) or ack.version != PROTOCOL_VERSION:
            writer.close()
            raise ChannelRefused(f"{self.worker_id} ({self.endpoint}) answered the hello with {ack!r:.200}")
        self._writer = writer
        self.last_heard = self.connected_at = time.monotonic()
        self._reader_task = asyncio.create_task(self._read(reader, frames),
                                                name=f"pdserve-channel-{self.worker_id}")

    @staticmethod
    async def _first_frame(reader: asyncio.StreamReader, frames: FrameReader) -> Frame:
        """The worker's answer to the hello; frames after it stay in ``frames``."""
        while True:
            data = await reader.read(READ_BYTES)
            if not data:
                raise ConnectionResetError("the worker closed the connection during the hello")
            frames.feed(data)
            for frame in frames:
                return frame

    def attempt(self, attempt_id: int) -> asyncio.Queue:
        """The queue that receives this attempt's frames (and CLOSED if the connection ends)."""
        if self.closed_reason is not None:
            raise ChannelClosed(self.closed_reason)
        q: asyncio.Queue = asyncio.Queue()
        self._attempts[attempt_id] = q
        return q

    def forget(self, attempt_id: int) -> None:
        self._attempts.pop(attempt_id, None)

    def generate(self, wire: WireRequest) -> None:
        self._write(Generate(wire))

    async def fresh_status(self, timeout_s: float) -> WorkerStatus:
        """The worker's status as of its last step (asked now, answered between two steps);
        raises TimeoutError, or ChannelClosed if the connection ends first."""
        sid = -next(_status_ids)  # attempt ids are positive
        q = self.attempt(sid)
        try:
            self._write(StatusQuery(sid))
            async with asyncio.timeout(timeout_s):
                frame = await q.get()
            if frame is CLOSED:
                raise ChannelClosed(self.closed_reason or "closed")
            return frame
        finally:
            self.forget(sid)

    def abort(self, attempt_id: int) -> None:
        self._write(Abort(attempt_id))

    def send_kv_peers(self, peers: dict[str, str]) -> None:
        """A generation worker sets KV pairs up with these context workers (id -> endpoint)."""
        self._write(KvPeers(dict(peers)))

    def ask_kv_snapshot(self) -> None:
        """The worker answers between two steps with its whole cache (KvSnapshot)."""
        self._write(KvSnapshotQuery())

    def close(self, reason: str = "closed by the router") -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._end(reason)

    def _write(self, frame: Frame) -> None:
        if not self.open:
            raise ChannelClosed(self.closed_reason or "not connected")
        # The transport buffers; frames are small, and a worker that stops reading shows up as a
        # closed connection or as the router's per-update timeout.
        self._writer.write(encode_frame(frame))

    async def _read(self, reader: asyncio.StreamReader, frames: FrameReader) -> None:
        why = "the worker closed the connection"
        try:
            self._dispatch(frames)  # what arrived together with the ack
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                self.last_heard = time.monotonic()
                frames.feed(data)
                self._dispatch(frames)
        except asyncio.CancelledError:
            raise
        except ProtocolError as exc:  # the stream cannot be trusted after a bad frame
            why = f"request channel: protocol error from the worker: {exc}"
        except Exception as exc:  # broken socket: either way it is over
            why = f"request channel failed: {exc!r}"
        finally:
            self._end(why)

    def _dispatch(self, frames: FrameReader) -> None:
        attempts = self._attempts
        for frame in frames:
            if type(frame) is Update:
                q = attempts.get(frame.update.request_id)
                if q is not None:
                    q.put_nowait(frame.update)
            elif type(frame) is KvEvents or type(frame) is KvSnapshot:
                if self.on_kv is not None:
                    try:
                        self.on_kv(self, frame)
                    except Exception:  # a bad batch must not end the channel that carries requests
                        log.exception("KV events from %s could not be applied", self.worker_id)
            elif type(frame) is Heartbeat:
                self._on_heartbeat(frame.status)
            elif type(frame) is StatusReply:
                self._on_heartbeat(frame.status)
                q = attempts.get(frame.query_id)
                if q is not None:
                    q.put_nowait(frame.status)
            else:
                raise ProtocolError(f"a router does not take {type(frame).__name__} frames")

    def _on_heartbeat(self, status: WorkerStatus) -> None:
        self.status, self.status_at = status, time.monotonic()
        if self.on_status is not None:
            try:
                self.on_status(self.worker_id, status)
            except Exception:  # a bad status must not end the channel that carries requests
                log.exception("status from %s could not be applied", self.worker_id)

    def _end(self, why: str) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = why
        if self._writer is not None:
            self._writer.close()
        attempts, self._attempts = self._attempts, {}
        for q in attempts.values():
            q.put_nowait(CLOSED)
        if attempts:
            log.warning("request channel to %s (%s) closed with %d attempt(s) live: %s",
                        self.worker_id, self.endpoint, len(attempts), why)
        if self.on_closed is not None:
            try:
                self.on_closed(self)
            except Exception:
                log.exception("closing %s's channel: the close callback failed", self.worker_id)

"""The router's end of a worker's request channel (``workers/request_channel.py`` has the frames
and why the path is a socket, not a Ray call): one asyncio connection per worker process, one
reader task that hands each update to the attempt it belongs to.

A closed connection (the worker died, or the socket broke) ends every attempt on it at once with
CLOSED, long before any timeout; the router then treats the worker as failed for those attempts.

Heartbeats carry the worker's status; the newest is kept in ``status`` (with ``status_at``) and
handed to ``on_status``, which is how the router learns loads and events without Ray calls.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Any, Callable

from pdserve.transport.channel_frames import frame_unpacker, pack_frame

log = logging.getLogger("pdserve.worker_channel")

READ_BYTES = 1 << 16


class ChannelClosed(ConnectionError):
    """The connection to the worker ended; ``str`` says why."""


CLOSED = object()  # put on an attempt's queue when the connection ends
_status_ids = itertools.count(1)


class WorkerChannel:
    def __init__(self, worker_id: str, endpoint: str, token: str,
                 on_status: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.token = token
        self.on_status = on_status
        self.closed_reason: str | None = None
        self.last_heard = time.monotonic()  # any bytes from the worker (heartbeats included)
        self.status: dict[str, Any] | None = None  # the newest heartbeat's status
        self.status_at = 0.0  # time.monotonic() it arrived
        self.connected_at = time.monotonic()
        self._attempts: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    @property
    def open(self) -> bool:
        return self._writer is not None and self.closed_reason is None

    async def connect(self, timeout_s: float) -> None:
        host, port = self.endpoint.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:  # small frames must leave at once (no Nagle delay)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._writer = writer
        self.last_heard = self.connected_at = time.monotonic()
        writer.write(pack_frame({"op": "hello", "token": self.token}))
        self._reader_task = asyncio.create_task(self._read(reader),
                                                name=f"pdserve-channel-{self.worker_id}")

    def attempt(self, attempt_id: int) -> asyncio.Queue:
        """The queue that receives this attempt's frames (and CLOSED if the connection ends)."""
        if self.closed_reason is not None:
            raise ChannelClosed(self.closed_reason)
        q: asyncio.Queue = asyncio.Queue()
        self._attempts[attempt_id] = q
        return q

    def forget(self, attempt_id: int) -> None:
        self._attempts.pop(attempt_id, None)

    def generate(self, wire: dict[str, Any]) -> None:
        self._write({"op": "generate", "wire": wire})

    async def fresh_status(self, timeout_s: float) -> dict[str, Any]:
        """The worker's status as of its last step (asked now, answered between two steps);
        raises TimeoutError, or ChannelClosed if the connection ends first."""
        sid = -next(_status_ids)  # attempt ids are positive
        q = self.attempt(sid)
        try:
            self._write({"op": "status", "id": sid})
            async with asyncio.timeout(timeout_s):
                frame = await q.get()
            if frame is CLOSED:
                raise ChannelClosed(self.closed_reason or "closed")
            return frame["status"]
        finally:
            self.forget(sid)

    def abort(self, attempt_id: int) -> None:
        self._write({"op": "abort", "id": attempt_id})

    def close(self, reason: str = "closed by the router") -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._end(reason)

    def _write(self, frame: dict[str, Any]) -> None:
        if not self.open:
            raise ChannelClosed(self.closed_reason or "not connected")
        # The transport buffers; frames are small, and a worker that stops reading shows up as a
        # closed connection or as the router's per-update timeout.
        self._writer.write(pack_frame(frame))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        frames = frame_unpacker()
        why = "the worker closed the connection"
        try:
            while True:
                data = await reader.read(READ_BYTES)
                if not data:
                    break
                self.last_heard = time.monotonic()
                frames.feed(data)
                for frame in frames:
                    if not isinstance(frame, dict):
                        continue
                    if isinstance(frame.get("status"), dict):  # a heartbeat or a status answer
                        self._on_heartbeat(frame["status"])
                    q = self._attempts.get(frame.get("id"))
                    if q is not None:
                        q.put_nowait(frame)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # broken socket or a garbled stream: either way it is over
            why = f"request channel failed: {exc!r}"
        finally:
            self._end(why)

    def _on_heartbeat(self, status: dict[str, Any]) -> None:
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

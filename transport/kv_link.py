"""The direct KV control link: generation worker -> context worker, one TCP connection per pair,
in the request channel's framing (``transport/requests``: Hello, then ``KvControl`` frames).

It carries the hot control messages, KV requests and cancels, so a transfer's payload starts one
socket write after the generation worker issued it; a Ray actor call costs about 0.6 ms here
before the context worker sees it. Ray still carries every message as well, as the
``kv_transfer`` call that is the transfer's record on the dashboard and returns its
``TransferDone``: the context side runs whichever copy arrives first and folds the other into
it (``KVSender.submit``), so a link that is down, or that loses a frame as it breaks, costs
latency and never a transfer. The link is one-way: the generation side decides a transfer by
its own receive, and a refusal also arrives on the data plane (a header that is not OK).

Discovery: a context worker's ``KVSender`` publishes "host:port token" under ``LINK_KEY`` in
its rendezvous store; a generation worker's pair thread reads it when it connects to that store,
and dials. The token proves only that the dialer could read the store: the store, and the pair
groups that rendezvous on it, are the data plane's trust boundary (as for gloo and NCCL).
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Callable

from .requests import (
    PROTOCOL_VERSION, FrameReader, Hello, HelloAck, KvControl, ProtocolError, Refused,
    check_hello, encode_frame,
)

LINK_KEY = "pdserve/kv_link"  # in a context worker's rendezvous store: "host:port token"
HELLO_TIMEOUT_S = 5.0  # a dialer must say hello this soon
SEND_TIMEOUT_S = 1.0  # a write that cannot finish this soon means the peer stopped reading
READ_BYTES = 1 << 16

log = logging.getLogger("pdserve.transport")

# (endpoint the sender meant, encoded control message), on the connection's reader thread
LinkHandler = Callable[[str, bytes], None]


def _nodelay(sock: socket.socket) -> None:
    # Control frames are tiny and must leave at once (Nagle plus delayed ACKs: tens of ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class KvLinkServer:
    """The context worker's end: accepts links and hands each ``KvControl`` frame to
    ``on_message`` on that connection's reader thread (frames of one link in order)."""

    def __init__(self, host: str, on_message: LinkHandler, *, name: str) -> None:
        self.name = name
        self.token = secrets.token_hex(16)
        self._on_message = on_message
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"{name}-kv-link-accept", daemon=True).start()

    @property
    def published(self) -> str:
        """What goes under LINK_KEY."""
        return f"{self.address} {self.token}"

    @property
    def num_links(self) -> int:
        with self._lock:
            return len(self._socks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = list(self._socks)
        try:
            self._listener.close()
        except OSError:
            pass
        for s in socks:
            _shut(s)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            _nodelay(sock)
            sock.settimeout(HELLO_TIMEOUT_S)
            threading.Thread(target=self._read, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name=f"{self.name}-kv-link-read", daemon=True).start()

    def _read(self, sock: socket.socket, peer: str) -> None:
        frames = FrameReader()
        registered = False
        try:
            while True:
                try:
                    data = sock.recv(READ_BYTES)
                except TimeoutError:
                    if not registered:
                        log.warning("%s: KV link from %s sent no hello; closing", self.name, peer)
                        return
                    continue
                if not data:
                    return
                frames.feed(data)
                for frame in frames:
                    if registered:
                        if not isinstance(frame, KvControl):
                            raise ProtocolError(f"a KV link does not take {type(frame).__name__}")
                        try:
                            self._on_message(frame.endpoint, frame.payload)
                        except Exception as exc:  # noqa: BLE001 - one bad message is dropped
                            log.warning("%s: KV link message from %s dropped: %r",
                                        self.name, peer, exc)
                        continue
                    why = check_hello(frame, self.token, secrets.compare_digest)
                    if why is not None:
                        log.warning("%s: KV link from %s refused: %s", self.name, peer, why)
                        sock.sendall(encode_frame(Refused(why)))
                        return
                    sock.sendall(encode_frame(HelloAck(PROTOCOL_VERSION, self.name)))
                    sock.settimeout(None)  # idle links are fine; the peer's close ends recv
                    with self._lock:
                        if self._closed:
                            return
                        self._socks.add(sock)
                    registered = True
        except (OSError, ProtocolError) as exc:
            log.info("%s: KV link from %s ended: %r", self.name, peer, exc)
        finally:
            with self._lock:
                self._socks.discard(sock)
            _shut(sock)


class KvLink:
    """The generation worker's end, dialled and greeted in the constructor (raises on failure).
    ``send`` from any thread; a failed write closes the link (the Ray copy still goes)."""

    def __init__(self, address: str, token: str, *, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.address = address
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            _nodelay(sock)
            sock.sendall(encode_frame(Hello(PROTOCOL_VERSION, token)))
            frames = FrameReader()
            end = time.monotonic() + timeout_s
            answer = None
            while answer is None:
                sock.settimeout(max(1e-3, end - time.monotonic()))
                data = sock.recv(READ_BYTES)
                if not data:
                    raise ConnectionError(f"KV link {address} closed during the handshake")
                frames.feed(data)
                answer = next(iter(frames), None)
            if isinstance(answer, Refused):
                raise ConnectionError(f"KV link {address} refused: {answer.reason}")
            if not isinstance(answer, HelloAck):
                raise ProtocolError(f"KV link {address} answered {type(answer).__name__}")
            sock.settimeout(SEND_TIMEOUT_S)
        except BaseException:
            _shut(sock)
            raise
        self.peer_name = answer.worker_id
        self._sock = sock
        self._lock = threading.Lock()
        self.closed = False

    def send(self, endpoint: str, payload: bytes) -> bool:
        """Write one control message; False (and the link closed) if that failed."""
        data = encode_frame(KvControl(endpoint, payload))
        with self._lock:
            if self.closed:
                return False
            try:
                self._sock.sendall(data)
            except OSError as exc:
                log.info("KV link %s: write failed (%r); closing it", self.address, exc)
                self._close_locked()
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            _shut(self._sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def parse_published(value: str) -> tuple[str, str]:
    """(address, token) from what a context worker published under LINK_KEY."""
    address, _, token = value.partition(" ")
    if not address or not token or ":" not in address:
        raise ValueError(f"not a KV link address: {value!r:.80}")
    return address, token

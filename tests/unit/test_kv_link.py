"""The direct KV control link (transport/kv_link.py) over real loopback sockets: the hello and
its token, frames delivered in order to the handler, and a misbehaving peer cut off without
touching other links."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.transport.kv_link import KvLink, KvLinkServer, parse_published
from pdserve.transport.requests import (
    PROTOCOL_VERSION, FrameReader, Hello, Refused, StatusQuery, encode_frame,
)

TIMEOUT_S = 5.0


class Inbox:
    def __init__(self, fail_on: bytes = b"") -> None:
        self.items: list[tuple[str, bytes]] = []
        self.fail_on = fail_on
        self.cond = threading.Condition()

    def __call__(self, endpoint: str, payload: bytes) -> None:
        with self.cond:
            self.items.append((endpoint, payload))
            self.cond.notify_all()
        if payload == self.fail_on:
            raise ValueError("a message the handler cannot take")

    def wait(self, n: int) -> list[tuple[str, bytes]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, TIMEOUT_S), self.items
            return list(self.items)


@pytest.fixture
def server():
    inbox = Inbox(fail_on=b"bad")
    srv = KvLinkServer("127.0.0.1", inbox, name="ctx-test")
    yield srv, inbox
    srv.close()


def test_frames_arrive_in_order(server) -> None:
    srv, inbox = server
    address, token = parse_published(srv.published)
    link = KvLink(address, token, timeout_s=TIMEOUT_S)
    assert link.peer_name == "ctx-test"
    for i in range(200):
        assert link.send("127.0.0.1:1#7", i.to_bytes(2, "big"))
    got = inbox.wait(200)
    assert [int.from_bytes(p, "big") for _, p in got] == list(range(200))
    assert {e for e, _ in got} == {"127.0.0.1:1#7"}
    link.close()
    assert link.send("x", b"after close") is False


def test_a_handler_error_drops_one_message_not_the_link(server) -> None:
    srv, inbox = server
    link = KvLink(*parse_published(srv.published), timeout_s=TIMEOUT_S)
    assert link.send("e", b"bad") and link.send("e", b"good")
    assert [p for _, p in inbox.wait(2)] == [b"bad", b"good"]
    link.close()


def test_a_wrong_token_is_refused(server) -> None:
    srv, inbox = server
    address, _ = parse_published(srv.published)
    with pytest.raises(ConnectionError, match="wrong token"):
        KvLink(address, "not-the-token", timeout_s=TIMEOUT_S)
    assert srv.num_links == 0 and inbox.items == []


def test_a_peer_sending_other_frames_is_cut_off(server) -> None:
    srv, inbox = server
    address, token = parse_published(srv.published)
    good = KvLink(address, token, timeout_s=TIMEOUT_S)
    host, port = address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    raw.sendall(encode_frame(Hello(PROTOCOL_VERSION, token)))
    reader = FrameReader()
    reader.feed(raw.recv(1 << 16))
    assert not isinstance(next(iter(reader)), Refused)
    raw.sendall(encode_frame(StatusQuery(1)))  # not a KvControl: the server closes this link
    end = time.monotonic() + TIMEOUT_S
    closed = False
    while not closed and time.monotonic() < end:
        try:
            closed = raw.recv(1 << 16) == b""
        except ConnectionResetError:
            closed = True
    assert closed
    raw.close()
    assert good.send("e", b"still here")  # the other link is untouched
    assert inbox.wait(1)[-1] == ("e", b"still here")
    good.close()


def test_published_value_is_checked() -> None:
    assert parse_published("127.0.0.1:5 abc") == ("127.0.0.1:5", "abc")
    for bad in ("", "127.0.0.1:5", "nohost abc", " abc"):
        with pytest.raises(ValueError):
            parse_published(bad)

"""transport/protocol.py (messages, wire header, chunking) and both session state machines of
transport/sessions.py and session_sides.py (every transition, leases, deadlines, quarantine)
under a fake clock."""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Callable

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transport.protocol import (
    HEADER_LEN, PROTOCOL_VERSION, CancelTransfer, KVLayout, KVRequest, ProtocolError,
    TransferDescriptor, TransferDone, TransferRejected, WireHeader, WireStatus, choose_chunking,
    consecutive_fraction, decode_message, encode_message, group_name, group_order, plan_chunks,
    wire_tag,
)
from pdserve.transport.session_sides import ReceiverSessions, SenderSessions
from pdserve.transport.sessions import RecvState, SendState, TransitionError

LAYOUT = KVLayout("bfloat16", 4096, (2, 16, 2, 32))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def kv_request(ctx_request_id: int = 7, num_blocks: int = 3, *, transfer_id: int = 0,
               group: str = "pdserve-kv/c/g/1/0", timeout_s: float = 5.0,
               layout: KVLayout = LAYOUT, num_cached: int = 0) -> KVRequest:
    return KVRequest(transfer_id, 0, group, "gen-0", ctx_request_id, 900, num_blocks, num_cached,
                     tuple(range(50, 50 + num_blocks)), layout.dtype, layout.bytes_per_block,
                     layout.kv_shape, timeout_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tx(clock: FakeClock) -> SenderSessions:
    return SenderSessions("ctx-0", LAYOUT, clock=clock, lease_s=10.0)


@pytest.fixture
def rx(clock: FakeClock) -> ReceiverSessions:
    return ReceiverSessions("gen-0", LAYOUT, clock=clock, default_timeout_s=10.0)


def reserve(rx: ReceiverSessions, rid: int = 1, blocks: tuple[int, ...] = (10, 11, 12, 13),
            cached: int = 1, timeout_s: float | None = None) -> None:
    rx.reserve(rid, ctx_worker_id="ctx-0", ctx_request_id=7, block_ids=blocks,
               num_cached_blocks=cached, timeout_s=timeout_s)


# ---------------------------------------------------------------------------- messages


def test_each_message_round_trips() -> None:
    for msg in (kv_request(), TransferDone(3, 7, False, "lease expired", 0, 0.25),
                TransferDone(3, 7, True, "", 4096, 1.0), CancelTransfer(3, 7, "gen-0", "abort")):
        assert decode_message(encode_message(msg)) == msg


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**40), max_size=40), tid=st.integers(0, 2**62),
       timeout=st.floats(1e-3, 1e6), group=st.text(max_size=30))
def test_kv_request_round_trips_any_values(ids: list[int], tid: int, timeout: float,
                                           group: str) -> None:
    msg = KVRequest(tid, 3, group, "g", 1, 2, len(ids), 0, tuple(ids), "float32", 8,
                    (1, 2, 3, 4), timeout)
    assert decode_message(encode_message(msg)) == msg


def _raw(**body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _done_body(**over: object) -> dict[str, object]:
    body: dict[str, object] = {"v": PROTOCOL_VERSION, "type": "done", "transfer_id": 1,
                               "ctx_request_id": 2, "ok": True, "reason": "", "nbytes": 3,
                               "seconds": 0.5}
    body.update(over)
    return body


@pytest.mark.parametrize("payload, match", [
    ("not bytes", "must be bytes"),
    (b"\xc1\xc1", "undecodable"),
    (_raw(), "unsupported protocol version"),
    (msgpack.packb([1, 2]), "must be a map"),
    (_raw(**_done_body(v=99)), "unsupported protocol version"),
    (_raw(**_done_body(type="launch_missiles")), "unknown message type"),
    (_raw(**{k: v for k, v in _done_body().items() if k != "nbytes"}), "lacks nbytes"),
    (_raw(**_done_body(nbytes="3")), "'nbytes' must be int"),
    (_raw(**_done_body(nbytes=True)), "'nbytes' must be int"),
    (_raw(**_done_body(ok=1)), "'ok' must be bool"),
    (_raw(**_done_body(seconds="x")), "'seconds' must be float"),
])
def test_malformed_messages_raise_protocol_error(payload: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_message(payload)  # type: ignore[arg-type]


def test_kv_request_field_checks() -> None:
    good = msgpack.unpackb(encode_message(kv_request()))
    for key, bad, match in [("gen_block_ids", [1, "x"], "must be ints"),
                            ("kv_shape", [1, 2, 3], "must be shape"),
                            ("num_blocks", 5, "num_blocks differs"),
                            ("timeout_s", 0, "positive"),
                            ("timeout_s", math.inf, "positive"),
                            ("timeout_s", math.nan, "positive")]:
        with pytest.raises(ProtocolError, match=match):
            decode_message(_raw(**{**good, key: bad}))


def test_kv_request_carries_the_plane_count() -> None:
    """num_planes (2 = K and V, 1 = an MLA latent) travels with the layout; a peer that
    predates the field has K and V; a count below one is malformed."""
    mla = KVLayout("bfloat16", 4096, (2, 16, 1, 64), num_planes=1)
    req = dataclasses.replace(kv_request(layout=mla), num_planes=1, kv_shape=mla.kv_shape)
    assert decode_message(encode_message(req)).layout == mla
    body = msgpack.unpackb(encode_message(req))
    del body["num_planes"]
    assert decode_message(_raw(**body)).num_planes == 2
    with pytest.raises(ProtocolError, match="num_planes"):
        decode_message(_raw(**{**body, "num_planes": 0}))


def test_extra_fields_are_ignored_and_int_is_a_float() -> None:
    body = _done_body(seconds=2, future_field=[1, 2])
    msg = decode_message(_raw(**body))
    assert msg == TransferDone(1, 2, True, "", 3, 2.0) and isinstance(msg.seconds, float)


def test_encoding_a_non_message_raises() -> None:
    with pytest.raises(ProtocolError):
        encode_message(object())  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- wire level


def test_wire_header_round_trip_and_validation() -> None:
    h = WireHeader(5, int(WireStatus.OK), 9, 7, 3, 4096, 1, 2)
    ints = h.to_ints()
    assert len(ints) == HEADER_LEN and WireHeader.from_ints(ints) == h
    with pytest.raises(ProtocolError, match="bad wire header"):
        WireHeader.from_ints([0, *ints[1:]])
    with pytest.raises(ProtocolError, match="bad wire header"):
        WireHeader.from_ints(ints[:-1])
    with pytest.raises(ProtocolError, match="bad wire status"):
        WireHeader.from_ints([ints[0], 5, 99, *ints[3:]])
    with pytest.raises(ProtocolError, match="no chunk size"):
        WireHeader.from_ints([*ints[:-1], 0])
    refused = WireHeader(5, int(WireStatus.REJECTED), 9, 7, 0, 4096, 0, 0)
    assert WireHeader.from_ints(refused.to_ints()) == refused


@settings(max_examples=100, deadline=None)
@given(planes=st.integers(1, 80), n=st.integers(0, 300), per_plane=st.integers(1, 64),
       per_block=st.integers(1, 64))
def test_plan_chunks_tile_every_plane_and_block_once(planes: int, n: int, per_plane: int,
                                                     per_block: int) -> None:
    chunks = plan_chunks(planes, n, per_plane, per_block)
    cells = [(p, b) for c in chunks for p in range(c.plane_start, c.plane_stop)
             for b in range(c.block_start, c.block_stop)]
    assert sorted(cells) == [(p, b) for p in range(planes) for b in range(n)]
    assert len(cells) == len(set(cells)) == sum(c.num_rows for c in chunks)


@settings(max_examples=150, deadline=None)
@given(planes=st.integers(1, 128), n=st.integers(0, 2000), row=st.integers(1, 1 << 16),
       target=st.integers(1 << 10, 1 << 24), runs=st.booleans())
def test_choose_chunking(planes: int, n: int, row: int, target: int, runs: bool) -> None:
    q, c = choose_chunking(planes, n, row, target, runs=runs)
    assert 1 <= q <= planes and 1 <= c <= max(1, n)
    assert q == 1 or c == max(1, n)  # a chunk is one plane, or whole planes
    chunks = plan_chunks(planes, n, q, c)
    if n and planes * n * row > target:
        if runs:
            assert q == 1  # single-plane chunks: a run of ids is one contiguous pool slice
        else:  # something to overlap, and no chunk above the target unless one row is bigger
            assert len(chunks) >= min(4, planes * n)
            assert max(ch.num_rows for ch in chunks) * row <= max(target, row)
    elif n:
        assert len(chunks) == 1  # small payloads travel as one message


def test_consecutive_fraction() -> None:
    assert consecutive_fraction([]) == consecutive_fraction([7]) == 1.0
    assert consecutive_fraction([3, 4, 5, 6]) == 1.0
    assert consecutive_fraction([3, 4, 9, 10]) == pytest.approx(2 / 3)
    assert consecutive_fraction([5, 4, 3]) == 0.0


def test_wire_tags_are_int32_and_distinct() -> None:
    tags = {wire_tag(s, i) for s in range(300) for i in range(20)}
    assert len(tags) == 300 * 20
    assert all(0 <= t < 2**31 for t in tags | {wire_tag(2**40, 2**20)})


def test_group_names_order_by_incarnation_then_epoch() -> None:
    a, b, c = group_name("c", "g", 5, 9), group_name("c", "g", 6, 0), group_name("c", "g", 6, 1)
    assert group_order(a) < group_order(b) < group_order(c)
    assert len({a, b, c}) == 3
    with pytest.raises(ProtocolError):
        group_order("garbage")


def test_descriptor_sizes_and_checks() -> None:
    d = TransferDescriptor(1, 0, "g", "c", "g", 7, 9, (4, 5), (8, 9), 2, LAYOUT)
    assert (d.num_blocks, d.total_bytes, d.dtype, d.bytes_per_block) == (2, 8192, "bfloat16", 4096)
    with pytest.raises(ValueError):
        TransferDescriptor(1, 0, "g", "c", "g", 7, 9, (4,), (8, 9), 2, LAYOUT)
    with pytest.raises(ValueError):
        TransferDescriptor(1, -1, "g", "c", "g", 7, 9, (), (8, 9), 2, LAYOUT)


# ---------------------------------------------------------------------------- sender sessions


def test_sender_happy_path_sends_only_trailing_blocks(tx: SenderSessions) -> None:
    tx.lease(7, [1, 2, 3, 4, 5])
    d = tx.claim(kv_request(7, num_blocks=3, num_cached=2))
    assert d.ctx_block_ids == (3, 4, 5) and d.gen_block_ids == (50, 51, 52)
    assert d.total_bytes == 3 * LAYOUT.bytes_per_block and d.num_cached_blocks == 2
    assert tx.state_of(7) == SendState.SENDING and tx.poll() == []
    assert tx.begin_op(7)
    tx.op_finished(7, ok=True, nbytes=d.total_bytes, seconds=0.5)
    (r,) = tx.poll()
    assert (r.request_id, r.state, r.ok, r.nbytes, r.block_ids) == (
        7, SendState.SENT, True, d.total_bytes, (1, 2, 3, 4, 5))
    assert tx.num_active == 0 and tx.poll() == []
    record = tx.transfer_records()[-1]
    assert (record.outcome, record.peer, record.nbytes, record.side) == (
        "SENT", "gen-0", d.total_bytes, "send")
    assert tx.stats() == (0, 0, {"SENT": 1}, d.total_bytes)
    assert (tx.transfers.sent, tx.transfers.bytes_sent, tx.transfers.seconds) == (
        1, d.total_bytes, 0.5)


@pytest.mark.parametrize("setup, req, match", [
    (lambda tx: None, kv_request(7), "unknown context request"),
    (lambda tx: tx.lease(7, [1, 2]), kv_request(7, num_blocks=3), "asked for 3 blocks"),
    (lambda tx: tx.lease(7, [1, 2, 3]),
     kv_request(7, layout=KVLayout("float32", 4096, (2, 16, 2, 32))), "layout mismatch"),
    (lambda tx: (tx.lease(7, [1, 2, 3]), tx.claim(kv_request(7))), kv_request(7), "is SENDING"),
])
def test_claim_refusals(tx: SenderSessions, setup: Callable[[SenderSessions], object],
                        req: KVRequest, match: str) -> None:
    setup(tx)
    with pytest.raises(TransferRejected, match=match):
        tx.claim(req)


def test_lease_expires_unclaimed(tx: SenderSessions, clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3], lease_s=2.0)
    clock.advance(1.9)
    assert tx.poll() == []
    clock.advance(0.1)
    (r,) = tx.poll()
    assert (r.state, r.ok, r.reason, r.block_ids) == (SendState.EXPIRED, False,
                                                      "deadline exceeded", (1, 2, 3))
    with pytest.raises(TransferRejected, match="unknown"):
        tx.claim(kv_request(7))


def test_claim_after_lease_ran_out_expires_it(tx: SenderSessions, clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3], lease_s=2.0)
    clock.advance(3.0)
    with pytest.raises(TransferRejected, match="expired"):
        tx.claim(kv_request(7))
    assert [r.state for r in tx.poll()] == [SendState.EXPIRED]


def test_claim_sets_the_transfer_deadline(tx: SenderSessions, clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3], lease_s=1.0)
    tx.claim(kv_request(7, timeout_s=5.0))
    clock.advance(4.0)  # past the lease, within the transfer deadline
    assert tx.poll() == [] and tx.remaining_s(7) == pytest.approx(1.0)
    clock.advance(1.0)
    assert tx.begin_op(7) is False  # past its deadline: the op must not touch the blocks
    (r,) = tx.poll()
    assert (r.state, r.reason) == (SendState.FAILED, "deadline exceeded")


def test_sender_cancel_in_each_live_state(tx: SenderSessions) -> None:
    tx.lease(1, [1])
    assert tx.cancel(1)
    tx.lease(2, [2, 3, 4])
    tx.claim(kv_request(2))
    assert tx.cancel(2, "gen gone")
    assert tx.begin_op(2) is False  # queued op of a cancelled session sends no payload
    results = {r.request_id: r for r in tx.poll()}
    assert results[1].state == results[2].state == SendState.CANCELLED
    assert results[2].reason == "gen gone" and tx.num_quarantined_blocks == 0
    assert tx.cancel(2) is False and tx.cancel(99) is False


def test_cancel_in_flight_send_quarantines_until_quiescent(tx: SenderSessions) -> None:
    tx.lease(7, [1, 2, 3, 4])
    tx.claim(kv_request(7))
    assert tx.begin_op(7)
    assert tx.cancel(7)
    assert tx.state_of(7) == SendState.CANCELLED
    assert tx.poll() == [] and tx.num_quarantined_blocks == 4 and tx.num_active == 1
    assert tx.stats().num_quarantined_blocks == 4
    tx.op_finished(7, ok=True, nbytes=123, seconds=0.1)  # the op ran to its end anyway
    (r,) = tx.poll()
    assert (r.state, r.ok, r.block_ids) == (SendState.CANCELLED, False, (1, 2, 3, 4))
    assert tx.num_quarantined_blocks == 0 and tx.num_active == 0


def test_in_flight_send_past_deadline_fails_into_quarantine(tx: SenderSessions,
                                                            clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3])
    tx.claim(kv_request(7, timeout_s=2.0))
    assert tx.begin_op(7)
    clock.advance(2.5)
    assert tx.poll() == [] and tx.state_of(7) == SendState.FAILED
    assert tx.num_quarantined_blocks == 3
    tx.op_finished(7, ok=False, nbytes=0, seconds=2.5, reason="timeout")
    (r,) = tx.poll()
    assert (r.state, r.reason) == (SendState.FAILED, "deadline exceeded")


def test_failed_send_reports_reason(tx: SenderSessions) -> None:
    tx.lease(7, [1, 2, 3])
    tx.claim(kv_request(7))
    assert tx.begin_op(7)
    tx.op_finished(7, ok=False, nbytes=0, seconds=0.1, reason="connection closed")
    (r,) = tx.poll()
    assert (r.state, r.ok, r.reason, r.nbytes) == (SendState.FAILED, False, "connection closed", 0)
    assert tx.transfer_records()[-1].outcome == "FAILED"


def test_transfers_are_counted_when_poll_hands_them_back(tx: SenderSessions, rx: ReceiverSessions,
                                                         clock: FakeClock) -> None:
    """The log is written by the thread that polls (the engine core's, which reads it), once per
    session; a worker with both roles counts both sides into one log."""
    rx.count_into(tx.transfers)
    tx.lease(7, [1, 2, 3], lease_s=2.0)
    tx.lease(8, [4, 5])
    d = tx.claim(kv_request(8, num_blocks=2))
    assert tx.begin_op(8)
    tx.op_finished(8, ok=True, nbytes=d.total_bytes, seconds=0.25)
    reserve(rx, 1, timeout_s=1.0)
    assert tx.transfers.records == deque() and tx.transfers.sent == 0  # final, not handed back
    clock.advance(2.0)
    assert [r.request_id for r in tx.poll()] == [8, 7] and [r.request_id for r in rx.poll()] == [1]
    t = tx.transfers
    assert (t.sent, t.received, t.failed, t.leases_expired) == (1, 0, 2, 1)
    assert (t.bytes_sent, t.bytes_received, t.seconds) == (d.total_bytes, 0, 0.25)
    assert t.outcomes == {"EXPIRED": 1, "SENT": 1, "TIMED_OUT": 1}
    assert [(r.request_id, r.side, r.outcome) for r in t.records] == [
        (8, "send", "SENT"), (7, "send", "EXPIRED"), (1, "recv", "TIMED_OUT")]
    assert rx.transfer_records() == tx.transfer_records()


def test_group_destroyed_releases_only_that_groups_quarantine(tx: SenderSessions) -> None:
    for rid, group in [(1, "pdserve-kv/c/a/1/0"), (2, "pdserve-kv/c/b/1/0")]:
        tx.lease(rid, [rid * 10, rid * 10 + 1])
        tx.claim(kv_request(rid, num_blocks=2, group=group))
        assert tx.begin_op(rid)
        tx.cancel(rid)
    assert tx.num_quarantined_blocks == 4
    assert tx.group_destroyed("pdserve-kv/c/a/1/0") == 1
    assert [r.request_id for r in tx.poll()] == [1] and tx.num_quarantined_blocks == 2


def test_sender_illegal_transitions_raise(tx: SenderSessions) -> None:
    tx.lease(7, [1, 2, 3])
    with pytest.raises(TransitionError):
        tx.lease(7, [4])  # two live sessions for one request
    with pytest.raises(TransitionError):
        tx.op_finished(7, ok=True, nbytes=0, seconds=0.0)  # no op was begun
    tx.claim(kv_request(7))
    assert tx.begin_op(7)
    with pytest.raises(TransitionError):
        tx.begin_op(7)
    tx.op_finished(7, ok=True, nbytes=0, seconds=0.0)
    with pytest.raises(TransitionError):
        tx.op_finished(7, ok=True, nbytes=0, seconds=0.0)
    assert tx.fail(7, "late") is False  # final already: data-plane races are tolerated


# ---------------------------------------------------------------------------- receiver sessions


def test_receiver_happy_path(rx: ReceiverSessions, clock: FakeClock) -> None:
    reserve(rx, 1, (10, 11, 12, 13), cached=1, timeout_s=8.0)
    assert rx.state_of(1) == RecvState.RESERVED
    clock.advance(3.0)
    msg = rx.request(1, group="pdserve-kv/ctx-0/gen-0/1/0", seq=4)
    assert (msg.num_blocks, msg.num_cached_blocks, msg.gen_block_ids) == (3, 1, (11, 12, 13))
    assert (msg.seq, msg.ctx_request_id, msg.gen_request_id, msg.timeout_s) == (4, 7, 1, 5.0)
    assert (msg.dtype, msg.bytes_per_block, msg.kv_shape) == (
        LAYOUT.dtype, LAYOUT.bytes_per_block, LAYOUT.kv_shape)
    d = rx.descriptor(1)
    assert d is not None and d.transfer_id == msg.transfer_id and d.ctx_block_ids == ()
    assert rx.find_transfer(msg.transfer_id, 7) == 1
    assert rx.state_of(1) == RecvState.REQUESTED
    assert rx.begin_op(1) and rx.state_of(1) == RecvState.RECEIVING
    rx.op_finished(1, ok=True, nbytes=d.total_bytes, seconds=0.2)
    (r,) = rx.poll()
    assert (r.state, r.ok, r.nbytes, r.block_ids) == (RecvState.COMPLETE, True, 3 * 4096,
                                                      (10, 11, 12, 13))
    assert rx.transfer_records()[-1] == (msg.transfer_id, 1, "ctx-0", 3 * 4096, 0.2, "COMPLETE",
                                         "", "recv")


def test_transfer_ids_are_unique(rx: ReceiverSessions) -> None:
    ids = []
    for rid in range(5):
        reserve(rx, rid)
        ids.append(rx.request(rid, group="g", seq=rid).transfer_id)
    assert len(set(ids)) == 5


@pytest.mark.parametrize("state", ["RESERVED", "REQUESTED"])
def test_receiver_times_out_before_the_op(rx: ReceiverSessions, clock: FakeClock,
                                          state: str) -> None:
    reserve(rx, 1, timeout_s=2.0)
    if state == "REQUESTED":
        rx.request(1, group="g", seq=0)
    clock.advance(2.0)
    (r,) = rx.poll()
    assert (r.state, r.ok) == (RecvState.TIMED_OUT, False)
    assert rx.begin_op(1) is False  # the pair thread then drains instead of writing


def test_receiver_timed_out_in_flight_is_quarantined(rx: ReceiverSessions,
                                                     clock: FakeClock) -> None:
    reserve(rx, 1, (10, 11, 12), cached=0, timeout_s=2.0)
    rx.request(1, group="g", seq=0)
    assert rx.begin_op(1)
    clock.advance(5.0)
    assert rx.poll() == [] and rx.state_of(1) == RecvState.TIMED_OUT
    assert rx.num_quarantined_blocks == 3
    rx.op_finished(1, ok=True, nbytes=3 * 4096, seconds=5.0)  # landed late: still timed out
    (r,) = rx.poll()
    assert (r.state, r.ok, r.nbytes) == (RecvState.TIMED_OUT, False, 0)
    assert rx.num_quarantined_blocks == 0


def test_data_plane_timeout_is_timed_out_not_failed(rx: ReceiverSessions) -> None:
    """The pair thread's wait (same deadline) can run out just before the clock check in poll:
    it reports expiry, and the session ends TIMED_OUT either way, after its quarantine."""
    reserve(rx, 1, (10, 11), cached=0, timeout_s=2.0)
    rx.request(1, group="g", seq=0)
    assert rx.begin_op(1)
    assert rx.expire(1)
    assert rx.poll() == [] and rx.num_quarantined_blocks == 2
    assert rx.fail(1, "wait timed out") is False and rx.expire(1) is False
    rx.op_finished(1, ok=False, nbytes=0, seconds=2.0, reason="wait timed out")
    (r,) = rx.poll()
    assert (r.state, r.ok, r.reason) == (RecvState.TIMED_OUT, False, "deadline exceeded")
    assert rx.transfers.outcomes == {"TIMED_OUT": 1} and rx.transfers.failed == 1


@pytest.mark.parametrize("state", ["RESERVED", "REQUESTED", "RECEIVING"])
def test_receiver_cancel_in_each_live_state(rx: ReceiverSessions, state: str) -> None:
    reserve(rx, 1, (10, 11), cached=0)
    if state != "RESERVED":
        rx.request(1, group="g", seq=0)
    if state == "RECEIVING":
        assert rx.begin_op(1)
    assert rx.cancel(1)
    if state == "RECEIVING":
        assert rx.poll() == [] and rx.num_quarantined_blocks == 2
        rx.op_finished(1, ok=False, nbytes=0, seconds=0.0, reason="peer gone")
    (r,) = rx.poll()
    assert (r.state, r.reason) == (RecvState.CANCELLED, "cancelled")
    assert rx.cancel(1) is False


@pytest.mark.parametrize("state", ["RESERVED", "REQUESTED", "RECEIVING"])
def test_receiver_failure_in_each_live_state(rx: ReceiverSessions, state: str) -> None:
    reserve(rx, 1, (10, 11), cached=0)
    if state != "RESERVED":
        rx.request(1, group="g", seq=0)
    if state == "RECEIVING":
        assert rx.begin_op(1)
        rx.op_finished(1, ok=False, nbytes=0, seconds=0.1, reason="connection closed")
    else:
        assert rx.fail(1, "refused")
    (r,) = rx.poll()
    assert r.state == RecvState.FAILED and r.reason in {"refused", "connection closed"}


def test_receiver_illegal_transitions_raise(rx: ReceiverSessions) -> None:
    with pytest.raises(ValueError):
        reserve(rx, 1, (10, 11), cached=3)
    with pytest.raises(TransitionError):
        rx.request(1, group="g", seq=0)  # nothing reserved
    reserve(rx, 1)
    with pytest.raises(TransitionError):
        reserve(rx, 1)
    assert rx.begin_op(1) is False  # RESERVED: no KV request went out, nothing may land
    rx.request(1, group="g", seq=0)
    with pytest.raises(TransitionError):
        rx.request(1, group="g", seq=1)
    rx.cancel(1)
    with pytest.raises(TransitionError):
        rx.request(1, group="g", seq=1)  # CANCELLED -> REQUESTED


# ---------------------------------------------------------------------------- property


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(
    ["reserve", "request", "begin", "finish_ok", "finish_err", "cancel", "fail", "tick", "poll"]),
    st.integers(0, 3)), max_size=60))
def test_receiver_invariants_under_random_operations(ops: list[tuple[str, int]]) -> None:
    """Whatever happens: each session is handed back exactly once, never while its op is in
    flight, and the quarantine count is exactly the blocks of final in-flight sessions."""
    clock = FakeClock()
    rx = ReceiverSessions("gen", LAYOUT, clock=clock, default_timeout_s=3.0)
    in_flight: set[int] = set()
    reserved: set[int] = set()
    handed: list[int] = []
    for op, rid in ops:
        if op == "reserve" and rid not in reserved:
            reserve(rx, rid, (rid * 10, rid * 10 + 1), cached=0)
            reserved.add(rid)
        elif op == "request" and rx.state_of(rid) == RecvState.RESERVED:
            rx.request(rid, group="g", seq=0)
        elif op == "begin" and rid not in in_flight:
            if rx.begin_op(rid):
                in_flight.add(rid)
        elif op in ("finish_ok", "finish_err") and rid in in_flight:
            rx.op_finished(rid, ok=op == "finish_ok", nbytes=1, seconds=0.0, reason="x")
            in_flight.discard(rid)
        elif op == "cancel":
            rx.cancel(rid)
        elif op == "fail":
            rx.fail(rid, "x")
        elif op == "tick":
            clock.advance(1.0)
        for r in rx.poll():
            assert r.request_id not in in_flight
            handed.append(r.request_id)
        quarantined = sum(2 for r in in_flight if rx.state_of(r) not in (
            RecvState.RECEIVING, None))
        assert rx.num_quarantined_blocks == quarantined
    assert len(handed) == len(set(handed))
    assert rx.num_active == len(reserved) - len(handed)


def test_done_endpoint_gone_is_a_field_and_may_be_absent():
    gone = TransferDone(1, 2, False, "endpoint gone: 127.0.0.1:5#9", 0, 0.0, endpoint_gone=True)
    assert decode_message(encode_message(gone)).endpoint_gone is True
    # A done without the field (as version 1 first wrote it) is not a gone endpoint.
    assert decode_message(_raw(**_done_body(ok=False, reason="x"))).endpoint_gone is False
    with pytest.raises(ProtocolError, match="endpoint_gone"):
        decode_message(_raw(**_done_body(endpoint_gone="yes")))


# ---------------------------------------------------------------------------- self-healing pairs
# A pair group that breaks fails only the op in flight on it: ops queued behind it move to the
# rebuilt group (the generation side re-issues them, the context side gives their claims back).

G0, G1 = "pdserve-kv/c/g/1/0", "pdserve-kv/c/g/1/1"


def test_pair_open_and_the_new_done_fields_round_trip() -> None:
    from pdserve.transport.protocol import PairOpen

    opening = PairOpen(G1, "gen-0", 30.0)
    assert decode_message(encode_message(opening)) == opening
    with pytest.raises(ProtocolError, match="timeout_s"):
        PairOpen(G1, "gen-0", 0.0)
    done = TransferDone(3, 7, False, "superseded", 0, 0.0, group=G0, seq=4, retryable=True)
    assert decode_message(encode_message(done)) == done
    # A done from a peer that predates these fields names no op and is no retry.
    old = decode_message(_raw(**_done_body(ok=False, reason="x")))
    assert (old.group, old.seq, old.retryable) == ("", -1, False)


def test_a_claim_dropped_with_its_group_goes_back_to_the_lease(tx: SenderSessions) -> None:
    tx.lease(7, [1, 2, 3])
    d = tx.claim(kv_request(7, group=G0))
    assert tx.release_claim(d)
    assert tx.state_of(7) == SendState.LEASED and tx.poll() == []
    again = tx.claim(kv_request(7, group=G1))  # the re-issue claims it like a first request
    assert again.group == G1 and tx.state_of(7) == SendState.SENDING


def test_a_reissue_takes_over_its_own_claim_from_an_older_group(tx: SenderSessions,
                                                                  clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3])
    old = tx.claim(kv_request(7, group=G0, timeout_s=5.0))
    clock.advance(1.0)
    new = tx.claim(kv_request(7, group=G1, timeout_s=5.0))  # the old op had not begun
    assert (new.group, new.transfer_id) == (G1, old.transfer_id)
    assert tx.remaining_s(7) == pytest.approx(5.0)
    # The old op's answer touches nothing: the claim is the new op's now.
    assert not tx.release_claim(old) and not tx.fail_claim(old, "pair group retired")
    assert tx.state_of(7) == SendState.SENDING
    # Not another transfer, not an older group, not one already on the wire.
    with pytest.raises(TransferRejected, match="is SENDING"):
        tx.claim(kv_request(7, group="pdserve-kv/c/g/1/2", transfer_id=99))
    with pytest.raises(TransferRejected, match="is SENDING"):
        tx.claim(kv_request(7, group=G0))
    assert tx.begin_op(7)
    with pytest.raises(TransferRejected, match="is SENDING"):
        tx.claim(kv_request(7, group="pdserve-kv/c/g/1/2"))
    assert not tx.release_claim(new)  # in flight: it fails or succeeds, never goes back
    tx.op_finished(7, ok=False, nbytes=0, seconds=0.1, reason="connection closed")
    assert tx.poll()[0].state == SendState.FAILED


def test_a_released_lease_still_expires(tx: SenderSessions, clock: FakeClock) -> None:
    tx.lease(7, [1, 2, 3])
    d = tx.claim(kv_request(7, group=G0, timeout_s=2.0))
    assert tx.release_claim(d)
    clock.advance(2.5)  # nobody re-issued it (the generation worker died): the blocks go
    assert tx.check_deadlines() == 1
    assert tx.poll()[0].state == SendState.EXPIRED


def test_reissue_moves_a_queued_op_to_the_new_group(rx: ReceiverSessions, clock: FakeClock) -> None:
    reserve(rx, timeout_s=10.0)
    first = rx.request(1, group=G0, seq=3)
    clock.advance(4.0)
    again = rx.reissue(1, group=G1, seq=1)
    assert again is not None
    assert (again.group, again.seq, again.transfer_id) == (G1, 1, first.transfer_id)
    assert again.timeout_s == pytest.approx(6.0)  # the same deadline, not a new one
    assert rx.current_op(1) == (G1, 1)
    assert rx.begin_op(1)
    assert rx.reissue(1, group="pdserve-kv/c/g/1/2", seq=1) is None  # receiving: in flight
    rx.op_finished(1, ok=True, nbytes=0, seconds=0.1)
    assert rx.reissue(1, group="pdserve-kv/c/g/1/2", seq=1) is None  # final


def test_no_reissue_past_the_deadline(rx: ReceiverSessions, clock: FakeClock) -> None:
    reserve(rx, timeout_s=2.0)
    rx.request(1, group=G0, seq=1)
    clock.advance(2.0)
    assert rx.reissue(1, group=G1, seq=1) is None
    assert rx.current_op(1) == (G0, 1)

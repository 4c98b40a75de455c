"""Layer-wise KV streaming, the pure parts: the stream flag on KV requests, the trailer that
carries the first token, layer-aligned chunking, the generation side's count of layer arrivals
(any order, duplicates refused), and the session rules under random interleavings of arrivals,
deadlines and cancels: a session with layers in flight is never released, a partial arrival
at its deadline ends TIMED_OUT with its blocks quarantined until the data plane is quiet."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transport.protocol import (
    HEADER_LEN, PROTOCOL_VERSION, KVLayout, KVRequest, LayerArrivals,
    ProtocolError, WireStatus, WireTrailer, choose_chunking, chunk_layer, decode_message,
    encode_message, layer_aligned, plan_chunks,
)
from pdserve.transport.session_sides import ReceiverSessions, SenderSessions
from pdserve.transport.sessions import RecvState, SendState

LAYOUT = KVLayout("float32", 4 * 2 * 16 * 2 * 32 * 4, (4, 16, 2, 32))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _request(stream: bool) -> KVRequest:
    return KVRequest(3, 1, "pdserve-kv/c/g/1/0", "gen-0", 7, 9, 2, 0, (5, 6), LAYOUT.dtype,
                     LAYOUT.bytes_per_block, LAYOUT.kv_shape, 5.0, stream)


def test_the_stream_flag_round_trips_and_defaults_to_after_prefill() -> None:
    for stream in (False, True):
        assert decode_message(encode_message(_request(stream))).stream is stream
    body = msgpack.unpackb(encode_message(_request(True)), raw=False)
    del body["stream"]  # a peer that predates the flag
    assert decode_message(msgpack.packb(body)).stream is False
    body["stream"] = 1
    with pytest.raises(ProtocolError, match="stream"):
        decode_message(msgpack.packb(body))
    assert body["v"] == PROTOCOL_VERSION


def test_trailer_round_trip_and_checks() -> None:
    ok = WireTrailer(4, int(WireStatus.OK), 17)
    ints = ok.to_ints()
    assert len(ints) == HEADER_LEN and WireTrailer.from_ints(ints) == ok
    cancelled = WireTrailer(4, int(WireStatus.CANCELLED), -1)
    assert WireTrailer.from_ints(cancelled.to_ints()) == cancelled
    with pytest.raises(ProtocolError, match="trailer"):
        WireTrailer.from_ints([0] * HEADER_LEN)  # a header where a trailer belongs
    with pytest.raises(ProtocolError, match="status"):
        WireTrailer.from_ints(WireTrailer(4, int(WireStatus.REJECTED), -1).to_ints())
    with pytest.raises(ProtocolError, match="first token"):
        WireTrailer.from_ints(WireTrailer(4, int(WireStatus.OK), -1).to_ints())


@given(st.integers(1, 8), st.integers(1, 40), st.integers(1, 4096), st.integers(256, 1 << 16),
       st.booleans(), st.sampled_from([1, 2]))
def test_layer_aligned_chunks_never_span_layers(layers: int, n: int, row: int, target: int,
                                                runs: bool, per_layer: int) -> None:
    """per_layer: planes per layer, 2 for K and V, 1 for an MLA latent."""
    planes = per_layer * layers
    per_chunk, blocks = choose_chunking(planes, n, row, target, runs=runs)
    per_chunk = layer_aligned(per_chunk, per_layer)
    chunks = plan_chunks(planes, n, per_chunk, blocks)
    for c in chunks:
        assert c.plane_start // per_layer == chunk_layer(c, per_layer)  # one layer per chunk
    # wire order is layer-major: a chunk never needs a later layer than the one after it
    assert [chunk_layer(c, per_layer) for c in chunks] == sorted(
        chunk_layer(c, per_layer) for c in chunks)
    assert {chunk_layer(c, per_layer) for c in chunks} == set(range(layers))


@settings(max_examples=200)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 2), st.integers(1, 12),
       st.randoms(use_true_random=False), st.sampled_from([1, 2]))
def test_arrivals_in_any_order_land_every_layer_once(layers: int, n: int, per_chunk: int,
                                                     blocks: int, rnd, per_layer: int) -> None:
    chunks = plan_chunks(per_layer * layers, n, per_chunk, min(blocks, n))
    arrivals = LayerArrivals(chunks, layers, per_layer)
    order = list(range(len(chunks)))
    rnd.shuffle(order)
    landed: set[int] = set()
    for k, i in enumerate(order):
        assert not arrivals.complete
        arrivals.arrive(i)
        landed.add(i)
        # the leading layers reported landed are exactly those whose every chunk is in
        expect = 0
        while expect < layers and all(
                j in landed for j, c in enumerate(chunks)
                if c.plane_start // per_layer <= expect <= chunk_layer(c, per_layer)):
            expect += 1
        assert arrivals.layers_landed == expect
        with pytest.raises(ProtocolError, match="twice"):
            arrivals.arrive(order[rnd.randrange(k + 1)])  # a duplicate is refused
    assert arrivals.complete and arrivals.layers_landed == layers
    with pytest.raises(ProtocolError, match="not in the payload"):
        arrivals.arrive(len(chunks))


# ------------------------------------------------------------------ sessions under interleavings

EVENTS = st.lists(st.sampled_from(["arrive", "tick", "cancel"]), min_size=1, max_size=30)


@settings(max_examples=300)
@given(EVENTS, st.integers(1, 4), st.integers(1, 4))
def test_receiver_never_releases_blocks_with_layers_in_flight(events: list[str], layers: int,
                                                               n: int) -> None:
    """gen side: reserve (stream) -> request -> header (begin_op) -> chunks arrive among clock
    ticks and cancels -> the op ends (complete and OK only when every layer landed and the
    session is live). Until then nothing is handed back; a deadline or a cancel mid-stream
    quarantines every block; afterwards the session is handed back exactly once."""
    clock = FakeClock()
    rx = ReceiverSessions("gen-0", LAYOUT, clock=clock, default_timeout_s=1.0)
    blocks = tuple(range(10, 10 + n))
    rx.reserve(1, ctx_worker_id="ctx-0", ctx_request_id=7, block_ids=blocks, timeout_s=1.0,
               stream=True)
    assert rx.request(1, group="pdserve-kv/c/g/1/0", seq=1).stream
    assert rx.begin_op(1) and rx.state_of(1) == RecvState.RECEIVING
    chunks = plan_chunks(2 * layers, n, 2, n)
    arrivals = LayerArrivals(chunks, layers, 2)
    nxt = 0
    for ev in events:
        if ev == "arrive" and nxt < len(chunks):
            arrivals.arrive(nxt)
            nxt += 1
        elif ev == "tick":
            clock.now += 0.3
        elif ev == "cancel":
            rx.cancel(1, "client gone")
        assert rx.poll() == []  # in flight: never handed back, whatever happened
        state = rx.state_of(1)
        if state in (RecvState.TIMED_OUT, RecvState.CANCELLED):
            assert rx.num_quarantined_blocks == n
    live = rx.state_of(1) == RecvState.RECEIVING
    rx.op_finished(1, ok=arrivals.complete, nbytes=0, seconds=0.0, reason="partial")
    (result,) = rx.poll()
    assert rx.num_quarantined_blocks == 0 and rx.num_active == 0
    if live and arrivals.complete:
        assert result.ok and result.state == RecvState.COMPLETE
    else:
        assert not result.ok
        if clock.now >= 101.0 and live:  # past the deadline, noticed at the op's end
            assert result.state in (RecvState.TIMED_OUT, RecvState.FAILED)
    assert tuple(result.block_ids) == blocks


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["cancel", "tick"]), max_size=12))
def test_sender_streams_claim_before_the_prefill_is_over(events: list[str]) -> None:
    """ctx side: the lease exists before the last chunk's forward (begin_stream); a layer-wise
    request claims it at once; a cancel while the op is in flight quarantines the blocks until
    the op ends; nothing is handed back while the op runs."""
    clock = FakeClock()
    tx = SenderSessions("ctx-0", LAYOUT, clock=clock, lease_s=1.0)
    tx.lease(7, (30, 31), lease_s=1.0)
    d = tx.claim(_request(True))
    assert d.stream and tx.state_of(7) == SendState.SENDING
    assert tx.begin_op(7)
    cancelled = False
    for ev in events:
        if ev == "cancel":
            cancelled |= tx.cancel(7, "generation side gone")
        elif ev == "tick":
            clock.now += 0.4
            tx.check_deadlines()
        assert tx.poll() == []
        if tx.state_of(7) != SendState.SENDING:
            assert tx.num_quarantined_blocks == 2
    live = tx.state_of(7) == SendState.SENDING
    tx.op_finished(7, ok=live, nbytes=0, seconds=0.0, reason="stream cancelled")
    (result,) = tx.poll()
    assert result.ok == live and tx.num_quarantined_blocks == 0 and tx.num_active == 0
    if cancelled:
        assert result.state == SendState.CANCELLED

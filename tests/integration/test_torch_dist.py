"""KVSender / KVReceiver between real OS processes (multiprocessing spawn, gloo on CPU,
127.0.0.1). The test process plays the control plane: it carries encoded KV requests, done and
cancel messages between the worker processes (tests/integration/kv_peer.py), as Ray would.

Every wait is bounded: transfers have deadlines of a few seconds, and the parent never waits on
a worker without a timeout, so a broken transport fails the test instead of hanging it.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_peer  # noqa: E402

from pdserve.transport.sessions import RecvState, SendState  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SHAPE = (2, 48, 4, 2, 8)  # layers, blocks, tokens/block, kv heads, head dim
BYTES_PER_BLOCK = {"float32": 2 * 2 * 4 * 2 * 8 * 4, "bfloat16": 2 * 2 * 4 * 2 * 8 * 2,
                   "float16": 2 * 2 * 4 * 2 * 8 * 2}
# small chunks so that a dozen blocks already take the pipelined multi-chunk paths
CONFIG = {"connect_timeout_s": 5.0, "default_timeout_s": 10.0, "chunk_bytes": 1024}
DEADLINE_S = 4.0
DTYPES = ("float32", "bfloat16", "float16")
MP = mp.get_context("spawn")


class Cluster:
    """The processes of this module, and helpers to run one transfer through them."""

    def __init__(self) -> None:
        self.peers: list[kv_peer.Peer] = []
        self.endpoints: dict[str, str] = {}
        self._rid = 1000

    def peer(self, stall: dict[str, Any] | None = None) -> kv_peer.Peer:
        p = kv_peer.Peer(MP, CONFIG, stall)
        self.peers.append(p)
        return p

    def sender(self, p: kv_peer.Peer, wid: str, dtype: str = "float32", seed: int = 1) -> None:
        self.endpoints[wid] = p.call("sender", wid, SHAPE, dtype, seed)

    def rid(self) -> int:
        self._rid += 1
        return self._rid

    def start(self, ctx: kv_peer.Peer, ctx_wid: str, gen: kv_peer.Peer, gen_wid: str,
              ctx_blocks: list[int], gen_blocks: list[int], *, cached: int = 0,
              ctx_rid: int | None = None, hold: bool = True,
              lease_s: float = 10.0) -> tuple[int, int, bytes]:
        """Lease on the context side, reserve + request on the generation side; returns
        (ctx request id, gen request id, encoded KV request) without delivering it."""
        ctx_rid = self.rid() if ctx_rid is None else ctx_rid
        gen_rid = self.rid()
        if hold:
            ctx.call("hold", ctx_wid, ctx_rid, ctx_blocks, lease_s)
        req = gen.call("start", gen_wid, gen_rid, {
            "ctx_worker_id": ctx_wid, "ctx_endpoint": self.endpoints[ctx_wid],
            "ctx_request_id": ctx_rid, "block_ids": gen_blocks, "num_cached_blocks": cached,
            "timeout_s": DEADLINE_S})
        return ctx_rid, gen_rid, req

    def deliver(self, ctx: kv_peer.Peer, ctx_wid: str, gen: kv_peer.Peer, gen_wid: str,
                gen_rid: int, req: bytes) -> bool:
        """Carry the KV request to the context side and its done answer back."""
        ctx.post("kv", ctx_wid, gen_rid, req)
        _, tag, done = ctx.take("done", timeout_s=DEADLINE_S + 10)
        assert tag == gen_rid
        gen.call("gen_done", gen_wid, done)
        return b"\xa2ok\xc3" in done  # msgpack "ok": true

    def transfer(self, ctx: kv_peer.Peer, ctx_wid: str, gen: kv_peer.Peer, gen_wid: str,
                 ctx_blocks: list[int], gen_blocks: list[int], *, cached: int = 0) -> tuple:
        ctx_rid, gen_rid, req = self.start(ctx, ctx_wid, gen, gen_wid, ctx_blocks, gen_blocks,
                                           cached=cached)
        self.deliver(ctx, ctx_wid, gen, gen_wid, gen_rid, req)
        got = gen.call("wait", gen_wid, [gen_rid], DEADLINE_S + 5)
        sent = ctx.call("wait", ctx_wid, [ctx_rid], DEADLINE_S + 5)
        return sent[ctx_rid], got[gen_rid]

    def stop(self) -> None:
        kv_peer.stop_peers(self.peers)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> tuple[kv_peer.Peer, kv_peer.Peer]:
    """ctxA and gen1, with one sender/receiver per dtype; ctxA stalls context requests 600
    and 700 for a while at their second chunk (receiver-killed and quarantine tests)."""
    ctx = cluster.peer(stall={"requests": {600: 2.5, 700: 2.5}, "chunk": 1})
    gen = cluster.peer()
    for i, dtype in enumerate(DTYPES):
        cluster.sender(ctx, f"ctxA{i}-{dtype}", dtype, seed=10 + i)
        gen.call("receiver", f"gen1-{dtype}", SHAPE, dtype, 20 + i)
    return ctx, gen


def assert_landed(ctx: kv_peer.Peer, ctx_wid: str, gen: kv_peer.Peer, gen_wid: str,
                  ctx_blocks: list[int], gen_blocks: list[int]) -> None:
    a = ctx.call("bits", ctx_wid, ctx_blocks)
    b = gen.call("bits", gen_wid, gen_blocks)
    assert a.shape == b.shape and bool((a == b).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["scattered", "consecutive"])
def test_blocks_land_bit_exact(cluster: Cluster, pair: Any, dtype: str, layout: str) -> None:
    ctx, gen = pair
    cw, gw = f"ctxA{DTYPES.index(dtype)}-{dtype}", f"gen1-{dtype}"
    if layout == "scattered":  # gathered and scattered through staging, several chunks
        ctx_blocks = [33, 2, 17, 40, 5, 29, 11, 8, 46, 21]
        gen_blocks = [7, 30, 1, 44, 12, 25, 3, 38, 19, 9]
    else:  # runs: chunks travel straight from / into the pools
        ctx_blocks, gen_blocks = list(range(20, 32)), list(range(4, 16))
    before = gen.call("bits", gw, gen_blocks)
    sent, got = cluster.transfer(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE)
    assert got[5] == sent[5] == len(ctx_blocks) * BYTES_PER_BLOCK[dtype]
    assert_landed(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    assert not bool((before == gen.call("bits", gw, gen_blocks)).all())  # data really moved


def test_only_trailing_blocks_travel(cluster: Cluster, pair: Any) -> None:
    ctx, gen = pair
    cw, gw = "ctxA0-float32", "gen1-float32"
    ctx_blocks, gen_blocks = [40, 41, 42, 43, 44, 45, 46, 47], [0, 1, 2, 36, 37, 38, 39, 47]
    cached_before = gen.call("bits", gw, gen_blocks[:3])
    sent, got = cluster.transfer(ctx, cw, gen, gw, ctx_blocks, gen_blocks, cached=3)
    assert got[2] == RecvState.COMPLETE
    assert got[5] == sent[5] == 5 * BYTES_PER_BLOCK["float32"]  # 5 of 8 blocks on the wire
    assert sent[7] == tuple(ctx_blocks)  # the whole lease is released after the send
    assert_landed(ctx, cw, gen, gw, ctx_blocks[3:], gen_blocks[3:])
    assert bool((gen.call("bits", gw, gen_blocks[:3]) == cached_before).all())
    records = gen.call("records", gw)
    assert records[-1][3] == 5 * BYTES_PER_BLOCK["float32"] and records[-1][5] == "COMPLETE"


def test_transfers_in_a_row_keep_order(cluster: Cluster, pair: Any) -> None:
    """Six requests issued in order; their KV requests reach the context side in reverse order
    (Ray calls may overtake each other): the pair still runs them in the order asked for."""
    ctx, gen = pair
    cw, gw = "ctxA1-bfloat16", "gen1-bfloat16"
    jobs = []
    for k in range(6):
        ctx_blocks = [(7 * k + j * 5) % 48 for j in range(3)]
        gen_blocks = [30 + 3 * k - j for j in range(3)]
        ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
        jobs.append((ctx_rid, gen_rid, req, ctx_blocks, gen_blocks))
    for _, gen_rid, req, _, _ in reversed(jobs):
        ctx.post("kv", cw, gen_rid, req)
    answers = [ctx.take("done", timeout_s=DEADLINE_S + 10) for _ in jobs]
    for _, _, done in answers:
        gen.call("gen_done", gw, done)
    got = gen.call("wait", gw, [j[1] for j in jobs], DEADLINE_S + 5)
    assert [got[j[1]][2] for j in jobs] == [RecvState.COMPLETE] * 6
    transfer_ids = [got[j[1]][1] for j in jobs]
    assert transfer_ids == sorted(transfer_ids)
    for ctx_rid, _, _, ctx_blocks, gen_blocks in jobs:
        assert_landed(ctx, cw, gen, gw, ctx_blocks, gen_blocks)


def test_a_warm_pair_allocates_nothing_per_transfer(cluster: Cluster, pair: Any) -> None:
    """Staging, header and trailer, block ids and row index are the pair's, reused: after one
    transfer of a size, more transfers of that size or less allocate no tensor on either side,
    scattered ids (gathered and scattered through staging) included, and still land exactly."""
    ctx, gen = pair
    cw, gw = "ctxA0-float32", "gen1-float32"
    jobs = [([40, 3, 17, 29, 8, 44, 12], [5, 31, 22, 9, 47, 1, 36]),
            ([2, 30, 11], [41, 7, 19]), ([33, 6, 25, 14, 45], [28, 10, 39, 16, 3])]
    cluster.transfer(ctx, cw, gen, gw, *jobs[0])  # warm: the largest of the three

    def allocations() -> tuple[int, int]:
        return (ctx.call("sender_allocations", cw)[gw],
                gen.call("pair_stats", gw)[cw]["buffer_allocations"])

    before = allocations()
    for ctx_blocks, gen_blocks in jobs * 2:
        _, got = cluster.transfer(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
        assert got[2] == RecvState.COMPLETE, got
        assert_landed(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    assert allocations() == before


def test_refusals_and_cancels_keep_the_pair_usable(cluster: Cluster, pair: Any) -> None:
    ctx, gen = pair
    cw, gw = "ctxA2-float16", "gen1-float16"
    # unknown context request: refused with a header, the generation side fails at once
    _, gen_rid, req = cluster.start(ctx, cw, gen, gw, [1, 2], [3, 4], hold=False)
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req) is False
    got = gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)
    # the wire header or the done message, whichever came first, carries the refusal
    assert got[gen_rid][2] == RecvState.FAILED and "context side" in got[gen_rid][4]
    # the generation side cancels before its KV request arrives: lease and transfer both end
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, [5, 6], [7, 8])
    cancel = gen.call("cancel_gen", gw, gen_rid)
    ctx.call("cancel_ctx", cw, cancel)
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req) is False
    assert ctx.call("wait", cw, [ctx_rid], 5.0)[ctx_rid][2] == SendState.CANCELLED
    assert gen.call("wait", gw, [gen_rid], 5.0)[gen_rid][2] == RecvState.CANCELLED
    # an expired lease frees its blocks and refuses the late KV request
    ctx_rid = cluster.rid()
    ctx.call("hold", cw, ctx_rid, [9, 10], 0.2)
    assert ctx.call("wait", cw, [ctx_rid], 5.0)[ctx_rid][2] == SendState.EXPIRED
    _, gen_rid, req = cluster.start(ctx, cw, gen, gw, [], [11, 12], ctx_rid=ctx_rid, hold=False)
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req) is False
    assert gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)[gen_rid][2] == RecvState.FAILED
    # none of that poisoned the pair
    sent, got = cluster.transfer(ctx, cw, gen, gw, [13, 14, 15], [16, 17, 18])
    assert got[2] == RecvState.COMPLETE
    assert_landed(ctx, cw, gen, gw, [13, 14, 15], [16, 17, 18])
    assert gen.call("counts", gw) == (0, 0) and ctx.call("counts", cw) == (0, 0)


def test_lost_kv_request_fails_both_sides_within_the_deadline(cluster: Cluster,
                                                              pair: Any) -> None:
    """The KV request of one transfer never reaches the context side (a lost control message):
    the next transfer on the pair waits behind it, both fail within their deadlines instead of
    hanging, and the pair is rebuilt for the transfer after."""
    ctx, gen = pair
    cw, gw = "ctxA1-bfloat16", "gen1-bfloat16"
    lost_ctx, lost_gen, _ = cluster.start(ctx, cw, gen, gw, [1, 2], [3, 4], lease_s=1.0)
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, [5, 6], [7, 8])
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req) is False
    got = gen.call("wait", gw, [lost_gen, gen_rid], DEADLINE_S + 5)
    assert {got[r][2] for r in (lost_gen, gen_rid)} <= {RecvState.FAILED, RecvState.TIMED_OUT}
    assert ctx.call("wait", cw, [ctx_rid], 5.0)[ctx_rid][2] == SendState.FAILED
    assert ctx.call("wait", cw, [lost_ctx], 5.0)[lost_ctx][2] == SendState.EXPIRED  # unclaimed
    _, got = cluster.transfer(ctx, cw, gen, gw, [9, 10, 11], [12, 13, 14])
    assert got[2] == RecvState.COMPLETE, got  # (request, transfer, state, ok, reason, ...)
    assert_landed(ctx, cw, gen, gw, [9, 10, 11], [12, 13, 14])


def test_cancel_never_frees_blocks_a_receive_may_write(cluster: Cluster, pair: Any) -> None:
    ctx, gen = pair
    cw, gw = "ctxA0-float32", "gen1-float32"
    # cancelled while the payload is landing: the blocks stay quarantined until the op is over
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, list(range(12)),
                                          list(range(30, 42)), ctx_rid=700)
    ctx.post("kv", cw, gen_rid, req)
    ctx.take("stalled", timeout_s=DEADLINE_S + 10)  # header and chunk 0 are out
    assert gen.call("state", gw, gen_rid, RecvState.RECEIVING, 2.0) == RecvState.RECEIVING
    assert gen.call("cancel_gen", gw, gen_rid) is not None
    assert gen.call("counts", gw) == (1, 12)  # quarantined, not released
    assert gen.call("wait", gw, [gen_rid], 0.2) == {}  # not handed back while in flight
    _, _, done = ctx.take("done", timeout_s=DEADLINE_S + 10)
    got = gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)
    assert got[gen_rid][2] == RecvState.CANCELLED and gen.call("counts", gw) == (0, 0)
    gen.call("gen_done", gw, done)
    # cancelled before the header came, the cancel message lost: the payload is drained into
    # staging, the reserved blocks are never written, and the pair stays in step
    ctx_blocks, gen_blocks = [3, 9, 27, 14, 33, 40], [2, 11, 19, 23, 29, 44]
    before = gen.call("bits", gw, gen_blocks)
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    gen.call("cancel_gen", gw, gen_rid)
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req) is True  # the send itself went fine
    assert ctx.call("wait", cw, [ctx_rid], 5.0)[ctx_rid][2] == SendState.SENT
    assert gen.call("wait", gw, [gen_rid], 5.0)[gen_rid][2] == RecvState.CANCELLED
    assert bool((gen.call("bits", gw, gen_blocks) == before).all())
    _, got = cluster.transfer(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    assert got[2] == RecvState.COMPLETE
    assert_landed(ctx, cw, gen, gw, ctx_blocks, gen_blocks)


def test_sender_killed_mid_transfer(cluster: Cluster, pair: Any) -> None:
    """ctxB stalls inside a send and is killed: gen1 sees the failure within the deadline, its
    pair with ctxA keeps working meanwhile, and a restarted ctxB serves a new transfer."""
    ctx_a, gen = pair
    ctx_b = cluster.peer(stall={"requests": {500: 60.0}, "chunk": 1})
    cluster.sender(ctx_b, "ctxB-float32", "float32", seed=3)
    blocks = list(range(0, 24, 2))
    ctx_b.call("hold", "ctxB-float32", 500, blocks, 10.0)
    gen_rid = cluster.rid()
    req = gen.call("start", "gen1-float32", gen_rid, {
        "ctx_worker_id": "ctxB-float32", "ctx_endpoint": cluster.endpoints["ctxB-float32"],
        "ctx_request_id": 500, "block_ids": blocks, "timeout_s": DEADLINE_S})
    ctx_b.post("kv", "ctxB-float32", gen_rid, req)
    ctx_b.take("stalled", timeout_s=DEADLINE_S + 10)
    # the other pair is unaffected while ctxB hangs...
    sent, got = cluster.transfer(ctx_a, "ctxA0-float32", gen, "gen1-float32", [1, 3], [5, 6])
    assert got[2] == RecvState.COMPLETE
    ctx_b.kill()
    got = gen.call("wait", "gen1-float32", [gen_rid], DEADLINE_S + 5)
    assert got[gen_rid][2] in (RecvState.FAILED, RecvState.TIMED_OUT) and got[gen_rid][4]
    assert gen.call("counts", "gen1-float32") == (0, 0)  # nothing quarantined once it is over
    # ... and after the failure
    sent, got = cluster.transfer(ctx_a, "ctxA0-float32", gen, "gen1-float32", [2, 4], [8, 9])
    assert got[2] == RecvState.COMPLETE
    # a restarted ctxB (new process, new endpoint): the pair group is rebuilt
    ctx_b2 = cluster.peer()
    cluster.sender(ctx_b2, "ctxB-float32", "float32", seed=4)
    sent, got = cluster.transfer(ctx_b2, "ctxB-float32", gen, "gen1-float32", blocks,
                                 list(range(24, 36)))
    assert got[2] == RecvState.COMPLETE
    assert_landed(ctx_b2, "ctxB-float32", gen, "gen1-float32", blocks, list(range(24, 36)))


def test_receiver_killed_mid_transfer(cluster: Cluster, pair: Any) -> None:
    """gen2 dies while ctxA is inside a send to it: ctxA's send fails within the deadline, its
    pair with gen1 is unaffected, and a restarted gen2 receives a new transfer."""
    ctx, gen1 = pair
    cw = "ctxA0-float32"
    gen2 = cluster.peer()
    gen2.call("receiver", "gen2-float32", SHAPE, "float32", 5)
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen2, "gen2-float32", list(range(12)),
                                          list(range(12, 24)), ctx_rid=600)
    ctx.post("kv", cw, gen_rid, req)
    ctx.take("stalled", timeout_s=DEADLINE_S + 10)
    gen2.kill()
    _, _, done = ctx.take("done", timeout_s=DEADLINE_S + 10)
    assert b"\xa2ok\xc2" in done  # msgpack "ok": false
    sent = ctx.call("wait", cw, [600], DEADLINE_S + 5)
    assert sent[600][2] == SendState.FAILED and sent[600][4]
    # gen1's pair never noticed
    _, got = cluster.transfer(ctx, cw, gen1, "gen1-float32", [30, 31], [40, 41])
    assert got[2] == RecvState.COMPLETE
    # a restarted gen2 (new incarnation, new pair group) is served
    gen2b = cluster.peer()
    gen2b.call("receiver", "gen2-float32", SHAPE, "float32", 6)
    sent, got = cluster.transfer(ctx, cw, gen2b, "gen2-float32", [20, 21, 22], [1, 2, 3])
    assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE)
    assert_landed(ctx, cw, gen2b, "gen2-float32", [20, 21, 22], [1, 2, 3])
    assert ctx.call("counts", cw) == (0, 0)


def test_kv_requests_travel_the_direct_link(cluster: Cluster, pair: Any) -> None:
    """Once the pair's store is connected its direct link is up: a KV request sent over the
    link alone is served, and the control-plane copy sent afterwards (the Ray record, in a
    cluster) folds into it: the same answer, one claim, one send."""
    ctx, gen = pair
    cw, gw = "ctxA2-float16", "gen1-float16"
    cluster.transfer(ctx, cw, gen, gw, [1, 2], [3, 4])  # the pair connects (group, link)
    end = time.monotonic() + DEADLINE_S  # the link is dialled on a helper thread
    while not gen.call("pair_stats", gw)[cw]["link"] and time.monotonic() < end:
        time.sleep(0.05)
    assert gen.call("pair_stats", gw)[cw]["link"] is True
    ctx_blocks, gen_blocks = [10, 30, 20], [5, 41, 17]
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    assert gen.call("direct", gw, cw, cluster.endpoints[cw], req) is True
    got = gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)
    assert got[gen_rid][2] == RecvState.COMPLETE
    assert_landed(ctx, cw, gen, gw, ctx_blocks, gen_blocks)
    folded = ctx.call("folded", cw)
    assert cluster.deliver(ctx, cw, gen, gw, gen_rid, req)  # the record copy: the same "ok"
    assert ctx.call("folded", cw) == folded + 1
    sent = ctx.call("wait", cw, [ctx_rid], DEADLINE_S + 5)
    assert sent[ctx_rid][2] == SendState.SENT
    records = [r for r in ctx.call("records", cw) if r[1] == ctx_rid]
    assert len(records) == 1 and records[0][5] == "SENT"
    # a request meant for another incarnation of the context worker is dropped by the link
    ctx_rid, gen_rid, req = cluster.start(ctx, cw, gen, gw, [11], [6])
    assert gen.call("direct", gw, cw, cluster.endpoints[cw] + "#1", req) is False
    cluster.deliver(ctx, cw, gen, gw, gen_rid, req)  # the control plane still carries it
    assert gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)[gen_rid][2] == RecvState.COMPLETE

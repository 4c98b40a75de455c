"""Head-sliced KV transfers between real OS processes (gloo on CPU; the peers of
tests/integration/kv_peer.py, as in test_torch_dist.py): the transport-level building block of
tensor parallelism. Each ``tp_map.KVMove`` of a (context TP, generation TP) layout is driven as
one transfer between one context rank's pool and one generation rank's pool, carrying only
that move's heads; the generation pools end up bit-exact equal to the matching head slices of
the context pools, every transfer reports exactly the bytes ``tp_map`` says its ranks move, and
a request for the wrong rank or an impossible slice is refused at once, naming both sides.

The parent plays the orchestration that will drive the ranks later: it reads the moves off
``plan_kv_moves`` and issues one transfer per move. (One context lease per move: a context
session is claimed by one transfer, so a rank that feeds several destination ranks leases its
blocks once per destination.)
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_peer  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.transport.protocol import HeadSlice, encode_message  # noqa: E402
from pdserve.transport.sessions import RecvState, SendState  # noqa: E402
from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig  # noqa: E402
from pdserve.transport.tp_map import (  # noqa: E402
    KVMove, bytes_per_dst_rank, bytes_per_src_rank, plan_kv_moves,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LAYERS, BLOCKS, TOKENS, HEAD_DIM, ITEMSIZE = 3, 24, 4, 8, 4  # float32


def shape(heads: int) -> tuple[int, ...]:
    return (LAYERS, BLOCKS, TOKENS, heads, HEAD_DIM)


# small chunks: a few blocks already take the pipelined multi-chunk paths
CONFIG = {"connect_timeout_s": 5.0, "default_timeout_s": 10.0, "chunk_bytes": 512}
DEADLINE_S = 4.0
MP = mp.get_context("spawn")
SIZES = {"num_layers": LAYERS, "num_planes": 2, "tokens_per_block": TOKENS, "head_dim": HEAD_DIM,
         "itemsize": ITEMSIZE}


class Ranks:
    """One process for the context ranks' senders, one for the generation ranks' receivers."""

    def __init__(self) -> None:
        self.ctx = kv_peer.Peer(MP, CONFIG)
        self.gen = kv_peer.Peer(MP, CONFIG)
        self.endpoints: dict[str, str] = {}
        self.tp: dict[str, tuple[int, int]] = {}
        self._rid = 9000
        # a 4-KV-head model at context TP 1 -> generation TP 2
        self.sender("c4", 4, (1, 0), seed=1)
        for r in range(2):
            self.gen.call("receiver", f"g4-tp2r{r}", shape(2), "float32", 20 + r)
        # a 2-KV-head model at context TP 2 -> generation TP 1, and TP 1 -> TP 4 (replicated)
        for r in range(2):
            self.sender(f"c2-tp2r{r}", 1, (2, r), seed=2 + r)
        self.sender("c2", 2, (1, 0), seed=4)
        self.gen.call("receiver", "g2-tp1", shape(2), "float32", 30)
        for r in range(4):
            self.gen.call("receiver", f"g2-tp4r{r}", shape(1), "float32", 40 + r)

    def sender(self, wid: str, heads: int, tp: tuple[int, int], seed: int) -> None:
        self.endpoints[wid] = self.ctx.call("sender", wid, shape(heads), "float32", seed, 2, tp)
        self.tp[wid] = tp

    def rid(self) -> int:
        self._rid += 1
        return self._rid

    def start(self, cw: str, gw: str, heads: HeadSlice, ctx_blocks: list[int],
              gen_blocks: list[int], *, ctx_tp: tuple[int, int] | None = None, stream: bool = False,
              lease: str = "hold", ctx_rid: int | None = None) -> tuple[int, int, bytes]:
        """``lease``: the context command that leases the blocks ("" for none: ``ctx_rid``'s
        lease is already held)."""
        ctx_rid = self.rid() if ctx_rid is None else ctx_rid
        gen_rid = self.rid()
        if lease:
            self.ctx.call(lease, cw, ctx_rid, ctx_blocks, 10.0)
        req = self.gen.call("start", gw, gen_rid, {
            "ctx_worker_id": cw, "ctx_endpoint": self.endpoints[cw], "ctx_request_id": ctx_rid,
            "block_ids": gen_blocks, "timeout_s": DEADLINE_S, "stream": stream, "heads": heads,
            "ctx_tp": self.tp[cw] if ctx_tp is None else ctx_tp})
        return ctx_rid, gen_rid, req

    def finish(self, cw: str, gw: str, ctx_rid: int, gen_rid: int,
               ctx_wait_s: float = DEADLINE_S + 5) -> tuple[dict, tuple | None, tuple]:
        """Carry the done answer back; (answer, context result, generation result)."""
        _, tag, done = self.ctx.take("done", timeout_s=DEADLINE_S + 10)
        assert tag == gen_rid
        self.gen.call("gen_done", gw, done)
        got = self.gen.call("wait", gw, [gen_rid], DEADLINE_S + 5)[gen_rid]
        sent = self.ctx.call("wait", cw, [ctx_rid], ctx_wait_s).get(ctx_rid)
        return msgpack.unpackb(done), sent, got

    def transfer(self, cw: str, gw: str, m: KVMove, ctx_blocks: list[int],
                 gen_blocks: list[int]) -> int:
        """One move as one transfer; the bytes it reports (both sides agree on them)."""
        ctx_rid, gen_rid, req = self.start(cw, gw, HeadSlice(m.src_offset, m.dst_offset,
                                                             m.num_heads), ctx_blocks, gen_blocks)
        self.ctx.post("kv", cw, gen_rid, req)
        done, sent, got = self.finish(cw, gw, ctx_rid, gen_rid)
        assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE), (sent, got)
        assert got[5] == sent[5] == done["nbytes"]
        assert self.gen.call("records", gw)[-1][3] == self.ctx.call("records", cw)[-1][3] == got[5]
        return got[5]

    def assert_landed(self, cw: str, gw: str, m: KVMove, ctx_blocks: list[int],
                      gen_blocks: list[int]) -> None:
        """The move's heads of the generation blocks are the context blocks' bit for bit."""
        a = self.ctx.call("bits", cw, ctx_blocks)  # [layers, planes, n, tokens, heads, head dim]
        b = self.gen.call("bits", gw, gen_blocks)
        assert bool((a[..., m.src_heads, :] == b[..., m.dst_heads, :]).all())

    def stop(self) -> None:
        kv_peer.stop_peers((self.ctx, self.gen))


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    r = Ranks()
    try:
        yield r
    finally:
        r.stop()


def test_context_tp1_to_generation_tp2_of_four_kv_heads(ranks: Ranks) -> None:
    """Rank 0 of the generation side takes heads 0-1 of the context pool, rank 1 heads 2-3;
    each destination pool is whole (2 heads). Scattered ids for rank 0 (staged on both sides),
    consecutive ones for rank 1 (received straight into the pool while the context side
    gathers its strided slice)."""
    moves = plan_kv_moves(1, 2, 4, "gqa")
    assert [(m.src_rank, m.dst_rank, m.src_offset, m.num_heads) for m in moves] == [
        (0, 0, 0, 2), (0, 1, 2, 2)]
    ids = {0: ([17, 2, 9, 21, 5, 13], [4, 19, 11, 1, 22, 7]),
           1: (list(range(6, 12)), list(range(12, 18)))}
    want = bytes_per_dst_rank(moves, gen_tp=2, num_blocks=6, **SIZES)
    for m in moves:
        gw = f"g4-tp2r{m.dst_rank}"
        before = ranks.gen.call("bits", gw, ids[m.dst_rank][1])
        assert ranks.transfer("c4", gw, m, *ids[m.dst_rank]) == want[m.dst_rank]
        ranks.assert_landed("c4", gw, m, *ids[m.dst_rank])
        assert not bool((before == ranks.gen.call("bits", gw, ids[m.dst_rank][1])).all())
    # half of each block's heads: 6 blocks x layers x K, V x tokens x 2 heads x head dim x 4 B
    assert want == dict.fromkeys((0, 1), 6 * LAYERS * 2 * TOKENS * 2 * HEAD_DIM * ITEMSIZE)


def test_context_tp2_to_generation_tp1_fills_one_pool_from_two_ranks(ranks: Ranks) -> None:
    """Two context ranks of one head each send into the two halves of one destination pool's
    blocks: each transfer writes its own head only."""
    moves = plan_kv_moves(2, 1, 2, "gqa")
    assert [(m.src_rank, m.dst_rank, m.dst_offset) for m in moves] == [(0, 0, 0), (1, 0, 1)]
    ctx_blocks, gen_blocks = [3, 8, 1, 14, 20], [10, 2, 23, 6, 15]
    before = ranks.gen.call("bits", "g2-tp1", gen_blocks)
    moved = 0
    for m in moves:
        cw = f"c2-tp2r{m.src_rank}"
        nbytes = ranks.transfer(cw, "g2-tp1", m, ctx_blocks, gen_blocks)
        assert nbytes == bytes_per_src_rank(moves, ctx_tp=2, num_blocks=5, **SIZES)[m.src_rank]
        moved += nbytes
        ranks.assert_landed(cw, "g2-tp1", m, ctx_blocks, gen_blocks)
        if m.src_rank == 0:  # the other half is still what it was
            after = ranks.gen.call("bits", "g2-tp1", gen_blocks)
            assert bool((after[..., 1:, :] == before[..., 1:, :]).all())
    assert moved == bytes_per_dst_rank(moves, gen_tp=1, num_blocks=5, **SIZES)[0]


def test_generation_tp4_of_two_kv_heads_replicates_each_head(ranks: Ranks) -> None:
    moves = plan_kv_moves(1, 4, 2, "gqa")
    assert [(m.dst_rank, m.head_start, m.src_offset) for m in moves] == [
        (0, 0, 0), (1, 0, 0), (2, 1, 1), (3, 1, 1)]
    ctx_blocks, gen_blocks = [5, 6, 7, 19], [0, 1, 2, 3]
    want = bytes_per_dst_rank(moves, gen_tp=4, num_blocks=4, **SIZES)
    for m in moves:
        gw = f"g2-tp4r{m.dst_rank}"
        assert ranks.transfer("c2", gw, m, ctx_blocks, gen_blocks) == want[m.dst_rank]
        ranks.assert_landed("c2", gw, m, ctx_blocks, gen_blocks)


def test_a_layerwise_stream_carries_only_its_slice(ranks: Ranks) -> None:
    """Claimed before the stand-in forward writes anything; each layer is rewritten, then
    announced: the destination equals the final bits of the move's heads, so each layer's
    slice went only once written."""
    m = plan_kv_moves(1, 2, 4, "gqa")[1]  # heads 2-3 of the context pool
    ctx_blocks, gen_blocks = [22, 0, 15, 8], [3, 20, 9, 14]
    ctx_rid, gen_rid, req = ranks.start("c4", "g4-tp2r1", HeadSlice(m.src_offset, m.dst_offset,
                                                                     m.num_heads),
                                        ctx_blocks, gen_blocks, stream=True, lease="begin_stream")
    ranks.ctx.post("kv", "c4", gen_rid, req)
    assert ranks.gen.call("state", "g4-tp2r1", gen_rid, RecvState.RECEIVING, 5.0) == \
        RecvState.RECEIVING
    for layer in range(LAYERS):
        time.sleep(0.1)
        ranks.ctx.call("write_layer", "c4", [ctx_rid], ctx_blocks, layer, 300 + layer)
    ranks.ctx.call("hold", "c4", ctx_rid, ctx_blocks, 10.0, 77)  # the first token
    done, sent, got = ranks.finish("c4", "g4-tp2r1", ctx_rid, gen_rid)
    assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE), (sent, got)
    assert got[5] == sent[5] == done["nbytes"] == bytes_per_dst_rank(
        (m,), gen_tp=2, num_blocks=4, **SIZES)[1]
    ranks.assert_landed("c4", "g4-tp2r1", m, ctx_blocks, gen_blocks)
    assert ranks.gen.call("first_token", "g4-tp2r1", gen_rid) == 77


@pytest.mark.parametrize("case", ["wrong rank", "slice outside the context pool"])
def test_refusals_are_fast_name_both_sides_and_keep_the_pair(ranks: Ranks, case: str) -> None:
    gw, blocks = "g4-tp2r0", [5, 6]
    before = ranks.gen.call("bits", gw, blocks)
    if case == "wrong rank":  # the generation side thinks c4 is rank 0 of a TP-2 context
        heads, ctx_tp = HeadSlice(0, 0, 2), (2, 0)
        words = ["expects context tensor parallel size 2 rank 0",
                 "this context worker is size 1 rank 0"]
    else:
        heads, ctx_tp = HeadSlice(3, 0, 2), (1, 0)
        words = ["[3, 5) of the context pool's 4 local KV heads", "[0, 2) of the generation pool's 2"]
    t0 = time.monotonic()
    ctx_rid, gen_rid, req = ranks.start("c4", gw, heads, [1, 2], blocks, ctx_tp=ctx_tp)
    ranks.ctx.post("kv", "c4", gen_rid, req)
    done, sent, got = ranks.finish("c4", gw, ctx_rid, gen_rid, ctx_wait_s=0.2)
    assert time.monotonic() - t0 < DEADLINE_S  # answered at once, not at a deadline
    assert not done["ok"] and all(w in done["reason"] for w in words), done["reason"]
    # (the wire header or the done message, whichever came first, failed the receive)
    assert got[2] == RecvState.FAILED and "context side" in got[4]
    assert sent is None  # the lease is untouched by a refusal: still held, not handed back
    assert bool((ranks.gen.call("bits", gw, blocks) == before).all())
    # the pair is still in step: the same lease goes to a right request
    m = plan_kv_moves(1, 2, 4, "gqa")[0]
    _, gen_rid2, req2 = ranks.start("c4", gw, HeadSlice(0, 0, 2), [1, 2], blocks, lease="",
                                    ctx_rid=ctx_rid)
    ranks.ctx.post("kv", "c4", gen_rid2, req2)
    done, sent, got = ranks.finish("c4", gw, ctx_rid, gen_rid2)
    assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE), (sent, got)
    ranks.assert_landed("c4", gw, m, [1, 2], blocks)


def test_an_eager_pair_to_another_rank_is_refused_at_open_and_heals() -> None:
    """In process, with a control sink (as in a worker): the generation side's pair opens
    eagerly, stating the context rank it expects. A context sender of another rank refuses the
    open (the pair is DOWN, its error naming both ranks, no rendezvous hangs) and answers a KV
    request for that rank at once, although its group never opened. Told the right rank, the
    pair's next open is accepted and a sliced transfer lands."""
    with pytest.raises(ValueError, match="rank 2 is outside tensor parallel size 2"):
        KVSender("bad", KVPool(*shape(1)), tp_size=2, rank=2)
    cfg = TransportConfig(connect_timeout_s=5.0, default_timeout_s=10.0, direct_link=False)
    ctx_pool = KVPool(*shape(1))  # rank 1 of a 2-KV-head model at TP 2: head 1
    ctx_pool.kv.copy_(torch.randn(ctx_pool.kv.shape, generator=torch.Generator().manual_seed(7)))
    sender = KVSender("ctx-r1", ctx_pool, config=cfg, tp_size=2, rank=1)

    def control(ctx_worker_id: str, endpoint: str, payload: bytes, name: str) -> None:
        def run() -> None:  # a Ray call in the transfer group, answered back
            answer = sender.handle(payload)
            if answer is not None:
                receiver.handle(answer)
        threading.Thread(target=run, daemon=True).start()

    receiver = KVReceiver("gen", KVPool(*shape(2)), config=cfg, control=control)
    try:
        receiver.connect_peers({"ctx-r1": sender.locator}, ctx_tp={"ctx-r1": (2, 0)})
        _wait(lambda: receiver.pair_stats()["ctx-r1"]["open_failures"] >= 1, "a refused open")
        stats = receiver.pair_stats()["ctx-r1"]
        assert stats["state"] == "down" and "expects context tensor parallel size 2 rank 0" in \
            stats["last_error"] and "this context worker is size 2 rank 1" in stats["last_error"]
        m = plan_kv_moves(2, 1, 2, "gqa")[1]  # head 1, from rank 1's only head
        heads = HeadSlice(m.src_offset, m.dst_offset, m.num_heads)
        sender.hold(5, [3, 4, 5])
        t0 = time.monotonic()
        req = receiver.start(1, ctx_worker_id="ctx-r1", ctx_endpoint=sender.locator,
                             ctx_request_id=5, block_ids=[7, 8, 9], timeout_s=8.0, heads=heads)
        control("ctx-r1", sender.locator, encode_message(req), "kv")
        result = _wait(lambda: receiver.poll(), "the refusal")[0]
        assert time.monotonic() - t0 < 2.0 and not result.ok
        assert "tensor parallel size 2 rank 0" in result.reason and "size 2 rank 1" in result.reason
        # told the right rank: the pair's next open goes through and the transfer lands
        req = receiver.start(2, ctx_worker_id="ctx-r1", ctx_endpoint=sender.locator,
                             ctx_request_id=5, block_ids=[7, 8, 9], timeout_s=8.0, heads=heads,
                             ctx_tp=(2, 1))
        control("ctx-r1", sender.locator, encode_message(req), "kv")
        result = _wait(lambda: receiver.poll(), "the transfer")[0]
        assert result.ok, result
        assert result.nbytes == bytes_per_dst_rank((m,), gen_tp=1, num_blocks=3, **SIZES)[0]
        assert receiver.pair_stats()["ctx-r1"]["state"] == "ready"
        got = receiver.pool.kv[:, :, [7, 8, 9], :, m.dst_heads]
        assert bool((got == ctx_pool.kv[:, :, [3, 4, 5], :, m.src_heads]).all())
    finally:
        receiver.close()
        sender.close()


def _wait(probe: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")

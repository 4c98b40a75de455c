"""The KV data plane over one-plane (MLA) pools: DeepSeek-V3 caches one compressed latent per
token and layer (kv_lora_rank 512 + qk_rope_head_dim 64 values), not K and V per head. Between
real OS processes over gloo (tests/integration/kv_peer.py, as test_torch_dist.py), whole-request
and layer-wise: the generation side's blocks equal the context side's bit for bit, and the
bytes each side reports (what ``pdserve status`` and the dashboard's transfer rows add up) are
the latent's, blocks x tokens x layers x latent x itemsize. A K+V pool is refused by a latent
one even when their bytes per block agree.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Iterator

import msgpack
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_peer  # noqa: E402

from pdserve.transport.sessions import RecvState, SendState  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LAYERS, BLOCKS, TOKENS_PER_BLOCK = 3, 24, 4
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM
MLA_SHAPE = (LAYERS, BLOCKS, TOKENS_PER_BLOCK, 1, LATENT)  # one plane: cache_heads 1
# A K+V pool whose bytes per block equal the latent pool's (2 planes of half the width)
KV_SHAPE = (LAYERS, BLOCKS, TOKENS_PER_BLOCK, 1, LATENT // 2)
ITEMSIZE = {"float32": 4, "bfloat16": 2}
# small chunks: a few blocks already take the pipelined, multi-chunk paths
CONFIG = {"connect_timeout_s": 5.0, "default_timeout_s": 10.0, "chunk_bytes": 8192}
DEADLINE_S = 4.0
MP = mp.get_context("spawn")


def latent_bytes(num_blocks: int, dtype: str) -> int:
    """What a transfer of num_blocks moves: the latent per token, no heads, no K and V."""
    return num_blocks * TOKENS_PER_BLOCK * LAYERS * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * ITEMSIZE[dtype]


class Peers:
    def __init__(self) -> None:
        self.ctx = kv_peer.Peer(MP, CONFIG)
        self.gen = kv_peer.Peer(MP, CONFIG)
        self.endpoints: dict[str, str] = {}
        self._rid = 5000
        for i, dtype in enumerate(ITEMSIZE):
            self.endpoints[f"ctx-{dtype}"] = self.ctx.call("sender", f"ctx-{dtype}", MLA_SHAPE,
                                                           dtype, 10 + i, 1)
            self.gen.call("receiver", f"gen-{dtype}", MLA_SHAPE, dtype, 20 + i, 1)
        self.gen.call("receiver", "gen-kv", KV_SHAPE, "float32", 30, 2)

    def rid(self) -> int:
        self._rid += 1
        return self._rid

    def start(self, dtype: str, gen_wid: str, ctx_rid: int, gen_blocks: list[int], *,
              cached: int = 0, stream: bool = False) -> tuple[int, bytes]:
        gen_rid = self.rid()
        req = self.gen.call("start", gen_wid, gen_rid, {
            "ctx_worker_id": f"ctx-{dtype}", "ctx_endpoint": self.endpoints[f"ctx-{dtype}"],
            "ctx_request_id": ctx_rid, "block_ids": gen_blocks, "num_cached_blocks": cached,
            "timeout_s": DEADLINE_S, "stream": stream})
        return gen_rid, req

    def finish(self, dtype: str, gen_wid: str, ctx_rid: int, gen_rid: int) -> tuple[dict, tuple, tuple]:
        """The context side's done answer (carried to the generation side), then both results."""
        _, tag, done = self.ctx.take("done", timeout_s=DEADLINE_S + 10)
        assert tag == gen_rid
        self.gen.call("gen_done", gen_wid, done)
        got = self.gen.call("wait", gen_wid, [gen_rid], DEADLINE_S + 5)[gen_rid]
        sent = self.ctx.call("wait", f"ctx-{dtype}", [ctx_rid], DEADLINE_S + 5)[ctx_rid]
        return msgpack.unpackb(done), sent, got

    def assert_landed(self, dtype: str, ctx_blocks: list[int], gen_blocks: list[int],
                      gen_wid: str | None = None) -> None:
        a = self.ctx.call("bits", f"ctx-{dtype}", ctx_blocks)
        b = self.gen.call("bits", gen_wid or f"gen-{dtype}", gen_blocks)
        assert tuple(a.shape) == (LAYERS, 1, len(ctx_blocks), TOKENS_PER_BLOCK, 1, LATENT)
        assert a.shape == b.shape and bool((a == b).all())

    def stop(self) -> None:
        kv_peer.stop_peers((self.ctx, self.gen))


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    p = Peers()
    try:
        yield p
    finally:
        p.stop()


def _check_bytes(peers: Peers, dtype: str, sent: tuple, got: tuple, done: dict, n: int) -> None:
    """Every byte count a transfer reports is the latent's: the results the engine core turns into
    the dashboard's transfer event, the done answer the context side logs, and the records the
    worker's status sums."""
    want = latent_bytes(n, dtype)
    assert (sent[2], got[2]) == (SendState.SENT, RecvState.COMPLETE), (sent, got)
    assert got[5] == sent[5] == done["nbytes"] == want
    assert peers.gen.call("records", f"gen-{dtype}")[-1][3] == want
    assert peers.ctx.call("records", f"ctx-{dtype}")[-1][3] == want


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
@pytest.mark.parametrize("blocks", ["scattered", "consecutive"])
def test_latent_blocks_land_bit_exact(peers: Peers, dtype: str, blocks: str) -> None:
    if blocks == "scattered":  # gathered and scattered through staging
        ctx_blocks, gen_blocks = [17, 2, 9, 21, 5, 13, 0], [4, 19, 11, 1, 22, 7, 15]
    else:  # runs: single-plane chunks straight from / into the pools
        ctx_blocks, gen_blocks = list(range(10, 18)), list(range(3, 11))
    before = peers.gen.call("bits", f"gen-{dtype}", gen_blocks)
    ctx_rid = peers.rid()
    peers.ctx.call("hold", f"ctx-{dtype}", ctx_rid, ctx_blocks, 10.0)
    gen_rid, req = peers.start(dtype, f"gen-{dtype}", ctx_rid, gen_blocks)
    peers.ctx.post("kv", f"ctx-{dtype}", gen_rid, req)
    done, sent, got = peers.finish(dtype, f"gen-{dtype}", ctx_rid, gen_rid)
    _check_bytes(peers, dtype, sent, got, done, len(ctx_blocks))
    peers.assert_landed(dtype, ctx_blocks, gen_blocks)
    assert not bool((before == peers.gen.call("bits", f"gen-{dtype}", gen_blocks)).all())


def test_only_trailing_latent_blocks_travel(peers: Peers) -> None:
    dtype = "float32"
    ctx_blocks, gen_blocks = [18, 19, 20, 21, 22, 23], [12, 13, 14, 20, 21, 23]
    cached_before = peers.gen.call("bits", f"gen-{dtype}", gen_blocks[:3])
    ctx_rid = peers.rid()
    peers.ctx.call("hold", f"ctx-{dtype}", ctx_rid, ctx_blocks, 10.0)
    gen_rid, req = peers.start(dtype, f"gen-{dtype}", ctx_rid, gen_blocks, cached=3)
    peers.ctx.post("kv", f"ctx-{dtype}", gen_rid, req)
    done, sent, got = peers.finish(dtype, f"gen-{dtype}", ctx_rid, gen_rid)
    _check_bytes(peers, dtype, sent, got, done, 3)  # 3 of 6 blocks on the wire
    peers.assert_landed(dtype, ctx_blocks[3:], gen_blocks[3:])
    assert bool((peers.gen.call("bits", f"gen-{dtype}", gen_blocks[:3]) == cached_before).all())


@pytest.mark.parametrize("dtype", list(ITEMSIZE))
def test_layerwise_latent_stream_sends_each_layer_once_written(peers: Peers, dtype: str) -> None:
    """The send is claimed before the (stand-in) forward writes anything; each layer's latent
    is rewritten, then announced, a while apart. A chunk sent before its own layer was announced
    would carry the old bits (with one plane per layer, plane p is layer p, not layer p // 2),
    so equality after the stream shows every layer went only once written."""
    ctx_blocks, gen_blocks = [6, 1, 8, 3, 20], [0, 16, 2, 9, 5]
    ctx_rid = peers.rid()
    peers.ctx.call("begin_stream", f"ctx-{dtype}", ctx_rid, ctx_blocks, 10.0)
    gen_rid, req = peers.start(dtype, f"gen-{dtype}", ctx_rid, gen_blocks, stream=True)
    peers.ctx.post("kv", f"ctx-{dtype}", gen_rid, req)
    assert peers.gen.call("state", f"gen-{dtype}", gen_rid, RecvState.RECEIVING, 5.0) == \
        RecvState.RECEIVING  # the header came: the op is waiting for layer 0
    for layer in range(LAYERS):
        time.sleep(0.2)  # room for a chunk that goes too early to go
        peers.ctx.call("write_layer", f"ctx-{dtype}", [ctx_rid], ctx_blocks, layer, 100 + layer)
    peers.ctx.call("hold", f"ctx-{dtype}", ctx_rid, ctx_blocks, 10.0, 42)  # the first token
    done, sent, got = peers.finish(dtype, f"gen-{dtype}", ctx_rid, gen_rid)
    _check_bytes(peers, dtype, sent, got, done, len(ctx_blocks))
    peers.assert_landed(dtype, ctx_blocks, gen_blocks)
    assert peers.gen.call("first_token", f"gen-{dtype}", gen_rid) == 42


def test_a_kv_pool_is_refused_by_a_latent_pool_of_equal_block_bytes(peers: Peers) -> None:
    """K and V of half the width take as many bytes per block as the latent: the context side
    still refuses, saying the planes differ, and the generation side fails the transfer
    without touching its blocks."""
    before = peers.gen.call("bits", "gen-kv", [0, 1])
    ctx_rid = peers.rid()
    peers.ctx.call("hold", "ctx-float32", ctx_rid, [2, 3], 10.0)
    gen_rid, req = peers.start("float32", "gen-kv", ctx_rid, [0, 1])
    assert msgpack.unpackb(req)["bytes_per_block"] == latent_bytes(1, "float32")
    peers.ctx.post("kv", "ctx-float32", gen_rid, req)
    _, tag, done = peers.ctx.take("done", timeout_s=DEADLINE_S + 10)
    assert tag == gen_rid
    answer = msgpack.unpackb(done)
    assert not answer["ok"] and "planes per layer 1 (MLA latent) vs 2 (K and V)" in answer["reason"]
    peers.gen.call("gen_done", "gen-kv", done)
    got = peers.gen.call("wait", "gen-kv", [gen_rid], DEADLINE_S + 5)[gen_rid]
    assert not got[3] and got[5] == 0
    assert bool((peers.gen.call("bits", "gen-kv", [0, 1]) == before).all())
    # the lease stays: the context request's blocks can still go to a matching receiver
    gen_rid, req = peers.start("float32", "gen-float32", ctx_rid, [23, 22])
    peers.ctx.post("kv", "ctx-float32", gen_rid, req)
    done, sent, got = peers.finish("float32", "gen-float32", ctx_rid, gen_rid)
    _check_bytes(peers, "float32", sent, got, done, 2)
    peers.assert_landed("float32", [2, 3], [23, 22])

"""Head-sliced KV transfers (tensor parallelism), the parts that need no second process: the
new KVRequest / PairOpen fields and their defaults, the relaxed layout check and the TP
expectation check of the context side's claim, the generation side's reservation, and
``BlockMover`` gathering and scattering a slice of heads (and the whole-pool path untouched)."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from pdserve.transport.kv_groups import BlockMover, StagingRing
from pdserve.transport.kv_pool import KVPool
from pdserve.transport.protocol import (
    PROTOCOL_VERSION, HeadSlice, KVLayout, KVRequest, PairOpen, ProtocolError, TransferRejected,
    choose_chunking, decode_message, encode_message, plan_chunks, transfer_mismatch,
)
from pdserve.transport.session_sides import ReceiverSessions, SenderSessions
from pdserve.transport.sessions import SendState
from pdserve.transport.tp_map import plan_kv_moves

# (layers, tokens per block, local KV heads, head dim), bfloat16, K and V
CTX4 = KVLayout("bfloat16", 2 * 2 * 16 * 4 * 32 * 2, (2, 16, 4, 32))
GEN2 = KVLayout("bfloat16", 2 * 2 * 16 * 2 * 32 * 2, (2, 16, 2, 32))
GROUP = "pdserve-kv/c/g/1/0"


def request(gen: KVLayout = GEN2, heads: HeadSlice = HeadSlice(), *, tp: tuple[int, int] = (1, 0),
            ctx_request_id: int = 7, num_blocks: int = 3) -> KVRequest:
    return KVRequest(0, 1, GROUP, "gen-0", ctx_request_id, 900, num_blocks, 0,
                     tuple(range(50, 50 + num_blocks)), gen.dtype, gen.bytes_per_block,
                     gen.kv_shape, 5.0, False, gen.num_planes, heads.src_offset, heads.dst_offset,
                     heads.num_heads, *tp)


def sender(layout: KVLayout = CTX4, tp: tuple[int, int] = (1, 0)) -> SenderSessions:
    tx = SenderSessions("ctx-0", layout, lease_s=10.0, tp=tp)
    tx.lease(7, [1, 2, 3, 4])
    return tx


# ---------------------------------------------------------------------------- messages


def test_the_new_fields_round_trip_and_default_to_whole_pools_and_a_tp1_context() -> None:
    sliced = request(heads=HeadSlice(2, 0, 2), tp=(2, 1))
    assert decode_message(encode_message(sliced)) == sliced
    assert sliced.heads == HeadSlice(2, 0, 2)
    opening = PairOpen(GROUP, "gen-0", 30.0, 4, 3)
    assert decode_message(encode_message(opening)) == opening
    # A message from a peer that predates the fields: whole pools, a TP-1 context of rank 0.
    body = msgpack.unpackb(encode_message(request()))
    for name in ("src_head_offset", "dst_head_offset", "num_heads", "ctx_tp_size", "ctx_rank"):
        body.pop(name)
    old = decode_message(msgpack.packb(body))
    assert old == request() and old.heads == HeadSlice() and (old.ctx_tp_size, old.ctx_rank) == (1, 0)
    old_open = decode_message(msgpack.packb({"v": PROTOCOL_VERSION, "type": "pair_open",
                                             "group": GROUP, "gen_worker_id": "g", "timeout_s": 1.0}))
    assert old_open == PairOpen(GROUP, "g", 1.0) and (old_open.ctx_tp_size, old_open.ctx_rank) == (1, 0)


def test_malformed_slices_and_tp_expectations_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="needs num_heads"):
        dataclasses.replace(request(), src_head_offset=1)
    with pytest.raises(ProtocolError, match="negative head slice"):
        dataclasses.replace(request(), num_heads=-1)
    with pytest.raises(ProtocolError, match="rank 2 is outside tensor parallel size 2"):
        request(tp=(2, 2))
    with pytest.raises(ProtocolError, match="outside tensor parallel size 0"):
        PairOpen(GROUP, "gen-0", 1.0, 0, 0)
    body = msgpack.unpackb(encode_message(request()))
    with pytest.raises(ProtocolError, match="num_heads"):
        decode_message(msgpack.packb({**body, "num_heads": "2"}))
    with pytest.raises(ValueError, match="needs num_heads"):
        HeadSlice(0, 1, 0)


# ---------------------------------------------------------------------------- the layout check


def test_a_slice_inside_both_pools_is_accepted_and_counts_the_slice_bytes() -> None:
    tx = sender()
    d = tx.claim(request(heads=HeadSlice(2, 0, 2)))
    assert (d.src_head_offset, d.dst_head_offset, d.num_heads, d.heads_moved) == (2, 0, 2, 2)
    assert d.bytes_per_block == CTX4.bytes_per_block // 2 == GEN2.bytes_per_block
    assert d.total_bytes == 3 * GEN2.bytes_per_block and tx.state_of(7) == SendState.SENDING
    # the whole-pool default still means equal pools, and still refuses unequal ones
    assert transfer_mismatch(CTX4, CTX4, HeadSlice()) == ""
    assert "kv_shape (2, 16, 4, 32) vs (2, 16, 2, 32)" in transfer_mismatch(CTX4, GEN2, HeadSlice())
    # every head of two equal pools, named explicitly, is the same transfer
    assert transfer_mismatch(CTX4, CTX4, HeadSlice(0, 0, 4)) == ""


@pytest.mark.parametrize("heads, words", [
    (HeadSlice(3, 0, 2), ["[3, 5) of the context pool's 4 local KV heads", "[0, 2)",
                          "generation pool's 2"]),
    (HeadSlice(0, 1, 2), ["[0, 2) of the context pool's 4", "[1, 3) of the generation pool's 2"]),
])
def test_a_slice_outside_either_pool_is_refused_naming_both_sides(heads: HeadSlice,
                                                                 words: list[str]) -> None:
    tx = sender()
    with pytest.raises(TransferRejected) as err:
        tx.claim(request(heads=heads))
    assert "KV layout mismatch" in str(err.value)
    for w in words:
        assert w in str(err.value)
    assert tx.state_of(7) == SendState.LEASED  # refused: the lease is untouched


@pytest.mark.parametrize("gen, words", [
    (KVLayout("float16", GEN2.bytes_per_block, GEN2.kv_shape), ["dtype bfloat16 vs float16"]),
    (KVLayout("bfloat16", GEN2.bytes_per_block * 2, (2, 16, 2, 64)), ["head_dim 32 vs 64"]),
    (KVLayout("bfloat16", GEN2.bytes_per_block * 3, (6, 16, 2, 32)), ["num_layers 2 vs 6"]),
    (KVLayout("bfloat16", GEN2.bytes_per_block, (2, 16, 2, 32), num_planes=1),
     ["planes per layer 2 (K and V) vs 1 (MLA latent)"]),
    (KVLayout("bfloat16", GEN2.bytes_per_block + 2, GEN2.kv_shape), ["bytes_per_block"]),
])
def test_a_slice_between_pools_that_differ_beyond_their_heads_is_refused(gen: KVLayout,
                                                                         words: list[str]) -> None:
    with pytest.raises(TransferRejected) as err:
        sender().claim(request(gen, HeadSlice(0, 0, 2)))
    for w in words:
        assert w in str(err.value)


def test_a_request_for_another_context_rank_is_refused_naming_both() -> None:
    tx = sender(tp=(2, 1))
    for tp in ((1, 0), (2, 0), (4, 1)):
        with pytest.raises(TransferRejected) as err:
            tx.claim(request(heads=HeadSlice(0, 0, 2), tp=tp))
        assert (f"expects context tensor parallel size {tp[0]} rank {tp[1]}" in str(err.value)
                and "this context worker is size 2 rank 1" in str(err.value))
    # checked first: even an unknown request is refused for the rank
    with pytest.raises(TransferRejected, match="tensor parallel mismatch"):
        tx.claim(request(ctx_request_id=99))
    assert tx.state_of(7) == SendState.LEASED
    assert tx.claim(request(heads=HeadSlice(0, 0, 2), tp=(2, 1))).ctx_rank == 1


def test_the_generation_side_states_its_slice_and_expectation() -> None:
    rx = ReceiverSessions("gen-0", GEN2, default_timeout_s=10.0)
    rx.reserve(1, ctx_worker_id="ctx-0", ctx_request_id=7, block_ids=(5, 6, 7),
               heads=HeadSlice(2, 0, 2), ctx_tp=(1, 0))
    msg = rx.request(1, group=GROUP, seq=1)
    assert (msg.src_head_offset, msg.dst_head_offset, msg.num_heads) == (2, 0, 2)
    d = rx.descriptor(1)
    assert d.bytes_per_block == GEN2.bytes_per_block and d.total_bytes == 3 * GEN2.bytes_per_block
    again = rx.reissue(1, group="pdserve-kv/c/g/1/1", seq=1)
    assert again is not None and again.heads == msg.heads and again.ctx_tp_size == 1
    # The two sides compute the same wire bytes for one slice.
    assert sender().claim(msg).bytes_per_block == d.bytes_per_block
    with pytest.raises(ValueError, match="does not fit this pool's 2 local KV heads"):
        rx.reserve(2, ctx_worker_id="ctx-0", ctx_request_id=8, block_ids=(1,),
                   heads=HeadSlice(0, 1, 2))


# ---------------------------------------------------------------------------- the block mover


def pool(heads: int, seed: int) -> KVPool:
    p = KVPool(2, 12, 4, heads, 8, dtype=torch.float32)
    p.kv.copy_(torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return p


def move(src: KVPool, dst: KVPool, src_ids: tuple[int, ...], dst_ids: tuple[int, ...],
         src_heads: tuple[int, int] | None, dst_heads: tuple[int, int] | None,
         row_bytes: int, chunk_bytes: int) -> tuple[BlockMover, BlockMover]:
    """Gather every chunk on one side and scatter it on the other, as the wire would."""
    planes, blocks = choose_chunking(2 * src.num_layers, len(src_ids), row_bytes, chunk_bytes)
    a = BlockMover(src, src_ids, planes, blocks, StagingRing(1, "cpu"), heads=src_heads)
    b = BlockMover(dst, dst_ids, planes, blocks, StagingRing(1, "cpu"), heads=dst_heads)
    assert a.staging_bytes == b.staging_bytes
    buf = torch.zeros(a.staging_bytes, dtype=torch.uint8)
    for c in a.chunks:
        wire = a.gather(c, buf)
        assert wire.is_contiguous() and wire.numel() == a.nbytes(c) == b.nbytes(c)
        b.scatter(c, wire)
    return a, b


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 512])
def test_the_mover_carries_a_slice_of_heads_into_a_slice_of_heads(chunk_bytes: int) -> None:
    src, dst = pool(4, 1), pool(2, 2)
    before = dst.kv.clone()
    src_ids, dst_ids = (9, 2, 5, 11), (0, 7, 3, 4)
    row_bytes = 4 * 1 * 8 * 4  # tokens x one head x head dim x float32
    a, b = move(src, dst, src_ids, dst_ids, (1, 1), (1, 1), row_bytes, chunk_bytes)
    assert a.sliced and b.sliced and a.row_bytes == b.row_bytes == row_bytes
    assert all(a.direct(c) is None for c in a.chunks)  # never sent from a strided view
    assert torch.equal(dst.kv[:, :, list(dst_ids), :, 1:2], src.kv[:, :, list(src_ids), :, 1:2])
    assert torch.equal(dst.kv[:, :, :, :, 0], before[:, :, :, :, 0])  # the other head untouched
    untouched = [i for i in range(12) if i not in dst_ids]
    assert torch.equal(dst.kv[:, :, untouched], before[:, :, untouched])


def test_a_sliced_source_fills_a_whole_destination_pool() -> None:
    """Context TP 1 -> generation TP 2 of 4 KV heads: each destination pool holds two heads."""
    src = pool(4, 3)
    ids = (3, 4, 5, 6)
    for m in plan_kv_moves(1, 2, 4, "gqa"):
        dst = pool(2, 10 + m.dst_rank)
        a, b = move(src, dst, ids, ids, (m.src_offset, m.num_heads), (m.dst_offset, m.num_heads),
                    4 * 2 * 8 * 4, 1 << 20)
        assert a.sliced and not b.sliced  # the destination takes whole rows
        assert torch.equal(dst.kv[:, :, list(ids)], src.kv[:, :, list(ids), :, m.src_heads])


@pytest.mark.parametrize("heads", [None, (0, 4)])
def test_all_of_the_pools_heads_take_the_whole_row_path(heads: tuple[int, int] | None) -> None:
    """No slice, or one naming every head: the rows travel whole, and a single-plane chunk over
    consecutive ids is the pool's own memory (the copy-free path)."""
    src = pool(4, 4)
    ids = (4, 5, 6)
    mover = BlockMover(src, ids, 1, 3, StagingRing(1, "cpu"), heads=heads)
    assert not mover.sliced and mover.row_bytes == src.bytes_per_block // 4
    c = plan_chunks(4, 3, 1, 3)[0]
    view = mover.direct(c)
    assert view is not None and view.data_ptr() == src.kv[0, 0, 4].data_ptr()
    with pytest.raises(IndexError, match="outside the pool's 4 local KV heads"):
        BlockMover(src, ids, 1, 3, StagingRing(1, "cpu"), heads=(3, 2))

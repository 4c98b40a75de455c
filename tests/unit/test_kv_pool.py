"""KVPool: layout, sizing, and gather/scatter of whole blocks in fp32, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transport.kv_pool import KVPool

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _pool(dtype: torch.dtype = torch.float32, num_blocks: int = 10) -> KVPool:
    pool = KVPool(3, num_blocks, 4, 2, 8, dtype=dtype)
    # Distinct, exactly representable values in every dtype: small integers.
    pool.kv.copy_((torch.arange(pool.kv.numel()) % 251).view(pool.kv.shape).to(dtype))
    return pool


def test_layout_and_attributes() -> None:
    pool = KVPool(3, 10, 4, 2, 8, dtype=torch.bfloat16)
    assert pool.kv.shape == (3, 2, 10, 4, 2, 8)
    assert (pool.num_layers, pool.num_blocks, pool.tokens_per_block) == (3, 10, 4)
    assert (pool.num_kv_heads, pool.head_dim, pool.dtype) == (2, 8, torch.bfloat16)
    assert pool.device == torch.device("cpu")
    assert pool.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2
    assert pool.layer(1).shape == (2, 10, 4, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_returns_blocks_in_order(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    ids = [7, 2, 9, 2]
    out = pool.gather_blocks(ids)
    assert out.shape == (3, 2, 4, 4, 2, 8) and out.dtype == dtype and out.is_contiguous()
    for i, b in enumerate(ids):
        assert torch.equal(out[:, :, i], pool.kv[:, :, b])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_then_gather_round_trip(dtype: torch.dtype) -> None:
    src = _pool(dtype)
    dst = KVPool(3, 12, 4, 2, 8, dtype=dtype)
    data = src.gather_blocks([1, 5, 3])
    dst.scatter_blocks([11, 0, 6], data)
    assert torch.equal(dst.gather_blocks([11, 0, 6]), data)
    assert torch.equal(dst.kv[:, :, 0], src.kv[:, :, 5])
    untouched = [b for b in range(12) if b not in (11, 0, 6)]
    assert not dst.gather_blocks(untouched).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_into_preallocated_out(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    out = torch.empty(pool.block_shape(2), dtype=dtype)
    assert pool.gather_blocks(torch.tensor([4, 0]), out=out) is out
    assert torch.equal(out[:, :, 1], pool.kv[:, :, 0])
    with pytest.raises(ValueError):
        pool.gather_blocks([4, 0, 1], out=out)
    with pytest.raises(ValueError):
        pool.gather_blocks([4, 0], out=out.float() if dtype != torch.float32 else out.half())


def test_scatter_converts_dtype_and_rejects_bad_input() -> None:
    pool = KVPool(2, 6, 4, 1, 4, dtype=torch.bfloat16)
    data = torch.full(pool.block_shape(1), 1.5, dtype=torch.float32)
    pool.scatter_blocks([3], data)
    assert pool.kv[:, :, 3].eq(1.5).all() and pool.kv.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        pool.scatter_blocks([1, 1], torch.zeros(pool.block_shape(2)))  # duplicate ids
    with pytest.raises(ValueError):
        pool.scatter_blocks([1, 2], torch.zeros(pool.block_shape(1)))  # wrong shape
    with pytest.raises(IndexError):
        pool.gather_blocks([6])
    with pytest.raises(IndexError):
        pool.scatter_blocks([-1], torch.zeros(pool.block_shape(1)))


def test_bytes_per_block() -> None:
    """Pool sizing from a memory budget is workers/loading/memory.py's (plan_memory, tested in
    test_hub.py); the pool only states what one block takes."""
    per_block = KVPool.bytes_per_block_for(4, 16, 2, 32, torch.float16)
    assert per_block == 4 * 2 * 16 * 2 * 32 * 2
    pool = KVPool(4, 5, 16, 2, 32, dtype=torch.float16)
    assert pool.bytes_per_block == per_block and pool.kv.numel() * 2 == per_block * 5


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_scatter_gather_property(ids: list[int], dtype: torch.dtype, seed: int) -> None:
    pool = KVPool(2, 16, 2, 2, 4, dtype=dtype)
    data = torch.randn(pool.block_shape(len(ids)), generator=torch.Generator().manual_seed(seed)).to(dtype)
    before = pool.kv.clone()
    pool.scatter_blocks(ids, data)
    assert torch.equal(pool.gather_blocks(ids), data)
    others = [b for b in range(16) if b not in ids]
    if others:  # blocks not named stay as they were
        assert torch.equal(pool.kv[:, :, others], before[:, :, others])


# ---------------------------------------------------------------- one plane (MLA latent)

# DeepSeek-V3-shaped latent, scaled down: kv_lora_rank 32 + qk_rope_head_dim 16 per token.
LATENT = 32 + 16


def _latent_pool(dtype: torch.dtype = torch.float32, num_blocks: int = 10) -> KVPool:
    pool = KVPool(3, num_blocks, 4, 1, LATENT, dtype=dtype, num_planes=1)
    pool.kv.copy_((torch.arange(pool.kv.numel()) % 251).view(pool.kv.shape).to(dtype))
    return pool


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_plane_pool_is_sized_by_the_latent(dtype: torch.dtype) -> None:
    pool = _latent_pool(dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert pool.kv.shape == (3, 1, 10, 4, 1, LATENT) and pool.num_planes == 1
    assert pool.bytes_per_block == 3 * 4 * 1 * LATENT * itemsize  # layers * B * latent, no K+V
    assert pool.bytes_per_block == KVPool.bytes_per_block_for(3, 4, 1, LATENT, dtype, 1)
    assert pool.kv.numel() * itemsize == pool.bytes_per_block * pool.num_blocks
    assert pool.layer(2).shape == (1, 10, 4, 1, LATENT)
    with pytest.raises(ValueError, match="num_planes"):
        KVPool(3, 10, 4, 1, LATENT, num_planes=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_plane_gather_scatter_and_copy_round_trip(dtype: torch.dtype) -> None:
    src = _latent_pool(dtype)
    data = src.gather_blocks([7, 2, 9])
    assert data.shape == (3, 1, 3, 4, 1, LATENT) and data.is_contiguous()
    for i, b in enumerate([7, 2, 9]):
        assert torch.equal(data[:, :, i], src.kv[:, :, b])
    dst = KVPool(3, 12, 4, 1, LATENT, dtype=dtype, num_planes=1)
    dst.scatter_blocks([11, 0, 6], data)
    assert torch.equal(dst.gather_blocks([11, 0, 6]), data)
    assert not dst.gather_blocks([b for b in range(12) if b not in (11, 0, 6)]).any()
    dst.copy_block(0, 5)
    assert torch.equal(dst.kv[:, :, 5], src.kv[:, :, 2])
    with pytest.raises(ValueError):  # a K+V-shaped payload does not fit a latent pool
        dst.scatter_blocks([1], torch.zeros(KVPool(3, 2, 4, 1, LATENT).block_shape(1)))


def test_layouts_of_one_and_two_plane_pools_never_match() -> None:
    """The layout both sides of a transfer compare: a latent pool and a K+V pool of half its
    width have equal bytes per block, yet a claim is refused, and the reason names the planes."""
    from pdserve.transport.kv_groups import layout_of, plane_block_bytes, wire_planes
    from pdserve.transport.protocol import KVRequest, TransferRejected
    from pdserve.transport.session_sides import SenderSessions

    latent = KVPool(3, 4, 4, 1, 2 * LATENT, num_planes=1)
    kv = KVPool(3, 4, 4, 1, LATENT)
    assert latent.bytes_per_block == kv.bytes_per_block  # the size alone cannot tell them apart
    a, b = layout_of(latent), layout_of(kv)
    assert (a.num_planes, b.num_planes) == (1, 2) and a != b
    assert "planes per layer 1 (MLA latent) vs 2 (K and V)" in a.mismatch(b)
    assert a.mismatch(layout_of(KVPool(3, 9, 4, 1, 2 * LATENT, num_planes=1))) == ""
    assert (wire_planes(latent), plane_block_bytes(latent)) == (3, 4 * 2 * LATENT * 4)
    assert (wire_planes(kv), plane_block_bytes(kv)) == (6, 4 * LATENT * 4)

    tx = SenderSessions("ctx-0", a, lease_s=10.0)
    tx.lease(7, [0, 1])
    req = KVRequest(0, 0, "pdserve-kv/c/g/1/0", "gen-0", 7, 9, 2, 0, (2, 3), b.dtype,
                    b.bytes_per_block, b.kv_shape, 5.0, False, b.num_planes)
    with pytest.raises(TransferRejected, match=r"planes per layer 1 \(MLA latent\) vs 2"):
        tx.claim(req)


def test_block_mover_moves_one_plane_rows() -> None:
    """The transfer's pool <-> wire mover over a latent pool: every chunking the sender may
    pick moves exactly the named blocks' latent rows, layer by layer."""
    from pdserve.transport.kv_groups import BlockMover, StagingRing, plane_block_bytes
    from pdserve.transport.protocol import chunk_layer

    src, dst = _latent_pool(), KVPool(3, 10, 4, 1, LATENT, num_planes=1)
    src_ids, dst_ids = (7, 2, 3, 4), (0, 1, 2, 9)
    for planes, blocks in [(3, 4), (1, 4), (1, 2), (2, 4)]:
        dst.kv.zero_()
        out = BlockMover(src, src_ids, planes, blocks, StagingRing(2, "cpu"))
        into = BlockMover(dst, dst_ids, planes, blocks, StagingRing(2, "cpu"))
        assert out.row_bytes == plane_block_bytes(src) == 4 * LATENT * 4
        assert sum(out.nbytes(c) for c in out.chunks) == len(src_ids) * src.bytes_per_block
        buf = torch.zeros(out.staging_bytes, dtype=torch.uint8)
        for c in out.chunks:
            if planes == 1:
                assert chunk_layer(c, 1) == c.plane_start  # one plane: the plane is the layer
            into.scatter(c, out.gather(c, buf))
        assert torch.equal(dst.gather_blocks(dst_ids), src.gather_blocks(src_ids))

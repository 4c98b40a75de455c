"""KVPool: layout, sizing, and gather/scatter of whole blocks in fp32, bf16 and fp16."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.workers.kv_pool import KVPool

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


def test_memory_budget_sizing() -> None:
    per_block = KVPool.bytes_per_block_for(4, 16, 2, 32, torch.float16)
    assert per_block == 4 * 2 * 16 * 2 * 32 * 2
    assert KVPool.num_blocks_for_budget(per_block * 7 + per_block - 1, 4, 16, 2, 32, dtype=torch.float16) == 7
    assert KVPool.num_blocks_for_budget(per_block - 1, 4, 16, 2, 32, dtype=torch.float16) == 0
    pool = KVPool.from_memory_budget(per_block * 5, 4, 16, 2, 32, dtype=torch.float16)
    assert pool.num_blocks == 5 and pool.kv.numel() * 2 == per_block * 5
    with pytest.raises(ValueError):
        KVPool.from_memory_budget(per_block - 1, 4, 16, 2, 32, dtype=torch.float16)


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

"""What a worker says it can take (workers/engine/admission.py ``max_request_tokens``) and what the
router then accepts (cluster/router/core.py ``request_limits``): full attention is capped at the
pool's tokens, a window that slides over every layer at the model's own max_seq_len, since its
pool holds only W + T tokens per sequence whatever the length."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve.cluster.router.config import RouterConfig
from pdserve.cluster.router.core import Router, request_limits
from pdserve.scheduler import KVCacheManager
from pdserve.scheduler.kv_window import SlidingWindowKVCacheManager
from pdserve.transport.requests import WorkerInfo
from pdserve.workers.engine.admission import max_request_tokens

B = 4


def _window_kv(pool_blocks: int, window: int = 8, max_num_tokens: int = 16):
    return SlidingWindowKVCacheManager(pool_blocks, B, attention_window=window,
                                       max_num_tokens=max_num_tokens, scratch_block=pool_blocks)


def _fits_every_split(kv, pool_blocks: int, total: int) -> bool:
    """check_request's test for every prompt/output split of ``total`` (prompt >= 1)."""
    return all(kv.blocks_to_completion_bound(p, total - p) <= pool_blocks for p in range(1, total + 1))


def test_full_attention_takes_what_its_pool_holds():
    kv = KVCacheManager(64, B)
    assert max_request_tokens(kv, 64, 4096) == 64 * B
    assert max_request_tokens(kv, 64, 100) == 100  # the model's own limit first


def test_a_sliding_window_takes_the_models_max_seq_len_beyond_its_pools_tokens():
    kv = _window_kv(16)  # 64 tokens of pool; a sequence holds W + T = 8 + 20 tokens at most
    assert max_request_tokens(kv, 16, 4096) == 4096
    assert _fits_every_split(kv, 16, 4096)


@pytest.mark.parametrize("pool_blocks", [1, 2, 3, 5, 7, 8, 9])
def test_the_answer_is_exact_where_the_window_does_not_fit_the_pool(pool_blocks):
    # Small pools: the longest total whose every split fits, checked split by split.
    kv = _window_kv(pool_blocks)
    got = max_request_tokens(kv, pool_blocks, 200)
    if got < 200:
        assert not _fits_every_split(kv, pool_blocks, got + 1)
    assert all(_fits_every_split(kv, pool_blocks, t) for t in range(1, got + 1))


def _info(worker_id: str, role: str, *, blocks: int, max_seq_len: int = 4096,
          max_request: int | None = None) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, pid=1, num_kv_blocks=blocks,
                      tokens_per_block=B, max_batch_size=8, max_input_len=max_seq_len - 1,
                      max_seq_len=max_seq_len, max_num_tokens=256, vocab_size=100, endpoint="",
                      incarnation=1, request_endpoint="", request_token="",
                      max_request_tokens=max_request)


class _Tokenizer:
    """What the router's constructor reads of a tokenizer: the vocabulary's longest token."""

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 100

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "ab"


def test_the_router_caps_a_windowed_worker_at_what_it_reports_not_at_its_pool():
    ctx = _info("ctx-0", "context", blocks=16, max_request=4096)  # windowed: pool of 64 tokens
    gen = _info("gen-0", "generation", blocks=16, max_request=4096)
    router = Router(RouterConfig(), {}, {"ctx-0": ctx, "gen-0": gen}, _Tokenizer())
    try:
        assert (router.limits.max_seq_len, router.limits.max_input_len) == (4096, 4095)
    finally:
        router._text_pool.shutdown()
    limits = request_limits({"ctx-0": ctx, "gen-0": gen}, 100)
    assert (limits.max_seq_len, limits.max_input_len) == (4096, 4095)
    # A full-attention worker (or one that does not report) is capped at its pool's tokens,
    # and one request must fit every worker.
    full = dataclasses.replace(gen, worker_id="gen-1", max_request_tokens=None)
    limits = request_limits({"ctx-0": ctx, "gen-0": gen, "gen-1": full}, 100)
    assert (limits.max_seq_len, limits.max_input_len) == (64, 63)
    reported = dataclasses.replace(full, max_request_tokens=64)
    assert request_limits({"ctx-0": ctx, "gen-1": reported}, 100).max_seq_len == 64

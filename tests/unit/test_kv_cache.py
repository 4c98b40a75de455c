"""KVCacheManager: allocation, beams, reuse, eviction, scheduling simulation, prefix analysis."""
from __future__ import annotations

import pytest

from pdserve.scheduler.kv_cache import (
    KVCacheManager,
    KVCacheOutOfBlocksError,
    KVCacheStats,
)
from pdserve.scheduler.kv_prefix_reuse import PrefixReuseSummary
from pdserve.scheduler.request import LlmRequest

B = 10


def req(rid: int, tokens: list[int] | int, max_new: int = 8, **kw) -> LlmRequest:
    if isinstance(tokens, int):
        tokens = [1000 + rid * 1000 + i for i in range(tokens)]  # unique per request
    return LlmRequest(rid, tokens, max_new, **kw)


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def kv(num_blocks: int = 20, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, B, **kw)


# ---- attributes -------------------------------------------------------------------------------
def test_plain_attributes():
    m = KVCacheManager(7, 4, max_attention_window=64, enable_block_reuse=True, sink_token_length=3)
    assert (m.num_blocks, m.tokens_per_block, m.max_attention_window) == (7, 4, 64)
    assert m.enable_block_reuse and not m.is_variable_window and not m.is_cross
    assert m.sink_token_length == 3 and m.num_reused_blocks == 0
    assert m.sink_bubble_length == 1 and m.max_token_num == 65
    assert KVCacheManager(7, 4, sink_token_length=8).sink_bubble_length == 0
    assert KVCacheManager(7, 4).max_token_num is None


def test_cross_manager_rejects_reuse():
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, is_cross=True, enable_block_reuse=True)


# ---- allocation -------------------------------------------------------------------------------
def test_add_sequence_allocates_prompt_blocks():
    m = kv()
    r = req(1, 25)
    m.add_sequence(r)
    ids = m.get_block_ids(1)
    assert len(ids) == 3 == m.get_num_allocated_blocks(1) and len(set(ids)) == 3
    assert m.get_num_tokens(1) == 25 and m.has_sequence(1)
    assert m.get_num_free_blocks() == 17 and m.get_num_used_blocks() == 3
    assert m.get_stats() == KVCacheStats(total=20, free=17, used=3, cached=0, reused=0)
    assert m.get_num_allocated_blocks(99) == 0
    with pytest.raises(ValueError):
        m.add_sequence(r)
    m.check_invariants()


def test_out_of_blocks_leaves_no_trace():
    m = kv(4)
    m.add_sequence(req(1, 20))
    with pytest.raises(KVCacheOutOfBlocksError):
        m.add_sequence(req(2, 25))
    assert not m.has_sequence(2) and m.get_num_free_blocks() == 2
    m.check_invariants()


def test_beam_search_shares_full_prompt_blocks_and_splits_the_partial_one():
    m = kv()
    m.add_sequence(req(1, 25, beam_width=2))
    b0, b1 = m.get_block_ids(1, 0), m.get_block_ids(1, 1)
    assert b0[:2] == b1[:2] and b0[2] != b1[2]
    assert m.get_num_used_blocks() == 4
    assert all(m.get_ref_count(b) == 1 for b in b0 + b1)  # one ref per sequence
    m.add_sequence(req(2, 20, beam_width=2))
    assert m.get_block_ids(2, 0) == m.get_block_ids(2, 1) and m.get_num_used_blocks() == 6
    m.check_invariants()


def test_add_token_allocates_on_block_boundary():
    m = kv()
    m.add_sequence(req(1, 10))
    assert m.get_num_allocated_blocks(1) == 1
    m.add_token(1)  # token 11 opens block 2
    assert m.get_num_allocated_blocks(1) == 2 and m.get_num_tokens(1) == 11
    for _ in range(9):
        m.add_token(1)
    assert m.get_num_allocated_blocks(1) == 2 and m.get_num_tokens(1) == 20
    m.add_token(1)
    assert m.get_num_allocated_blocks(1) == 3
    m.check_invariants()


def test_add_token_allocates_one_block_per_beam():
    m = kv()
    m.add_sequence(req(1, 20, beam_width=3))
    m.add_token(1)
    tails = {m.get_block_ids(1, b)[-1] for b in range(3)}
    assert len(tails) == 3 and m.get_num_used_blocks() == 5
    m.check_invariants()


def test_add_token_out_of_blocks_changes_nothing():
    m = kv(2)
    m.add_sequence(req(1, 20))
    with pytest.raises(KVCacheOutOfBlocksError):
        m.add_token(1)
    assert m.get_num_tokens(1) == 20 and m.get_num_allocated_blocks(1) == 2
    with pytest.raises(KeyError):
        m.add_token(42)


def test_remove_sequence_frees_everything_and_ignores_unknown_ids():
    m = kv()
    m.add_sequence(req(1, 25, beam_width=2))
    m.add_token(1)
    assert m.remove_sequence(1) is True
    assert m.get_num_free_blocks() == 20 and not m.has_sequence(1)
    assert m.remove_sequence(1) is False
    m.check_invariants()


def test_sliding_window_detaches_front_blocks():
    m = kv(10, max_attention_window=20)
    m.add_sequence(req(1, 15))
    first = m.get_block_ids(1)[0]
    for _ in range(14):  # 29 tokens: three blocks, nothing out of the window yet
        m.add_token(1)
    assert m.get_num_allocated_blocks(1) == 3 and m.get_num_front_blocks_removed(1) == 0
    m.add_token(1)  # 30 tokens: the span reaches W + B, block 0 leaves the window
    assert m.get_num_front_blocks_removed(1) == 1
    assert first not in m.get_block_ids(1) and m.get_num_allocated_blocks(1) == 2
    m.add_token(1)  # token 31 opens a new block
    assert m.get_num_allocated_blocks(1) == 3 and m.get_num_used_blocks() == 3
    m.check_invariants()


def test_long_prompt_is_capped_to_the_window():
    m = kv(10, max_attention_window=20, temporary_attention_window=5)
    m.add_sequence(req(1, 55))
    assert m.get_num_allocated_blocks(1) == 3  # ceil(min(55, 20 + 5) / 10)
    assert m.get_num_front_blocks_removed(1) == 3


# ---- reuse ------------------------------------------------------------------------------------
def test_store_caches_full_blocks_of_the_first_p_minus_1_tokens():
    m = kv(enable_block_reuse=True)
    r = req(1, prompt(21))
    m.add_sequence(r)
    assert m.store_context_blocks(r) == 2  # 20 of the 20 stored tokens
    r2 = req(2, prompt(20, base=500))
    m.add_sequence(r2)
    assert m.store_context_blocks(r2) == 1  # 19 tokens: one full block
    assert m.get_stats().cached == 3
    assert m.store_context_blocks(req(3, 30)) == 0  # unknown sequence
    m.check_invariants()


def test_store_is_a_noop_without_reuse():
    m = kv()
    r = req(1, 31)
    m.add_sequence(r)
    assert m.store_context_blocks(r) == 0 and m.get_stats().cached == 0


def test_reuse_on_add_sequence_sets_prepopulated_length_and_shares_blocks():
    m = kv(enable_block_reuse=True)
    a = req(1, prompt(31))
    m.add_sequence(a)
    m.store_context_blocks(a)
    b = req(2, prompt(31))
    m.add_sequence(b)
    assert b.prepopulated_prompt_len == 30 and b.context_current_position == 30
    assert m.num_reused_blocks == 3 and m.get_stats().reused == 3
    assert m.get_block_ids(2)[:3] == m.get_block_ids(1)[:3]
    assert m.get_block_ids(2)[3] != m.get_block_ids(1)[3]
    assert [m.get_ref_count(x) for x in m.get_block_ids(2)] == [2, 2, 2, 1]
    assert m.get_num_used_blocks() == 5
    m.check_invariants()


def test_reuse_never_covers_the_last_prompt_token():
    m = kv(enable_block_reuse=True)
    a = req(1, prompt(30))
    m.add_sequence(a)
    m.store_context_blocks(a)
    b = req(2, prompt(30))
    m.add_sequence(b)
    assert b.prepopulated_prompt_len == 20  # (30 - 1) // 10 blocks


def test_free_cached_block_is_reclaimed_by_a_later_request():
    m = kv(4, enable_block_reuse=True)
    a = req(1, prompt(21))
    m.add_sequence(a)
    m.store_context_blocks(a)
    m.remove_sequence(1)
    assert m.get_num_free_blocks() == 4 and m.get_stats().cached == 2
    b = req(2, prompt(25))
    m.add_sequence(b)  # 2 reclaimed + 1 new
    assert b.prepopulated_prompt_len == 20 and m.get_num_free_blocks() == 1
    m.check_invariants()


def test_reclaimed_blocks_do_not_count_as_available_for_new_ones():
    m = kv(3, enable_block_reuse=True)
    a = req(1, prompt(21))
    m.add_sequence(a)
    m.store_context_blocks(a)
    m.remove_sequence(1)
    with pytest.raises(KVCacheOutOfBlocksError):
        m.add_sequence(req(2, prompt(41)))  # reuses 2, needs 3 more: only 1 left
    assert m.get_stats().cached == 2 and m.get_num_free_blocks() == 3
    m.check_invariants()


def test_duplicate_block_stays_private():
    m = kv(enable_block_reuse=True)
    a, b = req(1, prompt(21)), req(2, prompt(21))
    m.add_sequence(a)
    m.add_sequence(b)  # nothing cached yet: b gets its own blocks
    a_blocks, b_blocks = m.get_block_ids(1), m.get_block_ids(2)
    assert not set(a_blocks) & set(b_blocks)
    assert m.store_context_blocks(a) == 2
    assert m.store_context_blocks(b) == 0  # keys already cached by a's blocks
    m.remove_sequence(2)
    m.remove_sequence(1)
    assert sorted(m._tree.free_cached_blocks()) == sorted(a_blocks[:2])
    assert not any(m._tree.is_cached(x) for x in b_blocks)
    assert m.get_num_free_blocks() == 20
    m.check_invariants()


def test_lora_id_separates_reuse():
    m = kv(enable_block_reuse=True)
    a = req(1, prompt(21), lora_task_id=5)
    m.add_sequence(a)
    m.store_context_blocks(a)
    other = req(2, prompt(21), lora_task_id=6)
    m.add_sequence(other)
    assert other.prepopulated_prompt_len == 0
    same = req(3, prompt(21), lora_task_id=5)
    m.add_sequence(same)
    assert same.prepopulated_prompt_len == 20


def test_allocation_takes_plain_free_blocks_before_evicting():
    m = kv(4, enable_block_reuse=True)
    a = req(1, prompt(11))
    m.add_sequence(a)
    m.store_context_blocks(a)
    cached = m.get_block_ids(1)[0]
    m.remove_sequence(1)
    m.add_sequence(req(2, 30))  # 3 plain free blocks exist: the cached one survives
    assert m.get_stats().cached == 1 and cached not in m.get_block_ids(2)
    m.add_sequence(req(3, 5))  # now it must be evicted
    assert m.get_block_ids(3) == [cached] and m.get_stats().cached == 0
    m.check_invariants()


def test_lru_evicts_the_least_recently_used_free_cached_block():
    m = kv(6, enable_block_reuse=True)
    blocks = {}
    for rid, base in ((1, 100), (2, 200), (3, 300)):
        r = req(rid, prompt(11, base))  # one cached full block + one private partial block
        m.add_sequence(r)
        m.store_context_blocks(r)
        blocks[rid] = m.get_block_ids(rid)[0]
    m.remove_sequence(2)
    m.remove_sequence(1)
    m.remove_sequence(3)  # LRU order: 2, 1, 3
    r = req(4, prompt(11, 100))
    m.add_sequence(r)  # reuses 1's block
    assert r.prepopulated_prompt_len == 10
    m.remove_sequence(4)  # released again: LRU order 2, 3, 1
    m.add_sequence(req(5, 30))  # the 3 plain free blocks go first
    assert m.get_stats().cached == 3
    m.add_sequence(req(6, 5))
    assert m.get_block_ids(6) == [blocks[2]]
    m.add_sequence(req(7, 5))
    assert m.get_block_ids(7) == [blocks[3]]
    assert m.get_stats().cached == 1
    m.check_invariants()


def test_release_is_leaf_first_so_leaves_are_evicted_first():
    m = kv(3, enable_block_reuse=True)
    a = req(1, prompt(21))
    m.add_sequence(a)
    m.store_context_blocks(a)
    root_block, leaf_block = m.get_block_ids(1)[:2]
    m.remove_sequence(1)
    m.add_sequence(req(2, 15))  # takes the plain free block, then evicts the leaf
    assert leaf_block in m.get_block_ids(2)
    b = req(3, prompt(21))
    assert m.analyze_prefix_reuse(b.get_tokens(0), b).reusable_blocks_all == 1
    assert m.get_ref_count(root_block) == 0
    m.check_invariants()


def test_evicting_an_ancestor_uncaches_in_use_descendants():
    m = kv(6, enable_block_reuse=True)
    a, b = req(1, prompt(11)), req(2, prompt(21))
    m.add_sequence(a)
    m.add_sequence(b)  # b duplicates a's first block
    m.store_context_blocks(a)
    m.store_context_blocks(b)  # b's second block is cached below a's first block
    b_second = m.get_block_ids(2)[1]
    m.remove_sequence(1)  # a's first block is free cached; b still holds its child
    m.add_sequence(req(3, 25))  # 3 blocks: 2 plain free + evicts a's block
    assert m.get_stats().cached == 0 and m.get_ref_count(b_second) == 1
    m.check_invariants()
    m.remove_sequence(2)
    m.remove_sequence(3)
    assert m.get_num_free_blocks() == 6
    m.check_invariants()


# ---- scheduling simulation --------------------------------------------------------------------
def test_scheduling_simulation_never_touches_real_state():
    m = kv(10, enable_block_reuse=True)
    a = req(1, prompt(21))
    m.add_sequence(a)
    m.store_context_blocks(a)
    b = req(2, prompt(25))
    m.add_sequence(b)  # shares 2 blocks with a
    m.add_sequence(req(3, 10))
    real = (m.get_num_free_blocks(), [m.get_ref_count(x) for x in range(10)])
    m.start_scheduling()
    assert m.scheduling_has_free_blocks(5) and not m.scheduling_has_free_blocks(6)
    m.scheduling_remove_sequence(2)  # only its private block frees
    assert m.get_scheduling_num_free_blocks() == 6
    m.scheduling_remove_sequence(2)  # idempotent within a round
    assert m.get_scheduling_num_free_blocks() == 6
    m.scheduling_remove_sequence(1)  # now the shared blocks free too
    assert m.get_scheduling_num_free_blocks() == 9 and m.scheduling_has_free_blocks(9)
    m.scheduling_remove_sequence(99)  # unknown: no-op
    assert (m.get_num_free_blocks(), [m.get_ref_count(x) for x in range(10)]) == real
    m.start_scheduling()  # a new round starts from the real state
    assert m.get_scheduling_num_free_blocks() == 5
    m.scheduling_remove_sequence(3)
    assert m.get_scheduling_num_free_blocks() == 6
    m.check_invariants()


# ---- analyze_prefix_reuse ---------------------------------------------------------------------
def test_analyze_on_k_times_b_plus_1_prompts():
    m = kv(enable_block_reuse=True)
    a = req(1, prompt(31))
    m.add_sequence(a)
    m.store_context_blocks(a)
    b = req(2, prompt(31))
    assert m.analyze_prefix_reuse(b.get_tokens(0), b) == PrefixReuseSummary(3, 3, None)
    m.remove_sequence(1)
    assert m.analyze_prefix_reuse(b.get_tokens(0), b) == PrefixReuseSummary(0, 3, None)


def test_analyze_first_new_block_key_identifies_prefix_and_lora():
    m = kv(enable_block_reuse=True)
    a = req(1, prompt(21))
    m.add_sequence(a)
    m.store_context_blocks(a)
    x = req(2, prompt(31))
    y = req(3, prompt(30) + [7])  # same first 30 tokens, different last token
    z = req(4, prompt(20) + [9] * 11)  # different third block
    sx = m.analyze_prefix_reuse(x.get_tokens(0), x)
    sy = m.analyze_prefix_reuse(y.get_tokens(0), y)
    sz = m.analyze_prefix_reuse(z.get_tokens(0), z)
    assert sx.reusable_blocks_all == sx.reusable_blocks_allocated == 2
    assert sx.first_new_block is not None and hash(sx.first_new_block) is not None
    assert sx.first_new_block == sy.first_new_block != sz.first_new_block
    lx = req(5, prompt(31), lora_task_id=1)
    sl = m.analyze_prefix_reuse(lx.get_tokens(0), lx)
    assert sl.reusable_blocks_all == 0 and sl.first_new_block not in (sx.first_new_block, None)


def test_analyze_short_prompts_and_empty_tree():
    m = kv(enable_block_reuse=True)
    r = req(1, 10)
    assert m.analyze_prefix_reuse(r.get_tokens(0), r) == PrefixReuseSummary(0, 0, None)
    r = req(2, 11)
    s = m.analyze_prefix_reuse(r.get_tokens(0), r)
    assert s[:2] == (0, 0) and s.first_new_block is not None


def test_block_keys_follow_a_growing_prompt():
    m = kv(enable_block_reuse=True)
    r = LlmRequest(1, prompt(15), 30)
    before = m.analyze_prefix_reuse(r.get_tokens(0), r).first_new_block
    for t in range(15, 35):
        r.add_new_token(t)
    r.state = r.state.GENERATION_IN_PROGRESS
    r.pause(max_input_len=100)  # prompt becomes 35 tokens
    fresh = LlmRequest(2, prompt(35), 30)
    a = m.analyze_prefix_reuse(r.get_tokens(0), r)
    assert a == m.analyze_prefix_reuse(fresh.get_tokens(0), fresh)
    assert a.first_new_block == before  # nothing cached: the first block is the first new one
    # Store the grown prompt and check the third block is found through the extended keys.
    m.add_sequence(r)
    m.store_context_blocks(r)
    assert m.analyze_prefix_reuse(fresh.get_tokens(0), fresh) == PrefixReuseSummary(3, 3, None)


def test_evicting_an_ancestor_frees_its_free_cached_descendants():
    m = kv(5, enable_block_reuse=True)
    a, b = req(1, prompt(11)), req(2, prompt(21))
    m.add_sequence(a)  # 2 blocks
    m.add_sequence(b)  # 3 blocks, its first duplicates a's first
    m.store_context_blocks(a)
    m.store_context_blocks(b)  # b's second block is cached below a's first block
    b_second = m.get_block_ids(2)[1]
    a_first = m.get_block_ids(1)[0]
    m.remove_sequence(1)  # LRU: a's first block
    m.remove_sequence(2)  # LRU: a's first, then b's second
    assert m.get_stats().cached == 2 and m.get_num_free_blocks() == 5
    m.add_sequence(req(3, 30))  # the 3 plain free blocks
    assert m.get_stats().cached == 2
    m.add_sequence(req(4, 10))  # evicts a's (older) block, which uncaches b's second too
    assert m.get_stats().cached == 0 and m.get_num_free_blocks() == 1
    assert m.get_block_ids(4) == [a_first]
    m.add_sequence(req(5, 10))
    assert m.get_block_ids(5) == [b_second]
    m.check_invariants()


def test_keys_past_the_prompt_are_not_cached():
    m = kv(enable_block_reuse=True)
    r = LlmRequest(1, prompt(11), 30)
    for t in (500 + i for i in range(20)):
        r.add_new_token(t)  # 31 tokens, prompt 11
    s_long = m.analyze_prefix_reuse(r.get_tokens(0), r)  # keys for 3 blocks, 1 cached on r
    assert len(r.block_key_cache[(B, False)].keys) == 1
    fresh = LlmRequest(2, r.get_tokens(0)[:31], 30)
    assert s_long == m.analyze_prefix_reuse(fresh.get_tokens(0), fresh)


def test_cached_summary_follows_tree_changes():
    m = kv(3, enable_block_reuse=True)
    r = req(9, prompt(11))
    first = m.analyze_prefix_reuse(r.get_tokens(0), r)
    assert first[:2] == (0, 0) and first.first_new_block is not None
    a = req(1, prompt(11))
    m.add_sequence(a)
    m.store_context_blocks(a)
    assert m.analyze_prefix_reuse(r.get_tokens(0), r) == PrefixReuseSummary(1, 1, None)
    m.remove_sequence(1)
    assert m.analyze_prefix_reuse(r.get_tokens(0), r) == PrefixReuseSummary(0, 1, None)
    m.add_sequence(req(2, 30))  # evicts the cached block
    assert m.analyze_prefix_reuse(r.get_tokens(0), r) == first


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    """n candidates fork one prefill: full blocks gain a ref, the partial last block is copied
    into a block of the child's own; each side frees only its refs."""
    kv = KVCacheManager(num_blocks=8, tokens_per_block=4)
    parent = req(1, 10)  # 10 tokens: 2 full blocks and a partial one
    kv.add_sequence(parent)
    assert kv.get_num_free_blocks() == 5
    child = req(-1, 10)
    src, dst = kv.fork_sequence(1, child)
    parent_blocks, child_blocks = kv.get_block_ids(1), kv.get_block_ids(-1)
    assert child_blocks[:2] == parent_blocks[:2] and src == parent_blocks[2] and dst == child_blocks[2] != src
    assert [kv.get_ref_count(b) for b in parent_blocks[:2]] == [2, 2] and kv.get_ref_count(dst) == 1
    assert kv.get_num_free_blocks() == 4 and kv.get_num_tokens(-1) == 10
    kv.add_token(-1)  # the child grows on its own
    kv.remove_sequence(1)
    assert kv.get_num_free_blocks() == 5  # the parent's partial block only: the full ones are the child's too
    kv.remove_sequence(-1)
    assert kv.get_num_free_blocks() == 8
    # On a block boundary nothing is copied; with no free block the fork takes nothing.
    kv.add_sequence(req(2, 8))
    assert kv.fork_sequence(2, req(-2, 8)) is None and kv.get_num_free_blocks() == 6
    full = KVCacheManager(num_blocks=3, tokens_per_block=4)
    full.add_sequence(req(3, 9))
    with pytest.raises(KVCacheOutOfBlocksError):
        full.fork_sequence(3, req(-3, 9))
    assert full.get_num_free_blocks() == 0 and not full.has_sequence(-3)
    assert [full.get_ref_count(b) for b in full.get_block_ids(3)] == [1, 1, 1]

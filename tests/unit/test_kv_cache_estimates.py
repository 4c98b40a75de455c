"""Block estimates: remaining-to-completion (scheduling.md 2.4) and needed-one-step (2.6)."""
from __future__ import annotations

from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.kv_prefix_reuse import PrefixReuseSummary
from pdserve.scheduler.request import LlmRequest, LlmRequestState as S, LlmRequestType

B = 10
ZERO = PrefixReuseSummary(0, 0, None)


def req(rid: int, p: int, n: int = 8, **kw) -> LlmRequest:
    return LlmRequest(rid, list(range(p)), n, **kw)


def kv(**kw) -> KVCacheManager:
    return KVCacheManager(100, B, **kw)


def remaining(m: KVCacheManager, r: LlmRequest, summary=None) -> int:
    r.estimated_reusable_tokens = 99  # the side effect must reset it
    return m.get_remaining_blocks_to_completion(r, summary)


def cached_manager(p: int, *, hold: bool) -> KVCacheManager:
    """A reuse-on manager that cached the full blocks of a p-token prompt 0..p-1."""
    m = kv(enable_block_reuse=True)
    a = req(1000, p)
    m.add_sequence(a)
    m.store_context_blocks(a)
    if not hold:
        m.remove_sequence(1000)
    return m


# ---- remaining blocks to completion -----------------------------------------------------------
def test_worked_example():
    assert remaining(kv(max_attention_window=90), req(1, 10, 80)) == 9


def test_no_window_counts_full_context_blocks_plus_generation_blocks():
    r = req(1, 25, 10)
    assert remaining(kv(), r) == 4  # ctx 2 full + (ceil(35/10) - 2) generation
    assert r.estimated_reusable_tokens == 0


def test_allocated_blocks_are_subtracted():
    m = kv()
    r = req(1, 25, 10)
    m.add_sequence(r)  # 3 blocks: alloc >= ctx blocks
    assert remaining(m, r) == 1


def test_beam_width_multiplies_generation_blocks_only():
    m = kv()
    r = req(1, 25, 10, beam_width=2)
    assert remaining(m, r) == 2 + 2 * 2
    m.add_sequence(r)  # beam-0 list holds 3 blocks
    assert remaining(m, r) == (4 - 3) * 2


def test_sink_bubble():
    # sink 4 -> S = 6: ctx (25 + 6) // 10 = 3, total ceil(41 / 10) = 5.
    assert remaining(kv(sink_token_length=4), req(1, 25, 10)) == 5
    assert remaining(kv(sink_token_length=20), req(1, 25, 10)) == 4  # multiple of B: no bubble


def test_window_with_temporary_window_and_sliding_extra_block():
    m = kv(max_attention_window=20, temporary_attention_window=5)
    r = req(1, 30, 10)
    # cap 25: ctx 2, total 3, gen 1; sliding: 40 > 20, ceil(40/10) = 4 > ceil(30/10) and > 3.
    assert remaining(m, r) == 2 + (1 + 1)
    for t in range(10):
        r.add_new_token(t)  # 40 tokens: no block boundary left to cross
    assert remaining(m, r) == 2 + 1


def test_no_extra_block_when_the_sequence_fits_the_window():
    m = kv(max_attention_window=50)
    assert remaining(m, req(1, 30, 10)) == 3 + 1  # 40 <= W


def test_reuse_credit_counts_allocated_blocks_and_estimates_all():
    r = req(1, 31, 9)  # ctx blocks 3, total ceil(40 / 10) = 4
    held = cached_manager(31, hold=True)
    assert remaining(held, r) == 1 and r.estimated_reusable_tokens == 30
    freed = cached_manager(31, hold=False)
    assert remaining(freed, r) == 4 and r.estimated_reusable_tokens == 30


def test_reuse_credit_uses_the_given_summary():
    m = cached_manager(31, hold=True)
    r = req(1, 31, 9)
    assert remaining(m, r, PrefixReuseSummary(2, 3, None)) == 1 + 1
    assert r.estimated_reusable_tokens == 30
    assert remaining(m, r, ZERO) == 4 and r.estimated_reusable_tokens == 0


def test_reuse_credit_is_capped_by_context_blocks():
    m = kv(enable_block_reuse=True)
    r = req(1, 31, 9)
    assert remaining(m, r, PrefixReuseSummary(7, 7, None)) == 1
    assert r.estimated_reusable_tokens == 30


def test_no_reuse_credit_when_off_not_first_chunk_or_allocated():
    r = req(1, 31, 9)
    assert remaining(kv(), r, PrefixReuseSummary(3, 3, None)) == 4  # reuse off
    m = cached_manager(31, hold=True)
    r.context_current_position = 10  # second chunk
    assert remaining(m, r) == 4 and r.estimated_reusable_tokens == 0
    r2 = req(2, 31, 9)
    m.add_sequence(r2)  # alloc > 0 (and it reused 3 blocks)
    r2.estimated_reusable_tokens = 5
    assert m.get_remaining_blocks_to_completion(r2) == 0
    assert r2.estimated_reusable_tokens == 0


def test_no_reuse_credit_for_generation_requests():
    m = cached_manager(31, hold=True)
    r = req(1, 31, 9)
    r.state = S.GENERATION_IN_PROGRESS
    assert remaining(m, r) == 4


def test_cross_remaining_blocks():
    m = kv(is_cross=True)
    r = req(1, 5, 8, encoder_tokens=list(range(25)))
    r.state = S.CONTEXT_INIT
    assert remaining(m, r) == 3
    r.context_current_position = 3
    assert remaining(m, r) == 0
    r.context_current_position = 0
    r.state = S.GENERATION_IN_PROGRESS
    assert remaining(m, r) == 0


# ---- needed blocks for one step ---------------------------------------------------------------
def one_step(m: KVCacheManager, r: LlmRequest, two: bool = False, summary=None) -> int:
    r.estimated_reusable_tokens = 99
    return m.get_needed_blocks_one_step(r, two, summary)


def test_one_step_first_chunk_shared_and_unshared():
    m = kv()
    assert one_step(m, req(1, 25)) == 3
    assert one_step(m, req(2, 25, beam_width=2)) == 2 + 2
    assert one_step(m, req(3, 20, beam_width=2)) == 2


def test_one_step_draft_tokens_window_and_sink():
    assert one_step(kv(), req(1, 18, draft_tokens=[1, 2, 3])) == 3  # 21 tokens
    assert one_step(kv(max_attention_window=10), req(2, 25, 5)) == 2  # min(25, 10 + 5)
    assert one_step(kv(sink_token_length=4), req(3, 25)) == 4  # 25 + 6


def test_one_step_gen_init_and_no_credit_for_it():
    m = cached_manager(31, hold=True)
    r = LlmRequest(1, list(range(31)), 8, llm_request_type=LlmRequestType.GENERATION_ONLY)
    assert r.state == S.DISAGG_GENERATION_INIT
    assert one_step(m, r) == 4 and r.estimated_reusable_tokens == 0


def test_one_step_reuse_credit_blocks_allocated_tokens_all():
    r = req(1, 31)
    held = cached_manager(31, hold=True)
    assert one_step(held, r) == 1 and r.estimated_reusable_tokens == 30
    freed = cached_manager(31, hold=False)
    assert one_step(freed, r) == 4 and r.estimated_reusable_tokens == 30
    assert one_step(held, r, summary=ZERO) == 4 and r.estimated_reusable_tokens == 0
    assert one_step(held, r, summary=PrefixReuseSummary(1, 2, None)) == 3
    assert r.estimated_reusable_tokens == 20


def test_one_step_generation_uses_the_managers_token_count():
    m = kv()
    r = req(1, 20, 30)
    m.add_sequence(r)
    r.state = S.GENERATION_IN_PROGRESS
    assert one_step(m, r) == 1  # 20 -> 21 crosses a boundary
    assert one_step(m, r, two=True) == 1
    m.add_token(1)  # the manager now holds 21 tokens, the request still 20
    assert one_step(m, r) == 0  # 21 -> 22
    assert r.estimated_reusable_tokens == 0
    r.draft_tokens = [7] * 9  # 10 tokens per step
    assert one_step(m, r) == 1  # 21 -> 31
    assert one_step(m, r, two=True) == 2  # 21 -> 41


def test_one_step_generation_is_capped_by_max_new_tokens():
    m = kv()
    r = req(1, 20, 5, draft_tokens=[7] * 9)
    m.add_sequence(r)
    m.add_token(1)
    r.state = S.GENERATION_IN_PROGRESS
    assert one_step(m, r, two=True) == 0  # 21 + min(20, 4) = 25


def test_one_step_generation_beam_width():
    m = kv()
    r = req(1, 20, 30, beam_width=3)
    m.add_sequence(r)
    r.state = S.GENERATION_TO_COMPLETE
    assert one_step(m, r) == 3


def test_one_step_generation_beyond_the_window_needs_nothing():
    m = kv(max_attention_window=20, sink_token_length=4)  # max tokens W + S = 26
    r = req(1, 20, 30)
    m.add_sequence(r)
    r.state = S.GENERATION_IN_PROGRESS
    assert one_step(m, r) == 1  # 21 <= 26
    for _ in range(6):
        m.add_token(1)
    assert one_step(m, r) == 0  # 27 > 26


def test_one_step_generation_without_a_sequence_uses_the_requests_tokens():
    r = req(1, 20, 30)
    r.state = S.DISAGG_GENERATION_TRANS_COMPLETE
    assert one_step(kv(), r) == 1


def test_one_step_other_states_need_nothing():
    m = kv()
    r = req(1, 25)
    r.context_current_position = 10  # not the first chunk
    assert one_step(m, r) == 0
    for state in (S.GENERATION_COMPLETE, S.DISAGG_GENERATION_TRANS_IN_PROGRESS, S.ENCODER_INIT):
        r.state = state
        assert one_step(m, r) == 0 and r.estimated_reusable_tokens == 0


def test_one_step_cross():
    m = kv(is_cross=True)
    r = req(1, 5, 8, encoder_tokens=list(range(25)))
    r.state = S.CONTEXT_INIT
    assert one_step(m, r) == 3
    r.state = S.GENERATION_IN_PROGRESS
    assert one_step(m, r) == 0

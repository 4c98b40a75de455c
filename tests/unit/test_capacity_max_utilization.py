"""MAX_UTILIZATION capacity scheduling: pause from the back, retry, caps, look-ahead, cross KV
(scheduling.md 2.5-2.8).

B = 4 tokens per block. A generating request whose KV sequence holds a multiple of B tokens needs
one block for its next step; a new context needs ceil(P / B) blocks (scheduling.md 2.6).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler.capacity import CapacityScheduler, CapacitySchedulerPolicy
from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.peft import PeftCacheManager
from pdserve.scheduler.request import LlmRequest, LlmRequestState, LlmRequestType

S = LlmRequestState
B = 4
MAXU = CapacitySchedulerPolicy.MAX_UTILIZATION


def ctx(rid: int, prompt_len: int, max_new: int = 8, **kw: object) -> LlmRequest:
    return LlmRequest(rid, [rid * 1000 + k for k in range(prompt_len)], max_new, **kw)


def generating(kv: KVCacheManager, rid: int, prompt_len: int, max_new: int = 8, *,
               steps: int = 0, cross: KVCacheManager | None = None, **kw: object) -> LlmRequest:
    req = ctx(rid, prompt_len, max_new, **kw)
    kv.add_sequence(req)
    if cross is not None:
        cross.add_sequence(req)
    req.context_current_position = req.prompt_len
    req.state = S.GENERATION_IN_PROGRESS
    req.add_new_token(1)
    for _ in range(steps):
        kv.add_token(rid)
        req.add_new_token(1)
    return req


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


def run(requests: list[LlmRequest], kv: KVCacheManager, *, cap: int = 64,
        peft: PeftCacheManager | None = None, cross: KVCacheManager | None = None,
        **kw: object) -> tuple[list[int], list[int], list[int]]:
    out = CapacityScheduler(cap, MAXU, **kw).schedule(requests, kv, peft, cross)
    return ids(out.fitting), ids(out.fitting_disagg_gen_init), ids(out.paused)


def test_max_utilization_pauses_from_the_back_and_never_twice_per_step() -> None:
    kv = KVCacheManager(7, B)
    g = [generating(kv, i, 8) for i in (1, 2, 3)]  # 2 blocks each, 1 more next step; 1 free
    # 2 fails -> the last started (3) is paused -> 2 is retried and fits.
    assert run(g, kv) == ([1, 2], [], [3])

    kv = KVCacheManager(8, B)
    g = [generating(kv, i, 8) for i in (1, 2, 3, 4)]  # nothing free
    # 1 fails -> pause 4 (2 free) -> 1, 2 fit -> 3 fails, is the last started -> pauses itself.
    assert run(g, kv) == ([1, 2], [], [4, 3])


def test_request_never_skips_itself_on_retry_after_pause() -> None:
    kv = KVCacheManager(3, B, enable_block_reuse=True)
    running = generating(kv, 1, 8)  # holds 2 blocks; 1 free
    new = ctx(2, 9)  # uncached first block: needs 3 blocks, registers itself once admitted
    assert kv.analyze_prefix_reuse(new.get_tokens(0), new).first_new_block is not None
    assert run([new, running], kv) == ([2], [], [1])


def test_failed_probe_leaves_no_trace() -> None:
    """Predict then commit: a failed attempt adds nothing, so the retry after a pause sees only
    what the pause freed (self pool, and the cross pool that failed)."""
    kv = KVCacheManager(5, B)
    cross = KVCacheManager(2, B, is_cross=True)
    running = generating(kv, 1, 8, cross=cross, encoder_tokens=[9] * 8)  # 2 self, 2 cross
    new = ctx(2, 12, encoder_tokens=[9] * 8)  # 3 self (fits in 3 free), 2 cross (0 free)
    new.state = S.CONTEXT_INIT
    assert run([new, running], kv, cross=cross) == ([2], [], [1])

    kv = KVCacheManager(3, B)
    running = generating(kv, 1, 8)
    exact = ctx(2, 12)  # needs 3 = 1 free + 2 freed by pausing ``running``
    assert run([exact, running], kv) == ([2], [], [1])


def test_max_num_requests_cap_triggers_pausing_of_started_requests() -> None:
    """capacitySchedulerTest.cpp SimpleSurpassMaxNumRequestsWithPriorities: a new high-priority
    request pushes the last running request out once the cap is reached."""
    kv = KVCacheManager(100, B)
    g1, g2 = generating(kv, 1, 9), generating(kv, 2, 9)  # need no block next step
    new = ctx(3, 4, priority=0.9)
    assert run([new, g1, g2], kv, cap=2) == ([3, 1], [], [2])
    g3, g4 = generating(kv, 4, 9), generating(kv, 5, 9)
    assert run([g1, g2, g3, g4], kv, cap=2) == ([1, 2], [], [5, 4])


def test_failing_request_may_pause_itself_when_last_started() -> None:
    kv = KVCacheManager(2, B)
    g = generating(kv, 1, 8)  # needs 1 block, none free
    new = ctx(2, 4)  # would fit in the 2 blocks the pause frees, but is never tried
    assert run([g, new], kv) == ([], [], [1])


def test_only_requests_at_or_after_i_can_be_paused() -> None:
    kv = KVCacheManager(6, B)
    early = generating(kv, 1, 9)  # started, scheduled first (needs 0 blocks)
    late = generating(kv, 2, 8)  # started, after the failing request
    big = ctx(3, 40)
    assert run([early, big, late], kv) == ([1], [], [2])


def test_gen_init_admitted_into_fitting_disagg_gen_init() -> None:
    kv = KVCacheManager(3, B)
    gi = LlmRequest(1, list(range(8)), 8, llm_request_type=LlmRequestType.GENERATION_ONLY)
    assert run([gi, ctx(2, 4), ctx(3, 4)], kv) == ([2], [1], [])


def test_transfer_in_progress_counts_against_cap_and_kv_but_is_never_returned() -> None:
    kv = KVCacheManager(100, B)
    t = LlmRequest(1, list(range(8)), 8, llm_request_type=LlmRequestType.GENERATION_ONLY,
                   lora_task_id=1)
    kv.add_sequence(t)  # reserved by the engine core when it was gen-init
    t.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    g1, g2 = generating(kv, 2, 9), generating(kv, 3, 9)
    assert run([t, g1, g2], kv, cap=2) == ([2], [], [3])  # t takes a slot, is never paused
    assert run([t, g1], kv, cap=1) == ([], [], [2])
    assert run([g1, t], kv, cap=1) == ([2], [], [])  # the cap is reached after g1: t stops
    # Never a pause victim: the failing request behind it pauses itself instead.
    small = KVCacheManager(5, B)
    t2 = LlmRequest(7, list(range(8)), 8, llm_request_type=LlmRequestType.GENERATION_ONLY)
    small.add_sequence(t2)
    t2.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    g = generating(small, 8, 8, steps=4)  # 12 tokens in 3 blocks, needs a 4th; none free
    assert run([g, t2], small) == ([], [], [8])
    # Its LoRA pages count: task 2 no longer fits; task 1 costs nothing more.
    peft = PeftCacheManager(6, 4)
    assert run([t, ctx(4, 4, lora_task_id=2)], kv, peft=peft) == ([], [], [])
    assert run([ctx(4, 4, lora_task_id=2)], kv, peft=peft) == ([4], [], [])
    assert run([t, ctx(5, 4, lora_task_id=1)], kv, peft=peft) == ([5], [], [])
    # Its blocks are held, so the budget is what is really free: 100 - 2 - 3 - 3.
    assert run([t, ctx(6, 4 * 92)], kv) == ([6], [], [])
    assert run([t, ctx(6, 4 * 93)], kv) == ([], [], [])


def test_prefix_aware_off_gives_no_reuse_credit() -> None:
    kv = KVCacheManager(5, B, enable_block_reuse=True)
    running = ctx(1, 9)
    kv.add_sequence(running)
    kv.store_context_blocks(running)  # 2 full blocks cached and held
    running.context_current_position = 9
    running.state = S.GENERATION_IN_PROGRESS
    running.add_new_token(1)
    same = LlmRequest(2, running.get_tokens(0)[:9], 8)  # 3 blocks, 1 with the 2 held credited
    assert kv.get_num_free_blocks() == 2
    assert run([running, same], kv) == ([1, 2], [], [])
    assert run([running, same], kv, enable_prefix_aware_scheduling=False) == ([1], [], [])


def test_two_steps_look_ahead() -> None:
    kv = KVCacheManager(2, B)
    g = generating(kv, 1, 7)  # 7 tokens: the 8th fits in block 2, the 9th needs block 3
    assert kv.get_needed_blocks_one_step(g, False) == 0
    assert kv.get_needed_blocks_one_step(g, True) == 1
    assert run([g], kv) == ([1], [], [])
    assert run([g], kv, two_steps_look_ahead=True) == ([], [], [1])


def test_lora_pages_once_per_task_and_head_of_line_break() -> None:
    kv = KVCacheManager(100, B)
    peft = PeftCacheManager(6, 4)
    reqs = [ctx(1, 4, lora_task_id=1), ctx(2, 4, lora_task_id=1), ctx(3, 4, lora_task_id=2),
            ctx(4, 4)]
    assert run(reqs, kv, peft=peft) == ([1, 2], [], [])  # 3 fails (8 > 6): nothing after it


def test_any_misfit_including_pages_triggers_the_pause_search() -> None:
    kv = KVCacheManager(100, B)
    peft = PeftCacheManager(6, 4)
    first = generating(kv, 1, 9, lora_task_id=1)
    lora = ctx(2, 4, lora_task_id=2)
    last = generating(kv, 3, 9)
    assert run([first, lora, last], kv, peft=peft) == ([1], [], [3])


def test_encoder_band_needs_a_cross_manager_and_encoder_init_uses_no_kv() -> None:
    kv = KVCacheManager(0, B)
    enc = ctx(1, 4, encoder_tokens=[3] * 16)
    with pytest.raises(ValueError):
        run([enc], kv, no_schedule_until_state=S.ENCODER_INIT)
    cross = KVCacheManager(0, B, is_cross=True)
    waiting = ctx(2, 4)
    waiting.state = S.DISAGG_CONTEXT_WAIT_SCHEDULER
    assert run([enc, waiting], kv, cross=cross, no_schedule_until_state=S.ENCODER_INIT) == (
        [1], [], [])


def test_scheduling_never_allocates_and_restarts_each_pass() -> None:
    kv = KVCacheManager(8, B)
    g = [generating(kv, i, 8) for i in (1, 2, 3, 4)]
    free = kv.get_num_free_blocks()
    first = run(g, kv)
    assert run(g, kv) == first  # the simulated pauses of the first pass are forgotten
    assert kv.get_num_free_blocks() == free
    kv.check_invariants()


def _is_started(req: LlmRequest) -> bool:
    return req.is_generation_in_progress_state or (
        req.is_context_init_state and not req.is_first_context_chunk)


@settings(max_examples=80, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.sampled_from(["gen", "new", "chunked", "done"]), st.integers(1, 14),
                  st.integers(0, 5)),
        min_size=1, max_size=9),
    spare=st.integers(0, 6),
    cap=st.integers(1, 9),
)
def test_max_utilization_invariants(spec: list, spare: int, cap: int) -> None:
    kv = KVCacheManager(400, B)
    reqs = []
    for rid, (kind, p, steps) in enumerate(spec):
        if kind == "gen":
            req = generating(kv, rid, p, 8, steps=steps)
        elif kind == "chunked":
            req = ctx(rid, p + 1)
            kv.add_sequence(req)
            req.context_current_position = 1
        else:
            req = ctx(rid, p)
            if kind == "done":
                req.state = S.GENERATION_COMPLETE
        reqs.append(req)
    hold = kv.get_num_free_blocks() - spare
    kv.add_sequence(ctx(999, hold * B))
    need = {r.request_id: kv.get_needed_blocks_one_step(r, False) for r in reqs}
    held = {r.request_id: kv.get_num_allocated_blocks(r.request_id) for r in reqs}

    fitting, gen_init, paused = run(reqs, kv, cap=cap)
    pos = {r.request_id: i for i, r in enumerate(reqs)}
    by_id = {r.request_id: r for r in reqs}
    assert gen_init == []
    assert len(set(paused)) == len(paused) and not set(paused) & set(fitting)
    assert all(_is_started(by_id[rid]) for rid in paused)
    assert [pos[r] for r in paused] == sorted((pos[r] for r in paused), reverse=True)
    if fitting and paused:
        assert max(pos[r] for r in fitting) < min(pos[r] for r in paused)
    assert [pos[r] for r in fitting] == sorted(pos[r] for r in fitting)
    assert len(fitting) <= cap
    assert sum(need[r] for r in fitting) <= spare + sum(held[r] for r in paused)
    assert all(by_id[r].state != S.GENERATION_COMPLETE for r in fitting)
    # A pause only happens when someone failed: with room for everyone, nobody is paused.
    in_band = [r for r in reqs if r.state != S.GENERATION_COMPLETE]
    if len(in_band) <= cap and sum(need[r.request_id] for r in in_band) <= spare:
        assert paused == [] and fitting == ids(in_band)

"""MicroBatchScheduler: scheduling.md 3 (reuse-adjusted cost model)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler.micro_batch import (
    ContextChunkingConfig,
    ContextChunkingPolicy,
    MicroBatchScheduler,
    reuse_adjusted_compute,
)
from pdserve.scheduler.request import LlmRequest, LlmRequestState

S = LlmRequestState
P = ContextChunkingPolicy
FCFS = P.FIRST_COME_FIRST_SERVED
EQUAL = P.EQUAL_PROGRESS
FORCE = P.FORCE_CHUNK


def ctx(
    rid: int,
    prompt_len: int,
    *,
    position: int = 0,
    reusable: int = 0,
    drafts: int = 0,
    lora: int | None = None,
    snapshots: list[int] | None = None,
    state: S = S.CONTEXT_INIT,
) -> LlmRequest:
    req = LlmRequest(
        rid,
        list(range(prompt_len)),
        8,
        lora_task_id=lora,
        draft_tokens=[7] * drafts if drafts else None,
        expected_snapshot_points=snapshots,
    )
    req.state = state
    req.context_current_position = position
    req.estimated_reusable_tokens = reusable
    return req


def gen(
    rid: int,
    *,
    beam: int = 1,
    drafts: int = 0,
    lora: int | None = None,
    state: S = S.GENERATION_IN_PROGRESS,
) -> LlmRequest:
    req = LlmRequest(
        rid, [1, 2, 3, 4], 8, beam_width=beam, lora_task_id=lora,
        draft_tokens=[7] * drafts if drafts else None,
    )
    req.state = state
    req.context_current_position = 4
    return req


def enc(rid: int, encoder_len: int, lora: int | None = None) -> LlmRequest:
    return LlmRequest(rid, [1, 2], 4, encoder_tokens=list(range(encoder_len)), lora_task_id=lora)


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


def chunked(policy: P, unit: int, max_context_length: int | None = None) -> MicroBatchScheduler:
    return MicroBatchScheduler(ContextChunkingConfig(policy, unit), max_context_length)


# ---- cost model -------------------------------------------------------------------------------
def test_reuse_adjusted_compute_charges_full_non_last_chunks():
    assert reuse_adjusted_compute(40, 0, 100) == 40  # no reuse
    assert reuse_adjusted_compute(40, 32, 100) == 40  # non-last: window shifted, not shrunk
    assert reuse_adjusted_compute(68, 32, 100) == 68  # 32 + 68 == 100 is the last chunk ...
    assert reuse_adjusted_compute(80, 32, 100) == 68  # ... and so is anything reaching the end
    assert reuse_adjusted_compute(10, 100, 100) == 0  # fully cached


def test_no_chunking_context_costs_prompt_minus_reuse_plus_drafts():
    sched = MicroBatchScheduler()
    a = ctx(1, 100, reusable=32, drafts=3)  # cost 68 + 3 = 71
    b = ctx(2, 10)
    context, _ = sched.schedule([a, b], set(), 8, 81)
    assert ids(context) == [1, 2]
    context, _ = sched.schedule([ctx(1, 100, reusable=32, drafts=3), ctx(2, 10)], set(), 8, 80)
    assert ids(context) == [1]


def test_fully_cached_context_still_costs_one_token():
    sched = MicroBatchScheduler()
    requests = [ctx(i, 10, reusable=10) for i in range(3)]
    context, _ = sched.schedule(requests, set(), 8, 2)
    assert ids(context) == [0, 1]  # each costs max(1, 0) = 1


def test_reuse_credit_only_on_first_chunk():
    sched = chunked(FCFS, 16)
    first = ctx(1, 100, reusable=32)
    context, _ = sched.schedule([first], set(), 8, 68)
    assert ids(context) == [1] and first.context_chunk_size == 100  # costs 100 - 32
    # Position 32 != prepopulated length 0: not a first chunk, so the 68 left cost 68.
    later = ctx(2, 100, position=32, reusable=32)
    context, _ = sched.schedule([later], set(), 8, 67)
    assert ids(context) == [2] and later.context_chunk_size == 64


def test_context_cost_above_max_context_length_without_chunking_raises():
    sched = MicroBatchScheduler(None, 50)
    with pytest.raises(ValueError, match="maximum context length"):
        sched.schedule([ctx(1, 60)], set(), 8, None)
    context, _ = sched.schedule([ctx(2, 60, reusable=20)], set(), 8, None)  # cost 40
    assert ids(context) == [2]


def test_encoder_requests_lead_the_context_list():
    sched = MicroBatchScheduler(no_schedule_until_state=S.ENCODER_INIT)
    gen_init = LlmRequest(9, [1, 2], 4, llm_request_type=2)  # DISAGG_GENERATION_INIT: never batched
    assert gen_init.state == S.DISAGG_GENERATION_INIT
    context, generation = sched.schedule(
        [ctx(1, 10), gen_init, enc(2, 5, lora=4), gen(3), enc(4, 5)], set(), 8, 100
    )
    assert ids(context) == [4, 2, 1] and ids(generation) == [3]


def test_encoder_breaks_on_token_overflow_and_rejects_long_input():
    sched = MicroBatchScheduler(None, 20, no_schedule_until_state=S.ENCODER_INIT)
    context, _ = sched.schedule([enc(1, 5), enc(2, 6), enc(3, 1)], set(), 8, 10)
    assert ids(context) == [1]
    with pytest.raises(ValueError, match="encoder tokens"):
        sched.schedule([enc(4, 21)], set(), 8, None)


def test_context_without_chunking_breaks_on_token_overflow():
    sched = MicroBatchScheduler()
    context, generation = sched.schedule(
        [ctx(1, 50), ctx(2, 60), ctx(3, 5), gen(4)], set(), 8, 100
    )
    assert ids(context) == [1] and generation == []  # break, not continue


def test_chunked_contexts_never_break():
    sched = chunked(FCFS, 16)
    a, b = ctx(1, 100), ctx(2, 100)
    context, generation = sched.schedule([a, b, gen(3)], set(), 8, 50)
    assert ids(generation) == [3]  # considered after two over-budget contexts
    assert ids(context) == [1] and a.context_chunk_size == 48 and b.context_chunk_size == 0


def test_generation_breaks_on_token_overflow():
    sched = MicroBatchScheduler()
    requests = [gen(1, drafts=1), gen(2, drafts=1), gen(3, drafts=1), gen(4)]
    _, generation = sched.schedule(requests, set(), 8, 5)
    assert ids(generation) == [1, 2]  # gen 4 would fit, but the loop stopped


def test_beam_width_mismatch_is_skipped_not_counted():
    sched = MicroBatchScheduler()
    requests = [gen(1, beam=2), gen(2, beam=1), gen(3, beam=2), gen(4, beam=2)]
    _, generation = sched.schedule(requests, set(), 2, None)
    assert ids(generation) == [1, 3]


def test_token_check_precedes_beam_check():
    sched = MicroBatchScheduler()
    _, generation = sched.schedule([gen(1), gen(2, beam=4), gen(3)], set(), 8, 4)
    assert ids(generation) == [1]  # gen 2 overflows (1 + 4 > 4) and breaks before its beam check


def test_batch_size_break_counts_pushed_chunk_contexts():
    sched = chunked(FCFS, 16)
    a, b = ctx(1, 100), ctx(2, 100)
    context, generation = sched.schedule([a, b, gen(3)], set(), 2, 60)
    assert ids(context) == [1] and b.context_chunk_size == 0  # b counted though it got chunk 0
    assert generation == []


def test_batch_size_break_without_chunking():
    sched = MicroBatchScheduler()
    context, generation = sched.schedule([ctx(1, 5), gen(2), gen(3)], set(), 2, None)
    assert ids(context) == [1] and ids(generation) == [2]


def test_generation_to_complete_is_never_scheduled():
    sched = MicroBatchScheduler()
    done_next = gen(1, state=S.GENERATION_TO_COMPLETE)
    _, generation = sched.schedule([done_next, gen(2)], set(), 1, None)
    assert ids(generation) == [2]  # and it did not take the only slot


def test_inflight_requests_are_skipped():
    sched = MicroBatchScheduler()
    context, generation = sched.schedule([gen(1), gen(2), ctx(3, 10)], {1, 3}, 1, None)
    assert context == [] and ids(generation) == [2]


def test_only_the_schedulable_band_is_considered():
    sched = MicroBatchScheduler()
    requests = [
        ctx(1, 10, state=S.DISAGG_CONTEXT_INIT_AND_TRANS),
        gen(2, state=S.DISAGG_GENERATION_TRANS_COMPLETE),
        gen(3, state=S.GENERATION_COMPLETE),
        gen(4, state=S.DISAGG_GENERATION_INIT),
        gen(5, state=S.DISAGG_GENERATION_TRANS_IN_PROGRESS),
        ctx(6, 10, state=S.DISAGG_CONTEXT_TRANS_IN_PROGRESS),
        enc(7, 3),  # ENCODER_INIT lies below the default band
    ]
    context, generation = sched.schedule(requests, set(), 8, None)
    assert ids(context) == [1] and ids(generation) == [2]


# ---- after the pass ---------------------------------------------------------------------------
def test_all_fit_keeps_whole_contexts_and_their_drafts():
    sched = chunked(EQUAL, 16)
    a, b = ctx(1, 100, drafts=3), ctx(2, 30)
    context, _ = sched.schedule([a, b], set(), 8, 133)
    assert ids(context) == [1, 2]
    assert (a.context_chunk_size, b.context_chunk_size, a.num_draft_tokens) == (100, 30, 3)


def test_max_context_length_forces_chunking_without_a_token_limit():
    sched = chunked(FCFS, 16, max_context_length=50)
    a = ctx(1, 100)
    context, _ = sched.schedule([a], set(), 8, None)
    assert ids(context) == [1] and a.context_chunk_size == 48


def test_force_chunk_chunks_even_when_everything_fits():
    sched = chunked(FORCE, 32)
    a = ctx(1, 100)
    context, _ = sched.schedule([a], set(), 8, None)
    assert ids(context) == [1] and a.context_chunk_size == 32 and not a.is_last_context_chunk


# ---- EQUAL_PROGRESS -------------------------------------------------------------------------------
def test_equal_progress_earlier_requests_get_the_extra_unit():
    sched = chunked(EQUAL, 16)
    requests = [ctx(1, 100), ctx(2, 100), ctx(3, 100)]
    context, _ = sched.schedule(requests, set(), 8, 80)
    assert [r.context_chunk_size for r in requests] == [32, 32, 16]
    assert ids(context) == [1, 2, 3]


def test_equal_progress_keeps_going_when_chunk_fully_reusable():
    # Request 1 has 90 of 100 tokens cached: its first unit costs 10, every later unit 0. Ending the
    # loop on the compute increment would stop it at 40.
    sched = chunked(EQUAL, 40)
    a, b = ctx(1, 100, reusable=90), ctx(2, 100)
    context, _ = sched.schedule([a, b], set(), 8, 30)
    assert a.context_chunk_size == 100 and b.context_chunk_size == 0
    assert ids(context) == [1]


def test_equal_progress_stops_when_budget_is_spent():
    a = ctx(1, 100, reusable=90)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a], EQUAL, 10, 40, None)
    assert a.context_chunk_size == 40  # used == capacity after the first round


def test_equal_progress_compares_max_context_length_to_the_raw_chunk():
    a = ctx(1, 100, reusable=90)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a], EQUAL, None, 40, 50)
    assert a.context_chunk_size == 40  # 80 > 50 although it would cost only 10


# ---- FIRST_COME_FIRST_SERVED ------------------------------------------------------------------------
def test_fcfs_trims_to_unit_multiple():
    requests = [ctx(1, 37), ctx(2, 100), ctx(3, 100)]
    MicroBatchScheduler.set_ctx_requests_chunk_size(requests, FCFS, 100, 16, None)
    # 37 is untrimmed (a whole last chunk); 63 left -> 48; 15 left -> 0.
    assert [r.context_chunk_size for r in requests] == [37, 48, 0]


def test_fcfs_credits_reuse_only_when_the_chunk_reaches_the_end():
    requests = [ctx(1, 100, reusable=64), ctx(2, 100)]
    MicroBatchScheduler.set_ctx_requests_chunk_size(requests, FCFS, 40, 16, None)
    assert [r.context_chunk_size for r in requests] == [100, 0]  # costs 36, leaves 4
    trimmed = ctx(3, 100, reusable=64)
    MicroBatchScheduler.set_ctx_requests_chunk_size([trimmed], FCFS, 20, 16, None)
    assert trimmed.context_chunk_size == 16  # a non-last chunk costs its full size


def test_fcfs_max_context_length_caps_the_chunk():
    a = ctx(1, 100)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a], FCFS, None, 16, 50)
    assert a.context_chunk_size == 48
    cached = ctx(2, 100, reusable=64)
    MicroBatchScheduler.set_ctx_requests_chunk_size([cached], FCFS, None, 16, 40)
    assert cached.context_chunk_size == 100  # computes only 36 <= 40


# ---- FORCE_CHUNK --------------------------------------------------------------------------------
def test_force_chunk_gives_chunk_zero_but_a_later_smaller_request_fits():
    requests = [ctx(1, 100), ctx(2, 40), ctx(3, 10)]
    MicroBatchScheduler.set_ctx_requests_chunk_size(requests, FORCE, 50, 32, None)
    assert [r.context_chunk_size for r in requests] == [32, 0, 10]


def test_force_chunk_targets_the_next_snapshot_point():
    points = [64, 200]
    a = ctx(1, 300, snapshots=points)
    b = ctx(2, 300, position=64, snapshots=points)
    c = ctx(3, 300, position=200, snapshots=points)
    d = ctx(4, 100, snapshots=[150])
    MicroBatchScheduler.set_ctx_requests_chunk_size([a, b, c, d], FORCE, None, 32, None)
    assert [r.context_chunk_size for r in (a, b, c, d)] == [64, 136, 100, 100]


def test_force_chunk_snapshot_chunk_capped_and_trimmed_to_units():
    b = ctx(2, 300, position=64, snapshots=[64, 200])
    MicroBatchScheduler.set_ctx_requests_chunk_size([b], FORCE, None, 32, 100)
    assert b.context_chunk_size == 96  # 136 capped to floor(100 / 32) * 32
    a, e = ctx(1, 300, snapshots=[64, 200]), ctx(5, 300)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a, e], FORCE, 50, 32, None)
    assert [a.context_chunk_size, e.context_chunk_size] == [32, 0]  # floor(50 / 32) * 32; 18 left


def test_force_chunk_never_credits_reuse():
    a, b = ctx(1, 64, reusable=60), ctx(2, 64)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a, b], FORCE, 64, 32, None)
    assert [a.context_chunk_size, b.context_chunk_size] == [32, 32]
    s = ctx(3, 64, reusable=60, snapshots=[64])
    MicroBatchScheduler.set_ctx_requests_chunk_size([s], FORCE, 40, 32, None)
    assert s.context_chunk_size == 32  # a credit would have let all 64 (cost 4) through


def test_force_chunk_unit_above_max_context_length_raises():
    with pytest.raises(ValueError, match="max context length"):
        MicroBatchScheduler.set_ctx_requests_chunk_size([ctx(1, 100)], FORCE, None, 64, 32)


# ---- draft tokens -------------------------------------------------------------------------------
def test_draft_tokens_needing_a_new_block_are_discarded():
    sched = chunked(FCFS, 32)
    a, b = ctx(1, 64, drafts=3), ctx(2, 100)
    context, _ = sched.schedule([a, b], set(), 8, 100)
    assert a.context_chunk_size == 64 and a.is_last_context_chunk
    assert a.num_draft_tokens == 0  # 64 is a unit multiple: no room left in its last unit
    assert b.context_chunk_size == 32 and ids(context) == [2, 1]


def test_draft_tokens_fit_in_the_open_unit():
    sched = chunked(FCFS, 32)
    a, b = ctx(1, 60, drafts=3), ctx(2, 100)
    sched.schedule([a, b], set(), 8, 100)
    assert (a.context_chunk_size, a.num_draft_tokens) == (60, 3)  # 4 slots left in the unit


def test_draft_tokens_limited_by_capacity_and_max_context_length():
    sched = chunked(FCFS, 32)
    a, b = ctx(1, 60, drafts=3), ctx(2, 100)
    sched.schedule([a, b], set(), 8, 94)  # chunks 60 + 32 use 92: room for 2 drafts
    assert a.num_draft_tokens == 2
    c = ctx(3, 60, drafts=3)
    MicroBatchScheduler.set_ctx_requests_chunk_size([c], FCFS, None, 32, 61)
    assert c.num_draft_tokens == 1


def test_drafts_of_a_non_last_chunk_are_untouched():
    a = ctx(1, 100, drafts=3)
    MicroBatchScheduler.set_ctx_requests_chunk_size([a], FCFS, 50, 32, None)
    assert a.context_chunk_size == 32 and a.num_draft_tokens == 3


# ---- final order --------------------------------------------------------------------------------
def test_final_sort_with_chunks_puts_last_chunks_at_the_end():
    sched = chunked(FORCE, 16)
    requests = [
        ctx(1, 10, lora=2),  # last chunk
        ctx(2, 100, lora=2),
        ctx(3, 8),  # last chunk
        ctx(4, 100),
        ctx(5, 12, lora=1),  # last chunk
        ctx(6, 50, lora=1),
        ctx(7, 100, lora=1),
    ]
    context, generation = sched.schedule(
        requests + [gen(8, lora=3), gen(9), gen(10, lora=1), gen(11)], set(), 16, None
    )
    assert ids(context) == [4, 6, 7, 2, 3, 5, 1]
    assert ids(generation) == [9, 11, 10, 8]


def test_final_sort_without_chunks_is_by_lora_id_and_stable():
    sched = MicroBatchScheduler()
    requests = [ctx(1, 5, lora=3), ctx(2, 5), ctx(3, 5, lora=1), ctx(4, 5, lora=3), ctx(5, 5)]
    context, _ = sched.schedule(requests, set(), 8, None)
    assert ids(context) == [2, 5, 3, 1, 4]


# ---- config -----------------------------------------------------------------------------------
def test_chunking_config_validates_and_parses_names():
    assert ContextChunkingConfig("equal_progress", 16).policy is EQUAL
    with pytest.raises(ValueError):
        ContextChunkingConfig(FCFS, 0)
    with pytest.raises(ValueError, match="unknown context chunking policy"):
        ContextChunkingPolicy.parse("NO_CHUNKING")


# ---- properties ---------------------------------------------------------------------------------
_OTHER_STATES = [
    S.GENERATION_TO_COMPLETE,
    S.GENERATION_COMPLETE,
    S.DISAGG_GENERATION_INIT,
    S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
    S.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
]

_request_spec = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["ctx", "ctx", "ctx", "gen", "gen", "other"]),
        "prompt_len": st.integers(1, 300),
        "position_frac": st.floats(0, 0.99),
        "reusable": st.integers(0, 300),
        "drafts": st.integers(0, 4),
        "beam": st.integers(1, 2),
        "lora": st.one_of(st.none(), st.integers(0, 2)),
        "snapshots": st.one_of(st.none(), st.lists(st.integers(1, 300), max_size=3)),
        "other_state": st.sampled_from(_OTHER_STATES),
        "inflight": st.booleans(),
        "alt_state": st.booleans(),
    }
)


def _build(rid: int, spec: dict) -> LlmRequest:
    if spec["kind"] == "ctx":
        state = S.DISAGG_CONTEXT_INIT_AND_TRANS if spec["alt_state"] else S.CONTEXT_INIT
        return ctx(
            rid,
            spec["prompt_len"],
            position=int(spec["position_frac"] * spec["prompt_len"]),
            reusable=spec["reusable"],
            drafts=spec["drafts"],
            lora=spec["lora"],
            snapshots=spec["snapshots"],
            state=state,
        )
    state = S.DISAGG_GENERATION_TRANS_COMPLETE if spec["alt_state"] else S.GENERATION_IN_PROGRESS
    if spec["kind"] == "other":
        state = spec["other_state"]
    return gen(rid, beam=spec["beam"], drafts=spec["drafts"], lora=spec["lora"], state=state)


def _cost(req: LlmRequest, chunking: bool) -> int:
    if req.is_generation_in_progress_state:
        return req.beam_width + req.num_draft_tokens
    remaining = req.context_remaining_length
    reusable = req.estimated_reusable_tokens if req.is_first_context_chunk else 0
    if not chunking:
        num_tokens = req.get_num_tokens(0)
        return max(1, reuse_adjusted_compute(num_tokens, reusable, remaining) + req.num_draft_tokens)
    drafts = req.num_draft_tokens if req.is_last_context_chunk else 0
    return reuse_adjusted_compute(req.context_chunk_size, reusable, remaining) + drafts


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(_request_spec, max_size=24),
    policy=st.one_of(st.none(), st.sampled_from(list(P))),
    unit=st.sampled_from([1, 8, 16, 64]),
    max_batch_size=st.integers(1, 16),
    max_num_tokens=st.one_of(st.none(), st.integers(1, 600)),
    max_context_length=st.one_of(st.none(), st.integers(64, 600)),
)
def test_micro_batch_invariants(specs, policy, unit, max_batch_size, max_num_tokens, max_context_length):
    requests = [_build(i, spec) for i, spec in enumerate(specs)]
    inflight = {i for i, spec in enumerate(specs) if spec["inflight"]}
    if policy is None:
        sched = MicroBatchScheduler()
    else:
        sched = MicroBatchScheduler(ContextChunkingConfig(policy, unit), max_context_length)
    remaining_before = {r.request_id: r.context_remaining_length for r in requests}

    context, generation = sched.schedule(requests, inflight, max_batch_size, max_num_tokens)

    scheduled = ids(context) + ids(generation)
    assert len(scheduled) == len(set(scheduled))
    assert len(scheduled) <= max_batch_size
    assert not inflight & set(scheduled)
    assert all(r.is_context_init_state for r in context)
    assert all(
        r.is_generation_in_progress_state and r.state != S.GENERATION_TO_COMPLETE
        for r in generation
    )
    assert len({r.beam_width for r in generation}) <= 1
    if policy is not None:
        for r in context:
            assert 0 < r.context_chunk_size <= remaining_before[r.request_id]
            if max_context_length is not None:
                # The limit bounds compute; an all-fit whole remainder may exceed it in raw tokens.
                reusable = r.estimated_reusable_tokens if r.is_first_context_chunk else 0
                compute = reuse_adjusted_compute(
                    r.context_chunk_size, reusable, r.context_remaining_length
                )
                assert compute <= max_context_length
    if max_num_tokens is not None:
        total = sum(_cost(r, policy is not None) for r in context + generation)
        assert total <= max_num_tokens

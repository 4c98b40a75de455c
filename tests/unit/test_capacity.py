"""Capacity scheduler: MaxRequests, GUARANTEED_NO_EVICT, STATIC_BATCH, LoRA pages, cross KV,
prefix-aware skipping and the reorder hook (scheduling.md 2).

KV state is built with the real KVCacheManager the way the engine core builds it (add_sequence,
add_token, store_context_blocks) and request states are set directly. B = 4 tokens per block;
GNE needs of a new request are ceil((P + N) / B) blocks, of a running one
ceil((P + N) / B) - allocated (scheduling.md 2.4).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler.capacity import CapacityScheduler, CapacitySchedulerPolicy
from pdserve.scheduler.capacity import CapacityOutput
from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.peft import PeftCacheManager
from pdserve.scheduler.request import LlmRequest, LlmRequestState, LlmRequestType

S = LlmRequestState
P = CapacitySchedulerPolicy
B = 4
GNE, STATIC, MAXU = P.GUARANTEED_NO_EVICT, P.STATIC_BATCH, P.MAX_UTILIZATION


def ctx(rid: int, prompt_len: int, max_new: int = 8, *, tokens: list[int] | None = None,
        **kw: object) -> LlmRequest:
    """A new context request; distinct prompts unless ``tokens`` is given."""
    toks = tokens if tokens is not None else [rid * 1000 + k for k in range(prompt_len)]
    return LlmRequest(rid, toks, max_new, **kw)


def generating(kv: KVCacheManager, rid: int, prompt_len: int, max_new: int = 8, *,
               steps: int = 0, **kw: object) -> LlmRequest:
    """A request whose context ran: prompt blocks allocated (and stored with reuse on), first
    token sampled, ``steps`` decode steps taken (one KV token each)."""
    req = ctx(rid, prompt_len, max_new, **kw)
    kv.add_sequence(req)
    req.context_current_position = req.prompt_len
    kv.store_context_blocks(req)
    req.state = S.GENERATION_IN_PROGRESS
    req.add_new_token(1)
    for _ in range(steps):
        kv.add_token(rid)
        req.add_new_token(1)
    return req


def gen_only(rid: int, prompt_len: int, max_new: int = 8, **kw: object) -> LlmRequest:
    """A generation-only request as it arrives on a generation worker (DISAGG_GENERATION_INIT)."""
    return ctx(rid, prompt_len, max_new, llm_request_type=LlmRequestType.GENERATION_ONLY, **kw)


def transferring(kv: KVCacheManager, rid: int, prompt_len: int, max_new: int = 8,
                 **kw: object) -> LlmRequest:
    """A gen-init request after the engine core reserved its blocks and posted the receive."""
    req = gen_only(rid, prompt_len, max_new, **kw)
    kv.add_sequence(req)
    req.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    return req


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


def run(policy: P, requests: list[LlmRequest], kv: KVCacheManager | None, *, cap: int = 64,
        peft: PeftCacheManager | None = None, cross: KVCacheManager | None = None,
        **kw: object) -> tuple[list[int], list[int], list[int]]:
    out = CapacityScheduler(cap, policy, **kw).schedule(requests, kv, peft, cross)
    assert isinstance(out, CapacityOutput)
    return ids(out.fitting), ids(out.fitting_disagg_gen_init), ids(out.paused)


# ---- construction -----------------------------------------------------------------------------
def test_policy_enum_values_and_name_strings() -> None:
    assert [int(p) for p in (MAXU, GNE, STATIC)] == [0, 1, 2]
    assert CapacityScheduler(4, "guaranteed_no_evict").policy is GNE
    with pytest.raises(ValueError):
        CapacityScheduler(4, GNE).schedule([ctx(1, 4)])  # a KV policy without a KV manager


# ---- MaxRequests (2.1) ------------------------------------------------------------------------
def test_max_requests_takes_in_band_requests_up_to_the_cap_and_ignores_policy() -> None:
    done = ctx(1, 4)
    done.state = S.GENERATION_COMPLETE
    sending = ctx(2, 4)
    sending.state = S.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    g = ctx(3, 4)
    g.state = S.GENERATION_IN_PROGRESS
    reqs = [done, sending, g, ctx(4, 4), ctx(5, 4)]
    for policy in P:
        assert run(policy, reqs, None, cap=2, has_kv_cache_manager=False) == ([3, 4], [], [])


def test_max_requests_ignores_gen_init_and_transfer_in_progress() -> None:
    kv = KVCacheManager(0, B)  # not even looked at
    t = gen_only(2, 4)
    t.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
    reqs = [gen_only(1, 4), t, ctx(3, 4), ctx(4, 4), ctx(5, 4)]
    assert run(GNE, reqs, kv, cap=2, has_kv_cache_manager=False) == ([3, 4], [], [])


def test_max_requests_admits_encoder_init_in_an_encoder_band() -> None:
    enc = ctx(1, 4, encoder_tokens=[7, 8])
    assert enc.state == S.ENCODER_INIT
    reqs = [enc, gen_only(2, 4), ctx(3, 4), ctx(4, 4)]
    assert run(GNE, reqs, None, cap=2, has_kv_cache_manager=False,
               no_schedule_until_state=S.ENCODER_INIT) == ([1, 3], [], [])
    assert run(GNE, reqs, None, cap=2, has_kv_cache_manager=False) == ([3, 4], [], [])


# ---- GUARANTEED_NO_EVICT (2.2) ----------------------------------------------------------------
def test_gne_admits_running_generation_unconditionally_and_overdraws() -> None:
    kv = KVCacheManager(10, B)
    g1 = generating(kv, 1, 8, 40)  # remaining ceil(48/4) - 2 = 10 each; 6 blocks free
    g2 = generating(kv, 2, 8, 40)
    assert run(GNE, [g1, ctx(3, 4, 4), g2], kv) == ([1, 2], [], [])


def test_gne_reserves_to_completion_and_breaks_at_first_block_misfit() -> None:
    kv = KVCacheManager(10, B)
    c1, c2, c3 = ctx(1, 8, 8), ctx(2, 8, 20), ctx(3, 4, 4)  # needs 4, 7, 2 of 10
    assert run(GNE, [c1, c2, c3], kv) == ([1], [], [])
    assert run(GNE, [c1, c3], kv) == ([1, 3], [], [])  # c3 alone fits: the break stopped it


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(0, 40),
    gens=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 20), st.integers(0, 6)), max_size=5),
    ctxs=st.lists(st.tuples(st.integers(1, 16), st.integers(1, 20)), max_size=6),
    cap=st.integers(1, 8),
    static=st.booleans(),
)
def test_guaranteed_no_evict_never_pauses(num_blocks: int, gens: list, ctxs: list, cap: int,
                                          static: bool) -> None:
    kv = KVCacheManager(200, B)
    running = [generating(kv, i, p, n + s, steps=s) for i, (p, n, s) in enumerate(gens)]
    # Shrink the pool to ``num_blocks`` free blocks by holding the rest in an unscheduled request.
    hold = kv.get_num_free_blocks() - num_blocks
    if hold > 0:
        filler = ctx(999, hold * B)
        kv.add_sequence(filler)
    news = [ctx(100 + i, p, n) for i, (p, n) in enumerate(ctxs)]
    free_before = kv.get_num_free_blocks()
    reqs = running + news
    gen_needs = sum(kv.get_remaining_blocks_to_completion(r) for r in running[:cap])
    fitting, gen_init, paused = run(STATIC if static else GNE, reqs, kv, cap=cap)
    assert paused == [] and gen_init == []
    # Every running request up to the cap stays; new ones only within the remaining budget.
    assert fitting[: min(cap, len(running))] == ids(running)[:cap]
    admitted_new = [r for r in news if r.request_id in fitting]
    assert sum(kv.get_remaining_blocks_to_completion(r) for r in admitted_new) <= max(
        0, free_before - gen_needs
    )
    assert len(fitting) <= cap
    if static and running:
        assert not admitted_new
    assert kv.get_num_free_blocks() == free_before  # scheduling never allocates


def test_gne_cap_counts_admitted_including_transfer_in_progress() -> None:
    kv = KVCacheManager(100, B)
    t = transferring(kv, 1, 8)
    g = generating(kv, 2, 8)
    assert run(GNE, [t, g, ctx(3, 4), ctx(4, 4)], kv, cap=3) == ([2, 3], [], [])
    assert run(GNE, [t, g, ctx(3, 4)], kv, cap=2) == ([2], [], [])


def test_gne_transfer_in_progress_reserves_remaining_blocks_but_is_never_returned() -> None:
    kv = KVCacheManager(12, B)
    t = transferring(kv, 1, 8, 16)  # holds 2; remaining ceil(24/4) - 2 = 4; 10 free
    c = ctx(2, 8, 20)  # needs 7
    assert run(GNE, [t, c], kv) == ([], [], [])  # 10 - 4 = 6 < 7
    assert run(GNE, [c], kv) == ([2], [], [])  # without t counted, c fits in 10


def test_gen_init_is_admitted_into_fitting_disagg_gen_init_before_contexts() -> None:
    kv = KVCacheManager(10, B)
    c = ctx(1, 8, 12)  # needs 5
    gi = gen_only(2, 8, 16)  # needs 6: considered first although listed second
    assert run(GNE, [c, gi], kv) == ([], [2], [])
    assert run(GNE, [c], kv) == ([1], [], [])


def test_gen_init_kv_misfit_does_not_stop_context_candidates() -> None:
    kv = KVCacheManager(10, B)
    big, small = gen_only(2, 40, 8), gen_only(3, 4, 4)  # need 12 and 2
    c = ctx(1, 8, 8)  # needs 4
    assert run(GNE, [c, big, small], kv) == ([1], [], [])
    assert run(GNE, [c, small], kv) == ([1], [3], [])


@pytest.mark.parametrize("policy", [GNE, STATIC])
def test_started_context_is_tried_before_first_chunk_requests_listed_ahead(policy: P) -> None:
    """scheduling.md 2.2, pdserve (issue 46): pass 2 takes the contexts past their first chunk
    first. TensorRT-LLM's list order would let the newcomer take the started request's reserved
    blocks, or, when the newcomer does not fit, end the pass before the started request."""
    kv = KVCacheManager(10, B)
    started = ctx(1, 9, 8)  # 5 blocks to completion, 3 of them (its prompt) held: needs 2
    kv.add_sequence(started)
    started.context_current_position = 4  # its first chunk ran
    assert kv.get_num_free_blocks() == 7
    fits_alone = ctx(2, 20, 8)  # needs 7: all that is free
    too_big = ctx(3, 28, 4)  # needs 8
    assert run(policy, [fits_alone, started], kv) == ([1], [], [])
    assert run(policy, [too_big, started], kv) == ([1], [], [])
    small = ctx(4, 4, 4)  # needs 2: both fit, started listed first
    assert run(policy, [small, started], kv) == ([1, 4], [], [])


def test_failed_probe_leaves_no_trace_no_evict() -> None:
    """A candidate whose blocks fit but whose LoRA pages do not is skipped without reserving."""
    kv = KVCacheManager(10, B)
    peft = PeftCacheManager(4, {1: 8})
    lora = ctx(1, 8, 20, lora_task_id=1)  # 7 blocks fit, 8 pages do not
    exact = ctx(2, 20, 20)  # needs all 10 blocks
    assert run(GNE, [lora, exact], kv, peft=peft) == ([2], [], [])


def test_gne_encoder_init_takes_slot_and_pages_but_no_kv() -> None:
    kv = KVCacheManager(0, B)
    cross = KVCacheManager(0, B, is_cross=True)
    peft = PeftCacheManager(5, 4)
    e1 = ctx(1, 4, encoder_tokens=[1] * 40, lora_task_id=1)
    e2 = ctx(2, 4, encoder_tokens=[1] * 40, lora_task_id=2)  # 4 + 4 > 5 pages: skipped
    e3 = ctx(3, 4, encoder_tokens=[1] * 40)
    waiting = ctx(4, 4)
    waiting.state = S.DISAGG_CONTEXT_WAIT_SCHEDULER  # inside an encoder band, never scheduled
    reqs = [e1, waiting, e2, e3]
    assert run(GNE, reqs, kv, peft=peft, cross=cross, no_schedule_until_state=S.ENCODER_INIT) == (
        [1, 3], [], [])
    assert run(GNE, reqs, kv, peft=peft, cross=cross, cap=1,
               no_schedule_until_state=S.ENCODER_INIT) == ([1], [], [])


# ---- STATIC_BATCH ----------------------------------------------------------------------------
def test_static_batch_admits_nothing_while_batch_running() -> None:
    kv = KVCacheManager(100, B)
    g = generating(kv, 1, 8)
    assert run(STATIC, [g, ctx(2, 4), gen_only(3, 4)], kv) == ([1], [], [])
    assert run(GNE, [g, ctx(2, 4), gen_only(3, 4)], kv) == ([1, 2], [3], [])
    t = transferring(kv, 4, 8)  # counted as admitted, so it blocks new requests too
    assert run(STATIC, [t, ctx(2, 4), gen_only(3, 4)], kv) == ([], [], [])
    assert run(STATIC, [ctx(2, 4), gen_only(3, 4), ctx(5, 4)], kv) == ([2, 5], [3], [])


# ---- LoRA pages (2.8) -------------------------------------------------------------------------
def test_gne_lora_pages_counted_once_per_task() -> None:
    kv = KVCacheManager(100, B)
    peft = PeftCacheManager(10, 4)
    g1 = generating(kv, 1, 8, lora_task_id=1)
    g2 = generating(kv, 2, 8, lora_task_id=1)  # task 1 already claimed: 0 pages
    reqs = [g1, g2, ctx(3, 4, lora_task_id=1), ctx(4, 4, lora_task_id=2),
            ctx(5, 4, lora_task_id=2), ctx(6, 4, lora_task_id=3), ctx(7, 4)]
    # 10 - 4 (task 1) - 4 (task 2) = 2 < 4: task 3 skipped, the request without LoRA admitted.
    assert run(GNE, reqs, kv, peft=peft) == ([1, 2, 3, 4, 5, 7], [], [])


def test_gne_running_requests_claim_pages_without_a_check() -> None:
    kv = KVCacheManager(100, B)
    peft = PeftCacheManager(5, {1: 8, 2: 1})
    g = generating(kv, 1, 8, lora_task_id=1)  # 8 > 5 pages: admitted anyway
    reqs = [g, ctx(2, 4, lora_task_id=2), ctx(3, 4, lora_task_id=1), ctx(4, 4)]
    # 5 - 8 = -3 pages left: even a zero-page candidate fails "needed <= available".
    assert run(GNE, reqs, kv, peft=peft) == ([1], [], [])
    assert run(GNE, reqs[1:], kv, peft=peft) == ([2, 4], [], [])  # task 1 alone is 8 > 5


def test_peft_only_shortage_skips_while_block_shortage_breaks() -> None:
    kv = KVCacheManager(10, B)
    peft = PeftCacheManager(4, 8)
    assert run(GNE, [ctx(1, 4, lora_task_id=1), ctx(2, 4)], kv, peft=peft) == ([2], [], [])
    assert run(GNE, [ctx(1, 40), ctx(2, 4)], kv, peft=peft) == ([], [], [])
    # Gen-init requests follow the same rule in their own list.
    assert run(GNE, [gen_only(1, 4, lora_task_id=1), gen_only(2, 4)], kv, peft=peft) == (
        [], [2], [])


# ---- cross KV (2.7) ---------------------------------------------------------------------------
def _decoder_ctx(rid: int, prompt_len: int, encoder_len: int) -> LlmRequest:
    req = ctx(rid, prompt_len, 4, encoder_tokens=[5] * encoder_len if encoder_len else None)
    req.state = S.CONTEXT_INIT  # encoder output ready
    return req


def test_cross_kv_misfit_breaks() -> None:
    kv = KVCacheManager(100, B)
    c1, c2 = _decoder_ctx(1, 4, 12), _decoder_ctx(2, 4, 0)  # cross needs 3 and 0
    assert run(GNE, [c1, c2], kv, cross=KVCacheManager(2, B, is_cross=True)) == ([], [], [])
    assert run(GNE, [c1, c2], kv, cross=KVCacheManager(3, B, is_cross=True)) == ([1, 2], [], [])


def test_cross_kv_reserves_for_running_requests() -> None:
    kv = KVCacheManager(100, B)
    cross = KVCacheManager(6, B, is_cross=True)
    chunked = _decoder_ctx(1, 8, 12)  # cross blocks taken at its first chunk: needs 0 more
    kv.add_sequence(chunked)
    cross.add_sequence(chunked)
    chunked.context_current_position = 4
    c = _decoder_ctx(2, 4, 12)  # 3 of the 3 cross blocks left
    assert run(GNE, [chunked, c], kv, cross=cross) == ([1, 2], [], [])
    assert run(GNE, [chunked, c, _decoder_ctx(3, 4, 4)], kv, cross=cross) == ([1, 2], [], [])


# ---- prefix-aware skipping (2.9) --------------------------------------------------------------
PROMPT = list(range(500, 509))  # P = 2B + 1: two full cacheable blocks


@pytest.mark.parametrize("policy", [GNE, MAXU])
def test_prefix_aware_delays_duplicate_uncached_prompt_without_self_skip(policy: P) -> None:
    kv = KVCacheManager(100, B, enable_block_reuse=True)
    a, dup, other = ctx(1, 9, tokens=PROMPT), ctx(2, 9, tokens=PROMPT), ctx(3, 9)
    assert run(policy, [a, dup, other], kv) == ([1, 3], [], [])  # skip is a continue
    assert run(STATIC, [a, dup, other], kv) == ([1, 2, 3], [], [])
    assert run(policy, [a, dup, other], kv, enable_prefix_aware_scheduling=False) == (
        [1, 2, 3], [], [])


@pytest.mark.parametrize("policy", [GNE, MAXU])
def test_contributed_set_prefilled_by_executing_chunked_contexts(policy: P) -> None:
    kv = KVCacheManager(100, B, enable_block_reuse=True)
    executing = ctx(1, 9, tokens=PROMPT)
    kv.add_sequence(executing)
    executing.context_current_position = 4  # first chunk done, blocks not stored yet
    new = ctx(2, 9, tokens=PROMPT)
    assert run(policy, [new, executing], kv) == ([1], [], [])
    executing.context_current_position = 0  # not executing yet: nothing pre-filled
    assert run(policy, [new, executing], kv) == ([2], [], [])  # and executing now skips


def test_prefix_aware_off_gives_no_reuse_credit() -> None:
    kv = KVCacheManager(7, B, enable_block_reuse=True)
    running = generating(kv, 1, 9, 8, tokens=PROMPT)  # holds 3, 2 cached; remaining 5 - 3 = 2
    same = ctx(2, 9, 3, tokens=PROMPT)  # 3 blocks, or 1 with both cached blocks credited
    assert kv.get_num_free_blocks() == 4
    assert run(GNE, [running, same], kv) == ([1, 2], [], [])
    assert run(GNE, [running, same], kv, enable_prefix_aware_scheduling=False) == ([1], [], [])


def test_skipping_is_off_with_a_variable_window_manager() -> None:
    kv = KVCacheManager(100, B, enable_block_reuse=True)
    kv.is_variable_window = True
    a, dup = ctx(1, 9, tokens=PROMPT), ctx(2, 9, tokens=PROMPT)
    assert run(GNE, [a, dup], kv) == ([1, 2], [], [])
    assert run(MAXU, [a, dup], kv) == ([1, 2], [], [])


# ---- reorder hook -----------------------------------------------------------------------------
class _ReverseAndDrop:
    """Reverses the list and drops request 99, recording what it was offered."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def reorder(self, requests: list[LlmRequest]) -> list[LlmRequest]:
        self.seen.append(ids(requests))
        return [r for r in reversed(requests) if r.request_id != 99]


@pytest.mark.parametrize("policy", [GNE, STATIC, MAXU, None])
def test_reorder_hook_applied_to_active_list_first(policy: P | None) -> None:
    kv = KVCacheManager(100, B)
    reqs = [ctx(1, 4), ctx(2, 4), ctx(99, 4), ctx(3, 4)]
    sched = CapacityScheduler(2, policy or GNE, has_kv_cache_manager=policy is not None)
    hook = _ReverseAndDrop()
    sched.set_reorder_policy(hook)
    out = sched.schedule(reqs, kv)
    assert hook.seen == [[1, 2, 99, 3]]
    assert ids(out.fitting) == [3, 2]
    sched.set_reorder_policy(None)
    assert ids(sched.schedule(reqs, kv).fitting) == [1, 2]

"""MicroBatchScheduler against a direct transcription of scheduling.md 3.2-3.4.

The scheduler's first pass and FIRST_COME_FIRST_SERVED chunking are written for speed (request
fields read in place, reuse_adjusted_compute inlined); the oracles below follow the reference
text step by step through the public request properties and ``reuse_adjusted_compute``, and
random batches must come out the same: lists, chunk sizes and draft tokens.
"""
from __future__ import annotations

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


def _oracle_fcfs(requests, capacity, unit, max_ctx) -> list[int]:
    """Reference 3.4 FIRST_COME_FIRST_SERVED, reuse-adjusted costs (no draft tokens)."""
    chunks = []
    for req in requests:
        suggested = req.context_remaining_length
        first = req.is_first_context_chunk
        reusable = min(req.estimated_reusable_tokens, suggested) if first else 0

        def cost(chunk: int) -> int:
            return reuse_adjusted_compute(chunk, reusable, suggested)

        actual = suggested
        if capacity is not None and cost(suggested) > capacity:
            actual = max(0, capacity)
        if max_ctx is not None and cost(actual) > max_ctx:
            actual = min(max_ctx, suggested)
        if actual != suggested:
            actual = actual // unit * unit
        chunks.append(actual)
        if capacity is not None:
            capacity -= cost(actual)
    return chunks


context_spec = st.tuples(
    st.integers(1, 80),  # prompt length
    st.integers(0, 80),  # position (clamped to the prompt)
    st.booleans(),  # on its first chunk (prepopulated length = position)
    st.integers(0, 100),  # estimated reusable tokens (may exceed what is left)
)


def _contexts(specs) -> list[LlmRequest]:
    requests = []
    for rid, (p, pos, first, reusable) in enumerate(specs):
        req = LlmRequest(rid, list(range(p)), 4)
        pos = min(pos, p - 1)
        req.context_current_position = pos
        req.prepopulated_prompt_len = pos if first else (pos + 1) % p
        req.estimated_reusable_tokens = reusable
        requests.append(req)
    return requests


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(context_spec, min_size=1, max_size=12),
    capacity=st.one_of(st.none(), st.integers(-20, 400)),
    unit=st.integers(1, 40),
    max_ctx=st.one_of(st.none(), st.integers(1, 120)),
)
def test_first_come_first_served_follows_the_reference(specs, capacity, unit, max_ctx) -> None:
    requests = _contexts(specs)
    expected = _oracle_fcfs(requests, capacity, unit, max_ctx)
    MicroBatchScheduler.set_ctx_requests_chunk_size(
        requests, P.FIRST_COME_FIRST_SERVED, capacity, unit, max_ctx
    )
    assert [r.context_chunk_size for r in requests] == expected


def _oracle_schedule(requests, inflight, max_batch_size, max_num_tokens, config, max_ctx):
    """Reference 3.2-3.3 (newest band: CONTEXT_INIT .. GENERATION_TO_COMPLETE)."""
    context, generation, to_chunk = [], [], []
    batch_tokens = chunked_tokens = count = beam0 = 0
    all_fit = True
    for req in requests:
        if not S.CONTEXT_INIT <= req.state < S.GENERATION_TO_COMPLETE or req.request_id in inflight:
            continue
        if req.is_context_init_state:
            remaining = req.context_remaining_length
            first = req.is_first_context_chunk
            reusable = min(req.estimated_reusable_tokens, remaining) if first else 0
            if config is None:
                cost = max(1, reuse_adjusted_compute(req.get_num_tokens(0), reusable, remaining)
                           + req.num_draft_tokens)
                if max_ctx is not None and cost > max_ctx:
                    return "error"
                if max_num_tokens is not None and batch_tokens + cost > max_num_tokens:
                    break
                context.append(req)
                batch_tokens += cost
            else:
                cost = reuse_adjusted_compute(remaining, reusable, remaining) + req.num_draft_tokens
                if max_ctx is not None and max_ctx < cost:
                    cost = max_ctx
                    all_fit = False
                to_chunk.append(req)
                chunked_tokens += cost
        elif req.is_generation_in_progress_state:
            beam = req.beam_width
            cost = beam + req.num_draft_tokens
            if max_num_tokens is not None and batch_tokens + cost > max_num_tokens:
                break
            if beam0 == 0:
                beam0 = beam
            elif beam != beam0:
                continue
            generation.append(req)
            batch_tokens += cost
        else:
            continue
        count += 1
        if count >= max_batch_size:
            break
    if max_num_tokens is not None and chunked_tokens > max_num_tokens - batch_tokens:
        all_fit = False
    if config is not None and config.policy == P.FORCE_CHUNK:
        all_fit = False
    by_lora = lambda r: (0, 0) if r.lora_task_id is None else (1, r.lora_task_id)  # noqa: E731
    if all_fit:
        for req in to_chunk:
            req.context_chunk_size = req.context_remaining_length
        context = sorted(context + to_chunk, key=by_lora)
    else:
        if config is None:
            return "error"
        capacity = max_num_tokens - batch_tokens if max_num_tokens is not None else None
        remainings = [r.context_remaining_length for r in to_chunk]
        MicroBatchScheduler.set_ctx_requests_chunk_size(
            to_chunk, config.policy, capacity, config.chunk_unit_size, max_ctx
        )
        not_last = [r for r, rem in zip(to_chunk, remainings) if 0 < r.context_chunk_size != rem]
        last = [r for r, rem in zip(to_chunk, remainings) if 0 < r.context_chunk_size == rem]
        context = sorted(not_last, key=by_lora) + sorted(last, key=by_lora)
    return context, sorted(generation, key=by_lora)


request_spec = st.tuples(
    st.sampled_from([
        S.CONTEXT_INIT, S.CONTEXT_INIT, S.DISAGG_CONTEXT_INIT_AND_TRANS, S.GENERATION_IN_PROGRESS,
        S.GENERATION_TO_COMPLETE, S.DISAGG_GENERATION_TRANS_COMPLETE, S.GENERATION_COMPLETE,
        S.DISAGG_GENERATION_INIT,
    ]),
    context_spec,
    st.sampled_from([0, 0, 0, 1, 3]),  # draft tokens
    st.sampled_from([1, 1, 1, 2]),  # beam width
    st.sampled_from([None, None, 1, 2]),  # LoRA task
)


def _requests(specs) -> list[LlmRequest]:
    requests = []
    for rid, (state, (p, pos, first, reusable), drafts, beam, lora) in enumerate(specs):
        req = LlmRequest(rid, list(range(p)), 4, beam_width=beam, lora_task_id=lora,
                         draft_tokens=[9] * drafts if drafts else None)
        req.state = state
        if req.is_context_init_state:
            pos = min(pos, p - 1)
            req.context_current_position = pos
            req.prepopulated_prompt_len = pos if first else (pos + 1) % p
            req.estimated_reusable_tokens = reusable
        requests.append(req)
    return requests


def _fields(requests) -> list[tuple]:
    return [(r.request_id, r.context_chunk_size, r.num_draft_tokens) for r in requests]


@settings(max_examples=300, deadline=None)
@given(
    specs=st.lists(request_spec, min_size=1, max_size=14),
    inflight=st.sets(st.integers(0, 13), max_size=2),
    max_batch_size=st.integers(1, 14),
    max_num_tokens=st.one_of(st.none(), st.integers(1, 400)),
    policy=st.sampled_from([None, *P]),
    unit=st.sampled_from([4, 8, 32]),
    max_ctx=st.one_of(st.none(), st.integers(32, 200)),
)
def test_first_pass_follows_the_reference(
    specs, inflight, max_batch_size, max_num_tokens, policy, unit, max_ctx
) -> None:
    config = ContextChunkingConfig(policy, unit) if policy is not None else None
    mine, theirs = _requests(specs), _requests(specs)
    try:
        got = MicroBatchScheduler(config, max_ctx).schedule(
            mine, inflight, max_batch_size, max_num_tokens
        )
    except ValueError:
        got = "error"
    expected = _oracle_schedule(theirs, inflight, max_batch_size, max_num_tokens, config, max_ctx)
    if expected == "error" or got == "error":
        assert got == expected
        return
    assert [[r.request_id for r in part] for part in got] == [
        [r.request_id for r in part] for part in expected
    ]
    assert _fields(mine) == _fields(theirs)


def test_a_credit_beyond_the_remaining_context_costs_nothing_not_less() -> None:
    # A's estimate (60) exceeds its remaining 10 tokens: its last chunk costs 0, not -50, so B's
    # 40 tokens overflow the 30-token budget and must be chunked (FCFS: 30 -> 28 on the 4 grid).
    a = LlmRequest(0, list(range(10)), 4)
    a.estimated_reusable_tokens = 60
    b = LlmRequest(1, list(range(40)), 4)
    config = ContextChunkingConfig(P.FIRST_COME_FIRST_SERVED, 4)
    context, _ = MicroBatchScheduler(config).schedule([a, b], set(), 8, 30)
    assert [r.request_id for r in context] == [1, 0]  # B is not on its last chunk
    assert (a.context_chunk_size, b.context_chunk_size) == (10, 28)

"""SimpleScheduler: capacity pass, then micro-batch pass on the fitting list (scheduling.md 6)."""
from __future__ import annotations

import pdserve.scheduler as sched_pkg
from pdserve.scheduler import (
    CapacityOutput,
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    SchedulerOutput,
    SimpleScheduler,
)

S = LlmRequestState


def ctx(rid: int, prompt_len: int = 8, max_new_tokens: int = 8) -> LlmRequest:
    return LlmRequest(rid, list(range(100 * rid, 100 * rid + prompt_len)), max_new_tokens)


def gen(rid: int, state: S = S.GENERATION_IN_PROGRESS) -> LlmRequest:
    req = LlmRequest(rid, [1, 2, 3, 4], 8)
    req.state = state
    req.context_current_position = 4
    req.add_new_token(9)
    return req


def ids(requests) -> list[int]:
    return [r.request_id for r in requests]


class FakeCapacity:
    """Returns a fixed split and records what it was given."""

    def __init__(self, output: CapacityOutput) -> None:
        self.output = output
        self.calls: list[tuple] = []

    def schedule(self, active_requests, kv_cache_manager=None, peft_cache_manager=None,
                 cross_kv_cache_manager=None) -> CapacityOutput:
        self.calls.append(
            (list(active_requests), kv_cache_manager, peft_cache_manager, cross_kv_cache_manager)
        )
        return self.output


def test_public_names_are_exported():
    for name in [
        "LlmRequestState", "LlmRequestType", "LlmRequest", "ContextPhaseParams", "KVCacheManager",
        "PrefixReuseSummary", "PeftCacheManager", "CapacitySchedulerPolicy", "CapacityScheduler",
        "CapacityOutput", "ContextChunkingPolicy", "ContextChunkingConfig", "MicroBatchScheduler",
        "AgentTreePolicy", "insert_request_in_order", "SimpleScheduler", "SchedulerOutput",
    ]:
        assert name in sched_pkg.__all__ and hasattr(sched_pkg, name), name


def test_micro_pass_runs_on_the_fitting_list_with_the_managers_and_limits():
    a, b, c, d = ctx(1), gen(2), gen(3), ctx(4)
    gen_init = LlmRequest(5, [1, 2], 4, llm_request_type=2)
    paused = gen(6)
    kv, peft, cross = object(), object(), object()
    capacity = FakeCapacity(CapacityOutput([a, b, c], [gen_init], [paused]))
    scheduler = SimpleScheduler(
        capacity, MicroBatchScheduler(), kv_cache_manager=kv, peft_cache_manager=peft,
        cross_kv_cache_manager=cross, max_batch_size=8, max_num_tokens=100,
    )
    out = scheduler.schedule([a, b, c, d, gen_init, paused], {3})
    assert isinstance(out, SchedulerOutput)
    assert capacity.calls == [([a, b, c, d, gen_init, paused], kv, peft, cross)]
    assert ids(out.context_requests) == [1]  # d did not fit the capacity pass
    assert ids(out.generation_requests) == [2]  # 3 is in flight
    assert ids(out.paused_requests) == [6]
    assert ids(out.fitting_disagg_gen_init_requests) == [5]
    assert out.num_fitting_requests == 3


def test_limits_apply_to_the_micro_pass():
    requests = [ctx(1), gen(2), gen(3)]
    capacity = FakeCapacity(CapacityOutput(list(requests), [], []))
    out = SimpleScheduler(capacity, MicroBatchScheduler(), max_batch_size=2).schedule(requests)
    assert ids(out.context_requests) == [1] and ids(out.generation_requests) == [2]
    out = SimpleScheduler(
        capacity, MicroBatchScheduler(), max_batch_size=8, max_num_tokens=9
    ).schedule(requests)
    assert ids(out.context_requests) == [1] and ids(out.generation_requests) == [2]  # 8 + 1 tokens


def test_guaranteed_no_evict_then_chunked_micro_batch():
    # 8-token prompts with 8 new tokens need 4 blocks of 4 to completion: two of three fit 10 blocks.
    kv = KVCacheManager(10, 4)
    scheduler = SimpleScheduler(
        CapacityScheduler(8, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT),
        MicroBatchScheduler(ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 4)),
        kv_cache_manager=kv, max_batch_size=8, max_num_tokens=10,
    )
    a, b, c = ctx(1), ctx(2), ctx(3)
    out = scheduler.schedule([a, b, c], set())
    assert out.num_fitting_requests == 2
    # FCFS: a takes its whole 8 tokens, the 2 left round down to 0 for b.
    assert ids(out.context_requests) == [1] and a.context_chunk_size == 8
    assert b.context_chunk_size == 0 and out.paused_requests == []


def test_generation_to_complete_counts_for_capacity_but_is_not_batched():
    scheduler = SimpleScheduler(
        CapacityScheduler(8, has_kv_cache_manager=False), MicroBatchScheduler(), max_batch_size=8
    )
    finishing, running = gen(1, S.GENERATION_TO_COMPLETE), gen(2)
    out = scheduler.schedule([finishing, running], set())
    assert out.num_fitting_requests == 2
    assert ids(out.generation_requests) == [2]


def test_max_requests_capacity_caps_the_fitting_list():
    scheduler = SimpleScheduler(
        CapacityScheduler(2, has_kv_cache_manager=False), MicroBatchScheduler(), max_batch_size=8
    )
    out = scheduler.schedule([ctx(1), gen(2), gen(3)], set())
    assert out.num_fitting_requests == 2
    assert ids(out.context_requests) == [1] and ids(out.generation_requests) == [2]


def test_can_schedule_is_true_only_when_everything_fits():
    scheduler = SimpleScheduler(
        CapacityScheduler(8, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT),
        MicroBatchScheduler(),
        kv_cache_manager=KVCacheManager(10, 4),
        max_batch_size=8,
    )
    assert scheduler.can_schedule([ctx(1), ctx(2)])
    assert not scheduler.can_schedule([ctx(1), ctx(2), ctx(3)])

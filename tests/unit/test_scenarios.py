"""Multi-step scenarios: requests driven to completion by the step harness (SimulatedWorker),
with the schedule of every iteration asserted. Expected schedules are derived by hand from the
reference formulas; the derivation is in each test's comments.

Harness conventions: the KV sequence holds the tokens whose K/V was computed (P after prefill)
while the request holds one more (the sampled token); a request completes at P + N tokens.
"""
from __future__ import annotations

from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    ContextPhaseParams,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    LlmRequestType,
    MicroBatchScheduler,
    PeftCacheManager,
    SimpleScheduler,
)
from pdserve.scheduler.sim_worker import SimulatedWorker

GNE = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
MAX_UTIL = CapacitySchedulerPolicy.MAX_UTILIZATION
STATIC = CapacitySchedulerPolicy.STATIC_BATCH


def make_worker(
    policy,
    *,
    num_blocks,
    tokens_per_block=4,
    max_batch_size=4,
    max_num_tokens=100,
    chunking=None,
    chunk_unit=4,
    reuse=False,
    peft=None,
    transfer_steps=1,
    max_input_len=1000,
):
    kv = KVCacheManager(num_blocks, tokens_per_block, enable_block_reuse=reuse)
    chunk_config = ContextChunkingConfig(chunking, chunk_unit) if chunking is not None else None
    scheduler = SimpleScheduler(
        CapacityScheduler(max_batch_size, policy),
        MicroBatchScheduler(chunk_config, max_num_tokens),
        kv_cache_manager=kv,
        peft_cache_manager=peft,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
    )
    return SimulatedWorker(
        scheduler, kv, max_input_len=max_input_len, transfer_steps=transfer_steps
    )


def req(rid, prompt_len, max_new, *, base=None, **kwargs):
    tokens = list(base) if base is not None else [100 + rid * 50 + i for i in range(prompt_len)]
    return LlmRequest(rid, tokens[:prompt_len], max_new, **kwargs)


def schedule_of(records):
    """(context (id, tokens) pairs, generation ids, paused ids) per step."""
    return [(list(r.context), list(r.generation), list(r.paused)) for r in records]


def assert_drained(worker):
    assert worker.kv.get_num_free_blocks() == worker.kv.num_blocks
    assert not worker.active


def test_guaranteed_no_evict_everything_fits():
    # P=5, N=3, B=4: remaining-to-completion = ctxBlocks 1 + genPerBeam (ceil(8/4) - 1) = 2.
    w = make_worker(GNE, num_blocks=8)
    for i in range(3):
        w.add_request(req(i, 5, 3))
    records = w.run()
    assert schedule_of(records) == [
        ([(0, 5), (1, 5), (2, 5)], [], []),
        ([], [0, 1, 2], []),
        ([], [0, 1, 2], []),
    ]
    assert [r.free_blocks for r in records] == [2, 2, 8]
    assert list(records[-1].finished) == [0, 1, 2]
    assert all(r.get_num_tokens(0) == 8 for r in w.finished)
    assert_drained(w)


def test_guaranteed_no_evict_waits_for_room_and_never_pauses():
    # 4 blocks: r0 and r1 reserve 2 each to completion; r2 waits until both finish (step 2
    # frees after scheduling, so r2 starts at step 3).
    w = make_worker(GNE, num_blocks=4)
    for i in range(3):
        w.add_request(req(i, 5, 3))
    records = w.run()
    assert schedule_of(records) == [
        ([(0, 5), (1, 5)], [], []),
        ([], [0, 1], []),
        ([], [0, 1], []),
        ([(2, 5)], [], []),
        ([], [2], []),
        ([], [2], []),
    ]
    assert w.stats.pauses == 0
    assert_drained(w)


def test_max_utilization_pauses_the_last_started_request_and_recomputes_it():
    # B=4, 4 blocks, P=4, N=8. One-step needs: prefill 1 block each; the first decode step
    # crosses into block 2 (1 each, 2 free); steps 2-4 need nothing; at step 5 r0 needs block 3
    # and nothing is free, so the backward search pauses r1 (the last started request), which
    # frees its 2 blocks, and r0 is retried at the same position.
    w = make_worker(MAX_UTIL, num_blocks=4)
    w.add_request(req(0, 4, 8))
    w.add_request(req(1, 4, 8))
    records = w.run()
    r1 = next(r for r in w.finished if r.request_id == 1)
    assert schedule_of(records) == [
        ([(0, 4), (1, 4)], [], []),
        ([], [0, 1], []),
        ([], [0, 1], []),
        ([], [0, 1], []),
        ([], [0, 1], []),
        ([], [0], [1]),
        # r1 is now a 9-token prompt (5 generated tokens folded in) needing 3 blocks; 1 is free.
        ([], [0], []),
        ([], [0], []),
        ([(1, 9)], [], []),
        ([], [1], []),
        ([], [1], []),
    ]
    assert [r.free_blocks for r in records][5:9] == [1, 1, 4, 1]
    assert r1.prompt_len == 9 and r1.max_new_tokens == 3 and r1.num_pauses == 1
    assert r1.get_num_tokens(0) == 12  # 4 prompt + 8 generated in all
    assert_drained(w)


def test_max_utilization_pause_preserves_tokens_against_an_unpaused_run():
    roomy = make_worker(MAX_UTIL, num_blocks=64)
    tight = make_worker(MAX_UTIL, num_blocks=6)
    for w in (roomy, tight):
        for i in range(4):
            w.add_request(req(i, 5 + i, 10))
        w.run()
    assert tight.stats.pauses > 0
    tokens = lambda w: {r.request_id: r.get_tokens(0) for r in w.finished}  # noqa: E731
    # Recompute after a pause folds the generated tokens into the prompt: the final sequence
    # is the original prompt + every generated token, as without the pause.
    assert {k: v for k, v in tokens(tight).items()} == tokens(roomy)
    assert_drained(tight)


def test_chunked_prefill_first_come_first_served():
    # max_num_tokens 8, unit 4: r0 (P=10) takes the whole budget (8, a unit multiple); r1's
    # chunk trims to 0 and it is not scheduled. Next step r0's last 2 tokens and r1's 6 fit.
    w = make_worker(
        GNE, num_blocks=16, max_num_tokens=8, chunking=ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
    )
    w.add_request(req(0, 10, 2))
    w.add_request(req(1, 6, 2))
    records = w.run()
    assert schedule_of(records) == [
        ([(0, 8)], [], []),
        ([(0, 2), (1, 6)], [], []),
        ([], [0, 1], []),
    ]
    assert_drained(w)


def test_chunked_prefill_equal_progress():
    # Budget 8, unit 2: EQUAL_PROGRESS hands out one unit per request per round: r0 2, r1 2,
    # r0 4, r1 4 = 8. Next step the remaining 6 + 2 tokens fit the budget whole (allFit), so
    # no chunking policy runs and both finish their prompts.
    w = make_worker(
        GNE, num_blocks=16, max_num_tokens=8, chunking=ContextChunkingPolicy.EQUAL_PROGRESS,
        chunk_unit=2,
    )
    w.add_request(req(0, 10, 1))
    w.add_request(req(1, 6, 1))
    records = w.run()
    assert schedule_of(records) == [
        ([(0, 4), (1, 4)], [], []),
        ([(0, 6), (1, 2)], [], []),
    ]
    assert_drained(w)


def test_priorities_decide_who_gets_the_blocks():
    # Only one request fits (2 blocks). r1 arrives later with higher priority and goes first.
    w = make_worker(GNE, num_blocks=2)
    w.add_request(req(0, 5, 3))
    w.add_request(req(1, 5, 3, priority=0.9))
    assert [r.request_id for r in w.waiting] == [1, 0]
    records = w.run()
    assert schedule_of(records) == [
        ([(1, 5)], [], []),
        ([], [1], []),
        ([], [1], []),
        ([(0, 5)], [], []),
        ([], [0], []),
        ([], [0], []),
    ]
    assert_drained(w)


def test_prefix_aware_scheduling_delays_a_duplicate_until_the_prefix_is_stored():
    # P = 2*B + 1 so both full blocks are storable. r1 duplicates r0's uncached prompt: it is
    # skipped at step 0 (its first new block is already being contributed by r0), then admitted
    # at step 1 with both blocks reused: cost max(1, 9 - 8) = 1 token, 1 block to completion.
    w = make_worker(GNE, num_blocks=16, reuse=True)
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    w.add_request(req(0, 9, 2, base=shared))
    w.add_request(req(1, 9, 2, base=shared))
    w.add_request(req(2, 9, 2))
    records = w.run()
    assert schedule_of(records) == [
        ([(0, 9), (2, 9)], [], []),
        ([(1, 1)], [0, 2], []),
        ([], [1], []),
    ]
    assert w.kv.num_reused_blocks == 2
    r0, r1 = (next(r for r in w.finished if r.request_id == i) for i in (0, 1))
    assert r1.get_tokens(0)[:9] == r0.get_tokens(0)[:9]
    assert_drained(w)


def _gen_only(rid, prompt_len, max_new, first_token=42):
    prompt = [200 + rid * 30 + i for i in range(prompt_len)]
    return LlmRequest(
        rid,
        prompt,
        max_new,
        llm_request_type=LlmRequestType.GENERATION_ONLY,
        context_phase_params=ContextPhaseParams(ctx_request_id=1000 + rid, first_gen_tokens=[first_token]),
    )


def test_disaggregated_generation_init_reserves_and_waits_when_full():
    # Each gen-only request reserves 2 blocks at DISAGG_GENERATION_INIT; the third waits in
    # that state, without error, until the first two finish.
    w = make_worker(GNE, num_blocks=4)
    reqs = [_gen_only(i, 5, 3) for i in range(3)]
    for r in reqs:
        w.add_request(r)
    r0 = w.step()
    assert r0.gen_init == (0, 1) and r0.context == () and r0.generation == ()
    assert reqs[0].state == LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
    assert reqs[2].state == LlmRequestState.DISAGG_GENERATION_INIT
    assert r0.free_blocks == 0
    records = [r0] + w.run()
    assert [(r.gen_init, r.generation) for r in records] == [
        ((0, 1), ()),
        ((), (0, 1)),
        ((), (0, 1)),
        ((2,), ()),
        ((), (2,)),
        ((), (2,)),
    ]
    # The context worker's first token was appended at conversion: P + [42] + 2 decoded.
    assert all(r.get_tokens(0)[5] == 42 and r.get_num_tokens(0) == 8 for r in reqs)
    assert_drained(w)


def test_transfer_in_progress_counts_against_the_request_cap():
    # Cap 2. g0, g1 are reserved at step 0 and receive for two steps; while they receive they
    # hold the two slots, so the context request r2 waits although blocks are plentiful.
    w = make_worker(GNE, num_blocks=32, max_batch_size=2, transfer_steps=2)
    w.add_request(_gen_only(0, 5, 2))
    w.add_request(_gen_only(1, 5, 2))
    w.add_request(req(2, 5, 1))
    records = w.run()
    assert [(r.gen_init, r.context_ids, r.generation) for r in records] == [
        ((0, 1), (), ()),
        ((), (), ()),
        ((), (), (0, 1)),
        ((), (2,), ()),
    ]
    assert_drained(w)


def test_static_batch_admits_nothing_while_a_batch_runs():
    w = make_worker(STATIC, num_blocks=32)
    w.add_request(req(0, 5, 3))
    w.add_request(req(1, 5, 3))
    first = w.step()
    w.add_request(req(2, 5, 1))  # arrives while the batch is running
    records = [first] + w.run()
    assert schedule_of(records) == [
        ([(0, 5), (1, 5)], [], []),
        ([], [0, 1], []),
        ([], [0, 1], []),
        ([(2, 5)], [], []),
    ]
    assert_drained(w)


def test_lora_pages_count_once_per_task_and_gate_admission():
    # Two pages on the device, two per task: task 1 (r0, r1) fits once; task 2 (r2) waits for
    # the pages, and since only pages are short it is skipped, not a break: r3 (no LoRA) runs.
    peft = PeftCacheManager(max_device_pages=2, pages_per_task=2)
    w = make_worker(GNE, num_blocks=32, peft=peft)
    w.add_request(req(0, 5, 2, lora_task_id=1))
    w.add_request(req(1, 5, 2, lora_task_id=1))
    w.add_request(req(2, 5, 2, lora_task_id=2))
    w.add_request(req(3, 5, 2))
    records = w.run()
    assert schedule_of(records) == [
        # final sort: no-LoRA first, then by task id
        ([(3, 5), (0, 5), (1, 5)], [], []),
        ([], [3, 0, 1], []),
        ([(2, 5)], [], []),
        ([], [2], []),
    ]
    assert_drained(w)

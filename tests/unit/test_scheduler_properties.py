"""Property tests over random workloads driven through the real schedulers by the step harness.

Each example draws a policy, a pool, a chunking configuration and a stream of requests (some
sharing prefixes, some generation-only, with priorities and staggered arrivals), runs it to
completion and checks after every step:
- free + used blocks == total;
- no request appears twice in one step's outputs (context, generation, paused, gen-init);
- the batch never exceeds max_batch_size and the tokens computed never exceed max_num_tokens;
- only started requests are paused;
and at the end that every block is free again and every request produced P + N tokens.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    SimpleScheduler,
)
from pdserve.scheduler.sim_worker import SimulatedWorker

B = 4
S = LlmRequestState

request_spec = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 16),  # max new tokens
    st.integers(0, 12),  # arrival step
    st.sampled_from([0.2, 0.5, 0.5, 0.9]),  # priority
    st.integers(0, 3),  # prefix family (0: unique)
    st.booleans(),  # generation-only (disaggregated) request
)

config = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(list(CapacitySchedulerPolicy)),
        "num_blocks": st.integers(15, 48),
        "max_batch_size": st.integers(1, 8),
        "chunking": st.sampled_from([None, *ContextChunkingPolicy]),
        "chunk_unit": st.sampled_from([4, 8]),
        "max_num_tokens": st.integers(8, 64),
        "reuse": st.booleans(),
        "transfer_steps": st.integers(1, 3),
    }
)


def _started(r: LlmRequest) -> bool:
    in_band = S.CONTEXT_INIT <= r.state < S.GENERATION_COMPLETE
    return in_band and (
        (r.is_context_init_state and not r.is_first_context_chunk) or r.is_generation_in_progress_state
    )


def _build(cfg, specs):
    max_tokens = cfg["max_num_tokens"]
    if cfg["chunking"] is None:
        max_tokens = max(max_tokens, 40)  # without chunking a whole prompt must fit one step
    kv = KVCacheManager(cfg["num_blocks"], B, enable_block_reuse=cfg["reuse"])
    chunking = (
        ContextChunkingConfig(cfg["chunking"], cfg["chunk_unit"]) if cfg["chunking"] is not None else None
    )
    scheduler = SimpleScheduler(
        CapacityScheduler(cfg["max_batch_size"], cfg["policy"]),
        MicroBatchScheduler(chunking, max_tokens),
        kv_cache_manager=kv,
        max_batch_size=cfg["max_batch_size"],
        max_num_tokens=max_tokens,
    )
    # Without chunking a whole (re)computed prompt must fit one step, so pauses clamp the
    # folded prompt at max_num_tokens, as an engine core's max_input_len would.
    max_input_len = max_tokens if cfg["chunking"] is None else 1000
    worker = SimulatedWorker(
        scheduler, kv, max_input_len=max_input_len, transfer_steps=cfg["transfer_steps"]
    )
    families = {f: [500 + 37 * f + i for i in range(40)] for f in range(1, 4)}
    arrivals = []
    for rid, (p, n, at, prio, fam, gen_only) in enumerate(specs):
        base = families[fam] if fam else [1000 + rid * 41 + i for i in range(p)]
        kwargs = {"priority": prio}
        if gen_only:
            # The context worker produced the first token; a router sends only requests that
            # still need decoding (max_tokens >= 2) to the generation side.
            n = max(n, 2)
            kwargs["llm_request_type"] = LlmRequestType.GENERATION_ONLY
            kwargs["context_phase_params"] = ContextPhaseParams(ctx_request_id=rid, first_gen_tokens=[7])
        arrivals.append((at, LlmRequest(rid, base[:p], n, **kwargs)))
    return worker, max_tokens, sorted(arrivals, key=lambda a: a[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config, specs=st.lists(request_spec, min_size=1, max_size=14))
def test_random_workloads_keep_every_invariant(cfg, specs):
    worker, max_tokens, arrivals = _build(cfg, specs)
    requests = [r for _, r in arrivals]
    total = worker.kv.num_blocks
    step = 0
    while arrivals or not worker.idle:
        while arrivals and arrivals[0][0] <= step:
            worker.add_request(arrivals.pop(0)[1])
        # A receive may complete at the start of the step (TRANS_COMPLETE counts as generation
        # in progress), so receiving requests may be started by the time the scheduler runs.
        started = {
            r.request_id
            for r in worker.active
            if _started(r) or r.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS
        }
        record = worker.step()
        step += 1
        assert step < 5000, "workload did not drain"

        ids = [*record.context_ids, *record.generation, *record.paused, *record.gen_init]
        assert len(ids) == len(set(ids)), f"a request appears twice: {record}"
        assert len(record.context) + len(record.generation) <= cfg["max_batch_size"]
        assert record.num_tokens <= max_tokens, record
        assert set(record.paused) <= started, f"paused a request that had not started: {record}"
        assert worker.kv.get_num_free_blocks() + worker.kv.get_num_used_blocks() == total
        if cfg["policy"] != CapacitySchedulerPolicy.MAX_UTILIZATION:
            assert not record.paused

    assert worker.kv.get_num_free_blocks() == total
    for r in requests:
        assert r.state == S.GENERATION_COMPLETE
        assert r.get_num_tokens(0) == r.orig_prompt_len + r.orig_max_new_tokens

"""Liveness: workloads the engine core accepts drain (issue 46).

A request the engine core accepts fits an empty pool on its own (``EngineCore.add_request`` refuses
P + N beyond the pool) and, without chunking, fits one step. Among such requests the schedulers
must never reach a state where nothing can run: no transfers are involved, so a step that
schedules nothing while requests are active leaves the state as it was, and every later step
repeats it. ``_drain`` fails on the first such step (a hang, named by the step's state), and
bounds the number of steps besides.

The hang of issue 46: GUARANTEED_NO_EVICT with prefix-aware skipping, where a first-chunk
request that was skipped (its first uncached block was about to be stored by another request)
came back ahead of a later request that had meanwhile started prefilling; no longer fitting, its
block misfit ended the pass before the started request, the only one whose completion could free
the blocks it needed (scheduling.md 2.2). The random workloads at the end run every capacity
policy under every chunking setting (none, FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS, FORCE_CHUNK,
units of 1-8 tokens with blocks of 1-4) with reuse on and off; they also found the MAX_UTILIZATION
hang of a first chunk shrunk to nothing (scheduling.md 3.5).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    SimpleScheduler,
)
from pdserve.scheduler.sim_worker import SimulatedWorker

S = LlmRequestState
GNE = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
FCFS = ContextChunkingPolicy.FIRST_COME_FIRST_SERVED

# Shared-prefix families: requests of one family share their leading tokens, so with reuse on the
# later ones are skipped while an earlier one stores those blocks (scheduling.md 2.9).
FAMILIES = {f: [300 + 50 * f + i for i in range(40)] for f in range(1, 4)}


def _worker(policy, *, tokens_per_block, num_blocks, max_batch_size, max_num_tokens, chunking,
            chunk_unit, reuse, prefix_aware=True):
    kv = KVCacheManager(num_blocks, tokens_per_block, enable_block_reuse=reuse)
    chunk_config = ContextChunkingConfig(chunking, chunk_unit) if chunking is not None else None
    scheduler = SimpleScheduler(
        CapacityScheduler(max_batch_size, policy, enable_prefix_aware_scheduling=prefix_aware),
        MicroBatchScheduler(chunk_config, max_num_tokens),
        kv_cache_manager=kv,
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
    )
    # Without chunking a paused request's folded prompt must still fit one step (the engine core's
    # max_input_len does the same).
    max_input_len = max_num_tokens if chunking is None else 10_000
    return SimulatedWorker(scheduler, kv, max_input_len=max_input_len)


def _drain(worker, arrivals, max_steps):
    """Runs ``arrivals`` ((step, request), sorted by step) to completion. Fails on a step that
    schedules nothing while requests are active and none is still to arrive (a hang), or past
    ``max_steps``. Returns the number of steps."""
    arrivals = list(arrivals)
    requests = [r for _, r in arrivals]
    step = 0
    while arrivals or not worker.idle:
        while arrivals and arrivals[0][0] <= step:
            worker.add_request(arrivals.pop(0)[1])
        record = worker.step()
        step += 1
        stuck = not record.context and not record.generation and not record.paused
        # Only with every request arrived: a later arrival may change the schedule.
        if stuck and worker.active and not arrivals:
            states = [(r.request_id, r.state.name, r.context_current_position, r.prompt_len)
                      for r in worker.active]
            raise AssertionError(
                f"step {record.iteration}: nothing scheduled, nothing can change: {states}, "
                f"{record.free_blocks} blocks free")
        assert step < max_steps, f"not drained after {max_steps} steps"
    assert worker.kv.get_num_free_blocks() == worker.kv.num_blocks
    for r in requests:
        assert r.state == S.GENERATION_COMPLETE, r
        assert r.get_num_tokens(0) == r.orig_prompt_len + r.orig_max_new_tokens
    return step


# ---- the reproduction of issue 46 ---------------------------------------------------------------
PREFIX = list(range(10, 35))  # 25 tokens


def _issue_46(num_blocks, chunk_unit=1, order=(0, 1, 2)):
    """B = 2, ``num_blocks`` blocks, max_num_tokens 16, FCFS chunks, reuse on: prompts of 12 and
    25 tokens sharing a prefix (A, B) and an unrelated one of 21 (C), max_tokens 4, all at once,
    listed in ``order`` (indices into A, B, C)."""
    worker = _worker(GNE, tokens_per_block=2, num_blocks=num_blocks, max_batch_size=64,
                     max_num_tokens=16, chunking=FCFS, chunk_unit=chunk_unit, reuse=True)
    prompts = [PREFIX[:12], PREFIX[:25], [200 + i for i in range(21)]]
    return worker, [(0, LlmRequest(rid, prompts[k], 4)) for rid, k in enumerate(order)]


@pytest.mark.parametrize("chunk_unit", [1, 2])
@pytest.mark.parametrize("num_blocks", [21, 22, 23, 24, 25])
def test_issue_46_a_started_context_is_not_shut_out_by_a_skipped_first_chunk(num_blocks, chunk_unit):
    # Step 0: A and C are admitted, B is skipped (A is about to store the blocks B's prompt starts
    # with). The 16-token budget gives A its 12 tokens and C 4: C has started, holding its 11
    # prompt blocks. From step 1 B's first uncached block is one nobody contributes, so B is a
    # candidate again, ahead of C. It needs 15 blocks (less the 5 it shares with A while A holds
    # them); with C's 11 out of a pool of at most 25 they are never free, and before the fix B's
    # misfit ended the pass before C, which alone could give blocks back: nothing ran again.
    worker, arrivals = _issue_46(num_blocks, chunk_unit)
    steps = _drain(worker, arrivals, max_steps=200)
    assert steps < 40
    # C completes before B is admitted: B fits only once C's blocks are back.
    assert [r.request_id for r in worker.finished] == [0, 2, 1]


def test_issue_46_every_arrival_order_drains():
    orders = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))
    for num_blocks in range(18, 30):
        for order in orders:
            worker, arrivals = _issue_46(num_blocks, order=order)
            _drain(worker, arrivals, max_steps=200)


# ---- a first chunk shorter than a block (scheduling.md 3.5) --------------------------------------
def test_a_cached_prefix_never_shrinks_a_first_chunk_to_nothing():
    # The position jumps past the 4 cached tokens. A 1-token chunk then ends mid-block, and
    # rounding its end down to the block boundary would leave nothing: it is kept.
    r = LlmRequest(1, list(range(6)), 1)
    r.context_chunk_size = 1
    r.set_prepopulated_prompt_len(4, 4)
    assert (r.context_current_position, r.context_chunk_size) == (4, 1)
    # A chunk reaching past a boundary still ends on it, as in TensorRT-LLM.
    r = LlmRequest(2, list(range(12)), 1)
    r.context_chunk_size = 5
    r.set_prepopulated_prompt_len(4, 4)
    assert (r.context_current_position, r.context_chunk_size) == (4, 4)


def test_max_utilization_runs_a_request_whose_first_chunk_is_shorter_than_a_block():
    # B = 4, 2 blocks, FCFS chunks of unit 1 (no block multiple) and a 1-token budget. A (5
    # tokens) prefills a token a step, stores its first block and finishes. B (6 tokens, A's 5
    # and one more) is allocated both blocks, the first from the cache, at position 4 with a
    # 1-token chunk. Shrunk to the block boundary that chunk was 0: B held every block while
    # still on its first chunk, so MAX_UTILIZATION charged it its prompt's blocks again and had
    # nobody started to pause. It never ran.
    worker = _worker(CapacitySchedulerPolicy.MAX_UTILIZATION, tokens_per_block=4, num_blocks=2,
                     max_batch_size=1, max_num_tokens=1, chunking=FCFS, chunk_unit=1, reuse=True)
    arrivals = [(0, LlmRequest(0, FAMILIES[1][:5], 1)), (0, LlmRequest(1, FAMILIES[1][:6], 1))]
    assert _drain(worker, arrivals, max_steps=50) == 7


# ---- random workloads ---------------------------------------------------------------------------
# Every capacity policy and chunking setting, with random engine settings and workloads of
# requests the engine core accepts: each must drain. A step that runs nothing while requests are
# active fails at once (``_drain``); the step bound is far above what progress needs (a step
# that runs anything advances some prompt or decode by a token, and a MAX_UTILIZATION pause
# only costs its recompute).
CHUNKINGS = [None, *ContextChunkingPolicy]
request_spec = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 8),  # max new tokens
    st.sampled_from([0, 0, 0, 1, 2, 4, 6]),  # arrival step
    st.sampled_from([0, 1, 1, 2]),  # prefix family (0: a prompt of its own)
)
engine_spec = st.fixed_dictionaries(
    {
        "chunk_unit": st.sampled_from([1, 2, 3, 4, 8]),
        "tokens_per_block": st.sampled_from([1, 2, 4]),
        "prefix_aware": st.sampled_from([True, True, False]),
        "max_batch_size": st.integers(1, 6),
        "max_num_tokens": st.integers(1, 16),
        "spare_blocks": st.integers(0, 8),  # over what the largest request needs on its own
    }
)


def _run_workload(policy, chunking, reuse, engine, specs):
    unit, b = engine["chunk_unit"], engine["tokens_per_block"]
    max_num_tokens = engine["max_num_tokens"]
    if chunking is None:
        max_num_tokens = max(max_num_tokens, max(p for p, _, _, _ in specs))  # a prompt a step
    else:
        max_num_tokens = max(max_num_tokens, unit)  # a chunk of one unit fits a step
    # The smallest pool the engine core accepts these requests on (workers/engine/admission.py).
    needed = max(-(-(p + n) // b) for p, n, _, _ in specs)
    worker = _worker(
        policy, tokens_per_block=b, num_blocks=needed + engine["spare_blocks"],
        max_batch_size=engine["max_batch_size"], max_num_tokens=max_num_tokens,
        chunking=chunking, chunk_unit=unit, reuse=reuse, prefix_aware=engine["prefix_aware"])
    arrivals = []
    for rid, (p, n, at, family) in enumerate(specs):
        tokens = FAMILIES[family][:p] if family else [1000 + 40 * rid + i for i in range(p)]
        arrivals.append((at, LlmRequest(rid, tokens, n)))
    arrivals.sort(key=lambda a: a[0])
    total = sum(p + n for p, n, _, _ in specs)
    _drain(worker, arrivals, max_steps=50 + 20 * total)


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=lambda c: "no_chunking" if c is None else c.name)
@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy), ids=lambda p: p.name)
@settings(max_examples=100, deadline=None)
@given(reuse=st.booleans(), engine=engine_spec,
       specs=st.lists(request_spec, min_size=1, max_size=10))
def test_random_workloads_drain(policy, chunking, reuse, engine, specs):
    _run_workload(policy, chunking, reuse, engine, specs)


@pytest.mark.parametrize("chunking", CHUNKINGS[1:], ids=lambda c: c.name)
@pytest.mark.parametrize("policy", list(CapacitySchedulerPolicy), ids=lambda p: p.name)
@settings(max_examples=150, deadline=None)
@given(engine=engine_spec, data=st.data())
def test_shared_prefix_workloads_drain(policy, chunking, engine, data):
    # The shape of issue 46, drawn at random: a prompt, a longer one sharing its start (skipped
    # while the first stores their shared blocks), then unrelated prompts, all at once, with
    # reuse on and chunked prefill (a request admitted meanwhile may start and hold its blocks).
    short = data.draw(st.integers(1, 20), label="shorter prompt")
    longer = data.draw(st.integers(short + 1, 30), label="longer prompt")
    new = st.integers(1, 8)
    others = data.draw(st.lists(st.tuples(st.integers(1, 30), new), min_size=1, max_size=4),
                       label="other prompts")
    specs = [(short, data.draw(new), 0, 1), (longer, data.draw(new), 0, 1)]
    specs += [(p, n, 0, 0) for p, n in others]
    _run_workload(policy, chunking, True, engine, specs)

"""KV-aware routing on a live 2P1D cluster whose context pools are small enough to evict: the
router's prefix index, fed only by the workers' KV events, predicts exactly what each prefill
worker reuses; a turn matched past the shared system prompt goes to a worker that ran its
conversation; no generation worker recomputes a prompt whose KV was meant to arrive by transfer;
the index holds what the caches hold; and a restarted worker's entries go at once and come back
from a snapshot."""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster_util as U  # noqa: E402

from pdserve.cluster.router import RouterConfig  # noqa: E402
from pdserve.scheduler.radix_tree import prompt_block_keys  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TPB = 4
CONTEXT_BLOCKS = 48  # 192 tokens per context worker: four conversations do not fit
SYSTEM_TOKENS = 24  # the shared system prompts: whole blocks, so a match past them is a turn's own
ROUTING = dict(router=RouterConfig(routing="kv-aware"), num_context_workers=2,
               num_generation_workers=1, context_engine=dict(num_kv_blocks=CONTEXT_BLOCKS))


def _conversations(n: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Multi-turn prompts: two system prompts shared across conversations, each turn extending
    the previous turn's prompt with new user tokens (so a turn's prefix is the last turn)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 259) for _ in range(SYSTEM_TOKENS)] for _ in range(2)]
    out = []
    for c in range(n):
        prompt = list(systems[c % 2])
        convo = []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(3, 259) for _ in range(rng.randint(6, 14))]
            convo.append(list(prompt))
        out.append(convo)
    return out


def _one_by_one(cl, prefix: str, prompts: list[list[int]]) -> list:
    async def run():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            return [await U.generate(stub, f"{prefix}-{i}", p, 4) for i, p in enumerate(prompts)]

    out = U.run(run(), 300)
    assert all(r.code is None for r in out), [r.details for r in out]
    return out


def _state(cl) -> dict:
    return ray.get(cl.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)


def _index_matches_the_caches(cl, timeout_s: float = 30.0) -> dict:
    """Waits until the router's index holds, for every worker, as many blocks as its cache."""
    deadline = time.monotonic() + timeout_s
    while True:
        index = _state(cl)["kv_index"]
        cached = {w: s["cached_blocks"] for w, s in U.worker_statuses(cl).items()}
        if index == cached:
            return cached
        assert time.monotonic() < deadline, f"index {index} != caches {cached}"
        time.sleep(0.1)


def test_kv_aware_routing_predicts_reuse_exactly_under_eviction(clusters, model_dir):
    cl = clusters(**ROUTING)
    n = 12
    convos = _conversations(n, turns=4, seed=21)
    # More distinct prompt blocks than both context pools hold, so they evict whatever the
    # routing does (with 8 conversations, 86 blocks fit 2 x 48 when the load spread them evenly).
    distinct = {k for convo in convos for p in convo for k in prompt_block_keys(p, TPB)}
    assert len(distinct) > 2 * CONTEXT_BLOCKS
    order = [(c, t) for t in range(4) for c in range(n)]  # round by round: evicts between turns
    results = {}

    async def run():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            for c, t in order:  # one at a time: the cache a request meets is the one predicted
                results[(c, t)] = await U.generate(stub, f"c{c}t{t}", convos[c][t], 4)

    U.run(run(), 300)
    assert all(r.code is None for r in results.values()), [r.details for r in results.values() if r.code]
    state = _state(cl)
    prefix = state["prefix"]
    assert prefix["requests"] == len(order)
    assert prefix["exact"] >= 0.95 * len(order), prefix
    assert prefix["reused_tokens"] > 0, prefix  # later turns met their earlier turns' blocks
    # Each response carries the same figures (Timings), as bench serve reads them.
    timings = [r.last.timings for r in results.values()]
    assert sum(t.prefix_predicted_tokens for t in timings) == prefix["predicted_tokens"]
    assert sum(t.prefix_reused_tokens for t in timings) == prefix["reused_tokens"]
    # The context pools evicted (more prompt blocks went through them than they hold), and the
    # router heard of it: its index followed stores and removals alike.
    events = state["kv_event_blocks"]
    assert sum(events[w]["removed"] for w in ("ctx-0", "ctx-1")) > 0, events
    assert sum(events[w]["stored"] for w in ("ctx-0", "ctx-1")) > 2 * CONTEXT_BLOCKS, events
    # A turn that the index matched beyond the shared system prompt went to a context worker that
    # ran an earlier turn of its conversation (only such a worker can hold those blocks). How
    # many turns keep their history depends on what LRU eviction left between rounds, which
    # depends on load figures sampled at routing time, so the test counts no fraction of them.
    own_history = 0
    for c in range(n):
        for t in range(1, 4):
            timing = results[(c, t)].last.timings
            if timing.prefix_predicted_tokens > SYSTEM_TOKENS:
                own_history += 1
                earlier = {results[(c, u)].last.timings.ctx_worker for u in range(t)}
                assert timing.ctx_worker in earlier, (c, t, timing.ctx_worker, earlier)
    assert own_history > 0, "no turn met its own earlier turns in a context cache"
    statuses = U.worker_statuses(cl)
    assert all(s["unexpected_recomputes"] == 0 for s in statuses.values())
    # Reuse does not change a token: the same prompts through the in-process engine.
    prompts = [convos[c][t] for c, t in order]
    assert [results[k].tokens for k in order] == U.reference(model_dir, prompts, 4)
    _index_matches_the_caches(cl)
    U.wait_drained(cl)


def test_a_restarted_worker_loses_its_entries_and_resyncs_from_a_snapshot(clusters):
    cl = clusters(**ROUTING)
    convo = _conversations(1, turns=2, seed=5)[0]
    _one_by_one(cl, "before-kill", convo)
    before = _index_matches_the_caches(cl)
    victim = next(w for w in ("ctx-0", "ctx-1") if before[w] > 0)
    asked = _state(cl)["kv_snapshots_asked"][victim]
    pid = U.worker_statuses(cl)[victim]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(cl)["kv_index"].get(victim):  # gone with its channel, not at the next poll
        assert time.monotonic() < deadline, "the dead worker's entries stayed in the index"
        time.sleep(0.05)
    deadline = time.monotonic() + 120  # Ray restarts it; the router reconnects and resyncs
    while _state(cl)["kv_snapshots_asked"][victim] <= asked or victim not in _state(cl)["kv_index"]:
        assert time.monotonic() < deadline, "the restarted worker was never resynced"
        time.sleep(0.2)
    U.wait_for(lambda: _state(cl)["healthy"][victim], 60, f"{victim} healthy again")
    # Serving goes on and the index follows the new process's (empty, then refilled) cache.
    _one_by_one(cl, "after-restart", convo)
    _index_matches_the_caches(cl)
    assert all(s["unexpected_recomputes"] == 0 for s in U.worker_statuses(cl).values())
    U.wait_drained(cl)

"""The simulator routes as the router does (``bench/simulator.py``): the policies of
``ClusterSpec.routing`` on a prefix index fed by the workers' KV events, or, for "oracle", on
their exact caches. The index ends equal to every worker's cache, also through snapshots after
an event log overflowed; kv-aware finds prefix hits round-robin misses; with no control-plane
latency and idle workers at each decision, kv-aware decides exactly as the oracle."""
from __future__ import annotations

import functools
import random

import pytest

from pdserve.bench import simulator_workers
from pdserve.bench.cost_model import CostModel, HardwareSpec, ModelShape
from pdserve.bench.metrics import Slo
from pdserve.bench.simulator import simulate
from pdserve.bench.simulator_spec import SIM_ROUTING_MODES, ClusterSpec, Latency, WorkerSpec
from pdserve.bench.workload import WorkItem
from pdserve.scheduler import kv_cache
from pdserve.scheduler.kv_events import KVEventLog

TINY = ModelShape("tiny", 4, 128, 4, 2, 32, 256, 259, dtype_bytes=4, max_seq_len=2048)
CPU = HardwareSpec("cpu", 20e9, 4e9, 0.0, step_overhead_s=1e-3, seq_overhead_s=2e-5, overlap=False)
COST = CostModel(TINY, CPU)
TPB = 4
# A small pool: the conversations below do not all fit, so blocks get evicted.
WORKER = WorkerSpec(max_batch_size=16, max_num_tokens=512, tokens_per_block=TPB, num_kv_blocks=160)


def conversations(num: int = 12, turns: int = 5, *, gap_s: float = 0.004, seed: int = 0) -> list[WorkItem]:
    """``num`` chats of ``turns`` turns: each turn's prompt is the previous one plus 16-40 new
    tokens (after a 12-token system prompt that half of the chats share), the turns of all
    chats interleaved in a seeded random order, one every ``gap_s``."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 259) for _ in range(12)]
    prompts = {c: (system if c % 2 else [rng.randrange(3, 259) for _ in range(12)]) + [3 + c] for c in range(num)}
    order = [c for _ in range(turns) for c in rng.sample(range(num), num)]
    items = []
    for i, c in enumerate(order):
        prompts[c] = prompts[c] + [rng.randrange(3, 259) for _ in range(rng.randrange(16, 41))]
        items.append(WorkItem(i, i * gap_s, list(prompts[c]), rng.randrange(2, 9)))
    return items


def _snapshot_keys(kv) -> frozenset[bytes]:
    return frozenset(k for event in kv.kv_snapshot() for k in event.keys)


def _run(routing: str, work, *, ctx: int = 2, gen: int = 2, hop: float = 1e-3, **kw):
    spec = ClusterSpec(ctx, gen, WORKER, WORKER, routing=routing, latency=Latency(hop, 1e-3), **kw)
    return simulate(spec, COST, work)


# ---------------------------------------------------------------------------- the spec

def test_routing_names_are_the_routers_plus_the_oracle():
    assert SIM_ROUTING_MODES == ("round-robin", "least-loaded", "kv-aware", "oracle")
    assert ClusterSpec(routing="least_loaded").routing == "least-loaded"
    with pytest.raises(ValueError, match="unknown routing"):
        ClusterSpec(routing="kv_cache_aware")
    off = WorkerSpec(enable_block_reuse=False)
    with pytest.raises(ValueError, match="enable_block_reuse"):
        ClusterSpec(1, 1, off, off, routing="kv-aware")
    ClusterSpec(1, 1, off, off, routing="round-robin")  # fine without reuse
    with pytest.raises(ValueError, match="kv_decode_weight"):
        ClusterSpec(routing="kv-aware", kv_decode_weight=-1)


# ---------------------------------------------------------------------------- (a) the index

@pytest.fixture
def built(monkeypatch) -> list:
    """The SimWorkers of each run, as the simulator builds them (their caches are what the
    index mirrors)."""
    out: list = []
    original = simulator_workers.SimWorker.__init__

    def capture(self, *args, **kw):
        original(self, *args, **kw)
        out.append(self)

    monkeypatch.setattr(simulator_workers.SimWorker, "__init__", capture)
    return out


class _CountingLog(KVEventLog):
    """A worker's event log that also counts the blocks it reported removed."""

    def __init__(self, max_pending: int = 100_000) -> None:
        super().__init__(max_pending)
        self.removed_blocks = 0

    def removed(self, keys) -> None:
        self.removed_blocks += len(keys)
        super().removed(keys)


@pytest.mark.parametrize("layout", [(2, 2), (0, 3)])
def test_the_index_ends_equal_to_every_workers_cache(layout, built, monkeypatch):
    monkeypatch.setattr(kv_cache, "KVEventLog", _CountingLog)
    result = _run("kv-aware", conversations(), ctx=layout[0], gen=layout[1])
    assert all(r.ok for r in result.records) and result.index_resyncs == 0
    assert len(built) == sum(layout)
    assert sum(w.kv.kv_events.removed_blocks for w in built) > 0  # evictions happened
    for w in built:
        keys = _snapshot_keys(w.kv)
        assert len(keys) == w.kv.get_num_cached_blocks() > 0
        assert result.index.keys_of(w.worker_id) == keys
        assert result.workers[w.worker_id]["index_blocks"] == len(keys)
    result.index.check_invariants()


def test_an_overflowed_event_log_resyncs_the_index_by_snapshot(monkeypatch, built):
    monkeypatch.setattr(kv_cache, "KVEventLog", functools.partial(KVEventLog, max_pending=3))
    result = _run("kv-aware", conversations(seed=1))
    assert all(w.kv.kv_events.max_pending == 3 for w in built)
    assert result.kv_snapshots >= len(built) and result.index_resyncs == 0
    for w in built:
        assert result.index.keys_of(w.worker_id) == _snapshot_keys(w.kv)
    result.index.check_invariants()
    assert result.summary(Slo())["routing"]["prediction_accuracy"] >= 0.9


# ---------------------------------------------------------------------------- (b) hits

@pytest.mark.parametrize("layout", [(2, 2), (0, 3)])
def test_kv_aware_finds_more_prefix_hits_than_round_robin(layout):
    work = conversations(seed=2)
    slo = Slo(1000, 100)
    rr = _run("round-robin", work, ctx=layout[0], gen=layout[1]).summary(slo)["routing"]
    kv = _run("kv-aware", work, ctx=layout[0], gen=layout[1]).summary(slo)["routing"]
    assert kv["requests"] == rr["requests"] == len(work)
    assert kv["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.1
    # The index's prediction is mostly what the prefill worker reused (not always: a busy
    # worker may evict the blocks before it schedules the request).
    assert kv["prediction_accuracy"] >= 0.85 and rr["prediction_accuracy"] >= 0.85


# ---------------------------------------------------------------------------- (c) the oracle

def _choices(result) -> list[tuple]:
    return [(r.worker, r.predicted_tokens, r.reused_tokens, r.first_token_s, r.finish_s) for r in result.records]


@pytest.mark.parametrize("layout", [(2, 2), (0, 3)])
def test_with_no_hop_and_idle_workers_kv_aware_decides_as_the_oracle(layout):
    """Each request finishes before the next arrives, so every decision sees idle workers, and
    with hop 0 every KV event has reached the index by then: index matches are exact."""
    work = conversations(seed=3, gap_s=1.0)
    kv = _run("kv-aware", work, ctx=layout[0], gen=layout[1], hop=0.0)
    oracle = _run("oracle", work, ctx=layout[0], gen=layout[1], hop=0.0)
    assert max(r.finish_s - r.arrival_s for r in kv.records) < 1.0
    assert _choices(kv) == _choices(oracle)
    assert all(r.predicted_tokens == r.reused_tokens for r in kv.records)
    assert sum(r.reused_tokens for r in kv.records) > 0


def test_under_load_the_index_lags_the_oracle_only_on_workers_mid_step(built, monkeypatch):
    """Why kv-aware and the oracle can still choose differently with hop 0: a simulated step
    does its KV bookkeeping at its start (SimulatedWorker.step) and publishes its events at
    its end, as a worker sends them after the forward pass; a decision in between sees the
    step's blocks through the oracle but not yet through the index."""
    from pdserve.cluster.prefix_index import PrefixIndex

    seen = {"same": 0, "mid_step": 0, "idle": 0}
    match = PrefixIndex.match

    def checked(self, keys):
        out = match(self, keys)
        exact = {w.worker_id: n for w in built if (n := w.kv.cached_leading_blocks(keys))}
        differing = [w for w in built if out.get(w.worker_id, 0) != exact.get(w.worker_id, 0)]
        seen["same" if not differing else "mid_step" if all(w.busy for w in differing) else "idle"] += 1
        return out

    monkeypatch.setattr(PrefixIndex, "match", checked)
    _run("kv-aware", conversations(seed=1), hop=0.0)
    assert seen["idle"] == 0 and seen["mid_step"] > 0 and seen["same"] > seen["mid_step"]

"""cluster/metrics.py without Ray: a fake factory records every metric call, a fake clock drives
the gauge timer, and the engine core's real stats and the transport's real TransferLog carry the
cumulative counters."""
from __future__ import annotations

import re
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster import metric_specs as MS
from pdserve.cluster import metrics as M
from pdserve.scheduler import KVCacheManager, LlmRequest, LlmRequestState
from pdserve.transport.sessions import TransferLog, TransferRecord
from pdserve.workers.engine.state import EngineStats

S = LlmRequestState


class FakeMetric:
    def __init__(self, kind: str, name: str, tag_keys: tuple[str, ...]) -> None:
        self.kind, self.name, self.tag_keys = kind, name, tag_keys
        self.calls: list[tuple[float, dict[str, str]]] = []

    def _record(self, value: float, tags: dict[str, str]) -> None:
        # Ray's strictness: every tag key present, values are strings, counters only go up.
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((value, dict(tags)))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        assert self.kind == "counter" and value > 0
        self._record(value, tags)

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert self.kind == "gauge"
        self._record(value, tags)

    def observe(self, value: float, tags: dict[str, str]) -> None:
        assert self.kind == "histogram"
        self._record(value, tags)


class FakeFactory:
    def __init__(self) -> None:
        self.metrics: dict[str, FakeMetric] = {}

    def _make(self, kind: str, name: str, tag_keys: tuple[str, ...]) -> FakeMetric:
        assert name not in self.metrics, f"{name} created twice"
        self.metrics[name] = FakeMetric(kind, name, tag_keys)
        return self.metrics[name]

    def counter(self, name, description, tag_keys):
        return self._make("counter", name, tag_keys)

    def gauge(self, name, description, tag_keys):
        return self._make("gauge", name, tag_keys)

    def histogram(self, name, description, boundaries, tag_keys):
        assert boundaries == sorted(boundaries) and boundaries[0] > 0
        return self._make("histogram", name, tag_keys)

    def calls(self, spec: MS.MetricSpec, **tags: str) -> list[float]:
        metric = self.metrics.get(spec.name)
        if metric is None:
            return []
        return [v for v, t in metric.calls if all(t[k] == val for k, val in tags.items())]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTransceiver:
    def __init__(self, maxlen: int = 10_000) -> None:
        self.transfers = TransferLog(maxlen)
        self.transmitting: dict[int, LlmRequest] = {}
        self.draining: dict[int, LlmRequest] = {}
        self.num_quarantined_blocks = 0

    def finish(self, rid: int, outcome: str, nbytes: int, seconds: float) -> None:
        """What the transport's sessions do when ``poll`` hands a finished transfer back."""
        ok = outcome in ("SENT", "COMPLETE")
        side = "recv" if outcome in ("COMPLETE", "TIMED_OUT") else "send"
        self.transfers.add(TransferRecord(rid, rid, "peer", nbytes if ok else 0, seconds, outcome,
                                          "", side), ok=ok)


class FakeExecutor:
    """The attributes WorkerMetrics reads from an Executor."""

    def __init__(self, transceiver: FakeTransceiver | None = None) -> None:
        self.stats = EngineStats()
        self.transceiver = transceiver
        self.active: list[LlmRequest] = []
        self.waiting: list[LlmRequest] = []
        self.kv = KVCacheManager(32, 4)
        self.has_work = True


def _request(rid: int, state: S) -> LlmRequest:
    r = LlmRequest(rid, [1, 2, 3, 4, 5], 4)
    r.state = state
    return r


def _worker(**kw) -> tuple[M.WorkerMetrics, FakeFactory, Clock]:
    factory, clock = FakeFactory(), Clock()
    return M.WorkerMetrics("context", "pdserve-ctx-0", factory=factory, clock=clock, **kw), factory, clock


def _step(ex: FakeExecutor, *, schedule=0.001, forward=0.01, ctx=0, gen=0, pauses=0, finished=0) -> None:
    s = ex.stats
    s.steps += 1
    s.schedule_seconds += schedule
    s.forward_seconds += forward
    s.context_tokens += ctx
    s.generated_tokens += gen
    s.pauses += pauses
    s.finished += finished


# ---------------------------------------------------------------------------- definitions


def test_importing_the_module_loads_no_ray():
    code = "import sys, pdserve.cluster.metrics; print(any(m.split('.')[0] == 'ray' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_metric_definitions_are_well_formed():
    names = [m.name for m in MS.METRICS]
    assert len(names) == len(set(names)) >= 20
    assert tuple(names) == MS.METRIC_NAMES
    for m in MS.METRICS:
        assert re.fullmatch(r"pdserve_[a-z0-9_]+", m.name), m.name
        assert not m.name.endswith("_total"), "Ray appends _total to counters"
        assert m.tag_keys[:2] == (MS.ROLE, MS.WORKER)
        assert m.kind in (MS.COUNTER, MS.GAUGE, MS.HISTOGRAM)
        if m.kind == MS.HISTOGRAM:
            assert list(m.boundaries) == sorted(set(m.boundaries)) and m.boundaries[0] > 0
        else:
            assert m.boundaries == ()
    assert MS.PAUSED_REQUESTS.prometheus_name == "ray_pdserve_paused_requests_total"
    assert MS.KV_BLOCKS_USED.prometheus_name == "ray_pdserve_kv_blocks_used"


def test_metric_objects_are_created_lazily_and_once():
    metrics, factory, _ = _worker()
    assert factory.metrics == {}
    ex = FakeExecutor()
    _step(ex, ctx=8, gen=1)
    metrics.observe(ex)
    _step(ex, gen=1)
    metrics.observe(ex)  # FakeFactory asserts no name is created twice
    assert MS.SCHEDULER_STEP_SECONDS.name in factory.metrics
    assert MS.KV_TRANSFERS.name not in factory.metrics  # nothing transferred yet


# ---------------------------------------------------------------------------- worker deltas


def test_counters_record_deltas_and_histograms_one_value_per_step():
    metrics, factory, _ = _worker()
    ex = FakeExecutor()
    _step(ex, ctx=16, gen=2, pauses=1)
    metrics.observe(ex)
    _step(ex, schedule=0.002, forward=0.02, gen=3, pauses=2, finished=1)
    ex.stats.aborted += 1
    metrics.observe(ex)
    assert factory.calls(MS.PAUSED_REQUESTS, role="context", worker="pdserve-ctx-0") == [1, 2]
    assert factory.calls(MS.FINISHED_REQUESTS, outcome="finished") == [1]
    assert factory.calls(MS.FINISHED_REQUESTS, outcome="aborted") == [1]
    assert factory.calls(MS.TOKENS_PER_STEP, kind="context") == [16]
    assert factory.calls(MS.TOKENS_PER_STEP, kind="generated") == [2, 3]
    assert factory.calls(MS.SCHEDULER_STEP_SECONDS) == [0.001, 0.002]
    assert [round(v, 9) for v in factory.calls(MS.FORWARD_SECONDS)] == [0.01, 0.02]
    # The exact totals, as counters.
    assert factory.calls(MS.SCHEDULER_STEPS) == [1, 1]
    assert factory.calls(MS.TOKENS, kind="context") == [16]
    assert factory.calls(MS.TOKENS, kind="generated") == [2, 3]
    assert [round(v, 9) for v in factory.calls(MS.SCHEDULER_TIME)] == [0.001, 0.002]
    assert [round(v, 9) for v in factory.calls(MS.FORWARD_TIME)] == [0.01, 0.02]


def test_observing_twice_without_a_step_records_nothing_new():
    metrics, factory, clock = _worker()
    ex = FakeExecutor()
    _step(ex, ctx=4, pauses=1)
    metrics.observe(ex)
    before = {name: len(m.calls) for name, m in factory.metrics.items()}
    metrics.observe(ex)
    assert {name: len(m.calls) for name, m in factory.metrics.items()} == before


def test_several_steps_between_observations_are_averaged_into_one():
    metrics, factory, _ = _worker()
    ex = FakeExecutor()
    for _ in range(4):
        _step(ex, schedule=0.004, forward=0.0, gen=2)
    metrics.observe(ex)
    assert [round(v, 9) for v in factory.calls(MS.SCHEDULER_STEP_SECONDS)] == [0.004]
    assert factory.calls(MS.TOKENS_PER_STEP, kind="generated") == [2]
    assert factory.calls(MS.FORWARD_SECONDS) == []  # idle steps ran no forward
    # The counters keep the exact totals the averaged histogram cannot.
    assert factory.calls(MS.SCHEDULER_STEPS) == [4]
    assert factory.calls(MS.TOKENS, kind="generated") == [8]
    assert factory.calls(MS.FORWARD_TIME) == []


def test_a_new_executor_restarts_the_deltas_from_zero():
    metrics, factory, _ = _worker()
    ex = FakeExecutor()
    _step(ex, pauses=5)
    metrics.observe(ex)
    fresh = FakeExecutor()
    _step(fresh, pauses=2)
    metrics.observe(fresh)
    assert factory.calls(MS.PAUSED_REQUESTS) == [5, 2]


def test_transfers_are_recorded_once_each_by_outcome():
    metrics, factory, _ = _worker()
    t = FakeTransceiver()
    ex = FakeExecutor(t)
    t.finish(1, "SENT", 2_000_000, 0.002)
    t.finish(2, "EXPIRED", 0, 30.0)  # counted as a lease that expired, too
    metrics.observe(ex)
    t.finish(3, "SENT", 0, 0.001)  # every block was cached on the generation side
    t.finish(4, "FAILED", 0, 0.5)
    metrics.observe(ex)
    metrics.observe(ex)
    assert factory.calls(MS.KV_TRANSFERS, outcome="SENT") == [1, 1]
    assert factory.calls(MS.KV_TRANSFERS, outcome="EXPIRED") == [1]
    assert factory.calls(MS.KV_TRANSFERS, outcome="FAILED") == [1]
    assert factory.calls(MS.KV_TRANSFER_BYTES) == [2_000_000]
    assert factory.calls(MS.KV_LEASES_EXPIRED) == [1]
    assert factory.calls(MS.KV_TRANSFER_SECONDS) == [0.002, 0.001]  # successful transfers only
    assert factory.calls(MS.KV_TRANSFER_TIME) == [0.002, 0.001]
    assert [round(v, 6) for v in factory.calls(MS.KV_TRANSFER_GBPS)] == [1.0]  # 2 MB / 2 ms


def test_more_new_transfers_than_the_bounded_record_deque_keeps():
    metrics, factory, _ = _worker()
    t = FakeTransceiver(maxlen=3)
    ex = FakeExecutor(t)
    for rid in range(10):
        t.finish(rid, "COMPLETE", 100, 0.001)
    metrics.observe(ex)
    # The bytes counter follows the totals; per-transfer metrics see what the deque kept.
    assert factory.calls(MS.KV_TRANSFER_BYTES) == [1000]
    assert factory.calls(MS.KV_TRANSFERS, outcome="COMPLETE") == [1, 1, 1]
    t.finish(10, "TIMED_OUT", 0, 30.0)
    metrics.observe(ex)
    assert factory.calls(MS.KV_TRANSFERS, outcome="TIMED_OUT") == [1]
    assert len(factory.calls(MS.KV_TRANSFERS)) == 4


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 50), st.integers(0, 2),
                          st.sampled_from(["SENT", "COMPLETE", "FAILED", "EXPIRED"]),
                          st.integers(0, 64), st.sampled_from([0.0, 0.003, 0.0125])), max_size=30),
       st.lists(st.booleans(), max_size=30))
def test_counter_increments_sum_to_the_cumulative_totals(events, observe_after):
    metrics, factory, _ = _worker()
    t = FakeTransceiver()
    ex = FakeExecutor(t)
    for i, (pauses, gen, n_transfers, outcome, ctx, forward) in enumerate(events):
        _step(ex, gen=gen, ctx=ctx, pauses=pauses, forward=forward)
        for _ in range(n_transfers):
            t.finish(i, outcome, 10, 0.01)
        if i < len(observe_after) and observe_after[i]:
            metrics.observe(ex)
    metrics.observe(ex)
    assert sum(factory.calls(MS.PAUSED_REQUESTS)) == ex.stats.pauses
    # Exact totals, whatever the histograms' averaging: tokens by kind, steps, seconds.
    assert sum(factory.calls(MS.TOKENS, kind="context")) == ex.stats.context_tokens
    assert sum(factory.calls(MS.TOKENS, kind="generated")) == ex.stats.generated_tokens
    assert sum(factory.calls(MS.SCHEDULER_STEPS)) == ex.stats.steps
    assert abs(sum(factory.calls(MS.SCHEDULER_TIME)) - ex.stats.schedule_seconds) < 1e-9
    assert abs(sum(factory.calls(MS.FORWARD_TIME)) - ex.stats.forward_seconds) < 1e-9
    assert abs(sum(factory.calls(MS.KV_TRANSFER_TIME)) - t.transfers.seconds) < 1e-9
    assert sum(factory.calls(MS.KV_TRANSFER_BYTES)) == t.transfers.bytes_sent + t.transfers.bytes_received
    assert sum(factory.calls(MS.KV_LEASES_EXPIRED)) == t.transfers.leases_expired
    total_transfers = t.transfers.sent + t.transfers.received + t.transfers.failed
    assert sum(factory.calls(MS.KV_TRANSFERS)) == total_transfers
    for outcome in ("SENT", "COMPLETE", "FAILED", "EXPIRED"):
        expected = sum(r.outcome == outcome for r in t.transfers.records)
        assert sum(factory.calls(MS.KV_TRANSFERS, outcome=outcome)) == expected


# ---------------------------------------------------------------------------- worker gauges


def test_gauges_are_rate_limited_and_states_that_empty_go_to_zero():
    metrics, factory, clock = _worker(gauge_interval_s=0.5)
    t = FakeTransceiver()
    ex = FakeExecutor(t)
    ex.active = [_request(1, S.CONTEXT_INIT), _request(2, S.GENERATION_IN_PROGRESS),
                 _request(3, S.GENERATION_IN_PROGRESS)]
    ex.kv.add_sequence(ex.active[0])
    t.transmitting[9] = _request(9, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)
    t.num_quarantined_blocks = 2
    metrics.observe(ex)
    assert factory.calls(MS.REQUESTS_BY_STATE, state="GENERATION_IN_PROGRESS") == [2]
    assert factory.calls(MS.REQUESTS_BY_STATE, state="DISAGG_CONTEXT_TRANS_IN_PROGRESS") == [1]
    used = ex.kv.get_num_used_blocks()
    assert used > 0
    assert factory.calls(MS.KV_BLOCKS_USED) == [used]
    assert factory.calls(MS.KV_BLOCKS_FREE) == [32 - used]
    assert factory.calls(MS.KV_BLOCKS_CAPACITY) == [32]
    assert factory.calls(MS.KV_BLOCKS_QUARANTINED) == [2]

    ex.active = ex.active[:1]
    clock.now += 0.2
    metrics.observe(ex)  # not due yet
    assert factory.calls(MS.KV_BLOCKS_CAPACITY) == [32]
    clock.now += 0.3
    metrics.observe(ex)  # due
    assert factory.calls(MS.KV_BLOCKS_CAPACITY) == [32, 32]
    assert factory.calls(MS.REQUESTS_BY_STATE, state="GENERATION_IN_PROGRESS") == [2, 0]
    metrics.observe(ex, force=True)
    assert factory.calls(MS.KV_BLOCKS_CAPACITY) == [32, 32, 32]
    assert factory.calls(MS.REQUESTS_BY_STATE, state="CONTEXT_INIT") == [1, 1, 1]


def test_the_step_that_leaves_the_executor_idle_refreshes_the_gauges():
    metrics, factory, clock = _worker(gauge_interval_s=0.5)
    ex = FakeExecutor()
    ex.active = [_request(1, S.GENERATION_IN_PROGRESS)]
    metrics.observe(ex)
    ex.active = []
    ex.has_work = False  # the last request finished in this step; the loop calls no more
    clock.now += 0.1
    metrics.observe(ex)
    assert factory.calls(MS.REQUESTS_BY_STATE, state="GENERATION_IN_PROGRESS") == [1, 0]


def test_ticks_set_every_gauge_again_on_a_timer_while_idle():
    """Ray exports only the gauges set since its last report, and drops one not set for two
    reports: an idle worker's ticks must keep setting them, unchanged values included."""
    metrics, factory, clock = _worker(gauge_interval_s=0.5)
    t = FakeTransceiver()
    ex = FakeExecutor(t)
    ex.has_work = False
    metrics.tick(ex)  # the first tick sets them: exported from the start, before any step
    assert factory.calls(MS.KV_BLOCKS_FREE) == [32]
    for _ in range(3):  # frequent idle ticks: not due, nothing recorded
        clock.now += 0.125
        metrics.tick(ex)
    assert factory.calls(MS.KV_BLOCKS_FREE) == [32]
    clock.now += 0.125
    metrics.tick(ex)  # 0.5 s later: due
    for name in (MS.KV_BLOCKS_FREE, MS.KV_BLOCKS_USED, MS.KV_BLOCKS_CAPACITY, MS.KV_BLOCKS_QUARANTINED):
        assert len(factory.calls(name)) == 2, name
    for _ in range(20):  # 10 idle seconds: set again every 0.5 s
        clock.now += 0.5
        metrics.tick(ex)
    assert factory.calls(MS.KV_BLOCKS_FREE) == [32] * 22
    assert factory.calls(MS.KV_BLOCKS_USED) == [0] * 22


def test_ticks_keep_a_state_that_emptied_at_zero():
    metrics, factory, clock = _worker(gauge_interval_s=0.5)
    ex = FakeExecutor()
    ex.active = [_request(1, S.GENERATION_IN_PROGRESS)]
    metrics.observe(ex)
    ex.active, ex.has_work = [], False
    clock.now += 0.1
    metrics.observe(ex)  # the step that left it idle
    for _ in range(3):
        clock.now += 0.5
        metrics.tick(ex)
    assert factory.calls(MS.REQUESTS_BY_STATE, state="GENERATION_IN_PROGRESS") == [1, 0, 0, 0, 0]


def test_steps_and_ticks_share_one_gauge_timer():
    metrics, factory, clock = _worker(gauge_interval_s=0.5)
    ex = FakeExecutor()
    metrics.observe(ex)
    clock.now += 0.3
    metrics.tick(ex)  # a step set them 0.3 s ago: not due
    assert len(factory.calls(MS.KV_BLOCKS_FREE)) == 1
    clock.now += 0.2
    metrics.tick(ex)
    clock.now += 0.1
    metrics.observe(ex)  # the tick set them 0.1 s ago, and the engine core still has work
    assert len(factory.calls(MS.KV_BLOCKS_FREE)) == 2


def test_gauges_from_the_executor_count_live_requests_and_blocks():
    t = FakeTransceiver()
    ex = FakeExecutor(t)
    ex.waiting = [_request(1, S.CONTEXT_INIT)]
    ex.kv.add_sequence(ex.waiting[0])
    t.draining[4] = _request(4, S.DISAGG_GENERATION_TRANS_IN_PROGRESS)
    t.num_quarantined_blocks = 3
    free = ex.kv.get_num_free_blocks()
    assert M.gauges_from_core(ex) == M.WorkerGauges(
        {"CONTEXT_INIT": 1, "DISAGG_GENERATION_TRANS_IN_PROGRESS": 1}, 32 - free, free, 32, 3)


# ---------------------------------------------------------------------------- router


def test_router_metrics_tag_every_event():
    factory = FakeFactory()
    router = M.RouterMetrics(factory=factory)
    assert factory.metrics == {}
    router.set_queue_depth(3)
    router.set_queue_depth(0)
    router.set_in_flight(2)
    router.count_request("completed")
    router.count_request("failed")
    router.count_request("completed")
    router.count_prefill(local=True)
    router.count_prefill(local=False)
    router.count_retries()
    router.count_retries(0)  # nothing to count: no call (Ray rejects 0)
    router.observe_queue_time(0.01)
    router.observe_ttft(0.05)
    router.observe_e2e(1.5)
    # Buffered off the request path until flush: then gauges give their last value, counters
    # their sum, histograms every observation.
    assert all(not factory.calls(spec) for spec in (MS.ROUTER_QUEUE_DEPTH, MS.ROUTER_REQUESTS,
                                                     MS.ROUTER_TTFT_SECONDS))
    router.flush()
    tags = dict(role="router", worker="pdserve-router")
    assert factory.calls(MS.ROUTER_QUEUE_DEPTH, **tags) == [0]
    assert factory.calls(MS.ROUTER_IN_FLIGHT) == [2]
    assert factory.calls(MS.ROUTER_REQUESTS, outcome="completed") == [2]
    assert factory.calls(MS.ROUTER_REQUESTS, outcome="failed") == [1]
    assert factory.calls(MS.ROUTER_PREFILLS, kind="local") == [1]
    assert factory.calls(MS.ROUTER_PREFILLS, kind="remote") == [1]
    assert factory.calls(MS.ROUTER_RETRIES, **tags) == [1]
    assert factory.calls(MS.ROUTER_QUEUE_SECONDS) == [0.01]
    assert factory.calls(MS.ROUTER_TTFT_SECONDS) == [0.05]
    assert factory.calls(M.ROUTER_E2E_SECONDS) == [1.5]
    router.observe_ttft(0.07)
    router.flush()
    router.flush()  # no new event: counters and histograms record nothing twice
    assert factory.calls(MS.ROUTER_TTFT_SECONDS) == [0.05, 0.07]
    assert factory.calls(MS.ROUTER_REQUESTS, outcome="completed") == [2]
    # ... but every flush sets every gauge's last value again (Ray drops a gauge not re-set).
    assert factory.calls(MS.ROUTER_QUEUE_DEPTH) == [0, 0, 0]
    assert factory.calls(MS.ROUTER_IN_FLIGHT) == [2, 2, 2]


def test_router_gauges_start_at_zero_and_are_set_at_every_flush():
    factory = FakeFactory()
    router = M.RouterMetrics(factory=factory)
    router.flush()  # before any request: exported as 0
    assert factory.calls(MS.ROUTER_QUEUE_DEPTH, role="router", worker="pdserve-router") == [0]
    assert factory.calls(MS.ROUTER_IN_FLIGHT) == [0]
    router.set_queue_depth(5)
    router.flush()
    router.set_in_flight(3)
    for _ in range(3):
        router.flush()
    assert factory.calls(MS.ROUTER_QUEUE_DEPTH) == [0, 5, 5, 5, 5]
    assert factory.calls(MS.ROUTER_IN_FLIGHT) == [0, 0, 3, 3, 3]


def test_router_counts_kv_paths_by_kind():
    factory = FakeFactory()
    router = M.RouterMetrics(factory=factory)
    for kind in ("transferred", "transferred", "local_prefill", "prefix_cached", "context_finished",
                 "failed", "transferred"):
        router.count_kv_path(kind)
    assert factory.calls(MS.ROUTER_KV_PATHS) == []  # buffered until flush
    router.flush()
    tags = dict(role="router", worker="pdserve-router")
    assert factory.calls(MS.ROUTER_KV_PATHS, kind="transferred", **tags) == [3]
    for kind in ("local_prefill", "prefix_cached", "context_finished", "failed"):
        assert factory.calls(MS.ROUTER_KV_PATHS, kind=kind) == [1]
    assert set(MS.KV_PATH_KINDS) == {"transferred", "local_prefill", "prefix_cached",
                                    "context_finished", "failed"}
    assert MS.ROUTER_KV_PATHS.kind == MS.COUNTER and MS.ROUTER_KV_PATHS.tag_keys == (MS.ROLE, MS.WORKER, MS.KIND)
    assert MS.ROUTER_KV_PATHS.prometheus_name == "ray_pdserve_router_kv_paths_total"
    try:
        router.count_kv_path("teleported")
    except ValueError:
        return
    raise AssertionError("an unknown KV path kind was accepted")


def test_every_summed_figure_has_an_exact_counter():
    """A Ray histogram's _sum is made of bucket midpoints: each histogram whose total matters
    has a counter that keeps it exactly."""
    pairs = {MS.TOKENS_PER_STEP: MS.TOKENS, MS.SCHEDULER_STEP_SECONDS: MS.SCHEDULER_TIME,
             MS.FORWARD_SECONDS: MS.FORWARD_TIME, MS.KV_TRANSFER_SECONDS: MS.KV_TRANSFER_TIME}
    for hist, counter in pairs.items():
        assert hist.kind == MS.HISTOGRAM and counter.kind == MS.COUNTER
        assert counter.tag_keys == hist.tag_keys
        assert hist.name in counter.description
    assert MS.SCHEDULER_STEPS.kind == MS.COUNTER


def test_tag_values_must_be_strings():
    try:
        M.WorkerMetrics("context", 0, factory=FakeFactory())  # type: ignore[arg-type]
    except TypeError:
        return
    raise AssertionError("a non-string worker id was accepted")


def test_state_names_are_every_llm_request_state():
    from pdserve.cluster import metric_specs as MS
    from pdserve.scheduler import LlmRequestState

    assert set(MS._STATE_NAMES) == {s.name for s in LlmRequestState}

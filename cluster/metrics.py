"""How pdserve records its metrics (the metrics themselves: ``metric_specs.py``).

Gauges must be re-set, not just set. What Ray 2.60 does (OpenTelemetry export, the default),
measured with a gauge set once in an actor: the process exports to its node's metrics agent
every ``metrics_report_interval_ms`` (10 s by default, at least 1 s) only the gauge values
*recorded since its previous export*, and the agent drops a gauge series that has not been
refreshed for 2 report intervals. A gauge set once was on the endpoint for ~2 s at a 1 s
interval and ~20 s at the default 10 s, then vanished, while counters and histograms (cumulative)
stay. So a worker that went idle, whose gauges were only set after steps, lost its KV and
request gauges from Prometheus a few seconds after the load stopped. Hence the timers:

- ``WorkerMetrics(role, worker)``: a worker actor calls ``observe(core)`` after every
  core step and ``tick(core)`` every turn of the ``WorkerHost`` loop (at least every
  ``idle_wait_s``, idle included). Counters and
  histograms come from the deltas of the engine core's cumulative ``EngineStats`` and of the
  transport's ``TransferLog`` (the transceiver's ``transfers``); gauges (requests per state, KV
  blocks) are set again, changed or not, whenever ``gauge_interval_s`` (0.5 s) has passed,
  from ``observe`` or ``tick``, and always after the step that leaves the engine core idle
  (``not core.has_work``); ``force=True`` sets them at once. A tick that is not due costs
  one clock read. While a step is stuck the ticks stop, and so, after 2 report intervals, do
  the worker's gauges.
- ``RouterMetrics()``: the router calls one method per event (queue change, first token,
  finish); events are buffered and handed to Ray by ``flush``, which the router calls every
  ``status_refresh_s`` (0.5 s). ``flush`` sets every gauge's last value again each time, so the
  router's gauges stay exported while it is up; they start at 0.

Importing this module does not import Ray: metric objects are created on first use, in the
process that records them (a Ray metric object must be created where Ray is initialised). Tests
pass a fake ``MetricsFactory`` through the constructors.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pdserve.scheduler import lifecycle

if TYPE_CHECKING:
    from pdserve.transport.sessions import TransferLog, TransferRecord
    from pdserve.workers.engine.core import EngineCore
    from pdserve.workers.engine.state import EngineStats

from .metric_specs import (
    COUNTER,
    FINISHED_REQUESTS,
    FORWARD_SECONDS,
    FORWARD_TIME,
    GAUGE,
    KIND,
    KV_BLOCKS_CAPACITY,
    KV_BLOCKS_FREE,
    KV_BLOCKS_QUARANTINED,
    KV_BLOCKS_USED,
    KV_LEASES_EXPIRED,
    KV_PATH_KINDS,
    KV_TRANSFERS,
    KV_TRANSFER_BYTES,
    KV_TRANSFER_GBPS,
    KV_TRANSFER_SECONDS,
    KV_TRANSFER_TIME,
    MetricSpec,
    OK_OUTCOMES,
    OUTCOME,
    PAUSED_REQUESTS,
    REQUESTS_BY_STATE,
    ROLE,
    ROUTER_IN_FLIGHT,
    ROUTER_E2E_SECONDS,
    ROUTER_FALLBACKS,
    ROUTER_KV_PATHS,
    ROUTER_PREFILLS,
    ROUTER_PREFIX_PREDICTED_TOKENS,
    ROUTER_PREFIX_PREDICTIONS,
    ROUTER_PREFIX_REUSED_TOKENS,
    ROUTER_QUEUE_DEPTH,
    ROUTER_QUEUE_SECONDS,
    ROUTER_REQUESTS,
    ROUTER_RETRIES,
    ROUTER_TTFT_SECONDS,
    SCHEDULER_STEPS,
    SCHEDULER_STEP_SECONDS,
    SCHEDULER_TIME,
    STATE,
    TOKENS,
    TOKENS_PER_STEP,
    UNEXPECTED_RECOMPUTES,
    WORKER,
    _STATE_NAMES,
)

# ---------------------------------------------------------------------------- metric objects


class MetricsFactory(Protocol):
    """Creates metric objects with ray.util.metrics' signatures and record methods
    (``inc(value, tags)``, ``set(value, tags)``, ``observe(value, tags)``)."""

    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...
    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any: ...
    def histogram(self, name: str, description: str, boundaries: list[float],
                  tag_keys: tuple[str, ...]) -> Any: ...


class RayMetricsFactory:
    def counter(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Counter

        return Counter(name, description, tag_keys)

    def gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Gauge

        return Gauge(name, description, tag_keys)

    def histogram(self, name: str, description: str, boundaries: list[float],
                  tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Histogram

        return Histogram(name, description, boundaries, tag_keys)


class MetricRegistry:
    """One metric object per name per process, created on first use."""

    def __init__(self, factory: MetricsFactory) -> None:
        self.factory = factory
        self._objects: dict[str, Any] = {}

    def get(self, spec: MetricSpec) -> Any:
        obj = self._objects.get(spec.name)
        if obj is None:
            f = self.factory
            if spec.kind == COUNTER:
                obj = f.counter(spec.name, spec.description, spec.tag_keys)
            elif spec.kind == GAUGE:
                obj = f.gauge(spec.name, spec.description, spec.tag_keys)
            else:
                obj = f.histogram(spec.name, spec.description, list(spec.boundaries), spec.tag_keys)
            self._objects[spec.name] = obj
        return obj


_ray_registry: MetricRegistry | None = None


def _registry(factory: MetricsFactory | None) -> MetricRegistry:
    global _ray_registry
    if factory is not None:
        return MetricRegistry(factory)
    if _ray_registry is None:
        _ray_registry = MetricRegistry(RayMetricsFactory())
    return _ray_registry


class _Recorder:
    """Tags cached per (key, value) so a record is a dict lookup and one metric call."""

    def __init__(self, role: str, worker_id: str, factory: MetricsFactory | None) -> None:
        if not isinstance(role, str) or not isinstance(worker_id, str):
            raise TypeError("role and worker_id must be str (Ray tag values are strings)")
        self.role = role
        self.worker_id = worker_id
        self._registry = _registry(factory)
        self._tags = {ROLE: role, WORKER: worker_id}
        self._extra_tags: dict[tuple[str, str], dict[str, str]] = {}

    def _tags_with(self, key: str, value: str) -> dict[str, str]:
        tags = self._extra_tags.get((key, value))
        if tags is None:
            tags = self._extra_tags[(key, value)] = {**self._tags, key: value}
        return tags

    def _inc(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:  # Ray counters reject increments <= 0
            self._registry.get(spec).inc(value, tags or self._tags)

    def _set(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        self._registry.get(spec).set(value, tags or self._tags)

    def _observe(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        if math.isfinite(value):
            self._registry.get(spec).observe(value, tags or self._tags)


# ---------------------------------------------------------------------------- workers


class WorkerGauges(NamedTuple):
    requests_by_state: Mapping[str, int]
    used_blocks: int
    free_blocks: int
    total_blocks: int
    quarantined_blocks: int


def gauges_from_core(core: EngineCore) -> WorkerGauges:
    """The gauge values without ``EngineCore.status()``'s invariant checks and transfer summary."""
    t = core.transceiver
    handed_over = (t.transmitting, t.draining) if t is not None else ()
    by_state = lifecycle.count_by_state(
        lifecycle.live_requests(core.active, core.waiting, *handed_over).values())
    kv = core.kv
    free = kv.get_num_free_blocks()
    return WorkerGauges(by_state, kv.num_blocks - free, free, kv.num_blocks,
                        t.num_quarantined_blocks if t is not None else 0)


class _Counters(NamedTuple):
    steps: int
    schedule_seconds: float
    forward_seconds: float
    context_tokens: int
    generated_tokens: int
    pauses: int
    finished: int
    aborted: int
    transfers: int  # records appended: sent + received + failed
    transfer_bytes: int
    transfer_seconds: float  # successful transfers only
    leases_expired: int
    unexpected_recomputes: int


_ZERO = _Counters(0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0)


class WorkerMetrics(_Recorder):
    """Records one worker's metrics. Not thread-safe: call from the engine core's loop thread."""

    def __init__(
        self,
        role: str,
        worker_id: str,
        *,
        factory: MetricsFactory | None = None,
        gauge_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(role, worker_id, factory)
        self.gauge_interval_s = gauge_interval_s
        self._clock = clock
        self._last = _ZERO
        self._next_gauges_at = -math.inf
        # Every state is exported, 0 when no request is in it, so the series exist from the
        # first refresh (a burst shorter than one refresh interval would otherwise leave none).
        self._states_reported: set[str] = set(_STATE_NAMES)

    def observe(self, core: EngineCore, *, force: bool = False) -> None:
        """After each step: counter/histogram deltas always; gauges when due, when the engine core
        has no work left, or with ``force``."""
        t = core.transceiver
        self.observe_stats(core.stats, t.transfers if t is not None else None)
        # The step that leaves the engine core idle always refreshes (its values changed).
        self.tick(core, force=force or not core.has_work)

    def tick(self, core: EngineCore, *, force: bool = False) -> None:
        """Every loop turn, idle included (from the WorkerHost loop): set every gauge again when
        ``gauge_interval_s`` has passed, so Ray keeps exporting them (see the module docstring).
        Not due: one clock read."""
        now = self._clock()
        if force or now >= self._next_gauges_at:
            self._next_gauges_at = now + self.gauge_interval_s
            self.observe_gauges(gauges_from_core(core))

    def observe_stats(self, stats: EngineStats, transfer_stats: TransferLog | None = None) -> None:
        """Record what the cumulative counters gained since the previous call. Several steps
        since the previous call are recorded as one step of their average (call once per step
        for exact histograms). A counter that went backwards (a new core) restarts from 0."""
        ts = transfer_stats
        cur = _Counters(
            stats.steps, stats.schedule_seconds, stats.forward_seconds, stats.context_tokens,
            stats.generated_tokens, stats.pauses, stats.finished, stats.aborted,
            (ts.sent + ts.received + ts.failed) if ts is not None else 0,
            (ts.bytes_sent + ts.bytes_received) if ts is not None else 0,
            ts.seconds if ts is not None else 0.0,
            ts.leases_expired if ts is not None else 0,
            stats.unexpected_recomputes,
        )
        last = self._last
        if cur == last:
            return
        d = _Counters(*(c - p if c >= p else c for c, p in zip(cur, last)))
        self._last = cur

        self._inc(SCHEDULER_STEPS, d.steps)
        self._inc(SCHEDULER_TIME, d.schedule_seconds)
        self._inc(FORWARD_TIME, d.forward_seconds)
        self._inc(TOKENS, d.context_tokens, self._tags_with(KIND, "context"))
        self._inc(TOKENS, d.generated_tokens, self._tags_with(KIND, "generated"))
        if d.steps > 0:
            self._observe(SCHEDULER_STEP_SECONDS, d.schedule_seconds / d.steps)
            if d.forward_seconds > 0:  # steps with nothing to run do no forward
                self._observe(FORWARD_SECONDS, d.forward_seconds / d.steps)
            if d.context_tokens > 0:
                self._observe(TOKENS_PER_STEP, d.context_tokens / d.steps, self._tags_with(KIND, "context"))
            if d.generated_tokens > 0:
                self._observe(TOKENS_PER_STEP, d.generated_tokens / d.steps, self._tags_with(KIND, "generated"))
        self._inc(PAUSED_REQUESTS, d.pauses)
        self._inc(FINISHED_REQUESTS, d.finished, self._tags_with(OUTCOME, "finished"))
        self._inc(FINISHED_REQUESTS, d.aborted, self._tags_with(OUTCOME, "aborted"))
        self._inc(KV_TRANSFER_BYTES, d.transfer_bytes)
        self._inc(KV_TRANSFER_TIME, d.transfer_seconds)
        self._inc(KV_LEASES_EXPIRED, d.leases_expired)
        self._inc(UNEXPECTED_RECOMPUTES, d.unexpected_recomputes)
        if d.transfers > 0 and ts is not None:
            records = ts.records  # bounded deque: only its newest entries can be new
            for i in range(len(records) - min(d.transfers, len(records)), len(records)):
                self._observe_transfer(records[i])

    def _observe_transfer(self, record: TransferRecord) -> None:
        self._inc(KV_TRANSFERS, 1, self._tags_with(OUTCOME, record.outcome))
        if record.outcome in OK_OUTCOMES:
            self._observe(KV_TRANSFER_SECONDS, record.seconds)
            if record.nbytes > 0 and record.seconds > 0:
                self._observe(KV_TRANSFER_GBPS, record.nbytes / record.seconds / 1e9)

    def observe_gauges(self, gauges: WorkerGauges) -> None:
        """Set every gauge now; a state no longer present is set to 0, not left stale."""
        for state, n in gauges.requests_by_state.items():
            self._set(REQUESTS_BY_STATE, n, self._tags_with(STATE, state))
        for state in self._states_reported.difference(gauges.requests_by_state):
            self._set(REQUESTS_BY_STATE, 0, self._tags_with(STATE, state))
        self._states_reported.update(gauges.requests_by_state)
        self._set(KV_BLOCKS_USED, gauges.used_blocks)
        self._set(KV_BLOCKS_FREE, gauges.free_blocks)
        self._set(KV_BLOCKS_CAPACITY, gauges.total_blocks)
        self._set(KV_BLOCKS_QUARANTINED, gauges.quarantined_blocks)


# ---------------------------------------------------------------------------- router


class RouterMetrics(_Recorder):
    """Records the router's metrics. Events are buffered and handed to Ray by ``flush`` (the
    router calls it from its status refresh, every status_refresh_s): a Ray metric call costs
    tens of microseconds, and a request records about ten, so recording them inline would add
    a noticeable share of a 1-token request's latency. Every ``flush`` sets every gauge's last
    value again (Ray drops a gauge that is not re-set; see the module docstring); the gauges
    start at 0. Not thread-safe: one event loop owns it."""

    def __init__(self, router_id: str = "pdserve-router", *, factory: MetricsFactory | None = None) -> None:
        super().__init__("router", router_id, factory)
        self._counts: dict[tuple[str, tuple], list] = {}  # name, tags -> [spec, tags, sum]
        self._gauges: dict[tuple[str, tuple], list] = {}  # name, tags -> [spec, tags, last value]
        self._observations: list[tuple[MetricSpec, dict[str, str], float]] = []
        self.set_queue_depth(0)
        self.set_in_flight(0)

    def _inc(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        tags = tags or self._tags
        entry = self._counts.setdefault((spec.name, tuple(tags.items())), [spec, tags, 0.0])
        entry[2] += value

    def _set(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        tags = tags or self._tags
        self._gauges[(spec.name, tuple(tags.items()))] = [spec, tags, value]

    def _observe(self, spec: MetricSpec, value: float, tags: dict[str, str] | None = None) -> None:
        self._observations.append((spec, tags or self._tags, value))

    def flush(self) -> None:
        """Hands the buffered counts and observations to Ray, and sets every gauge (kept, not
        cleared: each flush re-sets all of them, changed or not)."""
        counts, observations = self._counts, self._observations
        self._counts, self._observations = {}, []
        for spec, tags, total in counts.values():
            _Recorder._inc(self, spec, total, tags)
        for spec, tags, value in list(self._gauges.values()):
            _Recorder._set(self, spec, value, tags)
        for spec, tags, value in observations:
            _Recorder._observe(self, spec, value, tags)

    def set_queue_depth(self, depth: int) -> None:
        self._set(ROUTER_QUEUE_DEPTH, depth)

    def set_in_flight(self, count: int) -> None:
        self._set(ROUTER_IN_FLIGHT, count)

    def count_request(self, outcome: str) -> None:
        """outcome: completed | failed | aborted | rejected (RouterTotals' names)."""
        self._inc(ROUTER_REQUESTS, 1, self._tags_with(OUTCOME, outcome))

    def count_prefill(self, *, local: bool) -> None:
        self._inc(ROUTER_PREFILLS, 1, self._tags_with(KIND, "local" if local else "remote"))

    def count_fallback(self, *, local: bool) -> None:
        self._inc(ROUTER_FALLBACKS, 1, self._tags_with(KIND, "local" if local else "pair"))

    def count_retries(self, n: int = 1) -> None:
        self._inc(ROUTER_RETRIES, n)

    def count_kv_path(self, kind: str) -> None:
        """How a finished request's KV reached its generation worker; kind: one of
        ``KV_PATH_KINDS`` (transferred | local_prefill | prefix_cached | context_finished |
        failed)."""
        if kind not in KV_PATH_KINDS:
            raise ValueError(f"unknown KV path kind {kind!r}; expected one of {KV_PATH_KINDS}")
        self._inc(ROUTER_KV_PATHS, 1, self._tags_with(KIND, kind))

    def count_prefix_prediction(self, predicted_tokens: int, reused_tokens: int) -> None:
        """The prefix index's prediction for a completed request's prefill worker against what
        that worker reported it reused."""
        outcome = ("exact" if predicted_tokens == reused_tokens
                   else "over" if predicted_tokens > reused_tokens else "under")
        self._inc(ROUTER_PREFIX_PREDICTIONS, 1, self._tags_with(OUTCOME, outcome))
        self._inc(ROUTER_PREFIX_PREDICTED_TOKENS, predicted_tokens)
        self._inc(ROUTER_PREFIX_REUSED_TOKENS, reused_tokens)

    def observe_queue_time(self, seconds: float) -> None:
        self._observe(ROUTER_QUEUE_SECONDS, seconds)

    def observe_ttft(self, seconds: float) -> None:
        self._observe(ROUTER_TTFT_SECONDS, seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._observe(ROUTER_E2E_SECONDS, seconds)

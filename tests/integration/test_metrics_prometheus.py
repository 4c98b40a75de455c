"""pdserve metrics reach Ray's Prometheus endpoint as ray_pdserve_* with their tags and values.

Starts its own local Ray (metrics reported every second), records a worker's and the router's
metrics inside an actor, and polls the node's /metrics endpoint (bounded) until they appear.
The actor keeps setting the gauges every half second, as the workers' tick hook and the router's
flush do: Ray exports only the gauges set since its last report and drops one that has not been
set for 2 report intervals (cluster/metrics.py).
Ray 2.60's token auth covers its gRPC/dashboard APIs; the Prometheus endpoint is plain HTTP, but
if it ever answers 401/403 the poll retries with the cluster token as a bearer token.
"""
from __future__ import annotations

import math
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_session import free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKER_ID = f"pdserve-ctx-metrics-{os.getpid()}"  # unique: other Ray sessions may share the host
ROUTER_ID = f"pdserve-router-metrics-{os.getpid()}"


@pytest.fixture(scope="module")
def ray_metrics_port():
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    assert not ray.is_initialized()
    # address="local": always a fresh instance of our own, never a cluster someone else runs.
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _metrics_export_port=free_port(), log_to_driver=False)
    try:
        ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
        assert len(ports) == 1
        yield ports[0]
    finally:
        ray.shutdown()


def _record_metrics(worker_id: str, router_id: str):
    """Records one set of events; returns the (worker, gauges, router) that keep the gauges."""
    from pdserve.cluster.metrics import RouterMetrics, WorkerGauges, WorkerMetrics
    from pdserve.transport.sessions import TransferLog, TransferRecord
    from pdserve.workers.engine.state import EngineStats

    worker = WorkerMetrics("context", worker_id)
    stats, ts = EngineStats(), TransferLog()
    stats.steps, stats.schedule_seconds, stats.forward_seconds = 1, 0.002, 0.02
    stats.context_tokens, stats.generated_tokens, stats.pauses = 64, 1, 1
    worker.observe_stats(stats, ts)
    stats.steps, stats.schedule_seconds, stats.forward_seconds = 2, 0.004, 0.04
    stats.generated_tokens, stats.pauses = 3, 3
    # sent 2, failed 1 (an expired lease), 3 MB in 0.006 s
    ts.add(TransferRecord(0, 1, "gen-0", 1_000_000, 0.003, "SENT", "", "send"), ok=True)
    ts.add(TransferRecord(1, 2, "gen-0", 2_000_000, 0.003, "SENT", "", "send"), ok=True)
    ts.add(TransferRecord(-1, 3, "", 0, 30.0, "EXPIRED", "lease", "send"), ok=False)
    worker.observe_stats(stats, ts)
    gauges = WorkerGauges({"GENERATION_IN_PROGRESS": 2, "CONTEXT_INIT": 1}, 5, 27, 32, 0)
    worker.observe_gauges(gauges)

    router = RouterMetrics(router_id)
    router.set_queue_depth(4)
    router.count_request("completed")
    router.count_request("completed")
    router.count_request("aborted")
    router.count_retries()
    router.observe_ttft(0.2)
    router.observe_e2e(1.2)
    router.count_kv_path("transferred")
    router.count_kv_path("transferred")
    router.count_kv_path("failed")
    router.flush()
    return worker, gauges, router


def _scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        return urllib.request.urlopen(url, timeout=5).read().decode()
    except urllib.error.HTTPError as err:
        if err.code not in (401, 403):
            raise
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    return urllib.request.urlopen(request, timeout=5).read().decode()


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_pdserve_") and s.labels.get("worker") in (WORKER_ID, ROUTER_ID):
                keep = {k: v for k, v in s.labels.items() if k in ("role", "worker", "outcome", "state", "kind", "le")}
                out[(s.name, frozenset(keep.items()))] = s.value
    return out


def test_pdserve_metrics_are_exported_with_tags(ray_metrics_port):
    import ray

    @ray.remote(num_cpus=0)
    class Recorder:
        def record(self) -> None:
            import threading

            worker, gauges, router = _record_metrics(WORKER_ID, ROUTER_ID)

            def keep_gauges() -> None:  # what the worker's tick hook and the router's flush do
                while True:
                    time.sleep(0.5)
                    worker.observe_gauges(gauges)
                    router.flush()

            threading.Thread(target=keep_gauges, daemon=True).start()

    recorder = Recorder.options(name="pdserve-metrics-test").remote()
    ray.get(recorder.record.remote(), timeout=60)

    w = {"role": "context", "worker": WORKER_ID}
    r = {"role": "router", "worker": ROUTER_ID}

    def key(name: str, tags: dict, **extra: str) -> tuple[str, frozenset]:
        return name, frozenset({**tags, **extra}.items())

    expected = {
        key("ray_pdserve_paused_requests_total", w): 3.0,
        key("ray_pdserve_kv_transfers_total", w, outcome="SENT"): 2.0,
        key("ray_pdserve_kv_transfers_total", w, outcome="EXPIRED"): 1.0,
        key("ray_pdserve_kv_transfer_bytes_total", w): 3_000_000.0,
        key("ray_pdserve_kv_leases_expired_total", w): 1.0,
        key("ray_pdserve_kv_transfer_time_seconds_total", w): 0.006,
        key("ray_pdserve_scheduler_steps_total", w): 2.0,
        key("ray_pdserve_scheduler_time_seconds_total", w): 0.004,
        key("ray_pdserve_forward_time_seconds_total", w): 0.04,
        key("ray_pdserve_tokens_total", w, kind="context"): 64.0,
        key("ray_pdserve_tokens_total", w, kind="generated"): 3.0,
        key("ray_pdserve_kv_transfer_seconds_count", w): 2.0,
        key("ray_pdserve_scheduler_step_seconds_count", w): 2.0,
        key("ray_pdserve_forward_seconds_count", w): 2.0,
        key("ray_pdserve_tokens_per_step_count", w, kind="generated"): 2.0,
        key("ray_pdserve_tokens_per_step_bucket", w, kind="context", le="64.0"): 1.0,
        key("ray_pdserve_tokens_per_step_bucket", w, kind="context", le="32.0"): 0.0,
        key("ray_pdserve_requests", w, state="GENERATION_IN_PROGRESS"): 2.0,
        key("ray_pdserve_requests", w, state="CONTEXT_INIT"): 1.0,
        key("ray_pdserve_kv_blocks_used", w): 5.0,
        key("ray_pdserve_kv_blocks_free", w): 27.0,
        key("ray_pdserve_kv_blocks_capacity", w): 32.0,
        key("ray_pdserve_kv_blocks_quarantined", w): 0.0,
        key("ray_pdserve_router_queue_depth", r): 4.0,
        key("ray_pdserve_router_in_flight", r): 0.0,  # never set: the router starts it at 0
        key("ray_pdserve_router_kv_paths_total", r, kind="transferred"): 2.0,
        key("ray_pdserve_router_kv_paths_total", r, kind="failed"): 1.0,
        key("ray_pdserve_router_requests_total", r, outcome="completed"): 2.0,
        key("ray_pdserve_router_requests_total", r, outcome="aborted"): 1.0,
        key("ray_pdserve_router_retries_total", r): 1.0,
        key("ray_pdserve_router_ttft_seconds_count", r): 1.0,
        key("ray_pdserve_router_e2e_seconds_bucket", r, le="2.5"): 1.0,
        key("ray_pdserve_router_e2e_seconds_bucket", r, le="1.0"): 0.0,
    }
    seen: dict = {}
    deadline = time.monotonic() + 45  # reports go out every second; allow for a loaded host
    while time.monotonic() < deadline:
        try:
            seen = _samples(_scrape(ray_metrics_port))
        except (urllib.error.URLError, ConnectionError):
            seen = {}
        if all(k in seen for k in expected):
            break
        time.sleep(1.0)
    missing = sorted(name + str(sorted(tags)) for (name, tags) in expected if (name, tags) not in seen)
    assert not missing, f"not exported within 45 s: {missing}"
    wrong = {k: (seen[k], v) for k, v in expected.items() if not math.isclose(seen[k], v, rel_tol=1e-9)}
    assert not wrong, f"(exported, expected): {wrong}"

    # Re-set every half second, the gauges outlive Ray's 2-report-interval eviction (~2 s here).
    time.sleep(5.0)
    later = {}
    deadline = time.monotonic() + 30
    gauges = [k for k in expected if not k[0].endswith(("_total", "_count")) and "_bucket" not in k[0]]
    assert len(gauges) >= 8
    while time.monotonic() < deadline:
        try:
            later = _samples(_scrape(ray_metrics_port))
        except (urllib.error.URLError, ConnectionError):
            later = {}
        if all(later.get(k) == expected[k] for k in gauges):
            break
        time.sleep(1.0)
    gone = sorted(name + str(sorted(tags)) for (name, tags) in gauges if (name, tags) not in later)
    assert not gone, f"gauges no longer exported after 5 s: {gone}"

"""pdserve's metrics through a real Prometheus, and gauges that outlive the load.

One real pdserve cluster (1 context, 1 generation worker with a KV pool small enough that
MAX_UTILIZATION pauses requests) on the module's Ray (conftest ``clusters``; Ray reports metrics
every second: RAY_metrics_report_interval_ms=1000 is set before Ray starts).

- ``test_prometheus_scrapes_pdserve_through_rays_service_discovery``: starts the ``prometheus``
  binary (Debian's ``prometheus`` package) on a free 127.0.0.1 port, with a temporary storage
  dir and a config that reads the session's ``prom_metrics_service_discovery.json`` (written by
  Ray's dashboard into the session dir, 1 s scrape interval), runs requests under KV pressure
  (KV transfers and pauses), and queries Prometheus's HTTP API until the ``ray_pdserve_*``
  series agree with what the router's GetClusterStatus reports, tagged with the Ray actor names.
  Then every PromQL expression of deploy/grafana/pdserve-dashboard.json must run, name only
  series Prometheus has (or ones only a fault records), and return data when it can. Skipped
  when there is no ``prometheus`` on PATH, unless PDSERVE_REQUIRE_PROMETHEUS=1 (CI), which makes
  that a failure.
- ``test_gauges_are_still_exported_long_after_the_load``: 30 s after the last request, the
  workers' and the router's gauges are still on Ray's own Prometheus endpoint (Ray drops a gauge
  that is not re-set within 2 report intervals; see cluster/metrics.py).

Every wait is bounded; nothing is timed.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # before the module's Ray starts
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
# A Ray of its own (conftest), started after RAY_metrics_report_interval_ms is set above.
OWN_RAY = True

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
# As test_cluster.py's pause test: 12 disaggregated requests against a 24-block generation pool.
ENGINE = dict(tokens_per_block=4, max_batch_size=8, max_num_tokens=64,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=8, num_kv_blocks=256)
GEN_BLOCKS = 24
NUM_REQUESTS, MAX_TOKENS = 12, 24
CTX, GEN, ROUTER = "pdserve-ctx-0", "pdserve-gen-0", "pdserve-router"
# Series that only a fault (or a caller not wired yet) records: a dashboard query may name them
# although Prometheus has never seen them (Ray exports a counter from its first increment).
ONLY_ON_FAULTS = frozenset({"ray_pdserve_kv_leases_expired_total", "ray_pdserve_router_retries_total",
                            "ray_pdserve_router_kv_paths_total", "ray_pdserve_unexpected_recomputes_total",
                            "ray_pdserve_router_fallbacks_total"})
SHARED = list(range(200, 208))  # two blocks every prompt starts with, so the prefix counters move
GAUGE_WAIT_S = 30.0


def _report_interval_s() -> float:
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000.0


# ---------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def loaded(clusters):
    """The cluster after a burst of requests under KV pressure, drained: (cluster, status,
    time.monotonic() when the last request ended)."""
    import cluster_util as U

    cl = clusters(engine=ENGINE, generation_engine=dict(capacity_scheduler_policy="MAX_UTILIZATION",
                                                        num_kv_blocks=GEN_BLOCKS))
    # One request first, so the shared blocks are cached (and in the router's index) before the
    # burst: its requests are predicted to reuse them.
    warm = U.burst(cl, "prom-warm", [SHARED + [7, 8, 9]], MAX_TOKENS)
    results = warm + U.burst(cl, "prom", [SHARED + p for p in U.prompts(NUM_REQUESTS, seed=1)], MAX_TOKENS)
    load_end = time.monotonic()
    assert all(r.code is None and r.last is not None for r in results), \
        [(r.request_id, r.code, r.details) for r in results if r.code is not None]
    status = U.wait_drained(cl)
    workers = {w.worker_id: w for w in status.workers}
    assert workers["gen-0"].pauses > 0, "the generation pool was sized to force pauses"
    assert dict(workers["ctx-0"].transfers.outcomes) == {"SENT": NUM_REQUESTS + 1}
    assert status.totals.prefix.predicted_tokens > 0 and status.totals.prefix.reused_tokens > 0
    return cl, status, load_end


def _status_by_actor(status) -> dict:
    return {f"pdserve-{w.worker_id}": w for w in status.workers}


# ---------------------------------------------------------------------------- prometheus


def _prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        reason = "no `prometheus` binary on PATH (Debian: apt-get install prometheus)"
        if os.environ.get("PDSERVE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"PDSERVE_REQUIRE_PROMETHEUS=1 but {reason}")
        pytest.skip(reason)
    return path


def _get_json(url: str, timeout_s: float = 10.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as err:  # a bad query answers 400 with a JSON error body
        body = err.read().decode(errors="replace")
        try:
            return json.loads(body)
        except ValueError:
            return {"status": "error", "error": f"HTTP {err.code}: {body[:500]}"}


@pytest.fixture(scope="module")
def prometheus(request):
    """A Prometheus of our own scraping this Ray session every second: its base URL."""
    binary = _prometheus_binary()  # skip (or fail) before starting anything
    request.getfixturevalue("ray_cluster")
    import ray

    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    sd_file = session_dir / "prom_metrics_service_discovery.json"  # Ray 2.60: in the session dir
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-prometheus-"))
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: ray\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
        f"    file_sd_configs:\n      - files: ['{sd_file}']\n        refresh_interval: 1s\n"
    )
    port = free_port()  # below the ephemeral range the cluster's listeners draw from
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"prometheus exited: {(tmp / 'prometheus.log').read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready within 60 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _query(url: str, expr: str) -> dict:
    return _get_json(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")


def _vector(url: str, expr: str, *labels: str) -> dict[tuple[str, ...], float]:
    """An instant vector as {label values: value}."""
    answer = _query(url, expr)
    assert answer.get("status") == "success", (expr, answer)
    return {tuple(r["metric"].get(k, "") for k in labels): float(r["value"][1])
            for r in answer["data"]["result"]}


def _expected(status) -> dict[str, dict[tuple[str, ...], float]]:
    """What each query must return, from the router's GetClusterStatus."""
    w = _status_by_actor(status)
    ctx, gen, totals = w[CTX], w[GEN], status.totals
    tokens = {}
    for actor, ws in w.items():
        if ws.context_tokens:
            tokens[(actor, "context")] = float(ws.context_tokens)
        if ws.generated_tokens:
            tokens[(actor, "generated")] = float(ws.generated_tokens)
    return {
        "sum by (worker) (ray_pdserve_paused_requests_total)": {(GEN,): float(gen.pauses)},
        "sum by (worker, role, outcome) (ray_pdserve_kv_transfers_total)": {
            (CTX, "context", "SENT"): float(ctx.transfers.outcomes["SENT"]),
            (GEN, "generation", "COMPLETE"): float(gen.transfers.outcomes["COMPLETE"]),
        },
        "sum by (worker) (ray_pdserve_kv_transfer_bytes_total)": {
            (CTX,): float(ctx.transfers.bytes), (GEN,): float(gen.transfers.bytes)},
        "sum by (worker) (ray_pdserve_kv_transfer_seconds_count)": {
            (CTX,): float(ctx.transfers.count), (GEN,): float(gen.transfers.count)},
        "sum by (worker, kind) (ray_pdserve_tokens_total)": tokens,
        "sum by (worker, outcome) (ray_pdserve_router_requests_total)": {
            (ROUTER, "completed"): float(totals.completed)},
        "sum by (worker, kind) (ray_pdserve_router_prefills_total)": {
            (ROUTER, "remote"): float(totals.remote_prefills)},
        "sum by (worker) (ray_pdserve_kv_blocks_free)": {
            (CTX,): float(ctx.total_kv_blocks), (GEN,): float(GEN_BLOCKS)},
        "sum by (worker) (ray_pdserve_kv_blocks_capacity)": {
            (CTX,): float(ctx.total_kv_blocks), (GEN,): float(GEN_BLOCKS)},
        "sum by (worker) (ray_pdserve_router_prefix_predictions_total)": {
            (ROUTER,): float(totals.prefix.requests)},
        "sum by (worker) (ray_pdserve_router_prefix_predicted_tokens_total)": {
            (ROUTER,): float(totals.prefix.predicted_tokens)},
        "sum by (worker) (ray_pdserve_router_prefix_reused_tokens_total)": {
            (ROUTER,): float(totals.prefix.reused_tokens)},
        "sum by (worker) (ray_pdserve_router_queue_depth)": {(ROUTER,): 0.0},
        "sum by (worker) (ray_pdserve_router_in_flight)": {(ROUTER,): 0.0},
    }


def _labels_of(expr: str) -> tuple[str, ...]:
    return tuple(re.search(r"by \(([^)]*)\)", expr).group(1).replace(" ", "").split(","))


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs
    return exprs


def _instantiate(expr: str) -> str:
    """A dashboard expression as Grafana would send it with every role and worker selected."""
    return expr.replace("$role", ".*").replace("$worker", ".*").replace("$__rate_interval", "30s")


def test_prometheus_scrapes_pdserve_through_rays_service_discovery(prometheus, loaded):
    import ray

    import cluster_util as U

    cl, status, _ = loaded
    url = prometheus

    # 1. The figures the cluster reports, as Prometheus scraped them (each process reports on its
    #    own cycle, and the router flushes every status refresh: poll until they agree).
    got: dict = {}
    deadline = time.monotonic() + 90
    while True:
        status = U.status(cl.port)  # the router's view, refreshed every status_refresh_s
        expected = _expected(status)
        got = {expr: _vector(url, expr, *_labels_of(expr)) for expr in expected}
        tolerant = "ray_pdserve_kv_transfer_seconds_count"
        if all(got[e] == v for e, v in expected.items() if tolerant not in e):
            break
        assert time.monotonic() < deadline, (
            "Prometheus never agreed with GetClusterStatus within 90 s:\n"
            + "\n".join(f"{e}\n  prometheus: {got[e]}\n  cluster:    {v}"
                        for e, v in expected.items() if got[e] != v))
        time.sleep(1.0)
    # Transfer durations: one histogram observation per successful transfer on each side.
    assert got["sum by (worker) (ray_pdserve_kv_transfer_seconds_count)"] == \
        expected["sum by (worker) (ray_pdserve_kv_transfer_seconds_count)"]
    # The exact transfer-time counter equals the workers' own total of seconds.
    seconds = _vector(url, "sum by (worker) (ray_pdserve_kv_transfer_time_seconds_total)", "worker")
    for actor, ws in _status_by_actor(status).items():
        assert math.isclose(seconds[(actor,)], ws.transfers.seconds, rel_tol=1e-6), (actor, seconds)

    # 2. One `worker` tag convention: the Ray actor names, nothing else.
    workers = _vector(url, 'count by (worker, role) ({__name__=~"ray_pdserve_.+"})', "worker", "role")
    assert set(workers) == {(CTX, "context"), (GEN, "generation"), (ROUTER, "router")}, workers
    named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert {CTX, GEN, ROUTER} <= named

    # 3. Every dashboard expression runs, names only series Prometheus has (or fault-only ones),
    #    and returns data whenever every series it names exists.
    names_answer = _get_json(f"{url}/api/v1/label/__name__/values")
    assert names_answer["status"] == "success", names_answer
    known = {n for n in names_answer["data"] if n.startswith("ray_pdserve_")}
    problems: list[str] = []
    deadline = time.monotonic() + 30  # a fresh series needs two samples in a rate() window
    while True:
        problems = []
        for expr in _dashboard_exprs():
            query = _instantiate(expr)
            answer = _query(url, query)
            if answer.get("status") != "success":
                problems.append(f"{query}: {answer.get('errorType')}: {answer.get('error')}")
                continue
            names = set(re.findall(r"\bray_pdserve_[a-z0-9_]+", expr))
            unknown = names - known - ONLY_ON_FAULTS
            if unknown:
                problems.append(f"{query}: names series Prometheus never returned: {sorted(unknown)}")
            elif names <= known and not answer["data"]["result"]:
                problems.append(f"{query}: no data")
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not problems, "\n".join(problems)
    # The transfer, pause and KV panels above all had data (every series they name exists).
    for name in ("ray_pdserve_kv_transfers_total", "ray_pdserve_kv_transfer_bytes_total",
                 "ray_pdserve_kv_transfer_seconds_bucket", "ray_pdserve_kv_transfer_gbps_bucket",
                 "ray_pdserve_kv_transfer_time_seconds_total", "ray_pdserve_paused_requests_total",
                 "ray_pdserve_kv_blocks_used", "ray_pdserve_kv_blocks_free", "ray_pdserve_tokens_total",
                 "ray_pdserve_scheduler_steps_total"):
        assert name in known, name


# ---------------------------------------------------------------------------- gauges


def _ray_metrics_url() -> str:
    import ray

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def _gauges(text: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("ray_pdserve_kv_blocks_free", "ray_pdserve_kv_blocks_capacity",
                          "ray_pdserve_router_queue_depth", "ray_pdserve_router_in_flight"):
                out[(s.name, s.labels.get("worker", ""))] = s.value
    return out


def test_gauges_are_still_exported_long_after_the_load(loaded):
    _, status, load_end = loaded
    ctx_blocks = _status_by_actor(status)[CTX].total_kv_blocks
    expected = {
        ("ray_pdserve_kv_blocks_free", GEN): float(GEN_BLOCKS),
        ("ray_pdserve_kv_blocks_capacity", GEN): float(GEN_BLOCKS),
        ("ray_pdserve_kv_blocks_free", CTX): float(ctx_blocks),
        ("ray_pdserve_router_queue_depth", ROUTER): 0.0,
        ("ray_pdserve_router_in_flight", ROUTER): 0.0,
    }
    # Without the re-setting, a gauge leaves the endpoint 2 report intervals after it was last
    # set (measured: ~2 s at a 1 s interval): wait well past that with the cluster idle.
    wait_s = max(GAUGE_WAIT_S, 6 * _report_interval_s())
    remaining = load_end + wait_s - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
    seen: dict = {}
    present_in_a_row = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(_ray_metrics_url(), timeout=10) as resp:
                seen = _gauges(resp.read().decode())
        except OSError:
            seen = {}
        # Twice in a row, a few report intervals apart: exported for good, not a late leftover.
        present_in_a_row = present_in_a_row + 1 if all(seen.get(k) == v for k, v in expected.items()) else 0
        if present_in_a_row >= 2:
            break
        time.sleep(3 * _report_interval_s())
    assert present_in_a_row >= 2, (
        f"gauges gone or wrong {wait_s:.0f} s after the load: "
        f"{ {k: (seen.get(k), v) for k, v in expected.items() if seen.get(k) != v} }")

"""deploy/: every YAML and JSON parses; the Grafana dashboard has a panel for every metric that
cluster/metric_specs.py defines (read from the module), takes totals and means from counters only and
matches its generator; the Grafana provisioning file loads it; the Prometheus configs are valid
(promtool, where installed); the cluster manifests start pdserve with `pdserve launch` and pin
torch. tests/integration/test_prometheus_scrape.py runs the dashboard's queries on a real
Prometheus."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdserve.cluster import metric_specs as MS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pdserve-dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning" / "dashboards" / "pdserve.yml"


def _files(*suffixes: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in suffixes)


def _yaml(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows nest theirs
    return out


def _series_pattern(spec: MS.MetricSpec) -> re.Pattern:
    series = {MS.COUNTER: f"ray_{spec.name}_total", MS.GAUGE: f"ray_{spec.name}",
              MS.HISTOGRAM: f"ray_{spec.name}_bucket"}[spec.kind]
    return re.compile(rf"(?<![A-Za-z0-9_]){series}(?![A-Za-z0-9_])")


@pytest.mark.parametrize("path", _files(".yaml", ".yml"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path):
    assert _yaml(path), f"{path} is empty"


@pytest.mark.parametrize("path", _files(".json"), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path: Path):
    assert json.loads(path.read_text())


def test_expected_deploy_files_exist():
    for rel in ("ray-cluster.yaml", "kuberay/raycluster.yaml", "prometheus/prometheus.yml",
                "grafana/pdserve-dashboard.json", "grafana/provisioning/dashboards/pdserve.yml"):
        assert (DEPLOY / rel).is_file(), rel


# ---------------------------------------------------------------------------- grafana


def _primary_panel(panels: list[dict], spec: MS.MetricSpec) -> list[dict]:
    """The panel the generator writes for ``spec`` (its description names the metric)."""
    return [p for p in panels if p.get("description", "").endswith(f"({spec.kind} {spec.name})")]


def test_dashboard_has_a_panel_for_every_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(MS.METRICS) >= 20
    for spec in MS.METRICS:
        (panel,) = _primary_panel(panels, spec)
        pattern = _series_pattern(spec)
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs and all(pattern.search(e) for e in exprs), (spec.name, exprs)
        for expr in exprs:
            assert 'role=~"$role"' in expr and 'worker=~"$worker"' in expr, expr
            assert expr.count("(") == expr.count(")"), expr
            if spec.kind == MS.COUNTER:
                assert expr.startswith("sum by") and "rate(" in expr, expr
            elif spec.kind == MS.HISTOGRAM:
                assert expr.startswith("histogram_quantile(") and "by (le," in expr, expr
            else:
                assert "rate(" not in expr, expr
        if spec.kind == MS.HISTOGRAM:
            assert len(exprs) == 3  # p50, p95, p99


def _allowed_series() -> set[str]:
    out = set()
    for spec in MS.METRICS:
        if spec.kind == MS.COUNTER:
            out.add(f"ray_{spec.name}_total")
        elif spec.kind == MS.GAUGE:
            out.add(f"ray_{spec.name}")
        else:  # never _sum: Ray builds it from bucket midpoints
            out |= {f"ray_{spec.name}_bucket", f"ray_{spec.name}_count"}
    return out


def test_every_dashboard_query_names_real_series_and_no_histogram_sum():
    dashboard = json.loads(DASHBOARD.read_text())
    allowed = _allowed_series()
    used = set()
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = target["expr"]
            names = set(re.findall(r"\bray_pdserve_[a-z0-9_]+", expr))
            assert names, expr
            assert names <= allowed, (panel["title"], sorted(names - allowed))
            assert 'role=~"$role"' in expr and 'worker=~"$worker"' in expr, expr
            assert expr.count("(") == expr.count(")"), expr
            used |= names
    # The exact counters are on the dashboard: totals and means come from them.
    for spec in (MS.TOKENS, MS.SCHEDULER_STEPS, MS.FORWARD_TIME, MS.KV_TRANSFER_TIME, MS.ROUTER_KV_PATHS,
                 MS.KV_TRANSFER_BYTES, MS.PAUSED_REQUESTS):
        assert spec.prometheus_name in used, spec.name


def test_dashboard_derives_totals_and_means_from_counters():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {p["title"]: p for p in _panels(dashboard)}
    exprs = {title: " ".join(t["expr"] for t in p.get("targets", [])) for title, p in panels.items()}
    assert "ray_pdserve_tokens_total" in exprs["Tokens by kind (total)"]
    assert "ray_pdserve_router_kv_paths_total" in exprs["KV paths by kind (total)"]
    assert "ray_pdserve_router_kv_paths_total" in exprs["Router KV paths by kind (per second)"]
    mean_tokens = exprs["Tokens per step by kind (mean)"]
    assert "ray_pdserve_tokens_total" in mean_tokens and "ray_pdserve_scheduler_steps_total" in mean_tokens
    gbps = exprs["KV transfer throughput (mean GB/s)"]
    assert "ray_pdserve_kv_transfer_bytes_total" in gbps and "ray_pdserve_kv_transfer_time_seconds_total" in gbps
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows[0] == "Totals"


def test_dashboard_is_templated_by_role_and_worker():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "role", "worker"} <= set(variables)
    assert "role" in variables["role"]["definition"]
    assert "$role" in variables["worker"]["definition"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))


def test_dashboard_json_matches_its_generator():
    spec = importlib.util.spec_from_file_location("build_dashboard", DEPLOY / "grafana" / "build_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text()) == module.build_dashboard(), (
        "stale dashboard: run `python deploy/grafana/build_dashboard.py`"
    )


def test_grafana_provisioning_loads_the_dashboard_folder():
    (config,) = _yaml(PROVISIONING)
    assert config["apiVersion"] == 1
    (provider,) = config["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    # An environment variable Grafana expands; pointed at deploy/grafana it finds the dashboard.
    var = re.fullmatch(r"\$\{?([A-Z_]+)\}?", path)
    assert var, path
    assert var.group(1) in (ROOT / "docs" / "operations.md").read_text()
    assert (DASHBOARD.parent / DASHBOARD.name).is_file()
    assert json.loads(DASHBOARD.read_text())["uid"] == "pdserve"


def test_readme_documents_the_metrics_tab():
    readme = (ROOT / "docs" / "operations.md").read_text()
    section = readme[readme.index("## Metrics tab: Prometheus and Grafana"):]
    for needle in ("RAY_PROMETHEUS_HOST", "RAY_GRAFANA_HOST", "RAY_GRAFANA_IFRAME_HOST",
                   "deploy/prometheus/prometheus.yml", "prom_metrics_service_discovery.json",
                   "session_latest/metrics/grafana", "pdserve-dashboard.json",
                   "deploy/grafana/provisioning/dashboards/pdserve.yml", "/api/dashboards/db"):
        assert needle in section, needle


# ---------------------------------------------------------------------------- prometheus


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian package prometheus)")
@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-static.yml"])
def test_promtool_accepts_the_prometheus_configs(name: str):
    out = subprocess.run(["promtool", "check", "config", "--syntax-only", str(DEPLOY / "prometheus" / name)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_rays_service_discovery_file():
    (config,) = _yaml(DEPLOY / "prometheus" / "prometheus.yml")
    files = [f for job in config["scrape_configs"] for sd in job.get("file_sd_configs", [])
             for f in sd["files"]]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in files
    static = [job for path in _files(".yml", ".yaml") if path.parent.name == "prometheus"
              for doc in _yaml(path) for job in doc["scrape_configs"] if "static_configs" in job]
    assert static and all(":" in t for job in static for sc in job["static_configs"] for t in sc["targets"])


# ---------------------------------------------------------------------------- clusters


def test_ray_cluster_launcher_yaml():
    text = (DEPLOY / "ray-cluster.yaml").read_text()
    (config,) = _yaml(DEPLOY / "ray-cluster.yaml")
    assert "pdserve launch --address auto" in text
    types = config["available_node_types"]
    assert config["head_node_type"] in types and len(types) >= 2
    setup = config["setup_commands"]
    torch_at = next(i for i, c in enumerate(setup) if "pip install torch" in c)
    pdserve_at = next(i for i, c in enumerate(setup) if "pdserve" in c and "pip install" in c)
    assert "torch==2.13.0" in setup[torch_at] and torch_at < pdserve_at
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address" in c for c in config["worker_start_ray_commands"])


def test_kuberay_cluster_runs_pdserve_launch_and_exposes_grpc_and_dashboard():
    docs = _yaml(DEPLOY / "kuberay" / "raycluster.yaml")
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    hook = " ".join(head["lifecycle"]["postStart"]["exec"]["command"])
    assert re.search(r"pdserve launch --address auto --port 50051\b", hook)
    workers = cluster["spec"]["workerGroupSpecs"]
    assert any("nvidia.com/gpu" in g["template"]["spec"]["containers"][0]["resources"]["limits"]
               for g in workers)
    (service,) = [d for d in docs if d["kind"] == "Service"]
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert {50051, 8265} <= ports
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"


def test_every_torch_install_in_deploy_is_pinned():
    for path in DEPLOY.rglob("*"):
        if not path.is_file():
            continue
        for match in re.finditer(r"pip install[^\n]*?\btorch\b(\S*)", path.read_text()):
            assert match.group(1) == "==2.13.0", f"{path}: {match.group(0)}"

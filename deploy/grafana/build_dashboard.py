"""Writes pdserve-dashboard.json: one Grafana panel per metric in pdserve.cluster.metric_specs, plus
a few panels derived from the exact counters.

    python deploy/grafana/build_dashboard.py        # rewrite the JSON next to this file

Counters are shown as rates, gauges as values, histograms as p50/p95/p99 over rate() of their
buckets; every query is filtered by the dashboard's `role` and `worker` variables and grouped by
them (Ray adds its own labels such as WorkerId and SessionName, which the sums fold away).
`worker` is the Ray actor name (pdserve-ctx-0, pdserve-gen-0, pdserve-router).

Totals and means come from counters (and a histogram's exact `_count`), never from a histogram's
`_sum`: Ray exports that sum from bucket midpoints. The "Totals" row shows the counters' current
values (since each worker started), the derived panels mean tokens per step and mean KV transfer
throughput and duration.
tests/unit/test_deploy_files.py checks that the JSON matches what this script builds;
tests/integration/test_prometheus_scrape.py runs every expression against a real Prometheus.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.cluster.metric_specs import COUNTER, GAUGE, HISTOGRAM, METRICS, ROLE, WORKER, MetricSpec

OUT = Path(__file__).with_name("pdserve-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = '{role=~"$role", worker=~"$worker"}'
QUANTILES = (0.5, 0.95, 0.99)
PANEL_W, PANEL_H, PER_ROW = 8, 8, 3
ROWS = ("Totals", "Router", "Step loop", "KV cache", "KV transfers")


def _row_of(spec: MetricSpec) -> str:
    short = spec.name.removeprefix("pdserve_")
    if short.startswith("router_"):
        return "Router"
    if short.startswith("kv_blocks_"):
        return "KV cache"
    if short.startswith("kv_"):
        return "KV transfers"
    return "Step loop"


def _unit(spec: MetricSpec) -> str:
    if spec.kind == COUNTER and spec.name.endswith("_time_seconds"):
        return "percentunit"  # seconds per second: the share of wall-clock time
    if spec.name.endswith("_seconds"):
        return "s"
    if spec.name.endswith("_bytes"):
        return "Bps"  # shown as a rate
    if spec.name.endswith("_gbps"):
        return "GBs"
    return "ops" if spec.kind == COUNTER else "short"


def _targets(spec: MetricSpec) -> list[dict]:
    extra = [k for k in spec.tag_keys if k not in (ROLE, WORKER)]
    by = ", ".join([ROLE, WORKER, *extra])
    legend = "{{worker}}" + "".join(f" {{{{{k}}}}}" for k in extra)
    base = f"ray_{spec.name}"
    if spec.kind == COUNTER:
        exprs = [(f"sum by ({by}) (rate({base}_total{SELECTOR}[$__rate_interval]))", legend)]
    elif spec.kind == GAUGE:
        exprs = [(f"sum by ({by}) ({base}{SELECTOR})", legend)]
    else:
        exprs = [
            (f"histogram_quantile({q}, sum by (le, {by}) (rate({base}_bucket{SELECTOR}[$__rate_interval])))",
             f"p{round(q * 100)} {legend}")
            for q in QUANTILES
        ]
    return [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend_, "refId": chr(ord("A") + i)}
            for i, (expr, legend_) in enumerate(exprs)]


_WORDS = {"kv": "KV", "ttft": "TTFT", "e2e": "E2E", "gbps": "GB/s"}


def _title(spec: MetricSpec) -> str:
    short = spec.name.removeprefix("pdserve_")
    time_share = spec.kind == COUNTER and short.endswith("_time_seconds")
    if time_share:
        short = short.removesuffix("_seconds")
    words = " ".join(_WORDS.get(w, w) for w in short.split("_"))
    extra = [k for k in spec.tag_keys if k not in (ROLE, WORKER)]
    by = f" by {', '.join(extra)}" if extra else ""
    suffix = {COUNTER: " (per second)", GAUGE: "", HISTOGRAM: " (p50 / p95 / p99)"}[spec.kind]
    if time_share:
        suffix = " (share of wall clock)"
    return f"{words[0].upper()}{words[1:]}{by}{suffix}"


def _panel(spec: MetricSpec, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": _title(spec),
        "description": f"{spec.description} ({spec.kind} {spec.name})",
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": _unit(spec), "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": _targets(spec),
    }


def _sel(**tags: str) -> str:
    """The dashboard's selector with fixed tags added."""
    return SELECTOR[:-1] + "".join(f', {k}="{v}"' for k, v in tags.items()) + "}"


def _rate(series: str, by: str, **tags: str) -> str:
    return f"sum by ({by}) (rate({series}{_sel(**tags)}[$__rate_interval]))"


# Panels computed from the exact counters: (row, title, description, unit, kind, [(expr, legend)]).
_RW = f"{ROLE}, {WORKER}"
DERIVED: tuple[tuple[str, str, str, str, str, list[tuple[str, str]]], ...] = (
    ("Totals", "Tokens by kind (total)", "Tokens prefilled (context) and sampled (generated) since "
     "each worker started (from the counter pdserve_tokens)", "short", "stat",
     [("sum by (kind) (ray_pdserve_tokens_total" + SELECTOR + ")", "{{kind}}")]),
    ("Totals", "Router requests by outcome (total)", "Requests the router finished, by outcome "
     "(from the counter pdserve_router_requests)", "short", "stat",
     [("sum by (outcome) (ray_pdserve_router_requests_total" + SELECTOR + ")", "{{outcome}}")]),
    ("Totals", "KV paths by kind (total)", "How each finished request's KV reached its generation "
     "worker (from the counter pdserve_router_kv_paths)", "short", "stat",
     [("sum by (kind) (ray_pdserve_router_kv_paths_total" + SELECTOR + ")", "{{kind}}")]),
    ("Totals", "KV transfers by outcome (total)", "Finished KV transfers on each side "
     "(from the counter pdserve_kv_transfers)", "short", "stat",
     [("sum by (role, outcome) (ray_pdserve_kv_transfers_total" + SELECTOR + ")", "{{role}} {{outcome}}")]),
    ("Totals", "KV bytes moved (total)", "KV bytes moved by successful transfers, per side "
     "(from the counter pdserve_kv_transfer_bytes)", "bytes", "stat",
     [("sum by (role) (ray_pdserve_kv_transfer_bytes_total" + SELECTOR + ")", "{{role}}")]),
    ("Totals", "Paused requests (total)", "Requests paused (evicted, to be re-prefilled) "
     "(from the counter pdserve_paused_requests)", "short", "stat",
     [("sum by (worker) (ray_pdserve_paused_requests_total" + SELECTOR + ")", "{{worker}}")]),
    ("Step loop", "Tokens per step by kind (mean)", "Tokens per step from the exact counters: "
     "rate(pdserve_tokens) / rate(pdserve_scheduler_steps)", "short", "timeseries",
     [(f"{_rate('ray_pdserve_tokens_total', f'{_RW}, kind')} / on ({_RW}) group_left "
       f"{_rate('ray_pdserve_scheduler_steps_total', _RW)}", "{{worker}} {{kind}}")]),
    ("Step loop", "Forward time (mean per forward)", "Exact mean: rate(pdserve_forward_time_seconds)"
     " / rate(pdserve_forward_seconds_count)", "s", "timeseries",
     [(f"{_rate('ray_pdserve_forward_time_seconds_total', _RW)} / "
       f"{_rate('ray_pdserve_forward_seconds_count', _RW)}", "{{worker}}")]),
    ("KV transfers", "KV transfer throughput (mean GB/s)", "Exact mean over successful transfers: "
     "rate(pdserve_kv_transfer_bytes) / rate(pdserve_kv_transfer_time_seconds) / 1e9", "GBs",
     "timeseries",
     [(f"{_rate('ray_pdserve_kv_transfer_bytes_total', _RW)} / "
       f"{_rate('ray_pdserve_kv_transfer_time_seconds_total', _RW)} / 1e9", "{{worker}}")]),
    ("KV transfers", "KV transfer time (mean per transfer)", "Exact mean over successful "
     "transfers: rate(pdserve_kv_transfer_time_seconds) / rate(pdserve_kv_transfer_seconds_count)",
     "s", "timeseries",
     [(f"{_rate('ray_pdserve_kv_transfer_time_seconds_total', _RW)} / "
       f"{_rate('ray_pdserve_kv_transfer_seconds_count', _RW)}", "{{worker}}")]),
)


def _derived_panel(title: str, description: str, unit: str, kind: str, exprs: list[tuple[str, str]],
                   panel_id: int, x: int, y: int) -> dict:
    panel = {
        "id": panel_id,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": PANEL_H, "w": PANEL_W, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(exprs)],
    }
    if kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "textMode": "value_and_name", "colorMode": "none", "graphMode": "none"}
    else:
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel


def _variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": f"{name}-values"},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,  # on time range change, so new workers appear
        "sort": 1,
        "options": [],
        "hide": 0,
    }


def build_dashboard() -> dict:
    panels: list[dict] = []
    y, next_id = 0, 1
    for row in ROWS:
        specs = [s for s in METRICS if _row_of(s) == row]
        derived = [d[1:] for d in DERIVED if d[0] == row]
        if not specs and not derived:
            continue
        panels.append({"id": next_id, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, spec in enumerate(specs):
            panels.append(_panel(spec, next_id, (i % PER_ROW) * PANEL_W, y + (i // PER_ROW) * PANEL_H))
            next_id += 1
        for j, d in enumerate(derived, start=len(specs)):
            panels.append(_derived_panel(*d, next_id, (j % PER_ROW) * PANEL_W, y + (j // PER_ROW) * PANEL_H))
            next_id += 1
        y += -(-(len(specs) + len(derived)) // PER_ROW) * PANEL_H
    return {
        "uid": "pdserve",
        "title": "pdserve",
        "description": "pdserve P/D disaggregated serving: router, workers' step loop, KV cache and KV transfers",
        "tags": ["pdserve", "ray"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "options": [], "refresh": 1, "regex": ""},
            _variable("role", 'label_values({__name__=~"ray_pdserve_.+"}, role)'),
            _variable("worker", 'label_values({__name__=~"ray_pdserve_.+", role=~"$role"}, worker)'),
        ]},
        "panels": panels,
    }


def main() -> int:
    OUT.write_text(json.dumps(build_dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

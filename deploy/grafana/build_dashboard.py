"""Writes pdserve-dashboard.json: one Grafana panel per metric in pdserve.cluster.metrics.

    python deploy/grafana/build_dashboard.py        # rewrite the JSON next to this file

Counters are shown as rates, gauges as values, histograms as p50/p95/p99 over rate() of their
buckets; every query is filtered by the dashboard's `role` and `worker` variables and grouped by
them (Ray adds its own labels such as WorkerId and SessionName, which the sums fold away).
tests/unit/test_deploy_files.py checks that the JSON matches what this script builds.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.cluster.metrics import COUNTER, GAUGE, HISTOGRAM, METRICS, ROLE, WORKER, MetricSpec

OUT = Path(__file__).with_name("pdserve-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECTOR = '{role=~"$role", worker=~"$worker"}'
QUANTILES = (0.5, 0.95, 0.99)
PANEL_W, PANEL_H, PER_ROW = 8, 8, 3
ROWS = ("Router", "Step loop", "KV cache", "KV transfers")


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
    words = " ".join(_WORDS.get(w, w) for w in spec.name.removeprefix("pdserve_").split("_"))
    extra = [k for k in spec.tag_keys if k not in (ROLE, WORKER)]
    by = f" by {', '.join(extra)}" if extra else ""
    suffix = {COUNTER: " (per second)", GAUGE: "", HISTOGRAM: " (p50 / p95 / p99)"}[spec.kind]
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
        if not specs:
            continue
        panels.append({"id": next_id, "type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        for i, spec in enumerate(specs):
            panels.append(_panel(spec, next_id, (i % PER_ROW) * PANEL_W, y + (i // PER_ROW) * PANEL_H))
            next_id += 1
        y += -(-len(specs) // PER_ROW) * PANEL_H
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

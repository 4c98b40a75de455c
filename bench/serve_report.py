"""What ``pdserve bench serve|compare`` report: the side-by-side table, the JSON document (every
request, the status samples, the machine) and the PNG figures.
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.serve_replay import ServeRun
from pdserve.bench.workload import WorkItem, WorkloadSpec, mean_rate

LAYOUT_TITLES = {"1P1D": "1P1D disaggregated", "colocated": "1 colocated worker",
                 "colocated-x2": "2 colocated workers"}


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "gpu": _gpu_name()}


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def _fmt(d: dict, key: str) -> str:
    return " / ".join("-" if math.isnan(d[key][q]) else f"{d[key][q]:.1f}" for q in ("p50", "p90", "p99"))


TABLE_ROWS = [
    ("requests ok / sent", lambda s: f"{s['completed']} / {s['requests']}"),
    ("TTFT p50/p90/p99 ms", lambda s: _fmt(s, "ttft_ms")),
    ("TPOT p50/p90/p99 ms", lambda s: _fmt(s, "tpot_ms")),
    ("ITL p50/p90/p99 ms", lambda s: _fmt(s, "itl_ms")),
    ("E2E p50/p90/p99 ms", lambda s: _fmt(s, "e2e_ms")),
    ("throughput req/s", lambda s: f"{s['throughput']['requests_per_s']:.2f}"),
    ("output tokens/s", lambda s: f"{s['throughput']['output_tokens_per_s']:.1f}"),
    ("goodput req/s (SLO met)", lambda s: f"{s['goodput_rps']:.2f} ({100 * s['slo_attainment']:.0f}%)"),
    ("KV transfers / GB moved", lambda s: f"{s['kv_transfer']['transfers']} / {s['kv_transfer']['bytes'] / 1e9:.4f}"),
    ("KV transfer GB/s (per transfer)", lambda s: f"{s['kv_transfer']['gb_per_s']:.3f}"),
    ("pauses (requests paused)", lambda s: f"{s['pauses']} ({s['paused_requests']})"),
    ("local prefills", lambda s: str(s["local_prefills"])),
    ("prefix hit rate", lambda s: f"{100 * s['prefix']['hit_rate']:.1f} %"),
    ("prefix predicted exactly", lambda s: f"{100 * s['prefix']['prediction_exact']:.1f} %"),
    ("duration s", lambda s: f"{s['duration_s']:.1f}"),
]


def print_table(title: str, summaries: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    for name in summaries:
        table.add_column(LAYOUT_TITLES.get(name, name), justify="right")
    for label, fn in TABLE_ROWS:
        table.add_row(label, *(fn(s) for s in summaries.values()))
    Console(width=max(100, 40 + 28 * len(summaries))).print(table)


def write_outputs(kind: str, runs: dict[str, ServeRun], work: Sequence[WorkItem], spec: WorkloadSpec,
                  engine: dict, slo: Slo, out_dir: Path | None, json_path: str | None) -> dict[str, dict]:
    from pdserve.bench.plots import write_figures

    summaries = {name: summarize(run.records, slo) for name, run in runs.items()}
    figures: list[str] = []
    if out_dir is not None:
        figures = [str(p) for p in write_figures(
            out_dir, {n: r.records for n, r in runs.items()}, {n: r.samples for n, r in runs.items()},
            title=f"{spec.trace} [{spec.start}:{spec.start + spec.num_requests}]")]
    if json_path:
        doc = {
            "benchmark": f"bench {kind}", "machine": machine_info(), "workload": asdict(spec),
            "offered_rate_rps": mean_rate(work) if work else None, "engine": engine,
            "slo": asdict(slo), "figures": figures,
            "runs": {name: {"summary": summaries[name], "wall_s": run.wall_s,
                            "status_samples": run.samples, "final_status": run.final_status,
                            "requests": [r.to_dict() for r in run.records]}
                     for name, run in runs.items()},
        }
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1, default=_json_default))
    return summaries


def _json_default(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return str(value)

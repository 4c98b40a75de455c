"""`pdserve top --once` and `pdserve status` as a user runs them, against a live 1P1D cluster
after a few requests, in an 80-column terminal: every column header whole (no `wor…`), every
line within 80 columns, each worker named, and --json counters as JSON numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_util as U  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PDSERVE = [sys.executable, "-m", "pdserve"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", "COLUMNS": "80",
       "LINES": "200", "TERM": "dumb"}
TOP_HEADERS = ["worker", "role", "ok", "TP", "KV used/total", "run", "wait", "paused", "tok/s"]
STATUS_HEADERS = ["worker", "role", "ok", "KV free", "act", "queue", "paused", "pauses", "xfers", "bytes",
                  "quar"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=120, env=ENV, check=False)


def _check_80_columns(out: str, headers: list[str]) -> None:
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    lines = out.splitlines()
    header_rows = [lines[i - 1] for i, line in enumerate(lines) if i and line.startswith("─")]
    row = next((r for r in header_rows if r.startswith("worker")), None)
    assert row is not None, out
    at = 0
    for h in headers:  # whole and in order on one line
        at = row.find(h, at)
        assert at >= 0, (h, row)
        at += len(h)


def test_top_once_and_status_in_80_columns(clusters):
    cl = clusters(engine=U.ENGINE)
    with U.Client(f"127.0.0.1:{cl.port}") as client:
        for i, prompt in enumerate(U.prompts(3, seed=12, lo=12, hi=24)):
            done = client.generate(prompt, max_tokens=4, disaggregation="ALWAYS", request_id=f"top-{i}",
                                   **U.GREEDY)
            assert done.finish_reason == "length"
    workers = sorted(cl.workers)

    top = _run("top", "--once", "--interval", "0.5", "--port", str(cl.port))
    assert top.returncode == 0, top.stdout + top.stderr
    _check_80_columns(top.stdout, TOP_HEADERS)
    for worker in workers:
        assert worker in top.stdout
    assert "KV paths" in top.stdout and "transfers/s" in top.stdout

    status = _run("status", "--port", str(cl.port))
    assert status.returncode == 0, status.stderr
    _check_80_columns(status.stdout, STATUS_HEADERS)
    for worker in workers:
        assert worker in status.stdout
    assert "KV paths" in status.stdout and "completed" in status.stdout

    as_json = _run("status", "--json", "--port", str(cl.port))
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    by_id = {w["workerId"]: w for w in data["workers"]}
    assert sorted(by_id) == workers
    gen = next(w for w in by_id.values() if w["role"] == "WORKER_ROLE_GENERATION")
    assert isinstance(gen["transfers"]["count"], int) and gen["transfers"]["count"] >= 3
    assert isinstance(gen["transfers"]["bytes"], int) and gen["transfers"]["bytes"] > 0
    assert isinstance(gen["pauses"], int)
    assert isinstance(data["totals"]["completed"], int) and data["totals"]["completed"] >= 3

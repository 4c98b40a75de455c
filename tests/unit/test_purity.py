"""The decision logic stays pure: scheduler/, the pure transport modules (protocol, sessions,
requests, tp_map) and cluster/policies.py and validation.py import no torch, ray or grpc
(docs/design.md, "The purity rule"), so they are testable in milliseconds."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"torch", "ray", "grpc", "numpy"}
PURE_PATHS = [ROOT / "scheduler", ROOT / "transport" / "protocol.py",
              ROOT / "transport" / "sessions.py", ROOT / "transport" / "session_sides.py",
              ROOT / "transport" / "requests", ROOT / "transport" / "kv_link.py",
              ROOT / "transport" / "tp_map.py",
              ROOT / "cluster" / "policies.py", ROOT / "cluster" / "validation.py",
              ROOT / "cluster" / "prefix_index.py",
              ROOT / "cluster" / "front" / "openai" / "api.py", ROOT / "cluster" / "text_stream.py",
              ROOT / "cluster" / "front" / "openai" / "tools",
              ROOT / "cluster" / "auth.py",
              ROOT / "proto" / "stubs.py"]


def _pure_files() -> list[Path]:
    files: list[Path] = []
    for path in PURE_PATHS:
        if path.is_dir():
            files.extend(sorted(path.rglob("*.py")))
        elif path.exists():
            files.append(path)
    return files


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_pure_paths_exist():
    # A moved or renamed module would otherwise drop out of the purity check without a word.
    assert [p for p in PURE_PATHS if not p.exists()] == []


def test_scheduler_package_exists():
    assert (ROOT / "scheduler" / "request.py").exists()
    assert len(_pure_files()) >= 5


@pytest.mark.parametrize("path", _pure_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_module_imports_nothing_heavy(path: Path):
    bad = _imported_roots(path) & FORBIDDEN
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_importing_the_scheduler_loads_no_heavy_module():
    code = (
        "import sys, pdserve.scheduler, pdserve.scheduler.sim_worker\n"
        "import pdserve.transport.requests, pdserve.transport.tp_map, pdserve.cluster.front.openai.api, pdserve.cluster.text_stream\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch','ray','grpc','numpy'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"heavy modules loaded: {out.stdout.strip()}"

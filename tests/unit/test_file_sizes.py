"""Product files stay readable: none of the modules the wheel ships is over 650 lines, and the
engine core (the step, admission and outputs' caller) stays under 450. A file that grows past
its limit is a sign it holds more than one concept: split it along a seam and name the parts."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 650
CORE_MAX_LINES = 450


def _product_files() -> list[Path]:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    files = []
    for package in packages:
        folder = ROOT.joinpath(*package.split(".")[1:])
        files += [f for f in folder.glob("*.py") if f.name != "setup.py" and "_pb2" not in f.name]
    return files


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_product_file_is_over_650_lines():
    files = _product_files()
    assert len(files) > 100
    long = sorted(f"{f.relative_to(ROOT)}: {_lines(f)}" for f in files if _lines(f) > MAX_LINES)
    assert not long, long


def test_the_engine_core_is_under_450_lines():
    assert _lines(ROOT / "workers" / "engine" / "core.py") < CORE_MAX_LINES

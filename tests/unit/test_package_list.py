"""Every Python package in the repository is listed in pyproject.toml's ``packages``: setuptools
builds the wheel from that list, so a package missing there imports in a source checkout and is
missing from an installed wheel (``pdserve.cluster.router`` once was)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", "tests", "build", "dist", ".git", "docs", "deploy"}


def test_every_package_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in SKIP or rel.parts[0].startswith(".")
                          or any(p.endswith(".egg-info") or p == "__pycache__" for p in rel.parts)):
            continue
        found.add(".".join(("pdserve", *rel.parts)))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"

"""The split between ``bench/`` (the package's benchmark tools: ``pdserve bench``, ``simulate``,
the scheduler bench; in the wheel) and ``benchmarks/`` (experiment scripts run from a checkout; not
in the wheel): docs/design.md, "proto/, bench/, benchmarks/, deploy/, tests/".

In a source checkout the repository root is the package and tests/conftest.py puts benchmarks/ on
sys.path, so a package module that imported a script (as ``pdserve.benchmarks.X`` or by bare
name) would work here and fail in an installed wheel; these checks are static for that reason.
tests/integration/test_packaging.py checks the built wheel itself.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {p.stem for p in (ROOT / "bench").glob("*.py")}
SCRIPTS = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
# Modules some scripts import only in another environment (vLLM's venv, a CUDA torch build), so
# they need not be installed beside pdserve.
OTHER_ENVIRONMENTS = {"vllm", "triton"}


def _package_files() -> list[Path]:
    """Every .py file the wheel builds from: the folders of pyproject.toml's packages, each
    without its subfolders (those are packages of their own, listed separately)."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {ROOT.joinpath(*name.split(".")[1:]) for name in packages}
    return sorted(p for folder in folders for p in folder.glob("*.py") if p.name != "setup.py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the file; for ``from M import a`` both M
    and M.a, since ``a`` may be a module."""
    package = ["pdserve", *path.parent.relative_to(ROOT).parts] if path.is_relative_to(ROOT) else []
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _module_exists(dotted: str) -> bool:
    """Whether pdserve.a.b names a module or package of this repository."""
    rel = ROOT.joinpath(*dotted.split(".")[1:])
    return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()


def test_the_folders_are_disjoint_and_benchmarks_is_no_package():
    assert PRODUCT and SCRIPTS
    assert not PRODUCT & SCRIPTS - {"__init__"}, f"in both folders: {sorted(PRODUCT & SCRIPTS)}"
    # An __init__.py would make pdserve.benchmarks importable in a checkout (not in a wheel) and
    # benchmarks/ a package that tests/unit/test_package_list.py wants listed for the wheel.
    assert not (ROOT / "benchmarks" / "__init__.py").exists()
    assert "benchmarks" not in str(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"])


def test_no_package_module_imports_an_experiment_script():
    files = _package_files()
    assert ROOT / "bench" / "sizing.py" in files and ROOT / "cli" / "main.py" in files
    bad = []
    for path in files:
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] in SCRIPTS or parts[:2] == ["pdserve", "benchmarks"] or (
                    parts[:2] == ["pdserve", "bench"] and len(parts) > 2 and parts[2] in SCRIPTS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "the wheel has no benchmarks/:\n" + "\n".join(bad)


def test_every_pdserve_bench_name_is_a_module_of_bench():
    """No file (code, docs, Makefile, CI) names a moved script by its old dotted name."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=60).stdout.split("\0")
    bad = []
    for rel in filter(None, listed):
        path = ROOT / rel
        if rel.startswith("docs/results/") or not path.is_file() or path.suffix in (".xz", ".png", ".svg"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"\bpdserve\.bench\.([a-z0-9_]+)", line):  # lower case: NAME is a placeholder
                if m.group(1) not in PRODUCT:
                    bad.append(f"{rel}:{n}: pdserve.bench.{m.group(1)}")
    assert not bad, "\n".join(bad)


def test_each_script_imports_what_exists():
    """A script's pdserve.* imports name modules of the package; anything else it imports that is
    neither stdlib nor installed is a sibling script (imported by bare name, as its run allows)."""
    installed = set(importlib.metadata.packages_distributions())
    bad = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}:{node.lineno}: a relative import (scripts are no package)"
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                where = f"benchmarks/{path.name}:{node.lineno} imports {name}"
                if root == "pdserve":
                    if not _module_exists(name):
                        bad.append(f"{where}: no such module in the package")
                elif root in PRODUCT and root not in sys.stdlib_module_names:
                    bad.append(f"{where}: a bench/ module, import it as pdserve.bench.{root}")
                elif not (root in sys.stdlib_module_names or root in installed or root in SCRIPTS
                          or root in OTHER_ENVIRONMENTS):
                    bad.append(f"{where}: neither stdlib, installed nor a script beside it")
    assert not bad, "\n".join(bad)


def test_scripts_named_in_the_documents_exist():
    """docs/benchmarks.md and the others cite scripts by path: each path is a file."""
    texts = [ROOT / "README.md", ROOT / "Makefile", ROOT / "benchmarks" / "README.md",
             *sorted((ROOT / "docs").glob("*.md"))]
    named, missing = 0, []
    for path in texts:
        for m in re.finditer(r"\b(bench|benchmarks)/([a-z0-9_]+)\.py\b", path.read_text()):
            named += 1
            if not (ROOT / m.group(0)).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert named > 50
    assert not missing, "\n".join(missing)

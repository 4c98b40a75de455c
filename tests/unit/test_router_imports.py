"""The router core knows no protocol, and pdserve has no import cycle.

- No module of the package is part of an import cycle with another: the graph covers every
  module the wheel ships (scheduler/, transport/, workers/ with model/, cluster/, bench/, cli/,
  proto/, the root's __init__.py, __main__.py and traces.py; data/ holds no code), and every
  import counts: at module level, inside a function, relative, and under ``if TYPE_CHECKING:``
  too. What counts as an import of what: tests/unit/import_graph.py.
- The router core (cluster/router/) imports no grpc and no aiohttp, neither itself nor through
  any pdserve module it imports (the front doors in cluster/front/ adapt it); a fresh
  interpreter that imports it has loaded neither.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite imports with importlib
from import_graph import cycles, edges_of, read_package  # noqa: E402

PROTOCOL_LIBRARIES = {"grpc", "grpc_health", "grpc_reflection", "aiohttp", "google"}
TOP_LEVEL = {"scheduler", "transport", "workers", "cluster", "bench", "cli", "proto", "traces", "__main__"}


def test_the_graph_covers_the_whole_package():
    """Every layer and root module is in it (a package missing from pyproject.toml would drop
    out silently: test_package_list.py), the model families among them; tests/ and docs/ not."""
    modules = set(read_package())
    assert {m.split(".")[1] for m in modules if m != "pdserve"} == TOP_LEVEL
    assert {"pdserve", "pdserve.traces", "pdserve.__main__", "pdserve.workers.model.llama",
            "pdserve.transport.kv_pool", "pdserve.proto.stubs", "pdserve.cluster.router.core"} <= modules
    assert len(modules) > 130


def test_every_pdserve_import_names_a_module_of_the_package():
    """An import of a pdserve name no file defines (a stale path after a move) is an error
    the graph would otherwise drop."""
    bad = [f"{m}:{line} imports {target}" for m, found in sorted(read_package().items())
           for line, target in found.unresolved]
    assert not bad, "\n".join(bad)


def test_pdserve_has_no_import_cycle():
    found = cycles(edges_of(read_package()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_router_core_imports_no_protocol_library():
    """Directly or through any pdserve module it reaches (the whole package's graph)."""
    imports = read_package()
    edges = edges_of(imports)
    core = [m for m in edges if m == "pdserve.cluster.router" or m.startswith("pdserve.cluster.router.")]
    assert len(core) >= 8
    seen: set[str] = set()
    todo = list(core)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(edges.get(m, ()))
    bad = sorted(f"{m} imports {sorted(imports[m].libraries & PROTOCOL_LIBRARIES)}" for m in seen
                 if imports[m].libraries & PROTOCOL_LIBRARIES)
    assert not bad, "the router core reaches a protocol library:\n" + "\n".join(bad)
    assert not any(m.startswith("pdserve.cluster.front") for m in seen)


def test_importing_the_router_core_loads_no_protocol_library():
    code = ("import sys, pdserve.cluster.router, pdserve.cluster.router.api\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted(PROTOCOL_LIBRARIES)!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loaded: {out.stdout.strip()}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package tree of ``files`` (path -> source) with the pyproject.toml and root
    ``__init__.py`` (its _LAZY table) the graph reads."""
    packages = {"pdserve"}
    for rel, source in {"__init__.py": "_LAZY = {'LLM': ('pdserve.workers.engine', 'LLM')}\n", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        packages.add(".".join(["pdserve", *Path(rel).parent.parts]).rstrip("."))
    (tmp_path / "pyproject.toml").write_text(f"[tool.setuptools]\npackages = {sorted(packages)!r}\n")
    return tmp_path


def test_the_checkers_see_a_cycle_and_a_hidden_import(tmp_path):
    """The checkers themselves: a cycle through a TYPE_CHECKING import and a function-level
    relative import is found, and so is a library imported inside a function."""
    root = _tree(tmp_path, {
        "cluster/__init__.py": "",
        "cluster/router/__init__.py": "",
        "cluster/router/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "cluster/router/b.py": "def f():\n    from . import a\n    import grpc\n",
    })
    imports = read_package(root)
    assert cycles(edges_of(imports)) == [["pdserve.cluster.router.a", "pdserve.cluster.router.b"]]
    assert "grpc" in imports["pdserve.cluster.router.b"].libraries


def test_the_checkers_see_a_re_export_cycle_and_a_lazy_root_export(tmp_path):
    """A package __init__ re-exporting from its submodule, which imports a name from the
    package, is a cycle (``from . import sibling`` alone is not: the parent's __init__ runs
    first whatever the syntax); a name the root re-exports lazily leads to its module, and a
    pdserve import that names no file is reported."""
    root = _tree(tmp_path, {
        "scheduler/__init__.py": "from .core import Core\n",
        "scheduler/core.py": "from . import util\nfrom pdserve.scheduler import Helper\n",
        "scheduler/util.py": "",
        "workers/__init__.py": "",
        "workers/engine.py": "import pdserve\nx = pdserve.__name__\n",
        "cli/__init__.py": "",
        "cli/main.py": "from pdserve import LLM\nimport pdserve\ny = pdserve.LLM\nfrom pdserve.gone import X\n",
    })
    imports = read_package(root)
    edges = edges_of(imports)
    assert edges["pdserve.scheduler.core"] == {"pdserve.scheduler", "pdserve.scheduler.util"}
    assert edges["pdserve.scheduler.util"] == set()
    assert cycles(edges) == [["pdserve.scheduler", "pdserve.scheduler.core"]]
    assert edges["pdserve.cli.main"] == {"pdserve", "pdserve.workers.engine"}
    assert [t for _, t in imports["pdserve.cli.main"].modules].count("pdserve.workers.engine") == 2
    assert imports["pdserve.cli.main"].unresolved == [(4, "pdserve.gone")]

"""The router core knows no protocol, and cluster/ has no import cycle.

- No module under cluster/ is part of an import cycle with another: every import counts,
  at module level, inside a function, relative, and under ``if TYPE_CHECKING:`` too.
- The router core (cluster/router/) imports no grpc and no aiohttp, neither itself nor through
  any pdserve module it imports (the front doors in cluster/front/ adapt it); a fresh
  interpreter that imports it has loaded neither.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_LIBRARIES = {"grpc", "grpc_health", "grpc_reflection", "aiohttp", "google"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pdserve", *parts])


def _imports(path: Path, root: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(pdserve modules among ``known`` that the file imports, top-level names of the other
    libraries it imports). ``from pkg import name`` counts pkg.name when that is a module,
    else pkg."""
    tree = ast.parse(path.read_text(), str(path))
    package = path.relative_to(root).parts[:-1]
    modules: set[str] = set()
    libraries: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
                module = ".".join(["pdserve", *base, *(node.module.split(".") if node.module else [])])
            else:
                module = node.module or ""
            targets = [module]
            names = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("pdserve"):
                libraries.add(target.split(".")[0])
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            if subs:
                modules.update(subs)
            elif target in known:
                modules.add(target)
            else:  # a module outside cluster/ (scheduler, transport, ...): keep the nearest known
                modules.add(target)
    return modules, libraries


def _graph(root: Path, folder: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    files = {_module_name(p, root): p for p in sorted((root / folder).rglob("*.py"))}
    known = set(files)
    edges, libs = {}, {}
    for name, path in files.items():
        modules, libraries = _imports(path, root, known)
        edges[name] = {m for m in modules if m in known and m != name}
        libs[name] = libraries
    return edges, libs


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cluster_has_no_import_cycle():
    edges, _ = _graph(ROOT, "cluster")
    assert len(edges) > 20
    assert not _cycles(edges), _cycles(edges)


def test_the_router_core_imports_no_protocol_library():
    """Directly or through any pdserve module it reaches (the whole tree's graph)."""
    edges: dict[str, set[str]] = {}
    libs: dict[str, set[str]] = {}
    for layer in ("scheduler", "transport", "workers", "cluster"):
        e, lib = _graph(ROOT, layer)
        edges.update(e)
        libs.update(lib)
    # cross-layer edges: resolve every pdserve import against all files
    known = set(edges)
    for layer in ("scheduler", "transport", "workers", "cluster"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            modules, _ = _imports(path, ROOT, known)
            edges[_module_name(path, ROOT)] = {m for m in modules if m in known}
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
    bad = sorted(f"{m} imports {sorted(libs[m] & PROTOCOL_LIBRARIES)}" for m in seen
                 if libs.get(m, set()) & PROTOCOL_LIBRARIES)
    assert not bad, "the router core reaches a protocol library:\n" + "\n".join(bad)
    assert not any(m.startswith("pdserve.cluster.front") for m in seen)


def test_importing_the_router_core_loads_no_protocol_library():
    code = ("import sys, pdserve.cluster.router, pdserve.cluster.router.api\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted(PROTOCOL_LIBRARIES)!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"loaded: {out.stdout.strip()}"


def test_the_checkers_see_a_cycle_and_a_hidden_import(tmp_path):
    """The checkers themselves: a cycle through a TYPE_CHECKING import and a function-level
    relative import is found, and so is a library imported inside a function."""
    pkg = tmp_path / "cluster" / "router"
    pkg.mkdir(parents=True)
    (tmp_path / "cluster" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    import grpc\n")
    edges, libs = _graph(tmp_path, "cluster")
    assert _cycles(edges) == [["pdserve.cluster.router.a", "pdserve.cluster.router.b"]]
    assert "grpc" in libs["pdserve.cluster.router.b"]

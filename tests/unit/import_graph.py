"""pdserve's import graph, read from the source with ``ast`` (for test_router_imports.py and
test_layers.py).

Which files: every module the wheel ships, i.e. the ``.py`` files directly in each package that
pyproject.toml lists (``tests/unit/test_package_list.py`` holds that list complete), less
``setup.py`` (the build script at the root, never imported) and the git-ignored generated gRPC
stubs (``*_pb2*.py``). So tests/, docs/, deploy/ and any folder outside the package (an
experiments folder such as benchmarks/) are not in it.

Which imports: every ``import`` and ``from ... import`` statement, wherever it stands: at
module level, inside a function, under ``if TYPE_CHECKING:``, absolute or relative. An import
by string (``importlib.import_module``) is not read: the model registry's lazy family table
is one by design (it runs when called, once every module involved has loaded).

An import's target modules:
- ``import a.b.c``: a.b.c.
- ``from a.b import n``: a.b.n when that is a module of the package (Python imports the
  submodule; a package's ``__init__`` runs before any of its submodules whatever the syntax,
  so that parent edge is implied for every module and is not drawn), else a.b: the name is one
  a.b binds, so its ``__init__`` must have run that far. This is the re-export case: a
  package ``__init__`` that imports a submodule, and a submodule that imports a name from the
  package, are a cycle here.
- a name the root package re-exports lazily (``pdserve/__init__.py``'s ``_LAZY`` table, read
  from the source): ``from pdserve import LLM``, or ``pdserve.LLM`` after ``import pdserve``,
  imports the module that defines it (pdserve.workers.engine), as the lazy ``__getattr__``
  does. The root package itself imports no pdserve module.
"""
from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_MODULES = {"setup.py"}  # at the root, so in the "pdserve" package's folder, but the build script


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["pdserve", *parts])


def package_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the packages pyproject.toml lists."""
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    files: dict[str, Path] = {}
    for package in config["packages"]:
        folder = root.joinpath(*package.split(".")[1:])
        for path in sorted(folder.glob("*.py")):
            if path.relative_to(root).as_posix() in NOT_MODULES or "_pb2" in path.name:
                continue
            files[module_name(path, root)] = path
    return files


def lazy_exports(root: Path = ROOT) -> dict[str, str]:
    """The root package's lazily re-exported names -> the module each comes from (its
    ``_LAZY = {name: (module, attribute)}`` table). A root package that re-exports some other way
    must be taught here, so a missing table is an error, not an empty one."""
    tree = ast.parse((root / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {name: target[0] for name, target in ast.literal_eval(node.value).items()}
    raise AssertionError("pdserve/__init__.py has no _LAZY table: teach tests/unit/import_graph.py its re-exports")


@dataclass
class FileImports:
    modules: list[tuple[int, str]] = field(default_factory=list)  # (line, pdserve module)
    unresolved: list[tuple[int, str]] = field(default_factory=list)  # (line, pdserve name found nowhere)
    libraries: set[str] = field(default_factory=set)  # top-level names of other libraries


def file_imports(path: Path, root: Path, known: set[str], lazy: dict[str, str]) -> FileImports:
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = FileImports()

    def add(line: int, target: str) -> None:
        (out.modules if target in known else out.unresolved).append((line, target))

    imports_root = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "pdserve":
                    out.libraries.add(alias.name.split(".")[0])
                    continue
                add(node.lineno, alias.name)
                imports_root |= alias.name == "pdserve" and alias.asname is None
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from this file's package, one level up per extra dot
                parts = package.split(".")
                base = parts[:len(parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] != "pdserve":
                out.libraries.add(module.split(".")[0])
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in known:
                    add(node.lineno, sub)
                elif module == "pdserve" and alias.name in lazy:
                    add(node.lineno, lazy[alias.name])
                else:
                    add(node.lineno, module)
    if imports_root:  # ``pdserve.LLM`` after ``import pdserve`` runs the lazy import too
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "pdserve" and node.attr in lazy):
                add(node.lineno, lazy[node.attr])
    return out


def read_package(root: Path = ROOT) -> dict[str, FileImports]:
    """Module name -> what its file imports, for every module of the package."""
    files = package_files(root)
    known = set(files)
    lazy = lazy_exports(root)
    return {name: file_imports(path, root, known, lazy) for name, path in files.items()}


def edges_of(imports: dict[str, FileImports]) -> dict[str, set[str]]:
    return {name: {m for _, m in found.modules if m != name} for name, found in imports.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
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
        for w in sorted(edges.get(v, ())):
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
    return sorted(out)

"""Imports point down the layers docs/design.md states, lowest first:

    base < scheduler < transport < workers < cluster < bench < cli

A module may import its own layer and the ones below it, never one above: at module level,
inside a function, relative, and type-only under ``if TYPE_CHECKING:`` too (a type names a
module as surely as a call does). Every module of the package has a layer:

- base: what imports no other layer. The root package's ``__init__.py`` (its re-exports of
  ``LLM``, ``SamplingParams``, ``RequestOutput`` and ``Client`` are lazy: an import of one counts
  as an import of its module, tests/unit/import_graph.py), ``traces.py`` (stdlib only, usable
  from any layer), ``proto/`` (the .proto and its stub generator, which setup.py runs before
  pdserve is installed, so it imports no pdserve) and ``data/`` (bundled trace files, no code).
- the folders scheduler/ ... cli/ are their own layers; ``__main__.py`` (``python -m
  pdserve``) is in cli, the top floor.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the suite imports with importlib
from import_graph import read_package  # noqa: E402

LAYERS = ("base", "scheduler", "transport", "workers", "cluster", "bench", "cli")
BASE = {"traces", "proto", "data"}  # top-level names below scheduler/, beside the root __init__
IN_CLI = {"__main__"}


def layer_of(module: str) -> str:
    """The layer of a pdserve module (a name under none of them is an error: place it)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    if parts[1] in IN_CLI:
        return "cli"
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} is in no layer: give it one here and in docs/design.md")


def wrong_imports(root: Path | None = None) -> list[str]:
    imports = read_package(root) if root is not None else read_package()
    wrong = []
    for module, found in sorted(imports.items()):
        mine = LAYERS.index(layer_of(module))
        for line, target in sorted(found.modules):
            theirs = layer_of(target)
            if LAYERS.index(theirs) > mine:
                wrong.append(f"{module}:{line} imports {target} ({theirs}, above {layer_of(module)})")
    return wrong


def test_every_module_has_a_layer():
    layers = {layer_of(m) for m in read_package()}
    assert layers == set(LAYERS)


def test_imports_point_down_the_layers():
    wrong = wrong_imports()
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_relative_and_type_only_imports(tmp_path):
    """The checker itself: a function-level, a relative and a TYPE_CHECKING import up a layer
    are all seen, as is a lazy root re-export (``from pdserve import LLM`` is workers) and a
    root module importing a layer."""
    files = {
        "__init__.py": "_LAZY = {'LLM': ('pdserve.workers.engine', 'LLM')}\n",
        "traces.py": "def f():\n    from pdserve.scheduler import request\n",
        "scheduler/__init__.py": "",
        "scheduler/request.py": "",
        "transport/__init__.py": "",
        "transport/probe.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..workers import engine\n"
                               "def f():\n    from pdserve.cluster import metrics\n    from pdserve import LLM\n"
                               "from .other import X\n"),
        "transport/other.py": "",
        "workers/__init__.py": "",
        "workers/engine.py": "",
        "cluster/__init__.py": "",
        "cluster/metrics.py": "",
    }
    packages = {"pdserve"}
    for rel, source in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
        packages.add(".".join(["pdserve", *Path(rel).parent.parts]).rstrip("."))
    (tmp_path / "pyproject.toml").write_text(f"[tool.setuptools]\npackages = {sorted(packages)!r}\n")
    assert wrong_imports(tmp_path) == [
        "pdserve.traces:2 imports pdserve.scheduler.request (scheduler, above base)",
        "pdserve.transport.probe:3 imports pdserve.workers.engine (workers, above transport)",
        "pdserve.transport.probe:5 imports pdserve.cluster.metrics (cluster, above transport)",
        "pdserve.transport.probe:6 imports pdserve.workers.engine (workers, above transport)",
    ]


# Inside workers/, the floors of one worker: its shared config, the model code, loading a model,
# the model runner (a step plan's forward and sampling), the engine core (requests, schedulers,
# KV manager, outputs, KV connector) and the process shells (host, channels, Ray and RPC actors).
WORKER_FLOORS = ("config", "model", "loading", "runner", "engine", "process")


def worker_floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] != ["pdserve", "workers"] or len(parts) < 3:
        raise AssertionError(f"{module} is not under workers/")
    if parts[2] not in WORKER_FLOORS:
        raise AssertionError(f"{module} is on no floor of workers/: give it one here and in "
                             "docs/design.md")
    return parts[2]


def test_workers_floors_point_down():
    imports = read_package()
    wrong = []
    modules = [m for m in imports if m.startswith("pdserve.workers.")]
    assert {worker_floor_of(m) for m in modules} == set(WORKER_FLOORS)
    for module in sorted(modules):
        mine = WORKER_FLOORS.index(worker_floor_of(module))
        for line, target in sorted(imports[module].modules):
            if target.startswith("pdserve.workers.") and WORKER_FLOORS.index(worker_floor_of(target)) > mine:
                wrong.append(f"{module}:{line} imports {target} (above {worker_floor_of(module)})")
    assert not wrong, "\n".join(wrong)

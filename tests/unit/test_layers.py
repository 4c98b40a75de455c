"""Imports point down the layers docs/design.md states: scheduler < transport < workers <
cluster < bench < cli. A module may import its own layer and the ones below it, at module level
or inside a function; a type-only import under ``if TYPE_CHECKING:`` does not count."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("scheduler", "transport", "workers", "cluster", "bench", "cli")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imported_layers(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, layer) of every pdserve import in the file (absolute or relative)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = path.relative_to(root).parts[:-1]  # e.g. ("workers",) or ("workers", "model")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = list(package[:len(package) - node.level + 1])
                names = [".".join(["pdserve", *base, *(node.module.split(".") if node.module else [])])]
            else:
                names = [node.module or ""]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in LAYERS:
                out.append((node.lineno, parts[1]))
    return out


def test_imports_point_down_the_layers():
    wrong = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, target in _imported_layers(path):
                if LAYERS.index(target) > LAYERS.index(layer):
                    wrong.append(f"{rel}:{line} imports {target}/ (above {layer}/)")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a function-level and a relative import are seen, a TYPE_CHECKING
    one is not."""
    (tmp_path / "transport").mkdir()
    sample = tmp_path / "transport" / "probe.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..workers import kv_pool\n"
                      "def f():\n    from pdserve.cluster import metrics\n    from ..workers import engine\n"
                      "from .protocol import KVLayout\n")
    assert sorted(t for _, t in _imported_layers(sample, tmp_path)) == ["cluster", "transport", "workers"]

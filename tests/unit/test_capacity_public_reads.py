"""The capacity scheduler's modules (scheduler/capacity.py, capacity_plain.py with the plain fast
paths, capacity_common.py) read other objects only through their public names: the KV manager
through its SchedulingView and public methods, requests and the PEFT manager through their public
fields. A private attribute (leading underscore, dunders included) may be read only on ``self``
or ``cls``; getattr-style access with a private name counts as a read too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
CAPACITY_MODULES = [SCHEDULER / name for name in
                    ("capacity.py", "capacity_plain.py", "capacity_common.py")]
_BY_NAME = {"getattr", "setattr", "hasattr", "delattr"}


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every private attribute access on an object other than self/cls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _BY_NAME
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_checker_finds_private_reads() -> None:
    source = (
        "def f(self, kv, req):\n"
        "    a = self._kinds\n"
        "    b = kv._seqs.get\n"
        "    c = req._beams[0].tokens\n"
        "    d = kv.__dict__\n"
        "    e = getattr(kv, '_tree')\n"
        "    g = kv.scheduling_view().prefix_summary(req)\n"
    )
    assert sorted(line for line, _ in private_reads(source)) == [3, 4, 5, 6]


@pytest.mark.parametrize("path", CAPACITY_MODULES, ids=lambda p: p.name)
def test_capacity_reads_no_private_attribute_of_another_object(path: Path) -> None:
    assert private_reads(path.read_text()) == []

"""The capacity scheduler (scheduler/capacity.py) reads other objects only through their public
names: a KV pool through its SchedulingView and its ``start_scheduling`` and
``scheduling_remove_sequence``, requests and the PEFT manager through their public fields. A
private attribute (leading underscore, dunders included) may be read only on ``self`` or ``cls``;
getattr-style access with a private name counts as a read too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCHEDULER = Path(__file__).resolve().parents[2] / "scheduler"
CAPACITY_MODULES = [SCHEDULER / "capacity.py"]
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


# The names the capacity scheduler gives a KV pool, and what it may use of one besides its view.
_POOL_NAMES = {"kv", "cross_kv", "kv_cache_manager", "cross_kv_cache_manager"}
_POOL_CALLS = {"start_scheduling", "scheduling_remove_sequence"}


def test_capacity_reads_the_pools_only_through_their_views() -> None:
    source = (SCHEDULER / "capacity.py").read_text()
    used = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in _POOL_NAMES):
            used.add(node.attr)
    assert used == _POOL_CALLS


def test_the_fast_view_reads_no_private_attribute_of_the_pool() -> None:
    """kv_estimates.py reads a KV manager only through ``ViewSource``'s public accessors, so it
    needs nothing from kv_cache.py (which imports it) and the two form no import cycle."""
    assert private_reads((SCHEDULER / "kv_estimates.py").read_text()) == []

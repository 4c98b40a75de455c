"""Workers placed on one node load at the same time, so they must fit its memory together.

Each worker checks its own need (weights + KV pool, ``workers/loader.check_memory``) against what
its device has when it starts loading. Workers that start together on one node each read the
same MemAvailable before any of them has allocated, and all pass even when their sum does not
fit: the node then runs out of memory halfway through loading. So before any worker actor is
created, the launch sums the planned need of the CPU workers placed on each node (sized exactly
as the engine builder sizes them: ``workers/loading/memory.plan_model_dir``) and refuses the launch, naming
the node, each worker's figures and the total, when the sum exceeds that node's budget
(``loader.memory_budget("cpu")``: MemAvailable within the cgroup's limit, read on that node).

GPU workers are not summed: each has a GPU of its own (one per placement bundle), which its own
check reads. A node whose budget cannot be read, or a model this node cannot size (a directory
that exists only on the worker nodes), is left to the workers' own checks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("pdserve.launch")

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class PlannedWorker:
    """One worker's planned memory on its node: what it will hold once loaded."""

    worker_id: str
    node_id: str
    weight_bytes: int
    kv_bytes: int
    dtype: str

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def shortfalls(planned: list[PlannedWorker], budgets: dict[str, tuple[int, str] | None],
               node_names: dict[str, str] | None = None) -> list[str]:
    """One message per node whose workers together need more than its budget (node id ->
    (bytes, where the figure comes from), or None: unknown, not checked). Pure."""
    by_node: dict[str, list[PlannedWorker]] = {}
    for worker in planned:
        by_node.setdefault(worker.node_id, []).append(worker)
    out = []
    for node_id, workers in by_node.items():
        budget = budgets.get(node_id)
        total = sum(w.total for w in workers)
        if budget is None or total <= budget[0]:
            continue
        room, where = budget
        name = (node_names or {}).get(node_id)
        node = f"{name} ({node_id})" if name else node_id
        each = ", ".join(f"{w.worker_id} {_size(w.weight_bytes)} weights ({w.dtype}) + "
                         f"{_size(w.kv_bytes)} KV = {_size(w.total)}" for w in workers)
        out.append(f"node {node}: the {len(workers)} workers placed on it need {_size(total)} "
                   f"together ({each}), but only {_size(room)} is available there ({where}); "
                   "place fewer workers per node (--placement spread, more nodes), or give "
                   "them smaller KV pools (--num-kv-blocks, --kv-cache-memory-bytes) or a "
                   "smaller dtype (--dtype bfloat16)")
    return out


def plan(model_dir: Any, workers: list[tuple[str, str, dict[str, Any]]]) -> list[PlannedWorker]:
    """Each (worker id, node id, engine kwargs) of a CPU worker, planned as ``build_engine_core``
    will size it. Raises what sizing raises (a missing config.json, a bad engine setting)."""
    from pdserve.workers.config import EngineConfig
    from pdserve.workers.loading.memory import plan_model_dir

    out = []
    for worker_id, node_id, engine in workers:
        p = plan_model_dir(model_dir, EngineConfig.from_kwargs(engine), "cpu", check=False)
        out.append(PlannedWorker(worker_id, node_id, p.weight_bytes, p.kv_bytes,
                                 str(p.dtype).removeprefix("torch.")))
    return out


def _budget_here() -> tuple[int, str] | None:
    """This node's CPU memory budget (the loader's own figure), read where it runs."""
    from pdserve.workers.loading import loader

    return loader.memory_budget("cpu")


def node_budgets(node_ids: set[str], local_node: str,
                 local: Callable[[], tuple[int, str] | None] = _budget_here) -> dict[str, tuple[int, str] | None]:
    """Each node's budget: this node's read here, another's by a task pinned to it (no CPU
    asked: the placement group holds the node's CPUs). A node that does not answer: None."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out: dict[str, tuple[int, str] | None] = {}
    probe = ray.remote(num_cpus=0, max_retries=0)(_budget_here)
    refs = {}
    for node_id in node_ids:
        if node_id == local_node:
            out[node_id] = local()
        else:
            refs[node_id] = probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id, soft=False)).remote()
    for node_id, ref in refs.items():
        try:
            out[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # the workers' own checks still run there
            log.warning("node %s: its memory could not be read (%r); its workers check alone",
                        node_id, exc)
            out[node_id] = None
    return out

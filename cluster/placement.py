"""Where a launch's workers go: placement groups, and the checks made before any is placed.

Single-rank workers share one placement group (``--placement pack`` or ``spread``, a bundle
each). A worker group of N ranks (tensor parallelism) gets a placement group of its own, N
bundles ``STRICT_PACK``: Ray gang-schedules the ranks on one node or not at all, within the
launch's placement wait. Before anything is placed, a tensor-parallel size that the model's
heads (or experts) cannot be split by, or that no node has the CPUs or GPUs for, is refused
with the flag and the numbers; after placement, the memory of every rank placed on a node is
summed against that node's (node_memory.py).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pdserve.workers.process.names import actor_name

# The launch's LaunchConfig (launch.py imports this module, so it is not imported back).
LaunchConfig = Any

log = logging.getLogger("pdserve.launch")


class LaunchError(RuntimeError):
    """A launch that failed; what it had created is removed by then, and the message says why."""


def unplaceable(bundles: list[dict[str, float]], roles: list[str]) -> list[str]:
    """Which workers' bundles no live node of the cluster can hold now, each with what it asks
    and what the nodes offer (empty when every bundle fits some node)."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    offered = sorted({k for res in nodes for k in res
                      if not k.startswith("node:") and "_group_" not in k})
    return [f"{role} asks for {bundle}, and no node has it (the nodes offer: "
            f"{', '.join(offered)})"
            for role, bundle in zip(roles, bundles)
            if not any(all(res.get(k, 0) >= v for k, v in bundle.items()) for res in nodes)]


def place_workers(cfg: LaunchConfig, roles: list, tp_sizes: list[int], base: dict[str, float],
                  pg_box: list[Any]) -> list[tuple[Any, int, int]]:
    """Reserve every worker's resources, bounded by ``placement_timeout_s``: single-rank
    workers share one placement group (pack or spread, one bundle each); a worker group of N
    ranks gets its own of N bundles, ``STRICT_PACK`` (one node: its collectives and its plan
    stream stay there). Returns (placement group, first bundle, ranks) per worker."""
    import ray
    from ray.util.placement_group import placement_group

    names = [f"{p}-{i}" for p, i, *_ in roles]
    bundles = [{**base, **{k: float(v) for k, v in extra.items() if v}} for _, _, _, _, extra in roles]
    # A bundle no node can hold is said at once; the launch still waits (bounded) because an
    # autoscaler may add a node that has it.
    for line in unplaceable(bundles, names):
        log.warning("%s; waiting up to %.0f s for such a node to join", line, cfg.placement_timeout_s)
    placed: list[Any] = [None] * len(roles)
    single = [i for i, n in enumerate(tp_sizes) if n == 1]
    groups: list[tuple[str, Any, list[dict], list[str]]] = []
    if single:
        pg = placement_group([bundles[i] for i in single], name="pdserve-workers",
                             strategy="PACK" if cfg.placement == "pack" else "SPREAD")
        pg_box.append((pg, "pdserve-workers"))
        groups.append((f"{len(single)} bundles, {cfg.placement}", pg, [bundles[i] for i in single],
                       [names[i] for i in single]))
        for bundle, i in enumerate(single):
            placed[i] = (pg, bundle, 1)
    for i, n in enumerate(tp_sizes):
        if n > 1:
            name = actor_name(names[i])
            pg = placement_group([bundles[i]] * n, name=name, strategy="STRICT_PACK")
            pg_box.append((pg, name))
            groups.append((f"{names[i]}: {n} ranks, STRICT_PACK on one node", pg, [bundles[i]] * n,
                           [f"{names[i]} rank {r}" for r in range(n)]))
            placed[i] = (pg, 0, n)
    deadline = time.monotonic() + cfg.placement_timeout_s
    for what, pg, wanted, who in groups:
        try:
            ray.get(pg.ready(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            why = "; ".join(unplaceable(wanted, who))
            raise LaunchError(f"the workers' placement group ({what}) was not placed within "
                              f"{cfg.placement_timeout_s:.0f} s: "
                              f"{why or f'free resources now: {ray.available_resources()}'}") from None
    return placed


def check_worker_groups(cfg: LaunchConfig, roles: list, tp_sizes: list[int], model_dir: Path,
                        use_gpu: bool) -> None:
    """Refuse, before anything is placed, a tensor-parallel size the model cannot be split by
    (its heads, or its experts with expert parallelism) or that no node can hold (one CPU, or
    GPU, per rank on a single node), naming the flag and the numbers."""
    import ray

    from pdserve.workers.config import EngineConfig

    if any(n > 1 for n in tp_sizes) and any(p == "ctx" for p, *_ in roles):
        # Moving KV between groups means rank-to-rank sends along transport/tp_map.py's moves;
        # until the workers run them, a split model serves without context workers only.
        raise LaunchError("tensor parallelism (--tensor-parallel-size, --context-/--generation-"
                          "tensor-parallel-size > 1) runs with --num-context-workers 0 for now: "
                          "KV transfer between tensor-parallel worker groups is not available yet "
                          f"(asked: {sum(p == 'ctx' for p, *_ in roles)} context workers, TP sizes "
                          f"{', '.join(f'{p}-{i} {n}' for (p, i, *_), n in zip(roles, tp_sizes))})")
    unit = "GPU" if use_gpu else "CPU"
    biggest = max((n.get("Resources", {}).get(unit, 0) for n in ray.nodes() if n.get("Alive")), default=0)
    for (prefix, i, _, overrides, _), n in zip(roles, tp_sizes):
        if n == 1:
            continue
        flag = {"ctx": "--context-tensor-parallel-size", "gen": "--generation-tensor-parallel-size"}[prefix]
        if "tensor_parallel_size" not in overrides:
            flag = "--tensor-parallel-size"
        if n > biggest:
            raise LaunchError(f"{flag} {n} ({prefix}-{i}): a worker group's {n} ranks need {n} {unit}s on "
                              f"one node, and the largest node offers {biggest:g}")
        engine = EngineConfig.from_kwargs({**cfg.engine, **overrides})
        problem = tp_split_problem(model_dir, n, engine.enable_expert_parallel)
        if problem:
            raise LaunchError(f"{flag} {n} ({prefix}-{i}): {problem}")


def tp_split_problem(model_dir: Path, size: int, expert_parallel: bool) -> str:
    """Why the model cannot be split over ``size`` ranks ("" when it can): every rank's shard
    is built on the meta device, which raises the split's own error with the numbers."""
    import torch

    from pdserve.workers.loading.loader import ModelLoadError, load_config
    from pdserve.workers.model import build_model
    from pdserve.workers.model.parallel import TensorParallel, TPShapeError

    try:
        mcfg = load_config(model_dir)
    except ModelLoadError:
        return ""  # not readable here (a directory on the worker nodes only): the ranks check
    try:
        for rank in range(size):
            with torch.device("meta"):
                build_model(mcfg, dtype=torch.float32, device="meta",
                            tp=TensorParallel(rank, size, expert_parallel=expert_parallel))
    except TPShapeError as exc:
        return str(exc)
    return ""


def node_memory_shortfalls(cfg: LaunchConfig, roles: list, tp_sizes: list[int], placed: list,
                           model_dir: Path, use_gpu: bool) -> list[str]:
    """The nodes whose CPU workers (as placed) need more memory together than the node has
    (cluster/node_memory.py), one message each; empty when all fit or nothing can be checked
    (the workers' own checks still run). Every rank of a worker group counts: each holds its
    shard of the weights and its share of the KV pool."""
    import ray

    from . import node_memory

    nodes = bundle_nodes(placed)
    cpu_workers = []
    for index, (prefix, i, _, overrides, _) in enumerate(roles):
        engine = {**cfg.engine, **overrides}
        device = engine.get("device") or ("cuda" if use_gpu else "cpu")
        for rank in range(tp_sizes[index]):
            node = nodes.get((index, rank))
            if str(device).startswith("cpu") and node:
                name = f"{prefix}-{i}" + (f".rank{rank}" if rank else "")
                cpu_workers.append((name, node, engine))
    if not cpu_workers:
        return []
    try:
        planned = node_memory.plan(model_dir, cpu_workers)
    except Exception as exc:  # e.g. the directory exists only on the worker nodes
        log.warning("the workers' memory could not be sized on this node (%s); each worker "
                    "checks its own as it loads", exc)
        return []
    budgets = node_memory.node_budgets({w.node_id for w in planned},
                                       ray.get_runtime_context().get_node_id())
    names = {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    return node_memory.shortfalls(planned, budgets, names)


def bundle_nodes(placed: list) -> dict[tuple[int, int], str]:
    """(worker index, rank) -> the node its bundle was placed on."""
    from ray.util.placement_group import placement_group_table

    tables: dict[Any, dict] = {}
    out = {}
    for index, (pg, bundle, size) in enumerate(placed):
        if pg.id not in tables:
            tables[pg.id] = placement_group_table(pg).get("bundles_to_node_id", {})
        for rank in range(size):
            node = tables[pg.id].get(bundle + rank)
            if node:
                out[(index, rank)] = node
    return out


def workers_per_node(placed: list, tp_sizes: list[int]) -> list[int]:
    """For each worker, how many pdserve worker processes (every rank of a group) share its
    node: they share its cores."""
    nodes = bundle_nodes(placed)
    count: dict[Any, int] = {}
    for node in nodes.values():
        count[node] = count.get(node, 0) + 1
    return [count.get(nodes.get((index, 0)), 1) for index in range(len(placed))]

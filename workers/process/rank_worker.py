"""A worker group's follower ranks as Ray actors.

A worker with ``tensor_parallel_size`` N > 1 is N actors in one placement group of N bundles
(``STRICT_PACK``: one node, so the group's collectives and plan stream stay on that node). Rank
0 is the worker actor itself (``pdserve-ctx-0``: the engine core, the request channel, the KV
transfer); ranks 1 .. N-1 are ``RankWorker`` actors named after it (``pdserve-ctx-0.rank1``),
which the dashboard's Actors page lists beside it. Each runs ``runner.group.run_follower``: its
shard of every forward, no scheduling.

Lifecycle: rank 0 starts its followers while it builds its engine, after removing any left by
a previous incarnation of itself (a restart reuses the names). A follower's ``run`` returns
when rank 0 says stop or is gone (its plan stream closes, or stays silent past the group's
deadline), and the actor then exits: Ray never restarts a follower (``max_restarts=0``); the
group restarts through rank 0, whose next step fails once a follower is gone.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray

from pdserve.workers.process.names import NAMESPACE, actor_name

log = logging.getLogger("pdserve.worker")

EXIT_DELAY_S = 0.2  # lets run()'s reply reach rank 0 before the process goes


def rank_actor_name(worker_id: str, rank: int) -> str:
    """``ctx-0``, 1 -> ``pdserve-ctx-0.rank1``."""
    return actor_name(f"{worker_id}.rank{rank}")


@ray.remote(max_restarts=0, max_task_retries=0)
class RankWorker:
    def __init__(self, worker_id: str, rank: int) -> None:
        self.worker_id, self.rank = worker_id, rank

    def __repr__(self) -> str:
        return f"RankWorker({self.worker_id}.rank{self.rank})"

    def run(self, model_dir: str, engine: dict[str, Any], address: Any, pool_blocks: int,
            dtype_name: str, device: str, threads: int | None) -> int:
        """Follow rank 0 until it stops (returns the steps run); the actor exits after."""
        import torch

        from pdserve.workers.config import EngineConfig
        from pdserve.workers.runner.group import GroupBroken, run_follower

        try:
            return run_follower(model_dir, EngineConfig.from_kwargs(engine), address, self.rank, pool_blocks,
                                getattr(torch, dtype_name), device, threads=threads)
        except GroupBroken as exc:
            log.warning("%s.rank%d stops: %s", self.worker_id, self.rank, exc)
            return -1
        finally:
            threading.Thread(target=lambda: (time.sleep(EXIT_DELAY_S), os._exit(0)), daemon=True).start()

    def ping(self) -> str:
        return "pong"


class RayFollowers:
    """``build_engine_core``'s ``start_followers`` for a Ray worker: ranks 1 .. N-1 as
    ``RankWorker`` actors in bundles 1 .. N-1 of the worker's own placement group."""

    def __init__(self, worker_id: str, env: dict[str, str], num_gpus: float,
                 model_dir: str, config: Any, address: Any, pool_blocks: int, dtype: Any, device: str, *,
                 threads: int | None = None) -> None:
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group()
        if pg is None or pg.bundle_count < address.size:
            raise RuntimeError(f"{worker_id}: a worker group of {address.size} ranks needs a placement group "
                               f"of {address.size} bundles (found {pg.bundle_count if pg else 'none'})")
        self.handles: list[Any] = []
        self.refs: list[Any] = []
        for rank in range(1, address.size):
            name = rank_actor_name(worker_id, rank)
            _remove_stale(name)
            handle = RankWorker.options(
                name=name, namespace=NAMESPACE, num_cpus=1, num_gpus=num_gpus,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(worker_id, rank)
            self.handles.append(handle)
            self.refs.append(handle.run.remote(model_dir, config.to_dict(), address, pool_blocks,
                                               str(dtype).removeprefix("torch."), device, threads))

    def close(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) for the followers to stop after rank 0 said so; kill the rest."""
        try:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a dead follower's ref raises; it is gone either way
            pass
        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


def _remove_stale(name: str) -> None:
    """A previous incarnation's follower of this name (rank 0 restarted): kill it and wait
    (bounded) until the name is free."""
    try:
        old = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    ray.kill(old, no_restart=True)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the previous actor {name} did not go away within 30 s")

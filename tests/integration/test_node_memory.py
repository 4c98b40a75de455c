"""A launch whose workers fit a node's memory one at a time but not together is refused before
any worker loads, with a message naming the node, each worker's figures and the total, and
leaves nothing behind (cluster/node_memory.py). The node's budget is faked in this process:
the launch reads its own node's budget here (loader.memory_budget)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster_util as U  # noqa: E402

from pdserve.cluster import node_memory  # noqa: E402
from pdserve.cluster.launch import LaunchError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _leftovers() -> tuple[list[str], list[str]]:
    import ray

    actors = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
              if e["name"].startswith("pdserve-")]
    groups = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
              if pg.get("name") == "pdserve-workers" and pg.get("state") != "REMOVED"]
    return actors, groups


def test_workers_that_fit_a_node_alone_but_not_together_are_refused(ray_cluster, model_dir,
                                                                    monkeypatch):
    import ray

    from pdserve.workers.loading import loader

    (one,) = node_memory.plan(model_dir, [("any", "node", U.ENGINE)])
    budget = one.total * 3 // 2  # room for one worker, not for two
    monkeypatch.setattr(loader, "memory_budget",
                        lambda device: (budget, "cpu (a test's budget)") if str(device) == "cpu"
                        else None)
    with pytest.raises(LaunchError) as err:
        U.start_cluster(model_dir, num_context_workers=1, num_generation_workers=1)
    message = str(err.value)
    print("\nlaunch over the node's memory:", message)
    here = ray.get_runtime_context().get_node_id()
    assert f"node {ray.util.get_node_ip_address()} ({here}): the 2 workers placed on it need" in message
    assert "ctx-0 " in message and "gen-0 " in message and "together" in message
    assert "a test's budget" in message
    assert "removed what it had created: placement group" in message  # no actor was created
    U.wait_for(lambda: _leftovers() == ([], []), 60, "the failed launch's group to go")

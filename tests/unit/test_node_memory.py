"""Workers placed on one node must fit its memory together (cluster/node_memory.py): the pure
sum and refusal, and the planned figures are the ones each worker's own check uses."""
from __future__ import annotations

import pytest

from pdserve.cluster import node_memory
from pdserve.cluster.node_memory import PlannedWorker, shortfalls

GiB = 2**30


def test_workers_that_fit_alone_are_refused_together_with_every_figure_named():
    planned = [PlannedWorker("ctx-0", "aa11", 4 * GiB, 2 * GiB, "float32"),
               PlannedWorker("gen-0", "aa11", 4 * GiB, 2 * GiB, "float32"),
               PlannedWorker("gen-1", "bb22", 4 * GiB, 2 * GiB, "float32")]
    budgets = {"aa11": (10 * GiB, "cpu (MemAvailable)"), "bb22": (10 * GiB, "cpu (MemAvailable)")}
    (message,) = shortfalls(planned, budgets, {"aa11": "10.0.0.1", "bb22": "10.0.0.2"})
    assert message.startswith("node 10.0.0.1 (aa11): the 2 workers placed on it need 12.0 GiB "
                              "together (")
    assert "ctx-0 4.0 GiB weights (float32) + 2.0 GiB KV = 6.0 GiB" in message
    assert "gen-0 4.0 GiB weights (float32) + 2.0 GiB KV = 6.0 GiB" in message
    assert "but only 10.0 GiB is available there (cpu (MemAvailable))" in message
    assert "gen-1" not in message  # alone on its node, and it fits
    # Every worker fits alone: each one's own check would have passed.
    assert all(w.total <= 10 * GiB for w in planned)


def test_a_node_that_fits_or_whose_budget_is_unknown_is_not_refused():
    planned = [PlannedWorker("ctx-0", "aa11", GiB, GiB, "bfloat16"),
               PlannedWorker("gen-0", "aa11", GiB, GiB, "bfloat16")]
    assert shortfalls(planned, {"aa11": (4 * GiB, "x")}) == []
    assert shortfalls(planned, {"aa11": None}) == []
    assert len(shortfalls(planned, {"aa11": (4 * GiB - 1, "x")})) == 1


def test_the_plan_is_what_each_worker_checks_before_it_loads(tmp_path, monkeypatch):
    from pdserve.workers.config import EngineConfig
    from pdserve.workers.engine.build import build_engine_core
    from pdserve.workers.loading import memory
    from pdserve.workers.loading.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", vocab_size=300)
    kwargs = dict(tokens_per_block=8, num_kv_blocks=40, max_batch_size=4)
    (planned,) = node_memory.plan(model, [("gen-0", "aa11", kwargs)])
    seen = []

    def check(weights, kv, dtype, device, budget=None):
        seen.append((weights, kv, str(dtype).removeprefix("torch.")))
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(memory, "check_memory", check)
    with pytest.raises(RuntimeError, match="stop before loading"):
        build_engine_core(str(model), EngineConfig.from_kwargs({**kwargs, "device": "cpu"}))
    assert seen == [(planned.weight_bytes, planned.kv_bytes, planned.dtype)]
    assert planned.weight_bytes > 0 and planned.kv_bytes > 0 and planned.dtype == "float32"

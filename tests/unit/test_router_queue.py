"""The router core's admission queue (cluster/router/queue.py), without a cluster: priority
order, the in-flight cap, the agent-tree order, cancelled entries, and its invariants."""
from __future__ import annotations

import pytest

from pdserve.cluster.router import RouterConfig
from pdserve.cluster.router.queue import RequestQueue
from pdserve.cluster.router.request_state import RouterRequest
from pdserve.cluster.text_stream import TextStream
from pdserve.cluster.validation import GenerateSpec
from pdserve.scheduler import AgentTreePolicy, LlmRequest
from pdserve.transport.requests.sampling import SamplingParams


def _request(internal: int, priority: float = 0.5, agent: str | None = None) -> RouterRequest:
    hierarchy = [(agent, internal)] if agent else None
    entry = LlmRequest(internal, [1, 2, 3], 4, priority=priority, agent_hierarchy=hierarchy)
    return RouterRequest(internal, f"r{internal}", GenerateSpec(token_ids=(1, 2, 3), priority=priority),
                         [1, 2, 3], SamplingParams(), entry, 0.0, 100.0, TextStream(lambda ids: ""))


def test_priority_order_and_the_in_flight_cap():
    q = RequestQueue(max_queue=8, max_inflight=2, reorder=None)
    for i, p in enumerate([0.5, 0.9, 0.5, 0.1], start=1):
        q.add(_request(i, p))
    assert [r.internal_id for r in q.take_ready()] == [2, 1]  # higher priority first, then FIFO
    assert q.inflight == 2 and len(q) == 2 and list(q.take_ready()) == []
    q.release()
    assert [r.internal_id for r in q.take_ready()] == [3]
    assert list(q.dispatch_log) == ["r2", "r1", "r3"] and q.violations() == []


def test_a_cancelled_or_forgotten_entry_is_skipped_and_the_maps_stay_in_step():
    q = RequestQueue(max_queue=2, max_inflight=4, reorder=None)
    a, b = _request(1), _request(2)
    q.add(a)
    q.add(b)
    assert q.is_full() and q.holds("r1") and q.find("r2") is b
    a.cancelled = True
    assert [r.internal_id for r in q.take_ready()] == [2]
    q.forget(a)
    assert not q.holds("r1") and q.violations() == []
    q.waiting.append(_request(9).queue_entry)  # an entry whose request the router never held
    assert any("without a request" in v for v in q.violations())


def test_the_agent_tree_orders_each_round():
    tree = AgentTreePolicy(1.0, ["AgentDeepResearch"], None)
    q = RequestQueue(max_queue=8, max_inflight=8, reorder=tree)
    q.add(_request(1))  # a chatbot request first
    q.add(_request(2, agent="AgentDeepResearch"))
    assert [r.internal_id for r in q.take_ready()] == [2, 1]  # agent_percentage 1: agents first


@pytest.mark.parametrize("budget", [0, -1])
def test_an_agent_budget_that_would_stall_the_queue_is_refused(budget):
    with pytest.raises(ValueError, match="agent_inflight_seq_num: must be >= 1"):
        RouterConfig(agent_types=("AgentDeepResearch",), agent_percentage=0.5,
                     agent_inflight_seq_num=budget)

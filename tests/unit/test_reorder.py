"""AgentTree reorder policy and priority insertion: scheduling.md 5."""
from __future__ import annotations

import random

import pytest

from pdserve.scheduler.reorder import (
    ACCEPTED_AGENT_TYPE_NAMES,
    AGENT_TYPE_NAMES,
    AgentTreePolicy,
    insert_request_in_order,
)
from pdserve.scheduler.request import LlmRequest, LlmRequestState

S = LlmRequestState


def req(rid: int, hierarchy=None, *, state: S = S.CONTEXT_INIT, priority: float = 0.5) -> LlmRequest:
    r = LlmRequest(rid, [1, 2, 3], 4, agent_hierarchy=hierarchy, priority=priority)
    r.state = state
    return r


def ids(requests) -> list[int]:
    return [r.request_id for r in requests]


def dr(rid: int, node: int) -> LlmRequest:
    return req(rid, [("AgentDeepResearch", node)])


def researcher(rid: int, node: int) -> LlmRequest:
    return req(rid, [("Researcher", node)])


def mixed_requests() -> list[LlmRequest]:
    return [
        req(10),
        dr(5, 2),
        req(12, [("Mystery", 0)]),  # unknown type -> Chatbot
        dr(1, 9),
        researcher(2, 0),
        req(11),
        dr(3, 1),
        researcher(4, 5),
        req(13, [("AgentChatbot", 0)]),  # the root's own type is no child -> Chatbot
    ]


# Deep-research leaf by node id: [3, 5, 1]; researcher leaf: [2, 4]; merged by request id with the
# tail of the last list appended: [2, 3, 4, 5, 1]. Chatbot keeps arrival order: [10, 12, 11, 13].
AGENTS = [2, 3, 4, 5, 1]
CHATBOT = [10, 12, 11, 13]
TYPES = ["AgentDeepResearch", "Researcher"]


def test_known_type_names_are_exported():
    assert set(AGENT_TYPE_NAMES) == {
        "Chatbot", "AgentChatbot", "AgentDeepResearch", "Researcher", "MultiroundChat"
    }
    assert {"agent_deep_research", "multiround_chat", "agent_chatbot"} <= ACCEPTED_AGENT_TYPE_NAMES


def test_without_a_tree_the_list_is_unchanged():
    requests = mixed_requests() + [req(20, state=S.GENERATION_IN_PROGRESS)]
    for types in (None, []):
        policy = AgentTreePolicy(-1.0, types, 1)  # no tree: no ratio check, no truncation
        assert ids(policy.reorder(requests)) == ids(requests)


def test_ratio_outside_unit_interval_is_rejected_when_a_tree_is_built():
    for bad in (-1.0, 1.5):
        with pytest.raises(ValueError, match="agent_percentage"):
            AgentTreePolicy(bad, TYPES, 100)


def test_unknown_configured_type_raises_naming_it():
    with pytest.raises(ValueError, match="'DeepThought'"):
        AgentTreePolicy(0.5, ["Researcher", "DeepThought"], 100)


def test_ratio_one_puts_agents_first_and_zero_puts_chatbot_first():
    assert ids(AgentTreePolicy(1.0, TYPES, 100).reorder(mixed_requests())) == AGENTS + CHATBOT
    assert ids(AgentTreePolicy(0.0, TYPES, 100).reorder(mixed_requests())) == CHATBOT + AGENTS


def test_snake_case_names_map_to_the_same_types():
    snake = AgentTreePolicy(1.0, ["agent_deep_research", "researcher"], 100)
    assert ids(snake.reorder(mixed_requests())) == AGENTS + CHATBOT


def test_unconfigured_agent_type_goes_to_chatbot():
    # Researcher is registered but not configured: its requests join the chatbot list in arrival order.
    policy = AgentTreePolicy(1.0, ["AgentDeepResearch"], 100)
    assert ids(policy.reorder(mixed_requests())) == [3, 5, 1, 10, 12, 2, 11, 4, 13]


def test_interleave_draws_once_per_slot_from_the_seeded_generator():
    policy = AgentTreePolicy(0.5, TYPES, 100, seed=7)
    rng = random.Random(7)
    expected_runs = []
    for _ in range(3):  # the generator's state carries over between calls
        agents, chatbot, out = list(AGENTS), list(CHATBOT), []
        while agents and chatbot:
            out.append(agents.pop(0) if rng.random() < 0.5 else chatbot.pop(0))
        expected_runs.append(out + agents + chatbot)
    assert [ids(policy.reorder(mixed_requests())) for _ in range(3)] == expected_runs


def test_same_seed_reproduces_and_instances_are_independent():
    many = [req(i, [("MultiroundChat", i)]) if i % 2 else req(i) for i in range(40)]
    a = AgentTreePolicy(0.5, ["MultiroundChat"], 100, seed=3)
    b = AgentTreePolicy(0.5, ["MultiroundChat"], 100, seed=3)
    other = AgentTreePolicy(0.5, ["MultiroundChat"], 100, seed=3)
    runs_a = []
    runs_b = []
    for _ in range(4):
        runs_a.append(ids(a.reorder(many)))
        other.reorder(many)  # drawing from another instance must not disturb b
        runs_b.append(ids(b.reorder(many)))
    assert runs_a == runs_b
    assert len({tuple(run) for run in runs_a}) > 1  # state persists: successive calls differ
    assert ids(AgentTreePolicy(0.5, ["MultiroundChat"], 100, seed=4).reorder(many)) != runs_a[0]


def test_generation_requests_stay_first_in_order():
    g1 = req(30, [("Researcher", 0)], state=S.GENERATION_IN_PROGRESS)
    g2 = req(31, state=S.DISAGG_GENERATION_TRANS_COMPLETE)
    requests = mixed_requests()
    requests.insert(3, g2)
    requests.insert(1, g1)
    out = AgentTreePolicy(1.0, TYPES, 100).reorder(requests)
    assert ids(out) == [30, 31] + AGENTS + CHATBOT


def test_truncation_keeps_inflight_budget_minus_generation_count():
    gens = [req(40 + i, state=S.GENERATION_IN_PROGRESS) for i in range(2)]
    out = AgentTreePolicy(1.0, TYPES, 5).reorder(mixed_requests() + gens)
    assert ids(out) == [40, 41] + AGENTS[:3]
    many_gens = [req(50 + i, state=S.GENERATION_IN_PROGRESS) for i in range(7)]
    out = AgentTreePolicy(1.0, TYPES, 5).reorder(mixed_requests() + many_gens)
    assert ids(out) == ids(many_gens)  # generation is never truncated


def test_leaf_sorts_by_node_id_and_keeps_deeper_hierarchies():
    deep = req(7, [("AgentDeepResearch", 0), ("Researcher", 3)])
    out = AgentTreePolicy(1.0, ["AgentDeepResearch"], 100).reorder([dr(8, 4), deep, dr(9, 2)])
    assert ids(out) == [7, 9, 8]


def test_insert_request_in_order_is_priority_then_fifo():
    queue: list[LlmRequest] = []
    for rid, priority in [(1, 0.5), (2, 0.9), (3, 0.5), (4, 0.1), (5, 0.9), (6, 0.5)]:
        insert_request_in_order(queue, req(rid, priority=priority))
    assert ids(queue) == [2, 5, 1, 3, 6, 4]

"""Request ordering: the AgentTree reorder policy and priority insertion.

TensorRT-LLM agentTree.cpp semantics (scheduling.md 5), except that the
random interleave draws from a ``random.Random`` owned by the policy instance, so an ordering is
reproducible from the seed and instances never disturb each other. Pure Python, stdlib only.
"""
from __future__ import annotations

import enum
import heapq
import logging
import random
from typing import Iterable, Sequence

from .request import LlmRequest

logger = logging.getLogger(__name__)


class AgentType(enum.Enum):
    CHATBOT = "Chatbot"
    AGENT_CHATBOT = "AgentChatbot"
    AGENT_DEEP_RESEARCH = "AgentDeepResearch"
    RESEARCHER = "Researcher"
    MULTIROUND_CHAT = "MultiroundChat"


# Canonical (registered) names, UpperCamelCase as TensorRT-LLM registers them.
AGENT_TYPE_NAMES: tuple[str, ...] = tuple(t.value for t in AgentType)


def _snake_case(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


_TYPE_BY_NAME: dict[str, AgentType] = {}
for _type in AgentType:
    _TYPE_BY_NAME[_type.value] = _type
    _TYPE_BY_NAME[_snake_case(_type.value)] = _type  # "agent_deep_research", as in README examples
del _type

# Every spelling accepted in a config or a request's hierarchy.
ACCEPTED_AGENT_TYPE_NAMES: frozenset[str] = frozenset(_TYPE_BY_NAME)

# Leaves ordered by node id; Chatbot keeps arrival order.
_NODE_ID_ORDERED = frozenset(
    {AgentType.AGENT_DEEP_RESEARCH, AgentType.RESEARCHER, AgentType.MULTIROUND_CHAT}
)


def parse_agent_type(name: str | AgentType) -> AgentType:
    """Strict lookup (config path): an unknown name raises ValueError naming it."""
    if isinstance(name, AgentType):
        return name
    try:
        return _TYPE_BY_NAME[name]
    except KeyError:
        raise ValueError(
            f"unknown agent type {name!r}; known types: {', '.join(AGENT_TYPE_NAMES)} "
            f"(or their snake_case spellings)"
        ) from None


class AgentTreePolicy:
    """Orders the non-generation requests by the agent tree and truncates them to the in-flight
    budget; generation-in-progress requests stay in front, untouched.

    Tree: an AgentChatbot root with one child per configured agent type and a Chatbot child.
    A request with a hierarchy of depth d sits at the node of level d - 1 on the path its type
    names give; no hierarchy or an unknown type sends it to the Chatbot child.
    """

    def __init__(
        self,
        agent_percentage: float,
        agent_types: Iterable[str | AgentType] | None,
        agent_inflight_seq_num: int | None,
        seed: int = 42,
    ) -> None:
        types = [parse_agent_type(t) for t in agent_types] if agent_types else []
        self.agent_percentage = agent_percentage
        self.agent_inflight_seq_num = agent_inflight_seq_num
        # Root and Chatbot are always there; naming them in the config adds no child.
        children: list[AgentType] = []
        for t in types:
            if t not in (AgentType.AGENT_CHATBOT, AgentType.CHATBOT) and t not in children:
                children.append(t)
        self._agent_children = tuple(children)
        self.has_tree = bool(types)
        if self.has_tree and not 0.0 <= agent_percentage <= 1.0:
            raise ValueError(f"agent_percentage must lie in [0, 1], got {agent_percentage}")
        # Persists across calls, like TensorRT-LLM's thread_local generator.
        self._rng = random.Random(seed)

    def reorder(self, requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        if not self.has_tree:
            return list(requests)
        generation = [r for r in requests if r.is_generation_in_progress_state]
        others = [r for r in requests if not r.is_generation_in_progress_state]
        if not others:
            return generation
        ordered = self._tree_order(others)
        limit = self.agent_inflight_seq_num
        if limit is not None:
            del ordered[max(0, limit - len(generation)) :]
        return generation + ordered

    # ---- tree ----------------------------------------------------------------------------------
    def _tree_order(self, requests: list[LlmRequest]) -> list[LlmRequest]:
        agent_lists: dict[AgentType, list[LlmRequest]] = {t: [] for t in self._agent_children}
        chatbot: list[LlmRequest] = []
        for req in requests:
            hierarchy = req.agent_hierarchy
            if not hierarchy:
                chatbot.append(req)
                continue
            agent_type = _TYPE_BY_NAME.get(hierarchy[0][0])
            bucket = agent_lists.get(agent_type) if agent_type is not None else None
            if bucket is None:
                if agent_type is not AgentType.CHATBOT:
                    logger.warning(
                        "request %s: agent type %r is not in the tree; treated as Chatbot",
                        req.request_id,
                        hierarchy[0][0],
                    )
                chatbot.append(req)
            else:
                # Leaves have no children: a deeper hierarchy stays at its level-0 node.
                bucket.append(req)

        merged_inputs = [
            sorted(reqs, key=_node_id_at_level0) if t in _NODE_ID_ORDERED else reqs
            for t, reqs in agent_lists.items()
        ]
        # k-way merge by request id (each list keeps its own order; ties favour earlier types).
        agents = list(heapq.merge(*merged_inputs, key=_request_id))
        return self._interleave(agents, chatbot)

    def _interleave(self, agents: list[LlmRequest], chatbot: list[LlmRequest]) -> list[LlmRequest]:
        """One Bernoulli draw per slot while both sides last: agent with probability p."""
        out: list[LlmRequest] = []
        p = self.agent_percentage
        draw = self._rng.random
        i = j = 0
        while i < len(agents) and j < len(chatbot):
            if draw() < p:
                out.append(agents[i])
                i += 1
            else:
                out.append(chatbot[j])
                j += 1
        out.extend(agents[i:])
        out.extend(chatbot[j:])
        return out


def _node_id_at_level0(req: LlmRequest) -> int:
    return req.agent_hierarchy[0][1]  # type: ignore[index]


def _request_id(req: LlmRequest) -> int:
    return req.request_id


def insert_request_in_order(requests: list[LlmRequest], request: LlmRequest) -> None:
    """Insert in place before the first request of strictly lower priority, so the list stays
    sorted by descending priority and equal priorities keep arrival (FIFO) order."""
    priority = request.priority
    for index, other in enumerate(requests):
        if other.priority < priority:
            requests.insert(index, request)
            return
    requests.append(request)

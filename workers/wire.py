"""The one conversion between a worker's objects and the msgpack maps the request path carries
(the request channel, Ray's ``generate``, the RPC worker processes), so the three never drift.

A request on the wire: ``request_id`` (the router's attempt id), ``client_id``, ``prompt``,
``max_new_tokens``, ``priority``, ``type`` (an ``LlmRequestType`` name), ``agent_hierarchy``
(``[[agent_type, node_id], ...]`` or None), ``context_phase_params`` (a map or None); the
request channel adds ``sampling``, ``deadline_s`` and ``forced_tokens`` (read by the hosts).
An update: the ``RequestUpdate`` fields, ``context_phase_params`` as a map.
"""
from __future__ import annotations

from typing import Any

from pdserve.scheduler import ContextPhaseParams, LlmRequest, LlmRequestType


def params_to_wire(cpp: ContextPhaseParams) -> dict[str, Any]:
    return {
        "ctx_request_id": cpp.ctx_request_id,
        "first_gen_tokens": list(cpp.first_gen_tokens),
        "opaque_state": cpp.opaque_state,
        "prompt_token_ids": cpp.prompt_token_ids,
        "ctx_worker_id": cpp.ctx_worker_id,
        "num_blocks": cpp.num_blocks,
    }


def request_to_wire(request: LlmRequest) -> dict[str, Any]:
    cpp = request.context_phase_params
    return {
        "request_id": request.request_id,
        "client_id": request.client_id,
        "prompt": list(request.get_prompt_tokens()),
        "max_new_tokens": request.max_new_tokens,
        "priority": request.priority,
        "type": request.llm_request_type.name,
        "agent_hierarchy": [list(level) for level in request.agent_hierarchy]
        if request.agent_hierarchy is not None else None,
        "context_phase_params": params_to_wire(cpp) if cpp is not None else None,
    }


def request_from_wire(d: dict[str, Any]) -> LlmRequest:
    """Raises KeyError, TypeError or ValueError for a malformed request."""
    cpp = d.get("context_phase_params")
    return LlmRequest(
        d["request_id"],
        d["prompt"],
        d["max_new_tokens"],
        priority=d.get("priority", 0.5),
        agent_hierarchy=d.get("agent_hierarchy"),
        llm_request_type=LlmRequestType[d.get("type", "CONTEXT_AND_GENERATION")],
        context_phase_params=ContextPhaseParams(**cpp) if cpp else None,
        client_id=d.get("client_id"),
    )


def update_to_wire(update) -> dict[str, Any]:
    d = update._asdict()
    if update.context_phase_params is not None:
        d["context_phase_params"] = params_to_wire(update.context_phase_params)
    return d

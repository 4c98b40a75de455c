"""pdserve.scheduler: pure-Python scheduling with TensorRT-LLM batch-manager semantics.

Stdlib only (no torch, ray, grpc or numpy); the public names below are the stable interface
listed in docs/design.md section 11, whose semantics docs/scheduling.md gives rule by rule.
"""
from __future__ import annotations

from .capacity import CapacityOutput, CapacityScheduler, CapacitySchedulerPolicy
from .kv_cache import KVCacheManager
from .kv_prefix_reuse import PrefixReuseSummary
from .micro_batch import ContextChunkingConfig, ContextChunkingPolicy, MicroBatchScheduler
from .peft import PeftCacheManager
from .reorder import AGENT_TYPE_NAMES, AgentTreePolicy, insert_request_in_order
from .request import ContextPhaseParams, LlmRequest, LlmRequestState, LlmRequestType
from .scheduler import SchedulerOutput, SimpleScheduler

__all__ = [
    "AGENT_TYPE_NAMES",
    "AgentTreePolicy",
    "CapacityOutput",
    "CapacityScheduler",
    "CapacitySchedulerPolicy",
    "ContextChunkingConfig",
    "ContextChunkingPolicy",
    "ContextPhaseParams",
    "KVCacheManager",
    "LlmRequest",
    "LlmRequestState",
    "LlmRequestType",
    "MicroBatchScheduler",
    "PeftCacheManager",
    "PrefixReuseSummary",
    "SchedulerOutput",
    "SimpleScheduler",
    "insert_request_in_order",
]

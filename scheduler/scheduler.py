"""SimpleScheduler: capacity pass, then micro-batch pass (TensorRT-LLM PyExecutor's scheduler).

scheduling.md 6. The capacity pass decides who holds resources (and whom
to pause); the micro-batch pass picks this step's batch among the fitting requests. Pure Python.
"""
from __future__ import annotations

from typing import AbstractSet, Any, NamedTuple, Sequence

from .capacity import CapacityScheduler
from .micro_batch import MicroBatchScheduler
from .request import LlmRequest


class SchedulerOutput(NamedTuple):
    context_requests: list[LlmRequest]
    generation_requests: list[LlmRequest]
    paused_requests: list[LlmRequest]
    # Disaggregated generation-only requests whose KV the executor must reserve now.
    fitting_disagg_gen_init_requests: list[LlmRequest]
    num_fitting_requests: int


class SimpleScheduler:
    """Holds the managers and the step limits; ``schedule`` takes only the requests."""

    def __init__(
        self,
        capacity_scheduler: CapacityScheduler,
        micro_batch_scheduler: MicroBatchScheduler,
        *,
        kv_cache_manager: Any = None,
        peft_cache_manager: Any = None,
        cross_kv_cache_manager: Any = None,
        max_batch_size: int,
        max_num_tokens: int | None = None,
    ) -> None:
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be > 0, got {max_batch_size}")
        if max_num_tokens is not None and max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be > 0 or None, got {max_num_tokens}")
        self.capacity_scheduler = capacity_scheduler
        self.micro_batch_scheduler = micro_batch_scheduler
        self.kv_cache_manager = kv_cache_manager
        self.peft_cache_manager = peft_cache_manager
        self.cross_kv_cache_manager = cross_kv_cache_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens

    def schedule(
        self,
        active_requests: Sequence[LlmRequest],
        inflight_request_ids: AbstractSet[int] | None = None,
    ) -> SchedulerOutput:
        fitting, fitting_gen_init, paused = self.capacity_scheduler.schedule(
            active_requests,
            kv_cache_manager=self.kv_cache_manager,
            peft_cache_manager=self.peft_cache_manager,
            cross_kv_cache_manager=self.cross_kv_cache_manager,
        )
        context, generation = self.micro_batch_scheduler.schedule(
            fitting, inflight_request_ids or frozenset(), self.max_batch_size, self.max_num_tokens
        )
        return SchedulerOutput(
            context, generation, list(paused), list(fitting_gen_init), len(fitting)
        )

    def can_schedule(self, requests: Sequence[LlmRequest]) -> bool:
        """True when the capacity pass admits every one of ``requests``.

        MAX_UTILIZATION's pass resets the KV manager's scheduling counters (never real blocks),
        exactly as a real ``schedule`` call would."""
        fitting, _, _ = self.capacity_scheduler.schedule(
            requests,
            kv_cache_manager=self.kv_cache_manager,
            peft_cache_manager=self.peft_cache_manager,
            cross_kv_cache_manager=self.cross_kv_cache_manager,
        )
        return len(fitting) == len(requests)

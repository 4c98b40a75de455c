"""Capacity scheduler: which active requests may hold KV (and LoRA) resources this iteration.

Reference: trtllm-scheduling.md section 2 (newest capacityScheduler.cpp). Policies:

* MaxRequests (no KV manager): the first ``max_num_requests`` requests in the band.
* GUARANTEED_NO_EVICT / STATIC_BATCH: reserve blocks to completion; never pause.
* MAX_UTILIZATION: reserve blocks for the next step; pause started requests from the back.

This module holds the dispatch, MaxRequests and the generic path of each policy. The plain fast
paths for an exact ``KVCacheManager`` are in capacity_plain.py (``PlainKVPathsMixin``, inherited);
``CapacityOutput``, the state kinds and the prefix-aware skipping helpers in capacity_common.py.

Pure Python, stdlib only. The KV, PEFT and cross-KV managers are read only through the names
listed in DESIGN.md, so test doubles with those names can stand in.
"""
from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence

from .blocks_manager import MaxUtilizationScheduledBlocksManager, NoEvictScheduledBlocksManager
from .capacity_common import (
    _CONTEXT, _ENCODER, _GEN_INIT, _INT_MAX, _RUNNING, _S, _SKIP, _TRANSFER, _ZERO_SUMMARY,
    CapacityOutput, _beneficial_to_skip, _register_contribution, _reuse_walk_allowed, _state_kinds,
)
from .capacity_plain import PlainKVPathsMixin, _is_plain_kv
from .request import LlmRequest, LlmRequestState

__all__ = ["CapacityScheduler", "CapacitySchedulerPolicy", "ReorderPolicy"]


class CapacitySchedulerPolicy(enum.IntEnum):
    """Values as in TensorRT-LLM's executor enum."""

    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


class ReorderPolicy(Protocol):
    def reorder(self, requests: list[LlmRequest]) -> list[LlmRequest]: ...


class CapacityScheduler(PlainKVPathsMixin):
    """Chooses the requests that hold resources this iteration (reference section 2).

    ``schedule`` returns the policy's scheduled list split into disaggregated gen-init requests and
    the rest, order preserved, plus the requests MAX_UTILIZATION paused."""

    def __init__(
        self,
        max_num_requests: int,
        policy: CapacitySchedulerPolicy | str = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        *,
        has_kv_cache_manager: bool = True,
        two_steps_look_ahead: bool = False,
        no_schedule_until_state: LlmRequestState = LlmRequestState.CONTEXT_INIT,
        no_schedule_after_state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
        enable_prefix_aware_scheduling: bool = True,
    ) -> None:
        if max_num_requests < 0:
            raise ValueError(f"max_num_requests must be >= 0, got {max_num_requests}")
        if isinstance(policy, str):
            policy = CapacitySchedulerPolicy[policy.upper()]
        self.max_num_requests = max_num_requests
        self.policy = CapacitySchedulerPolicy(policy)
        self.has_kv_cache_manager = has_kv_cache_manager
        self.two_steps_look_ahead = two_steps_look_ahead
        self.no_schedule_until_state = LlmRequestState(no_schedule_until_state)
        self.no_schedule_after_state = LlmRequestState(no_schedule_after_state)
        self.enable_prefix_aware_scheduling = enable_prefix_aware_scheduling
        self._kinds = _state_kinds(self.no_schedule_until_state, self.no_schedule_after_state)
        self._reorder_policy: ReorderPolicy | None = None

    def set_reorder_policy(self, policy: ReorderPolicy | None) -> None:
        """Applied to the active list before every pass (reference sections 2 and 5)."""
        self._reorder_policy = policy

    def schedule(
        self,
        active_requests: Sequence[LlmRequest],
        kv_cache_manager: Any = None,
        peft_cache_manager: Any = None,
        cross_kv_cache_manager: Any = None,
    ) -> CapacityOutput:
        requests = active_requests
        if self._reorder_policy is not None:
            if not isinstance(requests, list):
                requests = list(requests)
            requests = self._reorder_policy.reorder(requests)
        if not self.has_kv_cache_manager:
            return CapacityOutput(self._schedule_max_requests(requests), [], [])
        if kv_cache_manager is None:
            raise ValueError(f"{self.policy.name} needs a KV cache manager")
        plain = _is_plain_kv(kv_cache_manager, cross_kv_cache_manager)
        if self.policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            if plain:
                return self._schedule_max_utilization_plain(
                    requests, kv_cache_manager, peft_cache_manager
                )
            return self._schedule_max_utilization(
                requests, kv_cache_manager, peft_cache_manager, cross_kv_cache_manager
            )
        if plain:
            return self._schedule_no_evict_plain(
                requests,
                kv_cache_manager,
                peft_cache_manager,
                static=self.policy == CapacitySchedulerPolicy.STATIC_BATCH,
            )
        return self._schedule_no_evict(
            requests,
            kv_cache_manager,
            peft_cache_manager,
            cross_kv_cache_manager,
            static=self.policy == CapacitySchedulerPolicy.STATIC_BATCH,
        )

    # ---- MaxRequests (reference 2.1) ---------------------------------------------------------
    def _schedule_max_requests(self, requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        # No disaggregated exemption: gen-init and transfer-in-progress requests are ignored.
        kinds, cap = self._kinds, self.max_num_requests
        scheduled: list[LlmRequest] = []
        for req in requests:
            kind = kinds[req.state]
            if kind == _RUNNING or kind == _CONTEXT or kind == _ENCODER:
                if len(scheduled) >= cap:
                    break
                scheduled.append(req)
        return scheduled

    # ---- prefix-aware skipping (reference 2.9) -----------------------------------------------
    def _skipping_is_relevant(self, kv: Any, cross_kv: Any) -> bool:
        # One block key cannot stand for blocks of several window-size pools.
        return (
            self.enable_prefix_aware_scheduling
            and not kv.is_variable_window
            and (cross_kv is None or not cross_kv.is_variable_window)
        )

    def _contexts_already_executing(
        self, requests: Sequence[LlmRequest], kv: Any, cross_kv: Any, view: Any = None
    ) -> tuple[set[Any], set[Any]]:
        """First new blocks of context requests past their first chunk: they will store those
        blocks, so a new request whose first uncached block is among them should wait. ``view``:
        the plain paths' ``kv.scheduling_view()``, whose summary is analyze_prefix_reuse's with
        its cache hit tested in place."""
        contributed: set[Any] = set()
        cross_contributed: set[Any] = set()
        walk_self = _reuse_walk_allowed(kv)
        walk_cross = _reuse_walk_allowed(cross_kv)
        if not (walk_self or walk_cross):
            return contributed, cross_contributed
        kinds = self._kinds
        # Context requests not on their first chunk (is_first_context_chunk, without the property).
        executing = [
            req
            for req in requests
            if kinds[req.state] == _CONTEXT
            and req.context_current_position != req.prepopulated_prompt_len
        ]
        for req in executing:
            if walk_self:
                summary = (
                    view.prefix_summary(req)
                    if view is not None
                    else kv.analyze_prefix_reuse(req.get_tokens(0), req)
                )
                block = summary.first_new_block
                if block is not None:
                    contributed.add(block)
            if walk_cross and req.encoder_tokens:
                block = cross_kv.analyze_prefix_reuse(req.encoder_tokens, req).first_new_block
                if block is not None:
                    cross_contributed.add(block)
        return contributed, cross_contributed

    # ---- GUARANTEED_NO_EVICT and STATIC_BATCH (reference 2.2) --------------------------------
    def _schedule_no_evict(
        self, requests: Sequence[LlmRequest], kv: Any, peft: Any, cross_kv: Any, *, static: bool
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        reserved = NoEvictScheduledBlocksManager(kv)
        reserved_cross = NoEvictScheduledBlocksManager(cross_kv) if cross_kv is not None else None
        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        pending_gen_init: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        claimed_peft = 0
        admitted = 0

        # Pass 1: running requests are admitted unconditionally and their remaining blocks
        # reserved even past zero; transfer-in-progress ones hold a slot and KV, never returned.
        decrement = reserved.decrement_unchecked
        for req in requests:
            kind = kinds[req.state]
            if kind == _SKIP:
                continue
            if admitted >= cap:
                break
            if kind == _RUNNING or kind == _TRANSFER:
                admitted += 1
                if kind == _RUNNING:
                    fitting.append(req)
                decrement(req)
                if reserved_cross is not None:
                    reserved_cross.decrement_unchecked(req)
                task = req.lora_task_id
                if task is not None and task not in seen_tasks:
                    seen_tasks.add(task)
                    if peft is not None:
                        claimed_peft += peft.determine_num_pages(req)
            elif kind == _GEN_INIT:
                pending_gen_init.append(req)
            else:
                pending.append(req)

        if (static and admitted > 0) or not (pending or pending_gen_init):
            return CapacityOutput(fitting, gen_init, [])

        # Pass 2: gen-init first, then the rest; each list is its own break scope, so a KV misfit
        # among gen-init requests does not stop context candidates.
        available_peft = (peft.max_device_pages if peft is not None else _INT_MAX) - claimed_peft
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and _reuse_walk_allowed(kv)
        walk_cross = prefix_aware and _reuse_walk_allowed(cross_kv)
        skipping = not static and self._skipping_is_relevant(kv, cross_kv)
        if skipping:
            contributed, cross_contributed = self._contexts_already_executing(
                requests, kv, cross_kv
            )
        else:
            contributed, cross_contributed = set(), set()
        check, commit = reserved.check, reserved.commit
        for pending_list, out in ((pending_gen_init, gen_init), (pending, fitting)):
            for req in pending_list:
                kind = kinds[req.state]
                first_chunk = kind == _CONTEXT and req.is_first_context_chunk
                summary = cross_summary = None
                if first_chunk:
                    if not prefix_aware:
                        summary = _ZERO_SUMMARY
                        cross_summary = _ZERO_SUMMARY if cross_kv is not None else None
                    else:
                        if walk_self:
                            summary = kv.analyze_prefix_reuse(req.get_tokens(0), req)
                        if walk_cross and req.encoder_tokens:
                            cross_summary = cross_kv.analyze_prefix_reuse(req.encoder_tokens, req)
                elif kind == _ENCODER and walk_cross and req.encoder_tokens:
                    cross_summary = cross_kv.analyze_prefix_reuse(req.encoder_tokens, req)
                if (
                    skipping
                    and (first_chunk or kind == _ENCODER)
                    and _beneficial_to_skip(summary, cross_summary, contributed, cross_contributed)
                ):
                    continue
                if admitted >= cap:
                    break
                task = req.lora_task_id
                new_task = task is not None and task not in seen_tasks
                needed_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0
                if kind == _ENCODER:
                    if needed_peft > available_peft:
                        continue
                elif kind == _CONTEXT or kind == _GEN_INIT:
                    if not check(req, summary):
                        break
                    if reserved_cross is not None and not reserved_cross.check(req, cross_summary):
                        break
                    if needed_peft > available_peft:
                        continue  # only LoRA pages are short: a later request may fit
                    commit()  # the checks above were pure: nothing is reserved before this
                    if reserved_cross is not None:
                        reserved_cross.commit()
                else:
                    continue
                out.append(req)
                admitted += 1
                available_peft -= needed_peft
                if new_task:
                    seen_tasks.add(task)
                if skipping:
                    _register_contribution(summary, cross_summary, contributed, cross_contributed)
        return CapacityOutput(fitting, gen_init, [])

    # ---- MAX_UTILIZATION (reference 2.5) -----------------------------------------------------
    def _schedule_max_utilization(
        self, requests: Sequence[LlmRequest], kv: Any, peft: Any, cross_kv: Any
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        if self.no_schedule_until_state == _S.ENCODER_INIT and cross_kv is None:
            raise ValueError("MAX_UTILIZATION from ENCODER_INIT needs a cross KV cache manager")
        kv.start_scheduling()
        if cross_kv is not None:
            cross_kv.start_scheduling()
        blocks = MaxUtilizationScheduledBlocksManager(kv, self.two_steps_look_ahead)
        cross_blocks = (
            MaxUtilizationScheduledBlocksManager(cross_kv, self.two_steps_look_ahead)
            if cross_kv is not None
            else None
        )
        max_peft = peft.max_device_pages if peft is not None else _INT_MAX
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and _reuse_walk_allowed(kv)
        # Cross summaries never take part in skipping here: only the self set is kept.
        skipping = self._skipping_is_relevant(kv, cross_kv)
        contributed = self._contexts_already_executing(requests, kv, None)[0] if skipping else set()
        no_cross: set[Any] = set()
        prepare, update = blocks.prepare_blocks_if_schedulable, blocks.update_scheduled_blocks

        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        scheduled_peft = 0
        admitted = 0
        i = 0
        end = len(requests)
        while i < end:
            req = requests[i]
            kind = kinds[req.state]
            if kind == _SKIP:
                i += 1
                continue
            task = req.lora_task_id
            new_task = task is not None and task not in seen_tasks
            if kind == _TRANSFER:
                # A slot and LoRA pages; its KV is already outside the scheduling free count.
                if admitted >= cap:
                    break
                if new_task:
                    seen_tasks.add(task)
                    if peft is not None:
                        scheduled_peft += peft.determine_num_pages(req)
                admitted += 1
                i += 1
                continue
            first_chunk = kind == _CONTEXT and req.is_first_context_chunk
            summary = None
            if first_chunk:
                if not prefix_aware:
                    summary = _ZERO_SUMMARY
                elif walk_self:
                    summary = kv.analyze_prefix_reuse(req.get_tokens(0), req)
                if skipping and _beneficial_to_skip(summary, None, contributed, no_cross):
                    i += 1  # skipped, not paused
                    continue
            required_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0

            # A retry after a pause reuses the summary and page count: a pause changes only the
            # scheduling counters, never the radix tree or the contributed set.
            while True:
                fits = False
                if admitted < cap and scheduled_peft + required_peft <= max_peft:
                    if kind == _ENCODER:
                        fits = True  # no KV in either pool
                    else:
                        # Predict, commit only if every pool fits: a failed try leaves no trace.
                        total = prepare(req, summary)
                        if total is not None:
                            if cross_blocks is None:
                                update(total)
                                fits = True
                            else:
                                cross_total = cross_blocks.prepare_blocks_if_schedulable(req)
                                if cross_total is not None:
                                    update(total)
                                    cross_blocks.update_scheduled_blocks(cross_total)
                                    fits = True
                if fits:
                    (gen_init if kind == _GEN_INIT else fitting).append(req)
                    admitted += 1
                    scheduled_peft += required_peft
                    if new_task:
                        seen_tasks.add(task)
                    if skipping and first_chunk:
                        _register_contribution(summary, None, contributed, no_cross)
                    i += 1
                    break
                victim = self._last_started(requests, i, end)
                if victim < 0:
                    return CapacityOutput(fitting, gen_init, paused)  # head-of-line blocking
                paused_req = requests[victim]
                kv.scheduling_remove_sequence(paused_req.request_id)
                if cross_kv is not None:
                    cross_kv.scheduling_remove_sequence(paused_req.request_id)
                paused.append(paused_req)
                end = victim  # it and everything after it are out of this round
                if victim == i:
                    break  # the request paused itself: the loop ends
        return CapacityOutput(fitting, gen_init, paused)

    def _last_started(self, requests: Sequence[LlmRequest], begin: int, end: int) -> int:
        """Index of the last started request in [begin, end), or -1. Started: generating, or a
        context past its first chunk; encoder-init and first-chunk contexts hold nothing worth
        freeing, and transfer-in-progress requests are never paused."""
        kinds = self._kinds
        for j in range(end - 1, begin - 1, -1):
            req = requests[j]
            kind = kinds[req.state]
            if kind == _RUNNING or (kind == _CONTEXT and not req.is_first_context_chunk):
                return j
        return -1

"""The capacity scheduler as it was before "each capacity policy written once": a frozen copy, the
"before" side of tests/unit/test_capacity_differential.py. Not collected by pytest (no test_
prefix); that test loads it by path.

Copied from commit 2f873a09f670ba64250b7f87d6568443cf5058d1 (scheduler/capacity.py,
scheduler/capacity_common.py, scheduler/blocks_manager.py): the *generic* path of each policy,
which reads every KV pool through its public methods only (``get_num_free_blocks``,
``get_remaining_blocks_to_completion``, ``get_needed_blocks_one_step``,
``scheduling_has_free_blocks``, ``analyze_prefix_reuse``, ``start_scheduling``,
``scheduling_remove_sequence``, ``enable_block_reuse``, ``is_variable_window``), through the two
scheduled-blocks managers. At that commit the plain fast path (capacity_plain.py, taken for an
exact ``KVCacheManager`` without a cross pool) was tested to decide exactly alike
(test_capacity_plain_path.py), so this one copy is "before" for every kind of pool.

Changes from the original: the plain-path dispatch is gone (every pool takes the generic path),
the pieces of the three files sit in this one module, and the class is ``OracleCapacityScheduler``.
One deliberate change of decisions since, made in the scheduler and here together: issue 46
(GUARANTEED_NO_EVICT / STATIC_BATCH pass 2 takes the contexts past their first chunk before the
other pending requests, so that a first-chunk request cannot shut a started one out for good;
docs/scheduling.md 2.2). Do not edit the decision logic otherwise: it is the reference the new
code is compared with.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from pdserve.scheduler import CapacitySchedulerPolicy, PrefixReuseSummary
from pdserve.scheduler.request import LlmRequest, LlmRequestState

__all__ = ["OracleCapacityScheduler", "OracleCapacityOutput"]


# ---- capacity_common.py ---------------------------------------------------------------------
class OracleCapacityOutput(NamedTuple):
    fitting: list[LlmRequest]
    fitting_disagg_gen_init: list[LlmRequest]
    paused: list[LlmRequest]


_SKIP = 0
_RUNNING = 1
_TRANSFER = 2
_GEN_INIT = 3
_CONTEXT = 4
_ENCODER = 5
_OTHER = 6

_S = LlmRequestState
_GENERATION_IN_PROGRESS = (
    _S.DISAGG_GENERATION_TRANS_COMPLETE,
    _S.GENERATION_IN_PROGRESS,
    _S.GENERATION_TO_COMPLETE,
)
_CONTEXT_INIT = (_S.CONTEXT_INIT, _S.DISAGG_CONTEXT_INIT_AND_TRANS)


def _state_kinds(until: LlmRequestState, after: LlmRequestState) -> dict[LlmRequestState, int]:
    kinds: dict[LlmRequestState, int] = {}
    for state in LlmRequestState:
        if state == _S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
            kind = _TRANSFER
        elif state == _S.DISAGG_GENERATION_INIT:
            kind = _GEN_INIT
        elif not until <= state < after or state == _S.DISAGG_CONTEXT_WAIT_SCHEDULER:
            kind = _SKIP
        elif state in _GENERATION_IN_PROGRESS:
            kind = _RUNNING
        elif state in _CONTEXT_INIT:
            kind = _CONTEXT
        elif state == _S.ENCODER_INIT:
            kind = _ENCODER
        else:
            kind = _OTHER
        kinds[state] = kind
    return kinds


_INT_MAX = 2**31 - 1
_ZERO_SUMMARY = PrefixReuseSummary(0, 0, None)


def _beneficial_to_skip(summary, cross_summary, contributed, cross_contributed) -> bool:
    if summary is not None:
        block = summary.first_new_block
        if block is not None and block in contributed:
            return True
    if cross_summary is not None:
        block = cross_summary.first_new_block
        if block is not None and block in cross_contributed:
            return True
    return False


def _register_contribution(summary, cross_summary, contributed, cross_contributed) -> None:
    if summary is not None and summary.first_new_block is not None:
        contributed.add(summary.first_new_block)
    if cross_summary is not None and cross_summary.first_new_block is not None:
        cross_contributed.add(cross_summary.first_new_block)


def _reuse_walk_allowed(manager: Any) -> bool:
    return manager is not None and manager.enable_block_reuse and not manager.is_variable_window


# ---- blocks_manager.py ----------------------------------------------------------------------
class NoEvictScheduledBlocksManager:
    __slots__ = ("_kv", "available", "_pending_need")

    def __init__(self, kv_cache_manager: Any) -> None:
        self._kv = kv_cache_manager
        self.available: int = kv_cache_manager.get_num_free_blocks()
        self._pending_need = 0

    def _remaining(self, request: LlmRequest, summary: PrefixReuseSummary | None) -> int:
        if summary is None:
            return self._kv.get_remaining_blocks_to_completion(request)
        return self._kv.get_remaining_blocks_to_completion(request, summary)

    def decrement_unchecked(self, request: LlmRequest) -> None:
        self.available -= self._remaining(request, None)

    def check(self, request: LlmRequest, summary: PrefixReuseSummary | None = None) -> bool:
        need = self._remaining(request, summary)
        self._pending_need = need
        return need <= self.available

    def commit(self) -> None:
        self.available -= self._pending_need
        self._pending_need = 0


class MaxUtilizationScheduledBlocksManager:
    __slots__ = ("_kv", "two_steps_look_ahead", "scheduled")

    def __init__(self, kv_cache_manager: Any, two_steps_look_ahead: bool) -> None:
        self._kv = kv_cache_manager
        self.two_steps_look_ahead = two_steps_look_ahead
        self.scheduled: int = 0

    def prepare_blocks_if_schedulable(
        self, request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int | None:
        kv = self._kv
        if summary is None:
            needed = kv.get_needed_blocks_one_step(request, self.two_steps_look_ahead)
        else:
            needed = kv.get_needed_blocks_one_step(request, self.two_steps_look_ahead, summary)
        total = self.scheduled + needed
        if not kv.scheduling_has_free_blocks(total):
            return None
        return total

    def update_scheduled_blocks(self, total: int) -> None:
        self.scheduled = total


# ---- capacity.py (generic paths) ------------------------------------------------------------
class OracleCapacityScheduler:
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
        self._reorder_policy: Any = None

    def set_reorder_policy(self, policy: Any) -> None:
        self._reorder_policy = policy

    def schedule(
        self,
        active_requests: Sequence[LlmRequest],
        kv_cache_manager: Any = None,
        peft_cache_manager: Any = None,
        cross_kv_cache_manager: Any = None,
    ) -> OracleCapacityOutput:
        requests = active_requests
        if self._reorder_policy is not None:
            if not isinstance(requests, list):
                requests = list(requests)
            requests = self._reorder_policy.reorder(requests)
        if not self.has_kv_cache_manager:
            return OracleCapacityOutput(self._schedule_max_requests(requests), [], [])
        if kv_cache_manager is None:
            raise ValueError(f"{self.policy.name} needs a KV cache manager")
        if self.policy == CapacitySchedulerPolicy.MAX_UTILIZATION:
            return self._schedule_max_utilization(
                requests, kv_cache_manager, peft_cache_manager, cross_kv_cache_manager
            )
        return self._schedule_no_evict(
            requests,
            kv_cache_manager,
            peft_cache_manager,
            cross_kv_cache_manager,
            static=self.policy == CapacitySchedulerPolicy.STATIC_BATCH,
        )

    def _schedule_max_requests(self, requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        kinds, cap = self._kinds, self.max_num_requests
        scheduled: list[LlmRequest] = []
        for req in requests:
            kind = kinds[req.state]
            if kind == _RUNNING or kind == _CONTEXT or kind == _ENCODER:
                if len(scheduled) >= cap:
                    break
                scheduled.append(req)
        return scheduled

    def _skipping_is_relevant(self, kv: Any, cross_kv: Any) -> bool:
        return (
            self.enable_prefix_aware_scheduling
            and not kv.is_variable_window
            and (cross_kv is None or not cross_kv.is_variable_window)
        )

    def _contexts_already_executing(
        self, requests: Sequence[LlmRequest], kv: Any, cross_kv: Any
    ) -> tuple[set[Any], set[Any]]:
        contributed: set[Any] = set()
        cross_contributed: set[Any] = set()
        walk_self = _reuse_walk_allowed(kv)
        walk_cross = _reuse_walk_allowed(cross_kv)
        if not (walk_self or walk_cross):
            return contributed, cross_contributed
        kinds = self._kinds
        executing = [
            req
            for req in requests
            if kinds[req.state] == _CONTEXT
            and req.context_current_position != req.prepopulated_prompt_len
        ]
        for req in executing:
            if walk_self:
                block = kv.analyze_prefix_reuse(req.get_tokens(0), req).first_new_block
                if block is not None:
                    contributed.add(block)
            if walk_cross and req.encoder_tokens:
                block = cross_kv.analyze_prefix_reuse(req.encoder_tokens, req).first_new_block
                if block is not None:
                    cross_contributed.add(block)
        return contributed, cross_contributed

    def _schedule_no_evict(
        self, requests: Sequence[LlmRequest], kv: Any, peft: Any, cross_kv: Any, *, static: bool
    ) -> OracleCapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        reserved = NoEvictScheduledBlocksManager(kv)
        reserved_cross = NoEvictScheduledBlocksManager(cross_kv) if cross_kv is not None else None
        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        pending_gen_init: list[LlmRequest] = []
        started: list[LlmRequest] = []  # contexts past their first chunk (issue 46)
        pending: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        claimed_peft = 0
        admitted = 0

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
            elif kind == _CONTEXT and not req.is_first_context_chunk:
                started.append(req)
            else:
                pending.append(req)
        # Issue 46: started contexts are considered before the other pending requests.
        pending = started + pending

        if (static and admitted > 0) or not (pending or pending_gen_init):
            return OracleCapacityOutput(fitting, gen_init, [])

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
                        continue
                    commit()
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
        return OracleCapacityOutput(fitting, gen_init, [])

    def _schedule_max_utilization(
        self, requests: Sequence[LlmRequest], kv: Any, peft: Any, cross_kv: Any
    ) -> OracleCapacityOutput:
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
                    i += 1
                    continue
            required_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0

            while True:
                fits = False
                if admitted < cap and scheduled_peft + required_peft <= max_peft:
                    if kind == _ENCODER:
                        fits = True
                    else:
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
                    return OracleCapacityOutput(fitting, gen_init, paused)
                paused_req = requests[victim]
                kv.scheduling_remove_sequence(paused_req.request_id)
                if cross_kv is not None:
                    cross_kv.scheduling_remove_sequence(paused_req.request_id)
                paused.append(paused_req)
                end = victim
                if victim == i:
                    break
        return OracleCapacityOutput(fitting, gen_init, paused)

    def _last_started(self, requests: Sequence[LlmRequest], begin: int, end: int) -> int:
        kinds = self._kinds
        for j in range(end - 1, begin - 1, -1):
            req = requests[j]
            kind = kinds[req.state]
            if kind == _RUNNING or (kind == _CONTEXT and not req.is_first_context_chunk):
                return j
        return -1

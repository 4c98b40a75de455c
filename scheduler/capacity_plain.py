"""Capacity scheduler plain fast paths: GUARANTEED_NO_EVICT / STATIC_BATCH and MAX_UTILIZATION
for a ``KVCacheManager`` (exactly that class) without a cross pool (reference sections 2.2, 2.5).

``CapacityScheduler`` (capacity.py) inherits ``PlainKVPathsMixin`` and takes these paths when
``_is_plain_kv`` holds; otherwise it takes its generic paths, which decide alike.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any, Sequence

from .capacity_common import (
    _CONTEXT, _ENCODER, _GEN_INIT, _INT_MAX, _RUNNING, _S, _SKIP, _TRANSFER, _ZERO_SUMMARY,
    CapacityOutput, _reuse_walk_allowed,
)
from .kv_cache import KVCacheManager
from .request import LlmRequest, LlmRequestState


# The KVCacheManager methods the plain paths bypass: they call the manager's SchedulingView
# (the same formulas) and compare the scheduling free count themselves.
_BYPASSED = frozenset(
    {
        "get_remaining_blocks_to_completion",
        "get_needed_blocks_one_step",
        "scheduling_has_free_blocks",
        "analyze_prefix_reuse",
    }
)


def _is_plain_kv(kv: Any, cross_kv: Any) -> bool:
    """May the policies take their plain paths, which compute the block needs through
    ``kv.scheduling_view()`` (the formulas of ``get_remaining_blocks_to_completion`` and
    ``get_needed_blocks_one_step``, with their side effect on ``estimated_reusable_tokens``)
    instead of through the blocks managers? Only for exactly ``KVCacheManager`` (a subclass may
    override the formulas, a double must see its calls), with none of the bypassed methods
    replaced on the instance, and without a cross pool."""
    return (
        type(kv) is KVCacheManager
        and cross_kv is None
        and not kv.is_cross
        and _BYPASSED.isdisjoint(vars(kv))
    )


class PlainKVPathsMixin:
    """``CapacityScheduler``'s plain paths. They use the scheduler's attributes below and its
    ``_skipping_is_relevant``, ``_contexts_already_executing`` and ``_last_started``."""

    max_num_requests: int
    two_steps_look_ahead: bool
    no_schedule_until_state: LlmRequestState
    enable_prefix_aware_scheduling: bool
    _kinds: dict[LlmRequestState, int]

    # ---- plain KVCacheManager fast paths -----------------------------------------------------
    # The two methods below make the same decisions, with the same side effects, as
    # _schedule_no_evict and _schedule_max_utilization for a KVCacheManager (exactly that class)
    # without a cross pool. They read the manager only through its public fast view
    # (SchedulingView: the block formulas and the prefix summary, bound once per pass) and its
    # public counters, and keep the budgets in local ints instead of blocks managers.
    # tests/unit/test_capacity_plain_path.py compares both paths.

    def _schedule_no_evict_plain(
        self, requests: Sequence[LlmRequest], kv: KVCacheManager, peft: Any, *, static: bool
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        view = kv.scheduling_view()
        to_completion = view.blocks_to_completion
        available = kv.get_num_free_blocks()
        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        pending_gen_init: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        claimed_peft = 0
        admitted = 0

        # Pass 1: running and transfer-in-progress requests, reserved unconditionally.
        admit, defer, defer_gen_init = fitting.append, pending.append, pending_gen_init.append
        for req in requests:
            kind = kinds[req.state]
            if kind == _SKIP:
                continue
            if admitted >= cap:
                break
            if kind == _RUNNING or kind == _TRANSFER:
                admitted += 1
                if kind == _RUNNING:
                    admit(req)
                available -= to_completion(req)
                task = req.lora_task_id
                if task is not None and task not in seen_tasks:
                    seen_tasks.add(task)
                    if peft is not None:
                        claimed_peft += peft.determine_num_pages(req)
            elif kind == _GEN_INIT:
                defer_gen_init(req)
            else:
                defer(req)

        if (static and admitted > 0) or not (pending or pending_gen_init):
            return CapacityOutput(fitting, gen_init, [])

        # Pass 2: gen-init first, then the rest, each list its own break scope.
        available_peft = (peft.max_device_pages if peft is not None else _INT_MAX) - claimed_peft
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and _reuse_walk_allowed(kv)
        skipping = not static and self._skipping_is_relevant(kv, None)
        contributed = (
            self._contexts_already_executing(requests, kv, None, view)[0] if skipping else set()
        )
        prefix_summary = view.prefix_summary
        for pending_list, out in ((pending_gen_init, gen_init), (pending, fitting)):
            for req in pending_list:
                kind = kinds[req.state]
                first_chunk = (
                    kind == _CONTEXT and req.context_current_position == req.prepopulated_prompt_len
                )
                summary = block = None
                if first_chunk:
                    if not prefix_aware:
                        summary = _ZERO_SUMMARY
                    elif walk_self:
                        summary = prefix_summary(req)
                    if summary is not None:
                        block = summary.first_new_block
                        if skipping and block is not None and block in contributed:
                            continue
                if admitted >= cap:
                    break
                task = req.lora_task_id
                new_task = task is not None and task not in seen_tasks
                needed_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0
                if kind == _CONTEXT or kind == _GEN_INIT:
                    need = to_completion(req, summary)
                    if need > available:
                        break
                    if needed_peft > available_peft:
                        continue  # only LoRA pages are short: a later request may fit
                    available -= need
                elif kind == _ENCODER:
                    if needed_peft > available_peft:
                        continue
                else:
                    continue
                out.append(req)
                admitted += 1
                available_peft -= needed_peft
                if new_task:
                    seen_tasks.add(task)
                if skipping and block is not None:
                    contributed.add(block)
        return CapacityOutput(fitting, gen_init, [])

    def _schedule_max_utilization_plain(
        self, requests: Sequence[LlmRequest], kv: KVCacheManager, peft: Any
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        if self.no_schedule_until_state == _S.ENCODER_INIT:
            raise ValueError("MAX_UTILIZATION from ENCODER_INIT needs a cross KV cache manager")
        kv.start_scheduling()
        view = kv.scheduling_view()
        generation_step, prompt_step = view.generation_step_blocks, view.prompt_step_blocks
        two_steps = self.two_steps_look_ahead
        free = kv.get_scheduling_num_free_blocks()  # only a pause moves it during the pass
        available_peft = peft.max_device_pages if peft is not None else _INT_MAX
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and _reuse_walk_allowed(kv)
        skipping = self._skipping_is_relevant(kv, None)
        contributed = (
            self._contexts_already_executing(requests, kv, None, view)[0] if skipping else set()
        )
        prefix_summary = view.prefix_summary

        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        scheduled_blocks = 0
        admitted = 0
        end = len(requests)
        for i in range(end):
            if i >= end:  # pauses cut the round short
                break
            req = requests[i]
            kind = kinds[req.state]
            if kind == _SKIP:
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
                        available_peft -= peft.determine_num_pages(req)
                admitted += 1
                continue
            first_chunk = (
                kind == _CONTEXT and req.context_current_position == req.prepopulated_prompt_len
            )
            summary = block = None
            if first_chunk:
                if not prefix_aware:
                    summary = _ZERO_SUMMARY
                elif walk_self:
                    summary = prefix_summary(req)
                if summary is not None:
                    block = summary.first_new_block
                    if skipping and block is not None and block in contributed:
                        continue  # skipped, not paused
            required_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0

            # Neither the slot and page test nor the request's one-step need changes when a
            # pause is retried (a pause moves only the scheduling free count), so both are
            # evaluated once, with the formula's side effect on estimated_reusable_tokens.
            room = admitted < cap and required_peft <= available_peft
            total = scheduled_blocks
            if room:
                if kind == _RUNNING:
                    total += generation_step(req, two_steps)
                elif first_chunk or kind == _GEN_INIT:
                    total += prompt_step(req, summary)
                elif kind != _ENCODER:  # encoder-init: no KV in either pool
                    req.estimated_reusable_tokens = 0  # later chunks: their blocks are held
            fits = room and (kind == _ENCODER or free >= total)
            while not fits:
                victim = self._last_started(requests, i, end)
                if victim < 0:
                    return CapacityOutput(fitting, gen_init, paused)  # head-of-line blocking
                paused_req = requests[victim]
                kv.scheduling_remove_sequence(paused_req.request_id)
                free = kv.get_scheduling_num_free_blocks()
                paused.append(paused_req)
                end = victim  # it and everything after it are out of this round
                if victim == i:
                    break  # the request paused itself: the round ends
                fits = room and (kind == _ENCODER or free >= total)
            if not fits:
                break
            (gen_init if kind == _GEN_INIT else fitting).append(req)
            scheduled_blocks = total
            admitted += 1
            available_peft -= required_peft
            if new_task:
                seen_tasks.add(task)
            if skipping and block is not None:
                contributed.add(block)
        return CapacityOutput(fitting, gen_init, paused)

"""Capacity scheduler: which active requests may hold KV (and LoRA) resources this iteration.

scheduling.md section 2 (newest capacityScheduler.cpp). One implementation per policy:

* MaxRequests (no KV manager, scheduling.md 2.1): ``_schedule_max_requests``.
* GUARANTEED_NO_EVICT / STATIC_BATCH (scheduling.md 2.2-2.4): ``_schedule_no_evict``; reserve
  blocks to completion, never pause.
* MAX_UTILIZATION (scheduling.md 2.5, 2.6): ``_schedule_max_utilization``; reserve blocks for
  the next step, pause started requests from the back (``_last_started``).

Prefix-aware skipping (scheduling.md 2.9): ``_skipping_is_relevant``,
``_contexts_already_executing`` and the contributed-block sets inside each policy. LoRA pages
(scheduling.md 2.8) and cross KV (scheduling.md 2.7) take part in the same loops.

Every KV pool, self and cross, is read only through a ``SchedulingView`` (kv_estimates.py) made
once per pass by ``kv_cache.scheduling_view_of``: the fast closures of an exact
``KVCacheManager``, or calls to the pool's public names (a subclass, a test double); plus the
pool's ``start_scheduling`` and ``scheduling_remove_sequence``. Requests and the PEFT manager
are read through their public fields. tests/unit/test_capacity_differential.py compares every
decision and side effect with the implementation before this one (a frozen copy).

Speed (bench/scheduler.py): with a fast view and no cross pool, the common requests (generating
with one beam and no LoRA, contexts without LoRA) take short paths inside each policy's loop,
and a generating request's blocks are counted at an upper bound that the view gives until a test
fails on the bound; only then are the exact figures asked for, so every decision is the one the
exact figures make. Everything else takes the general path.

Pure Python, stdlib only.
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple, Protocol, Sequence

from .kv_cache import scheduling_view_of
from .kv_estimates import SchedulingView
from .kv_prefix_reuse import PrefixReuseSummary
from .request import LlmRequest, LlmRequestState

__all__ = ["CapacityOutput", "CapacityScheduler", "CapacitySchedulerPolicy", "ReorderPolicy"]


class CapacitySchedulerPolicy(enum.IntEnum):
    """Values as in TensorRT-LLM's executor enum."""

    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


class CapacityOutput(NamedTuple):
    fitting: list[LlmRequest]
    fitting_disagg_gen_init: list[LlmRequest]
    paused: list[LlmRequest]


class ReorderPolicy(Protocol):
    def reorder(self, requests: list[LlmRequest]) -> list[LlmRequest]: ...


# What a state means to the capacity scheduler, precomputed per band so that the loops do one
# dict lookup per request instead of a chain of state comparisons.
_SKIP = 0  # outside the band (or DISAGG_CONTEXT_WAIT_SCHEDULER inside an encoder band)
_RUNNING = 1  # generation-in-progress, in the band
_TRANSFER = 2  # DISAGG_GENERATION_TRANS_IN_PROGRESS: counted, never returned (band exempt)
_GEN_INIT = 3  # DISAGG_GENERATION_INIT: KV reserved so its transfer can start (band exempt)
_CONTEXT = 4  # context-init, in the band
_ENCODER = 5  # encoder-init, in the band: a slot and LoRA pages, no KV
_OTHER = 6  # any other state in the band: considered, never reserved for

_S = LlmRequestState
_GENERATION_IN_PROGRESS = (
    _S.DISAGG_GENERATION_TRANS_COMPLETE, _S.GENERATION_IN_PROGRESS, _S.GENERATION_TO_COMPLETE
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
            # Python's scheduler rejects WAIT_SCHEDULER explicitly: an ENCODER_INIT band would
            # otherwise take in a context-only request still waiting for its generation side.
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


_INT_MAX = 2**31 - 1  # PEFT budget without a PEFT manager (C++ INT_MAX)
# enable_prefix_aware_scheduling=False: first-chunk contexts get this, so there is no reuse credit.
_ZERO_SUMMARY = PrefixReuseSummary(0, 0, None)


class CapacityScheduler:
    """Chooses the requests that hold resources this iteration (scheduling.md section 2).

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
        # The states of the two common kinds: a set test is cheaper than a lookup and a compare.
        self._running_states = frozenset(s for s, k in self._kinds.items() if k == _RUNNING)
        self._context_states = frozenset(s for s, k in self._kinds.items() if k == _CONTEXT)
        self._reorder_policy: ReorderPolicy | None = None

    def set_reorder_policy(self, policy: ReorderPolicy | None) -> None:
        """Applied to the active list before every pass (scheduling.md sections 2 and 5)."""
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
        kv, cross_kv = kv_cache_manager, cross_kv_cache_manager
        if kv is None:
            raise ValueError(f"{self.policy.name} needs a KV cache manager")
        max_utilization = self.policy == CapacitySchedulerPolicy.MAX_UTILIZATION
        if max_utilization and self.no_schedule_until_state == _S.ENCODER_INIT and cross_kv is None:
            raise ValueError("MAX_UTILIZATION from ENCODER_INIT needs a cross KV cache manager")
        view = scheduling_view_of(kv)
        cross_view = None if cross_kv is None else scheduling_view_of(cross_kv, encoder_tokens=True)
        peft = peft_cache_manager
        if max_utilization:
            return self._schedule_max_utilization(requests, kv, view, peft, cross_kv, cross_view)
        static = self.policy == CapacitySchedulerPolicy.STATIC_BATCH
        return self._schedule_no_evict(requests, view, peft, cross_view, static=static)

    # ---- MaxRequests (scheduling.md 2.1) ---------------------------------------------------
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

    # ---- prefix-aware skipping (scheduling.md 2.9) -----------------------------------------
    def _skipping_is_relevant(
        self, view: SchedulingView, cross_view: SchedulingView | None
    ) -> bool:
        # One block key cannot stand for blocks of several window-size pools.
        return (
            self.enable_prefix_aware_scheduling
            and not view.variable_window
            and (cross_view is None or not cross_view.variable_window)
        )

    def _contexts_already_executing(
        self, requests: Sequence[LlmRequest], view: SchedulingView,
        cross_view: SchedulingView | None,
    ) -> tuple[set[Any], set[Any]]:
        """First new blocks (self, cross) of the context requests past their first chunk among
        ``requests`` (in order): they will store those blocks, so a new request whose first
        uncached block is among them should wait. MAX_UTILIZATION passes no cross view
        (scheduling.md 2.7)."""
        contributed: set[Any] = set()
        cross_contributed: set[Any] = set()
        walk_self = view.reuse_walk
        walk_cross = cross_view is not None and cross_view.reuse_walk
        if not (walk_self or walk_cross):
            return contributed, cross_contributed
        executing = self._started_contexts(requests)
        prefix_summary = view.prefix_summary
        for req in executing:
            if walk_self:
                block = prefix_summary(req).first_new_block
                if block is not None:
                    contributed.add(block)
            if walk_cross and req.encoder_tokens:
                block = cross_view.prefix_summary(req).first_new_block  # type: ignore[union-attr]
                if block is not None:
                    cross_contributed.add(block)
        return contributed, cross_contributed

    def _started_contexts(self, requests: Sequence[LlmRequest]) -> list[LlmRequest]:
        """The context requests past their first chunk (is_first_context_chunk inlined), in
        order: they hold their prompt's blocks. The kind first: most requests are no contexts."""
        states = self._context_states
        return [r for r in requests
                if r.state in states and r.context_current_position != r.prepopulated_prompt_len]

    # ---- GUARANTEED_NO_EVICT and STATIC_BATCH (scheduling.md 2.2-2.4) ----------------------
    def _schedule_no_evict(
        self, requests: Sequence[LlmRequest], view: SchedulingView, peft: Any,
        cross_view: SchedulingView | None, *, static: bool,
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        to_completion = view.blocks_to_completion
        # The budgets (scheduling.md 2.3): the free blocks at the start, less what the admitted
        # requests reserve.
        available = view.num_free_blocks()
        cross = cross_view is not None
        if cross_view is not None:
            cross_to_completion = cross_view.blocks_to_completion
            cross_available = cross_view.num_free_blocks()
        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        pending_gen_init: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        claimed_peft = 0

        # Pass 1: running requests are admitted unconditionally and their remaining blocks
        # reserved even past zero; transfer-in-progress ones hold a slot and KV, never returned.
        # Fast view, no cross pool: a running request of beam 1 without LoRA takes a short path
        # (``lean``) and its blocks are not asked for: the budget, which only pass 2 reads, is
        # charged for all of them after the pass, at the view's upper bound on their blocks
        # while the bound passes every test, exactly once a test fails on it (``charged`` then
        # None), so each test decides as the exact budget would.
        admit, defer, defer_gen_init = fitting.append, pending.append, pending_gen_init.append
        total_to_completion = view.total_blocks_to_completion if cross_view is None else None
        fast = total_to_completion is not None
        lean_states = self._running_states if fast else frozenset()
        exact: set[LlmRequest] = set()  # running requests of the general path (asked for)
        admitted = 0
        unvisited: Sequence[LlmRequest] = ()
        for req in requests:
            if (req.state in lean_states and req.beam_width == 1 and req.lora_task_id is None
                    and admitted < cap):
                req.estimated_reusable_tokens = 0  # what its estimate sets
                admit(req)
                admitted += 1
                continue
            kind = kinds[req.state]
            if kind == _SKIP:
                continue
            if admitted >= cap:
                unvisited = requests[requests.index(req) :]
                break
            if kind == _RUNNING:
                admit(req)
                exact.add(req)
            elif kind == _GEN_INIT:
                defer_gen_init(req)
                continue
            elif kind != _TRANSFER:
                defer(req)
                continue
            # Running or transfer-in-progress.
            admitted += 1
            available -= to_completion(req)
            if cross:
                cross_available -= cross_to_completion(req)
            task = req.lora_task_id
            if task is not None and task not in seen_tasks:
                seen_tasks.add(task)
                if peft is not None:
                    claimed_peft += peft.determine_num_pages(req)

        if (static and admitted > 0) or not (pending or pending_gen_init):
            return CapacityOutput(fitting, gen_init, [])
        # Started contexts (past their first chunk) first: their blocks are reserved, and a
        # newcomer's misfit must not shut them out (scheduling.md 2.2, issue 46). Order kept.
        started = self._started_contexts(pending)
        if started:
            taken = set(started)
            pending = started + [r for r in pending if r not in taken]
        charged = None
        if len(fitting) > len(exact):
            # The short path's requests, in order: the running requests in ``fitting`` (only
            # running requests are there yet) less those the general path took.
            lean = [r for r in fitting if r not in exact] if exact else fitting[:]
            charged = view.blocks_to_completion_bound(lean)  # type: ignore[misc]
            available -= charged

        # Pass 2: gen-init first, then the rest; each list is its own break scope, so a KV misfit
        # among gen-init requests does not stop context candidates.
        available_peft = (peft.max_device_pages if peft is not None else _INT_MAX) - claimed_peft
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and view.reuse_walk
        walk_cross = prefix_aware and cross and cross_view.reuse_walk  # type: ignore[union-attr]
        skipping = not static and self._skipping_is_relevant(view, cross_view)
        if skipping:
            # The executing contexts: ``started``, then those past the cap (list order).
            contributed, cross_contributed = self._contexts_already_executing(
                (*started, *unvisited) if unvisited else started, view, cross_view
            )
        prefix_summary = view.prefix_summary
        cross_prefix_summary = cross_view.prefix_summary if cross_view is not None else None
        # Fast view, no cross pool, LoRA pages not over budget: a context request without LoRA
        # takes a short path with the general path's tests in its order (skip, cap, blocks).
        lean_contexts = self._context_states if fast and available_peft >= 0 else frozenset()
        prompt_to_completion = view.prompt_blocks_to_completion
        unwalked = _ZERO_SUMMARY if not prefix_aware else None
        for pending_list, out in ((pending_gen_init, gen_init), (pending, fitting)):
            for req in pending_list:
                if req.state in lean_contexts and req.lora_task_id is None:
                    block = None
                    if req.context_current_position == req.prepopulated_prompt_len:
                        summary = prefix_summary(req) if walk_self else unwalked
                        if skipping and summary is not None:
                            block = summary.first_new_block
                            if block is not None and block in contributed:
                                continue
                        if admitted >= cap:
                            break
                        need = prompt_to_completion(req, summary)
                    else:
                        if admitted >= cap:
                            break
                        need = to_completion(req, None)
                    if need > available:
                        if charged is None:
                            break
                        available += charged - total_to_completion(lean)  # type: ignore[misc]
                        charged = None
                        if need > available:
                            break
                    available -= need
                    out.append(req)
                    admitted += 1
                    if block is not None:
                        contributed.add(block)
                    continue
                kind = kinds[req.state]
                summary = cross_summary = block = cross_block = None
                position = req.context_current_position
                first_chunk = kind == _CONTEXT and position == req.prepopulated_prompt_len
                if first_chunk:
                    if not prefix_aware:
                        summary = _ZERO_SUMMARY
                        if cross:
                            cross_summary = _ZERO_SUMMARY
                    else:
                        if walk_self:
                            summary = prefix_summary(req)
                        if walk_cross and req.encoder_tokens:
                            cross_summary = cross_prefix_summary(req)  # type: ignore[misc]
                elif kind == _ENCODER and walk_cross and req.encoder_tokens:
                    cross_summary = cross_prefix_summary(req)  # type: ignore[misc]
                # Skip (not break) a request whose first uncached block an admitted or executing
                # context will store: waiting one round turns that block into a reuse hit.
                if skipping and (first_chunk or kind == _ENCODER):
                    if summary is not None:
                        block = summary.first_new_block
                        if block is not None and block in contributed:
                            continue
                    if cross_summary is not None:
                        cross_block = cross_summary.first_new_block
                        if cross_block is not None and cross_block in cross_contributed:
                            continue
                if admitted >= cap:
                    break
                task = req.lora_task_id
                new_task = task is not None and task not in seen_tasks
                needed_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0
                if kind == _CONTEXT or kind == _GEN_INIT:
                    need = to_completion(req, summary)
                    if need > available:
                        if charged is None:
                            break
                        available += charged - total_to_completion(lean)  # type: ignore[misc]
                        charged = None
                        if need > available:
                            break
                    if cross:
                        cross_need = cross_to_completion(req, cross_summary)
                        if cross_need > cross_available:
                            break
                    if needed_peft > available_peft:
                        continue  # only LoRA pages are short: a later request may fit
                    available -= need
                    if cross:
                        cross_available -= cross_need
                elif kind == _ENCODER:
                    if needed_peft > available_peft:
                        continue
                else:
                    continue
                out.append(req)
                admitted += 1
                if new_task:
                    available_peft -= needed_peft
                    seen_tasks.add(task)
                # Registered only once admitted, so no later duplicate waits on a contributor
                # that the budget checks rejected.
                if skipping:
                    if block is not None:
                        contributed.add(block)
                    if cross_block is not None:
                        cross_contributed.add(cross_block)
        return CapacityOutput(fitting, gen_init, [])

    # ---- MAX_UTILIZATION (scheduling.md 2.5, 2.6) ------------------------------------------
    def _schedule_max_utilization(
        self, requests: Sequence[LlmRequest], kv: Any, view: SchedulingView, peft: Any,
        cross_kv: Any, cross_view: SchedulingView | None,
    ) -> CapacityOutput:
        kinds, cap = self._kinds, self.max_num_requests
        kv.start_scheduling()
        if cross_kv is not None:
            cross_kv.start_scheduling()
        one_step, generation_step = view.blocks_one_step, view.generation_step_blocks
        prompt_step = view.prompt_step_blocks
        has_free, free_count = view.scheduling_has_free_blocks, view.scheduling_free_blocks
        two_steps = self.two_steps_look_ahead
        max_peft = peft.max_device_pages if peft is not None else _INT_MAX
        prefix_aware = self.enable_prefix_aware_scheduling
        walk_self = prefix_aware and view.reuse_walk
        # A first chunk's summary when none is walked.
        unwalked = _ZERO_SUMMARY if not prefix_aware else None
        # Cross summaries never take part in skipping here: only the self set is kept
        # (scheduling.md 2.7).
        skipping = self._skipping_is_relevant(view, cross_view)
        executing = self._contexts_already_executing(requests, view, None) if skipping else None
        contributed = executing[0] if executing is not None else set()
        prefix_summary = view.prefix_summary

        fitting: list[LlmRequest] = []
        gen_init: list[LlmRequest] = []
        paused: list[LlmRequest] = []
        seen_tasks: set[Any] = set()
        scheduled_peft = 0
        scheduled = cross_scheduled = 0  # blocks the admitted requests need for their next step
        cross = cross_view is not None
        if cross_view is not None:
            cross_one_step = cross_view.blocks_one_step
            cross_has_free = cross_view.scheduling_has_free_blocks
        transfers = 0  # transfer-in-progress requests admitted: a slot each, listed nowhere
        # The fast view's free test is a comparison with the count (SchedulingView).
        free = free_count() if free_count is not None else None
        admit, admit_gen_init = fitting.append, gen_init.append

        # Fast view, no cross pool: the common kinds take a short path. A generating request of
        # beam 1 without drafts or LoRA is admitted at the view's bound on its need while the
        # bound fits, without asking; the needs are asked for, and replace the bounds, only when
        # a free test fails on them, before anyone is paused. Every test that passes on the
        # bounds passes on the needs, so each decision is the one asking would make. Those
        # requests are the generating ones in fitting[resolved:] less ``exact`` (the general
        # path's). A context request without LoRA is tested here too; whatever does not pass
        # these short tests takes the general path below, which decides it from scratch. The
        # short paths test i < cap for the request cap (admitted <= i), and a pause turns them
        # off, so only the general path meets the end a pause sets.
        bounded = cross_view is None and view.generation_step_max is not None and free is not None
        bound = view.generation_step_max[1 if two_steps else 0] if bounded else 0  # type: ignore
        resolved = 0
        exact: set[LlmRequest] = set()
        running_states = self._running_states
        # The states that take a short path.
        lean_running = running_states if bounded else frozenset()
        lean_context = self._context_states if bounded else frozenset()
        # No short-path admission once the LoRA pages are over budget (transfer-in-progress
        # requests claim theirs untested).
        lean_cap = cap if max_peft >= 0 else -1

        end = len(requests)
        for i, req in enumerate(requests):
            if req.state in lean_running:
                if (
                    i < lean_cap
                    and req.beam_width == 1
                    and not req.draft_tokens
                    and req.lora_task_id is None
                    and scheduled + bound <= free
                ):
                    req.estimated_reusable_tokens = 0  # what asking for its need sets
                    scheduled += bound
                    admit(req)
                    continue
            elif req.state in lean_context:
                if i < lean_cap and req.lora_task_id is None:
                    block = None
                    if req.context_current_position == req.prepopulated_prompt_len:
                        summary = prefix_summary(req) if walk_self else unwalked
                        if summary is not None:
                            block = summary.first_new_block
                            if skipping and block is not None and block in contributed:
                                continue  # skipped, not paused
                        need = prompt_step(req, summary)
                    else:
                        need = one_step(req, two_steps)  # a later chunk: its blocks are held
                    if scheduled + need <= free:
                        admit(req)
                        scheduled += need
                        if block is not None and skipping:
                            contributed.add(block)
                        continue
                    # Not on the bounds: the general path asks again (same answers) and pauses.

            if i >= end:  # pauses cut the round short
                break
            kind = kinds[req.state]
            admitted = len(fitting) + len(gen_init) + transfers
            task = req.lora_task_id
            new_task = task is not None and task not in seen_tasks
            block = None
            if kind == _RUNNING:  # no summary, nothing to skip
                pass
            elif kind == _SKIP:
                continue
            elif kind == _TRANSFER:
                # A slot and LoRA pages; its KV is already outside the scheduling free count.
                if admitted >= cap:
                    break
                if new_task:
                    seen_tasks.add(task)
                    if peft is not None:
                        scheduled_peft += peft.determine_num_pages(req)
                        lean_cap = cap if scheduled_peft <= max_peft else -1
                transfers += 1
                continue
            else:
                summary = None
                position = req.context_current_position
                if kind == _CONTEXT and position == req.prepopulated_prompt_len:  # first chunk
                    if not prefix_aware:
                        summary = _ZERO_SUMMARY
                    elif walk_self:
                        summary = prefix_summary(req)
                    if summary is not None:
                        block = summary.first_new_block
                        if skipping and block is not None and block in contributed:
                            continue  # skipped, not paused
            required_peft = peft.determine_num_pages(req) if new_task and peft is not None else 0

            # Predict, commit only if every pool fits: a failed try leaves no trace. A pause
            # moves only the scheduling free counts, so the slot and page test and the request's
            # need in each pool are evaluated once, the free tests on every try; the cross need
            # is asked for once the self pool fits, as the blocks managers did (scheduling.md 2.6).
            if admitted < cap and scheduled_peft + required_peft <= max_peft:
                room = True
                if kind == _RUNNING:
                    total = scheduled + generation_step(req, two_steps)
                    fits = total <= free if free is not None else has_free(total)
                elif kind == _ENCODER:
                    total, fits = scheduled, True  # no KV in either pool
                else:
                    total = scheduled + one_step(req, two_steps, summary)
                    fits = total <= free if free is not None else has_free(total)
                if cross:
                    if kind == _ENCODER:
                        cross_total = cross_scheduled
                    else:
                        cross_total = None
                        if fits:
                            cross_total = cross_scheduled + cross_one_step(req, two_steps)
                            fits = cross_has_free(cross_total)
            else:
                room = fits = False
            while not fits:
                if bounded and room and len(fitting) > resolved:
                    # Maybe only the bounds do not fit: the needs of the requests admitted at
                    # the bound replace them (asked in admission order), then the same test.
                    lazy = [
                        r for r in fitting[resolved:] if r.state in running_states and r not in exact
                    ]
                    excess = bound * len(lazy) - sum([generation_step(r, two_steps) for r in lazy])
                    resolved = len(fitting)
                    exact.clear()
                    scheduled -= excess
                    total -= excess
                    fits = total <= free  # type: ignore[operator]
                    continue
                victim = self._last_started(requests, i, end)
                if victim < 0:
                    return CapacityOutput(fitting, gen_init, paused)  # head-of-line blocking
                paused_req = requests[victim]
                kv.scheduling_remove_sequence(paused_req.request_id)
                if cross_kv is not None:
                    cross_kv.scheduling_remove_sequence(paused_req.request_id)
                paused.append(paused_req)
                end = victim  # it and everything after it are out of this round
                lean_running = lean_context = frozenset()  # the general path tests the end
                if victim == i:
                    return CapacityOutput(fitting, gen_init, paused)  # it paused itself
                if room:  # then not encoder-init, which fits whenever there is room
                    if free is not None:
                        free = free_count()  # type: ignore[misc]
                    fits = total <= free if free is not None else has_free(total)
                    if fits and cross:
                        if cross_total is None:
                            cross_total = cross_scheduled + cross_one_step(req, two_steps)
                        fits = cross_has_free(cross_total)
            if kind == _GEN_INIT:
                admit_gen_init(req)
            else:
                admit(req)
                if kind == _RUNNING:
                    exact.add(req)  # its need is in ``scheduled``, not a bound
            scheduled = total
            if cross:
                cross_scheduled = cross_total
            if new_task:
                scheduled_peft += required_peft
                seen_tasks.add(task)
            if block is not None and skipping:
                contributed.add(block)  # only once admitted: a retry never sees its own block
        return CapacityOutput(fitting, gen_init, paused)

    def _last_started(self, requests: Sequence[LlmRequest], begin: int, end: int) -> int:
        """Index of the last started request in [begin, end), or -1. Started: generating, or a
        context past its first chunk; encoder-init and first-chunk contexts hold nothing worth
        freeing, and transfer-in-progress requests are never paused."""
        kinds = self._kinds
        for j in range(end - 1, begin - 1, -1):
            req = requests[j]
            kind = kinds[req.state]
            if kind == _RUNNING or (
                kind == _CONTEXT and req.context_current_position != req.prepopulated_prompt_len
            ):
                return j
        return -1

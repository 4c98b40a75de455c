"""The engine core's request table and counters: which requests it holds, in which queue,
with what sampling state and deadline. Every part of the core (admission, the step, outputs,
candidates) reads and retires requests through ``RequestTable``, so a request leaves every
structure at once."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from pdserve.scheduler import LlmRequest, LlmRequestState, lifecycle
from pdserve.scheduler.reorder import insert_request_in_order

from pdserve.workers.runner.sampling import RequestSampler, SamplingParams


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_seconds: float = 0.0
    schedule_seconds: float = 0.0
    context_tokens: int = 0
    generated_tokens: int = 0
    pauses: int = 0
    # The most recent paused ids (bounded so a long-running worker does not grow).
    paused_request_ids: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    finished: int = 0
    aborted: int = 0
    deadlines_exceeded: int = 0
    # Generation-only requests prefilled here although no pause forced it (their KV was meant
    # to arrive by transfer). An invariant check: it must stay 0.
    unexpected_recomputes: int = 0


@dataclass(slots=True)
class TrackedRequest:
    request: LlmRequest
    sampler: RequestSampler
    params: SamplingParams
    emitted: list[int] = field(default_factory=list)  # generated tokens already reported
    finish_reason: str | None = None
    deadline: float | None = None  # on the core's clock
    stream_kv: bool = False  # context-only, layer-wise: its KV is sent while it prefills
    # prompt_logprobs: the entries so far (one per prompt token after the first), None once
    # sent with the first token (or when not asked for).
    prompt_logprobs: list | None = None
    # n / best_of: candidate ``index`` of the request the router knows as ``wire_id`` (a
    # candidate after the first is a child request of its own, sharing the prompt's KV).
    wire_id: int = 0
    index: int = 0
    # The first candidate, until its prefill ends: the other candidates' samplers (they draw
    # their first tokens from the same logits).
    choice_samplers: list | None = None
    # A generation-only first candidate: the other candidates' first tokens (the context
    # worker drew them), forked off once its KV has arrived.
    choice_tokens: tuple = ()


class RequestTable:
    """``waiting``: admitted, in priority order; the step moves them to ``active`` (appended,
    so a request mid chunked prefill is never overtaken by a later arrival). ``tracked``: every
    request the core runs, by id. ``paused_since``: paused requests not yet prefilled again
    (id -> time.monotonic() of the pause)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.tracked: dict[int, TrackedRequest] = {}
        self.paused_since: dict[int, float] = {}
        # Requests whose other candidates are still to be forked: the step looks for them
        # only while there are any (the common step pays one truth test).
        self.awaiting_fork: set[int] = set()
        self.clock = clock
        self._num_deadlines = 0  # tracked requests that have a deadline

    def admit(self, tracked: TrackedRequest) -> None:
        self.track(tracked)
        insert_request_in_order(self.waiting, tracked.request)

    def track(self, tracked: TrackedRequest) -> None:
        self.tracked[tracked.request.request_id] = tracked
        self._num_deadlines += tracked.deadline is not None

    def untrack(self, request_id: int) -> TrackedRequest | None:
        self.paused_since.pop(request_id, None)
        self.awaiting_fork.discard(request_id)
        tracked = self.tracked.pop(request_id, None)
        if tracked is not None and tracked.deadline is not None:
            self._num_deadlines -= 1
        return tracked

    def retire(self, request: LlmRequest) -> None:
        """An active request is done here (finished, handed off, failed)."""
        self.active.remove(request)
        self.untrack(request.request_id)

    def dequeue(self, request: LlmRequest) -> None:
        for queue in (self.waiting, self.active):
            if request in queue:
                queue.remove(request)

    def activate_waiting(self) -> None:
        self.active.extend(self.waiting)
        self.waiting.clear()

    def expired(self) -> list[int]:
        if not self._num_deadlines:
            return []
        now = self.clock()
        return [rid for rid, t in self.tracked.items() if t.deadline is not None and now >= t.deadline]

    def time_left(self, request_id: int) -> float | None:
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.deadline is None:
            return None
        return tracked.deadline - self.clock()

    def note_pause(self, request_id: int) -> None:
        self.paused_since[request_id] = time.monotonic()


def status_snapshot(table: RequestTable, kv, stats: EngineStats, live: dict[int, LlmRequest],
                    transfer: dict) -> dict:
    """A worker's status for GetClusterStatus: requests by state, KV blocks, transfers
    (``transfer``: the KV connector's status), pauses and the invariants a drained worker must
    satisfy (free + used == total; every block held by a live request)."""
    free, used = kv.get_num_free_blocks(), kv.get_num_used_blocks()
    violations = []
    if free + used != kv.num_blocks:
        violations.append(f"free {free} + used {used} != total {kv.num_blocks}")
    orphans = [rid for rid in kv.sequence_ids() if rid not in live]
    if orphans:
        violations.append(f"blocks held by no live request: {sorted(orphans)[:10]}")
    return {
        "requests_by_state": lifecycle.count_by_state(live.values()),
        "num_active": len(table.active),
        "queue_depth": len(table.waiting),
        "free_blocks": free,
        "total_blocks": kv.num_blocks,
        "cached_blocks": kv.get_num_cached_blocks(),
        "pauses": stats.pauses,
        "queued_prefill_tokens": sum(
            r.prompt_len - r.context_current_position for r in (*table.waiting, *table.active)
            if r.state == LlmRequestState.CONTEXT_INIT),
        "unexpected_recomputes": stats.unexpected_recomputes,
        "steps": stats.steps,
        "finished": stats.finished,
        "aborted": stats.aborted,
        "deadlines_exceeded": stats.deadlines_exceeded,
        "quarantined_blocks": transfer["quarantined_blocks"],
        "transfer_sessions": transfer["transfer_sessions"],
        # Per-request bookkeeping; all 0 on a drained worker (memory stays bounded).
        "tracked": len(table.tracked) + transfer["tracked"],
        "transfers": transfer["transfers"],
        "violations": violations,
    }

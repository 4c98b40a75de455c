"""A worker without a model: it runs the real schedulers and the real KV bookkeeping and
advances requests exactly as the executor would, with tokens from a deterministic function.

Used by the scenario tests (a step harness whose every iteration is asserted), the scheduler
demo and the simulator. Disaggregated transfers complete after a fixed number of steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import lifecycle
from .reorder import insert_request_in_order
from .request import LlmRequest, LlmRequestState
from .scheduler import SimpleScheduler

TokenFn = Callable[[LlmRequest], int]


def default_token_fn(request: LlmRequest) -> int:
    """Deterministic stand-in for sampling: depends only on the request and its length, so a
    paused and recomputed request produces the same continuation."""
    return 3 + (request.request_id * 7919 + request.get_num_tokens(0) * 104729) % 997


@dataclass(frozen=True, slots=True)
class StepRecord:
    iteration: int
    context: tuple[tuple[int, int], ...]  # (request id, tokens computed this step)
    generation: tuple[int, ...]
    paused: tuple[int, ...]
    gen_init: tuple[int, ...]
    finished: tuple[int, ...]
    free_blocks: int
    num_active: int

    @property
    def context_ids(self) -> tuple[int, ...]:
        return tuple(rid for rid, _ in self.context)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.context) + len(self.generation)


@dataclass(slots=True)
class WorkerStats:
    steps: int = 0
    pauses: int = 0
    context_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    reused_blocks: int = 0
    peak_used_blocks: int = 0
    idle_steps: int = 0
    paused_ids: list[int] = field(default_factory=list)


class SimulatedWorker:
    def __init__(
        self,
        scheduler: SimpleScheduler,
        kv_cache_manager,
        *,
        max_input_len: int,
        token_fn: TokenFn = default_token_fn,
        transfer_steps: int = 1,
        ctx_send_steps: int = 1,
        max_num_active: int | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv_cache_manager
        self.max_input_len = max_input_len
        self.token_fn = token_fn
        self.transfer_steps = transfer_steps
        self.ctx_send_steps = ctx_send_steps
        self.max_num_active = max_num_active
        # Priority order lives in the waiting queue; activation appends, so a request that has
        # started (e.g. mid chunked prefill) is never overtaken in the active list by a later,
        # higher-priority arrival, which under GUARANTEED_NO_EVICT could block it forever.
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.finished: list[LlmRequest] = []
        self.iteration = 0
        self.stats = WorkerStats()
        self._receiving: dict[int, int] = {}  # gen request id -> steps left
        self._sending: dict[int, tuple[LlmRequest, int]] = {}  # ctx request id -> (req, steps left)

    def add_request(self, request: LlmRequest) -> None:
        insert_request_in_order(self.waiting, request)

    @property
    def idle(self) -> bool:
        return not self.active and not self.waiting and not self._sending

    def activate(self) -> None:
        """Waiting queue -> active list, in priority order, up to max_num_active."""
        room = len(self.waiting) if self.max_num_active is None else self.max_num_active - len(self.active)
        if room > 0:
            self.active.extend(self.waiting[:room])
            del self.waiting[:room]

    def step(self) -> StepRecord:
        self.activate()
        self._poll_receives()
        out = self.scheduler.schedule(self.active, set())
        lifecycle.pause_requests(out.paused_requests, self.kv, self.max_input_len)
        for request in out.fitting_disagg_gen_init_requests:
            lifecycle.reserve_generation_init(request, self.kv)
            self._receiving[request.request_id] = self.transfer_steps

        computed = lifecycle.prepare_context_chunks(out.context_requests, self.kv)
        context = [(r.request_id, n) for r, n in zip(out.context_requests, computed)]
        for request in out.generation_requests:
            lifecycle.prepare_generation_step(request, self.kv)
        self.stats.peak_used_blocks = max(
            self.stats.peak_used_blocks, self.kv.num_blocks - self.kv.get_num_free_blocks()
        )

        finished: list[int] = []
        for (rid, computed), request in zip(context, out.context_requests):
            self.stats.context_tokens += computed
            last = request.context_current_position + request.context_chunk_size >= request.prompt_len
            token = self.token_fn(request) if last else None
            if lifecycle.complete_context_chunk(request, self.kv, token):
                self.stats.generated_tokens += 1
                if request.is_context_only_request:
                    self._start_send(request)
                elif lifecycle.reached_max_tokens(request):
                    self._finish(request, finished)
        for request in out.generation_requests:
            lifecycle.complete_generation_step(request, self.token_fn(request))
            self.stats.generated_tokens += 1
            if lifecycle.reached_max_tokens(request):
                self._finish(request, finished)
        self._poll_sends(finished)

        paused = tuple(r.request_id for r in out.paused_requests)
        self.stats.pauses += len(paused)
        self.stats.paused_ids.extend(paused)
        self.stats.steps += 1
        if not context and not out.generation_requests:
            self.stats.idle_steps += 1
        record = StepRecord(
            iteration=self.iteration,
            context=tuple(context),
            generation=tuple(r.request_id for r in out.generation_requests),
            paused=paused,
            gen_init=tuple(r.request_id for r in out.fitting_disagg_gen_init_requests),
            finished=tuple(finished),
            free_blocks=self.kv.get_num_free_blocks(),
            num_active=len(self.active),
        )
        self.iteration += 1
        return record

    def run(self, max_steps: int = 100_000) -> list[StepRecord]:
        records = []
        while not self.idle:
            if len(records) >= max_steps:
                raise RuntimeError(f"requests still active after {max_steps} steps: {self.active}")
            records.append(self.step())
        return records

    def _finish(self, request: LlmRequest, finished: list[int]) -> None:
        lifecycle.finish_request(request, self.kv)
        self.active.remove(request)
        self.finished.append(request)
        self.stats.finished += 1
        finished.append(request.request_id)

    def _start_send(self, request: LlmRequest) -> None:
        # The slot is freed at once; the blocks stay until the send completes.
        self.active.remove(request)
        self._sending[request.request_id] = (request, self.ctx_send_steps)

    def _poll_sends(self, finished: list[int]) -> None:
        for rid in list(self._sending):
            request, left = self._sending[rid]
            if left <= 1:
                del self._sending[rid]
                lifecycle.finish_request(request, self.kv, LlmRequestState.DISAGG_CONTEXT_COMPLETE)
                self.finished.append(request)
                self.stats.finished += 1
                finished.append(rid)
            else:
                self._sending[rid] = (request, left - 1)

    def _poll_receives(self) -> None:
        by_id = {r.request_id: r for r in self.active}
        for rid in list(self._receiving):
            left = self._receiving[rid] - 1
            if left <= 0:
                del self._receiving[rid]
                by_id[rid].state = LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE
            else:
                self._receiving[rid] = left

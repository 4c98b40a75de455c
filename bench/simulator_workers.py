"""The simulator's workers: ``SimWorker`` (a ``SimulatedWorker`` on the simulated clock), the
shape of the batch each step ran (``step_shape``, what the cost model prices) and
``DecisionRecorder``, which logs every scheduler decision for the parity test. See
``bench/simulator.py``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from pdserve.bench.cost_model import SeqWork
from pdserve.bench.simulator_spec import WorkerSpec
from pdserve.cluster import policies as P
from pdserve.scheduler import LlmRequest, LlmRequestState, LlmRequestType, SimpleScheduler, lifecycle
from pdserve.scheduler.sim_worker import SimulatedWorker, StepRecord, default_token_fn

S = LlmRequestState


# ---------------------------------------------------------------------------- decisions

class Decision(NamedTuple):
    """What one scheduler call decided (ids and chunk sizes only)."""

    context: tuple[tuple[int, int], ...]  # (request id, chunk size)
    generation: tuple[int, ...]
    paused: tuple[int, ...]
    gen_init: tuple[int, ...]


class DecisionRecorder:
    """Wraps a SimpleScheduler and logs each call's decision; otherwise transparent."""

    def __init__(self, scheduler: SimpleScheduler) -> None:
        self.scheduler = scheduler
        self.log: list[Decision] = []

    def schedule(self, active_requests, inflight_request_ids=None):
        out = self.scheduler.schedule(active_requests, inflight_request_ids)
        self.log.append(Decision(
            tuple((r.request_id, r.context_chunk_size) for r in out.context_requests),
            tuple(r.request_id for r in out.generation_requests),
            tuple(r.request_id for r in out.paused_requests),
            tuple(r.request_id for r in out.fitting_disagg_gen_init_requests),
        ))
        return out

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)


# ---------------------------------------------------------------------------- workers

class SimWorker(SimulatedWorker):
    """A SimulatedWorker on a clock: transfers complete at event times instead of after a fixed
    number of steps, and a context-only request's blocks stay leased until its KV has landed."""

    def __init__(self, worker_id: str, role: P.WorkerRole, spec: WorkerSpec, *,
                 record_decisions: bool = False, token_fn: Callable[[LlmRequest], int] = default_token_fn
                 ) -> None:
        scheduler, kv = spec.build()
        self.recorder = DecisionRecorder(scheduler) if record_decisions else None
        super().__init__(self.recorder or scheduler, kv, max_input_len=spec.max_input_len,
                         token_fn=token_fn)
        self.worker_id = worker_id
        self.role = role
        self.spec = spec
        self.now = 0.0
        self.busy = False
        self.busy_s = 0.0
        self.by_id: dict[int, LlmRequest] = {}
        self.held: dict[int, LlmRequest] = {}  # context side: prefilled, KV leased until sent
        self.transfer_done_at: dict[int, float] = {}  # generation side: request id -> landed at
        self.incoming = 0  # dispatched to this worker, not yet arrived (the router's optimism)
        self.incoming_tokens = 0
        self.record_arrivals = record_decisions
        # Before each step: the requests that arrived since the previous one, as
        # (request id, prompt, max_new_tokens, type) -- enough to replay them into an engine core.
        self.arrival_log: list[list[tuple[int, list[int], int, LlmRequestType]]] = []
        self._arrived: list[tuple[int, list[int], int, LlmRequestType]] = []

    @property
    def has_work(self) -> bool:
        return bool(self.active or self.waiting)

    def deliver(self, request: LlmRequest) -> None:
        self.by_id[request.request_id] = request
        self.add_request(request)
        if self.record_arrivals:
            self._arrived.append((request.request_id, list(request.get_prompt_tokens()),
                                  request.max_new_tokens, request.llm_request_type))

    def begin_step(self, now: float) -> StepRecord:
        self.now = now
        if self.record_arrivals:
            self.arrival_log.append(self._arrived)
            self._arrived = []
        return self.step()

    def release(self, request_id: int) -> None:
        """The KV of a context-only request has landed on the generation side."""
        request = self.held.pop(request_id)
        lifecycle.finish_request(request, self.kv, S.DISAGG_CONTEXT_COMPLETE)
        self.stats.finished += 1
        self.by_id.pop(request_id, None)

    def load(self) -> P.WorkerLoad:
        pending = [r for r in self.active + self.waiting if r.state == S.CONTEXT_INIT]
        return P.WorkerLoad(
            self.worker_id, self.role,
            active_requests=len(self.active) + len(self.waiting) + self.incoming,
            queued_prompt_tokens=sum(r.prompt_len - r.context_current_position for r in pending)
            + self.incoming_tokens,
            free_kv_blocks=self.kv.get_num_free_blocks(), total_kv_blocks=self.kv.num_blocks,
            max_batch_size=self.spec.max_batch_size)

    # SimulatedWorker hooks -------------------------------------------------------------------

    def _start_send(self, request: LlmRequest) -> None:
        self.active.remove(request)
        self.held[request.request_id] = request

    def _poll_receives(self) -> None:
        if not self._receiving:
            return
        by_id = {r.request_id: r for r in self.active}
        for rid in list(self._receiving):
            done = self.transfer_done_at.get(rid)
            if done is None or done > self.now:
                continue
            del self._receiving[rid]
            del self.transfer_done_at[rid]
            request = by_id[rid]
            request.state = S.DISAGG_GENERATION_TRANS_COMPLETE
            if self.kv.enable_block_reuse:  # as the transceiver does: received blocks are cached
                self.kv.store_context_blocks(request)


def step_shape(worker: SimWorker, record: StepRecord) -> list[SeqWork]:
    """The batch a step ran, read back from the requests after the step: a context chunk of n
    tokens ended at the request's current position; a decode attended every token but the one
    it just appended."""
    seqs: list[SeqWork] = []
    for rid, n in record.context:
        if n <= 0:
            continue
        r = worker.by_id[rid]
        pos = r.context_current_position
        seqs.append(SeqWork(n, max(0, pos - n), pos >= r.prompt_len))
    for rid in record.generation:
        seqs.append(SeqWork(1, worker.by_id[rid].get_num_tokens(0) - 2, True))
    return seqs

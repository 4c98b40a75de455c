"""Discrete-event simulator of a pdserve cluster, for sizing: the real schedulers decide, a cost
model says how long each step takes.

Every simulated worker is a ``pdserve.scheduler.sim_worker.SimulatedWorker``: the real
``SimpleScheduler`` (capacity pass with GUARANTEED_NO_EVICT / MAX_UTILIZATION / STATIC_BATCH,
micro-batch pass with context chunking), the real ``KVCacheManager`` (prefix reuse, scheduling
counters) and the lifecycle functions the executor runs (pause-and-recompute, disaggregated
reservation, chunk advance). This module only adds time:

- a step starts when its worker is free and has work; its decisions are made at the start and
  its tokens leave at ``start + cost_model.step_time(batch)``;
- the router is the real one's logic on a simulated clock: FIFO queue, at most ``max_inflight``
  requests dispatched, the generation worker picked by ``cluster.policies`` (least loaded), the
  context worker by the configured policy, ``decide_prefill`` choosing remote or local prefill
  (local when there is no context worker: the colocated layout);
- a hand-off (context-only request finished) reaches the chosen generation worker one hop after
  the first token went out; its reservation sends a KV request, the blocks the generation side
  does not already cache cross the link (serialised per context/generation pair) and the
  context worker frees its blocks when they have landed;
- every message between the client/router and a worker takes ``hop_s``.

Nothing here imports torch or Ray; with ``step_jitter=0`` a run is a pure function of its
inputs, and the seed only drives the jitter.

This module: the event loop (``ClusterSimulator``, ``simulate``). The cluster's configuration
is in ``simulator_spec.py``, the workers on the clock in ``simulator_workers.py``; the
``simulate run|search|validate`` drivers in ``sizing.py`` and ``calibrate.py``.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from pdserve.bench.cost_model import CostModel
from pdserve.bench.metrics import RequestRecord, Slo, summarize
from pdserve.bench.simulator_spec import ClusterSpec
from pdserve.bench.simulator_workers import Decision, SimWorker, step_shape
from pdserve.bench.workload import WorkItem
from pdserve.cluster import policies as P
from pdserve.scheduler import ContextPhaseParams, LlmRequest, LlmRequestType
from pdserve.scheduler.sim_worker import StepRecord, default_token_fn


# ---------------------------------------------------------------------------- the simulation

@dataclass(slots=True)
class _Attempt:
    index: int  # the workload item
    worker: SimWorker
    request: LlmRequest
    emitted: int = 0  # generated tokens the client already has
    hand_off_to: SimWorker | None = None  # context-only: the generation worker picked at dispatch


@dataclass(slots=True)
class SimResult:
    spec: ClusterSpec
    records: list[RequestRecord]
    workers: dict[str, dict[str, float]]
    queue_series: list[tuple[float, int, int]]  # (t, router queue depth, in flight)
    gpus: int
    decisions: dict[str, list[Decision]] = field(default_factory=dict)
    arrival_logs: dict[str, list[list[tuple[int, list[int], int, LlmRequestType]]]] = field(default_factory=dict)
    events: int = 0

    def summary(self, slo: Slo) -> dict:
        out = summarize(self.records, slo)
        out["cluster"] = self.spec.label
        out["gpus"] = self.gpus
        out["goodput_rps_per_gpu"] = out["goodput_rps"] / self.gpus
        out["workers"] = self.workers
        return out


class SimulationStalled(RuntimeError):
    pass


_ARRIVE, _DELIVER, _STEP_END, _KICK, _LANDED, _RELEASE, _DONE = range(7)


class ClusterSimulator:
    def __init__(self, spec: ClusterSpec, cost: CostModel, *, seed: int = 0, step_jitter: float = 0.0,
                 record_decisions: bool = False,
                 token_fn: Callable[[LlmRequest], int] = default_token_fn) -> None:
        self.spec = spec
        self.cost = cost
        self.rng = random.Random(seed)
        self.step_jitter = step_jitter
        self.record_decisions = record_decisions
        self.token_fn = token_fn

    def run(self, work: Sequence[WorkItem], *, max_events: int = 50_000_000) -> SimResult:
        spec = self.spec
        ctx = [SimWorker(f"ctx-{i}", P.WorkerRole.CONTEXT, spec.context,
                         record_decisions=self.record_decisions, token_fn=self.token_fn)
               for i in range(spec.num_context_workers)]
        gen = [SimWorker(f"gen-{i}", P.WorkerRole.GENERATION, spec.generation,
                         record_decisions=self.record_decisions, token_fn=self.token_fn)
               for i in range(spec.num_generation_workers)]
        workers = ctx + gen
        ctx_policy = P.make_policy(spec.context_policy, P.WorkerRole.CONTEXT)
        gen_policy = P.make_policy("least_loaded", P.WorkerRole.GENERATION)
        max_inflight = spec.max_inflight or sum(w.spec.max_batch_size for w in gen)
        hop = spec.latency.hop_s
        control = spec.latency.kv_control_s
        block_bytes = {w.worker_id: self.cost.kv_block_bytes(w.spec.tokens_per_block) for w in workers}
        pool_tokens = min(w.spec.num_kv_blocks * w.spec.tokens_per_block for w in workers)
        hashes_needed = spec.context_policy == "kv_cache_aware"

        records = [RequestRecord(w.index, w.arrival_s, len(w.prompt), w.max_tokens) for w in work]
        items = {w.index: w for w in work}
        by_index = {r.index: r for r in records}
        if len(by_index) != len(records):
            raise ValueError("work item indices must be unique")
        attempts: dict[int, _Attempt] = {}
        attempt_ids = itertools.count(1)
        queue: deque[int] = deque()
        pair_free: dict[tuple[str, str], float] = {}
        series: list[tuple[float, int, int]] = []
        inflight = 0
        heap: list[tuple[float, int, int, tuple]] = []
        order = itertools.count()

        def push(t: float, kind: int, *args) -> None:
            heapq.heappush(heap, (t, next(order), kind, args))

        def sample(t: float) -> None:
            point = (t, len(queue), inflight)
            if not series or series[-1][1:] != point[1:]:
                series.append(point)

        def new_attempt(index: int, worker: SimWorker, max_tokens: int, kind: LlmRequestType,
                        cpp: ContextPhaseParams | None = None, emitted: int = 0) -> _Attempt:
            request = LlmRequest(next(attempt_ids), items[index].prompt, max_tokens,
                                 llm_request_type=kind, context_phase_params=cpp)
            attempt = _Attempt(index, worker, request, emitted)
            attempts[request.request_id] = attempt
            return attempt

        def send(t: float, attempt: _Attempt) -> None:
            attempt.worker.incoming += 1
            attempt.worker.incoming_tokens += attempt.request.prompt_len
            push(t + hop, _DELIVER, attempt)

        def dispatch(t: float) -> None:
            nonlocal inflight
            while queue and inflight < max_inflight:
                index = queue.popleft()
                item = items[index]
                rec = by_index[index]
                if len(item.prompt) + item.max_tokens > pool_tokens:
                    rec.error = "prompt + max_tokens exceed a worker's KV pool"
                    continue
                info = (P.PromptInfo.from_tokens(item.prompt, gen[0].spec.tokens_per_block)
                        if hashes_needed else P.PromptInfo(len(item.prompt), gen[0].spec.tokens_per_block))
                loads = [w.load() for w in workers]
                g = gen_policy.select(loads, info)
                c = ctx_policy.select(loads, info) if ctx else None
                decision = P.decide_prefill(P.DisaggregationMode.AUTO, len(item.prompt),
                                            g.matched_tokens, None, context_available=c is not None)
                g_worker = next(w for w in gen if w.worker_id == g.worker_id)
                inflight += 1
                if decision.route == P.PrefillRoute.REMOTE:
                    c_worker = next(w for w in ctx if w.worker_id == c.worker_id)
                    # A 1-token request ends on the context worker (no hand-off).
                    kind = LlmRequestType.CONTEXT_ONLY if item.max_tokens > 1 else LlmRequestType.CONTEXT_AND_GENERATION
                    attempt = new_attempt(index, c_worker, 1, kind)
                    attempt.hand_off_to = g_worker
                else:
                    rec.local_prefill = True
                    attempt = new_attempt(index, g_worker, item.max_tokens,
                                          LlmRequestType.CONTEXT_AND_GENERATION)
                rec.worker = attempt.worker.worker_id
                send(t, attempt)
            sample(t)

        def kick(t: float, worker: SimWorker) -> None:
            if worker.busy or not worker.has_work:
                return
            record = worker.begin_step(t)
            seqs = step_shape(worker, record)
            if seqs:
                d = self.cost.step_time(seqs)
                if self.step_jitter > 0:
                    d *= math.exp(self.rng.gauss(0.0, self.step_jitter))
                worker.busy = True
                worker.busy_s += d
                push(t + d, _STEP_END, worker, record)
            else:
                after_step(t, worker, record)
                if record.paused or record.gen_init:
                    push(t, _KICK, worker)

        def after_step(t: float, worker: SimWorker, record: StepRecord) -> None:
            out_t = t + hop
            for rid in [*record.context_ids, *record.generation]:
                attempt = attempts.get(rid)
                if attempt is None:
                    continue
                r = attempt.request
                rec = by_index[attempt.index]
                new = r.get_num_tokens(0) - r.orig_prompt_len - attempt.emitted
                if new > 0:
                    attempt.emitted += new
                    rec.num_tokens += new
                    rec.deltas.append((out_t, new))
                    if rec.first_token_s is None:
                        rec.first_token_s = out_t
                if r.request_id in worker.held:  # context-only prefill done: hand off
                    rec.pauses += r.num_pauses
                    rec.cached_tokens = max(rec.cached_tokens, r.prepopulated_prompt_len)
                    cpp = ContextPhaseParams(r.request_id, [r.get_tokens(0)[-1]],
                                             ctx_worker_id=worker.worker_id,
                                             num_blocks=worker.kv.get_num_allocated_blocks(r.request_id))
                    g = attempt.hand_off_to
                    send(out_t, new_attempt(attempt.index, g, items[attempt.index].max_tokens,
                                            LlmRequestType.GENERATION_ONLY, cpp, emitted=attempt.emitted))
            for rid in record.gen_init:  # reserved: ask the context worker for the missing blocks
                attempt = attempts[rid]
                r = attempt.request
                cpp = r.context_phase_params
                src = next(w for w in ctx if w.worker_id == cpp.ctx_worker_id)
                cached = r.prepopulated_prompt_len // worker.kv.tokens_per_block
                nbytes = max(0, cpp.num_blocks - cached) * block_bytes[src.worker_id]
                key = (src.worker_id, worker.worker_id)
                start = max(t + control / 2, pair_free.get(key, 0.0))
                landed = start + spec.link.transfer_time(nbytes, self.cost.tp)
                pair_free[key] = landed
                rec = by_index[attempt.index]
                rec.kv_bytes += nbytes
                rec.kv_ms += 1000.0 * (landed - start)
                push(landed, _RELEASE, src, cpp.ctx_request_id)
                push(landed + control / 2, _LANDED, worker, rid)
            for rid in record.finished:
                attempt = attempts.pop(rid, None)
                if attempt is None:
                    continue
                rec = by_index[attempt.index]
                rec.finish_s = out_t
                rec.pauses += attempt.request.num_pauses
                rec.cached_tokens = max(rec.cached_tokens, attempt.request.prepopulated_prompt_len)
                worker.by_id.pop(rid, None)
                push(out_t, _DONE)

        for w in work:
            push(w.arrival_s, _ARRIVE, w.index)
        events = 0
        while heap:
            t, _, kind, args = heapq.heappop(heap)
            events += 1
            if events > max_events:
                raise SimulationStalled(f"more than {max_events} events")
            if kind == _ARRIVE:
                queue.append(args[0])
                dispatch(t)
            elif kind == _DELIVER:
                attempt = args[0]
                attempt.worker.incoming -= 1
                attempt.worker.incoming_tokens -= attempt.request.prompt_len
                attempt.worker.deliver(attempt.request)
                kick(t, attempt.worker)
            elif kind == _STEP_END:
                worker, record = args
                worker.busy = False
                after_step(t, worker, record)
                kick(t, worker)
            elif kind == _KICK:
                kick(t, args[0])
            elif kind == _LANDED:
                worker, rid = args
                worker.transfer_done_at[rid] = t
                kick(t, worker)
            elif kind == _RELEASE:
                worker, rid = args
                attempts.pop(rid, None)
                worker.release(rid)
                kick(t, worker)
            elif kind == _DONE:
                inflight -= 1
                dispatch(t)

        unfinished = [r.index for r in records if r.finish_s is None and not r.error]
        if unfinished:
            states = {w.worker_id: [f"{r.request_id}:{r.state.name}" for r in w.active + w.waiting][:8]
                      for w in workers}
            raise SimulationStalled(f"{len(unfinished)} requests never finished (first {unfinished[:5]}); "
                                    f"worker requests: {states}")
        end = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
        stats = {w.worker_id: {
            "steps": w.stats.steps, "busy_s": w.busy_s, "utilization": w.busy_s / end if end else 0.0,
            "pauses": w.stats.pauses, "context_tokens": w.stats.context_tokens,
            "generated_tokens": w.stats.generated_tokens, "peak_used_blocks": w.stats.peak_used_blocks,
            "num_kv_blocks": w.kv.num_blocks, "reused_blocks": w.kv.num_reused_blocks,
        } for w in workers}
        return SimResult(
            spec, records, stats, series, gpus=spec.num_workers * self.cost.tp,
            decisions={w.worker_id: w.recorder.log for w in workers if w.recorder is not None},
            arrival_logs={w.worker_id: w.arrival_log for w in workers} if self.record_decisions else {},
            events=events,
        )


def simulate(spec: ClusterSpec, cost: CostModel, work: Sequence[WorkItem], *, seed: int = 0,
             step_jitter: float = 0.0) -> SimResult:
    return ClusterSimulator(spec, cost, seed=seed, step_jitter=step_jitter).run(work)

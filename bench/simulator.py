"""Discrete-event simulator of a pdserve cluster, for sizing: the real schedulers decide, a cost
model says how long each step takes.

Every simulated worker is a ``pdserve.scheduler.sim_worker.SimulatedWorker``: the real
``SimpleScheduler`` (capacity pass with GUARANTEED_NO_EVICT / MAX_UTILIZATION / STATIC_BATCH,
micro-batch pass with context chunking), the real ``KVCacheManager`` (prefix reuse, scheduling
counters) and the lifecycle functions the engine core runs (pause-and-recompute, disaggregated
reservation, chunk advance). This module only adds time:

- a step starts when its worker is free and has work; its decisions are made at the start and
  its tokens leave at ``start + cost_model.step_time(batch)``;
- the router is the real one's logic on a simulated clock: FIFO queue, at most ``max_inflight``
  requests dispatched, the generation and context workers picked by the policies of
  ``spec.routing`` (``cluster.policies.make_policy``, the router's own classes) on
  ``PromptInfo.from_tokens(prompt).with_matches(index.match(keys))``, ``decide_prefill``
  choosing remote or local prefill on the generation worker's matched tokens (local when there
  is no context worker: the colocated layout);
- the router's prefix index (``cluster.prefix_index.PrefixIndex``) is fed as the live one is:
  after each step (and each release of a transferred request's blocks) a worker drains its KV
  event log and the batch, numbered per worker, reaches the index one hop later (an overflowed
  log sends ``kv_snapshot()`` instead). Routing "oracle" uses the kv-aware policy on the exact
  ``cached_leading_blocks`` of every worker at decision time instead (no event delay). Each
  request records the prefill worker's predicted match (``RequestRecord.predicted_tokens``, at
  decision time) and what that worker actually reused (``reused_tokens``: the prefill attempt's
  ``prepopulated_prompt_len``), as the live router reports them, hence the summary's prefix hit
  rate and prediction accuracy (``metrics.summarize``, ``SimResult.routing_summary``);
- a hand-off (context-only request finished) reaches the chosen generation worker one hop after
  the first token went out; its reservation sends a KV request, the blocks the generation side
  does not already cache cross the link (serialised per context/generation pair) and the
  context worker frees its blocks when they have landed;
- ``kv_transfer_mode="layerwise"``: the hand-off leaves when the step with the last prefill
  chunk starts (the live CONTEXT_STREAMING); a KV request that arrives while that step runs
  sends layer l once the step is l+1 layers in (layers take equal shares of the step), each
  layer's bytes after the previous layer's, and lands no earlier than the step's end (the first
  token rides with the KV);
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
from pdserve.bench.simulator_spec import ORACLE, ClusterSpec
from pdserve.bench.simulator_workers import Decision, SimWorker, step_shape
from pdserve.bench.workload import WorkItem
from pdserve.cluster import policies as P
from pdserve.cluster.prefix_index import PrefixIndex
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
    prefill: bool = False  # the attempt that prefills the prompt (context-only, or local)


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
    index: PrefixIndex | None = None  # the router's prefix index at the end of the run
    index_resyncs: int = 0  # gaps the index saw (each answered by a snapshot); 0 unless a bug
    kv_snapshots: int = 0  # snapshots the workers sent (an overflowed event log, or a resync)

    def routing_summary(self) -> dict:
        """Over the completed requests: prefix hit rate (prompt tokens the prefill worker reused
        / prompt tokens) and prediction accuracy (share of requests whose predicted match on the
        prefill worker equals what it reused); the same figures as ``summary()["prefix"]``."""
        done = [r for r in self.records if r.ok and r.reused_tokens >= 0]
        prompt = sum(r.prompt_len for r in done)
        reused = sum(r.reused_tokens for r in done)
        return {"mode": self.spec.routing, "requests": len(done), "prompt_tokens": prompt,
                "reused_tokens": reused, "predicted_tokens": sum(r.predicted_tokens for r in done),
                "prefix_hit_rate": reused / prompt if prompt else math.nan,
                "prediction_accuracy": (sum(r.predicted_tokens == r.reused_tokens for r in done)
                                        / len(done) if done else math.nan),
                "over_predicted": sum(r.predicted_tokens > r.reused_tokens for r in done),
                "under_predicted": sum(r.predicted_tokens < r.reused_tokens for r in done),
                "index_resyncs": self.index_resyncs, "kv_snapshots": self.kv_snapshots}

    def summary(self, slo: Slo) -> dict:
        out = summarize(self.records, slo)
        out["cluster"] = self.spec.label
        out["gpus"] = self.gpus
        out["goodput_rps_per_gpu"] = out["goodput_rps"] / self.gpus
        out["workers"] = self.workers
        out["routing"] = self.routing_summary()
        return out


class SimulationStalled(RuntimeError):
    pass


_ARRIVE, _DELIVER, _STEP_END, _KICK, _LANDED, _RELEASE, _DONE, _KV_EVENTS, _KV_RESYNC = range(9)


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
        by_id = {w.worker_id: w for w in workers}
        # The router's policies: the oracle is kv-aware on exact matches.
        oracle = spec.routing == ORACLE
        mode = "kv-aware" if oracle else spec.routing
        weights = P.KvAwareWeights(spec.kv_overlap_weight, spec.kv_decode_weight)
        ctx_policy = P.make_policy(mode, P.WorkerRole.CONTEXT, weights)
        gen_policy = P.make_policy(mode, P.WorkerRole.GENERATION, weights)
        tokens_per_block = gen[0].spec.tokens_per_block  # the router's: the index's block keys
        max_inflight = spec.max_inflight or sum(w.spec.max_batch_size for w in gen)
        hop = spec.latency.hop_s
        control = spec.latency.kv_control_s
        layerwise = spec.kv_transfer_mode == "layerwise"
        layers = self.cost.model.num_layers
        # layer-wise: context request id -> (start, end) of the step with its last chunk, until
        # its generation side reserves
        streaming: dict[int, tuple[float, float]] = {}
        handed_off_early: set[int] = set()  # layer-wise hand-offs whose step has not ended
        block_bytes = {w.worker_id: self.cost.kv_block_bytes(w.spec.tokens_per_block) for w in workers}
        pool_tokens = min(w.spec.num_kv_blocks * w.spec.tokens_per_block for w in workers)
        # The router's prefix index, fed by the workers' KV events one hop after each step.
        prefix_index = PrefixIndex()
        for w in workers:
            prefix_index.add_worker(w.worker_id)
        kv_seq = {w.worker_id: 0 for w in workers}  # each worker's next batch number
        resyncs = snapshots = 0

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

        def publish(t: float, worker: SimWorker) -> None:
            """The worker drains its KV event log (as after each step); the batch reaches the
            index one hop later. An overflowed log sends the whole cache as a snapshot, which
            names the next batch's number and takes none itself (workers/process/channel_server.py)."""
            nonlocal snapshots
            log = worker.kv.kv_events
            if log is None:
                return
            events, overflowed = log.drain()
            wid = worker.worker_id
            if overflowed:
                snapshots += 1
                push(t + hop, _KV_EVENTS, wid, kv_seq[wid], worker.kv.kv_snapshot(), True)
            elif events:
                push(t + hop, _KV_EVENTS, wid, kv_seq[wid], events, False)
                kv_seq[wid] += 1

        def index_receive(t: float, wid: str, seq: int, events: list, snapshot: bool) -> None:
            nonlocal resyncs
            if snapshot:
                ok = prefix_index.apply_snapshot(wid, seq - 1, events)
            elif prefix_index.needs_snapshot(wid):
                return  # the snapshot asked for is on its way
            else:
                ok = prefix_index.apply(wid, seq, events)
            if not ok:  # as the router does: ask the worker for a snapshot (one hop each way)
                resyncs += 1
                prefix_index.expect_snapshot(wid)
                push(t + hop, _KV_RESYNC, by_id[wid])

        def matches(info: P.PromptInfo) -> dict[str, int]:
            if not info.block_keys:
                return {}
            if oracle:
                exact = ((w.worker_id, w.kv.cached_leading_blocks(info.block_keys)) for w in workers)
                return {wid: n for wid, n in exact if n}
            return prefix_index.match(info.block_keys)

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
                blank = P.PromptInfo.from_tokens(item.prompt, tokens_per_block)
                info = blank.with_matches(matches(blank))
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
                attempt.prefill = True
                rec.worker = attempt.worker.worker_id
                rec.predicted_tokens = info.matched_blocks.get(rec.worker, 0) * tokens_per_block
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
                if layerwise:
                    begin_streams(t, d, worker, record)
                push(t + d, _STEP_END, worker, record)
            else:
                publish(t, worker)
                after_step(t, worker, record)
                if record.paused or record.gen_init:
                    push(t, _KICK, worker)

        def hand_off(t: float, worker: SimWorker, attempt: _Attempt, r: LlmRequest,
                     emitted: int) -> None:
            cpp = ContextPhaseParams(r.request_id, [r.get_tokens(0)[-1]],
                                     ctx_worker_id=worker.worker_id,
                                     num_blocks=worker.kv.get_num_allocated_blocks(r.request_id))
            send(t, new_attempt(attempt.index, attempt.hand_off_to, items[attempt.index].max_tokens,
                                LlmRequestType.GENERATION_ONLY, cpp, emitted=emitted))

        def begin_streams(t: float, d: float, worker: SimWorker, record: StepRecord) -> None:
            """Layer-wise: the step that runs a request's last prefill chunk starts; the hand-off
            goes now (its first token, counted as emitted, reaches the client after the step)."""
            for rid in record.context_ids:
                attempt = attempts.get(rid)
                if attempt is None or rid not in worker.held or rid in handed_off_early:
                    continue
                streaming[rid] = (t, t + d)
                handed_off_early.add(rid)
                hand_off(t + hop, worker, attempt, attempt.request, emitted=1)

        def landed_at(start: float, nbytes: int, window: tuple[float, float] | None) -> float:
            """When the KV of a transfer that may start at ``start`` has landed."""
            if window is None or start >= window[1] or nbytes == 0:
                return start + spec.link.transfer_time(nbytes, self.cost.tp)
            t0, t1 = window
            per_layer = spec.link.transfer_time(nbytes, self.cost.tp) - spec.link.latency_s
            per_layer /= layers
            end = start
            for layer in range(layers):
                end = max(end, t0 + (layer + 1) * (t1 - t0) / layers) + per_layer
            return max(end + spec.link.latency_s, t1)

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
                    if attempt.prefill and attempt.emitted == 0:  # the prefill's token
                        rec.reused_tokens = r.prepopulated_prompt_len
                    attempt.emitted += new
                    rec.num_tokens += new
                    rec.deltas.append((out_t, new))
                    if rec.first_token_s is None:
                        rec.first_token_s = out_t
                if r.request_id in worker.held:  # context-only prefill done: hand off
                    rec.pauses += r.num_pauses
                    rec.cached_tokens = max(rec.cached_tokens, r.prepopulated_prompt_len)
                    if r.request_id in handed_off_early:  # layer-wise: it left at the step's start
                        handed_off_early.discard(r.request_id)
                    else:
                        hand_off(out_t, worker, attempt, r, attempt.emitted)
            for rid in record.gen_init:  # reserved: ask the context worker for the missing blocks
                attempt = attempts[rid]
                r = attempt.request
                cpp = r.context_phase_params
                src = next(w for w in ctx if w.worker_id == cpp.ctx_worker_id)
                cached = r.prepopulated_prompt_len // worker.kv.tokens_per_block
                nbytes = max(0, cpp.num_blocks - cached) * block_bytes[src.worker_id]
                key = (src.worker_id, worker.worker_id)
                start = max(t + control / 2, pair_free.get(key, 0.0))
                landed = landed_at(start, nbytes, streaming.pop(cpp.ctx_request_id, None))
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
                publish(t, worker)  # before after_step: the index hears of it before the client
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
                if not worker.busy:  # else with the running step's batch, as a worker would
                    publish(t, worker)
                kick(t, worker)
            elif kind == _DONE:
                inflight -= 1
                dispatch(t)
            elif kind == _KV_EVENTS:
                index_receive(t, *args)
            elif kind == _KV_RESYNC:  # the worker answers: pending events first, then its cache
                worker = args[0]
                publish(t, worker)  # (so the snapshot covers every numbered batch)
                snapshots += 1
                push(t + hop, _KV_EVENTS, worker.worker_id, kv_seq[worker.worker_id],
                     worker.kv.kv_snapshot() if worker.kv.kv_events is not None else [], True)

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
            "cached_blocks": w.kv.get_num_cached_blocks(), "index_blocks": prefix_index.num_blocks(w.worker_id),
        } for w in workers}
        return SimResult(
            spec, records, stats, series, gpus=spec.num_workers * self.cost.tp,
            decisions={w.worker_id: w.recorder.log for w in workers if w.recorder is not None},
            arrival_logs={w.worker_id: w.arrival_log for w in workers} if self.record_decisions else {},
            events=events, index=prefix_index, index_resyncs=resyncs,
            kv_snapshots=snapshots,
        )


def simulate(spec: ClusterSpec, cost: CostModel, work: Sequence[WorkItem], *, seed: int = 0,
             step_jitter: float = 0.0) -> SimResult:
    return ClusterSimulator(spec, cost, seed=seed, step_jitter=step_jitter).run(work)

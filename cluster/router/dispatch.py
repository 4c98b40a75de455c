"""Running requests: the dispatch loop takes requests off the router's queue in the reorder
policy's order (within max_inflight), and one attempt loop per request carries out the
context_first flow over the workers' request channels.

Flow per request (docs/design.md section 3): a context-only copy (max_tokens 1) goes to a
context worker; its CONTEXT_DONE update carries the first token and the context-phase params;
the first token is streamed at once; a generation-only request with those params goes to a
generation worker, which reserves KV, receives it and decodes. Short uncached prompts skip the
context worker (conditional disaggregation). A failed attempt is retried where
``policies.plan_retry`` says (another pair, or local prefill on a generation worker),
continuing after the tokens the client already has.

Every wait is bounded: by the request's deadline, and a worker's silence (no update and no
heartbeat from its step loop) by worker_call_timeout_s; a request that is only queued on a live
worker is not retried. Each attempt carries the seconds it has left (``deadline_s``), so a worker
frees a request whose client is gone even if the router's abort never arrives.

A failed KV transfer (the generation worker is alive, its KV did not arrive) is not a worker
death: the request falls back (``policies.plan_transfer_fallback``: local prefill on that
generation worker, or another context worker for it) without using up max_retries, which are
for dead or silent workers; each fallback is counted (``Timings.fallbacks``, metrics).

The dispatcher sees the router through a narrow interface: the ``RequestQueue`` it drains, the
``RouterCounters`` it counts in, the ``WorkerRegistry`` and the routing policies, and a
``Responder`` (``emit``, ``fail``) that takes each request's outputs. It knows no front door.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any, NamedTuple, Protocol

from pdserve.cluster import policies as P
from pdserve.cluster import validation as V
from pdserve.cluster.worker_channel import CLOSED, ChannelClosed
from pdserve.scheduler import LlmRequestType
from pdserve.transport.requests import (
    ErrorKind,
    UpdateInfo,
    UpdateKind,
    WireRequest,
    WireUpdate,
)

from .config import RouterConfig
from .counters import RouterCounters
from .errors import (
    DeadlineExceeded,
    RequestRejected,
    RouterErrorKind,
    StopStringReached,
    TransferFailed,
    WorkerDown,
    WorkerFailure,
)
from .queue import RequestQueue
from .registry import WorkerRegistry
from .request_state import Phase, RouterRequest

log = logging.getLogger("pdserve.router")

WORKER_DEADLINE_GRACE_S = 0.5  # a worker's deadline for an attempt trails the request's
MAX_TRANSFER_FALLBACKS = 4  # failed transfers one request may fall back from (then: give up)


class Responder(Protocol):
    """Where a request's outputs go (the router core; the front doors read them from there)."""

    async def emit(self, req: RouterRequest, tokens: list[int], finish_reason: str | None,
                   info: UpdateInfo | None, update: WireUpdate | None = None) -> None: ...

    async def fail(self, req: RouterRequest, kind: RouterErrorKind, message: str) -> None: ...


class Routing(NamedTuple):
    """The routing mode's policies (``policies.make_policy``)."""

    context: Any
    generation: Any


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, queue: RequestQueue,
                 counters: RouterCounters, responder: Responder, routing: Routing,
                 limits: V.ValidationLimits, tokens_per_block: int) -> None:
        self.config = config
        self.registry = registry
        self.queue = queue
        self.counters = counters
        self.responder = responder
        self.routing = routing
        self.limits = limits
        self.tokens_per_block = tokens_per_block
        self.wake = asyncio.Event()
        # The request id each worker attempt carries. Workers outlive a router: a restarted
        # router's ids must not meet the old one's (a late abort leaves a tombstone for its id,
        # a lease keeps its id), so they start at this incarnation's microsecond clock.
        self.attempt_ids = itertools.count(time.time_ns() // 1000)

    # ------------------------------------------------------------------ the queue

    async def loop(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            self.dispatch_ready()

    def dispatch_ready(self) -> None:
        """Start as many waiting requests as max_inflight allows, in the reorder policy's order.
        Runs inline when a request arrives (no extra event-loop hop on an idle router) and from
        the loop when a request ends."""
        queue = self.queue
        for req in queue.take_ready():
            req.dispatched = time.monotonic()
            self.counters.observe_queue_time(req.dispatched - req.received)
            req.task = asyncio.create_task(self.run(req))
            # Not in run's finally: a task cancelled before it first runs never enters it.
            req.task.add_done_callback(self._run_done)
        self.counters.observe_queue(len(queue), queue.inflight)

    def _run_done(self, task: asyncio.Task) -> None:
        self.queue.release()
        self.wake.set()

    # ------------------------------------------------------------------ one request

    async def run(self, req: RouterRequest) -> None:
        routing, counters, responder = self.routing, self.counters, self.responder
        # Pairs whose attempt failed (retries), each with the workers' incarnations then: a
        # failure is of one process, and a worker Ray restarted may be tried again.
        failed: dict[tuple[str | None, str], tuple[int | None, int | None]] = {}
        transfer_failed: set[tuple[str | None, str]] = set()  # pairs whose transfer failed (fallbacks)
        last_error = ""
        wait_until: float | None = None  # set at the first wait: worker_wait_s in all

        def retry_plan() -> P.RetryPlan:
            for pair, incarnations in list(failed.items()):
                if self._incarnations(pair) != incarnations:
                    del failed[pair]
            return P.plan_retry(failed, list(self.registry.loads.values()), prompt_info,
                                retries_used=req.retries, max_retries=self.config.max_retries,
                                context_policy=routing.context,
                                generation_policy=routing.generation,
                                mode=P.DisaggregationMode(req.spec.disaggregation),
                                unready=self.registry.unready_pairs())

        try:
            blank = P.PromptInfo.from_tokens(req.prompt, self.tokens_per_block)
            prompt_info = blank.with_matches(self.registry.prefix_matches(blank))
            plan = self._first_plan(req, prompt_info)
            while True:
                if plan.action == P.RetryAction.GIVE_UP and plan.worker_may_return:
                    if wait_until is None:
                        wait_until = time.monotonic() + self.config.worker_wait_s
                        counters.count("worker_waits")
                    if await self._wait_for_worker(req, plan.reason, wait_until):
                        prompt_info = blank.with_matches(self.registry.prefix_matches(blank))
                        if failed or transfer_failed:
                            # A transfer's generation worker went down: its pairs are new now.
                            transfer_failed.clear()
                            plan = retry_plan()
                            if plan.action != P.RetryAction.GIVE_UP:
                                counters.count_retry(req)
                        else:
                            plan = self._first_plan(req, prompt_info)
                        continue
                if plan.action == P.RetryAction.GIVE_UP:
                    await responder.fail(req, RouterErrorKind.UNAVAILABLE,
                                 f"no worker could serve the request: {plan.reason}{last_error}")
                    return
                try:
                    prefill_worker = plan.ctx_worker if plan.action == P.RetryAction.PAIR else plan.gen_worker
                    req.predicted_tokens = (prompt_info.matched_blocks.get(prefill_worker, 0)
                                            * prompt_info.tokens_per_block)
                    if plan.action == P.RetryAction.PAIR:
                        await self._remote(req, plan.ctx_worker, plan.gen_worker)
                    else:
                        await self._local(req, plan.gen_worker)
                    return
                except TransferFailed as exc:
                    if req.cancelled or time.monotonic() >= req.deadline:
                        return
                    if req.several and any(c.streamed for c in req.candidates):
                        await responder.fail(req, RouterErrorKind.UNAVAILABLE,
                                             f"a request of {len(req.candidates)} candidates lost "
                                             f"its KV transfer after streaming: {exc}")
                        return
                    log.warning("request %s: KV transfer %s -> %s failed: %s", req.external_id,
                                plan.ctx_worker, plan.gen_worker, exc)
                    last_error = f"; last failure: {exc}"
                    transfer_failed.add((plan.ctx_worker, plan.gen_worker))
                    prompt_info = blank.with_matches(self.registry.prefix_matches(blank))
                    plan = (P.plan_transfer_fallback(
                        transfer_failed, plan.gen_worker, list(self.registry.loads.values()),
                        prompt_info, context_policy=routing.context,
                        mode=P.DisaggregationMode(req.spec.disaggregation),
                        unready=self.registry.unready_pairs())
                        if len(transfer_failed) <= MAX_TRANSFER_FALLBACKS else
                        P.RetryPlan(P.RetryAction.GIVE_UP, None, None,
                                    f"{MAX_TRANSFER_FALLBACKS} KV transfers failed"))
                    if plan.action != P.RetryAction.GIVE_UP:
                        counters.count_fallback(req, local=plan.action == P.RetryAction.LOCAL_PREFILL)
                except WorkerFailure as exc:
                    if req.cancelled or time.monotonic() >= req.deadline:
                        return  # Generate answers DEADLINE_EXCEEDED; no retry past the deadline
                    if req.several and any(c.streamed for c in req.candidates):
                        # Its candidates were forked from one prefill on the lost worker; each
                        # would need a prefill of its own to go on. Not built: it fails whole.
                        await responder.fail(req, RouterErrorKind.UNAVAILABLE,
                                             f"a request of {len(req.candidates)} candidates lost "
                                             f"its worker after streaming: {exc}")
                        return
                    log.warning("request %s: attempt on %s/%s failed: %s", req.external_id,
                                plan.ctx_worker, plan.gen_worker, exc)
                    if isinstance(exc, WorkerDown):  # so the plan may wait for its restart
                        self.registry.mark_unhealthy(exc.worker_id, str(exc))
                    last_error = f"; last failure: {exc}"
                    pair = (plan.ctx_worker if plan.action == P.RetryAction.PAIR else None, plan.gen_worker)
                    failed[pair] = self._incarnations(pair)
                    prompt_info = blank.with_matches(self.registry.prefix_matches(blank))
                    plan = retry_plan()
                    if plan.action != P.RetryAction.GIVE_UP:
                        counters.count_retry(req)
        except asyncio.CancelledError:
            raise
        except StopStringReached:
            return
        except RequestRejected as exc:
            await responder.fail(req, RouterErrorKind.INVALID_ARGUMENT, str(exc))
        except DeadlineExceeded:
            await responder.fail(req, RouterErrorKind.DEADLINE_EXCEEDED,
                         f"request {req.external_id!r} did not finish within its deadline")
        except Exception as exc:  # a router bug must not leave the client waiting
            log.exception("request %s failed in the router", req.external_id)
            await responder.fail(req, RouterErrorKind.INTERNAL, f"router error: {exc!r}")

    def _first_plan(self, req: RouterRequest, prompt_info: P.PromptInfo) -> P.RetryPlan:
        routing = self.routing
        loads = list(self.registry.loads.values())
        gen = routing.generation.select(loads, prompt_info)
        if gen is None:
            return P.RetryPlan(P.RetryAction.GIVE_UP, None, None, "no healthy generation worker",
                               worker_may_return=bool(self.registry.gen_ids))
        ctx = None
        if self.registry.ctx_ids:
            # Only over a KV pair that is set up: a transfer never waits for a rendezvous.
            unready = self.registry.unready_pairs()
            ctx = routing.context.select(
                loads, prompt_info, exclude={c for c, g in unready if g == gen.worker_id})
            if ctx is None and req.spec.disaggregation == P.DisaggregationMode.ALWAYS:
                for other in routing.generation.rank(loads, prompt_info, exclude={gen.worker_id}):
                    ctx = routing.context.select(
                        loads, prompt_info,
                        exclude={c for c, g in unready if g == other.worker_id})
                    if ctx is not None:
                        gen = other
                        break
                else:  # no pair is set up: this one's transfer waits for its set-up
                    ctx = routing.context.select(loads, prompt_info)
        try:
            decision = P.decide_prefill(P.DisaggregationMode(req.spec.disaggregation), len(req.prompt),
                                        gen.matched_tokens, self.config.max_local_prefill_length,
                                        context_available=ctx is not None)
        except P.NoWorkerAvailable as exc:  # disaggregation=ALWAYS, no context worker healthy
            return P.RetryPlan(P.RetryAction.GIVE_UP, None, None, str(exc),
                               worker_may_return=bool(self.registry.ctx_ids))
        if decision.route == P.PrefillRoute.REMOTE:
            return P.RetryPlan(P.RetryAction.PAIR, ctx.worker_id, gen.worker_id, decision.reason)
        return P.RetryPlan(P.RetryAction.LOCAL_PREFILL, None, gen.worker_id, decision.reason)

    def _incarnations(self, pair: tuple[str | None, str]) -> tuple[int | None, int | None]:
        infos = self.registry.infos
        return tuple(infos[w].incarnation if w in infos else None for w in pair)  # type: ignore[return-value]

    async def _wait_for_worker(self, req: RouterRequest, why: str, until: float) -> bool:
        """Wait (until ``until``, never past the request's deadline) for a worker to turn
        healthy: Ray is restarting one, and a request that can wait a few seconds is not lost
        (measured kill -> healthy: 1.7-3.2 s, docs/benchmarks.md section 14). True if one did."""
        left = min(until, req.deadline) - time.monotonic()
        if left <= 0:
            return False
        log.info("request %s waits up to %.1f s for a worker: %s", req.external_id, left, why)
        return await self.registry.wait_for_healthy(left)

    async def _remote(self, req: RouterRequest, ctx_id: str, gen_id: str) -> None:
        req.start_remote(ctx_id, gen_id)
        self.registry.note_dispatch(ctx_id, len(req.prompt))
        self.registry.note_dispatch(gen_id, 0)
        self.counters.count_prefill(local=False)
        prompt, max_tokens, forced = req.continuation(self.limits.max_input_len)
        # A 1-token request ends on the context worker; no generation worker will claim KV.
        kind = LlmRequestType.CONTEXT_ONLY if max_tokens > 1 else LlmRequestType.CONTEXT_AND_GENERATION
        ctx_wire = self._wire(req, prompt, 1, kind, forced[:1])
        # Layer-wise: the context worker says CONTEXT_STREAMING when the last prefill chunk is
        # scheduled, and the generation attempt starts then, so its KV request meets the send
        # while the forward writes the layers. Its updates wait (``gate``) until the first
        # token, which comes from the context worker, has been streamed. A retry that forces
        # tokens keeps the after-prefill flow (the first token must be known to force it).
        streamed = (self.config.kv_transfer_mode == "layerwise"
                    and kind == LlmRequestType.CONTEXT_ONLY and not forced and not req.several)
        if streamed:
            ctx_wire = dataclasses.replace(ctx_wire, stream_kv=True)
        gen_task: asyncio.Task | None = None
        gen_wire: WireRequest | None = None
        gate = asyncio.Event()
        last: WireUpdate | None = None
        try:
            async for update in self._stream(req, ctx_id, ctx_wire):
                if update.kind in (UpdateKind.TOKENS, UpdateKind.CHOICE_DONE):
                    # The context worker runs the whole request (1 token) and it has several
                    # candidates: each one's token and end as it comes.
                    await self.responder.emit(req, update.new_token_ids, update.finish_reason,
                                              update.info, update)
                    continue
                if update.kind == UpdateKind.CONTEXT_STREAMING:
                    if streamed and gen_task is None:
                        gen_wire = self._wire(req, prompt, max_tokens,
                                              LlmRequestType.GENERATION_ONLY, forced,
                                              update.context_phase_params)
                        gen_task = asyncio.create_task(self._decode(req, gen_id, gen_wire, gate))
                    continue
                last = update
            self._check_final(last, f"context worker {ctx_id}", req, ctx_id)
        except BaseException:
            await self._drop(gen_task, gen_id, gen_wire)
            raise
        if last.kind == UpdateKind.ABORTED:  # the router's own abort (the request was cancelled)
            await self._drop(gen_task, gen_id, gen_wire)
            return
        if last.info is not None:
            req.reused_tokens = last.info.cached_tokens
        first = last.new_token_ids  # with several candidates, one first token each
        if last.kind == UpdateKind.FINISHED or max_tokens <= len(forced) + min(1, len(first)):
            # Ended on the context worker (a stop token, or it was all the client asked for).
            await self._drop(gen_task, gen_id, gen_wire)
            await self.responder.emit(req, first, last.finish_reason or "length", last.info, last)
            return
        # The context attempt's KV stays leased until the generation side has it: an attempt
        # that ends any other way (failure, cancel, a stop string in the first token) gives
        # the lease back at once.
        leased = (ctx_id, ctx_wire.request_id)
        req.attempts.append(leased)
        done = False
        try:
            await self.responder.emit(req, first, None, last.info, last)
            req.move(Phase.TRANSFER)
            if gen_task is None:
                gen_wire = self._wire(req, prompt, max_tokens, LlmRequestType.GENERATION_ONLY,
                                      forced, last.context_phase_params,
                                      choice_tokens=tuple((t,) for t in first[1:]))
                await self._decode(req, gen_id, gen_wire)
            else:
                gate.set()
                await gen_task
            done = True
        finally:
            if not done:
                await self._drop(gen_task, gen_id, gen_wire)
            if leased in req.attempts:
                req.attempts.remove(leased)
                if not done and not req.cancelled:  # a cancel aborted it already
                    self.registry.abort_attempt(*leased)

    async def _drop(self, task: asyncio.Task | None, gen_id: str, wire: WireRequest | None) -> None:
        """End a layer-wise generation attempt started early that will not be used: cancel its
        task and abort it on the worker (which cancels its KV request)."""
        if task is None:
            return
        finished = task.done() and not task.cancelled() and task.exception() is None
        task.cancel()
        await asyncio.wait([task])  # (a cancel of this coroutine still goes through)
        if not task.cancelled():
            task.exception()  # retrieved: its failure is not the request's any more
        if not finished and wire is not None:
            self.registry.abort_attempt(gen_id, wire.request_id)  # harmless if already gone

    async def _local(self, req: RouterRequest, gen_id: str) -> None:
        req.start_local(gen_id)
        self.registry.note_dispatch(gen_id, len(req.prompt))
        self.counters.count_prefill(local=True)
        prompt, max_tokens, forced = req.continuation(self.limits.max_input_len)
        await self._decode(req, gen_id, self._wire(req, prompt, max_tokens,
                                                   LlmRequestType.CONTEXT_AND_GENERATION, forced))

    async def _decode(self, req: RouterRequest, gen_id: str, wire: WireRequest,
                      gate: asyncio.Event | None = None) -> None:
        """A generation attempt's updates, streamed to the client. With ``gate`` (layer-wise:
        started before the first token was streamed) each waits until the gate opens."""
        last: WireUpdate | None = None
        # Closed on every way out (a break, a stop string), so the attempt is forgotten now.
        async with contextlib.aclosing(self._stream(req, gen_id, wire)) as updates:
            async for update in updates:
                if gate is not None:
                    await gate.wait()
                last = update
                if update.kind in (UpdateKind.FAILED, UpdateKind.ABORTED):
                    break
                if update.new_token_ids and req.phase != Phase.DECODE:
                    req.move(Phase.DECODE)
                if update.finished and req.local_prefill and update.info is not None:
                    req.reused_tokens = update.info.cached_tokens
                await self.responder.emit(req, update.new_token_ids, update.finish_reason, update.info,
                                          update)
        self._check_final(last, f"generation worker {gen_id}", req, gen_id)

    @staticmethod
    def _check_final(last: WireUpdate | None, who: str, req: RouterRequest, worker_id: str) -> None:
        """An attempt's stream ended: raise for anything but a finish or the router's own abort.
        An abort the router did not ask for (the request is not cancelled) is a worker failure:
        returning quietly would leave the client waiting for its deadline."""
        if last is None or not last.finished:
            raise WorkerFailure(f"{who}: the stream ended without a final update")
        if last.kind == UpdateKind.ABORTED and not req.cancelled:
            raise WorkerFailure(f"{who} aborted the attempt unasked")
        if last.kind == UpdateKind.FAILED:
            if last.error == ErrorKind.DEADLINE:
                raise DeadlineExceeded(who)
            if last.error == ErrorKind.REJECTED:
                raise RequestRejected(last.message)  # the request, not the worker
            if last.error == ErrorKind.TRANSFER:
                raise TransferFailed(f"{who}: {last.message}")
            if last.error == ErrorKind.UNAVAILABLE:
                raise WorkerDown(f"{who}: {last.message}", worker_id)
            raise WorkerFailure(f"{who}: {last.message}")

    def _wire(self, req: RouterRequest, prompt: list[int], max_tokens: int, kind: LlmRequestType,
              forced: list[int], params=None, choice_tokens: tuple = ()) -> WireRequest:
        return WireRequest(
            next(self.attempt_ids), req.external_id, prompt, max_tokens, req.spec.priority,
            kind, list(req.spec.agent_hierarchy) or None, params,
            # The prompt's logprobs go with the first token: a retry after it does not redo them.
            req.sampling.replace(max_tokens=max_tokens,
                                 prompt_logprobs=None if req.streamed else req.sampling.prompt_logprobs),
            # The worker's own deadline for the attempt: it frees everything once it passes.
            # It trails the router's, so the router answers DEADLINE_EXCEEDED (and aborts) first.
            max(0.0, req.deadline - time.monotonic()) + WORKER_DEADLINE_GRACE_S, tuple(forced),
            # A retry's prompt may hold streamed tokens: the output starts after the client's.
            output_start=len(req.prompt), choice_tokens=choice_tokens)

    async def _stream(self, req: RouterRequest, worker_id: str, wire: WireRequest):
        """A worker's updates for one attempt, over its request channel. An attempt waits as
        long as the request's deadline allows while the worker is heard from (updates or the
        step loop's heartbeats): a queued request is not a failed one. A worker silent for
        worker_call_timeout_s, or a closed channel, is a WorkerFailure; a request the worker
        finds invalid is RequestRejected (see _check_final)."""
        attempt = wire.request_id
        timeout = min(self.config.status_timeout_s, max(0.001, req.deadline - time.monotonic()))
        channel = await self.registry.channel_for(worker_id, timeout)
        req.attempts.append((worker_id, attempt))
        try:
            updates = channel.attempt(attempt)
            channel.generate(wire)
            silence_limit = self.config.worker_call_timeout_s
            while True:
                # Wake now and then to check the worker is still heard from.
                wait = min(max(0.5, silence_limit / 3), max(0.001, req.deadline - time.monotonic()))
                try:
                    async with asyncio.timeout(wait):
                        update = await updates.get()
                except TimeoutError:
                    if time.monotonic() >= req.deadline:
                        raise
                    silent = time.monotonic() - channel.last_heard
                    if silent > silence_limit:
                        self.registry.abort_attempt(worker_id, attempt)
                        self.registry.mark_unhealthy(worker_id, f"silent for {silent:.1f} s")
                        raise WorkerFailure(f"{worker_id} was silent for {silent:.1f} s "
                                            "(no update, no heartbeat)") from None
                    continue
                if update is CLOSED:
                    raise ChannelClosed(channel.closed_reason)
                yield update
                if update.finished:
                    return
        except TimeoutError as exc:  # the request's deadline
            self.registry.abort_attempt(worker_id, attempt)
            raise WorkerFailure(f"{worker_id}: the request's deadline passed") from exc
        except ChannelClosed as exc:
            self.registry.mark_unhealthy(worker_id, f"request channel closed: {exc}")
            raise WorkerFailure(f"{worker_id}: {exc}") from exc
        finally:
            channel.forget(attempt)
            if (worker_id, attempt) in req.attempts:
                req.attempts.remove((worker_id, attempt))

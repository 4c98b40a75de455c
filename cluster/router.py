"""The gRPC router (grpc.aio): validates and admits requests into a bounded queue, orders the
queue each dispatch round with the agent-tree policy (plus priority), picks a context and a
generation worker, runs the context_first flow and streams tokens back. Requests and their
updates travel over each worker's request channel (``worker_channel.py``, a socket with msgpack
frames: a Ray call per request costs more than the whole 1-token request); Ray carries
everything else (status, aborts when no channel is up, restarts, KV control messages).

Flow per request (DESIGN.md "Request lifecycle"): a context-only copy (max_tokens 1) goes to a
context worker; its last update carries the first token and the context-phase params; the first
token is streamed at once; a generation-only request with those params goes to a generation
worker, which reserves KV, receives it and decodes. Short uncached prompts skip the context
worker (conditional disaggregation). A failed attempt is retried on another pair or prefilled
locally on a generation worker, continuing after the tokens the client already has.

Reliability rules:
- Every wait is bounded: by the request's deadline, and a worker's silence (no update and no
  heartbeat from its step loop) by worker_call_timeout_s; a request that is only queued on a
  live worker is not retried. Each wire request carries the seconds it has left
  (``deadline_s``), so a worker frees a request whose client is gone even if the router's abort
  never arrives.
- A dead worker (its request channel closes, or a Ray actor error) is marked unhealthy at once;
  Ray restarts it, the status refresh sees a new incarnation (and its new channel endpoint) and
  a healthy status, and the worker takes requests again.
- A request is only ever retried after a worker failure, at most max_retries times, never after
  its deadline; tokens already streamed are folded into the retry's prompt (and, where that would
  exceed max_input_len, forced as the first generated tokens), so the client sees no duplicate
  and no gap.
- Cancellation (Abort, client disconnect, deadline) aborts every live attempt, including a
  context attempt whose KV is still leased for the generation side.
- Health turns NOT_SERVING while a worker reports an invariant violation, the router's own
  bookkeeping is inconsistent, or no generation worker is healthy.
- Memory is bounded: the queue (max_queue), requests in flight (max_inflight), the dispatch log.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster import policies as P
from pdserve.cluster.metrics import KV_PATH_KINDS
from pdserve.cluster.rpc import ROUTER_SERVICE_NAME, router_pb2 as pb, router_pb2_grpc, spec_from_proto
from pdserve.cluster.text_stream import TextStream
from pdserve.cluster.worker_channel import CLOSED, ChannelClosed, WorkerChannel
from pdserve.scheduler import AgentTreePolicy, LlmRequest, insert_request_in_order

log = logging.getLogger("pdserve.router")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    context_policy: str = "round_robin"
    max_local_prefill_length: int | None = None  # conditional disaggregation off by default
    max_queue: int = 1024
    max_inflight: int | None = None  # default: the generation workers' batch sizes summed
    max_retries: int = 2
    # A worker heard from neither by updates nor by heartbeats this long has failed its attempts.
    worker_call_timeout_s: float = 30.0
    status_timeout_s: float = 5.0  # one worker's status call (a restarting worker is slow)
    default_deadline_s: float = 600.0
    status_refresh_s: float = 0.5
    max_message_bytes: int = 4 << 20
    agent_percentage: float | None = None  # agent tree off unless agent types are given
    agent_types: tuple[str, ...] = ()
    agent_inflight_seq_num: int | None = None
    # OpenAI-compatible HTTP on the same router (cluster/http_server.py); None: off.
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    served_model_name: str | None = None  # default: the model directory's name


class WorkerFailure(RuntimeError):
    """A worker call failed (actor died, timed out, or the transfer failed)."""


class RequestRejected(ValueError):
    """A worker refused the request itself (validation); retrying elsewhere cannot help."""


class DeadlineExceeded(RuntimeError):
    """A worker ended the attempt at the request's deadline."""


class _Failure(NamedTuple):
    """Put on a request's output queue: the front door ends the call with this status."""

    code: grpc.StatusCode
    message: str


class RouterError(Exception):
    """A request refused at admission or ended by an error: a gRPC status code and a message
    (the HTTP front door maps the code to an HTTP status). For an error in one request field,
    ``field`` names it and ``detail`` is what is wrong with it; ``message`` is then
    "<field>: <detail>", gRPC's form."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field
        self.detail = detail if detail is not None else message


class _StopStringReached(Exception):
    """Raised out of _emit when the text hit a stop string: the request is complete and its
    attempts were aborted; _run ends quietly."""


# Where a request is, as the router sees it (request_phases()).
QUEUED, PREFILL, LOCAL, TRANSFER, DECODE = "queued", "prefill", "local", "transfer", "decode"
DISPATCH_LOG_LEN = 1000
MAX_EVENTS = 1000  # recent worker events kept for GetClusterStatus
STATUS_EVENTS = 200  # the most GetClusterStatus returns
WORKER_DEADLINE_GRACE_S = 0.5  # a worker's deadline for an attempt trails the request's


@dataclass(slots=True)
class _Request:
    internal_id: int
    external_id: str
    spec: P.GenerateSpec
    prompt: list[int]
    sampling: dict[str, Any]
    queue_entry: LlmRequest  # the reorder policies' view of this request
    received: float
    deadline: float
    text: TextStream
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    streamed: list[int] = field(default_factory=list)
    attempts: list[tuple[str, int]] = field(default_factory=list)  # (worker id, attempt id) live
    dispatched: float | None = None
    first_token: float | None = None
    ctx_worker: str = ""
    gen_worker: str = ""
    retries: int = 0
    local_prefill: bool = False
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    pauses: int = 0
    cached_tokens: int = 0
    # Blocks the generation worker's receive moved; None until one completed (see _kv_path).
    kv_blocks: int | None = None
    cancelled: bool = False
    task: asyncio.Task | None = None
    phase: str = QUEUED


class Router(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        config: RouterConfig,
        workers: dict[str, Any],  # worker id -> Ray actor handle
        infos: dict[str, dict[str, Any]],  # worker id -> WorkerActorBase.info()
        tokenizer,
        metrics=None,
        model_dir: str | None = None,  # the served model: the HTTP front door's model id and chat template
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.workers = workers
        self.infos = infos
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ctx_ids = sorted(w for w, i in infos.items() if i["role"] == "context")
        self.gen_ids = sorted(w for w, i in infos.items() if i["role"] == "generation")
        if not self.gen_ids:
            raise ValueError("the router needs at least one generation worker")
        first = infos[self.gen_ids[0]]
        self.tokens_per_block = first["tokens_per_block"]
        # A request must fit every worker's pool on its own, or GNE would hold it forever.
        pool_tokens = min(i["num_kv_blocks"] * i["tokens_per_block"] for i in infos.values())
        self.limits = P.ValidationLimits(
            vocab_size=first["vocab_size"],
            max_input_len=min(min(i["max_input_len"] for i in infos.values()), pool_tokens - 1),
            max_seq_len=min(min(i["max_seq_len"] for i in infos.values()), pool_tokens),
        )
        self.context_policy = P.make_policy(config.context_policy, P.WorkerRole.CONTEXT)
        self.generation_policy = P.make_policy("least_loaded", P.WorkerRole.GENERATION)
        self.max_inflight = config.max_inflight or sum(infos[g]["max_batch_size"] for g in self.gen_ids)
        self.reorder = (
            AgentTreePolicy(config.agent_percentage, list(config.agent_types),
                            config.agent_inflight_seq_num)
            if config.agent_types else None
        )
        self.loads: dict[str, P.WorkerLoad] = {
            w: P.WorkerLoad(w, P.WorkerRole.CONTEXT if i["role"] == "context" else P.WorkerRole.GENERATION,
                            free_kv_blocks=i["num_kv_blocks"], total_kv_blocks=i["num_kv_blocks"],
                            max_batch_size=i["max_batch_size"])
            for w, i in infos.items()
        }
        self.waiting: list[LlmRequest] = []
        self.requests: dict[int, _Request] = {}  # internal id -> request (queued or running)
        self.by_external: dict[str, int] = {}
        self.inflight = 0
        # external ids in dispatch order (the most recent ones only)
        self.dispatch_log: collections.deque[str] = collections.deque(maxlen=DISPATCH_LOG_LEN)
        self.violations: dict[str, list[str]] = {}  # worker id -> its last reported violations
        self.restarts: dict[str, int] = {w: 0 for w in infos}
        self.serving = True
        self.totals = {k: 0 for k in ("received", "completed", "failed", "aborted", "rejected",
                                      "retries", "remote_prefills", "local_prefills")}
        # How each finished request's KV reached its generation worker (KvPathTotals).
        self.kv_paths = {k: 0 for k in KV_PATH_KINDS}
        # The workers' transfer, pause and resume events, from their heartbeats (oldest first).
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self._ids = itertools.count(1)
        self._attempt_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.channels: dict[str, WorkerChannel] = {}  # worker id -> its open request channel
        self._connecting: dict[str, asyncio.Lock] = {}
        self._reconnects: dict[str, asyncio.Task] = {}  # worker id -> its reconnect in progress
        self.statuses: dict[str, dict[str, Any]] = {}  # worker id -> its last heartbeat status
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.http = None  # the OpenAI-compatible front door, when config.http_port is set
        self.http_port: int | None = None
        self.accepting = True  # False once stop() began: new requests get UNAVAILABLE

    # ------------------------------------------------------------------ server

    async def start(self) -> int:
        opts = [("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes)]
        self.server = grpc.aio.server(options=opts)
        router_pb2_grpc.add_RouterServicer_to_server(self, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [ROUTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self.server.start()
        await self.health.set(ROUTER_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._hear_all_workers(self.config.status_timeout_s)
        self._tasks = [asyncio.create_task(self._dispatch_loop()),
                       asyncio.create_task(self._refresh_loop())]
        log.info("router serving on %s:%d", self.config.host, self.port)
        if self.config.http_port is not None:
            await self._start_http()
        return self.port

    async def _hear_all_workers(self, timeout_s: float) -> None:
        """Open every worker's channel and wait (bounded) for its first heartbeat, so the router
        starts with real loads and GetClusterStatus has every worker from the first call. A
        worker not heard by then is left to the refresh loop's reconnects."""
        deadline = time.monotonic() + timeout_s
        results = await asyncio.gather(*(self._open_channel(w, timeout_s) for w in self.workers),
                                       return_exceptions=True)
        for worker_id, result in zip(self.workers, results):
            if isinstance(result, BaseException):
                log.warning("request channel to %s: %r", worker_id, result)
        while time.monotonic() < deadline and any(w not in self.statuses for w in self.workers):
            await asyncio.sleep(0.02)

    async def _start_http(self) -> None:
        from pathlib import Path

        from pdserve.cluster.chat_template import ChatTemplate
        from pdserve.cluster.http_server import OpenAIServer

        model_id = self.config.served_model_name or (Path(self.model_dir).name if self.model_dir else "pdserve")
        template = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir else None
        self.http = OpenAIServer(self, model_id, template)
        self.http_port = await self.http.start(self.config.http_host, self.config.http_port)

    async def stop(self, grace_s: float = 2.0) -> None:
        self.accepting = False
        if self.http is not None:
            await self.http.stop()
        for t in [*self._tasks, *self._reconnects.values()]:
            t.cancel()
        for channel in self.channels.values():
            channel.close("router stopping")
        if self.server is not None:
            await self.server.stop(grace_s)

    # ------------------------------------------------------------------ Generate

    async def Generate(self, request, context):
        try:
            req = self.admit(spec_from_proto(request), context.time_remaining())
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        async with contextlib.aclosing(self.results(req)) as stream:
            try:
                async for item in stream:
                    yield item
            except RouterError as exc:
                await context.abort(exc.code, exc.message)

    # The one admission path, shared by the gRPC and HTTP front doors: admit() validates and
    # queues a request, results() streams its GenerateResponse messages and, however the caller
    # leaves (finished, error, disconnect), cancels what is still running.

    def admit(self, spec: P.GenerateSpec, time_remaining_s: float | None = None) -> _Request:
        """Validate, tokenize and queue one request; raises RouterError (INVALID_ARGUMENT,
        ALREADY_EXISTS, RESOURCE_EXHAUSTED, UNAVAILABLE) when it cannot be queued."""
        now = time.monotonic()
        if not self.accepting:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        try:
            P.validate_generate_spec(spec, self.limits)
            prompt = self._prompt_ids(spec)
        except P.ValidationError as exc:
            self.totals["rejected"] += 1
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field, exc.message) from None
        external = spec.request_id or uuid.uuid4().hex
        if external in self.by_external:
            self.totals["rejected"] += 1
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {external!r} is already in flight",
                              "request_id", f"{external!r} is already in flight")
        if len(self.waiting) >= self.config.max_queue:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"router queue is full ({self.config.max_queue} waiting)")
        budget = self.config.default_deadline_s
        if spec.deadline_ms is not None:
            budget = min(budget, spec.deadline_ms / 1000.0)
        if time_remaining_s is not None:
            budget = min(budget, time_remaining_s)
        internal = next(self._ids)
        entry = LlmRequest(internal, prompt, spec.max_tokens, priority=spec.priority,
                           agent_hierarchy=list(spec.agent_hierarchy) or None)
        req = _Request(internal, external, spec, prompt, _sampling(spec), entry, now, now + budget,
                       TextStream(self._decode_text, spec.stop))
        self.requests[internal] = req
        self.by_external[external] = internal
        self.totals["received"] += 1
        insert_request_in_order(self.waiting, entry)
        self._dispatch_ready()
        return req

    async def results(self, req: _Request):
        """The request's GenerateResponse messages; the last has finish_reason. Raises
        RouterError when it fails or its deadline passes. Close it (contextlib.aclosing) so that
        a caller that leaves early cancels the request."""
        finished = False
        try:
            while True:
                # asyncio.timeout, not wait_for: wait_for wraps the get in one more task
                # (one more event-loop hop per update)
                async with asyncio.timeout_at(self._loop_time(req.deadline)):
                    item = await req.out.get()
                if isinstance(item, _Failure):
                    self._cancel(req, item.message)
                    self._count_failed()
                    raise RouterError(item.code, item.message)
                yield item
                if item.finish_reason:
                    finished = True
                    return
        except TimeoutError:
            self._cancel(req, "deadline")
            self._count_failed()
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {req.external_id!r} did not finish within its deadline") from None
        finally:
            if not finished and not req.cancelled:
                self._cancel(req, "client went away")  # also the path for client cancellation
            self._forget(req)

    def _prompt_ids(self, spec: P.GenerateSpec) -> list[int]:
        if spec.token_ids is not None:
            return list(spec.token_ids)
        ids = self.tokenizer.encode(spec.text, add_special_tokens=False).ids
        if not ids:
            raise P.ValidationError("prompt.text", "encodes to no tokens")
        if self.limits.max_input_len is not None and len(ids) > self.limits.max_input_len:
            raise P.ValidationError("prompt.text", f"{len(ids)} tokens exceed max_input_len "
                                                   f"{self.limits.max_input_len}")
        if self.limits.max_seq_len is not None and len(ids) + spec.max_tokens > self.limits.max_seq_len:
            raise P.ValidationError("sampling.max_tokens", f"prompt ({len(ids)}) + max_tokens "
                                                           f"exceeds max_seq_len {self.limits.max_seq_len}")
        return ids

    # ------------------------------------------------------------------ Abort / status

    async def Abort(self, request, context):
        internal = self.by_external.get(request.request_id)
        if internal is None:
            return pb.AbortResponse(aborted=False, detail=f"no request {request.request_id!r} in flight")
        req = self.requests[internal]
        self._cancel(req, "aborted by client")
        self.totals["aborted"] += 1
        await req.out.put(self._final(req, [], "abort", req.text.finish()))
        return pb.AbortResponse(aborted=True, detail="aborted")

    def request_phases(self) -> dict[str, dict[str, Any]]:
        """Every request the router holds: its phase and its live attempts (worker, attempt id)."""
        return {r.external_id: {"phase": r.phase, "attempts": list(r.attempts)}
                for r in self.requests.values()}

    def debug_state(self) -> dict[str, Any]:
        """Sizes of the router's per-request bookkeeping (all 0 when drained), restarts seen,
        violations (its own and the workers'), and whether health says SERVING."""
        return {"requests": len(self.requests), "by_external": len(self.by_external),
                "waiting": len(self.waiting), "inflight": self.inflight,
                "dispatch_log": len(self.dispatch_log), "restarts": dict(self.restarts),
                "violations": self.router_violations() + [
                    f"{w}: {v}" for w, vs in sorted(self.violations.items()) for v in vs],
                "serving": self.serving, "pid": os.getpid(),
                "healthy": {w: load.healthy for w, load in sorted(self.loads.items())},
                # prefix blocks each worker advertised at the last refresh (routing input)
                "cached_blocks": {w: len(load.cached_block_hashes) for w, load in sorted(self.loads.items())}}

    def router_violations(self) -> list[str]:
        """The router's own invariants: counts in range, the two request maps in step, and no
        queue entry without its request."""
        out = []
        if not 0 <= self.inflight <= self.max_inflight:
            out.append(f"router: in_flight {self.inflight} outside [0, {self.max_inflight}]")
        if len(self.waiting) > self.config.max_queue:
            out.append(f"router: {len(self.waiting)} queued > max_queue {self.config.max_queue}")
        if len(self.requests) != len(self.by_external):
            out.append(f"router: {len(self.requests)} requests but {len(self.by_external)} ids")
        stale = [e.request_id for e in self.waiting if e.request_id not in self.requests]
        if stale:
            out.append(f"router: queue entries without a request: {stale[:10]}")
        return out

    async def GetClusterStatus(self, request, context):
        """Each worker is asked over its request channel (not a Ray call, so status polls never
        reach the dashboard's task table) and answers between two steps; a worker that does
        not answer within status_timeout_s is shown from its last heartbeat."""
        await asyncio.gather(*(self._ask_status(w) for w in self.workers))
        statuses = [self._worker_status(w) for w in sorted(self.workers)]
        totals = pb.RouterTotals(in_flight=self.inflight, kv_paths=pb.KvPathTotals(**self.kv_paths),
                                 **self.totals)
        events = [_event_proto(e) for e in itertools.islice(
            reversed(self.events), STATUS_EVENTS)][::-1]
        return pb.ClusterStatus(workers=statuses, router_queue_depth=len(self.waiting), totals=totals,
                                context_policy=self.config.context_policy,
                                generation_policy="least_loaded", recent_events=events)

    async def _ask_status(self, worker_id: str) -> None:
        channel = self.channels.get(worker_id)
        if channel is None or not channel.open:
            return
        try:
            await channel.fresh_status(self.config.status_timeout_s)  # applied by the channel
        except (TimeoutError, ChannelClosed) as exc:
            log.warning("status of %s: %r", worker_id, exc)

    def _worker_status(self, worker_id: str):
        role = pb.WORKER_ROLE_CONTEXT if self.infos[worker_id]["role"] == "context" else pb.WORKER_ROLE_GENERATION
        channel = self.channels.get(worker_id)
        s = self.statuses.get(worker_id)
        if s is None or channel is None or channel.status is not s:
            why = (channel.closed_reason if channel is not None and channel.closed_reason
                   else "no heartbeat from its request channel yet")
            return pb.WorkerStatus(worker_id=worker_id, role=role, healthy=False,
                                   invariant_violations=[f"no status: {why}"])
        age = time.monotonic() - channel.status_at
        healthy = self.loads[worker_id].healthy and channel.open
        t = s.get("transfers") or {}
        return pb.WorkerStatus(
            worker_id=worker_id, role=role, healthy=healthy,
            requests_by_state=s["requests_by_state"], free_kv_blocks=s["free_blocks"],
            total_kv_blocks=s["total_blocks"], queue_depth=s["queue_depth"], pauses=s["pauses"],
            quarantined_blocks=s["quarantined_blocks"],
            transfers=pb.TransferStats(count=t.get("sent", 0) + t.get("received", 0),
                                       bytes=t.get("bytes_sent", 0) + t.get("bytes_received", 0),
                                       seconds=t.get("seconds", 0.0), outcomes=t.get("outcomes", {})),
            invariant_violations=s["violations"], active_requests=s["num_active"],
            max_batch_size=s["max_batch_size"], tokens_per_block=s["tokens_per_block"],
            generated_tokens=s.get("generated_tokens", 0), context_tokens=s.get("context_tokens", 0),
            paused_requests=s.get("paused_requests", 0), status_age_s=age,
            capacity_policy=s.get("capacity_policy", ""),
        )

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._dispatch_ready()

    def _dispatch_ready(self) -> None:
        """Start as many waiting requests as max_inflight allows, in the reorder policy's order.
        Runs inline when a request arrives (no extra event-loop hop on an idle router) and from
        the dispatch loop when a request ends."""
        while self.waiting and self.inflight < self.max_inflight:
            order = self.reorder.reorder(self.waiting) if self.reorder is not None else self.waiting
            if not order:
                break
            entry = order[0]
            self.waiting.remove(entry)
            req = self.requests.get(entry.request_id)
            if req is None or req.cancelled:
                continue
            self.inflight += 1
            req.dispatched = time.monotonic()
            if self.metrics is not None:
                self.metrics.observe_queue_time(req.dispatched - req.received)
            self.dispatch_log.append(req.external_id)
            req.task = asyncio.create_task(self._run(req))
            # Not in _run's finally: a task cancelled before it first runs never enters it.
            req.task.add_done_callback(self._run_done)
        self._observe_queue()

    async def _run(self, req: _Request) -> None:
        failed: set[tuple[str | None, str]] = set()
        last_error = ""
        try:
            prompt_info = P.PromptInfo.from_tokens(req.prompt, self.tokens_per_block)
            plan = self._first_plan(req, prompt_info)
            while True:
                if plan.action == P.RetryAction.GIVE_UP:
                    await self._fail(req, grpc.StatusCode.UNAVAILABLE,
                                     f"no worker could serve the request: {plan.reason}{last_error}")
                    return
                try:
                    if plan.action == P.RetryAction.PAIR:
                        await self._remote(req, plan.ctx_worker, plan.gen_worker)
                    else:
                        await self._local(req, plan.gen_worker)
                    return
                except WorkerFailure as exc:
                    if req.cancelled or time.monotonic() >= req.deadline:
                        return  # Generate answers DEADLINE_EXCEEDED; no retry past the deadline
                    log.warning("request %s: attempt on %s/%s failed: %s", req.external_id,
                                plan.ctx_worker, plan.gen_worker, exc)
                    last_error = f"; last failure: {exc}"
                    failed.add((plan.ctx_worker if plan.action == P.RetryAction.PAIR else None, plan.gen_worker))
                    plan = P.plan_retry(failed, list(self.loads.values()), prompt_info,
                                        retries_used=req.retries, max_retries=self.config.max_retries,
                                        context_policy=self.context_policy,
                                        generation_policy=self.generation_policy,
                                        mode=P.DisaggregationMode(req.spec.disaggregation))
                    if plan.action != P.RetryAction.GIVE_UP:
                        req.retries += 1
                        self.totals["retries"] += 1
                        if self.metrics is not None:
                            self.metrics.count_retries()
        except asyncio.CancelledError:
            raise
        except _StopStringReached:
            return
        except RequestRejected as exc:
            await self._fail(req, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except DeadlineExceeded:
            await self._fail(req, grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"request {req.external_id!r} did not finish within its deadline")
        except Exception as exc:  # a router bug must not leave the client waiting
            log.exception("request %s failed in the router", req.external_id)
            await self._fail(req, grpc.StatusCode.INTERNAL, f"router error: {exc!r}")

    def _run_done(self, task: asyncio.Task) -> None:
        self.inflight -= 1
        self._wake.set()

    def _first_plan(self, req: _Request, prompt_info: P.PromptInfo) -> P.RetryPlan:
        loads = list(self.loads.values())
        gen = self.generation_policy.select(loads, prompt_info)
        if gen is None:
            return P.RetryPlan(P.RetryAction.GIVE_UP, None, None, "no healthy generation worker")
        ctx = self.context_policy.select(loads, prompt_info) if self.ctx_ids else None
        try:
            decision = P.decide_prefill(P.DisaggregationMode(req.spec.disaggregation), len(req.prompt),
                                        gen.matched_tokens, self.config.max_local_prefill_length,
                                        context_available=ctx is not None)
        except P.NoWorkerAvailable as exc:
            return P.RetryPlan(P.RetryAction.GIVE_UP, None, None, str(exc))
        if decision.route == P.PrefillRoute.REMOTE:
            return P.RetryPlan(P.RetryAction.PAIR, ctx.worker_id, gen.worker_id, decision.reason)
        return P.RetryPlan(P.RetryAction.LOCAL_PREFILL, None, gen.worker_id, decision.reason)

    def _note_dispatch(self, worker_id: str, prompt_tokens: int) -> None:
        """The optimistic view until the next status refresh, so a burst spreads out."""
        load = self.loads.get(worker_id)
        if load is not None:
            self.loads[worker_id] = load.with_dispatched(prompt_tokens)

    async def _remote(self, req: _Request, ctx_id: str, gen_id: str) -> None:
        req.ctx_worker, req.gen_worker, req.local_prefill = ctx_id, gen_id, False
        req.kv_blocks = None
        req.phase = PREFILL
        self._note_dispatch(ctx_id, len(req.prompt))
        self._note_dispatch(gen_id, 0)
        self.totals["remote_prefills"] += 1
        if self.metrics is not None:
            self.metrics.count_prefill(local=False)
        prompt, max_tokens, forced = self._continuation(req)
        # A 1-token request ends on the context worker; no generation worker will claim KV.
        kind = "CONTEXT_ONLY" if max_tokens > 1 else "CONTEXT_AND_GENERATION"
        ctx_wire = self._wire(req, prompt, 1, kind, forced[:1])
        last = None
        async for update in self._stream(req, ctx_id, ctx_wire):
            last = update
        self._check_final(last, f"context worker {ctx_id}")
        if last["finish_reason"] == "abort":
            return
        first = last["new_token_ids"]
        cpp = last["context_phase_params"]
        done_now = cpp is None or max_tokens <= len(forced) + len(first)
        if done_now:
            await self._emit(req, first, last["finish_reason"], last.get("info"))
            return
        # The context attempt's KV stays leased until the generation side has it: an attempt
        # that ends any other way (failure, cancel, a stop string in the first token) gives
        # the lease back at once.
        leased = (ctx_id, ctx_wire["request_id"])
        req.attempts.append(leased)
        done = False
        try:
            await self._emit(req, first, None, last.get("info"))
            req.phase = TRANSFER
            gen_wire = self._wire(req, prompt, max_tokens, "GENERATION_ONLY", forced)
            gen_wire["context_phase_params"] = cpp
            await self._decode(req, gen_id, gen_wire)
            done = True
        finally:
            if leased in req.attempts:
                req.attempts.remove(leased)
                if not done and not req.cancelled:  # a cancel aborted it already
                    self._abort_attempt(*leased)

    async def _local(self, req: _Request, gen_id: str) -> None:
        req.ctx_worker, req.gen_worker, req.local_prefill = "", gen_id, True
        req.phase = LOCAL
        self._note_dispatch(gen_id, len(req.prompt))
        self.totals["local_prefills"] += 1
        if self.metrics is not None:
            self.metrics.count_prefill(local=True)
        prompt, max_tokens, forced = self._continuation(req)
        await self._decode(req, gen_id,
                           self._wire(req, prompt, max_tokens, "CONTEXT_AND_GENERATION", forced))

    async def _decode(self, req: _Request, gen_id: str, wire: dict[str, Any]) -> None:
        last = None
        # Closed on every way out (a break, a stop string), so the attempt is forgotten now.
        async with contextlib.aclosing(self._stream(req, gen_id, wire)) as updates:
            async for update in updates:
                last = update
                reason = update["finish_reason"]
                if reason in ("error", "deadline", "abort"):
                    break
                if update["new_token_ids"]:
                    req.phase = DECODE
                await self._emit(req, update["new_token_ids"], reason, update.get("info"))
        self._check_final(last, f"generation worker {gen_id}")

    @staticmethod
    def _check_final(last: dict[str, Any] | None, who: str) -> None:
        """An attempt's stream ended: raise for anything but a finish or an abort."""
        if last is None or not last["finished"]:
            raise WorkerFailure(f"{who}: the stream ended without a final update")
        if last["finish_reason"] == "error":
            raise WorkerFailure(f"{who}: {last.get('error')}")
        if last["finish_reason"] == "deadline":
            raise DeadlineExceeded(who)

    async def _stream(self, req: _Request, worker_id: str, wire: dict[str, Any]):
        """A worker's updates for one attempt, over its request channel. An attempt waits as
        long as the request's deadline allows while the worker is heard from (updates or the
        step loop's heartbeats): a queued request is not a failed one. A worker silent for
        worker_call_timeout_s, or a closed channel, is a WorkerFailure; a request the worker
        finds invalid is RequestRejected."""
        attempt = wire["request_id"]
        channel = await self._channel(worker_id, req)
        req.attempts.append((worker_id, attempt))
        # The worker's own deadline for the attempt: it frees everything once it passes. It
        # trails the router's, so the router answers DEADLINE_EXCEEDED (and aborts) first.
        wire["deadline_s"] = max(0.0, req.deadline - time.monotonic()) + WORKER_DEADLINE_GRACE_S
        try:
            updates = channel.attempt(attempt)
            channel.generate(wire)
            silence_limit = self.config.worker_call_timeout_s
            while True:
                # Wake now and then to check the worker is still heard from.
                wait = min(max(0.5, silence_limit / 3), max(0.001, req.deadline - time.monotonic()))
                try:
                    async with asyncio.timeout(wait):
                        frame = await updates.get()
                except TimeoutError:
                    if time.monotonic() >= req.deadline:
                        raise
                    silent = time.monotonic() - channel.last_heard
                    if silent > silence_limit:
                        self._abort_attempt(worker_id, attempt)
                        self._mark_unhealthy(worker_id, f"silent for {silent:.1f} s")
                        raise WorkerFailure(f"{worker_id} was silent for {silent:.1f} s "
                                            "(no update, no heartbeat)") from None
                    continue
                if frame is CLOSED:
                    raise ChannelClosed(channel.closed_reason)
                if "rejected" in frame:
                    raise RequestRejected(frame["rejected"])  # the request, not the worker
                if "error" in frame:
                    raise WorkerFailure(f"{worker_id}: {frame['error']}")
                update = frame["u"]
                yield update
                if update["finished"]:
                    return
        except TimeoutError as exc:  # the request's deadline
            self._abort_attempt(worker_id, attempt)
            raise WorkerFailure(f"{worker_id}: the request's deadline passed") from exc
        except ChannelClosed as exc:
            self._mark_unhealthy(worker_id, f"request channel closed: {exc}")
            raise WorkerFailure(f"{worker_id}: {exc}") from exc
        finally:
            channel.forget(attempt)
            if (worker_id, attempt) in req.attempts:
                req.attempts.remove((worker_id, attempt))

    async def _channel(self, worker_id: str, req: _Request) -> WorkerChannel:
        """The worker's open request channel, connecting if needed."""
        channel = self.channels.get(worker_id)
        if channel is not None and channel.open:
            return channel
        timeout = min(self.config.status_timeout_s, max(0.001, req.deadline - time.monotonic()))
        try:
            return await self._open_channel(worker_id, timeout)
        except (OSError, asyncio.TimeoutError, TimeoutError) as exc:
            self._mark_unhealthy(worker_id, f"request channel connect: {exc!r}")
            raise WorkerFailure(f"{worker_id}: cannot open its request channel "
                                f"({self.infos[worker_id]['request_endpoint']}): {exc!r}") from exc

    async def _open_channel(self, worker_id: str, timeout_s: float) -> WorkerChannel:
        """Connect (once, for every waiter). Its heartbeats make the worker healthy again."""
        lock = self._connecting.setdefault(worker_id, asyncio.Lock())
        async with lock:
            channel = self.channels.get(worker_id)
            if channel is not None and channel.open:
                return channel
            info = self.infos[worker_id]
            channel = WorkerChannel(worker_id, info["request_endpoint"], info["request_token"],
                                    on_status=self._on_worker_status)
            await channel.connect(timeout_s)
            self.channels[worker_id] = channel
            return channel

    def _continuation(self, req: _Request) -> tuple[list[int], int, list[int]]:
        """A retry continues after what the client already has: streamed tokens join the prompt
        as far as max_input_len allows; the rest are forced as the first generated tokens (the
        worker regenerates those positions as exactly these tokens and does not report them).
        Returns (prompt, max_new_tokens counted from that prompt, forced tokens)."""
        room = len(req.streamed)
        if self.limits.max_input_len is not None:
            room = max(0, min(room, self.limits.max_input_len - len(req.prompt)))
        prompt = req.prompt + req.streamed[:room]
        return prompt, req.spec.max_tokens - room, req.streamed[room:]

    def _wire(self, req: _Request, prompt: list[int], max_tokens: int, kind: str,
              forced: list[int]) -> dict[str, Any]:
        sampling = dict(req.sampling, max_tokens=max_tokens)
        wire = {"request_id": next(self._attempt_ids), "client_id": req.external_id,
                "prompt": prompt, "max_new_tokens": max_tokens, "priority": req.spec.priority, "type": kind,
                "agent_hierarchy": list(req.spec.agent_hierarchy) or None, "sampling": sampling}
        if forced:
            wire["forced_tokens"] = list(forced)
        return wire

    async def _emit(self, req: _Request, tokens: list[int], finish_reason: str | None, info) -> None:
        now = time.monotonic()
        if tokens and req.first_token is None:
            req.first_token = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - req.received)
        if info:
            if "kv_transfer_blocks" in info:
                req.kv_blocks = info["kv_transfer_blocks"]
            req.pauses += info.get("pauses", 0)
            req.kv_bytes += info.get("kv_transfer_bytes", 0)
            req.kv_seconds += info.get("kv_transfer_seconds", 0.0)
            req.cached_tokens = max(req.cached_tokens, info.get("cached_tokens", 0))
        req.streamed.extend(tokens)
        text = req.text.push(tokens)
        worker_finished = finish_reason is not None
        if req.text.stopped:
            finish_reason = "stop"
        if finish_reason is None:
            if tokens:
                await req.out.put(pb.GenerateResponse(request_id=req.external_id, token_ids=tokens, text=text))
            return
        text += req.text.finish()
        self.totals["completed"] += 1
        self._count_kv_path(self._kv_path(req))
        if self.metrics is not None:
            self.metrics.count_request("completed")
            self.metrics.observe_e2e(now - req.received)
        await req.out.put(self._final(req, tokens, finish_reason, text))
        if not worker_finished:
            # A stop string ended the request while a worker still generates: end its attempts
            # (the context attempt's KV lease included). Removed from req.attempts first, so no
            # caller up the stack aborts them a second time.
            for attempt in list(req.attempts):
                req.attempts.remove(attempt)
                self._abort_attempt(*attempt)
            raise _StopStringReached

    @staticmethod
    def _kv_path(req: _Request) -> str:
        """For a completed request: prefilled on its generation worker; or the generation
        worker received KV (0 blocks moved: its cache held the whole prompt); or it ended on
        the context worker's token before any generation worker had its KV."""
        if req.local_prefill:
            return "local_prefill"
        if req.kv_blocks is None:
            return "context_finished"
        return "transferred" if req.kv_blocks > 0 else "prefix_cached"

    def _count_kv_path(self, path: str) -> None:
        self.kv_paths[path] += 1
        if self.metrics is not None:
            self.metrics.count_kv_path(path)

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _final(self, req: _Request, tokens: list[int], finish_reason: str, text: str = ""):
        now = time.monotonic()
        timings = pb.Timings(
            queue_ms=1000 * ((req.dispatched or now) - req.received),
            ttft_ms=1000 * ((req.first_token or now) - req.received),
            e2e_ms=1000 * (now - req.received), kv_transfer_bytes=req.kv_bytes,
            kv_transfer_ms=1000 * req.kv_seconds, pauses=req.pauses, ctx_worker=req.ctx_worker,
            gen_worker=req.gen_worker, retries=req.retries, local_prefill=req.local_prefill)
        usage = pb.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(req.streamed),
                         cached_prompt_tokens=req.cached_tokens)
        return pb.GenerateResponse(request_id=req.external_id, token_ids=tokens, text=text,
                                   finish_reason=finish_reason, timings=timings, usage=usage)

    async def _fail(self, req: _Request, code: grpc.StatusCode, message: str) -> None:
        await req.out.put(_Failure(code, message))  # Generate counts it when it answers

    def _count_failed(self) -> None:
        self.totals["failed"] += 1
        self._count_kv_path("failed")
        if self.metrics is not None:
            self.metrics.count_request("failed")

    # ------------------------------------------------------------------ cancellation

    def _cancel(self, req: _Request, why: str) -> None:
        if req.cancelled:
            return
        req.cancelled = True
        if req.queue_entry in self.waiting:
            self.waiting.remove(req.queue_entry)
        for worker_id, attempt in list(req.attempts):
            self._abort_attempt(worker_id, attempt)
        if req.task is not None and not req.task.done():
            req.task.cancel()
        log.info("request %s cancelled: %s", req.external_id, why)

    def _abort_attempt(self, worker_id: str, attempt: int) -> None:
        """Fire and forget; the worker frees it. On the attempt's own channel the abort cannot
        overtake the request; without a channel (it closed), Ray carries it (a worker that
        lost its channel has aborted that channel's requests already)."""
        channel = self.channels.get(worker_id)
        if channel is not None and channel.open:
            channel.abort(attempt)
            return
        try:
            self.workers[worker_id].abort.remote(attempt)
        except Exception:  # the actor is gone: nothing left to free there
            pass

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        """A time.monotonic() deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())

    def _forget(self, req: _Request) -> None:
        self.requests.pop(req.internal_id, None)
        if self.by_external.get(req.external_id) == req.internal_id:
            del self.by_external[req.external_id]

    # ------------------------------------------------------------------ worker loads

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_refresh_s)
            try:
                if self.metrics is not None:
                    self.metrics.flush()
                await self.refresh_loads()
                await self._update_health()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad refresh
                log.exception("status refresh failed")

    async def _update_health(self) -> None:
        """NOT_SERVING while an invariant is broken or no generation worker is healthy."""
        broken = self.router_violations() + [v for vs in self.violations.values() for v in vs]
        any_gen = any(self.loads[g].healthy for g in self.gen_ids)
        serving = not broken and any_gen
        if serving != self.serving:
            self.serving = serving
            log.warning("router health -> %s (%s)", "SERVING" if serving else "NOT_SERVING",
                        "; ".join(broken[:5]) or "no healthy generation worker")
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.health.set(ROUTER_SERVICE_NAME, status)
            await self.health.set("", status)

    def _on_worker_status(self, worker_id: str, s: dict[str, Any]) -> None:
        """A heartbeat's status (on the router's loop, from the channel's reader): the load
        view, the worker's violations and its events."""
        self.statuses[worker_id] = s
        self.violations[worker_id] = list(s.get("violations") or ())
        events = s.get("events")
        if events:
            self.events.extend(events)
        old = self.loads[worker_id]
        self.loads[worker_id] = P.WorkerLoad(
            worker_id, old.role, active_requests=s["num_active"] + s["queue_depth"],
            queued_prompt_tokens=0, free_kv_blocks=s["free_blocks"], total_kv_blocks=s["total_blocks"],
            max_batch_size=s["max_batch_size"], healthy=bool(s.get("healthy", True)),
            cached_block_hashes=old.cached_block_hashes)

    async def refresh_loads(self) -> None:
        """Liveness, not load (heartbeats bring the load): a worker whose channel is down is
        reconnected in the background; one whose heartbeats stopped is unhealthy. Only the
        prefix-cache policies still ask workers over Ray, for their advertised hashes."""
        now = time.monotonic()
        for worker_id in self.workers:
            channel = self.channels.get(worker_id)
            if channel is None or not channel.open:
                task = self._reconnects.get(worker_id)
                if task is None or task.done():
                    self._reconnects[worker_id] = asyncio.create_task(
                        self._reconnect(worker_id), name=f"pdserve-reconnect-{worker_id}")
                continue
            heard = channel.status_at if channel.status is not None else channel.connected_at
            if now - heard > self.config.status_timeout_s:
                self._mark_unhealthy(worker_id, f"no heartbeat status for {now - heard:.1f} s")
        if self.config.context_policy == "kv_cache_aware" or self.config.max_local_prefill_length is not None:
            await asyncio.gather(*(self._refresh_hashes(w) for w in self.workers))

    async def _refresh_hashes(self, worker_id: str) -> None:
        try:
            hashes = frozenset(await asyncio.wait_for(
                self.workers[worker_id].cached_block_hashes.remote(), self.config.status_timeout_s))
        except Exception as exc:
            log.warning("cached block hashes of %s: %r", worker_id, exc)
            return
        self.loads[worker_id] = dataclasses.replace(self.loads[worker_id], cached_block_hashes=hashes)

    async def _reconnect(self, worker_id: str) -> None:
        """Open the worker's channel again. When its endpoint no longer answers, ask Ray for
        the worker's info: a new incarnation means Ray restarted it (new endpoint)."""
        timeout = self.config.status_timeout_s
        try:
            try:
                await self._open_channel(worker_id, timeout)
                return
            except (OSError, TimeoutError) as exc:
                first = exc
            info = await asyncio.wait_for(self.workers[worker_id].info.remote(), timeout)
            if info.get("incarnation") == self.infos[worker_id].get("incarnation"):
                raise first
            self._rejoin(worker_id, info)
            await self._open_channel(worker_id, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._mark_unhealthy(worker_id, f"reconnect: {exc!r}")

    def _rejoin(self, worker_id: str, info: dict[str, Any]) -> None:
        """A worker came back as a new process (Ray restarted it): take its new info."""
        if info["role"] != self.infos[worker_id]["role"]:
            raise RuntimeError(f"{worker_id} came back with role {info['role']}")
        self.infos[worker_id] = info
        old = self.channels.pop(worker_id, None)
        if old is not None:  # the previous process's channel; the next request opens a new one
            old.close(f"{worker_id} restarted")
        self.restarts[worker_id] = self.restarts.get(worker_id, 0) + 1
        log.warning("worker %s rejoined (pid %s, incarnation %s)", worker_id, info.get("pid"),
                    info.get("incarnation"))

    def _mark_unhealthy(self, worker_id: str, why: str = "") -> None:
        old = self.loads.get(worker_id)
        if old is not None and old.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, why)
            self.loads[worker_id] = P.WorkerLoad(worker_id, old.role, healthy=False,
                                                 max_batch_size=old.max_batch_size)

    def _observe_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue_depth(len(self.waiting))
            self.metrics.set_in_flight(self.inflight)


_EVENT_KINDS = {"transfer": pb.ClusterEvent.TRANSFER, "pause": pb.ClusterEvent.PAUSE,
                "resume": pb.ClusterEvent.RESUME}
_EVENT_FIELDS = ("request_id", "worker_id", "ctx_worker_id", "gen_worker_id", "blocks", "bytes",
                 "seconds", "outcome", "reason", "policy", "generated_tokens", "blocks_freed",
                 "paused_seconds", "pause_index")


def _event_proto(e: dict[str, Any]):
    """A worker's event record (workers/events.py) as a ClusterEvent."""
    return pb.ClusterEvent(kind=_EVENT_KINDS.get(e.get("kind"), pb.ClusterEvent.KIND_UNSPECIFIED),
                           time_unix=e.get("t", 0.0),
                           **{k: e[k] for k in _EVENT_FIELDS if e.get(k) is not None})


def _sampling(spec: P.GenerateSpec) -> dict[str, Any]:
    return {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "top_k": spec.top_k,
            "top_p": spec.top_p, "seed": spec.seed, "stop_token_ids": tuple(spec.stop_token_ids),
            "ignore_eos": spec.ignore_eos}

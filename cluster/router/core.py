"""The router: admits requests into a bounded queue, orders it each dispatch round with the
agent-tree policy (plus priority), and streams each request's responses to its front door
(gRPC in ``servicer.py``, OpenAI HTTP in ``cluster/http_server.py``). Running requests is
``dispatch.py``'s; the workers are ``registry.py``'s; a request is a ``RouterRequest``
(``request_state.py``).

Reliability rules:
- Every wait is bounded (see dispatch.py); a request is only ever retried after a worker
  failure, at most max_retries times, never after its deadline.
- Cancellation (Abort, client disconnect, deadline) aborts every live attempt, including a
  context attempt whose KV is still leased for the generation side.
- Health turns NOT_SERVING while a worker reports an invariant violation, the router's own
  bookkeeping is inconsistent, or no generation worker is healthy.
- Memory is bounded: the queue (max_queue), requests in flight (max_inflight), the dispatch log.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from pdserve.cluster import policies as P
from pdserve.cluster.auth import KeyRing, exposure_warnings
from pdserve.cluster import validation as V
from pdserve.cluster.metric_specs import KV_PATH_KINDS
from pdserve.cluster.text_stream import TextStream
from pdserve.scheduler import AgentTreePolicy, LlmRequest, insert_request_in_order
from pdserve.transport.requests import UpdateInfo, WorkerInfo

from . import servicer
from .config import Failure, RouterConfig, RouterError, StopStringReached
from .dispatch import Dispatcher, sampling_of
from .registry import WorkerRegistry
from .request_state import Phase, RouterRequest

log = logging.getLogger("pdserve.router")

DISPATCH_LOG_LEN = 1000
# Tokenizing threads. tokenizers releases the GIL in encode_batch, not in encode (measured,
# bench/router_loop.py: a 512 KB text stalled the loop 176 ms through encode on a thread,
# 14 ms through encode_batch; 215 ms on the loop itself).
TEXT_THREADS = 2


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token of the vocabulary decodes to: a text of B bytes is at
    least B / this many tokens. A token that is part of a character decodes to U+FFFD (3
    bytes), more than its real share, so the bound stays an upper bound."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    longest = 1
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return longest


class Router:
    def __init__(self, config: RouterConfig, workers: dict[str, Any], infos: dict[str, WorkerInfo],
                 tokenizer, metrics=None, model_dir: str | None = None) -> None:
        """``workers``: worker id -> Ray actor handle; ``infos``: their ``info()``;
        ``model_dir``: the served model (the HTTP front door's model id and chat template)."""
        self.config = config
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.registry = WorkerRegistry(config, workers, infos)
        if not self.registry.gen_ids:
            raise ValueError("the router needs at least one generation worker")
        first = infos[self.registry.gen_ids[0]]
        self.tokens_per_block = first.tokens_per_block
        # A request must fit every worker's pool on its own, or GNE would hold it forever.
        pool_tokens = min(i.num_kv_blocks * i.tokens_per_block for i in infos.values())
        self.limits = V.ValidationLimits(
            vocab_size=first.vocab_size,
            max_input_len=min(min(i.max_input_len for i in infos.values()), pool_tokens - 1),
            max_seq_len=min(min(i.max_seq_len for i in infos.values()), pool_tokens),
        )
        weights = P.KvAwareWeights(config.kv_overlap_weight, config.kv_decode_weight)
        self.context_policy = P.make_policy(config.routing, P.WorkerRole.CONTEXT, weights)
        self.generation_policy = P.make_policy(config.routing, P.WorkerRole.GENERATION, weights)
        self.max_inflight = config.max_inflight or sum(infos[g].max_batch_size for g in self.registry.gen_ids)
        self.reorder = (AgentTreePolicy(config.agent_percentage, list(config.agent_types),
                                        config.agent_inflight_seq_num)
                        if config.agent_types else None)
        self.waiting: list[LlmRequest] = []
        self.requests: dict[int, RouterRequest] = {}  # internal id -> request (queued or running)
        self.by_external: dict[str, int] = {}
        self.inflight = 0
        # external ids in dispatch order (the most recent ones only)
        self.dispatch_log: collections.deque[str] = collections.deque(maxlen=DISPATCH_LOG_LEN)
        self.serving = True
        self.totals = {k: 0 for k in ("received", "completed", "failed", "aborted", "rejected",
                                      "retries", "remote_prefills", "local_prefills", "fallbacks",
                                      "worker_waits")}
        # How each finished request's KV reached its generation worker (KvPathTotals).
        self.kv_paths = {k: 0 for k in KV_PATH_KINDS}
        # The prefix index's prediction for each completed request's prefill worker against what
        # the worker reported it reused (PrefixTotals).
        self.prefix = {"requests": 0, "exact": 0, "predicted_tokens": 0, "reused_tokens": 0}
        self._ids = itertools.count(1)
        # The request id each worker attempt carries. Workers outlive a router: a restarted
        # router's ids must not meet the old one's (a late abort leaves a tombstone for its id,
        # a lease keeps its id), so they start at this incarnation's microsecond clock.
        self.attempt_ids = itertools.count(time.time_ns() // 1000)
        # Tokenizing runs here, off the loop; the byte bound refuses what cannot fit first.
        self._text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="pdserve-tokenize")
        self.max_token_bytes = longest_token_bytes(tokenizer)
        self.max_prompt_bytes = (self.limits.max_input_len or 0) * self.max_token_bytes
        self.dispatcher = Dispatcher(self)
        self._tasks: list[asyncio.Task] = []
        self.server: grpc.aio.Server | None = None
        self.health = None
        self.port: int | None = None
        self.http = None  # the OpenAI-compatible front door, when config.http_port is set
        self.http_port: int | None = None
        self.accepting = True  # False once stop() began: new requests get UNAVAILABLE
        # Both front doors check keys against this one ring, so a key's cap counts across both.
        self.keys = KeyRing(config.api_keys, config.max_inflight_per_key)
        doors = [("gRPC", config.host)] + ([("HTTP", config.http_host)] if config.http_port is not None else [])
        self.security_warnings = exposure_warnings(doors, api_keys=self.keys.enabled,
                                                   tls=config.tls_cert is not None)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        self.server, self.health, self.port = await servicer.start_grpc(self)
        await self.registry.hear_all(self.config.status_timeout_s, self.config.ready_timeout_s)
        self._tasks = [asyncio.create_task(self.dispatcher.loop()),
                       asyncio.create_task(self._refresh_loop())]
        log.info("router serving on %s:%d (%s)", self.config.host, self.port, self._security_summary())
        for warning in self.security_warnings:
            log.warning("UNPROTECTED: %s", warning)
        if self.config.http_port is not None:
            from pdserve.cluster.chat_template import ChatTemplate
            from pdserve.cluster.http_server import OpenAIServer

            model_id = self.config.served_model_name or (Path(self.model_dir).name if self.model_dir else "pdserve")
            template = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir else None
            self.http = OpenAIServer(self, model_id, template)
            self.http_port = await self.http.start(self.config.http_host, self.config.http_port)
        return self.port

    def _security_summary(self) -> str:
        cfg = self.config
        keys = (f"{len(self.keys)} API keys {', '.join(self.keys.fingerprints)}" if self.keys.enabled
                else "no API key")
        tls = ("mutual TLS" if cfg.tls_client_ca else "TLS") if cfg.tls_cert else "no TLS"
        return f"{keys}, {tls}"

    async def stop(self, grace_s: float = 2.0) -> None:
        self.accepting = False
        if self.http is not None:
            await self.http.stop()
        for t in self._tasks:
            t.cancel()
        self.registry.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ admission
    # The one admission path, shared by the gRPC and HTTP front doors: admit() validates and
    # queues a request, results() streams its GenerateResponse messages and, however the caller
    # leaves (finished, error, disconnect), cancels what is still running.

    async def admit(self, spec: V.GenerateSpec, time_remaining_s: float | None = None) -> RouterRequest:
        """Validate, tokenize (off the event loop) and queue one request; raises RouterError
        (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED, UNAVAILABLE) when it cannot be
        queued. Everything after the tokenization runs without an await, so the duplicate-id
        check and the queue insert are one step of the loop."""
        now = time.monotonic()
        if not self.accepting:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        try:
            V.validate_generate_spec(spec, self.limits)
            prompt = await self._prompt_ids(spec)
        except V.ValidationError as exc:
            self.totals["rejected"] += 1
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field, exc.message) from None
        if not self.accepting:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
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
        req = RouterRequest(internal, external, spec, prompt, sampling_of(spec), entry, now,
                            now + budget, TextStream(self._decode_text, spec.stop))
        self.requests[internal] = req
        self.by_external[external] = internal
        self.totals["received"] += 1
        insert_request_in_order(self.waiting, entry)
        self.dispatcher.dispatch_ready()
        return req

    async def results(self, req: RouterRequest):
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
                if isinstance(item, Failure):
                    self.cancel(req, item.message)
                    self._count_failed()
                    raise RouterError(item.code, item.message)
                yield item
                if item.finish_reason:
                    finished = True
                    return
        except TimeoutError:
            self.cancel(req, "deadline")
            self._count_failed()
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"request {req.external_id!r} did not finish within its deadline") from None
        finally:
            if not finished and not req.cancelled:
                self.cancel(req, "client went away")  # also the path for client cancellation
            self._forget(req)

    async def _prompt_ids(self, spec: V.GenerateSpec) -> list[int]:
        if spec.token_ids is not None:
            return list(spec.token_ids)
        ids = await self.tokenize(spec.text, "prompt.text")
        if not ids:
            raise V.ValidationError("prompt.text", "encodes to no tokens")
        if self.limits.max_input_len is not None and len(ids) > self.limits.max_input_len:
            raise V.ValidationError("prompt.text", f"{len(ids)} tokens exceed max_input_len "
                                                   f"{self.limits.max_input_len}")
        if self.limits.max_seq_len is not None and len(ids) + spec.max_tokens > self.limits.max_seq_len:
            raise V.ValidationError("sampling.max_tokens", f"prompt ({len(ids)}) + max_tokens "
                                                           f"({spec.max_tokens}) exceeds max_seq_len "
                                                           f"{self.limits.max_seq_len}")
        return ids

    async def tokenize(self, text: str, field: str) -> list[int]:
        """Token ids of a text prompt, encoded on a small thread pool so a long prompt never
        stalls the streams on the router's loop. A text whose UTF-8 length alone proves it is
        too long (more bytes than max_input_len tokens of the longest token can hold) is
        refused before any tokenizing."""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        if self.limits.max_input_len is not None and nbytes > self.max_prompt_bytes:
            raise V.ValidationError(field, f"{nbytes} bytes cannot fit max_input_len "
                                           f"{self.limits.max_input_len} tokens (a token is at "
                                           f"most {self.max_token_bytes} bytes)")
        loop = asyncio.get_running_loop()
        encoding = await loop.run_in_executor(self._text_pool, self._encode, text)
        return encoding

    def _encode(self, text: str) -> list[int]:
        # encode_batch: the one entry point that lets go of the GIL while it works
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ responses

    async def emit(self, req: RouterRequest, tokens: list[int], finish_reason: str | None,
                   info: UpdateInfo | None) -> None:
        """Stream tokens to the client; with ``finish_reason`` the request completes. A stop
        string in the text completes it too: its live attempts are aborted and
        StopStringReached ends the attempt loop."""
        now = time.monotonic()
        if tokens and req.first_token is None:
            req.first_token = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - req.received)
        req.note_info(info)
        req.streamed.extend(tokens)
        text = req.text.push(tokens)
        worker_finished = finish_reason is not None
        if req.text.stopped:
            finish_reason = "stop"
        if finish_reason is None:
            if tokens:
                await req.out.put(servicer.token_response(req, tokens, text))
            return
        text += req.text.finish()
        self.totals["completed"] += 1
        self._count_kv_path(req.kv_path())
        self._count_prediction(req)
        if self.metrics is not None:
            self.metrics.count_request("completed")
            self.metrics.observe_e2e(now - req.received)
        req.move(Phase.DONE)
        await req.out.put(servicer.final_response(req, tokens, finish_reason, text))
        if not worker_finished:
            # A stop string ended the request while a worker still generates: end its attempts
            # (the context attempt's KV lease included). Removed from req.attempts first, so no
            # caller up the stack aborts them a second time.
            for attempt in list(req.attempts):
                req.attempts.remove(attempt)
                self.registry.abort_attempt(*attempt)
            raise StopStringReached

    async def fail(self, req: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        await req.out.put(Failure(code, message))  # results() counts it when it answers

    def count_fallback(self, req: RouterRequest, *, local: bool) -> None:
        req.fallbacks += 1
        self.totals["fallbacks"] += 1
        if self.metrics is not None:
            self.metrics.count_fallback(local=local)

    def count_prefill(self, *, local: bool) -> None:
        self.totals["local_prefills" if local else "remote_prefills"] += 1
        if self.metrics is not None:
            self.metrics.count_prefill(local=local)

    def _count_kv_path(self, path: str) -> None:
        self.kv_paths[path] += 1
        if self.metrics is not None:
            self.metrics.count_kv_path(path)

    def _count_prediction(self, req: RouterRequest) -> None:
        if req.reused_tokens is None:
            return
        p = self.prefix
        p["requests"] += 1
        p["exact"] += req.predicted_tokens == req.reused_tokens
        p["predicted_tokens"] += req.predicted_tokens
        p["reused_tokens"] += req.reused_tokens
        if self.metrics is not None:
            self.metrics.count_prefix_prediction(req.predicted_tokens, req.reused_tokens)

    def _count_failed(self) -> None:
        self.totals["failed"] += 1
        self._count_kv_path("failed")
        if self.metrics is not None:
            self.metrics.count_request("failed")

    # ------------------------------------------------------------------ cancellation

    def find(self, external_id: str) -> RouterRequest | None:
        internal = self.by_external.get(external_id)
        return self.requests[internal] if internal is not None else None

    def cancel(self, req: RouterRequest, why: str) -> None:
        if req.cancelled:
            return
        req.cancelled = True
        if req.phase != Phase.DONE:
            req.move(Phase.DONE)
        if req.queue_entry in self.waiting:
            self.waiting.remove(req.queue_entry)
        for worker_id, attempt in list(req.attempts):
            self.registry.abort_attempt(worker_id, attempt)
        if req.task is not None and not req.task.done():
            req.task.cancel()
        log.info("request %s cancelled: %s", req.external_id, why)

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        """A time.monotonic() deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())

    def _forget(self, req: RouterRequest) -> None:
        self.requests.pop(req.internal_id, None)
        if self.by_external.get(req.external_id) == req.internal_id:
            del self.by_external[req.external_id]

    # ------------------------------------------------------------------ state and health

    def request_phases(self) -> dict[str, dict[str, Any]]:
        """Every request the router holds: its phase and its live attempts (worker, attempt id)."""
        return {r.external_id: {"phase": str(r.phase), "attempts": list(r.attempts)}
                for r in self.requests.values()}

    def debug_state(self) -> dict[str, Any]:
        """Sizes of the router's per-request bookkeeping (all 0 when drained), restarts seen,
        violations (its own and the workers'), and whether health says SERVING."""
        registry = self.registry
        return {"requests": len(self.requests), "by_external": len(self.by_external),
                "waiting": len(self.waiting), "inflight": self.inflight,
                "dispatch_log": len(self.dispatch_log), "restarts": dict(registry.restarts),
                "violations": self.router_violations() + [
                    f"{w}: {v}" for w, vs in sorted(registry.violations.items()) for v in vs],
                "serving": self.serving, "pid": os.getpid(), "prefix": dict(self.prefix),
                "kv_index": {w: registry.index.num_blocks(w) for w in registry.index.workers()},
                "kv_snapshots_asked": dict(registry.snapshots_asked),
                "kv_event_blocks": {w: dict(c) for w, c in registry.kv_event_blocks.items()},
                "kv_pairs_unready": sorted(f"{c}->{g}" for c, g in registry.unready_pairs()),
                "healthy": {w: load.healthy for w, load in sorted(registry.loads.items())}}

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

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_refresh_s)
            try:
                if self.metrics is not None:
                    self.metrics.flush()
                await self.registry.refresh()
                await self._update_health()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad refresh
                log.exception("status refresh failed")

    async def _update_health(self) -> None:
        """NOT_SERVING while an invariant is broken or no generation worker is healthy."""
        registry = self.registry
        broken = self.router_violations() + [v for vs in registry.violations.values() for v in vs]
        serving = not broken and any(registry.loads[g].healthy for g in registry.gen_ids)
        if serving != self.serving:
            self.serving = serving
            log.warning("router health -> %s (%s)", "SERVING" if serving else "NOT_SERVING",
                        "; ".join(broken[:5]) or "no healthy generation worker")
            await servicer.set_health(self.health, serving)

    def observe_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue_depth(len(self.waiting))
            self.metrics.set_in_flight(self.inflight)

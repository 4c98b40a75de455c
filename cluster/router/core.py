"""The router core: admits requests into a bounded queue (``queue.py``), orders it each dispatch
round with the agent-tree policy (plus priority), and streams each request's outputs
(``RouterOutput``) to whichever front door admitted it. Running requests is ``dispatch.py``'s;
the workers are ``registry.py``'s; a request is a ``RouterRequest`` (``request_state.py``).

The core knows no protocol: it imports no grpc or aiohttp (``tests/unit/test_router_imports.py``).
The front doors (``cluster/front/grpc``, ``cluster/front/openai``) adapt its interface:
``admit`` / ``results`` / ``abort`` / ``cluster_status`` / ``live_counters`` / ``tokenize``,
health (``serving``, ``accepting``, ``add_health_listener``) and ``limits``. Errors are
``RouterError`` with a ``RouterErrorKind``; each door maps the kind to its own status.

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
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.cluster import policies as P
from pdserve.cluster import validation as V
from pdserve.cluster.text_stream import TextStream
from pdserve.scheduler import AgentTreePolicy, LlmRequest
from pdserve.transport.requests import UpdateInfo, UpdateKind, WireUpdate, WorkerInfo
from pdserve.transport.requests.sampling import SamplingParams, bad_words_to_token_ids

from .config import RouterConfig
from .counters import RouterCounters
from .dispatch import Dispatcher, Routing
from .errors import Failure, RouterError, RouterErrorKind, StopStringReached
from .outputs import (
    ClusterSnapshot,
    LiveCounters,
    RouterOutput,
    WorkerSnapshot,
    final_output,
    token_output,
)
from .queue import RequestQueue
from .registry import WorkerRegistry
from .request_state import Phase, RouterRequest

log = logging.getLogger("pdserve.router")

# Tokenizing threads. tokenizers releases the GIL in encode_batch, not in encode (measured,
# benchmarks/router_loop.py: a 512 KB text stalled the loop 176 ms through encode on a thread,
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


def request_tokens_cap(info: WorkerInfo) -> int:
    """The longest prompt + max_tokens ``info``'s worker can take: what it reports (its KV
    manager's own bound, so a windowed worker's pool caps nothing its window does not), else,
    from a worker that does not report it, its pool's tokens (full attention) within its
    max_seq_len."""
    if info.max_request_tokens is not None:
        return info.max_request_tokens
    return min(info.max_seq_len, info.num_kv_blocks * info.tokens_per_block)


def request_limits(infos: dict[str, WorkerInfo], vocab_size: int) -> V.ValidationLimits:
    """What the router accepts: every worker's limits, and one request must fit every worker's
    pool on its own (a request routed to a worker that can never hold it would wait forever
    under GUARANTEED_NO_EVICT, or be refused after it was queued)."""
    cap = min(request_tokens_cap(i) for i in infos.values())
    return V.ValidationLimits(
        vocab_size=vocab_size,
        max_input_len=min(min(i.max_input_len for i in infos.values()), cap - 1),
        max_seq_len=min(min(i.max_seq_len for i in infos.values()), cap),
    )


class Router:
    def __init__(self, config: RouterConfig, workers: dict[str, Any], infos: dict[str, WorkerInfo],
                 tokenizer, metrics=None) -> None:
        """``workers``: worker id -> Ray actor handle; ``infos``: their ``info()``."""
        self.config = config
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}
        self.registry = WorkerRegistry(config, workers, infos)
        if not self.registry.gen_ids:
            raise ValueError("the router needs at least one generation worker")
        first = infos[self.registry.gen_ids[0]]
        self.limits = request_limits(infos, first.vocab_size)
        weights = P.KvAwareWeights(config.kv_overlap_weight, config.kv_decode_weight)
        self.routing = Routing(P.make_policy(config.routing, P.WorkerRole.CONTEXT, weights),
                               P.make_policy(config.routing, P.WorkerRole.GENERATION, weights))
        max_inflight = config.max_inflight or sum(infos[g].max_batch_size for g in self.registry.gen_ids)
        reorder = (AgentTreePolicy(config.agent_percentage, list(config.agent_types),
                                   config.agent_inflight_seq_num)
                   if config.agent_types else None)
        self.queue = RequestQueue(config.max_queue, max_inflight, reorder)
        self.counters = RouterCounters(metrics)
        self._ids = itertools.count(1)
        # Tokenizing runs here, off the loop; the byte bound refuses what cannot fit first.
        self._text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="pdserve-tokenize")
        self.max_token_bytes = longest_token_bytes(tokenizer)
        self.max_prompt_bytes = (self.limits.max_input_len or 0) * self.max_token_bytes
        self.dispatcher = Dispatcher(config, self.registry, self.queue, self.counters, self,
                                     self.routing, self.limits, first.tokens_per_block)
        self._tasks: list[asyncio.Task] = []
        self.serving = True  # health: False while an invariant is broken or no gen worker is healthy
        self.accepting = True  # False once stop() began: new requests get UNAVAILABLE
        self._health_listeners: list[Callable[[bool], Awaitable[None] | None]] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open every worker's channel, wait (bounded) for them to report ready, and start the
        dispatch and refresh loops. The front doors open after this."""
        await self.registry.hear_all(self.config.status_timeout_s, self.config.ready_timeout_s)
        self._tasks = [asyncio.create_task(self.dispatcher.loop()),
                       asyncio.create_task(self._refresh_loop())]

    async def stop(self) -> None:
        """Stop accepting and close the workers' channels (the doors are stopped first, by
        whoever started them)."""
        self.accepting = False
        for t in self._tasks:
            t.cancel()
        self.registry.close()
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    def add_health_listener(self, listener: Callable[[bool], Awaitable[None] | None]) -> None:
        """``listener(serving)`` is called on the router's loop each time health flips."""
        self._health_listeners.append(listener)

    # ------------------------------------------------------------------ admission
    # The one admission path, shared by every front door: admit() validates and queues a
    # request, results() streams its RouterOutputs and, however the caller leaves (finished,
    # error, disconnect), cancels what is still running.

    async def admit(self, spec: V.GenerateSpec, time_remaining_s: float | None = None) -> RouterRequest:
        """Validate, tokenize (off the event loop) and queue one request; raises RouterError
        (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED, UNAVAILABLE) when it cannot be
        queued. Everything after the tokenization runs without an await, so the duplicate-id
        check and the queue insert are one step of the loop."""
        now = time.monotonic()
        if not self.accepting:
            raise RouterError(RouterErrorKind.UNAVAILABLE, "the router is shutting down")
        try:
            V.validate_generate_spec(spec, self.limits)
            prompt = await self._prompt_ids(spec)
            sampling = self._resolve_bad_words(spec.sampling)
            if sampling.best_of is not None and sampling.best_of > sampling.n and sampling.logprobs is None:
                sampling = sampling.replace(logprobs=0)  # best_of ranks by cumulative logprob
        except V.ValidationError as exc:
            self.counters.count("rejected")
            raise RouterError(RouterErrorKind.INVALID_ARGUMENT, str(exc), exc.field, exc.message) from None
        if not self.accepting:
            raise RouterError(RouterErrorKind.UNAVAILABLE, "the router is shutting down")
        external = spec.request_id or uuid.uuid4().hex
        if self.queue.holds(external):
            self.counters.count("rejected")
            raise RouterError(RouterErrorKind.ALREADY_EXISTS, f"request_id: {external!r} is already in flight",
                              "request_id", f"{external!r} is already in flight")
        if self.queue.is_full():
            raise RouterError(RouterErrorKind.RESOURCE_EXHAUSTED,
                              f"router queue is full ({self.config.max_queue} waiting)")
        budget = self.config.default_deadline_s
        if spec.deadline_ms is not None:
            budget = min(budget, spec.deadline_ms / 1000.0)
        if time_remaining_s is not None:
            budget = min(budget, time_remaining_s)
        internal = next(self._ids)
        entry = LlmRequest(internal, prompt, spec.max_tokens, priority=spec.priority,
                           agent_hierarchy=list(spec.agent_hierarchy) or None)
        req = RouterRequest(internal, external, spec, prompt, sampling, entry, now,
                            now + budget, TextStream(self._decode_text, spec.stop,
                                       include_stop=sampling.include_stop_str_in_output,
                                       min_tokens=sampling.min_tokens))
        self.queue.add(req)
        self.counters.count("received")
        self.dispatcher.dispatch_ready()
        return req

    async def results(self, req: RouterRequest) -> AsyncIterator[RouterOutput]:
        """The request's RouterOutputs; the last has finish_reason. Raises RouterError when it
        fails or its deadline passes. Close it (contextlib.aclosing) so that a caller that
        leaves early cancels the request."""
        finished = False
        try:
            while True:
                # asyncio.timeout, not wait_for: wait_for wraps the get in one more task
                # (one more event-loop hop per update)
                async with asyncio.timeout_at(self._loop_time(req.deadline)):
                    item = await req.out.get()
                if isinstance(item, Failure):
                    self.cancel(req, item.message)
                    self.counters.count_failed()
                    raise RouterError(item.kind, item.message)
                yield item
                if item.finish_reason:
                    finished = True
                    return
        except TimeoutError:
            self.cancel(req, "deadline")
            self.counters.count_failed()
            raise RouterError(RouterErrorKind.DEADLINE_EXCEEDED,
                              f"request {req.external_id!r} did not finish within its deadline") from None
        finally:
            if not finished and not req.cancelled:
                self.cancel(req, "client went away")  # also the path for client cancellation
            self.queue.forget(req)

    def _resolve_bad_words(self, sampling: SamplingParams) -> SamplingParams:
        """The bad words as token sequences, with the model's tokenizer (vLLM's rule)."""
        if not sampling.bad_words:
            return sampling
        ids = bad_words_to_token_ids(sampling.bad_words, self._encode)
        if self.limits.vocab_size is not None and any(t >= self.limits.vocab_size
                                                      for seq in ids for t in seq):
            raise V.ValidationError("sampling.bad_words", "encodes to ids outside the vocabulary")
        return sampling.replace(bad_words_token_ids=ids)

    async def _prompt_ids(self, spec: V.GenerateSpec) -> list[int]:
        if spec.token_ids is not None:
            return list(spec.token_ids)
        # The ids tokenized here (BOS included when the spec asks for it) are the ones the
        # dispatcher hashes for prefix routing and the workers prefill, so they cannot disagree.
        ids = await self.tokenize(spec.text, "prompt.text", spec.add_special_tokens)
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

    async def tokenize(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text prompt, encoded on a small thread pool so a long prompt never
        stalls the streams on the router's loop; ``add_special_tokens``: with the tokenizer's
        post-processor (its BOS), which every caller decides (completions yes, a rendered chat
        template no). A text whose UTF-8 length alone proves it is too long (more bytes than
        max_input_len tokens of the longest token can hold) is refused before any tokenizing
        (``ValidationError`` naming ``field``); added special tokens only make it longer, so the
        bound stays a bound."""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        if self.limits.max_input_len is not None and nbytes > self.max_prompt_bytes:
            raise V.ValidationError(field, f"{nbytes} bytes cannot fit max_input_len "
                                           f"{self.limits.max_input_len} tokens (a token is at "
                                           f"most {self.max_token_bytes} bytes)")
        loop = asyncio.get_running_loop()
        encode = self._encode_special if add_special_tokens else self._encode
        return await loop.run_in_executor(self._text_pool, encode, text)

    def _encode_special(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    def _encode(self, text: str) -> list[int]:
        # encode_batch: the one entry point that lets go of the GIL while it works
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def note_rejected(self) -> None:
        """A door refused a request before admit() saw it (a field its own parsing checks)."""
        self.counters.count("rejected")

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (how logprobs name tokens)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 1 << 18:
                self._token_texts[token_id] = text
        return text

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ responses (Responder)

    async def emit(self, req: RouterRequest, tokens: list[int], finish_reason: str | None,
                   info: UpdateInfo | None, update: WireUpdate | None = None) -> None:
        """Stream tokens to the client; with ``finish_reason`` the request completes. A stop
        string in the text completes it too: its live attempts are aborted and
        StopStringReached ends the attempt loop. ``update``: the worker's update the tokens
        came in (its logprobs and candidate index go along). With several candidates (n /
        best_of) each ends on its own (CHOICE_DONE, a stop string) and the request completes
        when all have; a CONTEXT_DONE brings every candidate's first token."""
        logprobs = update.logprobs if update is not None else None
        prompt_logprobs = update.prompt_logprobs if update is not None else None
        req.note_info(info)
        if req.several and update is not None and update.kind == UpdateKind.CONTEXT_DONE:
            for i, token in enumerate(tokens):
                await self._emit_candidate(req, i, [token], None,
                                           logprobs[i:i + 1] if logprobs else None,
                                           prompt_logprobs if i == 0 else None, False)
            return
        index = update.index if update is not None else 0
        worker_finished = finish_reason is not None and (update is None or update.finished)
        await self._emit_candidate(req, index, tokens, finish_reason, logprobs, prompt_logprobs,
                                   worker_finished)

    async def _emit_candidate(self, req: RouterRequest, index: int, tokens: list[int],
                              finish_reason: str | None, logprobs, prompt_logprobs,
                              worker_finished: bool) -> None:
        cand = req.candidates[index]
        if cand.finish_reason is not None:
            return  # a stop string ended this candidate; its worker went on for the others
        now = time.monotonic()
        if tokens and req.first_token is None:
            req.first_token = now
            self.counters.observe_ttft(now - req.received)
        cand.streamed.extend(tokens)
        text = cand.text.push(tokens)
        if cand.text.stopped:
            finish_reason = "stop"
        if finish_reason is None:
            if tokens or prompt_logprobs:
                await req.out.put(token_output(req, tokens, text, logprobs, prompt_logprobs, index))
            return
        text += cand.text.finish()
        cand.finish_reason = finish_reason
        if any(c.finish_reason is None for c in req.candidates):
            await req.out.put(token_output(req, tokens, text, logprobs, prompt_logprobs, index,
                                           choice_finish_reason=finish_reason))
            return
        self.counters.count_completed(req, now - req.received)
        req.move(Phase.DONE)
        await req.out.put(final_output(req, tokens, finish_reason, text, logprobs, prompt_logprobs,
                                       index))
        if not worker_finished:
            # A stop string ended the request while a worker still generates: end its attempts
            # (the context attempt's KV lease included). Removed from req.attempts first, so no
            # caller up the stack aborts them a second time.
            for attempt in list(req.attempts):
                req.attempts.remove(attempt)
                self.registry.abort_attempt(*attempt)
            raise StopStringReached

    async def fail(self, req: RouterRequest, kind: RouterErrorKind, message: str) -> None:
        await req.out.put(Failure(kind, message))  # results() counts it when it answers

    # ------------------------------------------------------------------ cancellation

    def find(self, external_id: str) -> RouterRequest | None:
        return self.queue.find(external_id)

    async def abort(self, external_id: str) -> bool:
        """The client's abort: the request ends with finish reason ``abort`` (its stream gets
        that as its last output). False when no such request is in flight."""
        req = self.queue.find(external_id)
        if req is None:
            return False
        self.cancel(req, "aborted by client")
        self.counters.count("aborted")
        await req.out.put(final_output(req, [], "abort", req.text.finish()))
        return True

    def cancel(self, req: RouterRequest, why: str) -> None:
        if req.cancelled:
            return
        req.cancelled = True
        if req.phase != Phase.DONE:
            req.move(Phase.DONE)
        self.queue.unqueue(req)
        for worker_id, attempt in list(req.attempts):
            self.registry.abort_attempt(worker_id, attempt)
        if req.task is not None and not req.task.done():
            req.task.cancel()
        log.info("request %s cancelled: %s", req.external_id, why)

    @staticmethod
    def _loop_time(monotonic_deadline: float) -> float:
        """A time.monotonic() deadline on the event loop's clock."""
        return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())

    # ------------------------------------------------------------------ state and health

    async def cluster_status(self) -> ClusterSnapshot:
        """Each worker is asked over its request channel (not a Ray call, so status polls never
        reach the dashboard's task table) and answers between two steps; a worker that does
        not answer within status_timeout_s is shown from its last heartbeat."""
        registry = self.registry
        await asyncio.gather(*(registry.ask_status(w) for w in registry.worker_ids))
        workers = []
        for worker_id in sorted(registry.worker_ids):
            status, age, missing = registry.current_status(worker_id)
            healthy = registry.healthy(worker_id) if status is not None else False
            workers.append(WorkerSnapshot(worker_id, registry.infos[worker_id], healthy, status,
                                          age, missing))
        c = self.counters
        return ClusterSnapshot(
            workers=workers, queue_depth=len(self.queue), in_flight=self.queue.inflight,
            totals=dict(c.totals), kv_paths=dict(c.kv_paths), prefix=dict(c.prefix),
            context_policy=self.routing.context.name, generation_policy=self.routing.generation.name,
            events=list(registry.events), max_input_len=self.limits.max_input_len or 0,
            max_seq_len=self.limits.max_seq_len or 0, max_prompt_bytes=self.max_prompt_bytes)

    def live_counters(self) -> LiveCounters:
        return LiveCounters(dict(self.counters.totals), len(self.queue), self.queue.inflight,
                            self.serving,
                            {w: load.healthy for w, load in sorted(self.registry.loads.items())})

    def request_phases(self) -> dict[str, dict[str, Any]]:
        """Every request the router holds: its phase and its live attempts (worker, attempt id)."""
        return {r.external_id: {"phase": str(r.phase), "attempts": list(r.attempts)}
                for r in self.queue.requests.values()}

    def debug_state(self) -> dict[str, Any]:
        """Sizes of the router's per-request bookkeeping (all 0 when drained), restarts seen,
        violations (its own and the workers'), and whether health says SERVING."""
        registry, queue = self.registry, self.queue
        return {"requests": len(queue.requests), "by_external": len(queue.by_external),
                "waiting": len(queue.waiting), "inflight": queue.inflight,
                "dispatch_log": len(queue.dispatch_log), "restarts": dict(registry.restarts),
                "violations": queue.violations() + [
                    f"{w}: {v}" for w, vs in sorted(registry.violations.items()) for v in vs],
                "serving": self.serving, "pid": os.getpid(), "prefix": dict(self.counters.prefix),
                "kv_index": {w: registry.index.num_blocks(w) for w in registry.index.workers()},
                "kv_snapshots_asked": dict(registry.snapshots_asked),
                "kv_event_blocks": {w: dict(c) for w, c in registry.kv_event_blocks.items()},
                "kv_pairs_unready": sorted(f"{c}->{g}" for c, g in registry.unready_pairs()),
                "healthy": {w: load.healthy for w, load in sorted(registry.loads.items())}}

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_refresh_s)
            try:
                self.counters.flush()
                await self.registry.refresh()
                await self._update_health()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad refresh
                log.exception("status refresh failed")

    async def _update_health(self) -> None:
        """NOT_SERVING while an invariant is broken or no generation worker is healthy."""
        registry = self.registry
        broken = self.queue.violations() + [v for vs in registry.violations.values() for v in vs]
        serving = not broken and any(registry.loads[g].healthy for g in registry.gen_ids)
        if serving != self.serving:
            self.serving = serving
            log.warning("router health -> %s (%s)", "SERVING" if serving else "NOT_SERVING",
                        "; ".join(broken[:5]) or "no healthy generation worker")
            for listener in self._health_listeners:
                out = listener(serving)
                if out is not None:
                    await out

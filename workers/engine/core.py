"""The engine core: TensorRT-LLM's PyExecutor step (scheduling.md 6) as schedule -> run ->
process outputs.

It owns the requests, the two-level scheduler, the KV manager and the outputs, and hands the
model runner (model_runner.py) a ``StepPlan`` per step, getting a ``StepResult`` back
(step_plan.py). Per step:
1. schedule: expire deadlines, poll KV transfers, run the capacity and micro-batch passes,
   pause what the capacity pass evicted (free its KV, fold its tokens into the prompt), start
   the receives of the generation requests it reserved, allocate first chunks (prefix reuse
   moves a chunk past the cached part) and grow decode sequences;
2. run: the plan's forward and sampling, on the runner;
3. process outputs: advance chunks and states, store finished contexts' blocks for reuse,
   apply stop checks, free finished requests, hand context-only ones to the KV connector.

The request bookkeeping is the pure code the simulated worker runs too
(``pdserve.scheduler.lifecycle``); admission, outputs, n/best_of candidates and the KV
connector are modules of their own.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from pdserve.scheduler import (CapacityScheduler, ContextChunkingConfig, KVCacheManager,
                               LlmRequest, LlmRequestState, LlmRequestType, MicroBatchScheduler,
                               SimpleScheduler, lifecycle)
from pdserve.scheduler.kv_window import SlidingWindowKVCacheManager
from pdserve.transport.requests import ErrorKind, WireUpdate

from pdserve.workers.engine.admission import AdmissionLimits, check_request
from pdserve.workers.engine.candidates import Candidates
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.state import EngineStats, RequestTable, TrackedRequest, status_snapshot
from pdserve.workers.engine.events import WorkerEvents
from pdserve.workers.engine.kv_connector import KVConnector, NoKVConnector
from pdserve.workers.runner.model_runner import ModelRunner
from pdserve.workers.engine.pauses import Pauses
from pdserve.workers.engine.outputs import OutputProcessor, note_prompt_logprobs
from pdserve.workers.runner.sampling import RequestSampler, SamplingParams
from pdserve.workers.runner.plan import SampledToken, SamplingBatch, ScheduledSequence, StepPlan

log = logging.getLogger("pdserve.engine_core")
S = LlmRequestState


class EngineCore:
    """Single-threaded: call ``add_request``, ``abort`` and ``step`` from one thread.

    ``attention_window``: the sliding window W every layer of the model shares; the KV manager
    is then a ``SlidingWindowKVCacheManager`` (blocks leave as the window passes them, the
    pool's last block is its scratch block). None: a ``KVCacheManager`` over the whole pool.
    ``transceiver``: the worker's KV connector (``KVTransceiver``) for a disaggregated worker,
    None otherwise."""

    def __init__(self, runner: ModelRunner, config: EngineConfig, *,
                 eos_token_ids: tuple[int, ...] = (), vocab_size: int, max_seq_len: int,
                 attention_window: int | None = None, transceiver=None,
                 clock: Callable[[], float] = time.monotonic, worker_id: str = "engine",
                 grammar=None) -> None:
        self.runner = runner
        pool = runner.kv_pool
        if attention_window is None:
            kv = KVCacheManager(pool.num_blocks, pool.tokens_per_block,
                                enable_block_reuse=config.enable_block_reuse)
        else:
            kv = SlidingWindowKVCacheManager(
                pool.num_blocks - 1, pool.tokens_per_block, attention_window=attention_window,
                max_num_tokens=config.max_num_tokens, scratch_block=pool.num_blocks - 1,
                enable_block_reuse=config.enable_block_reuse)
        self.kv = kv
        self.attention_window = attention_window
        self.config = config
        self.grammar = grammar  # structured outputs: a GrammarCompiler that builds matchers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        default_input_len = max_seq_len - 1
        if config.context_chunking_policy is None:
            # Without chunking a whole prompt (or a paused request's recompute) runs in one step.
            default_input_len = min(default_input_len, config.max_num_tokens)
        self.max_input_len = config.max_input_len or default_input_len
        if self.max_input_len >= max_seq_len:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be < max_seq_len ({max_seq_len})")
        if config.context_chunking_policy is None and self.max_input_len > config.max_num_tokens:
            raise ValueError(f"max_input_len ({self.max_input_len}) must be <= max_num_tokens "
                             f"({config.max_num_tokens}) when context chunking is off")
        chunking = (ContextChunkingConfig(config.context_chunking_policy, config.chunk_unit_size)
                    if config.context_chunking_policy is not None else None)
        self.scheduler = SimpleScheduler(
            CapacityScheduler(config.max_batch_size, config.capacity_scheduler_policy,
                              enable_prefix_aware_scheduling=config.enable_prefix_aware_scheduling),
            # The PyTorch backend bounds one context's compute by max_num_tokens.
            MicroBatchScheduler(chunking, config.max_num_tokens),
            kv_cache_manager=kv, max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens)
        self.requests = RequestTable(clock)
        self.stats = EngineStats()
        # Transfers, pauses and resumes for people (log lines, dashboard, pdserve top).
        events = WorkerEvents(transceiver.worker_id if transceiver is not None else worker_id)
        self.transceiver = transceiver  # the host wires its control plane
        self.connector: KVConnector = transceiver if transceiver is not None else NoKVConnector()
        self.connector.attach_events(events)
        self.limits = AdmissionLimits(vocab_size, max_seq_len, self.max_input_len, kv.num_blocks,
                                      config.capacity_scheduler_policy,
                                      self.connector.can_send, self.connector.can_receive)
        self.outputs = OutputProcessor(self.requests, kv, self.connector, self.stats,
                                       self.eos_token_ids, {})
        self.pauses = Pauses(self.requests, kv, events, self.stats,
                             config.capacity_scheduler_policy.name, self.max_input_len)
        self.candidates = Candidates(self.requests, kv, self.outputs, runner.copy_blocks,
                                     self._choice_sampler, self.max_input_len)
        # Where updates go that must not wait for the end of the step (a layer-wise context
        # request's CONTEXT_STREAMING, before its forward); the host sets it. Without one they
        # are returned with the step's other updates.
        self.deliver_now: Callable[[list[WireUpdate]], None] | None = None
        # Sends the connector's outbox now (the host's KV control); called once the step has
        # started its receives, so their KV requests reach the context workers while this
        # step's forward runs rather than after it. Without one they go after the step.
        self.flush_control: Callable[[], None] | None = None
        # Fault injection: runs after each layer of a forward that streams KV (request ids,
        # layers written so far); see the host's hold_stream test hook.
        self.layer_hook: Callable[[list[int], int], None] | None = None

    # The request table's parts, by the names the worker, metrics and tests read.
    waiting = property(lambda self: self.requests.waiting)
    active = property(lambda self: self.requests.active)
    tracked = property(lambda self: self.requests.tracked)
    paused_since = property(lambda self: self.requests.paused_since)
    kv_pool = property(lambda self: self.runner.kv_pool)

    @property
    def events(self) -> WorkerEvents:
        """Pauses and resumes go here (transfers: the connector's own)."""
        return self.pauses.events

    @events.setter
    def events(self, events: WorkerEvents) -> None:
        self.pauses.events = events
    model = property(lambda self: self.runner.model)

    # ------------------------------------------------------------------ admission

    def add_request(self, request: LlmRequest, params: SamplingParams, *,
                    deadline: float | None = None, forced_tokens: Sequence[int] = (),
                    stream_kv: bool = False, output_start: int | None = None,
                    choice_tokens: Sequence[Sequence[int]] = ()) -> None:
        """Validates against the model and the pool (admission.py); raises ValueError naming
        the field.

        ``deadline`` (on the core's clock): past it the request is aborted with finish reason
        "deadline" and everything it holds is freed. ``forced_tokens``: tokens the client already
        has for the positions right after the prompt (a retry whose continuation did not fit in
        max_input_len); they are regenerated as these tokens and not reported again. They count
        toward max_new_tokens. ``stream_kv``: a context-only request whose KV goes out layer by
        layer while its last chunk is computed (the router's layer-wise mode). ``output_start``:
        where the request's output begins in its tokens (a retry's prompt holds tokens it
        generated before; penalties and min_tokens count from here); None: the prompt's end."""
        if request.request_id in self.requests.tracked:
            raise ValueError(f"request_id {request.request_id} is already active")
        ok = check_request(request, params, self.limits, self.kv, forced_tokens=forced_tokens,
                           stream_kv=stream_kv, output_start=output_start,
                           choice_tokens=choice_tokens)
        request.max_new_tokens = ok.max_new_tokens
        matcher = None
        if params.guided is not None:
            # The grammar's state is rebuilt from the output so far: a retry's folded prompt, a
            # forced continuation, the context worker's first token (a migration or a
            # disaggregated request resumes exactly where the text stands).
            output = list(request.get_prompt_tokens()[ok.output_start:]) + ok.forced
            cpp = request.context_phase_params
            if request.is_generation_only_request and cpp is not None and not ok.forced:
                output += list(cpp.first_gen_tokens)
            matcher = self._grammar_matcher(params.guided, output)
        first_params = params.for_choice(0) if params.candidates > 1 else params
        sampler = RequestSampler(first_params, self.runner.device, output_start=ok.output_start,
                                 eos_token_ids=tuple(self.eos_token_ids), matcher=matcher)
        tracked = TrackedRequest(request, sampler, params, ok.emitted, deadline=deadline,
                                 stream_kv=stream_kv, wire_id=request.request_id)
        if params.candidates > 1:
            self.candidates.admit(tracked, choice_tokens)
        if params.prompt_logprobs is not None and not request.is_generation_only_request:
            # Every prompt position is computed here: a cached prefix would skip some, so the
            # request's blocks are salted out of the shared prefix cache (vLLM does the same).
            tracked.prompt_logprobs = []
            request.cache_salt = f"prompt-logprobs:{id(tracked):x}:{request.request_id}"
        self.requests.admit(tracked)

    def _choice_sampler(self, params: SamplingParams, index: int, output_start: int) -> RequestSampler:
        """Candidate ``index``'s sampler: seed + index (vLLM's rule), its own grammar state."""
        matcher = self._grammar_matcher(params.guided, []) if params.guided is not None else None
        return RequestSampler(params.for_choice(index), self.runner.device,
                              output_start=output_start, eos_token_ids=tuple(self.eos_token_ids),
                              matcher=matcher)

    def _grammar_matcher(self, guided: tuple[str, str], output: list[int]):
        if self.grammar is None:
            raise ValueError("guided: this worker has no tokenizer to build grammars with")
        return self.grammar.matcher_after(guided, output)

    def abort(self, request_id: int, reason: str = "abort") -> WireUpdate | None:
        """Frees everything the request holds. Returns its final update (ABORTED, or FAILED
        with ErrorKind.DEADLINE for reason "deadline"), or None if unknown."""
        table = self.requests
        known = table.tracked.get(request_id)
        if known is not None and known.wire_id != request_id:
            request_id = known.wire_id  # a candidate's child: the whole request ends
        final = (WireUpdate.failed(request_id, ErrorKind.DEADLINE, "deadline exceeded")
                 if reason == "deadline" else WireUpdate.aborted(request_id))
        children = self.candidates.children_of(request_id)
        for cid in children:
            child = table.untrack(cid).request
            table.dequeue(child)
            lifecycle.finish_request(child, self.kv)
        self.candidates.open.pop(request_id, None)
        tracked = table.untrack(request_id)
        if tracked is None:
            if not children and not self.connector.abort_handed_off(request_id, self.kv):
                return None
            self.stats.aborted += 1
            return final
        request = tracked.request
        table.dequeue(request)
        # A receive in flight keeps its blocks until the transport says it is quiet.
        if not self.connector.abort(request, self.kv):
            lifecycle.finish_request(request, self.kv)
        self.connector.take_received(request_id)
        self.stats.aborted += 1
        return final

    # ------------------------------------------------------------------ the step

    def step(self) -> list[WireUpdate]:
        updates, plan, sampling = self._schedule()
        if plan is None:
            self.stats.steps += 1
            return updates
        streams = [self._request_of(rid) for rid in plan.stream_request_ids]
        try:
            result = self.runner.execute(plan, sampling, self._layer_done(plan.stream_request_ids)
                                         if streams else None)
        except BaseException:
            for request in streams:  # nothing will finish them: their sends must not wait
                self.connector.end_stream(request, "the step failed")
            raise
        self.stats.forward_seconds += result.forward_seconds
        updates.extend(self._process(plan, result))
        self.stats.steps += 1
        return updates

    def _request_of(self, request_id: int) -> LlmRequest:
        return self.requests.tracked[request_id].request

    def _schedule(self) -> tuple[list[WireUpdate], StepPlan | None, SamplingBatch | None]:
        updates: list[WireUpdate] = self._expire_deadlines()
        table = self.requests
        table.activate_waiting()
        updates.extend(self._poll_transfers())
        t0 = time.perf_counter()
        out = self.scheduler.schedule(table.active, set())
        self.stats.schedule_seconds += time.perf_counter() - t0
        self.pauses.pause(out.paused_requests)
        for request in out.fitting_disagg_gen_init_requests:
            self.connector.start_receive(request, self.kv,
                                         timeout_s=table.time_left(request.request_id))
        if out.fitting_disagg_gen_init_requests and self.flush_control is not None:
            self.flush_control()
        if table.paused_since:
            self.pauses.note_resumed(out.context_requests)
        for request in out.context_requests:
            if (request.llm_request_type == LlmRequestType.GENERATION_ONLY and request.num_pauses == 0
                    and request.context_current_position == 0):
                self.stats.unexpected_recomputes += 1
                log.error("request %d: generation-only request prefilled here without a pause",
                          request.request_id)
        computed = lifecycle.prepare_context_chunks(out.context_requests, self.kv)
        contexts = [(r, n) for r, n in zip(out.context_requests, computed) if n > 0]
        for request in out.generation_requests:
            if table.awaiting_fork and request.request_id in table.awaiting_fork:
                updates.extend(self.candidates.fork_received(request))
            lifecycle.prepare_generation_step(request, self.kv)
        if not contexts and not out.generation_requests:
            return updates, None, None
        plan, sampling = self._plan(contexts, out.generation_requests,
                                    self._begin_streams(contexts, updates))
        return updates, plan, sampling

    def _plan(self, contexts: list[tuple[LlmRequest, int]], generation: list[LlmRequest],
              streams: list[int]) -> tuple[StepPlan, SamplingBatch]:
        """The flat batch [context chunks..., decode tokens...] and the sampling of every
        sequence that produces a token this step."""
        input_ids: list[int] = []
        rows: list[ScheduledSequence] = []
        sampling = SamplingBatch([], [])
        block_table = self.kv.block_table
        tracked = self.requests.tracked
        for request, n in contexts:
            rid, pos = request.request_id, request.context_current_position
            tokens = request.get_tokens(0)
            t = tracked[rid]
            samples = pos + n >= request.prompt_len
            k = targets = None
            if t.prompt_logprobs is not None:  # every row predicts a prompt token
                k = t.params.prompt_logprobs
                targets = tuple(tokens[pos + 1:pos + 1 + max(0, min(n, request.orig_prompt_len - 1 - pos))])
            rows.append(ScheduledSequence(rid, len(input_ids), n, pos,
                                          tuple(block_table(rid, pos, n)), samples, k,
                                          targets or ()))
            input_ids.extend(tokens[pos:pos + n])
            if samples:
                self._add_sampling_row(sampling, t, tokens)
        for request in generation:
            rid = request.request_id
            tokens = request.get_tokens(0)
            past = len(tokens) - 1
            rows.append(ScheduledSequence(rid, len(input_ids), 1, past,
                                          tuple(block_table(rid, past, 1)), True))
            input_ids.append(tokens[-1])
            self._add_sampling_row(sampling, tracked[rid], tokens)
        return StepPlan(tuple(input_ids), tuple(rows), len(contexts), tuple(streams)), sampling

    def _add_sampling_row(self, sampling: SamplingBatch, tracked: TrackedRequest, tokens) -> None:
        request = tracked.request
        if self.requests.awaiting_fork and request.is_context_init_state:
            siblings = self.candidates.samplers_at_prefill_end(request)
            if siblings is not None:  # n / best_of: they draw from the same logits
                sampling.extra[len(sampling.samplers)] = siblings
        sampling.samplers.append(tracked.sampler)
        sampling.sequences.append(tokens)

    def _process(self, plan: StepPlan, result) -> list[WireUpdate]:
        updates: list[WireUpdate] = []
        tracked = self.requests.tracked
        tokens = iter(result.tokens)
        for row in plan.sequences[:plan.num_context]:
            request = tracked[row.request_id].request
            if row.prompt_logprobs is not None:
                note_prompt_logprobs(tracked[row.request_id], row.past_len,
                                     result.prompt_logprobs.get(row.request_id, []))
            self.stats.context_tokens += row.num_new_tokens
            sampled = next(tokens) if row.samples else SampledToken(None, None)
            if not lifecycle.complete_context_chunk(request, self.kv, sampled.token):
                continue
            firsts = result.extra.get(row.request_id)
            if firsts is not None:
                updates.extend(self.candidates.fork_after_prefill(request, sampled, firsts))
            else:
                updates.append(self.outputs.on_token(request, sampled.token, sampled.logprobs))
        for row in plan.sequences[plan.num_context:]:
            request = tracked[row.request_id].request
            sampled = next(tokens)
            lifecycle.complete_generation_step(request, sampled.token)
            updates.append(self.outputs.on_token(request, sampled.token, sampled.logprobs))
        return updates

    def _begin_streams(self, contexts: list[tuple[LlmRequest, int]],
                       updates: list[WireUpdate]) -> list[int]:
        """Layer-wise context-only requests whose last chunk runs this step: lease their blocks
        now and tell the router (CONTEXT_STREAMING, delivered before the forward), so the
        generation side can ask for the KV while it is being written."""
        if not self.connector.can_send:
            return []
        streams, early = [], []
        for request, n in contexts:
            rid = request.request_id
            if (self.requests.tracked[rid].stream_kv and request.is_context_only_request
                    and request.context_current_position + n >= request.prompt_len):
                params = self.connector.begin_stream(request, self.kv,
                                                     lease_s=self.requests.time_left(rid))
                streams.append(rid)
                early.append(WireUpdate.context_streaming(rid, params))
        if early:
            if self.deliver_now is not None:
                self.deliver_now(early)
            else:
                updates.extend(early)
        return streams

    def _layer_done(self, stream_ids: Sequence[int]) -> Callable[[int], None]:
        ids = list(stream_ids)

        def on_layer(layers: int) -> None:  # the sends of the layers so far may start now
            self.connector.layers_written(ids, layers, self.runner.device)
            if self.layer_hook is not None:
                self.layer_hook(ids, layers)
        return on_layer

    def _poll_transfers(self) -> list[WireUpdate]:
        if not (self.connector.can_send or self.connector.can_receive):
            return []
        active = self.requests.active
        # Block briefly only when nothing but receives is left to run (scheduling.md 1.4 step 2).
        waiting_only = bool(active) and all(
            r.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS for r in active)
        failed = self.connector.poll(active, self.kv, wait_s=0.02 if waiting_only else 0.0)
        for request in active:
            if request.state == S.DISAGG_GENERATION_TRANS_COMPLETE:
                tracked = self.requests.tracked[request.request_id]
                if not tracked.emitted:  # layer-wise: the first token came with the KV, and
                    # the router streamed it from the context worker already
                    tracked.emitted = list(request.context_phase_params.first_gen_tokens)
        updates = []
        for request, reason in failed:
            self.requests.retire(request)
            log.warning("request %d: KV transfer failed: %s", request.request_id, reason)
            updates.append(WireUpdate.failed(request.request_id, ErrorKind.TRANSFER,
                                             f"KV transfer failed: {reason}"))
        return updates

    def _expire_deadlines(self) -> list[WireUpdate]:
        updates = []
        for rid in self.requests.expired():
            log.info("request %d: deadline exceeded, aborted", rid)
            update = self.abort(rid, reason="deadline")
            if update is not None:
                self.stats.deadlines_exceeded += 1
                updates.append(update)
        return updates

    # ------------------------------------------------------------------ what it holds

    def live_requests(self) -> dict[int, LlmRequest]:
        """Every request this worker holds (``lifecycle.live_requests``)."""
        return lifecycle.live_requests(self.requests.active, self.requests.waiting,
                                       *self.connector.held_requests())

    def request_states(self) -> dict[int, str]:
        """Every live request's state name; a generation request whose KV is on the way shows
        its transport session state instead (RESERVED, REQUESTED, RECEIVING)."""
        out: dict[int, str] = {}
        for rid, r in self.live_requests().items():
            name = r.state.name
            if r.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS:
                name = self.connector.receive_state(rid) or name
            out[rid] = name
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.requests.active or self.requests.waiting or self.connector.has_work)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.get_num_free_blocks()

    def status(self, *, records: bool = True) -> dict:
        """A snapshot for GetClusterStatus (``engine_state.status_snapshot``)."""
        return status_snapshot(self.requests, self.kv, self.stats, self.live_requests(),
                               self.connector.status(records=records))

"""The step loop (TensorRT-LLM's PyExecutor, scheduling.md 6) around a real model.

Per step: schedule (capacity, then micro-batch) -> pause what the capacity pass evicted (free its
KV, fold its tokens into the prompt) -> allocate KV for first chunks (prefix reuse moves the
chunk past the cached part) and grow decode sequences -> one forward over the flat batch ->
sample the rows that produce a token -> advance chunks and states, store finished contexts'
blocks for reuse -> free finished or aborted requests. A request past its deadline is aborted at
the start of a step (finish reason "deadline"), which frees everything it holds.

The request bookkeeping is the same pure code the simulated worker runs
(``pdserve.scheduler.lifecycle``); this module adds the tensors.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    LlmRequestType,
    MicroBatchScheduler,
    SimpleScheduler,
    lifecycle,
)
from pdserve.scheduler.kv_cache import KVCacheOutOfBlocksError
from pdserve.scheduler.kv_prefix_reuse import PrefixReuseSummary
from pdserve.scheduler.reorder import insert_request_in_order
from pdserve.transport.kv_pool import KVPool
from pdserve.transport.requests import ErrorKind, TokenLogprobs, UpdateInfo, UpdateKind, WireUpdate

from .config import EngineConfig
from .model.batch import SeqBatchInfo
from .sampling import RequestSampler, SamplingLimits, SamplingParams, sample, token_logprobs
from .step_threads import StepThreads
from .events import WorkerEvents, label
from .transceiver import KVTransceiver

log = logging.getLogger("pdserve.executor")


@dataclass(slots=True)
class ExecutorStats:
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
class _Tracked:
    request: LlmRequest
    sampler: RequestSampler
    params: SamplingParams
    emitted: list[int] = field(default_factory=list)  # generated tokens already reported
    finish_reason: str | None = None
    deadline: float | None = None  # on the executor's clock
    stream_kv: bool = False  # context-only, layer-wise: its KV is sent while it prefills
    # prompt_logprobs: the entries so far (one per prompt token after the first), None once
    # sent with the first token (or when not asked for).
    prompt_logprobs: list | None = None
    # n / best_of: candidate ``index`` of the request the router knows as ``wire_id`` (a
    # candidate after the first is a child request of its own, sharing the prompt's KV).
    wire_id: int = 0
    index: int = 0
    # The first candidate, until its prefill ends: the other candidates' samplers (they draw
    # their first tokens from the same logits), then their (token, logprobs).
    choice_samplers: list | None = None
    choice_firsts: list | None = None
    # A generation-only first candidate: the other candidates' first tokens (the context
    # worker drew them), forked off once its KV has arrived.
    choice_tokens: tuple = ()


class Executor:
    """Single-threaded: call ``add_request``, ``abort`` and ``step`` from one thread."""

    def __init__(
        self,
        model,
        kv_pool: KVPool,
        config: EngineConfig,
        *,
        eos_token_ids: tuple[int, ...] = (),
        vocab_size: int,
        max_seq_len: int,
        transceiver: KVTransceiver | None = None,
        clock: Callable[[], float] = time.monotonic,
        worker_id: str = "engine",
        grammar=None,
        attention_window: int | None = None,
    ) -> None:
        """``attention_window``: the sliding window W every layer of the model shares; KV blocks
        then leave the pool as the window passes them, and the pool's last block is a scratch
        block outside the manager (see ``_block_table``). None: every block is kept."""
        self.model = model
        self.kv_pool = kv_pool
        # Structured outputs: a GrammarCompiler (workers/grammar.py) that builds matchers.
        self.grammar = grammar
        self.config = config
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
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be <= max_num_tokens "
                f"({config.max_num_tokens}) when context chunking is off"
            )
        B = kv_pool.tokens_per_block
        self.attention_window = attention_window
        if attention_window is None:
            self.kv = KVCacheManager(num_blocks=kv_pool.num_blocks, tokens_per_block=B,
                                     enable_block_reuse=config.enable_block_reuse)
            self._scratch_block = -1
        else:
            if attention_window <= 0 or kv_pool.num_blocks < 2:
                raise ValueError("a sliding window needs W > 0 and a pool of at least 2 blocks")
            # T: one step's chunk (at most max_num_tokens tokens) plus the window it reads fits in
            # the live blocks with a block to spare for misalignment, so a prompt's live blocks
            # hold every key its chunks and its first decode read (see _block_table).
            temporary = -(-config.max_num_tokens // B) * B + B
            self._scratch_block = kv_pool.num_blocks - 1
            self.kv = KVCacheManager(num_blocks=kv_pool.num_blocks - 1, tokens_per_block=B,
                                     enable_block_reuse=config.enable_block_reuse,
                                     max_attention_window=attention_window,
                                     temporary_attention_window=temporary)
            # TensorRT-LLM's estimates assume a cyclic window (see these two): the capacity
            # scheduler then reads the pool through the manager's public names.
            self.kv.get_needed_blocks_one_step = self._needed_blocks_one_step
            self.kv.get_remaining_blocks_to_completion = self._remaining_blocks_to_completion
            self.kv.analyze_prefix_reuse = self._analyze_prefix_reuse
        chunking = (
            ContextChunkingConfig(config.context_chunking_policy, config.chunk_unit_size)
            if config.context_chunking_policy is not None
            else None
        )
        self.scheduler = SimpleScheduler(
            CapacityScheduler(
                config.max_batch_size,
                config.capacity_scheduler_policy,
                enable_prefix_aware_scheduling=config.enable_prefix_aware_scheduling,
            ),
            # The PyTorch backend bounds one context's compute by max_num_tokens.
            MicroBatchScheduler(chunking, config.max_num_tokens),
            kv_cache_manager=self.kv,
            max_batch_size=config.max_batch_size,
            max_num_tokens=config.max_num_tokens,
        )
        # Priority order lives in the waiting queue; activation appends, so a started request
        # (mid chunked prefill) is never overtaken by a later arrival in the active list.
        self.waiting: list[LlmRequest] = []
        self.active: list[LlmRequest] = []
        self.tracked: dict[int, _Tracked] = {}
        # n / best_of: candidates after the first run as child requests with ids of their own
        # (negative: the router's ids are not), and each request's candidates still running.
        self._child_ids = itertools.count(-1, -1)
        self._open_choices: dict[int, int] = {}
        # Requests whose other candidates are still to be forked: the step looks for them only
        # while there are any (the common step pays one truth test).
        self._awaiting_fork: set[int] = set()
        self.stats = ExecutorStats()
        # Transfers, pauses and resumes for people (log lines, dashboard, pdserve top).
        self.events = WorkerEvents(transceiver.worker_id if transceiver is not None else worker_id)
        self.transceiver = transceiver
        if transceiver is not None and transceiver.events is None:
            transceiver.events = self.events
        self._device = kv_pool.device
        # Intra-op threads per step (EngineConfig.small_step_threads; step_threads.py), or None
        # when every step runs on all of them. "All" is the count when the engine is built (the
        # worker sets it first).
        small = config.small_step_threads
        self._step_threads = (None if small is None or self._device.type != "cpu"
                              else StepThreads(torch.get_num_threads(), config.small_step_tokens,
                                               None if small == "auto" else small))
        self._clock = clock
        self._num_deadlines = 0  # tracked requests that have a deadline
        # Paused requests not yet prefilled again: id -> time.monotonic() of the pause.
        self.paused_since: dict[int, float] = {}
        # Where updates go that must not wait for the end of the step (a layer-wise context
        # request's CONTEXT_STREAMING, before its forward); the host sets it. Without one they
        # are returned with the step's other updates.
        self.deliver_now: Callable[[list[WireUpdate]], None] | None = None
        # Sends the transceiver's outbox now (the host's KV control); called once the step has
        # started its receives, so their KV requests reach the context workers while this
        # step's forward runs rather than after it. Without one they go after the step.
        self.flush_control: Callable[[], None] | None = None
        # Fault injection: runs after each layer of a forward that streams KV (request ids,
        # layers written so far); see the host's hold_stream test hook.
        self.layer_hook: Callable[[list[int], int], None] | None = None

    # ------------------------------------------------------------------ admission

    def add_request(self, request: LlmRequest, params: SamplingParams, *,
                    deadline: float | None = None, forced_tokens: Sequence[int] = (),
                    stream_kv: bool = False, output_start: int | None = None,
                    choice_tokens: Sequence[Sequence[int]] = ()) -> None:
        """Validates against the model and the pool; raises ValueError naming the field.

        ``deadline`` (on the executor's clock): past it the request is aborted with finish reason
        "deadline" and everything it holds is freed. ``forced_tokens``: tokens the client already
        has for the positions right after the prompt (a retry whose continuation did not fit in
        max_input_len); they are regenerated as these tokens and not reported again. They count
        toward max_new_tokens. ``stream_kv``: a context-only request whose KV goes out layer by
        layer while its last chunk is computed (the router's layer-wise mode). ``output_start``:
        where the request's output begins in its tokens (a retry's prompt holds tokens it
        generated before; penalties and min_tokens count from here); None: the prompt's end."""
        if request.request_id in self.tracked:
            raise ValueError(f"request_id {request.request_id} is already active")
        params.validate(SamplingLimits.vocab_only(self.vocab_size))
        if output_start is None:
            output_start = request.prompt_len
        if not 0 <= output_start <= request.prompt_len:
            raise ValueError(f"output_start {output_start} is outside the prompt [0, "
                             f"{request.prompt_len}]")
        forced = [int(t) for t in forced_tokens]
        if any(not 0 <= t < self.vocab_size for t in forced):
            raise ValueError(f"forced_tokens are outside the vocabulary [0, {self.vocab_size})")
        if len(forced) > request.max_new_tokens:
            raise ValueError(f"forced_tokens ({len(forced)}) exceed max_new_tokens "
                             f"({request.max_new_tokens})")
        prompt = request.get_prompt_tokens()
        if len(prompt) > self.max_input_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than max_input_len {self.max_input_len}"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        request.max_new_tokens = min(request.max_new_tokens, self.max_seq_len - request.prompt_len)
        needed = self._blocks_to_completion(request.prompt_len, request.max_new_tokens)
        each = ""
        if (self.attention_window is not None and params.candidates > 1
                and not request.is_context_only_request
                and self.config.capacity_scheduler_policy != CapacitySchedulerPolicy.MAX_UTILIZATION):
            needed *= params.candidates  # every candidate's peak (_remaining_blocks_to_completion)
            each = f" for {params.candidates} candidates (n/best_of)"
        if needed > self.kv.num_blocks:
            # Under GUARANTEED_NO_EVICT such a request would wait forever.
            raise ValueError(
                f"prompt + max_tokens{each} needs {needed} KV blocks but the pool has {self.kv.num_blocks}"
            )
        matcher = None
        if params.guided is not None:
            # The grammar's state is rebuilt from the output so far: a retry's folded prompt, a
            # forced continuation, the context worker's first token (a migration or a
            # disaggregated request resumes exactly where the text stands).
            output = list(request.get_prompt_tokens()[output_start:]) + forced
            cpp = request.context_phase_params
            if request.is_generation_only_request and cpp is not None and not forced:
                output += list(cpp.first_gen_tokens)
            matcher = self._grammar_matcher(params.guided, output)
        candidates = params.candidates
        if candidates > 1 and (forced or stream_kv or request.beam_width != 1):
            raise ValueError("n/best_of: a request of several candidates starts from its prompt")
        if request.is_generation_only_request and len(choice_tokens) != candidates - 1:
            raise ValueError(f"choice_tokens: {candidates - 1} first tokens expected (n/best_of "
                             f"{candidates}), got {len(choice_tokens)}")
        first_params = params.for_choice(0) if candidates > 1 else params
        sampler = RequestSampler(first_params, self._device, output_start=output_start,
                                 eos_token_ids=tuple(self.eos_token_ids), matcher=matcher)
        tracked = _Tracked(request, sampler, params, forced, deadline=deadline, stream_kv=stream_kv,
                           wire_id=request.request_id)
        if candidates > 1:
            self._awaiting_fork.add(request.request_id)
            if request.is_generation_only_request:
                tracked.choice_tokens = tuple(tuple(int(t) for t in c) for c in choice_tokens)
            else:
                tracked.choice_samplers = [self._choice_sampler(params, i, output_start, [])
                                           for i in range(1, candidates)]
        if params.prompt_logprobs is not None and not request.is_generation_only_request:
            # Every prompt position is computed here: a cached prefix would skip some, so the
            # request's blocks are salted out of the shared prefix cache (vLLM does the same).
            tracked.prompt_logprobs = []
            request.cache_salt = f"prompt-logprobs:{id(tracked):x}:{request.request_id}"
        if stream_kv and not request.is_context_only_request:
            raise ValueError("stream_kv is for context-only requests")
        if request.is_generation_only_request:
            cpp = request.context_phase_params
            if self.transceiver is None or self.transceiver.receiver is None:
                raise ValueError("generation-only requests need a worker with a KV receiver")
            # No first token: layer-wise, it arrives with the KV (then nothing may be forced).
            if cpp is None or len(cpp.first_gen_tokens) not in (
                    request.beam_width, 0 if not forced else request.beam_width):
                raise ValueError("context_phase_params must carry the first generated token")
            if forced and forced[0] != cpp.first_gen_tokens[0]:
                raise ValueError("forced_tokens must start with the context phase's first token")
            # The context worker's first token reached the client through the router already.
            tracked.emitted = forced or list(cpp.first_gen_tokens)
        elif request.is_context_only_request and (
            self.transceiver is None or self.transceiver.sender is None
        ):
            raise ValueError("context-only requests need a worker with a KV sender")
        self.tracked[request.request_id] = tracked
        self._num_deadlines += deadline is not None
        insert_request_in_order(self.waiting, request)

    def _blocks_to_completion(self, prompt_len: int, max_new_tokens: int) -> int:
        """The most blocks the capacity scheduler asks to be free for one sequence of a fresh
        request (or its recompute) in an otherwise empty pool, without reuse credit (a cache may
        not keep it): GUARANTEED_NO_EVICT's estimate (scheduling.md 2.4), which bounds
        MAX_UTILIZATION's first-chunk need too (``_needed_blocks_one_step``). More than the
        pool: it would wait forever."""
        B = self.kv.tokens_per_block
        total = prompt_len + max_new_tokens
        w = self.attention_window
        if w is None:
            return -(-total // B)
        blocks = -(-min(total, w + self.kv.temporary_attention_window) // B)
        if total > w and -(-total // B) > max(-(-prompt_len // B), blocks):
            blocks += 1  # the window slides: a block is allocated before one is detached
        return blocks

    def _analyze_prefix_reuse(self, tokens, request: LlmRequest) -> PrefixReuseSummary:
        """The manager reuses no cached prefix for a prompt past W + T: the scheduler must
        neither credit one (a step would run out of blocks, or past max_num_tokens) nor hold the
        request back for one to be stored (prefix-aware skipping)."""
        if len(tokens) > self.attention_window + self.kv.temporary_attention_window:
            return PrefixReuseSummary(0, 0, None)
        return KVCacheManager.analyze_prefix_reuse(self.kv, tokens, request)

    def _remaining_blocks_to_completion(self, request: LlmRequest, summary=None) -> int:
        """GUARANTEED_NO_EVICT's estimate of a windowed pool. TensorRT-LLM's (scheduling.md 2.4)
        credits a cached prefix this manager does not reuse (a prompt past W + T), and counts
        blocks shared with another sequence (a reused prefix, n > 1's fork) as held for good,
        while the window detaches them from one holder, which then allocates anew. Here a
        sequence is charged its whole peak (the formula's per-beam blocks, no reuse credit) less
        only the blocks it alone holds, so the running sequences' peaks always fit the pool;
        a request whose other candidates are still to fork off is charged for each."""
        kv = self.kv
        if request.prompt_len > self.attention_window + kv.temporary_attention_window:
            summary = PrefixReuseSummary(0, 0, None)  # no reuse, so no compute credit either
        # Called for its estimated_reusable_tokens too (the chunk's compute credit).
        formula = KVCacheManager.get_remaining_blocks_to_completion(kv, request, summary)
        if request.beam_width != 1:
            return formula
        B, w = kv.tokens_per_block, self.attention_window
        total = request.prompt_len + request.max_new_tokens
        peak = -(-min(total, w + kv.temporary_attention_window) // B)
        if total > w and -(-total // B) > max(-(-request.get_num_tokens(0) // B), peak):
            peak += 1  # the window slides: a block is allocated before one is detached
        rid = request.request_id
        if rid in self._awaiting_fork and not request.is_context_only_request:
            peak *= self.tracked[rid].params.candidates
        own = 0
        if kv.has_sequence(rid):
            own = sum(1 for block in kv.get_block_ids(rid) if kv.get_ref_count(block) == 1)
        return max(0, peak - own)

    def _needed_blocks_one_step(self, request: LlmRequest, two_steps_look_ahead: bool,
                                summary=None) -> int:
        """MAX_UTILIZATION's next-step need of a windowed pool, as this manager allocates.
        TensorRT-LLM's formula (scheduling.md 2.6) has a cyclic window in mind: it caps a first
        chunk at W + max_new_tokens and counts nothing for a decode past W. This manager holds
        min(P, W + T) tokens of a prompt (no reuse past W + T) and a decode opens a block at
        every boundary after detaching what the window left. Short counts would let a step run
        out of blocks halfway; these are exact (a decode's net need) or over."""
        kv = self.kv
        B, w = kv.tokens_per_block, self.attention_window
        held = w + kv.temporary_attention_window
        rid = request.request_id

        def formula() -> int:
            return KVCacheManager.get_needed_blocks_one_step(kv, request, two_steps_look_ahead,
                                                             summary)

        if request.beam_width != 1:
            return formula()  # beams never detach
        if request.state == LlmRequestState.DISAGG_GENERATION_INIT or (
                request.is_context_init_state
                and request.context_current_position == request.prepopulated_prompt_len):
            p = request.prompt_len
            if p > held:
                summary = PrefixReuseSummary(0, 0, None)  # no reuse, so no compute credit either
                formula()  # (sets estimated_reusable_tokens)
                return -(-held // B)
            # TensorRT-LLM's count of min(P, W + max_new) tokens, less its reuse credit, raised
            # to the P tokens allocated.
            return formula() + -(-p // B) - -(-min(p, w + request.max_new_tokens) // B)
        if request.is_context_init_state or not kv.has_sequence(rid):
            return formula()  # a later chunk allocates nothing
        cur = kv.get_num_tokens(rid)
        if two_steps_look_ahead:
            return -(-(cur + 2) // B) - -(-cur // B)  # without what the window frees
        n = cur + 1
        if (n - 1) % B:
            return 0
        live = kv.get_block_ids(rid)
        front = kv.get_num_front_blocks_removed(rid)
        freed = 0  # add_token's detach, before it allocates
        for i, block in enumerate(live):
            if n - (front + i) * B < w + B:
                break
            freed += kv.get_ref_count(block) == 1
        return max(0, 1 - freed)

    def _choice_sampler(self, params: SamplingParams, index: int, output_start: int,
                        output: list[int]) -> RequestSampler:
        """Candidate ``index``'s sampler: seed + index (vLLM's rule), its own grammar state."""
        matcher = self._grammar_matcher(params.guided, output) if params.guided is not None else None
        return RequestSampler(params.for_choice(index), self._device, output_start=output_start,
                              eos_token_ids=tuple(self.eos_token_ids), matcher=matcher)

    def _fork_choices(self, parent: LlmRequest, firsts: list[tuple[int, TokenLogprobs | None]],
                      samplers: list[RequestSampler] | None, *, reported: bool) -> list[LlmRequest]:
        """Candidates 1.. of ``parent`` as child requests right after its prefill (its KV holds
        the prompt, nothing more): each shares the prompt's full blocks and gets a copy of the
        partial last one, and starts generating after its own first token. A child that finds
        no free block for its copy is paused: it recomputes its prompt when there is room."""
        pt = self.tracked[parent.request_id]
        prompt = parent.get_tokens(0)[:parent.prompt_len]
        children = []
        for i, (token, _) in enumerate(firsts, start=1):
            child = LlmRequest(next(self._child_ids), prompt, parent.max_new_tokens,
                               priority=parent.priority, client_id=parent.client_id)
            child.arrival_seq = parent.arrival_seq
            # (Its grammar state takes the first token in _after_token, as the first candidate's.)
            sampler = (samplers[i - 1] if samplers is not None else
                       self._choice_sampler(pt.params, i, pt.sampler.output_start, []))
            # ``reported``: the router has the first tokens already (the context worker's).
            tracked = _Tracked(child, sampler, sampler.params, [token] if reported else [],
                               deadline=pt.deadline, wire_id=pt.wire_id, index=i)
            child.add_new_token(token)
            child.decoding_iter = 1
            child.context_current_position = child.prompt_len
            child.state = LlmRequestState.GENERATION_IN_PROGRESS
            self.tracked[child.request_id] = tracked
            self._num_deadlines += tracked.deadline is not None
            try:
                copy = self.kv.fork_sequence(parent.request_id, child)
            except KVCacheOutOfBlocksError:
                lifecycle.pause_requests([child], self.kv, self.max_input_len)
                self.paused_since[child.request_id] = time.monotonic()
            else:
                if copy is not None:
                    self.kv_pool.copy_block(*copy)
            self.active.append(child)
            children.append(child)
        self._open_choices[pt.wire_id] = len(firsts) + 1
        return children

    def _fork_received(self, request: LlmRequest) -> list[WireUpdate]:
        """A generation-only request of several candidates whose KV has arrived: the other
        candidates (their first tokens came from the context worker, through the router) fork
        off before its first decode. A candidate whose first token already ends it finishes
        here."""
        tracked = self.tracked[request.request_id]
        firsts = [(c[0], None) for c in tracked.choice_tokens]
        tracked.choice_tokens = ()
        self._awaiting_fork.discard(request.request_id)
        out = []
        for child, (first, _) in zip(self._fork_choices(request, firsts, None, reported=True), firsts):
            update = self._after_token(child, first, None)
            if update.finished or update.kind != UpdateKind.TOKENS:
                out.append(update)
        return out

    def _grammar_matcher(self, guided: tuple[str, str], output: list[int]):
        """A structured-output request's matcher, after ``output``; ValueError (the request is
        refused) when its grammar does not compile or the output breaks it."""
        if self.grammar is None:
            raise ValueError("guided: this worker has no tokenizer to build grammars with")
        from pdserve.transport.requests.structured import GuidedSpec

        matcher = self.grammar.matcher(GuidedSpec.from_pair(guided))
        if output and not matcher.replay(output):
            raise ValueError("guided: the tokens generated so far do not follow the grammar")
        return matcher

    def abort(self, request_id: int, reason: str = "abort") -> WireUpdate | None:
        """Frees everything the request holds. Returns its final update (ABORTED, or FAILED
        with ErrorKind.DEADLINE for reason "deadline"), or None if unknown."""
        known = self.tracked.get(request_id)
        if known is not None and known.wire_id != request_id:
            request_id = known.wire_id  # a candidate's child: the whole request ends
        final = (WireUpdate.failed(request_id, ErrorKind.DEADLINE, "deadline exceeded")
                 if reason == "deadline" else WireUpdate.aborted(request_id))
        children = [cid for cid, t in self.tracked.items()
                    if t.wire_id == request_id and cid != request_id]
        for cid in children:
            child = self._untrack(cid).request
            for queue in (self.waiting, self.active):
                if child in queue:
                    queue.remove(child)
            lifecycle.finish_request(child, self.kv)
        self._open_choices.pop(request_id, None)
        tracked = self._untrack(request_id)
        if tracked is None and children:
            self.stats.aborted += 1
            return final
        if tracked is None:
            handed_off = self.transceiver.transmitting.get(request_id) if self.transceiver else None
            if handed_off is None:
                return None
            self.transceiver.abort(handed_off, self.kv)  # blocks freed once the send is quiet
            self.stats.aborted += 1
            return final
        request = tracked.request
        for queue in (self.waiting, self.active):
            if request in queue:
                queue.remove(request)
        # A receive in flight keeps its blocks until the transport says it is quiet.
        if self.transceiver is None or not self.transceiver.abort(request, self.kv):
            lifecycle.finish_request(request, self.kv)
        if self.transceiver is not None:
            self.transceiver.received.pop(request_id, None)
        self.stats.aborted += 1
        return final

    def request_states(self) -> dict[int, str]:
        """Every live request's state name; a generation request whose KV is on the way shows
        its transport session state instead (RESERVED, REQUESTED, RECEIVING)."""
        t = self.transceiver
        out: dict[int, str] = {}
        for rid, r in self.live_requests().items():
            name = r.state.name
            if (t is not None and r.state == LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                    and rid not in t.draining):
                name = t.receive_state(rid) or name
            out[rid] = name
        return out

    def live_requests(self) -> dict[int, LlmRequest]:
        """Every request this worker holds (``lifecycle.live_requests``)."""
        t = self.transceiver
        if t is None:
            return lifecycle.live_requests(self.active, self.waiting)
        return lifecycle.live_requests(self.active, self.waiting, t.transmitting, t.draining)

    def _untrack(self, request_id: int) -> _Tracked | None:
        self.paused_since.pop(request_id, None)
        self._awaiting_fork.discard(request_id)
        tracked = self.tracked.pop(request_id, None)
        if tracked is not None and tracked.deadline is not None:
            self._num_deadlines -= 1
        return tracked

    def _expire_deadlines(self) -> list[WireUpdate]:
        if not self._num_deadlines:
            return []
        now = self._clock()
        expired = [rid for rid, t in self.tracked.items()
                   if t.deadline is not None and now >= t.deadline]
        updates = []
        for rid in expired:
            log.info("request %d: deadline exceeded, aborted", rid)
            update = self.abort(rid, reason="deadline")
            if update is not None:
                self.stats.deadlines_exceeded += 1
                updates.append(update)
        return updates

    def _time_left(self, request_id: int) -> float | None:
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.deadline is None:
            return None
        return tracked.deadline - self._clock()

    @property
    def has_work(self) -> bool:
        t = self.transceiver
        return bool(self.active or self.waiting or (t is not None and (t.transmitting or t.draining)))

    @property
    def num_free_blocks(self) -> int:
        return self.kv.get_num_free_blocks()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[WireUpdate]:
        updates: list[WireUpdate] = self._expire_deadlines()
        self.active.extend(self.waiting)
        self.waiting.clear()
        if self.transceiver is not None:
            updates.extend(self._poll_transfers())
        t0 = time.perf_counter()
        out = self.scheduler.schedule(self.active, set())
        self.stats.schedule_seconds += time.perf_counter() - t0
        self._pause(out.paused_requests)
        for request in out.fitting_disagg_gen_init_requests:
            self.transceiver.start_receive(request, self.kv,
                                           timeout_s=self._time_left(request.request_id))
        if out.fitting_disagg_gen_init_requests and self.flush_control is not None:
            self.flush_control()

        if self.paused_since:
            self._note_resumed(out.context_requests)
        for request in out.context_requests:
            if (request.llm_request_type == LlmRequestType.GENERATION_ONLY and request.num_pauses == 0
                    and request.context_current_position == 0):
                self.stats.unexpected_recomputes += 1
                log.error("request %d: generation-only request prefilled here without a pause",
                          request.request_id)
        computed = lifecycle.prepare_context_chunks(out.context_requests, self.kv)
        contexts = [(r, n) for r, n in zip(out.context_requests, computed) if n > 0]
        for request in out.generation_requests:
            if self._awaiting_fork and request.request_id in self._awaiting_fork:
                updates.extend(self._fork_received(request))
            lifecycle.prepare_generation_step(request, self.kv)

        if not contexts and not out.generation_requests:
            self.stats.steps += 1
            return updates
        streams = self._begin_streams(contexts, updates)
        try:
            tokens = self._forward_and_sample(contexts, out.generation_requests, streams)
        except BaseException:
            for request in streams:  # nothing will finish them: their sends must not wait
                self.transceiver.end_stream(request, "the step failed")
            raise

        for request, n in contexts:
            self.stats.context_tokens += n
            token, logprobs = tokens.get(request.request_id, (None, None))
            if lifecycle.complete_context_chunk(request, self.kv, token):
                tracked = self.tracked[request.request_id]
                firsts = tracked.choice_firsts
                if firsts is not None and not request.is_context_only_request:
                    self._awaiting_fork.discard(request.request_id)
                    samplers = tracked.choice_samplers
                    tracked.choice_samplers = tracked.choice_firsts = None
                    children = self._fork_choices(request, firsts, samplers, reported=False)
                    updates.append(self._after_token(request, token, logprobs))
                    for child, (first, lp) in zip(children, firsts):
                        updates.append(self._after_token(child, first, lp))
                else:
                    updates.append(self._after_token(request, token, logprobs))
        for request in out.generation_requests:
            token, logprobs = tokens[request.request_id]
            lifecycle.complete_generation_step(request, token)
            updates.append(self._after_token(request, token, logprobs))
        self.stats.steps += 1
        return updates

    def status(self, *, records: bool = True) -> dict:
        """A snapshot for GetClusterStatus: requests by state, KV blocks, transfers, pauses and
        the invariants a drained worker must satisfy (free + used == total; every block held by
        a live request)."""
        t = self.transceiver
        live = self.live_requests()
        by_state = lifecycle.count_by_state(live.values())
        free, used = self.kv.get_num_free_blocks(), self.kv.get_num_used_blocks()
        violations = []
        if free + used != self.kv.num_blocks:
            violations.append(f"free {free} + used {used} != total {self.kv.num_blocks}")
        orphans = [rid for rid in self.kv.sequence_ids() if rid not in live]
        if orphans:
            violations.append(f"blocks held by no live request: {sorted(orphans)[:10]}")
        ts = t.transfers if t is not None else None
        return {
            "requests_by_state": by_state,
            "num_active": len(self.active),
            "queue_depth": len(self.waiting),
            "free_blocks": free,
            "total_blocks": self.kv.num_blocks,
            "cached_blocks": self.kv.get_num_cached_blocks(),
            "pauses": self.stats.pauses,
            "queued_prefill_tokens": sum(
                r.prompt_len - r.context_current_position for r in (*self.waiting, *self.active)
                if r.state == LlmRequestState.CONTEXT_INIT),
            "unexpected_recomputes": self.stats.unexpected_recomputes,
            "steps": self.stats.steps,
            "finished": self.stats.finished,
            "aborted": self.stats.aborted,
            "deadlines_exceeded": self.stats.deadlines_exceeded,
            "quarantined_blocks": t.num_quarantined_blocks if t is not None else 0,
            "transfer_sessions": t.num_in_flight_sessions if t is not None else 0,
            # Per-request bookkeeping; all 0 on a drained worker (memory stays bounded).
            "tracked": len(self.tracked) + (len(t.received) if t is not None else 0),
            "transfers": {
                "sent": ts.sent, "received": ts.received, "failed": ts.failed,
                "leases_expired": ts.leases_expired, "bytes_sent": ts.bytes_sent,
                "bytes_received": ts.bytes_received, "seconds": ts.seconds,
                "outcomes": dict(ts.outcomes),
                **({"records": [r._asdict() for r in list(ts.records)[-64:]]} if records else {}),
            } if ts is not None else None,
            "violations": violations,
        }

    def _poll_transfers(self) -> list[WireUpdate]:
        # Block briefly only when nothing but receives is left to run (scheduling.md 1.4 step 2).
        waiting_only = bool(self.active) and all(
            r.state == LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS for r in self.active
        )
        failed = self.transceiver.poll(self.active, self.kv, wait_s=0.02 if waiting_only else 0.0)
        for request in self.active:
            if request.state == LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE:
                tracked = self.tracked[request.request_id]
                if not tracked.emitted:  # layer-wise: the first token came with the KV, and
                    # the router streamed it from the context worker already
                    tracked.emitted = list(request.context_phase_params.first_gen_tokens)
        updates = []
        for request, reason in failed:
            self.active.remove(request)
            self._untrack(request.request_id)
            log.warning("request %d: KV transfer failed: %s", request.request_id, reason)
            updates.append(WireUpdate.failed(request.request_id, ErrorKind.TRANSFER,
                                             f"KV transfer failed: {reason}"))
        return updates

    def _pause(self, paused: list[LlmRequest]) -> None:
        if not paused:
            return
        policy = self.config.capacity_scheduler_policy.name
        now = time.monotonic()
        for request in paused:
            rid = request.request_id
            blocks = len(self.kv.get_block_ids(rid)) if self.kv.has_sequence(rid) else 0
            self.events.pause(client=label(rid, request.client_id), policy=policy,
                              generated_tokens=request.get_num_tokens(0) - request.orig_prompt_len,
                              blocks_freed=blocks, pause_index=request.num_pauses + 1)
            self.paused_since[rid] = now
        lifecycle.pause_requests(paused, self.kv, self.max_input_len)
        self.stats.pauses += len(paused)
        self.stats.paused_request_ids.extend(r.request_id for r in paused)

    def _note_resumed(self, scheduled_contexts: list[LlmRequest]) -> None:
        """A paused request resumes when its recompute's first chunk is scheduled."""
        now = time.monotonic()
        for request in scheduled_contexts:
            since = self.paused_since.pop(request.request_id, None)
            if since is not None:
                self.events.resume(client=label(request.request_id, request.client_id),
                                   paused_seconds=now - since, pause_index=request.num_pauses,
                                   prefill_tokens=request.prompt_len)

    def _begin_streams(self, contexts: list[tuple[LlmRequest, int]],
                       updates: list[WireUpdate]) -> list[LlmRequest]:
        """Layer-wise context-only requests whose last chunk runs this step: lease their blocks
        now and tell the router (CONTEXT_STREAMING, delivered before the forward), so the
        generation side can ask for the KV while it is being written."""
        if self.transceiver is None or self.transceiver.sender is None:
            return []
        streams, early = [], []
        for request, n in contexts:
            rid = request.request_id
            if (self.tracked[rid].stream_kv and request.is_context_only_request
                    and request.context_current_position + n >= request.prompt_len):
                params = self.transceiver.begin_stream(request, self.kv,
                                                       lease_s=self._time_left(rid))
                streams.append(request)
                early.append(WireUpdate.context_streaming(rid, params))
        if early:
            if self.deliver_now is not None:
                self.deliver_now(early)
            else:
                updates.extend(early)
        return streams

    def _layer_done(self, stream_ids: list[int]) -> Callable[[int], None]:
        def on_layer(layers: int) -> None:  # the sends of the layers so far may start now
            self.transceiver.layers_written(stream_ids, layers, self._device)
            if self.layer_hook is not None:
                self.layer_hook(stream_ids, layers)
        return on_layer

    def _forward_and_sample(
        self, contexts: list[tuple[LlmRequest, int]], generation: list[LlmRequest],
        streams: Sequence[LlmRequest] = (),
    ) -> dict[int, tuple[int, TokenLogprobs | None]]:
        """One forward over the flat batch [context chunks..., decode tokens...]; returns the
        sampled token (and its logprobs, when asked) of every sequence that produces one this
        step."""
        input_ids: list[int] = []
        seqs: list[SeqBatchInfo] = []
        producing: list[tuple[int, LlmRequest]] = []  # (row in seqs, request)
        for request, n in contexts:
            pos = request.context_current_position
            start = len(input_ids)
            input_ids.extend(request.get_tokens(0)[pos : pos + n])
            seqs.append(SeqBatchInfo(start, n, pos, self._block_table(request.request_id, pos, n)))
            if pos + n >= request.prompt_len:
                producing.append((len(seqs) - 1, request))
        for request in generation:
            past = request.get_num_tokens(0) - 1
            seqs.append(
                SeqBatchInfo(len(input_ids), 1, past, self._block_table(request.request_id, past, 1))
            )
            input_ids.append(request.get_tokens(0)[-1])
            producing.append((len(seqs) - 1, request))

        stream_ids = [r.request_id for r in streams]
        on_layer = self._layer_done(stream_ids) if stream_ids else None

        # Context chunks whose request wants prompt logprobs need every row's logits.
        prompt_rows = [(request, seqs[i]) for i, (request, _) in enumerate(contexts)
                       if self.tracked[request.request_id].prompt_logprobs is not None]
        t0 = time.perf_counter()
        threads = None
        if self._step_threads is not None:
            threads = self._step_threads.threads_for(len(input_ids))
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)  # the calling thread's count, which the step uses
        ids = torch.tensor(input_ids, dtype=torch.long, device=self._device)
        logits = self.model.forward(ids, None, seqs, self.kv_pool, all_logits=bool(prompt_rows),
                                    on_layer=on_layer)  # [len(seqs), V], or [T, V]
        seconds = time.perf_counter() - t0
        self.stats.forward_seconds += seconds
        if threads is not None:
            self._step_threads.observe(len(input_ids), threads, seconds)
        if prompt_rows:
            full = logits
            last = torch.tensor([s.start + s.num_new_tokens - 1 for s in seqs], dtype=torch.long,
                                device=full.device)
            logits = full.index_select(0, last)
            for request, seq in prompt_rows:
                self._note_prompt_logprobs(request, full[seq.start:seq.start + seq.num_new_tokens],
                                           seq.past_len)
        if not producing:
            return {}
        rows = torch.tensor([row for row, _ in producing], dtype=torch.long, device=logits.device)
        picked = logits.index_select(0, rows)
        sequences = [r.get_tokens(0) for _, r in producing]
        sampled, logprobs = sample(picked, [self.tracked[r.request_id].sampler for _, r in producing],
                                   sequences)
        for i, (_, request) in enumerate(producing if self._awaiting_fork else ()):
            if request.request_id not in self._awaiting_fork:
                continue
            tracked = self.tracked[request.request_id]
            if tracked.choice_samplers is not None and request.is_context_init_state:
                # n / best_of: every candidate's first token from the one prefill's logits.
                row = picked[i:i + 1]
                tracked.choice_firsts = []
                for sampler in tracked.choice_samplers:
                    tok, lp = sample(row, [sampler], [sequences[i]])
                    tracked.choice_firsts.append((tok[0], lp[0]))
        return {r.request_id: (tok, lp) for (_, r), tok, lp in zip(producing, sampled, logprobs)}

    def _block_table(self, request_id: int, past: int, new: int) -> list[int]:
        """The block table the model reads this step: one entry per block of positions
        0 .. past + new - 1. Without a sliding window, or before any block was detached, that
        is the sequence's own table.

        With one (every layer attends to keys > q - W), the manager's live blocks stand for
        virtual blocks ``front ..`` (``front`` = blocks never allocated or detached). Entry v:
        - v >= front: ``live[v - front]``;
        - ``first`` <= v < front, where ``first`` is the block of the lowest position this step
          or a later one reads from the pool: ``live[(v - front) mod L]``, a ring over the live
          blocks. A chunked prefill of a prompt longer than the live blocks writes its early
          chunks there; the last L virtual blocks land exactly on the linear mapping, so the
          context's live blocks need no copy before decoding or a transfer.
        - v below both: the scratch block, written (several tokens may share a slot) and read
          only where nothing attends: under the window mask, or a prefill's positions no later
          query reaches (a first chunk attends its fresh K/V, not the pool).
        Exact because everything read unmasked maps to distinct slots holding its own K/V:
        [first, last] spans at most L blocks (checked), so no write clobbers a key that is still
        read; and pool contents are finite, so masked reads of other blocks weigh nothing."""
        live = self.kv.get_block_ids(request_id)
        if self.attention_window is None:
            return live
        front = self.kv.get_num_front_blocks_removed(request_id)
        if front == 0:
            return live
        B, L = self.kv.tokens_per_block, len(live)
        total = past + new
        last = (total - 1) // B
        # Queries of this step read keys > past - W from the pool (a first chunk reads none);
        # later queries (positions >= total) read keys > total - W.
        first = max(0, (past if past > 0 else total) - self.attention_window + 1) // B
        if first < front and last - first + 1 > L:
            raise RuntimeError(
                f"request {request_id}: the window of a {new}-token step at position {past} "
                f"spans {last - first + 1} blocks, more than the {L} live ones")
        end = last + 1
        table = [self._scratch_block] * min(first, front, end)
        table.extend(live[(v - front) % L] for v in range(len(table), min(front, end)))
        if end > front:
            table.extend(live[: end - front])
        return table

    def _note_prompt_logprobs(self, request: LlmRequest, rows: torch.Tensor, past: int) -> None:
        """Row j of ``rows`` predicted the token at position past + j + 1: a prompt token's
        logprob while that position is inside the original prompt."""
        tracked = self.tracked[request.request_id]
        k = tracked.params.prompt_logprobs
        tokens = request.get_tokens(0)
        end = min(rows.shape[0], request.orig_prompt_len - 1 - past)
        if end <= 0:
            return
        lp = torch.log_softmax(rows[:end].float(), dim=-1)
        entries = tracked.prompt_logprobs
        for j in range(end):
            position = past + j + 1
            if position - 1 == len(entries):  # each position once (a recompute repeats them)
                entries.append(token_logprobs(lp[j], tokens[position], k))

    def _after_token(self, request: LlmRequest, token: int,
                     logprobs: TokenLogprobs | None = None) -> WireUpdate:
        """Stop checks after a token was appended; finished requests free their KV."""
        tracked = self.tracked[request.request_id]
        self.stats.generated_tokens += 1
        generated = request.get_tokens(0)[request.orig_prompt_len :]
        if len(generated) <= len(tracked.emitted):
            # A pause clamped at max_input_len dropped tokens the client already has; the
            # regenerated position keeps what was streamed, so there is no duplicate or gap.
            token = tracked.emitted[len(generated) - 1]
            request.get_tokens(0)[-1] = token
            generated[-1] = token
        new = generated[len(tracked.emitted) :]
        tracked.emitted.extend(new)
        matcher = tracked.sampler.matcher
        if matcher is not None:
            matcher.accept(token)
        # Logprobs go with a token the client has not seen (a forced one was reported before).
        lps = (logprobs,) if logprobs is not None and new else None
        plps = None
        if tracked.prompt_logprobs is not None:  # sent once, with the first token
            plps, tracked.prompt_logprobs = tuple(tracked.prompt_logprobs), None
        reason = None
        if token in self.eos_token_ids and not tracked.params.ignore_eos:
            reason = "stop"
        elif matcher is not None and matcher.is_terminated():
            reason = "stop"  # the grammar is complete: nothing but EOS could follow
        elif token in tracked.params.stop_token_ids:
            reason = "stop"
        elif lifecycle.reached_max_tokens(request):
            reason = "length"
        rid, index = tracked.wire_id, tracked.index
        if request.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS and (
                reason in (None, "length") or tracked.choice_firsts is not None):
            # Context-only: the slot is freed now, the blocks stay leased for the generation side
            # (never past the request's deadline). With several candidates, every candidate's
            # first token goes along (new_token_ids[i] is candidate i's): the generation side
            # decides which of them ended.
            if tracked.choice_firsts is not None:
                new = list(new) + [t for t, _ in tracked.choice_firsts]
                if lps is not None:
                    lps = lps + tuple(lp for _, lp in tracked.choice_firsts)
            lease_s = self._time_left(request.request_id)
            self.active.remove(request)
            self._untrack(request.request_id)
            info = self._request_info(request)
            params = self.transceiver.hand_off(request, self.kv, token, lease_s=lease_s)
            return WireUpdate.context_done(rid, new, params, info, logprobs=lps,
                                           prompt_logprobs=plps)
        if self.transceiver is not None and request.request_id in self.transceiver.streaming:
            # A layer-wise context request that ended at its first token: its send may be in
            # flight, so its blocks are freed only once the data plane is quiet.
            tracked.finish_reason = reason
            self.active.remove(request)
            self._untrack(request.request_id)
            info = self._request_info(request)
            self.transceiver.end_stream(request, f"the request finished ({reason})")
            self.stats.finished += 1
            return WireUpdate.finished_with(rid, new, reason, info, logprobs=lps,
                                            prompt_logprobs=plps)
        if reason is None:
            received = self.transceiver.received if self.transceiver is not None else None
            if received and request.request_id in received:
                # The first decode after a receive tells the router how the KV arrived; the
                # finishing update then reports 0 bytes more (the router adds them up).
                return WireUpdate.tokens(rid, new, self._transfer_info(request),
                                         logprobs=lps, prompt_logprobs=plps, index=index)
            return WireUpdate.tokens(rid, new, logprobs=lps, prompt_logprobs=plps, index=index)
        tracked.finish_reason = reason
        self.active.remove(request)
        self._untrack(request.request_id)
        info = self._request_info(request)
        lifecycle.finish_request(request, self.kv, LlmRequestState.GENERATION_COMPLETE)
        self.stats.finished += 1
        open_choices = self._open_choices.get(rid)
        if open_choices is not None:
            if open_choices > 1:  # other candidates go on: this one's end is not the request's
                self._open_choices[rid] = open_choices - 1
                return WireUpdate.choice_done(rid, index, new, reason, info, logprobs=lps,
                                              prompt_logprobs=plps)
            del self._open_choices[rid]
        return WireUpdate.finished_with(rid, new, reason, info, logprobs=lps,
                                        prompt_logprobs=plps, index=index)

    def _request_info(self, request: LlmRequest) -> UpdateInfo:
        moved = self._transfer_info(request)
        return UpdateInfo(request.num_pauses, moved.kv_transfer_bytes, moved.kv_transfer_seconds,
                          moved.kv_transfer_blocks, request.prepopulated_prompt_len)

    def _transfer_info(self, request: LlmRequest) -> UpdateInfo:
        """What this request's receive moved, reported once (popped). ``kv_transfer_blocks`` is
        set only for a generation-only request whose receive completed: 0 blocks means its
        generation worker's cache already held the whole prompt."""
        got = self.transceiver.received.pop(request.request_id, None) if self.transceiver else None
        if got is None:
            return UpdateInfo()
        nbytes, seconds, blocks = got
        return UpdateInfo(kv_transfer_bytes=nbytes, kv_transfer_seconds=seconds,
                          kv_transfer_blocks=blocks)

"""Scheduling views of a KV pool: what the capacity scheduler reads of a pool, as one
NamedTuple of functions (``SchedulingView``), and the two ways of making one.

* ``build_scheduling_view(kv)``: the fast view of a ``KVCacheManager``, closures over its
  configuration and live state, read through the public accessors ``ViewSource`` names (this
  module imports nothing from kv_cache.py, which imports it: no import cycle). These closures
  are the only copy of the block formulas of scheduling.md 2.4, 2.6 and 2.7 (with the prefix
  credit of scheduling.md 2.9): the manager's estimate methods
  (``get_remaining_blocks_to_completion``, ``get_needed_blocks_one_step``) compute through
  one. Two closures repeat the one-beam, no-window case of ``blocks_to_completion`` inline for
  speed (``prompt_blocks_to_completion``, ``total_blocks_to_completion``); the capacity
  differential test holds them to it.
* ``public_scheduling_view(manager)``: the same view over any object with the public names of
  the contract (docs/design.md section 11), calling those names: a subclass, a test double.

``kv_cache.scheduling_view_of`` picks one of the two for a pool.

Pure Python, stdlib only.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, NamedTuple, Protocol, Sequence

from .kv_prefix_reuse import PrefixAnalyzer, PrefixReuseSummary
from .request import LlmRequest, LlmRequestState

_S = LlmRequestState
_CONTEXT_INIT = (_S.CONTEXT_INIT, _S.DISAGG_CONTEXT_INIT_AND_TRANS)
_GEN_IN_PROGRESS = (
    _S.GENERATION_IN_PROGRESS,
    _S.GENERATION_TO_COMPLETE,
    _S.DISAGG_GENERATION_TRANS_COMPLETE,
)
_NO_LIMIT = 1 << 62  # a token count no request reaches
_prompt_len = attrgetter("prompt_len")
_max_new_tokens = attrgetter("max_new_tokens")


class SequenceBlocks(Protocol):
    """What the fast view reads of one sequence a pool holds (``kv_cache._Sequence``)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def beams(self) -> Sequence[Sequence[int]]:
        """Each beam's block table (live window only); the view reads beam 0's length."""
        ...


class ViewSource(Protocol):
    """A KV pool as ``build_scheduling_view`` reads it (``KVCacheManager`` is one): its
    configuration, read once per view, and live state through two read-only accessors the view
    binds once per pass, so a request costs a dict lookup and no attribute walk.

    ``sequence_lookup`` is ``request_id -> SequenceBlocks | None`` over the live sequences; it
    must stay valid while the view lives (the manager hands out its dict's ``get``, and never
    replaces the dict). ``prefix_analyzer`` is the pool's one ``PrefixAnalyzer`` (its tree is
    never replaced either)."""

    @property
    def tokens_per_block(self) -> int: ...
    @property
    def sink_bubble_length(self) -> int: ...
    @property
    def max_attention_window(self) -> int | None: ...
    @property
    def temporary_attention_window(self) -> int: ...
    @property
    def max_token_num(self) -> int | None: ...
    @property
    def is_cross(self) -> bool: ...
    @property
    def is_variable_window(self) -> bool: ...
    @property
    def enable_block_reuse(self) -> bool: ...
    @property
    def sequence_lookup(self) -> Callable[[int], SequenceBlocks | None]: ...
    @property
    def prefix_analyzer(self) -> PrefixAnalyzer: ...

    def get_num_free_blocks(self) -> int: ...
    def scheduling_has_free_blocks(self, num_blocks: int) -> bool: ...
    def get_scheduling_num_free_blocks(self) -> int: ...


class SchedulingView(NamedTuple):
    """One KV pool as the capacity scheduler reads it for one scheduling pass: its block
    formulas (scheduling.md 2.4, 2.6), its prefix summary (scheduling.md 2.9) and its free
    counts, as functions a loop binds once per pass and calls once per request.

    ``prefix_summary(request)``
        ``analyze_prefix_reuse(tokens, request)`` with the request's tokens in this pool: its
        prompt (``request.tokens``), or for the view of a cross pool its encoder tokens.
    ``blocks_to_completion(request, summary=None)``
        ``get_remaining_blocks_to_completion``: GUARANTEED_NO_EVICT, the blocks the request still
        needs until it completes (scheduling.md 2.4), less the held matched blocks a first chunk
        is credited with; for a cross pool, the encoder output's blocks before the first chunk
        (scheduling.md 2.7).
    ``blocks_one_step(request, two_steps_look_ahead, summary=None)``
        ``get_needed_blocks_one_step``: MAX_UTILIZATION, the blocks the next step needs
        (scheduling.md 2.6), by the request's state: a context request's first chunk or a
        disaggregated generation-init request, its prompt (cross pool: encoder output) and
        drafts, less a context request's held matched blocks; a generating request, the block
        boundaries its next step (two with look-ahead) crosses (none in a cross pool); any
        other state, later context chunks included, 0.
    ``generation_step_blocks(request, two_steps_look_ahead)``
        ``blocks_one_step`` for a request known to be generating (generation in progress),
        without the dispatch on its state: the hot call of MAX_UTILIZATION.
    ``prompt_step_blocks(request, summary=None)``
        ``blocks_one_step`` for a request on its first context chunk or in generation-init,
        whose need look-ahead does not change (a public view asks without it).
    ``prompt_blocks_to_completion(request, summary=None)``
        ``blocks_to_completion`` for a context request on its first chunk (the caller has
        tested state and position).
    ``num_free_blocks()``
        ``get_num_free_blocks``: what GUARANTEED_NO_EVICT starts its budget from
        (scheduling.md 2.3).
    ``scheduling_has_free_blocks(num_blocks)``
        MAX_UTILIZATION's free test against the scheduling free count (scheduling.md 2.5),
        which only ``start_scheduling`` and ``scheduling_remove_sequence`` (called on the pool)
        move.
    ``scheduling_free_blocks``
        ``get_scheduling_num_free_blocks`` where the free test is exactly ``count >= num_blocks``
        (the fast view), so a loop may compare with the count it read after the last of those
        two calls instead of calling the test; None where the test must be called (a public
        view: a double sees every test).
    ``reuse_walk``
        whether prefix summaries mean anything here: block reuse on, one window size
        (scheduling.md 2.9).
    ``variable_window``
        the pool's ``is_variable_window``: prefix-aware skipping is off when a pool has one.
    ``generation_step_max``
        the most ``generation_step_blocks`` returns for a request of beam width 1 without draft
        tokens, (without, with) two-step look-ahead: a loop may count such a request at this
        bound and ask for its need only when the bound does not fit. None where every request
        must be asked (a public view: a double sees every call).
    ``total_blocks_to_completion(requests)``
        ``sum(blocks_to_completion(r) for r in requests)`` with the same effects, in one call
        (GUARANTEED_NO_EVICT's running requests); None on a public view.
    ``blocks_to_completion_bound(requests)``
        an upper bound of ``total_blocks_to_completion(requests)`` for requests of beam width 1,
        from their token counts alone (no effects, no sequence read); None on a public view.

    ``summary`` is the request's prefix summary; a formula computes it when None and a credit
    applies, and a public view passes it on only when not None. Each estimate sets
    ``request.estimated_reusable_tokens``: the credited prefix's matched tokens (free cached
    blocks included), else 0.

    Valid for one pass: a view copies the configuration (tokens per block, window, sink, reuse
    switches, pool kind) when it is made, so make one per pass. Sequences, the radix tree and the
    counters are read live.
    """

    prefix_summary: Callable[[LlmRequest], PrefixReuseSummary]
    blocks_to_completion: Callable[..., int]
    blocks_one_step: Callable[..., int]
    generation_step_blocks: Callable[[LlmRequest, bool], int]
    prompt_step_blocks: Callable[..., int]
    prompt_blocks_to_completion: Callable[..., int]
    num_free_blocks: Callable[[], int]
    scheduling_has_free_blocks: Callable[[int], bool]
    scheduling_free_blocks: Callable[[], int] | None
    reuse_walk: bool
    variable_window: bool
    generation_step_max: tuple[int, int] | None = None
    total_blocks_to_completion: Callable[[Sequence[LlmRequest]], int] | None = None
    blocks_to_completion_bound: Callable[[Sequence[LlmRequest]], int] | None = None


def build_scheduling_view(kv: ViewSource, *, encoder_tokens: bool = False) -> SchedulingView:
    """``kv``'s fast view: its configuration read once, into closure cells (a closure cell is
    read faster than an attribute, and these run for every request on every step). Changes
    nothing in the manager; the only effects are the estimates' own (see ``SchedulingView``) and
    the request's block-key cache. ``encoder_tokens``: the view of a cross pool, whose prefix
    summary analyzes the request's encoder tokens."""
    b = kv.tokens_per_block
    s = kv.sink_bubble_length
    # ceil((tokens + S) / B) == (tokens + round_up) // B: one addition instead of two negations.
    round_up = s + b - 1
    w = kv.max_attention_window
    temporary_window = kv.temporary_attention_window
    # The window's max token count; no window: more tokens than a request can have.
    max_token_num = kv.max_token_num if kv.max_token_num is not None else _NO_LIMIT
    # The most prompt tokens whose blocks a context keeps (W + the temporary window).
    ctx_window = w + temporary_window if w is not None else _NO_LIMIT
    is_cross = kv.is_cross
    variable_window = bool(kv.is_variable_window)
    # Held matched blocks are credited against a first chunk's need: one block key cannot stand
    # for blocks of several window-size pools, and a cross pool never reuses.
    reuse_credit = kv.enable_block_reuse and not variable_window and not is_cross
    seqs_get = kv.sequence_lookup  # bound once here: one dict lookup per request below
    prefix = kv.prefix_analyzer
    tree = prefix.tree  # never replaced; its version tells whether a cached summary is current
    key_ns = prefix.key_ns
    analyze = prefix.analyze
    summary_for = prefix.summary_for
    generation_init = _S.DISAGG_GENERATION_INIT
    context_init = _CONTEXT_INIT
    gen_in_progress = _GEN_IN_PROGRESS

    def prefix_summary(request: LlmRequest) -> PrefixReuseSummary:
        # The summary cached on the request is current while the tree's version is unchanged;
        # that test costs a few attribute reads, a walk happens only on a miss. An entry tagged
        # with a tree always holds a positive block count, so an empty request never hits.
        tokens = request.tokens
        n = len(tokens)
        cache = request.block_key_cache
        if cache is not None:
            entry = cache.get(key_ns)
            if (
                entry is not None
                and entry.tree is tree
                and entry.version == tree.version
                and entry.count == (n - 1) // b
                and entry.lora == request.lora_task_id
            ):
                return entry.summary  # type: ignore[return-value]
        return analyze(tokens, n, request)

    def encoder_prefix_summary(request: LlmRequest) -> PrefixReuseSummary:
        tokens = request.encoder_tokens
        return analyze(tokens, len(tokens), request)

    def blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        p = request.prompt_len
        # per_beam: the blocks one beam holds at completion; its context's full blocks are shared.
        if w is None:
            per_beam = (p + request.max_new_tokens + round_up) // b
        else:
            total_tokens = p + request.max_new_tokens
            per_beam = (min(total_tokens, w + temporary_window) + round_up) // b
            if total_tokens > w:
                max_blocks = -(-total_tokens // b)  # ceil
                if max_blocks > -(-request.get_num_tokens(0) // b) and max_blocks > per_beam:
                    per_beam += 1  # the window slides: a block is allocated before one is detached
        seq = seqs_get(request.request_id)
        beam = request.beam_width
        if seq is None:
            alloc = 0
        else:
            alloc = len(seq.beams[0])
            if beam == 1:
                # The return below for one beam; no credit, which needs nothing allocated.
                request.estimated_reusable_tokens = 0
                return per_beam - alloc
        reusable_ctx = 0
        if (
            alloc == 0
            and reuse_credit
            and request.state in context_init
            and request.context_current_position == request.prepopulated_prompt_len
        ):
            ctx_blocks = ((p if p < ctx_window else ctx_window) + s) // b  # full blocks only
            if summary is None:
                summary = summary_for(request)
            held = summary.reusable_blocks_allocated
            reusable_ctx = held if held < ctx_blocks else ctx_blocks
            # Free cached blocks save compute but not blocks: they already count as free.
            matched = summary.reusable_blocks_all
            request.estimated_reusable_tokens = (matched if matched < ctx_blocks else ctx_blocks) * b
        else:
            request.estimated_reusable_tokens = 0
        if beam == 1:
            return per_beam - reusable_ctx - alloc  # what the lines below give for one beam
        ctx_blocks = ((p if p < ctx_window else ctx_window) + s) // b
        eff_ctx = ctx_blocks - reusable_ctx
        if alloc < eff_ctx:
            # The beams share the context blocks still to allocate; each grows its own tail.
            return (eff_ctx - alloc) + (per_beam - ctx_blocks) * beam
        return (per_beam - reusable_ctx - alloc) * beam

    def generation_step_blocks(request: LlmRequest, two_steps_look_ahead: bool) -> int:
        # One block per beam for each block boundary the new tokens cross (one token plus the
        # drafts per step, at most what is left to generate); none once the window is full.
        request.estimated_reusable_tokens = 0
        seq = seqs_get(request.request_id)
        # TensorRT-LLM requires the sequence; without one, the request's own count stands in.
        cur = seq.num_tokens if seq is not None else request.get_num_tokens(0)
        drafts = request.draft_tokens
        add = len(drafts) + 1 if drafts else 1
        if two_steps_look_ahead:
            add += add
        nxt = cur + add
        last = request.prompt_len + request.max_new_tokens  # no more tokens than that
        if nxt > last:
            nxt = last
        if nxt > max_token_num:
            return 0
        return ((-cur) // b - (-nxt) // b) * request.beam_width  # ceil(nxt/B) - ceil(cur/B)

    # A cross pool holds the encoder output: allocated whole before the first context chunk, it
    # never grows (scheduling.md 2.7).
    def cross_blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        request.estimated_reusable_tokens = 0
        if request.state in context_init and request.context_current_position == 0:
            return -(-request.encoder_output_len // b)  # ceil
        return 0

    def cross_generation_step_blocks(request: LlmRequest, two_steps_look_ahead: bool) -> int:
        request.estimated_reusable_tokens = 0
        return 0

    to_completion = cross_blocks_to_completion if is_cross else blocks_to_completion
    generation_step = cross_generation_step_blocks if is_cross else generation_step_blocks

    def prompt_step_blocks(request: LlmRequest, summary: PrefixReuseSummary | None = None) -> int:
        # The prompt (cross pool: the encoder output) and draft tokens, capped by the window.
        length = request.encoder_output_len if is_cross else request.prompt_len
        drafts = request.draft_tokens
        if drafts:
            length += len(drafts)
        if w is not None:
            # TensorRT-LLM names max_new_tokens "chunkSize" here.
            length = min(length, w + request.max_new_tokens)
        length += s
        shared = length // b
        # The last partial block is written by every beam, so each beam gets its own.
        need = shared + (request.beam_width if length % b else 0)
        if reuse_credit and request.state != generation_init:
            if summary is None:
                summary = summary_for(request)
            held = summary.reusable_blocks_allocated
            need -= held if held < shared else shared
            matched = summary.reusable_blocks_all
            request.estimated_reusable_tokens = (matched if matched < shared else shared) * b
        else:
            request.estimated_reusable_tokens = 0
        return need

    def blocks_one_step(
        request: LlmRequest, two_steps_look_ahead: bool, summary: PrefixReuseSummary | None = None
    ) -> int:
        state = request.state
        if state == generation_init or (
            state in context_init
            and request.context_current_position == request.prepopulated_prompt_len
        ):
            return prompt_step_blocks(request, summary)
        if state in gen_in_progress:
            return generation_step(request, two_steps_look_ahead)
        request.estimated_reusable_tokens = 0  # later context chunks: their blocks are held
        return 0

    def prompt_blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        if w is not None or not reuse_credit or request.beam_width != 1 or seqs_get(
            request.request_id
        ) is not None:
            return blocks_to_completion(request, summary)
        # blocks_to_completion's credited return for one beam, no window, nothing allocated.
        p = request.prompt_len
        ctx_blocks = (p + s) // b
        if summary is None:
            summary = summary_for(request)
        held = summary.reusable_blocks_allocated
        matched = summary.reusable_blocks_all
        request.estimated_reusable_tokens = (matched if matched < ctx_blocks else ctx_blocks) * b
        return (p + request.max_new_tokens + round_up) // b - (
            held if held < ctx_blocks else ctx_blocks
        )

    def total_blocks_to_completion(requests: Sequence[LlmRequest]) -> int:
        if w is not None:
            return sum([blocks_to_completion(request) for request in requests])
        total = 0
        for request in requests:
            seq = seqs_get(request.request_id)
            if seq is not None and request.beam_width == 1:
                # blocks_to_completion's beam-1 return without a window, inline: a running
                # request's case.
                request.estimated_reusable_tokens = 0
                total += (request.prompt_len + request.max_new_tokens + round_up) // b - len(
                    seq.beams[0]
                )
            else:
                total += blocks_to_completion(request)
        return total

    def blocks_to_completion_bound(requests: Sequence[LlmRequest]) -> int:
        # One beam holds per_beam <= (P + N + round_up) // B blocks at completion (one more
        # while a window slides) and nothing held or credited is negative; a sum of floors is
        # at most the floor of the sum.
        n = len(requests)
        tokens = sum(map(_prompt_len, requests)) + sum(map(_max_new_tokens, requests))
        return (tokens + n * round_up) // b + (n if w is not None else 0)

    return SchedulingView(
        encoder_prefix_summary if encoder_tokens else prefix_summary,
        to_completion,
        blocks_one_step,
        generation_step,
        prompt_step_blocks,
        to_completion if is_cross else prompt_blocks_to_completion,
        kv.get_num_free_blocks,
        kv.scheduling_has_free_blocks,
        kv.get_scheduling_num_free_blocks,
        bool(kv.enable_block_reuse) and not variable_window,
        variable_window,
        # ceil(nxt / B) - ceil(cur / B) <= ceil((nxt - cur) / B): one step adds one token, two
        # add two; a cross pool never grows.
        (0, 0) if is_cross else (1, 1 if b > 1 else 2),
        None if is_cross else total_blocks_to_completion,
        None if is_cross else blocks_to_completion_bound,
    )


def public_scheduling_view(manager: Any, *, encoder_tokens: bool = False) -> SchedulingView:
    """The view of any KV pool through the public names of the contract, looked up when called,
    so a subclass's overrides and a double's recorders see every call. ``summary`` is passed on
    only when it is not None, so the two-argument signatures of the contract suffice when no
    summary exists. ``encoder_tokens``: the view of a cross pool (the encoder tokens are
    analyzed)."""

    def prefix_summary(request: LlmRequest) -> PrefixReuseSummary:
        tokens = request.encoder_tokens if encoder_tokens else request.get_tokens(0)
        return manager.analyze_prefix_reuse(tokens, request)

    def blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        if summary is None:
            return manager.get_remaining_blocks_to_completion(request)
        return manager.get_remaining_blocks_to_completion(request, summary)

    def blocks_one_step(
        request: LlmRequest, two_steps_look_ahead: bool, summary: PrefixReuseSummary | None = None
    ) -> int:
        if summary is None:
            return manager.get_needed_blocks_one_step(request, two_steps_look_ahead)
        return manager.get_needed_blocks_one_step(request, two_steps_look_ahead, summary)

    def generation_step_blocks(request: LlmRequest, two_steps_look_ahead: bool) -> int:
        return manager.get_needed_blocks_one_step(request, two_steps_look_ahead)

    def prompt_step_blocks(request: LlmRequest, summary: PrefixReuseSummary | None = None) -> int:
        return blocks_one_step(request, False, summary)

    def num_free_blocks() -> int:
        return manager.get_num_free_blocks()

    def scheduling_has_free_blocks(num_blocks: int) -> bool:
        return manager.scheduling_has_free_blocks(num_blocks)

    variable_window = bool(manager.is_variable_window)
    return SchedulingView(
        prefix_summary,
        blocks_to_completion,
        blocks_one_step,
        generation_step_blocks,
        prompt_step_blocks,
        blocks_to_completion,
        num_free_blocks,
        scheduling_has_free_blocks,
        None,
        bool(manager.enable_block_reuse) and not variable_window,
        variable_window,
    )

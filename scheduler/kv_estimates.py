"""Scheduling estimates of a ``KVCacheManager``: the block formulas of reference 2.4 and 2.6
(with the prefix credit of 2.9) that the capacity scheduler reads.

The formulas live in ``SchedulingView``, the public fast view the capacity scheduler's hot loops
read (``KVCacheManager.scheduling_view``); the manager's estimate methods
(``SchedulingEstimatesMixin``, which ``KVCacheManager`` inherits) compute through it.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from .kv_prefix_reuse import PrefixReuseSummary
from .request import LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from .kv_cache import KVCacheManager

_S = LlmRequestState
_CONTEXT_INIT = (_S.CONTEXT_INIT, _S.DISAGG_CONTEXT_INIT_AND_TRANS)
_GEN_IN_PROGRESS = (
    _S.GENERATION_IN_PROGRESS,
    _S.GENERATION_TO_COMPLETE,
    _S.DISAGG_GENERATION_TRANS_COMPLETE,
)


class SchedulingView(NamedTuple):
    """The public fast view of one ``KVCacheManager`` that the capacity scheduler's hot loops
    read: the manager's block formulas (reference 2.4, 2.6) and its prefix summary (2.9), as
    functions a loop binds once per pass and calls once per request.

    These functions are the only copy of the formulas: ``get_remaining_blocks_to_completion``
    and ``get_needed_blocks_one_step`` compute through a view. They are closures over the
    manager's configuration rather than methods because a closure cell is read faster than an
    attribute, and they run for every request on every step.

    Invariants:
    * valid for one scheduling pass: the configuration (tokens per block, window, sink, reuse
      switches, pool kind) is copied when the view is made (``KVCacheManager.scheduling_view``),
      so a view must not outlive a change of those attributes; make one per pass.
    * sequences and the radix tree are read live, so a view stays exact while sequences are
      added, grown or removed. The scheduling counters are not part of it: read
      ``get_scheduling_num_free_blocks``, which only ``start_scheduling`` and
      ``scheduling_remove_sequence`` move.
    * the functions change nothing in the manager; their only effects are those of the manager's
      methods: ``request.estimated_reusable_tokens`` and the request's block-key cache.

    ``prefix_summary(request)``
        ``analyze_prefix_reuse(request.tokens, request)``: the prompt's summary in this pool;
        one cached on the request costs a few reads.
    ``blocks_to_completion(request, summary=None)``
        GUARANTEED_NO_EVICT: the blocks the request still needs until it completes (2.4), less
        the held matched blocks a first chunk is credited with.
    ``prompt_step_blocks(request, summary=None)``
        MAX_UTILIZATION: the blocks the next step needs for a context request's first chunk or a
        disaggregated generation-init request (2.6), less a context request's held matched blocks.
    ``generation_step_blocks(request, two_steps_look_ahead)``
        MAX_UTILIZATION: the blocks a generating request's next step (two with look-ahead) needs
        (2.6).

    ``summary`` is the request's prefix summary, computed when None and a credit applies. Each
    estimate sets ``request.estimated_reusable_tokens``: the credited prefix's matched tokens
    (free cached blocks included), else 0.
    """

    prefix_summary: Callable[[LlmRequest], PrefixReuseSummary]
    blocks_to_completion: Callable[..., int]
    prompt_step_blocks: Callable[..., int]
    generation_step_blocks: Callable[[LlmRequest, bool], int]


def _build_scheduling_view(kv: KVCacheManager) -> SchedulingView:
    """``kv``'s SchedulingView: its configuration read once, into closure cells."""
    b = kv.tokens_per_block
    s = kv.sink_bubble_length
    # ceil((tokens + S) / B) == (tokens + round_up) // B: one addition instead of two negations.
    round_up = s + b - 1
    w = kv.max_attention_window
    temporary_window = kv.temporary_attention_window
    max_token_num = kv.max_token_num
    is_cross = kv.is_cross
    # Held matched blocks are credited against a first chunk's need: one block key cannot stand
    # for blocks of several window-size pools, and a cross pool never reuses.
    reuse_credit = kv.enable_block_reuse and not kv.is_variable_window and not is_cross
    seqs_get = kv._seqs.get
    tree = kv._tree  # never replaced; its version tells whether a cached summary is current
    key_ns = kv._key_ns
    analyze = kv._analyze
    summary_for = kv._summary_for
    generation_init = _S.DISAGG_GENERATION_INIT

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

    def blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        request.estimated_reusable_tokens = 0
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
        if seq is not None and request.beam_width == 1:
            # The beam-1 return below; no credit, which needs nothing allocated yet.
            return per_beam - len(seq.beams[0])
        alloc = 0 if seq is None else len(seq.beams[0])
        ctx_tokens = p if w is None else min(p, w + temporary_window)
        ctx_blocks = (ctx_tokens + s) // b  # full blocks only

        reusable_ctx = 0
        if (
            alloc == 0
            and reuse_credit
            and request.state in _CONTEXT_INIT
            and request.context_current_position == request.prepopulated_prompt_len
        ):
            if summary is None:
                summary = summary_for(request)
            held = summary.reusable_blocks_allocated
            reusable_ctx = held if held < ctx_blocks else ctx_blocks
            # Free cached blocks save compute but not blocks: they already count as free.
            matched = summary.reusable_blocks_all
            estimated = (matched if matched < ctx_blocks else ctx_blocks) * b
            request.estimated_reusable_tokens = estimated

        beam = request.beam_width
        if beam == 1:
            return per_beam - reusable_ctx - alloc  # what both lines below give for one beam
        eff_ctx = ctx_blocks - reusable_ctx
        if alloc < eff_ctx:
            # The beams share the context blocks still to allocate; each grows its own tail.
            return (eff_ctx - alloc) + (per_beam - ctx_blocks) * beam
        return (per_beam - reusable_ctx - alloc) * beam

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
        estimated = 0
        if reuse_credit and request.state != generation_init:
            if summary is None:
                summary = summary_for(request)
            held = summary.reusable_blocks_allocated
            need -= held if held < shared else shared
            matched = summary.reusable_blocks_all
            estimated = (matched if matched < shared else shared) * b
        request.estimated_reusable_tokens = estimated
        return need

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
            add *= 2
        add_max = request.max_new_tokens - (cur - request.prompt_len)
        if add_max < add:
            add = add_max
        nxt = cur + add
        if max_token_num is not None and nxt > max_token_num:
            return 0
        return ((-cur) // b - (-nxt) // b) * request.beam_width  # (ceil(nxt/B) - ceil(cur/B))

    if not is_cross:
        return SchedulingView(
            prefix_summary, blocks_to_completion, prompt_step_blocks, generation_step_blocks
        )

    # A cross pool holds the encoder output: allocated whole before the first context chunk,
    # it never grows.
    def cross_blocks_to_completion(
        request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        request.estimated_reusable_tokens = 0
        if request.state in _CONTEXT_INIT and request.context_current_position == 0:
            return -(-request.encoder_output_len // b)  # ceil
        return 0

    def cross_generation_step_blocks(request: LlmRequest, two_steps_look_ahead: bool) -> int:
        request.estimated_reusable_tokens = 0
        return 0

    return SchedulingView(
        prefix_summary, cross_blocks_to_completion, prompt_step_blocks, cross_generation_step_blocks
    )


class SchedulingEstimatesMixin:
    """``KVCacheManager``'s estimate methods: each computes through a ``SchedulingView``, the only
    copy of the formulas."""

    # ---- block estimates (reference 2.4, 2.6) -------------------------------------------------
    def scheduling_view(self) -> SchedulingView:
        """The public fast view of this manager for one scheduling pass (``SchedulingView``)."""
        return _build_scheduling_view(self)

    def get_remaining_blocks_to_completion(
        self, request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        """GUARANTEED_NO_EVICT estimate of the blocks the request still needs (reference 2.4);
        the formula is ``SchedulingView.blocks_to_completion``."""
        return self.scheduling_view().blocks_to_completion(request, summary)

    def get_needed_blocks_one_step(
        self,
        request: LlmRequest,
        two_steps_look_ahead: bool,
        summary: PrefixReuseSummary | None = None,
    ) -> int:
        """MAX_UTILIZATION estimate of the blocks the next step needs (reference 2.6); the
        formulas are ``SchedulingView.prompt_step_blocks`` and ``generation_step_blocks``."""
        state = request.state
        if state == _S.DISAGG_GENERATION_INIT or (
            state in _CONTEXT_INIT and request.is_first_context_chunk
        ):
            return self.scheduling_view().prompt_step_blocks(request, summary)
        if state in _GEN_IN_PROGRESS:
            return self.scheduling_view().generation_step_blocks(request, two_steps_look_ahead)
        request.estimated_reusable_tokens = 0  # later context chunks: their blocks are held
        return 0

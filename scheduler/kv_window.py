"""A KV manager for a model whose every layer attends a sliding window of W tokens.

The base ``KVCacheManager`` already detaches blocks the window has passed (TensorRT-LLM's
front-block removal); this subclass adds what a real pool of such a model needs on top:

- the block table a forward reads (``block_table``): the live blocks stand for the virtual
  blocks from ``front`` on, a ring over them for a long prompt's early chunks, and one scratch
  block (the pool's last, outside this manager) for positions nothing reads unmasked;
- estimates that match how this manager allocates (TensorRT-LLM's formulas assume a cyclic
  window, scheduling.md 2.4 and 2.6): a prompt past W + T reuses no cached prefix, a decode
  past W detaches before it allocates, and a request whose other n/best_of candidates are still
  to fork off is charged for each (``LlmRequest.pending_forks``).

The capacity scheduler reads it through the public names (``scheduling_view_of`` gives a
subclass the public view), so nothing is patched onto an instance. Pure Python, stdlib only.
"""
from __future__ import annotations

from .kv_cache import KVCacheManager
from .kv_prefix_reuse import PrefixReuseSummary
from .request import LlmRequest, LlmRequestState

_NO_REUSE = PrefixReuseSummary(0, 0, None)


class SlidingWindowKVCacheManager(KVCacheManager):
    """``num_blocks`` managed blocks; ``scratch_block`` is the pool block past them (never
    allocated). ``max_num_tokens``: the most tokens one step's chunk holds. T, the temporary
    window, is that rounded up to whole blocks plus one block for misalignment, so a prompt's
    live blocks hold every key its chunks and its first decode read."""

    def __init__(self, num_blocks: int, tokens_per_block: int, *, attention_window: int,
                 max_num_tokens: int, scratch_block: int, enable_block_reuse: bool = False) -> None:
        if attention_window <= 0 or num_blocks < 1:
            raise ValueError("a sliding window needs W > 0 and a pool of at least 2 blocks")
        B = tokens_per_block
        super().__init__(num_blocks, B, enable_block_reuse=enable_block_reuse,
                         max_attention_window=attention_window,
                         temporary_attention_window=-(-max_num_tokens // B) * B + B)
        self.attention_window = attention_window
        self.scratch_block = scratch_block

    @property
    def _held_tokens(self) -> int:
        """The most prompt tokens whose blocks a context keeps (W + T)."""
        return self.attention_window + self.temporary_attention_window

    def blocks_to_completion_bound(self, prompt_len: int, max_new_tokens: int,
                                   candidates: int = 1) -> int:
        B, w = self.tokens_per_block, self.attention_window
        total = prompt_len + max_new_tokens
        blocks = -(-min(total, self._held_tokens) // B)
        if total > w and -(-total // B) > max(-(-prompt_len // B), blocks):
            blocks += 1  # the window slides: a block is allocated before one is detached
        return blocks * max(1, candidates)

    def block_table(self, request_id: int, past: int, new: int) -> list[int]:
        """The block table a step of ``new`` tokens at position ``past`` reads; one entry per
        block of positions 0 .. past + new - 1. Entry v:
        - v >= front (blocks never allocated or detached): ``live[v - front]``;
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
        live = self.get_block_ids(request_id)
        front = self.get_num_front_blocks_removed(request_id)
        if front == 0:
            return live
        B, L = self.tokens_per_block, len(live)
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
        table = [self.scratch_block] * min(first, front, end)
        table.extend(live[(v - front) % L] for v in range(len(table), min(front, end)))
        if end > front:
            table.extend(live[: end - front])
        return table

    # ---- estimates ---------------------------------------------------------------------------
    def analyze_prefix_reuse(self, tokens, request: LlmRequest) -> PrefixReuseSummary:
        """No cached prefix is reused for a prompt past W + T: the scheduler must neither credit
        one (a step would run out of blocks, or past max_num_tokens) nor hold the request back
        for one to be stored (prefix-aware skipping)."""
        if len(tokens) > self._held_tokens:
            return _NO_REUSE
        return super().analyze_prefix_reuse(tokens, request)

    def get_remaining_blocks_to_completion(self, request: LlmRequest, summary=None) -> int:
        """GUARANTEED_NO_EVICT's estimate. TensorRT-LLM's (scheduling.md 2.4) credits a cached
        prefix this manager does not reuse (a prompt past W + T), and counts blocks shared with
        another sequence (a reused prefix, n > 1's fork) as held for good, while the window
        detaches them from one holder, which then allocates anew. Here a sequence is charged
        its whole peak (the formula's per-beam blocks, no reuse credit) less only the blocks it
        alone holds, so the running sequences' peaks always fit the pool."""
        if request.prompt_len > self._held_tokens:
            summary = _NO_REUSE  # no reuse, so no compute credit either
        # Called for its estimated_reusable_tokens too (the chunk's compute credit).
        formula = super().get_remaining_blocks_to_completion(request, summary)
        if request.beam_width != 1:
            return formula
        B, w = self.tokens_per_block, self.attention_window
        total = request.prompt_len + request.max_new_tokens
        peak = -(-min(total, self._held_tokens) // B)
        if total > w and -(-total // B) > max(-(-request.get_num_tokens(0) // B), peak):
            peak += 1  # the window slides: a block is allocated before one is detached
        rid = request.request_id
        if not request.is_context_only_request:
            peak *= request.pending_forks
        own = 0
        if self.has_sequence(rid):
            own = sum(1 for block in self.get_block_ids(rid) if self.get_ref_count(block) == 1)
        return max(0, peak - own)

    def get_needed_blocks_one_step(self, request: LlmRequest, two_steps_look_ahead: bool,
                                   summary=None) -> int:
        """MAX_UTILIZATION's next-step need, as this manager allocates. TensorRT-LLM's formula
        (scheduling.md 2.6) caps a first chunk at W + max_new_tokens and counts nothing for a
        decode past W. This manager holds min(P, W + T) tokens of a prompt (no reuse past
        W + T) and a decode opens a block at every boundary after detaching what the window
        left. Short counts would let a step run out of blocks halfway; these are exact (a
        decode's net need) or over."""
        B, w = self.tokens_per_block, self.attention_window
        held = self._held_tokens
        rid = request.request_id
        formula = super().get_needed_blocks_one_step
        if request.beam_width != 1:
            return formula(request, two_steps_look_ahead, summary)  # beams never detach
        if request.state == LlmRequestState.DISAGG_GENERATION_INIT or (
                request.is_context_init_state
                and request.context_current_position == request.prepopulated_prompt_len):
            p = request.prompt_len
            if p > held:
                formula(request, two_steps_look_ahead, _NO_REUSE)  # (sets the compute credit)
                return -(-held // B)
            # TensorRT-LLM's count of min(P, W + max_new) tokens, less its reuse credit, raised
            # to the P tokens allocated.
            return (formula(request, two_steps_look_ahead, summary)
                    + -(-p // B) - -(-min(p, w + request.max_new_tokens) // B))
        if request.is_context_init_state or not self.has_sequence(rid):
            return formula(request, two_steps_look_ahead, summary)  # a later chunk: nothing
        cur = self.get_num_tokens(rid)
        if two_steps_look_ahead:
            return -(-(cur + 2) // B) - -(-cur // B)  # without what the window frees
        n = cur + 1
        if (n - 1) % B:
            return 0
        live = self.get_block_ids(rid)
        front = self.get_num_front_blocks_removed(rid)
        freed = 0  # add_token's detach, before it allocates
        for i, block in enumerate(live):
            if n - (front + i) * B < w + B:
                break
            freed += self.get_ref_count(block) == 1
        return max(0, 1 - freed)

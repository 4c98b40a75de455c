"""Paged KV block accounting with TensorRT-LLM semantics (scheduling.md 2.4-2.9).

Block accounting only: no tensors. Block ids are ints in [0, num_blocks); a torch KV pool is
indexed by them. One attention-window size per manager (``is_variable_window`` is False).

Invariants:
* every block is exactly one of: plain free, free cached (ref 0, in the reuse tree, evictable in
  LRU order), used (ref > 0). ``free + used == num_blocks``.
* a block's ref count is the number of live sequences holding it; a sequence holds each of its
  distinct blocks once, whatever its beam width (full prompt blocks are shared by the beams).
* the reuse tree holds only full blocks of the first P - 1 prompt tokens (scheduling.md 2.9).
* allocation takes plain free blocks first, then evicts free cached blocks LRU; evicting a block
  uncaches its subtree (radix_tree.py), so no tree entry becomes unreachable.
* the scheduling simulation (start_scheduling / scheduling_remove_sequence /
  scheduling_has_free_blocks) never touches real state. Scheduling ref counts are copied lazily
  per block (epoch stamp), so a scheduling round costs O(blocks of the removed sequences).

Two concerns live beside the manager, not in it: its prefix analysis (the block keys cached
on a request and the tree walk, scheduling.md 2.9) is a ``PrefixAnalyzer`` it owns
(kv_prefix_reuse.py), and its block estimates (scheduling.md 2.4, 2.6) are the closures of
``kv_estimates.build_scheduling_view``, the only copy of the formulas, which the estimate methods
below call. ``scheduling_view_of`` picks the view the capacity scheduler reads a pool through.

Choices where TensorRT-LLM is silent (scheduling.md 2.3, 2.9): ``remove_sequence`` of an
unknown id is a no-op returning False; a cross manager never reuses blocks (reuse on a cross
manager is rejected); sliding-window front-block detaching applies to beam width 1 only.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from .kv_estimates import SchedulingView, build_scheduling_view, public_scheduling_view
from .kv_events import BlocksStored, KVEventLog
from .kv_prefix_reuse import PrefixAnalyzer, PrefixReuseSummary
from .radix_tree import BlockKey, RadixTree
from .request import LlmRequest


class KVCacheStats(NamedTuple):
    total: int
    free: int
    used: int
    cached: int
    reused: int


class KVCacheOutOfBlocksError(RuntimeError):
    """Not enough free blocks (after evicting free cached ones); nothing was allocated."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Sequence:
    """Blocks one request holds. ``beams[b]`` is beam b's block table (live window only);
    ``blocks`` lists each distinct held block once (one ref each), in allocation order. For beam
    width 1 both are the same list object."""

    __slots__ = ("beam_width", "num_tokens", "beams", "blocks", "front_removed")

    def __init__(self, beam_width: int, num_tokens: int, beams: list[list[int]],
                 blocks: list[int], front_removed: int) -> None:
        self.beam_width = beam_width
        self.num_tokens = num_tokens
        self.beams = beams
        self.blocks = blocks
        self.front_removed = front_removed


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        *,
        max_attention_window: int | None = None,
        enable_block_reuse: bool = False,
        sink_token_length: int = 0,
        num_blocks_secondary: int = 0,
        is_cross: bool = False,
        temporary_attention_window: int = 0,
    ) -> None:
        if num_blocks < 0 or tokens_per_block <= 0:
            raise ValueError("num_blocks must be >= 0 and tokens_per_block > 0")
        if max_attention_window is not None and max_attention_window <= 0:
            raise ValueError("max_attention_window must be positive or None")
        if sink_token_length < 0 or temporary_attention_window < 0:
            raise ValueError("sink_token_length and temporary_attention_window must be >= 0")
        if is_cross and enable_block_reuse:
            raise ValueError("block reuse is not supported for a cross KV cache manager")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.max_attention_window = max_attention_window
        self.enable_block_reuse = enable_block_reuse
        self.is_variable_window = False
        self.sink_token_length = sink_token_length
        # Accepted for interface parity; there is no secondary (offload) pool here.
        self.num_blocks_secondary = num_blocks_secondary
        self.is_cross = is_cross
        self.temporary_attention_window = temporary_attention_window
        self.num_reused_blocks = 0

        rem = sink_token_length % tokens_per_block
        # S: padding that makes the sink tokens fill whole blocks.
        self.sink_bubble_length = 0 if rem == 0 else tokens_per_block - rem
        # The window's max token count (W + S); None = unlimited.
        self.max_token_num = (
            None if max_attention_window is None else max_attention_window + self.sink_bubble_length
        )

        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # stack: pops 0, 1, 2, ... first
        # With block reuse, what the prefix cache does is reported as KV events (the router keeps
        # an exact index of every worker's cache from them; scheduler/kv_events.py).
        self.kv_events: KVEventLog | None = KVEventLog() if enable_block_reuse else None
        self._tree = RadixTree(self.kv_events)
        self._prefix = PrefixAnalyzer(tokens_per_block, is_cross, self._tree)
        self._seqs: dict[int, _Sequence] = {}

        # Scheduling simulation: per-block counts are valid only if stamped with the epoch.
        self._sched_epoch = 0
        self._sched_stamp = [0] * num_blocks
        self._sched_refs = [0] * num_blocks
        self._sched_free = num_blocks
        self._sched_removed: set[int] = set()

    # ---- what the fast scheduling view reads (kv_estimates.ViewSource) ------------------------
    @property
    def sequence_lookup(self) -> Callable[[int], _Sequence | None]:
        """A request id's live sequence, or None: the sequence dict's own ``get``, which a
        scheduling view binds once per pass (the dict is never replaced, so the bound method
        stays current). For reading only: the view reads ``num_tokens`` and ``beams``."""
        return self._seqs.get

    @property
    def prefix_analyzer(self) -> PrefixAnalyzer:
        """This pool's one ``PrefixAnalyzer`` (never replaced): the block keys cached on a
        request and the tree walk, for a scheduling view's prefix summaries."""
        return self._prefix

    # ---- queries ------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free) + self._tree.num_free_cached

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - self.get_num_free_blocks()

    def get_num_cached_blocks(self) -> int:
        return self._tree.num_cached

    def use_event_log(self, log: KVEventLog | None) -> None:
        """Report KV events to ``log`` from now on (None: not at all). For benchmarks and tests;
        a worker keeps the log it was built with."""
        self.kv_events = log
        self._tree.events = log

    def cached_leading_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` (``radix_tree.prompt_block_keys``) this cache holds now: the
        exact answer a router's prefix index approximates from events (an oracle for tests and
        the simulator)."""
        return len(self._tree.match(keys))

    def kv_snapshot(self) -> list[BlocksStored]:
        """The whole prefix cache as ``BlocksStored`` events, parents first (see kv_events)."""
        return self._tree.snapshot()

    def sequence_ids(self) -> list[int]:
        """Ids of every request that holds blocks (for leak checks)."""
        return list(self._seqs)

    def has_sequence(self, request_id: int) -> bool:
        return request_id in self._seqs

    def get_block_ids(self, request_id: int, beam: int = 0) -> list[int]:
        return list(self._get_seq(request_id).beams[beam])

    def get_num_allocated_blocks(self, request_id: int) -> int:
        seq = self._seqs.get(request_id)
        return 0 if seq is None else len(seq.beams[0])

    def get_num_tokens(self, request_id: int) -> int:
        return self._get_seq(request_id).num_tokens

    def get_num_front_blocks_removed(self, request_id: int) -> int:
        """Blocks detached from the front by the sliding window (beam-0 table starts there)."""
        return self._get_seq(request_id).front_removed

    def block_table(self, request_id: int, past: int, new: int) -> list[int]:
        """The block table a forward of ``new`` tokens at position ``past`` reads: with full
        attention, the sequence's own blocks (a windowed manager maps detached positions)."""
        return self.get_block_ids(request_id)

    def blocks_to_completion_bound(self, prompt_len: int, max_new_tokens: int,
                                   candidates: int = 1) -> int:
        """The most blocks the capacity scheduler asks to be free for one fresh request (or its
        recompute) in an otherwise empty pool, without reuse credit (a cache may not keep it):
        GUARANTEED_NO_EVICT's estimate (scheduling.md 2.4), which bounds MAX_UTILIZATION's
        first-chunk need too. More than the pool: the request would wait forever. Full
        attention charges n/best_of candidates nothing more: they share the prompt's blocks
        and each is charged its own growth as it runs."""
        return -(-(prompt_len + max_new_tokens) // self.tokens_per_block)

    def get_ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def get_stats(self) -> KVCacheStats:
        free = self.get_num_free_blocks()
        return KVCacheStats(
            self.num_blocks, free, self.num_blocks - free, self._tree.num_cached,
            self.num_reused_blocks,
        )

    def _get_seq(self, request_id: int) -> _Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no KV sequence for request {request_id}")
        return seq

    # ---- block pool ---------------------------------------------------------------------------
    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, released = self._tree.evict_lru()
            self._free.extend(released)
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        refs = self._refs
        refs[block] -= 1
        if refs[block] == 0:
            if self._tree.is_cached(block):
                self._tree.mark_free(block)
            else:
                self._free.append(block)
        elif refs[block] < 0:
            raise AssertionError(f"block {block} ref count went negative")

    # ---- sequences ----------------------------------------------------------------------------
    def add_sequence(self, request: LlmRequest) -> None:
        """Allocate blocks for the request's prompt (cross manager: its encoder output).

        With reuse on, the longest cached run of full prompt blocks (covering at most P - 1
        tokens) is taken instead of new blocks and the request's prepopulated length is set.
        Raises KVCacheOutOfBlocksError, leaving no trace, when the blocks do not fit."""
        self.add_sequences([request])

    def add_sequences(self, requests: Sequence[LlmRequest]) -> None:
        """``add_sequence`` for a step's first chunks at once: every request's cached prefix is
        claimed before any new block is allocated, so one request's allocation cannot evict a
        free cached block another request's reuse credit was scheduled on. All or nothing."""
        claimed: list[tuple[LlmRequest, tuple[int, int, int], list[int]]] = []
        try:
            for request in requests:
                claimed.append((request, *self._claim_prefix(request)))
        except Exception:
            self._unclaim(claimed)
            raise
        done: list[LlmRequest] = []
        try:
            for request, shape, matched in claimed:
                self._allocate_rest(request, shape, matched)
                done.append(request)
        except Exception:
            for request in done:
                self.remove_sequence(request.request_id)
            self._unclaim(claimed[len(done) :])
            raise

    def _unclaim(self, claimed) -> None:
        for _, _, matched in claimed:
            for blk in matched:
                self._release(blk)

    def _claim_prefix(self, request: LlmRequest) -> tuple[tuple[int, int, int], list[int]]:
        rid = request.request_id
        if rid in self._seqs:
            raise ValueError(f"request {rid} already has a KV sequence")
        b = self.tokens_per_block
        n = request.encoder_output_len if self.is_cross else request.prompt_len
        eff = n if self.max_token_num is None else min(
            n, self.max_token_num + self.temporary_attention_window
        )
        matched: list[int] = []
        if self.enable_block_reuse and eff == n and n > 1:
            count = (n - 1) // b
            keys = self._prefix.block_keys(request.get_tokens(0), count, request)
            matched = self._tree.match(keys, count)
        # Claim matched blocks before allocating, so eviction cannot touch them.
        refs = self._refs
        for blk in matched:
            if refs[blk] == 0:
                self._tree.mark_used(blk)
            refs[blk] += 1
        return (n, eff, request.beam_width), matched

    def _allocate_rest(
        self, request: LlmRequest, shape: tuple[int, int, int], matched: list[int]
    ) -> None:
        rid = request.request_id
        n, eff, beam = shape
        b = self.tokens_per_block
        full, partial = divmod(eff, b)
        has_partial = 1 if partial else 0
        # The last partial block is written by every beam, so each beam gets its own.
        share_partial = beam == 1 or self.is_cross
        needed = full - len(matched) + has_partial * (1 if share_partial else beam)
        available = len(self._free) + self._tree.num_free_cached
        if needed > available:
            raise KVCacheOutOfBlocksError(
                f"request {rid}: needs {needed} new KV blocks, {available} free"
            )
        shared = matched + [self._take_free() for _ in range(full - len(matched))]
        if beam == 1:
            if has_partial:
                shared.append(self._take_free())
            beams = [shared]
            blocks = shared
        else:
            blocks = list(shared)
            if has_partial and share_partial:
                tail = self._take_free()
                blocks.append(tail)
                beams = [shared + [tail] for _ in range(beam)]
            elif has_partial:
                beams = []
                for _ in range(beam):
                    tail = self._take_free()
                    blocks.append(tail)
                    beams.append(shared + [tail])
            else:
                beams = [list(shared) for _ in range(beam)]
        front_removed = _ceil_div(n, b) - _ceil_div(eff, b)
        self._seqs[rid] = _Sequence(beam, n, beams, blocks, front_removed)
        if matched:
            self.num_reused_blocks += len(matched)
            request.set_prepopulated_prompt_len(len(matched) * b, b)

    def add_token(self, request_id: int) -> None:
        """Every beam grows by one token: a block per beam when a block boundary is crossed.
        With a sliding window (beam width 1), blocks that fall fully out of the window are
        detached first (a token span of W + B triggers a detach, as in TensorRT-LLM)."""
        seq = self._get_seq(request_id)
        b = self.tokens_per_block
        n = seq.num_tokens + 1
        detach = 0
        w = self.max_attention_window
        if w is not None and seq.beam_width == 1:
            live = len(seq.beams[0])
            while detach < live and n - (seq.front_removed + detach) * b >= w + b:
                detach += 1
        need = seq.beam_width if (n - 1) % b == 0 else 0
        if need:
            refs = self._refs
            freed = sum(1 for blk in seq.beams[0][:detach] if refs[blk] == 1)
            available = self.get_num_free_blocks() + freed
            if need > available:
                raise KVCacheOutOfBlocksError(
                    f"request {request_id}: needs {need} new KV blocks, {available} free"
                )
        if detach:
            front = seq.beams[0][:detach]
            del seq.beams[0][:detach]  # beam 1: beams[0] is seq.blocks
            seq.front_removed += detach
            for blk in front:
                self._release(blk)
        seq.num_tokens = n
        if need:
            if seq.beam_width == 1:
                seq.blocks.append(self._take_free())
            else:
                for beam_blocks in seq.beams:
                    blk = self._take_free()
                    seq.blocks.append(blk)
                    beam_blocks.append(blk)

    def fork_sequence(self, parent_id: int, child: LlmRequest) -> tuple[int, int] | None:
        """Give ``child`` the parent's KV as it stands (beam width 1): every full live block
        shared (one more ref each, so neither frees it while the other holds it), and the
        partial last block, which both will write, copied on write now: the child gets a block
        of its own. Blocks a sliding window detached stay detached: the child starts from the
        parent's front. Returns (parent's partial block, the child's copy) for the caller to
        copy the data, or None when the parent ends on a block boundary. All or nothing:
        KVCacheOutOfBlocksError when the copy has no free block."""
        parent = self._get_seq(parent_id)
        rid = child.request_id
        if rid in self._seqs:
            raise ValueError(f"request {rid} already has a KV sequence")
        if parent.beam_width != 1 or self.is_cross:
            raise ValueError("only a beam-1 sequence can be forked")
        live = parent.beams[0]  # ends with the block of the last token
        partial = parent.num_tokens % self.tokens_per_block
        blocks = list(live[:-1] if partial else live)
        if partial and self.get_num_free_blocks() < 1:
            raise KVCacheOutOfBlocksError(f"request {rid}: needs 1 new KV block to fork, 0 free")
        for blk in blocks:
            self._refs[blk] += 1
        copy = None
        if partial:
            tail = self._take_free()
            copy = (live[-1], tail)
            blocks.append(tail)
        self._seqs[rid] = _Sequence(1, parent.num_tokens, [blocks], blocks, parent.front_removed)
        return copy

    def store_context_blocks(self, request: LlmRequest) -> int:
        """Cache the request's full blocks covering its first P - 1 prompt tokens, keyed by token
        content and LoRA task id. A key already cached by another block keeps that block; the
        request's duplicate stays private. Returns the number of newly cached blocks (0 when
        reuse is off, for a cross manager, or when the sequence is unknown)."""
        if not self.enable_block_reuse:
            return 0
        seq = self._seqs.get(request.request_id)
        if seq is None or seq.front_removed:
            return 0
        count = min((request.prompt_len - 1) // self.tokens_per_block, len(seq.beams[0]))
        if count <= 0:
            return 0
        keys = self._prefix.block_keys(request.get_tokens(0), count, request)
        return len(self._tree.insert(keys[:count], seq.beams[0][:count]))

    def remove_sequence(self, request_id: int) -> bool:
        """Drop the sequence's refs. A block reaching ref 0 becomes a free cached block (if in the
        tree) or a plain free block. Blocks are released leaf-first (reverse allocation order),
        so descendants are evicted before their ancestors. Unknown id: no-op, returns False."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        release = self._release
        for blk in reversed(seq.blocks):
            release(blk)
        return True

    # ---- prefix reuse and block estimates (scheduling.md 2.4, 2.6, 2.9) -----------------------
    def analyze_prefix_reuse(self, tokens: Sequence[int], request: Any) -> PrefixReuseSummary:
        """One tree walk over the full blocks of ``tokens[:len(tokens) - 1]`` (the last token is
        never cached). ``tokens`` is the prompt (cross manager: the encoder tokens).

        The result is cached on the request until the tree changes (``RadixTree.version``), so
        repeated calls within a scheduling step cost a few attribute reads."""
        return self._prefix.analyze(tokens, len(tokens), request)

    def scheduling_view(self, *, encoder_tokens: bool = False) -> SchedulingView:
        """This manager's fast view for one scheduling pass (``kv_estimates.SchedulingView``);
        ``encoder_tokens``: as a cross pool, whose prefix summary analyzes encoder tokens."""
        return build_scheduling_view(self, encoder_tokens=encoder_tokens)

    def get_remaining_blocks_to_completion(
        self, request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int:
        """GUARANTEED_NO_EVICT estimate of the blocks the request still needs (scheduling.md
        2.4); the formula is ``SchedulingView.blocks_to_completion``."""
        return build_scheduling_view(self).blocks_to_completion(request, summary)

    def get_needed_blocks_one_step(
        self,
        request: LlmRequest,
        two_steps_look_ahead: bool,
        summary: PrefixReuseSummary | None = None,
    ) -> int:
        """MAX_UTILIZATION estimate of the blocks the next step needs (scheduling.md 2.6); the
        formula is ``SchedulingView.blocks_one_step``."""
        return build_scheduling_view(self).blocks_one_step(request, two_steps_look_ahead, summary)

    # ---- scheduling simulation (scheduling.md 2.5) --------------------------------------------
    def start_scheduling(self) -> None:
        self._sched_epoch += 1
        self._sched_free = self.get_num_free_blocks()
        self._sched_removed.clear()

    def scheduling_remove_sequence(self, request_id: int) -> None:
        """Pretend the sequence is freed: each of its blocks loses one scheduling ref and blocks
        reaching 0 raise the scheduling free count. Unknown or already removed ids: no-op."""
        seq = self._seqs.get(request_id)
        if seq is None or request_id in self._sched_removed:
            return
        self._sched_removed.add(request_id)
        epoch, stamp, srefs, refs = self._sched_epoch, self._sched_stamp, self._sched_refs, self._refs
        for blk in seq.blocks:
            if stamp[blk] != epoch:
                stamp[blk] = epoch
                srefs[blk] = refs[blk]
            srefs[blk] -= 1
            if srefs[blk] == 0:
                self._sched_free += 1

    def scheduling_has_free_blocks(self, num_blocks: int) -> bool:
        return self._sched_free >= num_blocks

    def get_scheduling_num_free_blocks(self) -> int:
        return self._sched_free

    # ---- invariants (tests) -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Full consistency check, O(pool): for tests only."""
        self._tree.check_invariants()
        held = [0] * self.num_blocks
        for seq in self._seqs.values():
            assert len(set(seq.blocks)) == len(seq.blocks), "a sequence holds a block twice"
            for blk in seq.blocks:
                held[blk] += 1
            for beam_blocks in seq.beams:
                assert set(beam_blocks) <= set(seq.blocks)
        assert held == self._refs, "ref counts disagree with the sequences"
        free = set(self._free)
        assert len(free) == len(self._free), "plain free list has duplicates"
        lru = set(self._tree.free_cached_blocks())
        assert not free & lru
        for blk in range(self.num_blocks):
            if self._refs[blk] > 0:
                assert blk not in free and blk not in lru
            else:
                assert (blk in lru) == self._tree.is_cached(blk)
                assert (blk in free) != (blk in lru)
        assert len(free) + len(lru) + sum(1 for r in self._refs if r > 0) == self.num_blocks


def scheduling_view_of(manager: Any, *, encoder_tokens: bool = False) -> SchedulingView:
    """The view a scheduler reads a KV pool through for one pass: the fast closures for exactly
    a ``KVCacheManager`` (they compute what its methods compute), else
    ``public_scheduling_view``, which calls the pool's public names (a subclass such as
    ``SlidingWindowKVCacheManager`` overrides formulas, a double must see its calls).
    ``encoder_tokens``: the pool is the cross pool (prefix summaries analyze the encoder
    tokens)."""
    if type(manager) is KVCacheManager:
        return build_scheduling_view(manager, encoder_tokens=encoder_tokens)
    return public_scheduling_view(manager, encoder_tokens=encoder_tokens)

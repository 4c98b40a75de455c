"""KV prefix reuse (reference 2.9): the summary of one radix-tree walk over a prompt, and the
chained block keys cached on a request.

``PrefixReuseMixin`` is the prefix-analysis part of ``KVCacheManager`` (kv_cache.py), which
inherits it; it reads the manager's ``tokens_per_block``, ``is_cross``, ``_key_ns`` and ``_tree``.

Prefix analysis is cheap by construction: chained block keys are cached on the request
(``LlmRequest.block_key_cache``) and extended when a pause grows the prompt, and the last
summary is reused until the tree's ``version`` changes.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from .radix_tree import BlockKey, RadixTree, chain_block_keys, lora_seed
from .request import LlmRequest


class PrefixReuseSummary(NamedTuple):
    """One radix-tree walk over a prompt's full blocks (reference 2.9).

    ``reusable_blocks_allocated``: matched blocks (in the leading matched run) that live
    sequences hold; ``reusable_blocks_all``: length of the leading matched run, free cached blocks
    included; ``first_new_block``: key of the first full prompt block not in the tree (None when
    every full block is cached)."""

    reusable_blocks_allocated: int
    reusable_blocks_all: int
    first_new_block: BlockKey | None


_EMPTY_SUMMARY = PrefixReuseSummary(0, 0, None)


class _KeyCache:
    """Per request and pool kind: chained block keys, plus the last walk's summary tagged with
    the tree and tree version it was computed against. ``count`` is -1 or the (positive) number
    of full blocks the summary covers, which ``keys`` always holds.
    ``SchedulingView.prefix_summary`` tests a cache hit in place, exactly as ``_analyze`` does."""

    __slots__ = ("lora", "keys", "tree", "version", "count", "summary")

    def __init__(self, lora: int | None) -> None:
        self.lora = lora
        self.keys: list[BlockKey] = []
        self.tree: RadixTree | None = None
        self.version = -1
        self.count = -1
        self.summary: PrefixReuseSummary | None = None


class PrefixReuseMixin:
    """``KVCacheManager``'s prefix analysis: the request's chained block keys and the tree walk
    over them. The attributes below are the manager's (set in ``KVCacheManager.__init__``)."""

    tokens_per_block: int
    is_cross: bool
    _key_ns: tuple[int, bool]
    _tree: RadixTree

    # ---- prefix reuse (reference 2.9) ---------------------------------------------------------
    def _key_cache(self, tokens: Sequence[int], count: int, request: Any) -> _KeyCache:
        """The request's chained keys, covering at least its first ``count`` full blocks.

        Cached on the request per (tokens_per_block, pool kind): a prompt only ever grows by
        appending (pause), which leaves the keys of its old prefix valid, so the cache is
        extended rather than rebuilt; a changed LoRA id rebuilds it."""
        lora = request.lora_task_id
        cache = getattr(request, "block_key_cache", None)
        if cache is None:
            cache = {}
            try:
                request.block_key_cache = cache
            except AttributeError:  # a slotted test double without the cache slot
                pass
        entry = cache.get(self._key_ns)
        if entry is None or entry.lora != lora:
            entry = _KeyCache(lora)
            cache[self._key_ns] = entry
        keys = entry.keys
        have = len(keys)
        if have < count:
            b = self.tokens_per_block
            # Only prompt blocks are cached: prompt tokens never change (a pause only appends),
            # while tokens past the prompt may be dropped and generated differently.
            limit = count if self.is_cross else min(count, (request.prompt_len - 1) // b)
            prev = keys[-1] if keys else lora_seed(lora)
            if have < limit:
                chain_block_keys(tokens, b, limit, start=have, prev=prev, out=keys)
            if limit < count:
                extra = _KeyCache(lora)
                extra.keys = list(keys)
                prev = keys[-1] if keys else prev
                chain_block_keys(tokens, b, count, start=len(keys), prev=prev, out=extra.keys)
                return extra
        return entry

    def _block_keys(self, tokens: Sequence[int], count: int, request: Any) -> list[BlockKey]:
        return self._key_cache(tokens, count, request).keys

    def analyze_prefix_reuse(self, tokens: Sequence[int], request: Any) -> PrefixReuseSummary:
        """One tree walk over the full blocks of ``tokens[:len(tokens) - 1]`` (the last token is
        never cached). ``tokens`` is the prompt (cross manager: the encoder tokens).

        The result is cached on the request until the tree changes (``RadixTree.version``), so
        repeated calls within a scheduling step cost a few attribute reads."""
        return self._analyze(tokens, len(tokens), request)

    def _analyze(self, tokens: Sequence[int], num_tokens: int, request: Any) -> PrefixReuseSummary:
        count = (num_tokens - 1) // self.tokens_per_block if num_tokens > 0 else 0
        if count <= 0:
            return _EMPTY_SUMMARY
        entry = self._key_cache(tokens, count, request)
        tree = self._tree
        if entry.tree is tree and entry.version == tree.version and entry.count == count:
            return entry.summary  # type: ignore[return-value]
        # Like TensorRT-LLM countReusableBlocks(onlyAllocated): held blocks along the matched run.
        held, matched, first_new = tree.walk_counting(entry.keys, count)
        summary = PrefixReuseSummary(held, matched, first_new)
        entry.tree, entry.version, entry.count, entry.summary = tree, tree.version, count, summary
        return summary

    def _summary_for(self, request: LlmRequest) -> PrefixReuseSummary:
        # No slice copy: only the first prompt_len tokens are read, and only on a cache miss.
        return self._analyze(request.get_tokens(0), request.prompt_len, request)

"""KV prefix reuse (scheduling.md 2.9): the summary of one radix-tree walk over a prompt, and
the chained block keys cached on a request.

``PrefixAnalyzer`` is one pool's prefix analysis; a ``KVCacheManager`` (kv_cache.py) owns one.

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
    """One radix-tree walk over a prompt's full blocks (scheduling.md 2.9).

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
    ``SchedulingView.prefix_summary`` tests a cache hit in place, exactly as
    ``PrefixAnalyzer.analyze`` does."""

    __slots__ = ("lora", "keys", "tree", "version", "count", "summary")

    def __init__(self, lora: int | None) -> None:
        self.lora = lora
        self.keys: list[BlockKey] = []
        self.tree: RadixTree | None = None
        self.version = -1
        self.count = -1
        self.summary: PrefixReuseSummary | None = None


class PrefixAnalyzer:
    """The prefix analysis of one KV pool (scheduling.md 2.9): a request's chained block keys,
    cached on the request, and the tree walk over them. A ``KVCacheManager`` owns one
    (``_prefix``) and answers ``analyze_prefix_reuse`` through it; its scheduling view reads
    ``key_ns``, ``tree`` and ``analyze``.

    ``key_ns`` (tokens per block, pool kind) names the request's key cache of this kind of
    pool; ``tree`` is the pool's radix tree, never replaced."""

    __slots__ = ("tokens_per_block", "is_cross", "key_ns", "tree")

    def __init__(self, tokens_per_block: int, is_cross: bool, tree: RadixTree) -> None:
        self.tokens_per_block = tokens_per_block
        self.is_cross = is_cross
        self.key_ns = (tokens_per_block, is_cross)
        self.tree = tree

    def key_cache(self, tokens: Sequence[int], count: int, request: Any) -> _KeyCache:
        """The request's chained keys, covering at least its first ``count`` full blocks.

        Cached on the request per (tokens_per_block, pool kind): a prompt only ever grows by
        appending (pause), which leaves the keys of its old prefix valid, so the cache is
        extended rather than rebuilt; a changed LoRA id rebuilds it."""
        lora = request.lora_task_id
        salt = getattr(request, "cache_salt", None)
        if salt is not None:  # its own key chain: it matches no one else's blocks
            lora = (lora, salt)
        cache = getattr(request, "block_key_cache", None)
        if cache is None:
            cache = {}
            try:
                request.block_key_cache = cache
            except AttributeError:  # a slotted test double without the cache slot
                pass
        entry = cache.get(self.key_ns)
        if entry is None or entry.lora != lora:
            entry = _KeyCache(lora)
            cache[self.key_ns] = entry
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

    def block_keys(self, tokens: Sequence[int], count: int, request: Any) -> list[BlockKey]:
        return self.key_cache(tokens, count, request).keys

    def analyze(self, tokens: Sequence[int], num_tokens: int, request: Any) -> PrefixReuseSummary:
        """One tree walk over the full blocks of ``tokens[:num_tokens - 1]`` (the last token is
        never cached), cached on the request until the tree changes (``RadixTree.version``)."""
        count = (num_tokens - 1) // self.tokens_per_block if num_tokens > 0 else 0
        if count <= 0:
            return _EMPTY_SUMMARY
        entry = self.key_cache(tokens, count, request)
        tree = self.tree
        if entry.tree is tree and entry.version == tree.version and entry.count == count:
            return entry.summary  # type: ignore[return-value]
        # Like TensorRT-LLM countReusableBlocks(onlyAllocated): held blocks along the matched run.
        held, matched, first_new = tree.walk_counting(entry.keys, count)
        summary = PrefixReuseSummary(held, matched, first_new)
        entry.tree, entry.version, entry.count, entry.summary = tree, tree.version, count, summary
        return summary

    def summary_for(self, request: LlmRequest) -> PrefixReuseSummary:
        """The summary of the request's prompt: the credit a block estimate computes when it is
        given none. No slice copy: only the first prompt_len tokens are read, on a miss."""
        return self.analyze(request.get_tokens(0), request.prompt_len, request)

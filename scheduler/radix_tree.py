"""Block-key tree for KV prefix reuse: match, insert, evict (scheduling.md 2.9).

A node is one cached KV block. Its key is a *chained* block key: a digest of the whole token
prefix up to and including that block plus the LoRA task id (see ``chain_block_keys``), so a key
alone identifies its position in the tree and two requests that share a prefix compute the
same keys. The tree never holds a sequence's last prompt token (the stored context is P - 1
tokens), so only full blocks are ever cached.

Free cached blocks (ref count 0, still in the tree) sit in an LRU order, oldest first; the block
pool evicts from there once its plain free blocks run out.

Eviction rule (chosen here): evicting a node uncaches its whole subtree, so no tree entry is ever
left unreachable. Descendants that are free go back to the caller as plain free blocks;
descendants still held by live sequences simply become private (uncached) blocks of those
sequences. Callers release blocks leaf-first, so descendants are normally older in the LRU
order than their ancestors and eviction almost always hits leaves.

Because keys are chained and eviction removes whole subtrees, a key is in the tree only together
with all its ancestors; a flat key index therefore answers "how long is the cached leading run"
by binary search (``walk_counting``), which the capacity scheduler needs for every waiting
request on every step. ``version`` changes whenever a walk's answer could change.

Pure Python, stdlib only. Every operation costs O(blocks touched), never O(pool).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Iterator, Sequence

from .kv_events import BlocksStored, KVEventLog

BlockKey = bytes
"""A chained block key: 16-byte BLAKE2b digest of (previous key, block tokens)."""

_KEY_BYTES = 16


def lora_seed(lora_task_id: int | None) -> bytes:
    """The chain's starting value: separates identical prompts under different LoRA adapters."""
    return hashlib.blake2b(
        b"pdserve-kv-root:" + repr(lora_task_id).encode(), digest_size=_KEY_BYTES
    ).digest()


def chain_block_keys(
    tokens: Sequence[int],
    tokens_per_block: int,
    num_blocks: int,
    *,
    start: int = 0,
    prev: bytes,
    out: list[BlockKey] | None = None,
) -> list[BlockKey]:
    """Append the keys of full blocks ``start .. num_blocks - 1`` of ``tokens`` to ``out``.

    ``prev`` is the key of block ``start - 1`` (or ``lora_seed(...)`` when ``start == 0``), so a
    cached list of keys can be extended when the prompt grows without rehashing its prefix."""
    keys: list[BlockKey] = [] if out is None else out
    b = tokens_per_block
    for i in range(start, num_blocks):
        block = array("q", tokens[i * b : (i + 1) * b])
        prev = hashlib.blake2b(prev + block.tobytes(), digest_size=_KEY_BYTES).digest()
        keys.append(prev)
    return keys


def prompt_block_keys(token_ids: Sequence[int], tokens_per_block: int,
                      lora_task_id: int | None = None) -> list[BlockKey]:
    """The keys a worker caches a prompt's blocks under: its full blocks over all but the last
    token (the last prompt token is always recomputed, so a block ending on it is never reused).
    The one block hash the workers' caches and the router's prefix index share."""
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    count = max(0, (len(token_ids) - 1) // tokens_per_block)
    return chain_block_keys(token_ids, tokens_per_block, count, prev=lora_seed(lora_task_id))


class _Node:
    __slots__ = ("key", "block_id", "parent", "children")

    def __init__(self, key: BlockKey | None, block_id: int, parent: _Node | None) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[BlockKey, _Node] = {}


class RadixTree:
    """Cached blocks keyed by chained block keys, plus the LRU order of the free cached ones.

    The tree knows nothing about reference counts: the owner tells it when a cached block
    becomes free (``mark_free``) or is taken again (``mark_used``)."""

    __slots__ = ("_root", "_by_block", "_by_key", "_lru", "_free_keys", "version", "events")

    def __init__(self, events: KVEventLog | None = None) -> None:
        # Where each change to the cached set is reported (``kv_events.py``); None: nowhere.
        self.events = events
        # Bumped by every change that can alter a walk's outcome (a node added or removed, a
        # cached block turning free or used), so callers can cache walk results.
        self.version = 0
        self._root = _Node(None, -1, None)
        self._by_block: dict[int, _Node] = {}
        # Chained keys make a flat index exact: a key is present only with all its ancestors.
        self._by_key: dict[BlockKey, int] = {}
        # Free cached block ids, least recently used first (values unused).
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free_keys: set[BlockKey] = set()  # keys of the blocks in _lru

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        return len(self._by_block)

    @property
    def num_free_cached(self) -> int:
        return len(self._lru)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._by_block

    def is_free_cached(self, block_id: int) -> bool:
        return block_id in self._lru

    def free_cached_blocks(self) -> Iterator[int]:
        """Free cached blocks, least recently used first (for tests and stats)."""
        return iter(self._lru)

    def match(self, keys: Sequence[BlockKey], limit: int | None = None) -> list[int]:
        """Block ids of the leading run of ``keys`` (at most ``limit``) present in the tree."""
        node = self._root
        out: list[int] = []
        n = len(keys) if limit is None else min(limit, len(keys))
        for i in range(n):
            child = node.children.get(keys[i])
            if child is None:
                break
            out.append(child.block_id)
            node = child
        return out

    def walk(self, keys: Sequence[BlockKey], limit: int) -> tuple[list[int], BlockKey | None]:
        """One walk: (matched block ids, first key of ``keys[:limit]`` not in the tree or None)."""
        node = self._root
        out: list[int] = []
        for i in range(limit):
            key = keys[i]
            child = node.children.get(key)
            if child is None:
                return out, key
            out.append(child.block_id)
            node = child
        return out, None

    def walk_counting(self, keys: Sequence[BlockKey], limit: int) -> tuple[int, int, BlockKey | None]:
        """(matched blocks in use, matched blocks, first new key or None) for ``keys[:limit]``.

        Same answer as a root-down walk, but this runs for every waiting request on every
        scheduling step, so it uses the flat key index: a chained key is present only with all
        its ancestors, so presence is monotone along ``keys`` and a binary search finds the
        leading run; in-use blocks are the matched ones whose keys are not free."""
        by_key = self._by_key
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi) >> 1
            if keys[mid] in by_key:
                lo = mid + 1
            else:
                hi = mid
        matched = lo
        free = self._free_keys
        held = matched
        if free and matched:
            run = keys[:matched]
            if not free.isdisjoint(run):
                held -= len(free.intersection(run))
        return held, matched, (keys[matched] if matched < limit else None)

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> list[int]:
        """Cache ``block_ids[i]`` under ``keys[i]`` along one path from the root.

        Where a key is already cached (by this block or another), the cached block is kept and
        the walk continues below it; a duplicate block stays private. Returns the newly cached
        block ids. Inserted blocks are assumed to be in use (not free)."""
        node = self._root
        added: list[int] = []
        by_block = self._by_block
        first_parent: _Node | None = None  # the new blocks form one chain below this node
        for key, block_id in zip(keys, block_ids):
            child = node.children.get(key)
            if child is None:
                if block_id in by_block:
                    # A block caches one prefix only; it cannot start a second path.
                    raise ValueError(f"block {block_id} is already cached under another key")
                if first_parent is None:
                    first_parent = node
                child = _Node(key, block_id, node)
                node.children[key] = child
                by_block[block_id] = child
                self._by_key[key] = block_id
                added.append(block_id)
            node = child
        if added:
            self.version += 1
            if self.events is not None:
                # A new node has no children, so the added keys are the walk's last ones.
                walked = min(len(keys), len(block_ids))
                self.events.stored(first_parent.key, tuple(keys[walked - len(added):walked]))
        return added

    # ---- free / used / evict ------------------------------------------------------------------
    def mark_free(self, block_id: int) -> None:
        """A cached block's ref count reached 0: it becomes the most recently used free block."""
        node = self._by_block.get(block_id)
        if node is None:
            raise KeyError(f"block {block_id} is not cached")
        self._free_keys.add(node.key)  # type: ignore[arg-type]
        self._lru[block_id] = None
        self._lru.move_to_end(block_id)
        self.version += 1

    def mark_used(self, block_id: int) -> None:
        """A free cached block was taken again (reused): it leaves the evictable set."""
        if self._lru.pop(block_id, 0) is None:  # values are None: it was there
            self._free_keys.discard(self._by_block[block_id].key)  # type: ignore[arg-type]
            self.version += 1

    def evict_lru(self) -> tuple[int, list[int]]:
        """Evict the least recently used free cached block.

        Returns (evicted block id, other free blocks uncached with its subtree). Both are now
        plain free blocks owned by the caller; in-use descendants just become private."""
        if not self._lru:
            raise LookupError("no free cached block to evict")
        block_id, _ = self._lru.popitem(last=False)
        self.version += 1
        node = self._by_block[block_id]
        released = self._remove_subtree(node)
        return block_id, released

    def snapshot(self) -> list[BlocksStored]:
        """Every cached block as ``BlocksStored`` events, parents before children, single-child
        runs joined into one event: what a router replaces its view of this cache with."""
        out: list[BlocksStored] = []
        stack = [(self._root, child) for child in self._root.children.values()]
        while stack:
            parent, node = stack.pop()
            chain = [node.key]
            while len(node.children) == 1:
                (node,) = node.children.values()
                chain.append(node.key)
            out.append(BlocksStored(parent.key, tuple(chain)))
            stack.extend((node, child) for child in node.children.values())
        return out

    def _remove_subtree(self, top: _Node) -> list[int]:
        assert top.parent is not None
        del top.parent.children[top.key]  # type: ignore[arg-type]
        top.parent = None
        released: list[int] = []
        removed_keys: list[BlockKey] = []
        stack = [top]
        by_block, by_key, lru = self._by_block, self._by_key, self._lru
        while stack:
            node = stack.pop()
            del by_block[node.block_id]
            del by_key[node.key]  # type: ignore[arg-type]
            self._free_keys.discard(node.key)  # type: ignore[arg-type]
            if node is not top and node.block_id in lru:
                del lru[node.block_id]
                released.append(node.block_id)
            stack.extend(node.children.values())
            node.children = {}
            removed_keys.append(node.key)
        if self.events is not None:
            self.events.removed(tuple(removed_keys))
        return released

    # ---- invariants (tests) -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every cached block is reachable from the root exactly once; LRU blocks are cached.
        O(tree): for tests only."""
        seen: set[int] = set()
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.block_id not in seen, f"block {node.block_id} cached twice"
            seen.add(node.block_id)
            assert self._by_block.get(node.block_id) is node
            assert self._by_key.get(node.key) == node.block_id  # type: ignore[arg-type]
            for key, child in node.children.items():
                assert child.key == key and child.parent is node
                stack.append(child)
        assert seen == set(self._by_block), "unreachable tree entries"
        assert len(self._by_key) == len(seen)
        assert set(self._lru) <= seen, "free cached block missing from the tree"
        assert self._free_keys == {self._by_block[b].key for b in self._lru}

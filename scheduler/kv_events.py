"""KV cache events: what a worker's prefix cache (``radix_tree.RadixTree``) did, as it happened,
so the router can keep an exact index of every worker's cached blocks (``cluster/prefix_index``).
PURE (stdlib only).

A block is named by its chained key (``radix_tree.chain_block_keys``: a digest of the whole token
prefix up to and including the block), the one block hash the workers and the router share.
Because keys are chained and the tree evicts whole subtrees, a worker's cached keys are always
prefix-closed: a block is cached only together with its parent.

- ``BlocksStored(parent, keys)``: ``keys`` became cached, in chain order; the first one's parent
  is ``parent`` (None: the root), each later one's parent is the key before it.
- ``BlocksRemoved(keys)``: ``keys`` were uncached (eviction removes a whole subtree).
- ``AllCleared()``: the worker's cache is empty (a new process, or a reset).

``KVEventLog`` batches them: the tree appends as it goes and the worker drains once per step,
numbering each batch (``seq``) so the router can tell a gap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BlockKey = bytes


@dataclass(frozen=True, slots=True)
class BlocksStored:
    parent: BlockKey | None
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KVEvent = Union[BlocksStored, BlocksRemoved, AllCleared]


class KVEventLog:
    """The events since the last ``drain``, in order. The tree appends (one call per tree
    operation, so the cost is a list append); the worker drains once per step. Bounded: past
    ``max_pending`` events the log drops them all and says so (``overflowed``), and the worker
    sends its whole cache instead, which the router takes as a snapshot."""

    __slots__ = ("_pending", "max_pending", "overflowed", "recorded")

    def __init__(self, max_pending: int = 100_000) -> None:
        self._pending: list[KVEvent] = []
        self.max_pending = max_pending
        self.overflowed = False
        self.recorded = 0  # every event ever recorded

    def stored(self, parent: BlockKey | None, keys: tuple[BlockKey, ...]) -> None:
        self._add(BlocksStored(parent, keys))

    def removed(self, keys: tuple[BlockKey, ...]) -> None:
        self._add(BlocksRemoved(keys))

    def cleared(self) -> None:
        self._pending.clear()  # whatever came before no longer matters
        self.overflowed = False
        self._add(AllCleared())

    def _add(self, event: KVEvent) -> None:
        self.recorded += 1
        if self.overflowed:
            return
        self._pending.append(event)
        if len(self._pending) > self.max_pending:
            self._pending.clear()
            self.overflowed = True

    def drain(self) -> tuple[list[KVEvent], bool]:
        """(the events since the last drain, whether some were dropped: then send a snapshot)."""
        out, overflowed = self._pending, self.overflowed
        self._pending, self.overflowed = [], False
        return out, overflowed

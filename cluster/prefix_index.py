"""The router's global prefix index: which worker caches which KV block, kept exact from the
workers' KV events (``scheduler/kv_events.py``). PURE (stdlib only).

Keys are chained block keys (``radix_tree.chain_block_keys``): a key names its whole token
prefix, so its parent is a function of the key and is stored once, and every worker's key set is
prefix-closed (the radix tree caches a block only with its parent and evicts whole subtrees).

Layout:

- one ``_Entry`` per distinct key held by any worker: the key, its parent key and ``mask``, the
  bitmask of the worker *slots* holding it. A worker keeps its slot while registered; freed slots
  are reused lowest first, so masks stay as narrow as the number of live workers.
- per worker, ``held``: key -> how many of the worker's held keys have it as parent. It is the
  worker's key set (for dropping it in O(its entries)) and what lets a removal prove it leaves no
  orphan behind.

``match`` walks a prompt's keys intersecting the running mask, so it costs one dict lookup per
key until no worker holds the prefix, plus O(workers) to name where each worker's bit dropped.

Exactness: ``apply`` checks every event against the worker's current set. A store under a parent
the worker does not hold, a store of a key it already holds (or under another parent than the
key's own), a removal of a key it does not hold or one that would orphan a held child, or a batch
number other than the next expected one, is a *gap*: the worker's entries are dropped, it is
marked as needing a snapshot, and ``apply`` returns False until ``apply_snapshot`` resyncs it.

Snapshot form: a sequence of ``BlocksStored`` events, parents before children: each event's
``parent`` is None (the root) or a key stored by an earlier event of the snapshot, and its keys
continue the chain as in a live event. A worker emits it by walking its radix tree depth first,
one event per chain of single-child nodes (``PrefixIndex.snapshot`` produces the same form).
A snapshot taken after batch ``seq`` covers every batch up to ``seq``; batches numbered ``<= seq``
that arrive after it (in flight while it was taken) are stale and ignored.

Memory (tracemalloc, CPython 3.11, 16-byte keys): about 160 bytes per distinct key (its
``_Entry``, the key object, the mask int, the dict slot) plus about 55 bytes per worker holding
it (a slot in that worker's ``held``); each key object is kept once however many workers hold
it. In ``benchmarks/prefix_index.py``'s chat workload (about two holders per key) that is 127-134
bytes per (block, worker) entry: about 125 MiB for 10^6 entries, at 8 or 64 workers.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Sequence

from pdserve.scheduler.kv_events import AllCleared, BlockKey, BlocksRemoved, BlocksStored, KVEvent

__all__ = ["PrefixIndex"]


class _Entry:
    """One key held by at least one worker."""

    __slots__ = ("key", "parent", "mask")

    def __init__(self, key: BlockKey, parent: BlockKey | None) -> None:
        self.key = key
        self.parent = parent
        self.mask = 0


class _Worker:
    __slots__ = ("slot", "bit", "held", "next_seq", "stale_through", "needs_snapshot")

    def __init__(self, slot: int, next_seq: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.held: dict[BlockKey, int] = {}  # key -> number of held children
        self.next_seq = next_seq
        self.stale_through: int | None = None  # batches <= this are covered by the last snapshot
        self.needs_snapshot = False


class _Gap(Exception):
    pass


class PrefixIndex:
    """Which worker caches which block, by chained block key; see the module docstring."""

    def __init__(self) -> None:
        self._entries: dict[BlockKey, _Entry] = {}
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []  # min-heap
        self._total = 0

    # -- workers -------------------------------------------------------------------------------

    def add_worker(self, worker_id: str, *, next_seq: int = 0) -> int:
        """Register a worker whose cache is empty and whose next batch is numbered ``next_seq``
        (a fresh process). Returns its slot. A worker whose cache state is unknown should be
        resynced with ``apply_snapshot``."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} already registered")
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._slot_owner[slot] = worker_id
        else:
            slot = len(self._slot_owner)
            self._slot_owner.append(worker_id)
        self._workers[worker_id] = _Worker(slot, next_seq)
        return slot

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead or restarted worker: all its entries go at once, its slot is freed."""
        w = self._workers.pop(worker_id)
        self._drop(w)
        self._slot_owner[w.slot] = None
        heapq.heappush(self._free_slots, w.slot)

    def clear(self, worker_id: str) -> None:
        """The worker's cache is empty (as ``AllCleared``); its batch numbering is unchanged."""
        self._drop(self._workers[worker_id])

    def expect_snapshot(self, worker_id: str) -> None:
        """The worker's cache is unknown (a new connection, or the caller saw a gap): drop its
        entries and refuse batches until ``apply_snapshot``."""
        self._gap(self._workers[worker_id])

    def slot(self, worker_id: str) -> int:
        return self._workers[worker_id].slot

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def needs_snapshot(self, worker_id: str) -> bool:
        return self._workers[worker_id].needs_snapshot

    # -- events --------------------------------------------------------------------------------

    def apply(self, worker_id: str, seq: int, events: Iterable[KVEvent]) -> bool:
        """Apply batch ``seq`` of the worker's events. False on a gap (and for every batch while
        a snapshot is awaited): the worker then holds nothing here until ``apply_snapshot``."""
        w = self._workers[worker_id]
        if w.needs_snapshot:
            return False
        if w.stale_through is not None and seq <= w.stale_through:
            return True  # in flight while the last snapshot was taken, so already in it
        if seq != w.next_seq:
            return self._gap(w)
        try:
            for event in events:
                if type(event) is BlocksStored:
                    self._store(w, event.parent, event.keys)
                elif type(event) is BlocksRemoved:
                    self._remove(w, event.keys)
                elif type(event) is AllCleared:
                    self._drop(w)
                else:
                    raise TypeError(f"not a KV event: {event!r}")
        except _Gap:
            return self._gap(w)
        w.next_seq = seq + 1
        return True

    def apply_snapshot(self, worker_id: str, seq: int, stored: Iterable[BlocksStored]) -> bool:
        """Replace the worker's entries with a snapshot taken after its batch ``seq`` (the form
        is in the module docstring); the next batch expected is ``seq + 1``. False if the
        snapshot is not well formed: the worker then still holds nothing and needs a snapshot."""
        w = self._workers[worker_id]
        self._drop(w)
        try:
            for event in stored:
                if type(event) is not BlocksStored:
                    raise _Gap
                self._store(w, event.parent, event.keys)
        except _Gap:
            return self._gap(w)
        w.needs_snapshot = False
        w.next_seq = seq + 1
        w.stale_through = seq
        return True

    def snapshot(self, worker_id: str) -> list[BlocksStored]:
        """The worker's entries in snapshot form (depth first, one event per single-child chain)."""
        held = self._workers[worker_id].held
        entries = self._entries
        children: dict[BlockKey | None, list[BlockKey]] = {}
        for key in held:
            children.setdefault(entries[key].parent, []).append(key)
        out: list[BlocksStored] = []
        stack: list[BlockKey | None] = [None]
        while stack:
            parent = stack.pop()
            for first in children.get(parent, ()):
                chain = [first]
                while len(kids := children.get(chain[-1], ())) == 1:
                    chain.append(kids[0])
                out.append(BlocksStored(parent, tuple(chain)))
                if kids:
                    stack.append(chain[-1])
        return out

    def _store(self, w: _Worker, parent: BlockKey | None, keys: Sequence[BlockKey]) -> None:
        held = w.held
        entries = self._entries
        if parent is not None:
            if parent not in held:
                raise _Gap
            parent = entries[parent].key  # keep the canonical object, not the event's copy
        bit = w.bit
        for key in keys:
            if key in held:
                raise _Gap
            e = entries.get(key)
            if e is None:
                e = entries[key] = _Entry(key, parent)
            elif e.parent != parent:
                raise _Gap  # a chained key names its parent
            # held and masks change together, so _drop can always undo a partial batch
            e.mask |= bit
            held[e.key] = 0  # the canonical key object: one copy however many workers hold it
            if parent is not None:
                held[parent] += 1
            self._total += 1
            parent = e.key

    def _remove(self, w: _Worker, keys: Sequence[BlockKey]) -> None:
        held = w.held
        entries = self._entries
        for key in keys:
            if key not in held:
                raise _Gap
        # Each removed key's parent loses a child; afterwards a removed key's count is its
        # children outside the removal, which must be none (whole subtrees only).
        for key in keys:
            parent = entries[key].parent
            if parent is not None and parent in held:
                held[parent] -= 1
        notbit = ~w.bit
        for key in keys:
            left = held.pop(key, None)
            if left is None:
                raise _Gap  # listed twice
            self._unmask(key, notbit)
            if left:
                raise _Gap

    def _unmask(self, key: BlockKey, notbit: int) -> None:
        e = self._entries[key]
        e.mask &= notbit
        if not e.mask:
            del self._entries[key]
        self._total -= 1

    def _drop(self, w: _Worker) -> None:
        notbit = ~w.bit
        for key in w.held:
            self._unmask(key, notbit)
        w.held = {}

    def _gap(self, w: _Worker) -> bool:
        self._drop(w)
        w.needs_snapshot = True
        return False

    # -- queries -------------------------------------------------------------------------------

    def match(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """For each worker holding ``keys[0]``: how many leading keys of ``keys`` it holds.
        One dict lookup per key while some worker still holds the run, plus O(workers)."""
        entries = self._entries
        owner = self._slot_owner
        out: dict[str, int] = {}
        running = -1
        n = 0
        for key in keys:
            e = entries.get(key)
            mask = running & e.mask if e is not None else 0
            if mask != running:
                if n:
                    dropped = running & ~mask
                    while dropped:
                        low = dropped & -dropped
                        out[owner[low.bit_length() - 1]] = n
                        dropped ^= low
                if not mask:
                    return out
                running = mask
            n += 1
        if n:
            while running:
                low = running & -running
                out[owner[low.bit_length() - 1]] = n
                running ^= low
        return out

    def num_blocks(self, worker_id: str) -> int:
        return len(self._workers[worker_id].held)

    def keys_of(self, worker_id: str) -> frozenset[BlockKey]:
        return frozenset(self._workers[worker_id].held)

    @property
    def total_entries(self) -> int:
        """(block, worker) pairs held: the sum of ``num_blocks`` over workers."""
        return self._total

    @property
    def num_keys(self) -> int:
        """Distinct keys held by at least one worker."""
        return len(self._entries)

    def check_invariants(self) -> None:
        """Masks agree with the per-worker sets; each set is prefix-closed with exact child
        counts; slots are consistent. For tests: O(entries)."""
        masks: dict[BlockKey, int] = {}
        for worker_id, w in self._workers.items():
            assert self._slot_owner[w.slot] == worker_id and w.bit == 1 << w.slot
            if w.needs_snapshot:
                assert not w.held
            children: dict[BlockKey, int] = {}
            for key in w.held:
                e = self._entries[key]
                assert e.key is key, "held keys are the entries' own objects"
                masks[key] = masks.get(key, 0) | w.bit
                if e.parent is not None:
                    assert e.parent in w.held, "orphan: parent not held"
                    children[e.parent] = children.get(e.parent, 0) + 1
            for key, count in w.held.items():
                assert count == children.get(key, 0), "child count"
        assert masks == {k: e.mask for k, e in self._entries.items()}
        for k, e in self._entries.items():
            assert e.key == k and (e.parent is None or self._entries[e.parent].key is e.parent)
        assert self._total == sum(len(w.held) for w in self._workers.values())
        live = {w.slot for w in self._workers.values()}
        assert len(live) == len(self._workers)
        assert sorted(self._free_slots) == [s for s in range(len(self._slot_owner)) if s not in live]
        assert all((o is None) == (s not in live) for s, o in enumerate(self._slot_owner))

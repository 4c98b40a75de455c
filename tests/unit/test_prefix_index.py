"""The router's prefix index against a reference model of the workers' radix trees."""
from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.scheduler.kv_events import AllCleared, BlocksRemoved, BlocksStored
from pdserve.scheduler.radix_tree import chain_block_keys, lora_seed

ROOT_SEED = b"root"


def child_key(parent: bytes | None, label: int) -> bytes:
    """A chained key, as the workers compute them: the key names its whole prefix."""
    return hashlib.blake2b((parent or ROOT_SEED) + bytes([label]), digest_size=16).digest()


def chain(parent: bytes | None, labels) -> list[bytes]:
    keys = []
    for label in labels:
        parent = child_key(parent, label)
        keys.append(parent)
    return keys


def fresh(key: bytes) -> bytes:
    """The same key as a new object, as decoded off the wire."""
    return bytes(memoryview(key))


class RefWorker:
    """One worker's radix tree as a prefix-closed dict key -> parent, plus its event numbering."""

    def __init__(self) -> None:
        self.tree: dict[bytes, bytes | None] = {}
        self.seq = 0  # next batch number

    def store(self, anchor: bytes | None, labels) -> list:
        keys = chain(anchor, labels)
        i = 0
        while i < len(keys) and keys[i] in self.tree:  # the tree matches before it inserts
            i += 1
        if i == len(keys):
            return []
        parent = keys[i - 1] if i else anchor
        for k in keys[i:]:
            self.tree[k] = parent
            parent = k
        return [BlocksStored(keys[i - 1] if i else anchor, tuple(fresh(k) for k in keys[i:]))]

    def subtree(self, top: bytes) -> list[bytes]:
        out, frontier = [top], [top]
        while frontier:
            p = frontier.pop()
            kids = [k for k, par in self.tree.items() if par == p]
            out.extend(kids)
            frontier.extend(kids)
        return out

    def evict(self, top: bytes, order: int) -> list:
        keys = self.subtree(top)  # parents first
        if order == 1:
            keys.reverse()  # leaves first
        elif order == 2:
            random.Random(len(keys)).shuffle(keys)
        for k in keys:
            del self.tree[k]
        return [BlocksRemoved(tuple(keys))]

    def clear(self) -> list:
        self.tree.clear()
        return [AllCleared()]

    def snapshot(self) -> list[BlocksStored]:
        """Parents before children, one key per event (the index accepts any chaining)."""
        out, frontier = [], [None]
        while frontier:
            p = frontier.pop(0)
            for k, par in self.tree.items():
                if par == p:
                    out.append(BlocksStored(p, (fresh(k),)))
                    frontier.append(k)
        return out

    def batch(self) -> int:
        self.seq += 1
        return self.seq - 1


def leading_run(tree, keys) -> int:
    n = 0
    while n < len(keys) and keys[n] in tree:
        n += 1
    return n


def expected_match(views: dict[str, set], keys) -> dict[str, int]:
    out = {}
    for w, view in views.items():
        n = leading_run(view, keys)
        if n:
            out[w] = n
    return out


def check(index: PrefixIndex, refs: dict[str, RefWorker], synced: dict[str, bool], prompts) -> None:
    index.check_invariants()
    views = {w: set(r.tree) if synced[w] else set() for w, r in refs.items()}
    assert index.workers() == sorted(refs)
    for w, view in views.items():
        assert index.keys_of(w) == view
        assert index.num_blocks(w) == len(view)
        assert index.needs_snapshot(w) == (not synced[w])
    assert index.total_entries == sum(len(v) for v in views.values())
    assert index.num_keys == len(set().union(*views.values()))
    for keys in prompts:
        assert index.match(keys) == expected_match(views, keys)


def prompts_for(refs: dict[str, RefWorker], rng: random.Random) -> list[list[bytes]]:
    """Random prompts sharing prefixes with what is cached: a held key's path, extended."""
    out = [chain(None, [rng.randrange(3) for _ in range(rng.randrange(1, 7))]) for _ in range(3)]
    held = sorted({k: p for r in refs.values() for k, p in r.tree.items()}.items())
    for _ in range(4):
        if not held:
            break
        key, _ = held[rng.randrange(len(held))]
        parents = {k: p for r in refs.values() for k, p in r.tree.items()}
        path = [key]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
        path.reverse()
        out.append(path + chain(key, [rng.randrange(3) for _ in range(rng.randrange(3))]))
    return out


sub_op = st.tuples(st.sampled_from(["store"] * 12 + ["evict"] * 3 + ["clear"]), st.integers(0, 1000),
                   st.lists(st.integers(0, 2), min_size=1, max_size=8), st.integers(0, 2))
batch = st.tuples(st.just("batch"), st.integers(0, 5), st.lists(sub_op, min_size=0, max_size=6))
op = st.one_of(
    batch, batch, batch, batch, batch, batch,
    st.tuples(st.just("restart"), st.integers(0, 5)),
    st.tuples(st.just("snapshot"), st.integers(0, 5)),
    st.tuples(st.just("skip_seq"), st.integers(0, 5)),
    st.tuples(st.just("stale_after_snapshot"), st.integers(0, 5), st.integers(0, 1000),
              st.lists(st.integers(0, 2), min_size=1, max_size=3)),
)


@settings(max_examples=300)
@given(n_workers=st.integers(1, 6), ops=st.lists(op, min_size=15, max_size=60), seed=st.integers(0, 2**16))
def test_index_equals_the_union_of_the_reference_trees(n_workers, ops, seed):
    rng = random.Random(seed)
    index = PrefixIndex()
    names = [f"w{i}" for i in range(n_workers)]
    refs = {w: RefWorker() for w in names}
    synced = dict.fromkeys(names, True)
    for w in names:
        index.add_worker(w)

    def pick(ref: RefWorker, i: int) -> bytes | None:
        held = sorted(ref.tree)
        return None if not held or i % (len(held) + 1) == 0 else held[i % (len(held) + 1) - 1]

    for step in ops:
        w = names[step[1] % n_workers]
        ref = refs[w]
        if step[0] == "batch":
            events = []
            for kind, i, labels, order in step[2]:
                if kind == "store":
                    events += ref.store(pick(ref, i), labels)
                elif kind == "evict" and ref.tree:
                    events += ref.evict(sorted(ref.tree)[i % len(ref.tree)], order)
                elif kind == "clear":
                    events += ref.clear()
            assert index.apply(w, ref.batch(), events) is synced[w]
        elif step[0] == "restart":
            index.remove_worker(w)
            index.add_worker(w)
            refs[w], synced[w] = RefWorker(), True
        elif step[0] == "snapshot":
            assert index.apply_snapshot(w, ref.seq - 1, ref.snapshot())
            synced[w] = True
        elif step[0] == "skip_seq":  # a batch lost in transit: the next one is a gap
            ref.batch()
            assert index.apply(w, ref.batch(), []) is False
            synced[w] = False
        elif step[0] == "stale_after_snapshot":  # a batch in flight while the snapshot was taken
            events = ref.store(pick(ref, step[2]), step[3])
            seq = ref.batch()
            assert index.apply_snapshot(w, seq, ref.snapshot())
            synced[w] = True
            assert index.apply(w, seq, events) is True
        check(index, refs, synced, prompts_for(refs, rng))


def test_match_walks_the_leading_run_per_worker():
    idx = PrefixIndex()
    for w in ("a", "b", "c"):
        idx.add_worker(w)
    k = chain(None, [0, 1, 2, 0])
    other = chain(None, [1])
    assert idx.apply("a", 0, [BlocksStored(None, tuple(k))])
    assert idx.apply("b", 0, [BlocksStored(None, tuple(k[:2]))])
    assert idx.apply("c", 0, [BlocksStored(None, tuple(other))])
    assert idx.match(k) == {"a": 4, "b": 2}
    assert idx.match(k[:3]) == {"a": 3, "b": 2}
    assert idx.match(k[1:]) == {"a": 3, "b": 1}  # leading keys held, wherever they start
    assert idx.match(other + k) == {"c": 1}
    assert idx.match([]) == {}
    idx.check_invariants()


def test_real_chained_keys_from_the_radix_tree():
    """Shared system prompt, two users: keys from ``chain_block_keys`` as the workers make them."""
    b = 4
    system = list(range(100, 116))  # 4 blocks

    def keys_of(tokens):
        return chain_block_keys(tokens, b, len(tokens) // b, prev=lora_seed(None))

    user1 = keys_of(system + [1] * 8)
    user2 = keys_of(system + [2] * 12)
    lora = chain_block_keys(system, b, 4, prev=lora_seed(7))
    idx = PrefixIndex()
    idx.add_worker("p0")
    idx.add_worker("p1")
    assert idx.apply("p0", 0, [BlocksStored(None, tuple(user1))])
    # p1 first caches the system prompt, then a user's turn extending it
    assert idx.apply("p1", 0, [BlocksStored(None, tuple(user2[:4]))])
    assert idx.apply("p1", 1, [BlocksStored(user2[3], tuple(fresh(k) for k in user2[4:]))])
    assert idx.num_keys == 4 + 2 + 3 and idx.total_entries == 6 + 7
    assert idx.match(keys_of(system + [2] * 8 + [3] * 4)) == {"p0": 4, "p1": 6}
    assert idx.match(user1) == {"p0": 6, "p1": 4}
    assert idx.match(lora) == {}  # same tokens under a LoRA adapter: other keys
    # p1 evicts the user's turn (leaf first, as the tree releases it)
    assert idx.apply("p1", 2, [BlocksRemoved(tuple(reversed(user2[4:])))])
    assert idx.match(user2) == {"p0": 4, "p1": 4}
    idx.check_invariants()


def _synced_pair():
    idx = PrefixIndex()
    idx.add_worker("a")
    idx.add_worker("b")
    k = chain(None, [0, 0, 0])
    assert idx.apply("a", 0, [BlocksStored(None, tuple(k))])
    assert idx.apply("b", 0, [BlocksStored(None, tuple(k))])
    return idx, k


def _assert_gap(idx, k):
    assert idx.needs_snapshot("a") and idx.num_blocks("a") == 0
    assert idx.match(k) == {"b": 3}  # the other worker is untouched
    idx.check_invariants()
    # later batches are refused until a snapshot arrives
    assert idx.apply("a", 1, []) is False and idx.apply("a", 2, []) is False
    # a snapshot after batch 5 restores exactness; the next batch expected is 6
    assert idx.apply_snapshot("a", 5, [BlocksStored(None, (k[0],)), BlocksStored(k[0], (k[1],))])
    assert not idx.needs_snapshot("a") and idx.match(k) == {"a": 2, "b": 3}
    assert idx.apply("a", 6, [BlocksStored(k[1], (k[2],))])
    assert idx.match(k) == {"a": 3, "b": 3}
    assert idx.apply("a", 8, []) is False  # and numbering is checked again
    idx.check_invariants()


@pytest.mark.parametrize("case", ["skipped_seq", "repeated_seq", "unknown_parent", "stored_twice",
                                  "wrong_parent", "remove_unknown", "remove_orphaning",
                                  "remove_listed_twice"])
def test_gaps_drop_the_worker_and_ask_for_a_snapshot(case):
    idx, k = _synced_pair()
    x = chain(None, [2, 2])
    seq, events = {
        "skipped_seq": (2, []),
        "repeated_seq": (0, []),
        "unknown_parent": (1, [BlocksStored(x[0], (x[1],))]),
        "stored_twice": (1, [BlocksStored(k[1], (k[2],))]),
        "wrong_parent": (1, [BlocksStored(None, (x[0],)), BlocksStored(x[0], (k[2],))]),
        "remove_unknown": (1, [BlocksRemoved((x[0],))]),
        "remove_orphaning": (1, [BlocksRemoved((k[1],))]),  # k[2] would be left without parent
        "remove_listed_twice": (1, [BlocksRemoved((k[2], k[2]))]),
    }[case]
    assert idx.apply("a", seq, events) is False
    _assert_gap(idx, k)


def test_a_gap_mid_batch_leaves_no_partial_state():
    idx, k = _synced_pair()
    x = chain(None, [1, 1, 1])
    events = [BlocksStored(None, tuple(x)), BlocksRemoved((k[2],)), BlocksRemoved((k[2],))]
    assert idx.apply("a", 1, events) is False
    assert idx.num_keys == 3 and idx.match(x) == {}
    _assert_gap(idx, k)


def test_bad_snapshot_keeps_the_worker_waiting():
    idx, k = _synced_pair()
    assert idx.apply_snapshot("a", 3, [BlocksStored(k[0], (k[1],))]) is False  # child before parent
    assert idx.needs_snapshot("a") and idx.num_blocks("a") == 0
    assert idx.apply_snapshot("a", 3, [BlocksRemoved((k[0],))]) is False
    assert idx.apply_snapshot("a", 3, idx.snapshot("b"))
    assert idx.keys_of("a") == idx.keys_of("b")
    idx.check_invariants()


def test_snapshot_round_trips_in_parent_first_form():
    idx = PrefixIndex()
    idx.add_worker("a")
    idx.add_worker("b")
    trunk = chain(None, [0, 0])
    events = [BlocksStored(None, tuple(trunk))]
    for label in range(3):
        branch = chain(trunk[-1], [label, 1, 1])
        events.append(BlocksStored(trunk[-1], tuple(branch)))
        events.append(BlocksStored(branch[0], tuple(chain(branch[0], [2]))))
    assert idx.apply("a", 0, events)
    snap = idx.snapshot("a")
    seen = set()
    for e in snap:  # parents before children, each chain continuing from its parent
        assert e.parent is None or e.parent in seen
        seen.update(e.keys)
    assert seen == idx.keys_of("a")
    assert idx.apply_snapshot("b", 0, snap) and idx.keys_of("b") == idx.keys_of("a")
    idx.check_invariants()


def test_clear_and_all_cleared_keep_the_numbering():
    idx, k = _synced_pair()
    idx.clear("a")
    assert idx.num_blocks("a") == 0 and idx.match(k) == {"b": 3} and not idx.needs_snapshot("a")
    assert idx.apply("a", 1, [BlocksStored(None, (k[0],))])
    assert idx.apply("a", 2, [AllCleared(), BlocksStored(None, tuple(k[:2]))])
    assert idx.match(k) == {"a": 2, "b": 3}
    idx.check_invariants()


def test_slots_are_stable_and_freed_slots_reused_lowest_first():
    idx = PrefixIndex()
    assert [idx.add_worker(w) for w in "abcd"] == [0, 1, 2, 3]
    k = chain(None, [0])
    assert idx.apply("d", 0, [BlocksStored(None, tuple(k))])
    idx.remove_worker("c")
    idx.remove_worker("a")
    assert idx.slot("d") == 3 and idx.match(k) == {"d": 1}
    assert idx.add_worker("e") == 0 and idx.add_worker("f") == 2 and idx.add_worker("g") == 4
    assert idx.match(k) == {"d": 1}  # a reused slot starts empty
    with pytest.raises(ValueError):
        idx.add_worker("d")
    idx.check_invariants()


def test_remove_worker_drops_every_entry_at_once():
    idx, k = _synced_pair()
    idx.remove_worker("a")
    assert idx.total_entries == 3 and idx.match(k) == {"b": 3}
    idx.remove_worker("b")
    assert idx.total_entries == 0 and idx.num_keys == 0 and idx.match(k) == {}
    idx.check_invariants()


def test_keys_are_stored_once_however_many_workers_hold_them():
    idx = PrefixIndex()
    k = chain(None, [0, 1])
    for w in "abc":
        idx.add_worker(w)
        assert idx.apply(w, 0, [BlocksStored(None, tuple(fresh(x) for x in k))])
    objs = {id(x) for w in "abc" for x in idx._workers[w].held}
    assert len(objs) == 2
    idx.check_invariants()

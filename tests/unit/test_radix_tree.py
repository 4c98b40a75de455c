"""Block-key tree: chained keys, match, insert, LRU eviction with subtree uncaching."""
from __future__ import annotations

import pytest

from pdserve.scheduler.radix_tree import RadixTree, chain_block_keys, lora_seed

B = 4


def keys_of(tokens: list[int], lora: int | None = None) -> list[bytes]:
    return chain_block_keys(tokens, B, len(tokens) // B, prev=lora_seed(lora))


def test_chained_keys_identify_the_whole_prefix():
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8])
    b = keys_of([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and all(isinstance(k, bytes) for k in a)
    assert a[1] != b[1]  # same second block, different prefix
    assert keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])[:2] == a  # extension keeps the prefix


def test_lora_id_separates_keys():
    assert keys_of([1, 2, 3, 4], lora=None) != keys_of([1, 2, 3, 4], lora=7)
    assert keys_of([1, 2, 3, 4], lora=7) == keys_of([1, 2, 3, 4], lora=7)


def test_chain_extension_from_a_cached_prefix():
    tokens = list(range(16))
    full = keys_of(tokens)
    part = keys_of(tokens[:8])
    chain_block_keys(tokens, B, 4, start=2, prev=part[-1], out=part)
    assert part == full


def test_insert_and_match_leading_run():
    tree = RadixTree()
    k = keys_of(list(range(12)))
    assert tree.insert(k, [5, 6, 7]) == [5, 6, 7]
    assert tree.match(k) == [5, 6, 7]
    assert tree.match(k, limit=2) == [5, 6]
    other = keys_of([0, 1, 2, 3, 9, 9, 9, 9])
    assert tree.match(other) == [5]
    assert tree.walk(other, 2) == ([5], other[1])
    assert tree.walk(k, 3) == ([5, 6, 7], None)
    assert tree.num_cached == 3
    tree.check_invariants()


def test_insert_keeps_the_cached_block_for_a_duplicate_key():
    tree = RadixTree()
    k = keys_of(list(range(8)))
    tree.insert(k[:1], [1])
    assert tree.insert(k, [2, 3]) == [3]  # block 2 duplicates key 0: it stays private
    assert tree.match(k) == [1, 3]
    assert not tree.is_cached(2)
    tree.check_invariants()


def test_a_block_cannot_be_cached_under_two_keys():
    tree = RadixTree()
    tree.insert(keys_of([1, 1, 1, 1]), [0])
    with pytest.raises(ValueError):
        tree.insert(keys_of([2, 2, 2, 2]), [0])


def test_lru_eviction_order_and_mark_used():
    tree = RadixTree()
    tree.insert(keys_of([1] * 4), [10])
    tree.insert(keys_of([2] * 4), [20])
    tree.insert(keys_of([3] * 4), [30])
    for blk in (20, 10, 30):
        tree.mark_free(blk)
    tree.mark_used(10)  # reused: no longer evictable
    assert list(tree.free_cached_blocks()) == [20, 30]
    tree.mark_free(10)  # released again: most recently used
    assert tree.evict_lru() == (20, [])
    assert tree.evict_lru() == (30, [])
    assert tree.evict_lru() == (10, [])
    assert tree.num_cached == 0 and tree.num_free_cached == 0
    with pytest.raises(LookupError):
        tree.evict_lru()


def test_evicting_an_inner_node_uncaches_its_subtree():
    tree = RadixTree()
    k = keys_of(list(range(12)))
    tree.insert(k, [1, 2, 3])
    side = keys_of([0, 1, 2, 3, 7, 7, 7, 7])
    tree.insert(side, [1, 4])
    # 1 is free and oldest; 3 is free; 2 and 4 are held by live sequences.
    tree.mark_free(1)
    tree.mark_free(3)
    evicted, released = tree.evict_lru()
    assert evicted == 1 and released == [3]
    assert tree.num_cached == 0 and tree.num_free_cached == 0
    assert tree.match(k) == []
    tree.check_invariants()


def test_mark_free_of_an_uncached_block_is_an_error():
    with pytest.raises(KeyError):
        RadixTree().mark_free(3)


def test_walk_counting_matches_a_root_down_walk():
    tree = RadixTree()
    k = keys_of(list(range(20)))
    tree.insert(k[:4], [1, 2, 3, 4])
    tree.mark_free(2)  # a free block in the middle of the run
    tree.mark_free(4)
    assert tree.walk_counting(k, 5) == (2, 4, k[4])
    assert tree.walk_counting(k, 4) == (2, 4, None)
    assert tree.walk_counting(k, 0) == (0, 0, None)
    assert tree.walk(k, 5) == ([1, 2, 3, 4], k[4])
    tree.mark_used(2)
    assert tree.walk_counting(k, 3) == (3, 3, None)


def test_version_changes_with_every_walk_relevant_change():
    tree = RadixTree()
    k = keys_of(list(range(8)))
    seen = {tree.version}
    tree.insert(k, [1, 2])
    seen.add(tree.version)
    tree.insert(k, [1, 2])  # nothing new: same version
    assert tree.version in seen and len(seen) == 2
    for op in (lambda: tree.mark_free(2), lambda: tree.mark_used(2), lambda: tree.mark_free(2),
               tree.evict_lru):
        op()
        assert tree.version not in seen
        seen.add(tree.version)

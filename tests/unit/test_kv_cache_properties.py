"""Property tests: random operation sequences keep the KV block accounting consistent."""
from __future__ import annotations

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.scheduler.kv_cache import KVCacheManager, KVCacheOutOfBlocksError
from pdserve.scheduler.kv_events import BlocksRemoved, BlocksStored
from pdserve.scheduler.request import LlmRequest

# Three prompt families so that prefixes are shared often.
_FAMILIES = [[f * 100 + i for i in range(24)] for f in range(3)]


def _state(m: KVCacheManager) -> tuple:
    return (m.get_stats(), [m.get_ref_count(b) for b in range(m.num_blocks)])


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 40),
        tokens_per_block=st.sampled_from([2, 4]),
        reuse=st.booleans(),
        window=st.sampled_from([None, None, 6, 12]),
    )
    def setup(self, num_blocks: int, tokens_per_block: int, reuse: bool, window) -> None:
        self.m = KVCacheManager(
            num_blocks, tokens_per_block, enable_block_reuse=reuse, max_attention_window=window
        )
        self.live: dict[int, LlmRequest] = {}
        self.next_id = 0
        self.replayed: dict[bytes, bytes | None] = {}  # key -> parent, rebuilt from KV events

    def _pick(self, index: int) -> int:
        ids = sorted(self.live)
        return ids[index % len(ids)]

    def _holders(self) -> dict[int, set[int]]:
        holders: dict[int, set[int]] = {}
        for rid, r in self.live.items():
            for beam in range(r.beam_width):
                for blk in self.m.get_block_ids(rid, beam):
                    holders.setdefault(blk, set()).add(rid)
        return holders

    # ---- operations ---------------------------------------------------------------------------
    @rule(
        family=st.integers(0, 2),
        shared=st.integers(0, 24),
        tail=st.lists(st.integers(0, 3), max_size=6),
        lora=st.sampled_from([None, 1]),
        beam=st.sampled_from([1, 1, 2]),
    )
    def add(self, family: int, shared: int, tail: list[int], lora, beam: int) -> None:
        tokens = _FAMILIES[family][:shared] + tail
        if not tokens:
            tokens = [7]
        rid = self.next_id
        self.next_id += 1
        r = LlmRequest(rid, tokens, 16, lora_task_id=lora, beam_width=beam)
        summary = self.m.analyze_prefix_reuse(r.get_tokens(0), r)
        # The indexed walk agrees with a plain root-down walk.
        count = (len(tokens) - 1) // self.m.tokens_per_block
        if count > 0:
            keys = r.block_key_cache[(self.m.tokens_per_block, False)].keys
            ids, first_new = self.m._tree.walk(keys, count)
            held = sum(1 for blk in ids if self.m.get_ref_count(blk) > 0)
            assert summary == (held, len(ids), first_new)
        before = _state(self.m)
        try:
            self.m.add_sequence(r)
        except KVCacheOutOfBlocksError:
            assert _state(self.m) == before and not self.m.has_sequence(rid)
            return
        self.live[rid] = r
        b = self.m.tokens_per_block
        window = self.m.max_attention_window
        if self.m.enable_block_reuse and (window is None or len(tokens) <= window):
            # add_sequence takes exactly the run the analysis saw.
            assert r.prepopulated_prompt_len == summary.reusable_blocks_all * b
            assert self.m.num_reused_blocks == before[0].reused + summary.reusable_blocks_all
        else:
            assert r.prepopulated_prompt_len == 0
        assert self.m.get_num_tokens(rid) == len(tokens)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def add_token(self, index: int) -> None:
        rid = self._pick(index)
        before = _state(self.m)
        tokens = self.m.get_num_tokens(rid)
        try:
            self.m.add_token(rid)
        except KVCacheOutOfBlocksError:
            assert _state(self.m) == before and self.m.get_num_tokens(rid) == tokens
            return
        assert self.m.get_num_tokens(rid) == tokens + 1

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def store(self, index: int) -> None:
        rid = self._pick(index)
        used = self.m.get_num_used_blocks()
        self.m.store_context_blocks(self.live[rid])
        assert self.m.get_num_used_blocks() == used

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def remove(self, index: int) -> None:
        rid = self._pick(index)
        assert self.m.remove_sequence(rid)
        del self.live[rid]
        assert not self.m.has_sequence(rid)

    @rule(victims=st.lists(st.integers(0, 100), max_size=4))
    def scheduling_round(self, victims: list[int]) -> None:
        before = _state(self.m)
        self.m.start_scheduling()
        removed: set[int] = set()
        for index in victims:
            if self.live:
                rid = self._pick(index)
                self.m.scheduling_remove_sequence(rid)
                removed.add(rid)
        # A block is simulated free once every live holder is removed.
        expected = self.m.get_num_free_blocks() + sum(
            1 for holders in self._holders().values() if holders <= removed
        )
        assert self.m.get_scheduling_num_free_blocks() == expected
        assert self.m.scheduling_has_free_blocks(expected)
        assert not self.m.scheduling_has_free_blocks(expected + 1)
        assert _state(self.m) == before

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def stray_scheduling_remove(self, index: int) -> None:
        # Outside a fresh round (stale epoch): still never touches real state.
        before = _state(self.m)
        self.m.scheduling_remove_sequence(self._pick(index))
        assert _state(self.m) == before

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def accounting(self) -> None:
        m = self.m
        stats = m.get_stats()
        assert stats.free + stats.used == stats.total == m.num_blocks
        assert all(m.get_ref_count(b) >= 0 for b in range(m.num_blocks))
        holders = self._holders()
        for blk, rids in holders.items():
            assert m.get_ref_count(blk) == len(rids)
            if len(rids) > 1 and m.max_attention_window is None:
                # Only a cached (reused) block may be handed to two live sequences. (A sliding
                # window may detach, and so let eviction uncache, a shared block's ancestor.)
                assert m._tree.is_cached(blk)
        assert stats.used == len(holders)
        m.check_invariants()

    @invariant()
    def kv_events_replay_to_the_cache(self) -> None:
        """The KV events, replayed in order, rebuild exactly the cached set, and every event is
        consistent with the set before it (a store extends a held key or the root, a removal
        names held keys); a snapshot gives the same set, parents first."""
        if self.m.kv_events is None:
            return
        events, overflowed = self.m.kv_events.drain()
        assert not overflowed
        have = self.replayed
        for event in events:
            if isinstance(event, BlocksStored):
                parent = event.parent
                assert parent is None or parent in have
                for key in event.keys:
                    assert key not in have
                    have[key] = parent
                    parent = key
            elif isinstance(event, BlocksRemoved):
                for key in event.keys:
                    assert key in have
                for key in event.keys:
                    del have[key]
                # eviction takes whole subtrees: nothing left points at a removed key
                removed = set(event.keys)
                assert not any(p in removed for p in have.values())
            else:
                have.clear()
        seen: dict[bytes, bytes | None] = {}
        for stored in self.m.kv_snapshot():
            parent = stored.parent
            assert parent is None or parent in seen  # parents before children
            for key in stored.keys:
                seen[key] = parent
                parent = key
        assert seen == have
        assert len(have) == self.m.get_num_cached_blocks()

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for rid in list(self.live):
            self.m.remove_sequence(rid)
        stats = self.m.get_stats()
        assert stats.free == stats.total and stats.used == 0
        assert self.m._tree.num_free_cached == stats.cached
        self.m.check_invariants()


KVCacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheProperties = KVCacheMachine.TestCase

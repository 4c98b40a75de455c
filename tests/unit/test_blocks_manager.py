"""Scheduled-blocks managers (reference 2.3 and 2.6)."""
from __future__ import annotations

from pdserve.scheduler.blocks_manager import (
    MaxUtilizationScheduledBlocksManager,
    NoEvictScheduledBlocksManager,
)
from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.kv_prefix_reuse import PrefixReuseSummary
from pdserve.scheduler.request import LlmRequest, LlmRequestState as S

B = 10


def req(rid: int, p: int, n: int = 10, **kw) -> LlmRequest:
    return LlmRequest(rid, list(range(p)), n, **kw)


def test_no_evict_check_caches_need_and_commit_subtracts_it():
    m = KVCacheManager(10, B)
    blocks = NoEvictScheduledBlocksManager(m)
    assert blocks.available == 10
    big, small = req(1, 25, 100), req(2, 25, 10)  # need 2 + 11 = 13, 2 + 2 = 4
    assert not blocks.check(big)
    assert blocks.available == 10  # a check alone reserves nothing
    assert blocks.check(small)
    blocks.commit()
    assert blocks.available == 6
    assert blocks.check(small)
    blocks.commit()
    assert blocks.available == 2 and not blocks.check(small)


def test_no_evict_starts_from_the_free_blocks_and_can_go_negative():
    m = KVCacheManager(10, B)
    running = req(1, 50, 40)
    m.add_sequence(running)  # 5 blocks held, 4 more to completion
    running.state = S.GENERATION_IN_PROGRESS
    blocks = NoEvictScheduledBlocksManager(m)
    assert blocks.available == 5
    blocks.decrement_unchecked(running)
    assert blocks.available == 1
    blocks.decrement_unchecked(req(2, 30, 20))
    assert blocks.available == 1 - 5


def test_no_evict_passes_the_summary():
    m = KVCacheManager(10, B, enable_block_reuse=True)
    a = req(1, 31)
    m.add_sequence(a)
    m.store_context_blocks(a)  # 3 cached blocks, held
    blocks = NoEvictScheduledBlocksManager(m)
    assert blocks.available == 6
    r = req(2, 31, 49)  # 3 ctx blocks + 5 generation blocks
    assert not blocks.check(r, PrefixReuseSummary(0, 0, None))  # 8 > 6
    assert blocks.check(r)  # credit computed by the manager: 5
    assert r.estimated_reusable_tokens == 30
    blocks.commit()
    assert blocks.available == 1


def test_max_utilization_accumulates_one_step_needs():
    m = KVCacheManager(10, B)
    m.start_scheduling()
    blocks = MaxUtilizationScheduledBlocksManager(m, two_steps_look_ahead=False)
    assert blocks.scheduled == 0
    total = blocks.prepare_blocks_if_schedulable(req(1, 45))  # 5 blocks
    assert total == 5 and blocks.scheduled == 0  # nothing changes until update
    blocks.update_scheduled_blocks(total)
    total = blocks.prepare_blocks_if_schedulable(req(2, 41))
    assert total == 10
    blocks.update_scheduled_blocks(total)
    assert blocks.prepare_blocks_if_schedulable(req(3, 5)) is None
    assert blocks.scheduled == 10


def test_max_utilization_sees_scheduling_removals():
    m = KVCacheManager(10, B)
    running = req(1, 80, 40)
    m.add_sequence(running)
    running.state = S.GENERATION_IN_PROGRESS
    m.start_scheduling()
    blocks = MaxUtilizationScheduledBlocksManager(m, two_steps_look_ahead=True)
    new = req(2, 35)
    assert blocks.prepare_blocks_if_schedulable(new) is None  # needs 4, 2 free
    m.scheduling_remove_sequence(1)  # pausing the running request frees its 8 blocks
    assert blocks.prepare_blocks_if_schedulable(new) == 4
    assert m.get_num_free_blocks() == 2  # real state untouched


def test_max_utilization_passes_the_summary_and_two_step_flag():
    m = KVCacheManager(10, B, enable_block_reuse=True)
    a = req(1, 31, 40)
    m.add_sequence(a)
    m.store_context_blocks(a)
    m.start_scheduling()
    blocks = MaxUtilizationScheduledBlocksManager(m, two_steps_look_ahead=True)
    r = req(2, 31)
    assert blocks.prepare_blocks_if_schedulable(r, PrefixReuseSummary(0, 0, None)) == 4
    assert blocks.prepare_blocks_if_schedulable(r) == 1
    a.state = S.GENERATION_IN_PROGRESS
    a.draft_tokens = [1] * 9  # 31 + 2 * 10 = 51: 6 blocks, 4 held
    assert blocks.prepare_blocks_if_schedulable(a) == 2


class _MinimalKV:
    """A double with only the DESIGN.md signatures (no summary parameter)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def get_num_free_blocks(self) -> int:
        return 3

    def get_remaining_blocks_to_completion(self, request):
        self.calls.append(("remaining", request))
        return 2

    def get_needed_blocks_one_step(self, request, two_steps_look_ahead):
        self.calls.append(("one_step", request, two_steps_look_ahead))
        return 1

    def scheduling_has_free_blocks(self, num_blocks):
        return num_blocks <= 3


def test_managers_work_with_a_minimal_double():
    fake = _MinimalKV()
    r = req(1, 5)
    no_evict = NoEvictScheduledBlocksManager(fake)
    assert no_evict.check(r)
    no_evict.commit()
    assert no_evict.available == 1
    mu = MaxUtilizationScheduledBlocksManager(fake, True)
    assert mu.prepare_blocks_if_schedulable(r) == 1
    assert fake.calls == [("remaining", r), ("one_step", r, True)]

"""The capacity policies' block budgets (scheduling.md 2.3 and 2.6), seen through the calls a KV
pool receives: GUARANTEED_NO_EVICT reserves each admitted request's blocks to completion from the
free count at the start of the pass, MAX_UTILIZATION tests the running total of next-step needs
against the scheduling free count, which pauses raise. The pools here are doubles with only the
public names of the contract (two-argument signatures included), so these are also the contract.
"""
from __future__ import annotations

from pdserve.scheduler import CapacityScheduler, CapacitySchedulerPolicy, PrefixReuseSummary
from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.request import LlmRequest, LlmRequestState as S

B = 10
GNE, MAXU = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, CapacitySchedulerPolicy.MAX_UTILIZATION
ZERO = PrefixReuseSummary(0, 0, None)


def req(rid: int, p: int, n: int = 10, **kw) -> LlmRequest:
    return LlmRequest(rid, list(range(p)), n, **kw)


def ids(requests: list[LlmRequest]) -> list[int]:
    return [r.request_id for r in requests]


class MinimalKV:
    """Only the contract's names, with its two-argument signatures (no ``summary``): fixed free
    counts and per-request needs, every call recorded."""

    enable_block_reuse = False
    is_variable_window = False

    def __init__(self, free: int, remaining: dict[int, int] | None = None,
                 one_step: dict[int, int] | None = None, held: dict[int, int] | None = None):
        self.free = free
        self.sched_free = free
        self.remaining = remaining or {}
        self.one_step = one_step or {}
        self.held = held or {}
        self.calls: list[tuple] = []

    def get_num_free_blocks(self) -> int:
        self.calls.append(("free",))
        return self.free

    def get_remaining_blocks_to_completion(self, request):
        self.calls.append(("remaining", request.request_id))
        return self.remaining[request.request_id]

    def get_needed_blocks_one_step(self, request, two_steps_look_ahead):
        self.calls.append(("one_step", request.request_id, two_steps_look_ahead))
        return self.one_step[request.request_id]

    def scheduling_has_free_blocks(self, num_blocks):
        self.calls.append(("has_free", num_blocks))
        return num_blocks <= self.sched_free

    def analyze_prefix_reuse(self, tokens, request):  # reuse is off: never asked
        raise AssertionError("analyze_prefix_reuse called with reuse off")

    def start_scheduling(self) -> None:
        self.calls.append(("start",))
        self.sched_free = self.free

    def scheduling_remove_sequence(self, request_id: int) -> None:
        self.calls.append(("remove", request_id))
        self.sched_free += self.held.pop(request_id, 0)


class RecordingKV(KVCacheManager):
    """A real manager (a subclass: read through its public methods) recording the summaries and
    look-ahead flags its estimates receive."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple] = []

    def get_remaining_blocks_to_completion(self, request, summary=None):
        self.seen.append(("remaining", request.request_id, summary))
        return super().get_remaining_blocks_to_completion(request, summary)

    def get_needed_blocks_one_step(self, request, two_steps_look_ahead, summary=None):
        self.seen.append(("one_step", request.request_id, two_steps_look_ahead, summary))
        return super().get_needed_blocks_one_step(request, two_steps_look_ahead, summary)


def generating(rid: int, p: int = 5) -> LlmRequest:
    r = req(rid, p)
    r.state = S.GENERATION_IN_PROGRESS
    return r


# ---- GUARANTEED_NO_EVICT (2.3) ----------------------------------------------------------------
def test_no_evict_reserves_from_the_free_count_at_the_start_and_a_misfit_reserves_nothing():
    kv = MinimalKV(10, remaining={1: 13, 2: 4, 3: 4, 4: 4})
    out = CapacityScheduler(8, GNE).schedule([req(2, 5), req(3, 5), req(4, 5)], kv)
    assert ids(out.fitting) == [2, 3]  # 4 + 4 of 10; the third needs 4 of the 2 left
    assert kv.calls == [("free",), ("remaining", 2), ("remaining", 3), ("remaining", 4)]
    kv.calls.clear()
    out = CapacityScheduler(8, GNE).schedule([req(1, 5), req(2, 5)], kv)
    assert ids(out.fitting) == []  # a block misfit breaks: 2 is never asked
    assert kv.calls == [("free",), ("remaining", 1)]


def test_no_evict_running_requests_overdraw_the_budget():
    kv = MinimalKV(3, remaining={1: 2, 2: 2, 3: 2, 4: 0})
    requests = [generating(1), generating(2), generating(3), req(4, 5)]
    out = CapacityScheduler(8, GNE).schedule(requests, kv)
    # 3 - 6 = -3 blocks left: even a request needing nothing does not fit.
    assert ids(out.fitting) == [1, 2, 3]
    assert ("remaining", 4) in kv.calls


def test_no_evict_passes_the_summary_only_when_there_is_one():
    kv = RecordingKV(10, B, enable_block_reuse=True)
    a = req(100, 31)
    kv.add_sequence(a)
    kv.store_context_blocks(a)  # 3 cached blocks, held; 6 free
    r = req(2, 31, 49)  # 3 context blocks + 5 generation blocks, or 5 with the 3 held credited
    out = CapacityScheduler(8, GNE, enable_prefix_aware_scheduling=False).schedule([r], kv)
    assert ids(out.fitting) == [] and kv.seen == [("remaining", 2, ZERO)]  # no credit: 8 > 6
    kv.seen.clear()
    out = CapacityScheduler(8, GNE).schedule([r], kv)
    assert ids(out.fitting) == [2] and r.estimated_reusable_tokens == 30
    assert kv.seen == [("remaining", 2, PrefixReuseSummary(3, 3, None))]
    kv.seen.clear()
    g = generating(3)
    CapacityScheduler(8, GNE).schedule([g], kv)
    assert kv.seen == [("remaining", 3, None)]  # a running request: no summary


# ---- MAX_UTILIZATION (2.6) --------------------------------------------------------------------
def test_max_utilization_tests_the_running_total_of_next_step_needs():
    kv = MinimalKV(10, one_step={1: 5, 2: 5, 3: 1})
    out = CapacityScheduler(8, MAXU).schedule([req(1, 45), req(2, 41), req(3, 5)], kv)
    assert ids(out.fitting) == [1, 2] and ids(out.paused) == []  # 3 fails, nothing to pause
    assert kv.calls == [
        ("start",), ("one_step", 1, False), ("has_free", 5), ("one_step", 2, False),
        ("has_free", 10), ("one_step", 3, False), ("has_free", 11),
    ]


def test_max_utilization_retries_against_what_a_pause_freed():
    kv = MinimalKV(2, one_step={1: 1, 2: 4}, held={1: 8})
    running = generating(1)
    new = req(2, 35)
    out = CapacityScheduler(8, MAXU, two_steps_look_ahead=True).schedule([new, running], kv)
    assert ids(out.fitting) == [2] and ids(out.paused) == [1]
    # The need is asked for once; the free test again after the pause.
    assert kv.calls == [("start",), ("one_step", 2, True), ("has_free", 4), ("remove", 1),
                        ("has_free", 4)]


def test_max_utilization_passes_the_summary_and_the_look_ahead_flag():
    kv = RecordingKV(10, B, enable_block_reuse=True)
    a = req(1, 31, 40)
    kv.add_sequence(a)
    kv.store_context_blocks(a)
    a.context_current_position = 31
    a.state = S.GENERATION_IN_PROGRESS
    r = req(2, 31)
    CapacityScheduler(8, MAXU, two_steps_look_ahead=True,
                      enable_prefix_aware_scheduling=False).schedule([a, r], kv)
    assert kv.seen == [("one_step", 1, True, None), ("one_step", 2, True, ZERO)]
    kv.seen.clear()
    CapacityScheduler(8, MAXU).schedule([a, r], kv)
    assert kv.seen == [("one_step", 1, False, None),
                       ("one_step", 2, False, PrefixReuseSummary(3, 3, None))]

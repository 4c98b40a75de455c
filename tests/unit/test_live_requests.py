"""lifecycle.live_requests / count_by_state: the one definition of what a worker holds, behind
EngineCore.status, EngineCore.request_states and the metrics' request gauges."""
from __future__ import annotations

from pdserve.scheduler import LlmRequest, LlmRequestState, lifecycle

S = LlmRequestState


def _req(rid: int, state: LlmRequestState) -> LlmRequest:
    r = LlmRequest(rid, [1, 2, 3], 4)
    r.state = state
    return r


def test_each_request_counts_once_wherever_it_is_held():
    active = [_req(1, S.GENERATION_IN_PROGRESS), _req(2, S.CONTEXT_INIT)]
    waiting = [_req(3, S.CONTEXT_INIT)]
    leased = {4: _req(4, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)}
    draining = {5: _req(5, S.DISAGG_GENERATION_TRANS_IN_PROGRESS), 1: active[0]}  # 1 twice
    live = lifecycle.live_requests(active, waiting, leased, draining)
    assert sorted(live) == [1, 2, 3, 4, 5]
    assert lifecycle.count_by_state(live.values()) == {
        "GENERATION_IN_PROGRESS": 1, "CONTEXT_INIT": 2, "DISAGG_CONTEXT_TRANS_IN_PROGRESS": 1,
        "DISAGG_GENERATION_TRANS_IN_PROGRESS": 1}
    assert lifecycle.live_requests([], []) == {} and lifecycle.count_by_state([]) == {}

"""The engine core's pure parts, without a model: admission refuses with the field's name, the
stop check keeps vLLM's order, a regenerated position keeps what the client was shown, and the
windowed KV manager's bound charges every candidate."""
from __future__ import annotations

import pytest

from pdserve.scheduler import (CapacitySchedulerPolicy, ContextPhaseParams, KVCacheManager,
                               LlmRequest, LlmRequestType)
from pdserve.scheduler.kv_window import SlidingWindowKVCacheManager
from pdserve.transport.requests.sampling import SamplingParams
from pdserve.workers.engine.admission import AdmissionLimits, check_request
from pdserve.workers.engine.outputs import reconcile_emitted, stop_reason

LIMITS = AdmissionLimits(vocab_size=100, max_seq_len=64, max_input_len=32, pool_blocks=10,
                         policy=CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
KV = KVCacheManager(10, 4)


def _check(request, params=None, limits=LIMITS, kv=KV, **kwargs):
    return check_request(request, params or SamplingParams(max_tokens=4), limits, kv, **kwargs)


def test_a_request_that_fits_is_admitted_with_its_max_tokens_clamped():
    limits = AdmissionLimits(100, 64, 32, 16, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    ok = _check(LlmRequest(1, [1] * 20, 100), limits=limits, kv=KVCacheManager(16, 4))
    assert ok.max_new_tokens == 44 and ok.output_start == 20 and ok.forced == []


@pytest.mark.parametrize("request_, kwargs, field", [
    (LlmRequest(1, [1] * 33, 4), {}, "max_input_len"),
    (LlmRequest(1, [1, 200], 4), {}, "vocabulary"),
    (LlmRequest(1, [1] * 30, 20), {}, "KV blocks"),
    (LlmRequest(1, [1, 2], 4), {"forced_tokens": [1, 2, 3, 4, 5]}, "forced_tokens"),
    (LlmRequest(1, [1, 2], 4), {"forced_tokens": [100]}, "forced_tokens"),
    (LlmRequest(1, [1, 2], 4), {"output_start": 3}, "output_start"),
    (LlmRequest(1, [1, 2], 4), {"stream_kv": True}, "stream_kv"),
    (LlmRequest(1, [1, 2], 4, llm_request_type=LlmRequestType.CONTEXT_ONLY), {}, "KV sender"),
    (LlmRequest(1, [1, 2], 4, llm_request_type=LlmRequestType.GENERATION_ONLY,
                context_phase_params=ContextPhaseParams(1, [5], b"x", None)), {}, "KV receiver"),
])
def test_a_refusal_names_the_field(request_, kwargs, field):
    with pytest.raises(ValueError, match=field):
        _check(request_, **kwargs)


def test_several_candidates_start_from_their_prompt():
    with pytest.raises(ValueError, match="n/best_of"):
        _check(LlmRequest(1, [1, 2], 4), SamplingParams(max_tokens=4, n=2), forced_tokens=[3])


def test_a_generation_only_request_needs_its_first_token():
    limits = AdmissionLimits(100, 64, 32, 10, CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
                             can_receive=True)
    cpp = ContextPhaseParams(1, [], b"x", None)
    with pytest.raises(ValueError, match="first generated token"):
        _check(LlmRequest(1, [1, 2], 4, llm_request_type=LlmRequestType.GENERATION_ONLY,
                          context_phase_params=cpp), limits=limits, forced_tokens=[7])
    cpp = ContextPhaseParams(1, [5], b"x", None)
    ok = _check(LlmRequest(1, [1, 2], 4, llm_request_type=LlmRequestType.GENERATION_ONLY,
                           context_phase_params=cpp), limits=limits)
    assert ok.emitted == [5]  # the client has it from the context worker


def test_under_a_window_every_candidate_is_charged():
    kv = SlidingWindowKVCacheManager(10, 4, attention_window=8, max_num_tokens=4, scratch_block=10)
    one = kv.blocks_to_completion_bound(8, 24)
    assert one == -(-min(32, 8 + kv.temporary_attention_window) // 4) + 1
    assert kv.blocks_to_completion_bound(8, 24, 3) == 3 * one
    assert KV.blocks_to_completion_bound(8, 24, 3) == 8  # full attention: shared prompt, no charge
    with pytest.raises(ValueError, match="for 3 candidates"):
        _check(LlmRequest(1, [1] * 8, 24), SamplingParams(max_tokens=24, n=3), kv=kv)
    limits = AdmissionLimits(100, 64, 32, 10, CapacitySchedulerPolicy.MAX_UTILIZATION)
    _check(LlmRequest(1, [1] * 8, 24), SamplingParams(max_tokens=24, n=3), kv=kv, limits=limits)


def test_stop_reasons_in_vllms_order():
    def reason(token, **kw):
        base = dict(eos_token_ids={2}, ignore_eos=False, grammar_done=False, stop_token_ids={7},
                    reached_max_tokens=False)
        return stop_reason(token, **{**base, **kw})

    assert reason(5) is None
    assert reason(2) == "stop" and reason(2, reached_max_tokens=True) == "stop"
    assert reason(2, ignore_eos=True) is None
    assert reason(2, ignore_eos=True, reached_max_tokens=True) == "length"
    assert reason(7, reached_max_tokens=True) == "stop"
    assert reason(5, grammar_done=True) == "stop"
    assert reason(5, reached_max_tokens=True) == "length"


def test_a_regenerated_position_keeps_what_the_client_has():
    emitted = [4, 5, 6]
    generated = [4, 9]  # a pause clamped at max_input_len regenerated position 1 as 9
    assert reconcile_emitted(generated, emitted) == [] and generated == [4, 5]
    generated = [4, 5, 6, 8]
    assert reconcile_emitted(generated, emitted) == [8] and emitted == [4, 5, 6, 8]

"""workers/wire.py: the one request/update conversion of the request path round-trips every
field, agent hierarchy and client id included (the RPC worker's own copy used to drop the
hierarchy)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.scheduler import ContextPhaseParams, LlmRequest, LlmRequestType
from pdserve.workers.wire import params_to_wire, request_from_wire, request_to_wire

tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)
params = st.builds(
    ContextPhaseParams, ctx_request_id=st.integers(0, 2**40), first_gen_tokens=st.lists(st.integers(0, 10**6), min_size=1, max_size=2),
    opaque_state=st.binary(max_size=40), draft_tokens=st.none(), prompt_token_ids=tokens,
    ctx_worker_id=st.text(min_size=1, max_size=8), num_blocks=st.integers(0, 100))


@given(rid=st.integers(0, 2**40), prompt=tokens, max_new=st.integers(0, 4096),
       priority=st.floats(0, 1), kind=st.sampled_from(list(LlmRequestType)),
       hierarchy=st.none() | st.lists(st.tuples(st.sampled_from(["AgentDeepResearch", "AgentChat"]),
                                                st.integers(0, 9)), max_size=3),
       client=st.none() | st.text(max_size=20), cpp=st.none() | params)
def test_request_round_trip(rid, prompt, max_new, priority, kind, hierarchy, client, cpp):
    request = LlmRequest(rid, prompt, max_new, priority=priority, llm_request_type=kind,
                         agent_hierarchy=hierarchy, client_id=client, context_phase_params=cpp)
    back = request_from_wire(request_to_wire(request))
    assert (back.request_id, list(back.get_prompt_tokens()), back.max_new_tokens, back.priority,
            back.llm_request_type, back.agent_hierarchy, back.client_id) == (
        rid, prompt, max_new, priority, kind, request.agent_hierarchy, client)
    if cpp is None:
        assert back.context_phase_params is None
    else:
        assert params_to_wire(back.context_phase_params) == params_to_wire(cpp)

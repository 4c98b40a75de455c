"""Router policies: prompt block keys, worker selection (kv-aware on the prefix index's
matches), conditional disaggregation, retries and request validation (scheduling.md 7.5,
docs/design.md section 3)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.policies import (
    ROUTING_MODES,
    DisaggregationMode,
    GenerationLoadPolicy,
    KvAwarePolicy,
    KvAwareWeights,
    LeastLoadedPolicy,
    NoWorkerAvailable,
    PrefillRoute,
    PromptInfo,
    RetryAction,
    RoundRobinPolicy,
    WorkerLoad,
    WorkerRole,
    blocks_needed_for_prompt,
    decide_prefill,
    make_policy,
    matched_tokens,
    needs_remote_prefill,
    plan_retry,
    plan_transfer_fallback,
)
from pdserve.scheduler.kv_cache import KVCacheManager
from pdserve.scheduler.radix_tree import chain_block_keys, lora_seed, prompt_block_keys
from pdserve.scheduler.request import LlmRequest
from pdserve.cluster.validation import (
    GenerateSpec,
    ValidationError,
    ValidationLimits,
    sampling_params,
    validate_generate_spec,
)
from pdserve.transport.requests.sampling import SamplingParams

CTX, GEN = WorkerRole.CONTEXT, WorkerRole.GENERATION
TPB = 4


def ctx(wid: str, **kw) -> WorkerLoad:
    return WorkerLoad(wid, CTX, **kw)


def gen(wid: str, **kw) -> WorkerLoad:
    kw.setdefault("free_kv_blocks", 100)
    kw.setdefault("total_kv_blocks", 100)
    return WorkerLoad(wid, GEN, **kw)


def prompt(n: int, tpb: int = TPB, offset: int = 0) -> PromptInfo:
    return PromptInfo.from_tokens([offset + i for i in range(n)], tpb)


# ---- prompt block keys --------------------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (13, 3)])
def test_keys_cover_full_blocks_of_all_but_the_last_token(n, expected):
    assert len(prompt_block_keys(list(range(n)), TPB)) == expected
    assert len(prompt(n).block_keys) == expected


def test_keys_are_chained_and_stable():
    tokens = list(range(100, 113))
    keys = prompt_block_keys(tokens, TPB)
    assert keys == chain_block_keys(tokens, TPB, 3, prev=lora_seed(None))
    # Stable across interpreter runs (Python's hash() is randomized per process).
    code = ("from pdserve.scheduler.radix_tree import prompt_block_keys; "
            "print([k.hex() for k in prompt_block_keys(list(range(100, 113)), 4)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([k.hex() for k in keys])


def test_the_router_keys_are_the_keys_a_worker_caches_under():
    """The one block hash: what the router computes for a prompt is what the worker's radix
    tree reports in its KV events for the same prompt."""
    kv = KVCacheManager(32, TPB, enable_block_reuse=True)
    tokens = list(range(50, 67))  # 17 tokens: 4 full blocks over the first 16
    request = LlmRequest(1, tokens, 4)
    kv.add_sequence(request)
    kv.store_context_blocks(request)
    events, _ = kv.kv_events.drain()
    stored = [key for e in events for key in e.keys]
    assert stored == prompt_block_keys(tokens, TPB) and len(stored) == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
       st.lists(st.integers(0, 2**32 - 1), max_size=20),
       st.lists(st.integers(0, 2**32 - 1), max_size=20),
       st.integers(1, 6))
def test_equal_prefixes_give_equal_leading_keys(prefix, tail_a, tail_b, tpb):
    a = prompt_block_keys(prefix + tail_a, tpb)
    b = prompt_block_keys(prefix + tail_b, tpb)
    shared = (len(prefix) - 1) // tpb  # blocks lying wholly inside the prefix, minus the last token
    assert a[:shared] == b[:shared]
    first_diff = next((i for i, (x, y) in enumerate(zip(prefix + tail_a, prefix + tail_b)) if x != y), None)
    if first_diff is not None:
        block = first_diff // tpb
        if block < min(len(a), len(b)):
            assert a[block:] and a[block] != b[block]


def test_bad_tokens_per_block_is_rejected():
    with pytest.raises(ValueError, match="tokens_per_block"):
        prompt_block_keys([1, 2, 3], 0)


def test_matched_tokens_come_from_the_index_matches():
    p = prompt(17).with_matches({"a": 3, "b": 1})
    assert matched_tokens(ctx("a"), p) == 12
    assert matched_tokens(ctx("b"), p) == 4
    assert matched_tokens(ctx("c"), p) == 0


def test_blocks_needed_counts_the_first_generated_token():
    assert blocks_needed_for_prompt(7, 4) == 2
    assert blocks_needed_for_prompt(8, 4) == 3
    assert blocks_needed_for_prompt(1, 4) == 1


# ---- round robin --------------------------------------------------------------------------------

def pick(policy, workers, p=None, exclude=()):
    s = policy.select(workers, p or prompt(9), exclude)
    return None if s is None else s.worker_id


def test_round_robin_cycles_and_skips_unhealthy():
    rr = RoundRobinPolicy()
    ws = [ctx("a"), ctx("b"), ctx("c")]
    assert [pick(rr, ws) for _ in range(4)] == ["a", "b", "c", "a"]
    ws[2] = ctx("c", healthy=False)
    assert [pick(rr, ws) for _ in range(3)] == ["b", "a", "b"]
    ws[2] = ctx("c")
    assert pick(rr, ws) == "c"  # back in the cycle where it was


def test_round_robin_resets_when_a_worker_is_removed():
    rr = RoundRobinPolicy()
    ws = [ctx("a"), ctx("b"), ctx("c")]
    assert [pick(rr, ws) for _ in range(2)] == ["a", "b"]
    assert pick(rr, [ctx("a"), ctx("c")]) == "a"
    # Adding a worker keeps the position.
    assert pick(rr, [ctx("a"), ctx("c"), ctx("d")]) == "c"


def test_round_robin_honours_exclude_role_and_empty():
    rr = RoundRobinPolicy()
    assert pick(rr, []) is None
    assert pick(rr, [gen("g")]) is None  # wrong role
    assert pick(rr, [ctx("a"), ctx("b")], exclude={"a"}) == "b"
    assert pick(rr, [ctx("a")], exclude={"a"}) is None


def test_round_robin_rank_does_not_advance():
    rr = RoundRobinPolicy()
    ws = [ctx("a"), ctx("b")]
    assert [s.worker_id for s in rr.rank(ws, prompt(9))] == ["a", "b"]
    assert [s.worker_id for s in rr.rank(ws, prompt(9))] == ["a", "b"]
    assert pick(rr, ws) == "a"
    assert [s.worker_id for s in rr.rank(ws, prompt(9))] == ["b", "a"]


# ---- least loaded -------------------------------------------------------------------------------

def test_least_loaded_picks_min_queued_prompt_tokens():
    ll = LeastLoadedPolicy()
    ws = [ctx("a", queued_prompt_tokens=50), ctx("b", queued_prompt_tokens=10),
          ctx("c", queued_prompt_tokens=30)]
    assert pick(ll, ws) == "b"
    assert pick(ll, ws, exclude={"b"}) == "c"
    ws[1] = ctx("b", queued_prompt_tokens=10, healthy=False)
    assert pick(ll, ws) == "c"


def test_least_loaded_ties_are_deterministic():
    ll = LeastLoadedPolicy()
    ws = [ctx("z", active_requests=1), ctx("y"), ctx("x")]
    assert pick(ll, ws) == "x"  # equal tokens: fewer active, then worker_id
    assert pick(ll, list(reversed(ws))) == "x"  # independent of list order
    ws = [ctx("x", active_requests=2), ctx("y", active_requests=1)]
    assert pick(ll, ws) == "y"


def test_with_dispatched_moves_load():
    ll = LeastLoadedPolicy()
    ws = [ctx("a"), ctx("b")]
    first = pick(ll, ws, prompt(9))
    assert first == "a"
    ws = [w.with_dispatched(9) if w.worker_id == first else w for w in ws]
    assert ws[0].active_requests == 1 and ws[0].queued_prompt_tokens == 9
    assert pick(ll, ws) == "b"


# ---- kv-aware -----------------------------------------------------------------------------------

def test_kv_aware_cost_formula():
    p = prompt(17).with_matches({"a": 2, "b": 4})  # 17 tokens + first token: 5 blocks
    w = KvAwareWeights(overlap=1.0, decode=0.25)
    a = ctx("a", queued_prompt_tokens=0, free_kv_blocks=90, total_kv_blocks=100)
    b = ctx("b", queued_prompt_tokens=12, free_kv_blocks=98, total_kv_blocks=100)
    policy = KvAwarePolicy(CTX, w)
    assert policy.cost(a, p) == pytest.approx(1.0 * (5 - 2) + 0 + 0.25 * 10)
    assert policy.cost(b, p) == pytest.approx(1.0 * (5 - 4) + 3 + 0.25 * 2)
    ranked = policy.rank([a, b], p)
    assert [s.worker_id for s in ranked] == ["b", "a"]
    assert {s.worker_id: s.matched_tokens for s in ranked} == {"a": 8, "b": 16}
    # Weigh the cache hit down and the load wins.
    assert pick(KvAwarePolicy(CTX, KvAwareWeights(overlap=0.1, decode=0.25)), [a, b], p) == "a"


def test_kv_aware_ties_prefer_the_longer_match_then_the_id():
    p = prompt(9).with_matches({"b": 1})
    # same cost: a has 1 block less matched but a lighter queue
    a = ctx("a", queued_prompt_tokens=0)
    b = ctx("b", queued_prompt_tokens=4)
    assert [s.worker_id for s in KvAwarePolicy().rank([a, b], p)] == ["b", "a"]
    assert [s.worker_id for s in KvAwarePolicy().rank([ctx("y"), ctx("x")], prompt(9))] == ["x", "y"]


def test_kv_aware_generation_worker_without_room_for_the_uncached_part_ranks_last():
    p = prompt(40).with_matches({"holds": 8})  # 11 blocks needed, 8 cached on "holds"
    ws = [gen("holds", free_kv_blocks=3, total_kv_blocks=100), gen("empty", free_kv_blocks=10, total_kv_blocks=100)]
    ranked = KvAwarePolicy(GEN).rank(ws, p)
    assert [s.worker_id for s in ranked] == ["holds", "empty"]  # 3 free blocks are enough for it
    assert [s.worker_id for s in KvAwarePolicy(GEN).rank(ws, p.with_matches({}))] == ["empty", "holds"]


# ---- generation ---------------------------------------------------------------------------------

def test_generation_least_loaded_by_active_then_free_blocks():
    gp = GenerationLoadPolicy()
    ws = [gen("g0", active_requests=3, free_kv_blocks=90), gen("g1", active_requests=1, free_kv_blocks=10),
          gen("g2", active_requests=1, free_kv_blocks=50)]
    assert pick(gp, ws) == "g2"
    assert pick(gp, ws, exclude={"g2"}) == "g1"
    assert pick(gp, [ctx("c")]) is None


def test_generation_worker_without_room_for_the_prompt_ranks_last():
    gp = GenerationLoadPolicy()
    p = prompt(40)  # needs 11 blocks (40 prompt tokens + first token, 4 per block)
    ws = [gen("tight", active_requests=0, free_kv_blocks=10), gen("busy", active_requests=5, free_kv_blocks=11)]
    assert [s.worker_id for s in gp.rank(ws, p)] == ["busy", "tight"]
    assert pick(gp, [ws[0]], p) == "tight"  # still chosen when it is the only one


def test_generation_selection_reports_matched_prefix():
    p = prompt(17).with_matches({"g": 1})
    s = GenerationLoadPolicy().select([gen("g")], p)
    assert s is not None and s.matched_tokens == 4


# ---- factory ------------------------------------------------------------------------------------

def test_make_policy():
    assert isinstance(make_policy("round-robin"), RoundRobinPolicy)
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)  # the config file's spelling
    assert isinstance(make_policy("least-loaded"), LeastLoadedPolicy)
    assert isinstance(make_policy("kv-aware"), KvAwarePolicy)
    assert isinstance(make_policy("least-loaded", GEN), GenerationLoadPolicy)
    assert isinstance(make_policy("round-robin", GEN), GenerationLoadPolicy)
    assert make_policy("kv-aware", GEN).role == GEN
    assert {make_policy(n).name for n in ROUTING_MODES} == set(ROUTING_MODES)


@pytest.mark.parametrize("bad", ["", "load_balance", "RoundRobin", "random", "kv_cache_aware"])
def test_make_policy_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        make_policy(bad)


# ---- conditional disaggregation -----------------------------------------------------------------

@pytest.mark.parametrize(
    "prompt_len, matched, limit, remote",
    [
        (100, 0, 1000, True),  # nothing cached: always remote
        (100, 96, 4, False),  # 4 uncached <= 4
        (100, 95, 4, True),  # 5 uncached > 4
        (100, 64, 36, False),
        (100, 64, 35, True),
        (100, 96, None, True),  # feature off
        (100, 96, 0, True),  # 0 behaves as off: at least the last token is uncached
    ],
)
def test_needs_remote_prefill(prompt_len, matched, limit, remote):
    assert needs_remote_prefill(prompt_len, matched, limit) is remote


def test_needs_remote_prefill_rejects_negative_limit():
    with pytest.raises(ValueError, match="max_local_prefill_length"):
        needs_remote_prefill(10, 4, -1)


def test_decide_prefill_modes():
    A, ALW, NEV = DisaggregationMode.AUTO, DisaggregationMode.ALWAYS, DisaggregationMode.NEVER
    assert decide_prefill(A, 100, 96, 8).route == PrefillRoute.LOCAL
    assert decide_prefill(A, 100, 0, 8).route == PrefillRoute.REMOTE
    assert decide_prefill(ALW, 100, 96, 8).route == PrefillRoute.REMOTE
    assert decide_prefill(NEV, 100, 0, None).route == PrefillRoute.LOCAL
    assert decide_prefill(A, 100, 0, 8, context_available=False).route == PrefillRoute.LOCAL
    assert decide_prefill(NEV, 100, 0, 8, context_available=False).route == PrefillRoute.LOCAL
    assert decide_prefill(2, 100, 0, None).route == PrefillRoute.LOCAL  # plain ints from the proto
    with pytest.raises(NoWorkerAvailable):
        decide_prefill(ALW, 100, 0, 8, context_available=False)


# ---- retries ------------------------------------------------------------------------------------

def retry(failed, workers, *, used=0, max_retries=3, mode=DisaggregationMode.AUTO):
    return plan_retry(failed, workers, prompt(9), retries_used=used, max_retries=max_retries,
                      context_policy=LeastLoadedPolicy(), generation_policy=GenerationLoadPolicy(),
                      mode=mode)


def test_retry_prefers_a_pair_of_fresh_workers():
    ws = [ctx("c0"), ctx("c1"), gen("g0"), gen("g1")]
    plan = retry({("c0", "g0")}, ws)
    assert plan[:3] == (RetryAction.PAIR, "c1", "g1")


def test_retry_reuses_a_worker_when_no_fresh_pair_exists():
    ws = [ctx("c0"), gen("g0"), gen("g1")]
    plan = retry({("c0", "g0")}, ws)
    assert plan[:3] == (RetryAction.PAIR, "c0", "g1")


def test_retry_falls_back_to_local_prefill():
    ws = [ctx("c0"), gen("g0")]
    plan = retry({("c0", "g0")}, ws)
    assert plan[:3] == (RetryAction.LOCAL_PREFILL, None, "g0")
    # Context worker dead: local prefill on the healthiest generation worker.
    ws = [ctx("c0", healthy=False), gen("g0", active_requests=2), gen("g1")]
    assert retry({("c0", "g1")}, ws)[:3] == (RetryAction.LOCAL_PREFILL, None, "g0")


def test_retry_gives_up():
    ws = [ctx("c0"), gen("g0")]
    assert retry({("c0", "g0"), (None, "g0")}, ws).action == RetryAction.GIVE_UP
    assert retry(set(), ws, used=3, max_retries=3).action == RetryAction.GIVE_UP
    assert retry({("c0", "g0")}, ws, mode=DisaggregationMode.ALWAYS).action == RetryAction.GIVE_UP
    assert retry(set(), [ctx("c0")]).action == RetryAction.GIVE_UP  # no generation worker


def test_a_give_up_says_whether_a_worker_may_come_back():
    # The only generation worker is down (Ray restarts it): waiting for it can help.
    down = [ctx("c0"), gen("g0", healthy=False)]
    plan = retry({("c0", "g0")}, down)
    assert plan.action == RetryAction.GIVE_UP and plan.worker_may_return
    # Every worker is up and each way failed: nothing to wait for, fail now.
    up = [ctx("c0"), gen("g0")]
    plan = retry({("c0", "g0"), (None, "g0")}, up)
    assert plan.action == RetryAction.GIVE_UP and not plan.worker_may_return
    # Retries used up: no wait either, whatever is down.
    plan = retry(set(), down, used=3, max_retries=3)
    assert plan.action == RetryAction.GIVE_UP and not plan.worker_may_return
    # A transfer to a generation worker that went down: it may come back.
    plan = plan_transfer_fallback({("c0", "g0")}, "g0", down, prompt(9),
                                  context_policy=LeastLoadedPolicy())
    assert plan.action == RetryAction.GIVE_UP and plan.worker_may_return
    # Every way to a live generation worker tried: no wait.
    plan = plan_transfer_fallback({("c0", "g0")}, "g0", up, prompt(9),
                                  context_policy=LeastLoadedPolicy(), mode=DisaggregationMode.ALWAYS)
    assert plan.action == RetryAction.GIVE_UP and not plan.worker_may_return


def test_retry_in_never_mode_moves_local_prefill_to_another_worker():
    ws = [ctx("c0"), gen("g0"), gen("g1")]
    plan = retry({(None, "g0")}, ws, mode=DisaggregationMode.NEVER)
    assert plan[:3] == (RetryAction.LOCAL_PREFILL, None, "g1")


def test_retry_does_not_advance_round_robin():
    rr = RoundRobinPolicy()
    ws = [ctx("c0"), ctx("c1"), gen("g0")]
    plan_retry(set(), ws, prompt(9), retries_used=0, max_retries=1, context_policy=rr,
               generation_policy=GenerationLoadPolicy())
    assert pick(rr, ws) == "c0"


# ---- validation ---------------------------------------------------------------------------------

LIMITS = ValidationLimits(vocab_size=1000, max_input_len=64, max_seq_len=100, max_tokens_limit=80,
                          max_stop_token_ids=4, max_agent_depth=3, max_request_id_len=16,
                          max_text_chars=50, max_deadline_ms=60_000)
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop"}
GOOD_SAMPLING = dict(max_tokens=8, temperature=0.7, top_p=0.9, top_k=5, seed=7, stop_token_ids=(2,))
GOOD = GenerateSpec(request_id="req-1", token_ids=(1, 2, 3), sampling=SamplingParams(**GOOD_SAMPLING),
                    priority=0.5, agent_hierarchy=(("AgentDeepResearch", 3), ("researcher", 0)),
                    disaggregation=DisaggregationMode.ALWAYS, deadline_ms=1000)


def spec(**kw) -> GenerateSpec:
    """GOOD with some fields changed; sampling fields go into the record, built as the doors
    build it (its own range errors are ValidationErrors naming sampling.<field>)."""
    fields = {f: getattr(GOOD, f) for f in GOOD.__dataclass_fields__}
    sampling = dict(GOOD_SAMPLING)
    for name in list(kw):
        if name in SAMPLING_FIELDS:
            sampling[name] = kw.pop(name)
    fields.update(kw)
    fields["sampling"] = sampling_params(**sampling)
    return GenerateSpec(**fields)


def test_good_specs_pass():
    validate_generate_spec(GOOD, LIMITS)
    validate_generate_spec(spec(request_id=None, token_ids=None, text="hi", seed=None, deadline_ms=None,
                                agent_hierarchy=(), temperature=0, top_p=1.0, priority=1.0), LIMITS)
    validate_generate_spec(GenerateSpec(text="hello"))  # defaults, no limits
    validate_generate_spec(spec(token_ids=tuple(range(64)), max_tokens=36), LIMITS)  # exactly at limits


MALFORMED = [
    ("request_id", dict(request_id="")),
    ("request_id", dict(request_id="x" * 17)),
    ("request_id", dict(request_id="has space")),
    ("request_id", dict(request_id="-leading-dash")),
    ("prompt", dict(token_ids=None, text=None)),
    ("prompt", dict(text="both")),
    ("prompt.text", dict(token_ids=None, text="")),
    ("prompt.text", dict(token_ids=None, text="x" * 51)),
    ("prompt.token_ids", dict(token_ids=())),
    ("prompt.token_ids", dict(token_ids=tuple(range(65)))),
    ("prompt.token_ids[1]", dict(token_ids=(1, -1))),
    ("prompt.token_ids[2]", dict(token_ids=(1, 2, 1000))),
    ("prompt.token_ids[0]", dict(token_ids=(True,))),
    ("sampling.max_tokens", dict(max_tokens=0)),
    ("sampling.max_tokens", dict(max_tokens=81)),
    ("sampling.max_tokens", dict(max_tokens=2.0)),
    ("sampling.max_tokens", dict(token_ids=tuple(range(30)), max_tokens=71)),  # 30 + 71 > max_seq_len
    ("sampling.temperature", dict(temperature=-0.1)),
    ("sampling.temperature", dict(temperature=float("nan"))),
    ("sampling.temperature", dict(temperature=float("inf"))),
    ("sampling.top_p", dict(top_p=0.0)),
    ("sampling.top_p", dict(top_p=1.5)),
    ("sampling.top_p", dict(top_p=float("nan"))),
    ("sampling.top_k", dict(top_k=-1)),
    ("sampling.seed", dict(seed=-1)),
    ("sampling.seed", dict(seed=2**63)),
    ("sampling.stop_token_ids", dict(stop_token_ids=(1, 2, 3, 4, 5))),
    ("sampling.stop_token_ids[1]", dict(stop_token_ids=(2, 1000))),
    ("sampling.stop_token_ids[0]", dict(stop_token_ids=(-5,))),
    ("priority", dict(priority=-0.01)),
    ("priority", dict(priority=1.01)),
    ("priority", dict(priority=float("nan"))),
    ("priority", dict(priority=float("inf"))),
    ("agent_hierarchy", dict(agent_hierarchy=(("Chatbot", 0),) * 4)),
    ("agent_hierarchy[0].agent_type", dict(agent_hierarchy=(("", 0),))),
    ("agent_hierarchy[1].agent_type", dict(agent_hierarchy=(("Researcher", 0), ("Planner", 1)))),
    ("agent_hierarchy[0].node_id", dict(agent_hierarchy=(("Researcher", -1),))),
    ("agent_hierarchy[0].node_id", dict(agent_hierarchy=(("Researcher", "7"),))),
    ("agent_hierarchy[0]", dict(agent_hierarchy=(("Researcher",),))),
    ("disaggregation", dict(disaggregation=3)),
    ("disaggregation", dict(disaggregation=-1)),
    ("deadline_ms", dict(deadline_ms=0)),
    ("deadline_ms", dict(deadline_ms=60_001)),
]


@pytest.mark.parametrize("field, change", MALFORMED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MALFORMED)])
def test_malformed_request_names_the_field(field, change):
    with pytest.raises(ValidationError) as info:
        validate_generate_spec(spec(**change), LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
    assert isinstance(info.value, ValueError)


def test_malformed_table_is_large_and_covers_every_validated_field():
    assert len(MALFORMED) >= 25
    covered = {f.split("[")[0] for f, _ in MALFORMED}
    assert covered >= {"request_id", "prompt", "prompt.text", "prompt.token_ids", "sampling.max_tokens",
                       "sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.seed",
                       "sampling.stop_token_ids", "priority", "agent_hierarchy", "disaggregation",
                       "deadline_ms"}


def test_vocab_checks_are_skipped_without_a_vocab_size():
    validate_generate_spec(spec(token_ids=(10**6,), stop_token_ids=(10**6,)), ValidationLimits())


# ---- purity -------------------------------------------------------------------------------------

def test_importing_policies_loads_no_heavy_module():
    code = (
        "import sys, pdserve.cluster.policies\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'torch','ray','grpc','numpy'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# ---- fallback after a failed KV transfer -----------------------------------------------------------

def _fallback(failed, ws, mode=DisaggregationMode.AUTO, gen_worker="g0"):
    return plan_transfer_fallback(failed, gen_worker, ws, prompt(9), context_policy=LeastLoadedPolicy(),
                                  mode=mode)


def test_a_failed_transfer_falls_back_to_local_prefill_on_its_generation_worker():
    ws = [ctx("c0"), ctx("c1"), gen("g0"), gen("g1")]
    plan = _fallback({("c0", "g0")}, ws)
    assert (plan.action, plan.ctx_worker, plan.gen_worker) == (RetryAction.LOCAL_PREFILL, None, "g0")
    # Under NEVER too (a request that never wanted a transfer had none to fail, but the rule holds).
    assert _fallback({("c0", "g0")}, ws, DisaggregationMode.NEVER).action == RetryAction.LOCAL_PREFILL


def test_when_disaggregation_is_required_another_context_worker_serves_the_same_generation_worker():
    ws = [ctx("c0"), ctx("c1", queued_prompt_tokens=50), ctx("c2"), gen("g0")]
    plan = _fallback({("c0", "g0")}, ws, DisaggregationMode.ALWAYS)
    assert (plan.action, plan.ctx_worker, plan.gen_worker) == (RetryAction.PAIR, "c2", "g0")
    plan = _fallback({("c0", "g0"), ("c2", "g0")}, ws, DisaggregationMode.ALWAYS)
    assert (plan.action, plan.ctx_worker) == (RetryAction.PAIR, "c1")
    plan = _fallback({("c0", "g0"), ("c1", "g0"), ("c2", "g0")}, ws, DisaggregationMode.ALWAYS)
    assert plan.action == RetryAction.GIVE_UP and "failed KV transfer" in plan.reason


def test_a_fallback_never_targets_an_unhealthy_generation_worker():
    ws = [ctx("c0"), gen("g0", healthy=False)]
    plan = _fallback({("c0", "g0")}, ws)
    assert plan.action == RetryAction.GIVE_UP and "not healthy" in plan.reason



# ---- pairs whose KV group is not set up ----------------------------------------------------------

def test_no_retry_or_fallback_is_planned_over_a_pair_that_is_not_set_up():
    ws = [ctx("c0"), ctx("c1"), gen("g0"), gen("g1")]
    plan = plan_retry({("c0", "g0")}, ws, prompt(9), retries_used=0, max_retries=3,
                      context_policy=LeastLoadedPolicy(), generation_policy=GenerationLoadPolicy(),
                      unready={("c1", "g1")})
    assert (plan.action, plan.ctx_worker, plan.gen_worker) != (RetryAction.PAIR, "c1", "g1")
    assert plan.action == RetryAction.PAIR and (plan.ctx_worker, plan.gen_worker) in {
        ("c1", "g0"), ("c0", "g1")}
    # Every pair down: local prefill, and an unready pair is no failure of its workers.
    every = {(c, g) for c in ("c0", "c1") for g in ("g0", "g1")}
    plan = plan_retry(set(), ws, prompt(9), retries_used=0, max_retries=3,
                      context_policy=LeastLoadedPolicy(), generation_policy=GenerationLoadPolicy(),
                      unready=every)
    assert plan.action == RetryAction.LOCAL_PREFILL
    # Disaggregation required and no pair set up: a pair anyway (its transfer waits for the
    # set-up within its deadline) rather than giving up.
    plan = plan_retry(set(), ws, prompt(9), retries_used=0, max_retries=3,
                      context_policy=LeastLoadedPolicy(), generation_policy=GenerationLoadPolicy(),
                      mode=DisaggregationMode.ALWAYS, unready=every)
    assert plan.action == RetryAction.PAIR
    plan = plan_transfer_fallback({("c0", "g0")}, "g0", [ctx("c0"), ctx("c1"), gen("g0")], prompt(9),
                                  context_policy=LeastLoadedPolicy(), mode=DisaggregationMode.ALWAYS,
                                  unready={("c1", "g0")})
    assert (plan.action, plan.ctx_worker) == (RetryAction.PAIR, "c1")
    plan = _fallback({("c0", "g0")}, [ctx("c0"), ctx("c1"), ctx("c2"), gen("g0")],
                     DisaggregationMode.ALWAYS)
    assert plan.ctx_worker in ("c1", "c2")
    plan = plan_transfer_fallback({("c0", "g0")}, "g0", [ctx("c0"), ctx("c1"), ctx("c2"), gen("g0")],
                                  prompt(9), context_policy=LeastLoadedPolicy(),
                                  mode=DisaggregationMode.ALWAYS, unready={("c1", "g0")})
    assert (plan.action, plan.ctx_worker) == (RetryAction.PAIR, "c2")

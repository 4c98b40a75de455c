"""Router policies: block hashing, worker selection, conditional disaggregation, retries and
request validation (reference trtllm-scheduling.md section 7.5, DESIGN.md "Router policies")."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.cluster.policies import (
    CONTEXT_POLICY_NAMES,
    DisaggregationMode,
    GenerationLoadPolicy,
    KvCacheAwarePolicy,
    LeastLoadedPolicy,
    NoWorkerAvailable,
    PrefillRoute,
    PromptInfo,
    RetryAction,
    RoundRobinPolicy,
    WorkerLoad,
    WorkerRole,
    block_hashes,
    blocks_needed_for_prompt,
    chain_block_hash,
    decide_prefill,
    make_policy,
    matched_tokens,
    needs_remote_prefill,
    plan_retry,
)
from pdserve.cluster.validation import (
    GenerateSpec,
    ValidationError,
    ValidationLimits,
    validate_generate_spec,
)

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


# ---- hashing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [(0, 0), (1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (13, 3)])
def test_hashes_cover_full_blocks_of_all_but_the_last_token(n, expected):
    assert len(block_hashes(list(range(n)), TPB)) == expected


def test_hashes_are_chained_and_stable():
    tokens = list(range(100, 113))
    hashes = block_hashes(tokens, TPB)
    assert hashes[0] == chain_block_hash(None, tokens[0:4])
    assert hashes[1] == chain_block_hash(hashes[0], tokens[4:8])
    # Same block content at another position hashes differently (the chain carries the prefix).
    assert chain_block_hash(hashes[0], tokens[0:4]) != hashes[0]
    # Stable across interpreter runs (Python's hash() is randomized per process).
    code = "from pdserve.cluster.policies import block_hashes; print(block_hashes(list(range(100, 113)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(hashes)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
       st.lists(st.integers(0, 2**32 - 1), max_size=20),
       st.lists(st.integers(0, 2**32 - 1), max_size=20),
       st.integers(1, 6))
def test_equal_prefixes_give_equal_leading_hashes(prefix, tail_a, tail_b, tpb):
    a = block_hashes(prefix + tail_a, tpb)
    b = block_hashes(prefix + tail_b, tpb)
    shared = (len(prefix) - 1) // tpb  # blocks lying wholly inside the prefix, minus the last token
    assert a[:shared] == b[:shared]
    first_diff = next((i for i, (x, y) in enumerate(zip(prefix + tail_a, prefix + tail_b)) if x != y), None)
    if first_diff is not None:
        block = first_diff // tpb
        if block < min(len(a), len(b)):
            assert a[block:] and a[block] != b[block]


def test_bad_tokens_per_block_is_rejected():
    with pytest.raises(ValueError, match="tokens_per_block"):
        block_hashes([1, 2, 3], 0)


def test_matched_tokens_is_the_leading_run_only():
    p = prompt(17)  # 4 hashes
    h = p.block_hashes
    assert matched_tokens(ctx("a", cached_block_hashes=frozenset(h[:3])), p) == 12
    # A hole in the run stops the match even if later blocks are cached.
    assert matched_tokens(ctx("a", cached_block_hashes=frozenset({h[0], h[2], h[3]})), p) == 4
    assert matched_tokens(ctx("a", cached_block_hashes=frozenset(h[1:])), p) == 0


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


# ---- kv cache aware -----------------------------------------------------------------------------

def test_kv_cache_aware_score_formula():
    p = prompt(17)  # 4 blocks of 4 tokens
    h = p.block_hashes
    a = ctx("a", cached_block_hashes=frozenset(h[:2]), active_requests=0, max_batch_size=64)
    b = ctx("b", cached_block_hashes=frozenset(h), active_requests=32, max_batch_size=64)
    ranked = KvCacheAwarePolicy().rank([a, b], p)
    scores = {s.worker_id: s.score for s in ranked}
    assert scores["a"] == pytest.approx(8 / 16 - 0 / 64)
    assert scores["b"] == pytest.approx(16 / 16 - 32 / 64)
    assert {s.worker_id: s.matched_tokens for s in ranked} == {"a": 8, "b": 16}
    # 0.5 vs 0.5: tie broken by fewer active requests.
    assert ranked[0].worker_id == "a"
    b2 = ctx("b", cached_block_hashes=frozenset(h), active_requests=16, max_batch_size=64)
    assert pick(KvCacheAwarePolicy(), [a, b2], p) == "b"


def test_kv_cache_aware_without_full_blocks_uses_load_only():
    p = prompt(3)
    ws = [ctx("a", active_requests=3), ctx("b", active_requests=1), ctx("c", active_requests=1)]
    ranked = KvCacheAwarePolicy().rank(ws, p)
    assert [s.worker_id for s in ranked] == ["b", "c", "a"]
    assert not any(math.isnan(s.score) for s in ranked)


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
    p = prompt(17)
    s = GenerationLoadPolicy().select([gen("g", cached_block_hashes=frozenset(p.block_hashes[:1]))], p)
    assert s is not None and s.matched_tokens == 4


# ---- factory ------------------------------------------------------------------------------------

def test_make_policy():
    assert isinstance(make_policy("round_robin"), RoundRobinPolicy)
    assert isinstance(make_policy("least_loaded"), LeastLoadedPolicy)
    assert isinstance(make_policy("kv_cache_aware"), KvCacheAwarePolicy)
    assert isinstance(make_policy("least_loaded", GEN), GenerationLoadPolicy)
    assert make_policy("round_robin", GEN).role == GEN
    assert make_policy("kv_cache_aware", GEN).role == GEN
    assert {make_policy(n).name for n in CONTEXT_POLICY_NAMES} == set(CONTEXT_POLICY_NAMES)


@pytest.mark.parametrize("bad", ["", "load_balance", "RoundRobin", "random"])
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
GOOD = GenerateSpec(request_id="req-1", token_ids=(1, 2, 3), max_tokens=8, temperature=0.7, top_p=0.9,
                    top_k=5, seed=7, stop_token_ids=(2,), priority=0.5,
                    agent_hierarchy=(("AgentDeepResearch", 3), ("researcher", 0)),
                    disaggregation=DisaggregationMode.ALWAYS, deadline_ms=1000)


def spec(**kw) -> GenerateSpec:
    fields = {f: getattr(GOOD, f) for f in GOOD.__dataclass_fields__}
    fields.update(kw)
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

"""Differential test: the capacity scheduler (scheduler/capacity.py) against the frozen copy of
the implementation before "each capacity policy written once" (capacity_oracle.py, the generic
path of each policy through the scheduled-blocks managers).

Two identical worlds are built from one drawn description, the new scheduler runs on one and
the oracle on the other, and everything the capacity pass can touch must come out the same: the
three output lists (request ids, in order), or the error raised; every request's
``estimated_reusable_tokens`` and other scheduling fields; the KV pools' real and scheduling free
counts; and the calls a double exposing only the public names receives, in order (after a
MAX_UTILIZATION pause the old code asked again for a request's one-step need, which a pause
never changes; the new code asks once, so a repeated identical one-step call is dropped from the
old log before comparing).

Pools: the stock ``KVCacheManager`` (fast view), a subclass of it, a stock one with an estimate
replaced on the instance, a double with only the public names (with and without the optional
``summary`` parameters), as the self pool and as the cross pool. States: random request mixes
over every state (disaggregated ones included), chunk positions, beams, drafts, LoRA tasks with
a PEFT manager, reuse on and off over real shared prefixes, sliding windows, sinks, prefix-aware
scheduling on and off, two-step look-ahead, bands (an encoder band with a cross pool among
them), pools small enough for MAX_UTILIZATION to pause and GUARANTEED_NO_EVICT to run out,
request caps and reorder policies. Workloads are also stepped to completion (SimulatedWorker,
and the lifecycle functions with a cross pool) so that states evolve as an engine core moves them.

``PDSERVE_DIFF_EXAMPLES`` scales the example counts (default: a few seconds in CI).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler import (
    AgentTreePolicy,
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    ContextPhaseParams,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    LlmRequestType,
    MicroBatchScheduler,
    PeftCacheManager,
    SimpleScheduler,
)
from pdserve.scheduler import lifecycle
from pdserve.scheduler.kv_cache import KVCacheOutOfBlocksError
from pdserve.scheduler.sim_worker import SimulatedWorker

_spec = importlib.util.spec_from_file_location(
    "pdserve_capacity_oracle", Path(__file__).with_name("capacity_oracle.py")
)
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)  # type: ignore[union-attr]

S = LlmRequestState
P = CapacitySchedulerPolicy
_SCALE = float(os.environ.get("PDSERVE_DIFF_EXAMPLES", "1"))


def _examples(n: int) -> int:
    return max(1, int(n * _SCALE))


# ---- pools ------------------------------------------------------------------------------------
class SubclassKV(KVCacheManager):
    """The same manager; a subclass is read through its public methods."""


def _tag_summary(summary: Any) -> Any:
    return None if summary is None else tuple(summary)


class PublicKV:
    """A double with only the public names of the contract, each delegated to a real manager;
    the scheduling calls are recorded into ``log`` (shared by a world's pools) as
    ``(tag, call, ...)``. The lifecycle names (add_sequence, ...) let a worker step it."""

    def __init__(self, inner: KVCacheManager, log: list, tag: str, *,
                 variable_window: bool = False, reuse: bool | None = None) -> None:
        self._inner = inner
        self._log = log
        self._tag = tag
        # A cross double may claim reuse (a stock cross pool cannot): its prompts are then
        # analyzed, and encoder-init and first-chunk requests take part in prefix-aware skipping.
        self.enable_block_reuse = inner.enable_block_reuse if reuse is None else reuse
        self.is_variable_window = variable_window
        self.tokens_per_block = inner.tokens_per_block
        self.num_blocks = inner.num_blocks

    # the scheduling contract
    def get_num_free_blocks(self) -> int:
        self._log.append((self._tag, "free"))
        return self._inner.get_num_free_blocks()

    def get_remaining_blocks_to_completion(self, request, summary=None) -> int:
        self._log.append((self._tag, "remaining", request.request_id, _tag_summary(summary)))
        return self._inner.get_remaining_blocks_to_completion(request, summary)

    def get_needed_blocks_one_step(self, request, two_steps_look_ahead, summary=None) -> int:
        self._log.append(
            (self._tag, "one_step", request.request_id, two_steps_look_ahead, _tag_summary(summary))
        )
        return self._inner.get_needed_blocks_one_step(request, two_steps_look_ahead, summary)

    def scheduling_has_free_blocks(self, num_blocks: int) -> bool:
        self._log.append((self._tag, "has_free", num_blocks))
        return self._inner.scheduling_has_free_blocks(num_blocks)

    def analyze_prefix_reuse(self, tokens, request):
        which = "encoder" if tokens is request.encoder_tokens else "tokens"
        if which == "tokens":
            assert tokens is request.get_tokens(0)
        self._log.append((self._tag, "analyze", request.request_id, which, len(tokens)))
        return self._inner.analyze_prefix_reuse(tokens, request)

    def start_scheduling(self) -> None:
        self._log.append((self._tag, "start"))
        self._inner.start_scheduling()

    def scheduling_remove_sequence(self, request_id: int) -> None:
        self._log.append((self._tag, "remove", request_id))
        self._inner.scheduling_remove_sequence(request_id)

    # what a worker needs to step it (not logged)
    def has_sequence(self, request_id):
        return self._inner.has_sequence(request_id)

    def add_sequence(self, request):
        self._inner.add_sequence(request)

    def add_sequences(self, requests):
        self._inner.add_sequences(requests)

    def add_token(self, request_id):
        self._inner.add_token(request_id)

    def store_context_blocks(self, request):
        return self._inner.store_context_blocks(request)

    def remove_sequence(self, request_id):
        return self._inner.remove_sequence(request_id)


class PublicKV2(PublicKV):
    """The contract's two-argument signatures: no ``summary`` parameter."""

    def get_remaining_blocks_to_completion(self, request) -> int:  # type: ignore[override]
        return super().get_remaining_blocks_to_completion(request)

    def get_needed_blocks_one_step(self, request, two_steps_look_ahead) -> int:  # type: ignore[override]
        return super().get_needed_blocks_one_step(request, two_steps_look_ahead)


def _inner(kv: Any) -> Any:
    return kv._inner if isinstance(kv, PublicKV) else kv


def _make_pool(kind: str, log: list, tag: str, variable_window: bool, **kwargs: Any) -> Any:
    if kind == "subclass":
        kv = SubclassKV(**kwargs)
        kv.is_variable_window = variable_window
        return kv
    if kind == "replaced":  # one estimate overridden by a subclass: the override is called
        class OneStepLogged(KVCacheManager):
            def get_needed_blocks_one_step(self, request, two_steps_look_ahead, summary=None):
                log.append((tag, "one_step", request.request_id, two_steps_look_ahead,
                            _tag_summary(summary)))
                return super().get_needed_blocks_one_step(request, two_steps_look_ahead, summary)

        kv = OneStepLogged(**kwargs)
        kv.is_variable_window = variable_window
        return kv
    inner = KVCacheManager(**kwargs)
    if kind in ("public", "public2", "public_reuse"):
        cls = PublicKV2 if kind == "public2" else PublicKV
        return cls(inner, log, tag, variable_window=variable_window,
                   reuse=True if kind == "public_reuse" else None)
    inner.is_variable_window = variable_window
    return inner


def normalized(log: list) -> list:
    """The log without a one-step call repeating the pool's previous one (a retry after a
    MAX_UTILIZATION pause, which the old code evaluated again)."""
    out = []
    last: dict[str, tuple] = {}
    for entry in log:
        tag, call = entry[0], entry[1]
        if call == "start":
            last.pop(tag, None)
        elif call == "one_step":
            if last.get(tag) == entry:
                continue
            last[tag] = entry
        out.append(entry)
    return out


def snapshot(requests: list[LlmRequest]) -> list[tuple]:
    return [
        (
            r.request_id, int(r.state), r.prompt_len, r.max_new_tokens,
            r.context_current_position, r.context_chunk_size, r.prepopulated_prompt_len,
            r.estimated_reusable_tokens, tuple(r.draft_tokens or ()), r.get_num_tokens(0),
        )
        for r in requests
    ]


def _pool_counts(kv: Any) -> tuple | None:
    if kv is None:
        return None
    inner = _inner(kv)
    return inner.get_num_free_blocks(), inner.get_scheduling_num_free_blocks()


class ByPriority:
    """A reorder policy: highest priority first, stable."""

    def reorder(self, requests: list[LlmRequest]) -> list[LlmRequest]:
        return sorted(requests, key=lambda r: -r.priority)


def _make_reorder(kind: str | None) -> Any:
    if kind == "priority":
        return ByPriority()
    if kind == "agent_tree":
        return AgentTreePolicy(0.5, ["AgentDeepResearch", "Researcher"], 6, seed=7)
    return None


# ---- random scheduler states ------------------------------------------------------------------
_BANDS = [
    (S.CONTEXT_INIT, S.GENERATION_COMPLETE),
    (S.CONTEXT_INIT, S.GENERATION_COMPLETE),
    (S.ENCODER_INIT, S.GENERATION_COMPLETE),
    (S.CONTEXT_INIT, S.GENERATION_TO_COMPLETE),
    (S.UNKNOWN, S.DISAGG_GENERATION_WAIT_TOKENS),
    (S.DISAGG_TRANS_ERROR, S.DISAGG_CONTEXT_COMPLETE),
]
_KINDS = [
    "new", "new", "new", "new", "new", "chunked", "chunked", "chunked", "gen", "gen", "gen",
    "gen", "gen", "gen_to_complete",
    "trans_complete", "gen_init", "transfer", "encoder", "ctx_and_trans", "first_allocated",
    "wait_scheduler", "complete", "ctx_trans", "ctx_complete", "wait_tokens", "unknown",
    "trans_error",
]

world_config = st.fixed_dictionaries(
    {
        "cross": st.sampled_from(
            [None, None, None, None, "stock", "subclass", "public", "public_reuse"]),
        "tokens_per_block": st.sampled_from([1, 2, 4]),
        "num_blocks": st.sampled_from([0, 3, 8, 12, 16, 20, 25, 30, 40, 50, 60, 80, 100]),
        "cross_blocks": st.sampled_from([0, 2, 4, 8, 12, 24]),
        "hold": st.sampled_from([0, 0, 2, 5, 10, 20]),  # blocks a filler holds, outside the band
        # Prompts of the prefix families cached before the requests arrive: held by a live
        # sequence outside the active list, or free cached blocks.
        "cached": st.sampled_from([(), (1,), (1,), (2,), (1, 2)]),
        "cached_held": st.booleans(),
        "window": st.one_of(st.none(), st.none(), st.integers(2, 30)),
        "temporary_window": st.sampled_from([0, 0, 3]),
        "sink": st.sampled_from([0, 0, 0, 1, 3]),
        "reuse": st.sampled_from([False, True, True]),
        "variable_window": st.sampled_from([False, False, False, True]),
        "prefix_aware": st.booleans(),
        "two_steps": st.booleans(),
        "cap": st.sampled_from([0, 1, 2, 3, 5, 8, 64, 64, 64]),
        "band": st.sampled_from(range(len(_BANDS))),
        "peft": st.sampled_from([None, 1, 3, 4, 8]),
        "peft_tasks": st.sampled_from([{1: 2, 2: 3, 3: 1}] * 5 + [{1: 2, 2: 3}]),  # 3 unknown
        "reorder": st.sampled_from([None, None, "priority", "agent_tree"]),
    }
)
request_spec = st.tuples(
    st.sampled_from(_KINDS),
    st.sampled_from([1, 2, 3, 5, 7, 8, 9, 12, 13, 16, 17, 20, 24]),  # prompt length
    st.sampled_from([1, 2, 3, 4, 6, 9, 12]),  # max new tokens
    st.sampled_from([0, 1, 1, 2]),  # prefix family (0: unique)
    st.sampled_from([1, 1, 1, 2, 3]),  # beam width
    st.sampled_from([0, 0, 0, 1, 3]),  # draft tokens
    st.sampled_from([None, None, None, None, 1, 2, 3]),  # LoRA task
    st.sampled_from([0, 0, 4, 9]),  # encoder tokens
    st.sampled_from([0, 1, 2, 3, 5, 8, 10]),  # chunk position / decode steps
    st.sampled_from([0.2, 0.5, 0.9]),  # priority
)

_FAMILIES = {f: [300 + 17 * f + i for i in range(40)] for f in (1, 2)}


def _tokens(rid: int, p: int, family: int) -> list[int]:
    return _FAMILIES[family][:p] if family else [1000 + 41 * rid + i for i in range(p)]


def build_state(cfg: dict, specs: list[tuple]) -> dict:
    """One world: pools, PEFT manager and requests in the drawn states. Deterministic."""
    log: list = []
    b = cfg["tokens_per_block"]
    reuse = cfg["reuse"] and cfg["pool"] != "public2"  # the 2-argument double takes no summary
    kv = _make_pool(
        cfg["pool"], log, "self", cfg["variable_window"], num_blocks=cfg["num_blocks"],
        tokens_per_block=b, max_attention_window=cfg["window"], enable_block_reuse=reuse,
        sink_token_length=cfg["sink"], temporary_attention_window=cfg["temporary_window"],
    )
    cross = None
    if cfg["cross"] is not None:
        cross = _make_pool(cfg["cross"], log, "cross", False, num_blocks=cfg["cross_blocks"],
                           tokens_per_block=b, is_cross=True)
    inner, cross_inner = _inner(kv), _inner(cross)
    peft = None
    if cfg["peft"] is not None:
        peft = PeftCacheManager(cfg["peft"], cfg["peft_tasks"])
    if inner.enable_block_reuse:
        for family in cfg["cached"]:
            seed = LlmRequest(-10 - family, _FAMILIES[family][: 6 + 7 * family], 1)
            if _allocate(seed, inner, None):
                inner.store_context_blocks(seed)
                if not cfg["cached_held"]:
                    inner.remove_sequence(seed.request_id)
    requests: list[LlmRequest] = []
    for rid, (kind, p, n, fam, beam, drafts, lora, enc, pos, prio) in enumerate(specs):
        gen_only = kind in ("gen_init", "transfer", "trans_complete")
        kwargs: dict = {"beam_width": beam, "lora_task_id": lora, "priority": prio}
        if drafts:
            kwargs["draft_tokens"] = [5] * drafts
        if enc or kind == "encoder":
            kwargs["encoder_tokens"] = [7 + (i % 5) for i in range(enc or 4)]
        if gen_only:
            kwargs["llm_request_type"] = LlmRequestType.GENERATION_ONLY
            kwargs["context_phase_params"] = ContextPhaseParams(rid, [7] * beam)
        if cfg["reorder"] == "agent_tree" and rid % 3 == 1:
            kwargs["agent_hierarchy"] = [("AgentDeepResearch", rid % 4)]
        r = LlmRequest(rid, _tokens(rid, p, fam), n, **kwargs)
        _put_in_state(r, kind, pos, inner, cross_inner)
        r.estimated_reusable_tokens = 1000 + rid  # stale: shows whether a pass sets it
        requests.append(r)
    if cfg["hold"] and inner.get_num_free_blocks():
        filler = LlmRequest(-1, [90_000 + i for i in range(min(cfg["hold"],
                            inner.get_num_free_blocks()) * b)], 1)
        inner.add_sequence(filler)
    return {"kv": kv, "cross": cross, "peft": peft, "requests": requests, "log": log}


def _allocate(r: LlmRequest, kv: KVCacheManager, cross: KVCacheManager | None) -> bool:
    try:
        kv.add_sequence(r)
    except KVCacheOutOfBlocksError:
        return False
    if cross is not None and r.encoder_tokens:
        try:
            cross.add_sequence(r)
        except KVCacheOutOfBlocksError:
            kv.remove_sequence(r.request_id)
            r.prepopulated_prompt_len = 0
            r.context_current_position = 0
            return False
    return True


def _put_in_state(r: LlmRequest, kind: str, pos: int, kv: KVCacheManager,
                  cross: KVCacheManager | None) -> None:
    simple = {
        "new": S.CONTEXT_INIT, "ctx_and_trans": S.DISAGG_CONTEXT_INIT_AND_TRANS,
        "gen_init": S.DISAGG_GENERATION_INIT, "encoder": S.ENCODER_INIT,
        "wait_scheduler": S.DISAGG_CONTEXT_WAIT_SCHEDULER, "complete": S.GENERATION_COMPLETE,
        "ctx_complete": S.DISAGG_CONTEXT_COMPLETE, "wait_tokens": S.DISAGG_GENERATION_WAIT_TOKENS,
        "unknown": S.UNKNOWN, "trans_error": S.DISAGG_TRANS_ERROR,
    }
    if kind in simple:
        r.state = simple[kind]
        if kind == "ctx_and_trans" and pos % 2 and _allocate(r, kv, cross):
            r.context_current_position = min(r.prompt_len - 1, r.prepopulated_prompt_len + pos)
        return
    r.state = S.CONTEXT_INIT
    if not _allocate(r, kv, cross):
        return  # no room: it stays a new context request
    if kind == "first_allocated":  # allocated, first chunk not run yet
        return
    if kind == "chunked":
        remaining = r.prompt_len - r.prepopulated_prompt_len
        r.context_current_position = r.prepopulated_prompt_len + min(max(1, pos), remaining - 1) \
            if remaining > 1 else r.context_current_position
        return
    if kind == "transfer":
        r.state = S.DISAGG_GENERATION_TRANS_IN_PROGRESS
        return
    if kind == "trans_complete":
        r.state = S.DISAGG_GENERATION_TRANS_COMPLETE
        return
    # A finished prefill, then ``pos`` decode steps (the KV sequence holds one token less).
    r.context_current_position = r.prompt_len
    if kv.enable_block_reuse:
        kv.store_context_blocks(r)
    r.add_new_tokens([11] * r.beam_width)
    for _ in range(min(pos, max(0, r.max_new_tokens - 2))):
        try:
            kv.add_token(r.request_id)
        except KVCacheOutOfBlocksError:
            break
        r.add_new_tokens([12] * r.beam_width)
    r.state = {
        "gen": S.GENERATION_IN_PROGRESS, "gen_to_complete": S.GENERATION_TO_COMPLETE,
        "ctx_trans": S.DISAGG_CONTEXT_TRANS_IN_PROGRESS,
    }[kind]


def _scheduler(cls: type, cfg: dict) -> Any:
    until, after = _BANDS[cfg["band"]]
    policy = cfg["policy"]
    sched = cls(
        cfg["cap"], policy if policy is not None else P.GUARANTEED_NO_EVICT,
        has_kv_cache_manager=policy is not None, two_steps_look_ahead=cfg["two_steps"],
        no_schedule_until_state=until, no_schedule_after_state=after,
        enable_prefix_aware_scheduling=cfg["prefix_aware"],
    )
    sched.set_reorder_policy(_make_reorder(cfg["reorder"]))
    return sched


def _outcome(cls: type, cfg: dict, specs: list[tuple], passes: int = 2) -> list:
    world = build_state(cfg, specs)
    sched = _scheduler(cls, cfg)
    requests = world["requests"]
    results = []
    for _ in range(passes):  # a second pass reads the summaries cached by the first
        try:
            out = sched.schedule(requests, world["kv"], world["peft"], world["cross"])
            result: Any = [[r.request_id for r in part] for part in out]
        except Exception as exc:  # both must fail alike
            result = ("error", type(exc).__name__, str(exc))
        results.append((
            result, snapshot(requests), _pool_counts(world["kv"]), _pool_counts(world["cross"]),
            normalized(world["log"]),
        ))
        world["log"].clear()
    return results


_POOLS = ["stock", "subclass", "public", "public2", "replaced"]


@pytest.mark.parametrize(
    "policy, pool",
    [(policy, pool) for policy in P for pool in _POOLS] + [(None, "public")],
    ids=lambda x: getattr(x, "name", x) or "MAX_REQUESTS",
)
@settings(max_examples=_examples(30))
@given(cfg=world_config, specs=st.lists(request_spec, min_size=0, max_size=12))
def test_random_states_decide_alike(policy: P | None, pool: str, cfg: dict,
                                    specs: list[tuple]) -> None:
    cfg = {**cfg, "policy": policy, "pool": pool}
    assert _outcome(CapacityScheduler, cfg, specs) == _outcome(
        oracle.OracleCapacityScheduler, cfg, specs)


shared_prefix_config = st.tuples(world_config, st.sampled_from(_POOLS[:3])).map(lambda x: {
    **x[0], "pool": x[1], "reuse": True, "prefix_aware": True, "variable_window": False, "cap": 64,
    "num_blocks": 100, "cross_blocks": 60, "hold": 0,
    "cross": None if x[0]["cross"] is None else "public_reuse",
})
shared_prefix_request = st.tuples(
    st.sampled_from(["new", "new", "new", "chunked", "gen", "encoder", "ctx_and_trans"]),
    st.sampled_from([9, 13, 16, 17, 20, 24]),  # prompt length: past the cached prefixes
    st.sampled_from([1, 4, 9]),
    st.sampled_from([1, 2]),  # prefix family
    st.just(1), st.sampled_from([0, 0, 1]), st.sampled_from([None, None, 1]),
    st.sampled_from([0, 9, 9]),  # encoder tokens: equal ones share their first cross block
    st.sampled_from([1, 3, 5]), st.sampled_from([0.2, 0.5, 0.9]),
)


@pytest.mark.parametrize("policy", list(P), ids=lambda p: p.name)
@settings(max_examples=_examples(30))
@given(cfg=shared_prefix_config, specs=st.lists(shared_prefix_request, min_size=2, max_size=10))
def test_shared_uncached_prefixes_decide_alike(policy: P, cfg: dict, specs: list[tuple]) -> None:
    """Prefix-aware skipping: requests sharing an uncached first block (self prompts, and
    encoder tokens in a cross pool that analyzes them) behind admitted or executing ones."""
    cfg = {**cfg, "policy": policy}
    assert _outcome(CapacityScheduler, cfg, specs) == _outcome(
        oracle.OracleCapacityScheduler, cfg, specs)


@settings(max_examples=_examples(25))
@given(
    policy=st.sampled_from(list(P)),
    pool=st.sampled_from(["stock", "subclass", "public"]),
    prefix_aware=st.booleans(),
    window=st.one_of(st.none(), st.integers(8, 64)),
    num_blocks=st.integers(10, 60),
    cap=st.integers(1, 16),
    seed_lengths=st.lists(st.tuples(st.integers(2, 40), st.integers(1, 20), st.integers(0, 9)),
                          min_size=1, max_size=12),
)
def test_a_running_pool_under_every_budget(policy, pool, prefix_aware, window, num_blocks, cap,
                                           seed_lengths) -> None:
    """Some requests decode (sequences allocated, grown, prompts cached), others wait, several
    sharing a cached prefix; a filler outside the band sweeps the free-block budget so that every
    admission threshold is crossed somewhere."""

    def outcome(cls: type) -> list:
        log: list = []
        kv = _make_pool(pool, log, "self", False, num_blocks=num_blocks, tokens_per_block=4,
                        max_attention_window=window, enable_block_reuse=True)
        inner = _inner(kv)
        requests = []
        for rid, (p, n, grown) in enumerate(seed_lengths):
            start = 500 if rid % 3 else 2000 + 50 * rid
            r = LlmRequest(rid, [start + i for i in range(p)], n)
            if rid % 2 == 0 and inner.get_num_free_blocks() > p // 4 + 2:
                inner.add_sequence(r)
                r.context_current_position = r.prompt_len
                inner.store_context_blocks(r)
                r.state = S.GENERATION_IN_PROGRESS
                for _ in range(min(grown, n - 1)):
                    if inner.get_num_free_blocks() < 2:
                        break
                    r.add_new_token(9)
                    inner.add_token(rid)
            requests.append(r)
        sched = cls(cap, policy, enable_prefix_aware_scheduling=prefix_aware)
        results = []
        for filler_blocks in range(inner.get_num_free_blocks() + 1):
            if filler_blocks:
                inner.add_sequence(LlmRequest(-1, [90_000 + i for i in range(filler_blocks * 4)], 1))
            for _ in range(2):
                out = sched.schedule(requests, kv)
                results.append(([[r.request_id for r in part] for part in out], snapshot(requests),
                                _pool_counts(kv), normalized(log)))
                log.clear()
            inner.remove_sequence(-1)
        return results

    assert outcome(CapacityScheduler) == outcome(oracle.OracleCapacityScheduler)


# ---- stepped workloads ------------------------------------------------------------------------
workload_config = st.fixed_dictionaries(
    {
        "tokens_per_block": st.sampled_from([1, 2, 4]),
        "num_blocks": st.integers(6, 60),
        "window": st.one_of(st.none(), st.integers(2, 24)),
        "sink": st.sampled_from([0, 0, 0, 1, 3]),
        "reuse": st.booleans(),
        "prefix_aware": st.booleans(),
        "two_steps": st.booleans(),
        "max_num_requests": st.integers(1, 10),
        "max_batch_size": st.integers(1, 10),
        "chunking": st.sampled_from([None, *ContextChunkingPolicy]),
        "chunk_unit": st.sampled_from([2, 4, 8]),
        "max_num_tokens": st.integers(8, 80),
        "peft": st.booleans(),
        "transfer_steps": st.integers(1, 2),
        "reorder": st.sampled_from([None, None, "priority"]),
    }
)
workload_request = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max new tokens
    st.integers(0, 8),  # arrival step
    st.integers(0, 2),  # prefix family (0: unique)
    st.sampled_from([1, 1, 1, 2]),  # beam width
    st.sampled_from([0, 0, 0, 2]),  # draft tokens
    st.sampled_from([None, None, 1, 2]),  # LoRA task
    st.booleans(),  # generation-only (disaggregated)
    st.sampled_from([0.2, 0.5, 0.9]),  # priority
)


def _workload(cfg: dict, specs: list[tuple], cls: type) -> tuple[SimulatedWorker, list, list]:
    b = cfg["tokens_per_block"]
    log: list = []
    kv = _make_pool(cfg["pool"], log, "self", False, num_blocks=cfg["num_blocks"],
                    tokens_per_block=b, max_attention_window=cfg["window"],
                    enable_block_reuse=cfg["reuse"], sink_token_length=cfg["sink"])
    chunking = cfg["chunking"]
    max_tokens = cfg["max_num_tokens"] if chunking is not None else max(cfg["max_num_tokens"], 60)
    capacity = cls(cfg["max_num_requests"], cfg["policy"], two_steps_look_ahead=cfg["two_steps"],
                   enable_prefix_aware_scheduling=cfg["prefix_aware"])
    capacity.set_reorder_policy(_make_reorder(cfg["reorder"]))
    scheduler = SimpleScheduler(
        capacity,
        MicroBatchScheduler(
            ContextChunkingConfig(chunking, cfg["chunk_unit"]) if chunking is not None else None,
            max_tokens,
        ),
        kv_cache_manager=kv,
        peft_cache_manager=PeftCacheManager(4, {1: 2, 2: 3}) if cfg["peft"] else None,
        max_batch_size=cfg["max_batch_size"],
        max_num_tokens=max_tokens,
    )
    worker = SimulatedWorker(scheduler, kv, max_input_len=60, transfer_steps=cfg["transfer_steps"])
    arrivals = []
    for rid, (p, n, at, fam, beam, drafts, lora, gen_only, prio) in enumerate(specs):
        kwargs: dict = {"beam_width": beam, "lora_task_id": lora if cfg["peft"] else None,
                        "priority": prio}
        if drafts:
            kwargs["draft_tokens"] = [5] * drafts
        if gen_only:
            kwargs["llm_request_type"] = LlmRequestType.GENERATION_ONLY
            kwargs["context_phase_params"] = ContextPhaseParams(rid, [7] * beam)
            n = max(n, 2)
        arrivals.append((at, LlmRequest(rid, _tokens(rid, p, fam), n, **kwargs)))
    arrivals.sort(key=lambda a: a[0])
    return worker, arrivals, log


def _run_workload(cfg: dict, specs: list[tuple], cls: type, steps: int) -> list:
    worker, arrivals, log = _workload(cfg, specs, cls)
    everyone = [r for _, r in arrivals]
    inner = _inner(worker.kv)
    trace: list = []
    for step in range(steps):
        while arrivals and arrivals[0][0] <= step:
            worker.add_request(arrivals.pop(0)[1])
        if not arrivals and worker.idle:
            break
        try:
            record = worker.step()
        except Exception as exc:  # both must fail alike, then the run stops
            trace.append(("error", type(exc).__name__, str(exc)))
            break
        trace.append((record.context, record.generation, record.paused, record.gen_init,
                      record.free_blocks, inner.get_scheduling_num_free_blocks()))
        trace.append(snapshot(everyone))
        trace.append(normalized(log))
        log.clear()
    return trace


@pytest.mark.parametrize("pool", ["stock", "subclass", "public"])
@pytest.mark.parametrize("policy", list(P), ids=lambda p: p.name)
@settings(max_examples=_examples(25))
@given(cfg=workload_config, specs=st.lists(workload_request, min_size=1, max_size=10))
def test_stepped_workloads_decide_alike(policy: P, pool: str, cfg: dict,
                                        specs: list[tuple]) -> None:
    cfg = {**cfg, "policy": policy, "pool": pool}
    assert _run_workload(cfg, specs, CapacityScheduler, 40) == _run_workload(
        cfg, specs, oracle.OracleCapacityScheduler, 40)


# ---- stepped encoder-decoder workloads (a cross pool) -----------------------------------------
cross_config = st.fixed_dictionaries(
    {
        "pool": st.sampled_from(["stock", "public"]),
        "cross": st.sampled_from(["stock", "stock", "subclass", "public", "public_reuse"]),
        "encoder_band": st.booleans(),
        "num_blocks": st.integers(6, 40),
        "cross_blocks": st.integers(2, 24),
        "reuse": st.booleans(),
        "prefix_aware": st.booleans(),
        "two_steps": st.booleans(),
        "cap": st.integers(1, 8),
        "peft": st.booleans(),
    }
)
cross_request = st.tuples(
    st.integers(1, 20),  # prompt length
    st.integers(1, 8),  # max new tokens
    st.integers(0, 6),  # arrival step
    st.integers(0, 2),  # prefix family
    st.sampled_from([0, 3, 5, 9]),  # encoder tokens
    st.sampled_from([None, None, 1, 2]),  # LoRA task
)


def _run_cross(cfg: dict, specs: list[tuple], cls: type, steps: int = 40) -> list:
    """Steps an encoder-decoder workload with the lifecycle functions: an encoder-init request
    runs its encoder when scheduled; a context request takes its cross blocks (the encoder
    output) with its first chunk and frees them with its self blocks."""
    b = 2
    log: list = []
    kv = _make_pool(cfg["pool"], log, "self", False, num_blocks=cfg["num_blocks"],
                    tokens_per_block=b, enable_block_reuse=cfg["reuse"])
    cross = _make_pool(cfg["cross"], log, "cross", False, num_blocks=cfg["cross_blocks"],
                       tokens_per_block=b, is_cross=True)
    inner, cross_inner = _inner(kv), _inner(cross)
    until = S.ENCODER_INIT if cfg["encoder_band"] else S.CONTEXT_INIT
    scheduler = SimpleScheduler(
        cls(cfg["cap"], cfg["policy"], two_steps_look_ahead=cfg["two_steps"],
            no_schedule_until_state=until, enable_prefix_aware_scheduling=cfg["prefix_aware"]),
        MicroBatchScheduler(ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 4),
                            16, no_schedule_until_state=until),
        kv_cache_manager=kv, cross_kv_cache_manager=cross,
        peft_cache_manager=PeftCacheManager(4, {1: 2, 2: 3}) if cfg["peft"] else None,
        max_batch_size=cfg["cap"], max_num_tokens=16,
    )
    arrivals = []
    for rid, (p, n, at, fam, enc, lora) in enumerate(specs):
        r = LlmRequest(rid, _tokens(rid, p, fam), n, lora_task_id=lora if cfg["peft"] else None,
                       encoder_tokens=[3 + (i % 4) for i in range(enc)] if enc else None)
        if not cfg["encoder_band"]:
            r.state = S.CONTEXT_INIT  # the encoder ran elsewhere
        arrivals.append((at, r))
    arrivals.sort(key=lambda a: a[0])
    everyone = [r for _, r in arrivals]
    active: list[LlmRequest] = []
    trace: list = []
    for step in range(steps):
        while arrivals and arrivals[0][0] <= step:
            active.append(arrivals.pop(0)[1])
        if not active and not arrivals:
            break
        try:
            out = scheduler.schedule(active, set())
            for r in out.paused_requests:
                if cross_inner.has_sequence(r.request_id):
                    cross_inner.remove_sequence(r.request_id)
            lifecycle.pause_requests(out.paused_requests, kv, 60)
            if not cfg["encoder_band"]:
                for r in out.paused_requests:
                    r.state = S.CONTEXT_INIT  # its encoder output is kept
            contexts = []
            for r in out.context_requests:
                if r.state == S.ENCODER_INIT:
                    r.state = S.CONTEXT_INIT
                else:
                    contexts.append(r)
            for r in contexts:
                if r.encoder_tokens and not cross_inner.has_sequence(r.request_id):
                    cross_inner.add_sequence(r)
            lifecycle.prepare_context_chunks(contexts, kv)
            for r in out.generation_requests:
                lifecycle.prepare_generation_step(r, kv)
            for r in contexts:
                last = r.context_current_position + r.context_chunk_size >= r.prompt_len
                lifecycle.complete_context_chunk(r, kv, 21 if last else None)
            for r in out.generation_requests:
                lifecycle.complete_generation_step(r, 22)
            for r in list(active):
                if r.is_generation_in_progress_state and lifecycle.reached_max_tokens(r):
                    lifecycle.finish_request(r, kv)
                    if cross_inner.has_sequence(r.request_id):
                        cross_inner.remove_sequence(r.request_id)
                    active.remove(r)
        except Exception as exc:  # both must fail alike, then the run stops
            trace.append(("error", type(exc).__name__, str(exc)))
            break
        trace.append(([[r.request_id for r in part] for part in out[:4]], snapshot(everyone),
                      _pool_counts(kv), _pool_counts(cross), normalized(log)))
        log.clear()
    return trace


@pytest.mark.parametrize("policy", list(P), ids=lambda p: p.name)
@settings(max_examples=_examples(25))
@given(cfg=cross_config, specs=st.lists(cross_request, min_size=1, max_size=8))
def test_stepped_encoder_decoder_workloads_decide_alike(policy: P, cfg: dict,
                                                       specs: list[tuple]) -> None:
    cfg = {**cfg, "policy": policy}
    assert _run_cross(cfg, specs, CapacityScheduler) == _run_cross(
        cfg, specs, oracle.OracleCapacityScheduler)


# ---- targeted cases ---------------------------------------------------------------------------
def test_an_estimate_overridden_by_a_subclass_is_called() -> None:
    """The fast view is for exactly a KVCacheManager: a subclass's estimate is what counts."""
    calls = []

    class OneBlock(KVCacheManager):
        def get_needed_blocks_one_step(self, request, two_steps_look_ahead, summary=None):
            calls.append(request.request_id)
            return 1

    out = CapacityScheduler(4, P.MAX_UTILIZATION).schedule([LlmRequest(1, [1, 2, 3], 2)],
                                                           OneBlock(8, 4))
    assert [r.request_id for r in out.fitting] == [1] and calls == [1]


def test_a_subclass_formula_is_called() -> None:
    class Generous(KVCacheManager):
        def get_remaining_blocks_to_completion(self, request, summary=None):
            return 0

    requests = [LlmRequest(i, [i] * 40, 40) for i in range(3)]  # 20 blocks each, 4 exist
    assert CapacityScheduler(8, P.GUARANTEED_NO_EVICT).schedule(requests, Generous(4, 4)).fitting \
        == requests
    assert CapacityScheduler(8, P.GUARANTEED_NO_EVICT).schedule(
        requests, KVCacheManager(4, 4)).fitting == []


@pytest.mark.parametrize("policy", list(P))
def test_a_two_argument_double_without_reuse_is_served(policy: P) -> None:
    log: list = []
    kv = PublicKV2(KVCacheManager(5, 4), log, "self")
    requests = [LlmRequest(1, [1] * 9, 3), LlmRequest(2, [2] * 9, 3)]  # 3 blocks each
    out = CapacityScheduler(4, policy).schedule(requests, kv)
    assert [r.request_id for r in out.fitting] == [1]
    assert log and {entry[1] for entry in log} >= {"remaining" if policy else "one_step"}


_BASE = {
    "cross": None, "tokens_per_block": 4, "num_blocks": 100, "cross_blocks": 0, "hold": 0,
    "cached": (), "cached_held": False, "window": None, "temporary_window": 0, "sink": 0,
    "reuse": True, "variable_window": False, "prefix_aware": True, "two_steps": False,
    "cap": 64, "band": 0, "peft": None, "peft_tasks": {}, "reorder": None,
}


def _spec(kind: str, p: int, family: int = 1, pos: int = 1) -> tuple:
    return (kind, p, 4, family, 1, 0, None, 0, pos, 0.5)


@pytest.mark.parametrize("pool", _POOLS[:3])
@pytest.mark.parametrize("cfg, specs", [
    # GUARANTEED_NO_EVICT stops pass 1 at the cap; a chunked context behind that point still
    # contributes its first new block, so the duplicate before it is skipped (not stopped).
    ({"policy": P.GUARANTEED_NO_EVICT, "cap": 1},
     [_spec("new", 17), _spec("new", 17), _spec("gen", 9, 0), _spec("chunked", 17, pos=4)]),
    # MAX_UTILIZATION: the duplicate waits, the other context takes the room a pause made.
    ({"policy": P.MAX_UTILIZATION, "num_blocks": 12, "hold": 3},
     [_spec("chunked", 17, pos=4), _spec("new", 17), _spec("new", 9, 0), _spec("gen", 9, 0)]),
], ids=["gne-cap-break", "mu-pause"])
def test_examples_decide_alike(pool: str, cfg: dict, specs: list[tuple]) -> None:
    cfg = {**_BASE, **cfg, "pool": pool}
    assert _outcome(CapacityScheduler, cfg, specs) == _outcome(
        oracle.OracleCapacityScheduler, cfg, specs)

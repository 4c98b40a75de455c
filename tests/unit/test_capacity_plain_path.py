"""The capacity policies' plain paths (a ``KVCacheManager`` without a cross pool: block formulas
evaluated in place) must decide exactly what the generic paths (every formula called through the
blocks managers) decide. A subclass of ``KVCacheManager`` takes the generic path, so two identical
worlds, one on each manager, are driven step by step and compared after every step: the
scheduler's outputs, every request's scheduling fields (chunk sizes, reuse estimates, draft
tokens, positions) and the KV pool.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.scheduler import (
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
from pdserve.scheduler import capacity_plain as capacity_module
from pdserve.scheduler.sim_worker import SimulatedWorker

S = LlmRequestState
P = CapacitySchedulerPolicy


class _GenericKV(KVCacheManager):
    """Same manager; being a subclass sends the policies down their generic paths."""


def test_only_the_exact_class_takes_the_plain_path() -> None:
    plain = KVCacheManager(8, 4)
    assert capacity_module._is_plain_kv(plain, None)
    assert not capacity_module._is_plain_kv(_GenericKV(8, 4), None)
    assert not capacity_module._is_plain_kv(plain, KVCacheManager(8, 4, is_cross=True))


def test_a_formula_replaced_on_the_instance_is_called() -> None:
    kv = KVCacheManager(8, 4)
    calls = []

    def one_step(request, two_steps_look_ahead, summary=None):
        calls.append(request.request_id)
        return 1

    kv.get_needed_blocks_one_step = one_step  # type: ignore[method-assign]
    out = CapacityScheduler(4, P.MAX_UTILIZATION).schedule([LlmRequest(1, [1, 2, 3], 2)], kv)
    assert [r.request_id for r in out.fitting] == [1] and calls == [1]


def _snapshot(requests: list[LlmRequest]) -> list[tuple]:
    return [
        (
            r.request_id, int(r.state), r.prompt_len, r.max_new_tokens,
            r.context_current_position, r.context_chunk_size, r.prepopulated_prompt_len,
            r.estimated_reusable_tokens, tuple(r.draft_tokens or ()), r.get_num_tokens(0),
        )
        for r in requests
    ]


world = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(list(P)),
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
    }
)
request_spec = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max new tokens
    st.integers(0, 8),  # arrival step
    st.integers(0, 2),  # prefix family (0: unique)
    st.sampled_from([1, 1, 1, 2]),  # beam width
    st.sampled_from([0, 0, 0, 2]),  # draft tokens
    st.sampled_from([None, None, 1, 2]),  # LoRA task
    st.booleans(),  # generation-only (disaggregated)
)


def _build(cfg: dict, specs: list[tuple], kv_class: type) -> tuple[SimulatedWorker, list]:
    b = cfg["tokens_per_block"]
    kv = kv_class(
        cfg["num_blocks"], b, max_attention_window=cfg["window"],
        enable_block_reuse=cfg["reuse"], sink_token_length=cfg["sink"],
    )
    chunking = cfg["chunking"]
    max_tokens = cfg["max_num_tokens"] if chunking is not None else max(cfg["max_num_tokens"], 60)
    scheduler = SimpleScheduler(
        CapacityScheduler(
            cfg["max_num_requests"], cfg["policy"], two_steps_look_ahead=cfg["two_steps"],
            enable_prefix_aware_scheduling=cfg["prefix_aware"],
        ),
        MicroBatchScheduler(
            ContextChunkingConfig(chunking, cfg["chunk_unit"]) if chunking is not None else None,
            max_tokens,
        ),
        kv_cache_manager=kv,
        peft_cache_manager=PeftCacheManager(6, {1: 2, 2: 3}) if cfg["peft"] else None,
        max_batch_size=cfg["max_batch_size"],
        max_num_tokens=max_tokens,
    )
    worker = SimulatedWorker(scheduler, kv, max_input_len=60, transfer_steps=cfg["transfer_steps"])
    families = {f: [300 + 17 * f + i for i in range(30)] for f in (1, 2)}
    arrivals = []
    for rid, (p, n, at, fam, beam, drafts, lora, gen_only) in enumerate(specs):
        tokens = families[fam][:p] if fam else [1000 + 41 * rid + i for i in range(p)]
        kwargs: dict = {"beam_width": beam, "lora_task_id": lora if cfg["peft"] else None}
        if drafts:
            kwargs["draft_tokens"] = [5] * drafts
        if gen_only:
            kwargs["llm_request_type"] = LlmRequestType.GENERATION_ONLY
            kwargs["context_phase_params"] = ContextPhaseParams(
                ctx_request_id=rid, first_gen_tokens=[7] * beam
            )
            n = max(n, 2)
        arrivals.append((at, LlmRequest(rid, tokens, n, **kwargs)))
    arrivals.sort(key=lambda a: a[0])
    return worker, arrivals


def _run(cfg: dict, specs: list[tuple], kv_class: type, steps: int) -> list:
    worker, arrivals = _build(cfg, specs, kv_class)
    everyone = [r for _, r in arrivals]
    trace: list = []
    for step in range(steps):
        while arrivals and arrivals[0][0] <= step:
            worker.add_request(arrivals.pop(0)[1])
        if not arrivals and worker.idle:
            break
        try:
            record = worker.step()
        except Exception as exc:  # both paths must fail alike, then the run stops
            trace.append(("error", type(exc).__name__, str(exc)))
            break
        trace.append(
            (record.context, record.generation, record.paused, record.gen_init,
             record.free_blocks, worker.kv.get_scheduling_num_free_blocks())
        )
        trace.append(_snapshot(everyone))
    return trace


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=world, specs=st.lists(request_spec, min_size=1, max_size=10))
def test_plain_and_generic_paths_decide_alike(cfg: dict, specs: list[tuple]) -> None:
    assert _run(cfg, specs, KVCacheManager, 40) == _run(cfg, specs, _GenericKV, 40)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.one_of(st.none(), st.integers(8, 64)),
    num_blocks=st.integers(10, 80),
    cap=st.integers(1, 16),
    seed_lengths=st.lists(st.tuples(st.integers(2, 40), st.integers(1, 20), st.integers(0, 9)),
                          min_size=1, max_size=16),
)
def test_plain_and_generic_paths_on_a_running_pool(window, num_blocks, cap, seed_lengths) -> None:
    """Every policy, with and without prefix awareness, on a pool where some requests already
    decode (sequences allocated and grown, prompts cached) and others wait, several sharing a
    cached prefix, under every free-block budget."""
    for policy in P:
        for prefix_aware in (True, False):
            _compare_running_pool(policy, prefix_aware, window, num_blocks, cap, seed_lengths)


def _compare_running_pool(policy, prefix_aware, window, num_blocks, cap, seed_lengths) -> None:
    def outcome(kv_class: type) -> list:
        b = 4
        kv = kv_class(num_blocks, b, max_attention_window=window, enable_block_reuse=True)
        requests = []
        for rid, (p, n, grown) in enumerate(seed_lengths):
            shared = rid % 3 != 0
            start = 500 if shared else 2000 + 50 * rid
            base = [start + i for i in range(40)]
            r = LlmRequest(rid, base[:p], n)
            if rid % 2 == 0 and kv.get_num_free_blocks() > p // b + 2:
                kv.add_sequence(r)
                r.context_current_position = r.prompt_len
                kv.store_context_blocks(r)
                r.state = S.GENERATION_IN_PROGRESS
                for _ in range(min(grown, n - 1)):
                    if kv.get_num_free_blocks() < 2:
                        break
                    r.add_new_token(9)
                    kv.add_token(rid)
            requests.append(r)
        scheduler = CapacityScheduler(
            cap, policy, enable_prefix_aware_scheduling=prefix_aware
        )
        results = []
        # Sweep the free-block budget with a filler sequence (outside the scheduling band), so
        # that every admission threshold is crossed somewhere.
        for filler_blocks in range(kv.get_num_free_blocks() + 1):
            filler = None
            if filler_blocks:
                filler = LlmRequest(-1, [90_000 + i for i in range(filler_blocks * b)], 1)
                kv.add_sequence(filler)
            out = scheduler.schedule(requests, kv)
            again = scheduler.schedule(requests, kv)  # cached summaries change nothing
            results.append((
                [[r.request_id for r in part] for part in out],
                [[r.request_id for r in part] for part in again],
                _snapshot(requests),
                kv.get_scheduling_num_free_blocks(),
            ))
            if filler is not None:
                kv.remove_sequence(filler.request_id)
        return results

    assert outcome(KVCacheManager) == outcome(_GenericKV)

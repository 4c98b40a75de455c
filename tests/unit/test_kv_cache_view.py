"""SchedulingView, the KV manager's public fast view: its formulas are the manager's estimates
(scheduling.md 2.4 and 2.6), checked against a plain transcription of the reference on random pools,
windows, beams, drafts, reuse credits and states; and it reads sequences and the tree live."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.scheduler.kv_cache import KVCacheManager, KVCacheOutOfBlocksError
from pdserve.scheduler.kv_prefix_reuse import PrefixReuseSummary
from pdserve.scheduler.request import LlmRequest, LlmRequestState as S

_CONTEXT_INIT = (S.CONTEXT_INIT, S.DISAGG_CONTEXT_INIT_AND_TRANS)
_GEN_IN_PROGRESS = (S.GENERATION_IN_PROGRESS, S.GENERATION_TO_COMPLETE,
                    S.DISAGG_GENERATION_TRANS_COMPLETE)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _reference_summary(kv: KVCacheManager, r: LlmRequest) -> PrefixReuseSummary:
    return kv.analyze_prefix_reuse(r.get_prompt_tokens(), r)


def reference_remaining(kv: KVCacheManager, r: LlmRequest, summary) -> tuple[int, int]:
    """Reference 2.4 as written there: (blocks, estimated_reusable_tokens)."""
    b = kv.tokens_per_block
    if kv.is_cross:
        if r.state in _CONTEXT_INIT and r.context_current_position == 0:
            return _ceil(r.encoder_output_len, b), 0
        return 0, 0
    p, n, s, w = r.prompt_len, r.max_new_tokens, kv.sink_bubble_length, kv.max_attention_window
    if w is None:
        ctx_tokens, total_tokens = p, p + n
    else:
        cap = w + kv.temporary_attention_window
        ctx_tokens, total_tokens = min(p, cap), min(p + n, cap)
    ctx_blocks = (ctx_tokens + s) // b
    total_per_beam = _ceil(total_tokens + s, b)
    alloc = kv.get_num_allocated_blocks(r.request_id)
    reusable, estimated = 0, 0
    if (kv.enable_block_reuse and not kv.is_variable_window and r.state in _CONTEXT_INIT
            and r.is_first_context_chunk and alloc == 0):
        summary = summary if summary is not None else _reference_summary(kv, r)
        reusable = min(summary.reusable_blocks_allocated, ctx_blocks)
        estimated = min(summary.reusable_blocks_all, ctx_blocks) * b
    extra = 0
    if w is not None and p + n > w:
        max_blocks = _ceil(p + n, b)
        if max_blocks > _ceil(r.get_num_tokens(0), b) and max_blocks > total_per_beam:
            extra = 1
    beam = r.beam_width
    eff_ctx = ctx_blocks - reusable
    if alloc < eff_ctx:
        return (eff_ctx - alloc) + (total_per_beam - ctx_blocks + extra) * beam, estimated
    return (total_per_beam - reusable - alloc + extra) * beam, estimated


def reference_one_step(kv: KVCacheManager, r: LlmRequest, two_steps: bool, summary):
    """Reference 2.6 as written there: (blocks, estimated_reusable_tokens)."""
    b, beam = kv.tokens_per_block, r.beam_width
    gen_init = r.state == S.DISAGG_GENERATION_INIT
    if gen_init or (r.state in _CONTEXT_INIT and r.is_first_context_chunk):
        base = r.encoder_output_len if kv.is_cross else r.prompt_len
        length = base + r.num_draft_tokens
        if kv.max_attention_window is not None:
            length = min(length, kv.max_attention_window + r.max_new_tokens)
        length += kv.sink_bubble_length
        shared = length // b
        need = shared + (beam if length % b else 0)
        estimated = 0
        if kv.enable_block_reuse and not kv.is_cross and not kv.is_variable_window and not gen_init:
            summary = summary if summary is not None else _reference_summary(kv, r)
            need -= min(summary.reusable_blocks_allocated, shared)
            estimated = min(summary.reusable_blocks_all, shared) * b
        return need, estimated
    if r.state in _GEN_IN_PROGRESS and not kv.is_cross:
        has_seq = kv.has_sequence(r.request_id)
        cur = kv.get_num_tokens(r.request_id) if has_seq else r.get_num_tokens(0)
        add = min((2 if two_steps else 1) * (r.num_draft_tokens + 1),
                  r.max_new_tokens - (cur - r.prompt_len))
        nxt = cur + add
        if kv.max_token_num is not None and nxt > kv.max_token_num:
            return 0, 0
        return (_ceil(nxt, b) - _ceil(cur, b)) * beam, 0
    return 0, 0


def _measured(r: LlmRequest, estimate, *args) -> tuple[int, int]:
    r.estimated_reusable_tokens = -1  # every estimate sets it
    blocks = estimate(r, *args)
    return blocks, r.estimated_reusable_tokens


_FAMILY = [500 + i for i in range(48)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_view_and_manager_match_the_reference_formulas(data) -> None:
    b = data.draw(st.sampled_from([1, 2, 4, 16]), "tokens_per_block")
    cross = data.draw(st.booleans(), "cross")
    kv = KVCacheManager(
        240,
        b,
        max_attention_window=data.draw(st.one_of(st.none(), st.integers(1, 40)), "window"),
        enable_block_reuse=not cross and data.draw(st.booleans(), "reuse"),
        sink_token_length=data.draw(st.sampled_from([0, 0, 1, 3, 5]), "sink"),
        is_cross=cross,
        temporary_attention_window=data.draw(st.sampled_from([0, 0, 2]), "temporary"),
    )
    kv.is_variable_window = data.draw(st.sampled_from([False, False, True]), "variable")
    requests = []
    for rid in range(data.draw(st.integers(1, 6), "requests")):
        p = data.draw(st.integers(1, 40))
        shared = data.draw(st.booleans())
        tokens = _FAMILY[:p] if shared else [9000 + 50 * rid + i for i in range(p)]
        drafts = data.draw(st.sampled_from([0, 0, 1, 3]))
        r = LlmRequest(
            rid, tokens, data.draw(st.integers(0, 24)),
            beam_width=data.draw(st.sampled_from([1, 1, 2, 3])),
            draft_tokens=[5] * drafts if drafts else None,
            encoder_tokens=list(range(data.draw(st.integers(1, 30)))) if cross else None,
        )
        if data.draw(st.booleans()):  # holds a sequence, possibly grown, its prompt cached
            try:
                kv.add_sequence(r)
                kv.store_context_blocks(r)
                for _ in range(data.draw(st.integers(0, 20))):
                    kv.add_token(rid)
                    r.add_new_tokens([7] * r.beam_width)
            except KVCacheOutOfBlocksError:  # a small drawn pool: the request keeps what it got
                pass
        r.state = data.draw(st.sampled_from(list(S)))
        r.context_current_position = data.draw(
            st.sampled_from([0, r.prepopulated_prompt_len, r.prompt_len, min(3, r.prompt_len)])
        )
        requests.append(r)

    view = kv.scheduling_view()
    for r in requests:
        held = data.draw(st.integers(0, 12))
        summaries = [None, PrefixReuseSummary(held, held + data.draw(st.integers(0, 4)), None)]
        if not cross:
            summaries.append(kv.analyze_prefix_reuse(r.get_tokens(0), r))
        for summary in summaries:
            expected = reference_remaining(kv, r, summary)
            assert _measured(r, kv.get_remaining_blocks_to_completion, summary) == expected
            assert _measured(r, view.blocks_to_completion, summary) == expected
            for two_steps in (False, True):
                expected = reference_one_step(kv, r, two_steps, summary)
                assert _measured(r, kv.get_needed_blocks_one_step, two_steps, summary) == expected
                assert _measured(r, view.blocks_one_step, two_steps, summary) == expected
        if not cross:
            assert view.prefix_summary(r) == kv.analyze_prefix_reuse(r.get_tokens(0), r)


def test_view_reads_sequences_and_the_tree_live() -> None:
    kv = KVCacheManager(50, 4, enable_block_reuse=True)
    view = kv.scheduling_view()  # made before anything below happens
    prompt = list(range(17))
    first = LlmRequest(1, prompt, 8)
    assert view.blocks_to_completion(first) == 7  # ceil(25 / 4), nothing allocated
    assert view.prefix_summary(first) == (0, 0, first.block_key_cache[(4, False)].keys[0])
    kv.add_sequence(first)
    assert view.blocks_to_completion(first) == 7 - 5
    kv.store_context_blocks(first)  # caches the 4 full blocks of the first 16 tokens
    second = LlmRequest(2, prompt, 8)
    assert view.prefix_summary(second) == (4, 4, None)
    assert view.blocks_to_completion(second, view.prefix_summary(second)) == 7 - 4
    assert second.estimated_reusable_tokens == 16
    kv.remove_sequence(1)  # the cached blocks are free now: reuse saves compute, not blocks
    assert view.prefix_summary(second) == (0, 4, None)
    assert view.blocks_to_completion(second, view.prefix_summary(second)) == 7

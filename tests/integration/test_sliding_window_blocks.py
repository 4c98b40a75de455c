"""Sliding-window models free KV blocks as the window passes (every layer shares one window W):
greedy tokens stay transformers' while a sequence holds only its live blocks. Prompts longer
and shorter than W + T (T: the temporary window, max_num_tokens in whole blocks + B), with and
without chunking, prefix reuse, pauses (MAX_UTILIZATION reading what the window allocates), n > 1,
abort, and a 1P1D split whose two workers keep different numbers of trailing blocks."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers.loading.memory import sliding_window_of  # noqa: E402
from pdserve.workers.loading.loader import load_config  # noqa: E402

W, B = 8, 4
CHUNKED = dict(tokens_per_block=B, num_kv_blocks=64, max_batch_size=8, max_num_tokens=16,
               context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
               enable_block_reuse=True)
LIVE_LIMIT = -(-(W + 16 + B) // B)  # a prompt's live blocks: ceil((W + T) / B), T = 16 + B
DECODE_LIMIT = -(-(W + B - 1) // B)  # a decode's: its span stays under W + B tokens
VARIANTS = {
    "mistral": ("MistralConfig", {"sliding_window": W}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 0}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Any, Path]]:
    tmp = tmp_path_factory.mktemp("sliding")
    return {name: P.build_hf_model(tmp, cls, overrides, name=name) for name, (cls, overrides) in VARIANTS.items()}


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _batch(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, P.VOCAB) for _ in range(n)] for n in lengths]


def _drained(llm: LLM) -> bool:
    kv = llm.engine.core.kv
    return kv.get_num_free_blocks() == kv.num_blocks and not kv.sequence_ids()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_engine_parity(built, name):
    """The harness: chunked prefill with prefix reuse (prompts of 14 .. 70 tokens, within and
    past W + T = 28), then a pool small enough that MAX_UTILIZATION pauses and recomputes."""
    hf, path = built[name]
    assert sliding_window_of(load_config(path)) == W
    got = P.check_engine_parity(hf, path)
    assert got["reused_blocks"] > 0 and got["pauses"] > 0


def test_long_decodes_hold_only_live_blocks(built):
    hf, path = built["mistral"]
    llm = LLM(path, **CHUNKED)
    kv = llm.engine.core.kv
    assert (kv.max_attention_window, kv.temporary_attention_window) == (W, 16 + B)
    batch = _batch(3, (27, 90))
    expected = P.reference(hf, batch, 40)
    engine = llm.engine
    rids = [engine.add_request(p, _greedy(40)) for p in batch]
    peak = {rid: 0 for rid in rids}
    decode_peak = 0
    done: dict[int, list[int]] = {}
    while engine.has_unfinished:
        # MAX_UTILIZATION's next-step needs never undercount: TensorRT-LLM's formula counts no
        # block for a decode past W, this manager opens one at each block boundary.
        live = engine.core.active + engine.core.waiting
        needed = sum(kv.get_needed_blocks_one_step(r, False) for r in live)
        used = kv.get_num_used_blocks()
        for out, update in engine.step():
            if update.finished:
                done[out.request_id] = out.token_ids
        assert kv.get_num_used_blocks() - used <= needed
        for rid, prompt in zip(rids, batch):
            held = kv.get_num_allocated_blocks(rid)
            peak[rid] = max(peak[rid], held)
            if held and kv.get_num_tokens(rid) > len(prompt):  # decoding
                decode_peak = max(decode_peak, held)
                assert kv.get_num_front_blocks_removed(rid) > 0
    assert [done[r] for r in rids] == expected
    # 90 + 40 tokens would take 33 blocks without the window.
    assert peak[rids[1]] == LIVE_LIMIT and decode_peak == DECODE_LIMIT, (peak, decode_peak)
    assert _drained(llm)


def test_chunking_off_and_prompts_past_the_live_blocks(built):
    """Without chunking every prompt is one step within W + T; with chunking a prompt of 150
    tokens writes its early chunks ring-wise into its 7 live blocks."""
    hf, path = built["mistral"]
    batch = _batch(4, (9, 33, 57))
    one_step = LLM(path, **{**CHUNKED, "context_chunking_policy": None, "max_num_tokens": 64})
    assert [o.token_ids for o in one_step.generate(batch, _greedy(16))] == P.reference(hf, batch, 16)
    assert _drained(one_step)
    batch = _batch(5, (150, 33))
    chunked = LLM(path, **{**CHUNKED, "enable_block_reuse": False, "chunk_unit_size": 1,
                           "context_chunking_policy": "EQUAL_PROGRESS"})
    assert [o.token_ids for o in chunked.generate(batch, _greedy(10))] == P.reference(hf, batch, 10)
    assert _drained(chunked)


def test_no_reuse_credit_past_the_window(built):
    """A prompt just past W + T whose prefix is cached: the manager reuses nothing for it, so
    the scheduler credits nothing either (its chunks stay within max_num_tokens)."""
    hf, path = built["mistral"]
    llm = LLM(path, **CHUNKED)
    prefix = _batch(6, (28,))[0]
    long = prefix[:24] + _batch(7, (7,))[0]  # 31 tokens > W + T, 24 of them cached
    expected = P.reference(hf, [prefix, long], 10)
    assert llm.generate([prefix], _greedy(10))[0].token_ids == expected[0]
    assert llm.engine.core.kv.get_num_cached_blocks() == 27 // B
    steps = llm.stats.steps
    assert llm.generate([long], _greedy(10))[0].token_ids == expected[1]
    assert llm.stats.steps - steps == 2 + 9  # two chunks of at most 16 tokens, then 9 decodes
    assert _drained(llm)


def test_several_candidates_and_abort(built):
    hf, path = built["qwen3"]
    batch = _batch(8, (23, 81))  # forked within W + T, and with blocks already detached
    expected = P.reference(hf, batch, 12)
    llm = LLM(path, **CHUNKED)
    for out, want in zip(llm.generate(batch, _greedy(12, n=3)), expected):
        assert [c.token_ids for c in out.outputs] == [want] * 3
    assert _drained(llm)
    engine = llm.engine
    rid = engine.add_request(batch[1], _greedy(30))
    for _ in range(12):
        engine.step()
    assert engine.core.kv.get_num_front_blocks_removed(rid) > 0
    assert engine.abort(rid) and _drained(llm)


def test_max_utilization_in_a_tight_pool(built):
    """MAX_UTILIZATION in a pool of 11 blocks with prompts within and past W + T: the next-step
    needs it reads are what the windowed manager allocates, so no step runs out of blocks."""
    hf, path = built["mistral"]
    batch = _batch(9, (12, 30, 19, 5, 16))
    expected = P.reference(hf, batch, 12)
    llm = LLM(path, tokens_per_block=B, num_kv_blocks=11, max_num_tokens=16, max_batch_size=8,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
              capacity_scheduler_policy="MAX_UTILIZATION", enable_block_reuse=False)
    assert [o.token_ids for o in llm.generate(batch, _greedy(12))] == expected
    assert _drained(llm)


def test_1p1d_moves_the_trailing_live_blocks(built, tmp_path):
    """The generation worker keeps more trailing blocks (max_num_tokens 64: T = 68) than the
    context worker (T = 20): only the context's live blocks travel, the rest stay unwritten
    outside the window and out of the prefix cache; tokens are transformers'."""
    hf, path = built["mistral"]
    got = P.check_disagg_parity(hf, path, tmp_path, gen_engine={"max_num_tokens": 64})
    moved = {r["request_id"]: r["nbytes"] for r in got["records"]}
    s = P.SMALL
    per_block = (s["num_hidden_layers"] * 2 * B * s["num_key_value_heads"]
                 * s["hidden_size"] // s["num_attention_heads"] * 4)  # K and V, float32
    # The 52- and 70-token prompts (13 and 18 blocks there) receive the context's 7.
    assert [len(p) for p in P.prompts()][3:5] == [52, 70]
    assert moved[3] == moved[4] == LIVE_LIMIT * per_block
    assert got["generation_status"]["free_blocks"] == got["generation_status"]["total_blocks"]

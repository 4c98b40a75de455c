"""transport/tp_map.py: which KV heads a TP rank holds, and the moves between a context worker of
TP size P and a generation worker of TP size D, checked against a brute-force oracle (who owns
head h, found by looping over ranks), byte counts, and four regression cases from peers' bugs."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.transport.tp_map import (
    KVMove, TPLayout, TPLayoutError, bytes_per_dst_rank, bytes_per_src_rank, kv_heads_of_rank,
    plan_kv_moves,
)

TP_SIZES = (1, 2, 4, 8)
KV_HEADS = (1, 2, 4, 8, 64)
ATTENTION = ("mha", "gqa", "mla")
GRID = list(itertools.product(TP_SIZES, TP_SIZES, KV_HEADS, ATTENTION))

# ------------------------------------------------------------------------------------ the oracle


def oracle_valid(tp: int, heads: int, attention: str) -> bool:
    if attention == "mla":
        return heads == 1
    return heads % tp == 0 or tp % heads == 0


def oracle_owned(tp: int, rank: int, heads: int, attention: str) -> list[int]:
    """The heads rank ``rank`` holds, by testing every head (a formulation independent of the
    module's: h*tp//heads is the rank of an evenly split head, rank*heads//tp the head of a
    replicated rank)."""
    if attention == "mla":
        return [0]
    if heads >= tp:
        return [h for h in range(heads) if h * tp // heads == rank]
    return [h for h in range(heads) if h == rank * heads // tp]


def oracle_holders(tp: int, head: int, heads: int, attention: str) -> list[int]:
    return [r for r in range(tp) if head in oracle_owned(tp, r, heads, attention)]


def check_plan(ctx_tp: int, gen_tp: int, heads: int, attention: str) -> None:
    """Every invariant of plan_kv_moves for one combination, or its refusal when invalid."""
    if not (oracle_valid(ctx_tp, heads, attention) and oracle_valid(gen_tp, heads, attention)):
        with pytest.raises(TPLayoutError):
            plan_kv_moves(ctx_tp, gen_tp, heads, attention)
        return
    for tp in (ctx_tp, gen_tp):
        for rank in range(tp):
            expected = oracle_owned(tp, rank, heads, attention)
            assert list(kv_heads_of_rank(tp, rank, heads, attention)) == expected
    moves = plan_kv_moves(ctx_tp, gen_tp, heads, attention)

    # Each source holds what it sends; "copy" global head ids through the offsets: every slot of
    # every destination is written once, and ends up holding exactly the heads it must.
    src_local = {s: oracle_owned(ctx_tp, s, heads, attention) for s in range(ctx_tp)}
    dst_local: dict[int, list[int | None]] = {
        d: [None] * len(oracle_owned(gen_tp, d, heads, attention)) for d in range(gen_tp)}
    for m in moves:
        assert m.num_heads >= 1
        assert set(range(m.head_start, m.head_stop)) <= set(src_local[m.src_rank])
        assert src_local[m.src_rank][m.src_heads] == list(range(m.head_start, m.head_stop))
        assert dst_local[m.dst_rank][m.dst_heads] == [None] * m.num_heads, f"{m} writes a slot twice"
        dst_local[m.dst_rank][m.dst_heads] = src_local[m.src_rank][m.src_heads]
    assert dst_local == {d: oracle_owned(gen_tp, d, heads, attention) for d in range(gen_tp)}

    # Merged: at most one move per (src, dst) pair, so at most P * D sends; ordered.
    assert len(moves) <= ctx_tp * gen_tp
    assert len({(m.src_rank, m.dst_rank) for m in moves}) == len(moves)
    assert list(moves) == sorted(moves, key=lambda m: (m.dst_rank, m.head_start))

    # Spread: the destinations reading one replicated head read distinct replicas while any is free.
    for head in range(heads):
        sources = [m.src_rank for m in moves if m.head_start <= head < m.head_stop]
        wanters = [d for d in range(gen_tp) if head in oracle_owned(gen_tp, d, heads, attention)]
        assert len(sources) == len(wanters)
        assert len(set(sources)) == min(len(oracle_holders(ctx_tp, head, heads, attention)), len(wanters))

    # Deterministic: a fresh computation (past the cache) gives the same plan.
    assert plan_kv_moves.__wrapped__(ctx_tp, gen_tp, heads, attention) == moves


@given(st.sampled_from(GRID))
def test_plan_matches_the_oracle(case):
    check_plan(*case)


def test_plan_matches_the_oracle_on_the_whole_grid():
    for case in GRID:
        check_plan(*case)


@given(st.integers(1, 16), st.integers(1, 16), st.integers(1, 96), st.sampled_from(ATTENTION))
def test_plan_matches_the_oracle_on_any_sizes(ctx_tp, gen_tp, heads, attention):
    """Sizes that do not divide each other too: they are refused, never mapped wrongly."""
    check_plan(ctx_tp, gen_tp, heads, attention)


# ----------------------------------------------------------------------------------- refusals


def test_refusals_name_the_numbers():
    with pytest.raises(TPLayoutError, match="tensor parallel size 3 does not divide 8 KV heads"):
        kv_heads_of_rank(3, 0, 8, "gqa")
    with pytest.raises(TPLayoutError, match="3 KV heads do not divide tensor parallel size 4"):
        kv_heads_of_rank(4, 0, 3, "mha")
    with pytest.raises(TPLayoutError, match="num_kv_heads must be 1, not 8"):
        plan_kv_moves(2, 2, 8, "mla")
    with pytest.raises(TPLayoutError, match="rank 4 is outside tensor parallel size 4"):
        kv_heads_of_rank(4, 4, 8, "gqa")
    with pytest.raises(TPLayoutError, match="'mqa' is not one of mha, gqa, mla"):
        kv_heads_of_rank(1, 0, 1, "mqa")
    with pytest.raises(TPLayoutError, match="positive integer, not 0"):
        plan_kv_moves(0, 1, 8, "gqa")
    assert issubclass(TPLayoutError, ValueError)


# -------------------------------------------------------------------------------- byte counts

SHAPE = dict(num_blocks=3, num_layers=2, num_planes=2, tokens_per_block=16, head_dim=64, itemsize=2)
HEAD = 3 * 2 * 2 * 16 * 64 * 2  # one KV head's bytes over the 3 blocks


def test_bytes_gqa_heads_split_over_both_sides():
    moves = plan_kv_moves(2, 4, 8, "gqa")
    assert bytes_per_dst_rank(moves, gen_tp=4, **SHAPE) == dict.fromkeys(range(4), 2 * HEAD)
    assert bytes_per_src_rank(moves, ctx_tp=2, **SHAPE) == {0: 4 * HEAD, 1: 4 * HEAD}


@pytest.mark.parametrize("ctx_tp", [1, 2, 4])
def test_bytes_replicated_on_the_generation_side(ctx_tp):
    moves = plan_kv_moves(ctx_tp, 4, 2, "gqa")
    assert bytes_per_dst_rank(moves, gen_tp=4, **SHAPE) == dict.fromkeys(range(4), HEAD)
    assert sum(bytes_per_src_rank(moves, ctx_tp=ctx_tp, **SHAPE).values()) == 4 * HEAD


def test_bytes_replicated_on_the_context_side_are_read_once():
    moves = plan_kv_moves(4, 1, 2, "gqa")
    assert bytes_per_dst_rank(moves, gen_tp=1, **SHAPE) == {0: 2 * HEAD}
    # Head 0 lives on ranks 0 and 1, head 1 on ranks 2 and 3: one replica of each is read.
    assert bytes_per_src_rank(moves, ctx_tp=4, **SHAPE) == {0: HEAD, 1: 0, 2: HEAD, 3: 0}


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (2, 8), (8, 2), (4, 4)])
def test_bytes_mla_one_latent_per_destination(ctx_tp, gen_tp):
    latent = dict(SHAPE, num_planes=1, head_dim=512 + 64)
    one = 3 * 2 * 1 * 16 * 576 * 2
    moves = plan_kv_moves(ctx_tp, gen_tp, 1, "mla")
    assert bytes_per_dst_rank(moves, gen_tp=gen_tp, **latent) == dict.fromkeys(range(gen_tp), one)
    assert [m.src_rank for m in moves] == [d % ctx_tp for d in range(gen_tp)]
    sent = bytes_per_src_rank(moves, ctx_tp=ctx_tp, **latent)
    assert sum(sent.values()) == gen_tp * one and max(sent.values()) == -(-gen_tp // ctx_tp) * one


def test_bytes_refuse_a_move_outside_the_group():
    with pytest.raises(TPLayoutError, match="dst_rank 4, outside tensor parallel size 4"):
        bytes_per_dst_rank([KVMove(0, 4, 0, 1, 0, 0)], gen_tp=4, **SHAPE)


# ------------------------------------------------------------------------------------ layouts


def test_layout_mismatch_names_both_sides():
    ctx = TPLayout(tp_size=4, rank=1, num_kv_heads=8, attention="gqa")
    assert ctx.kv_heads == range(2, 4)
    assert ctx.mismatch(TPLayout(1, 0, 8, "gqa")) == ""  # TP sizes may differ: the map bridges them
    message = ctx.mismatch(TPLayout(2, 0, 4, "mha"))
    assert message.startswith("attention gqa vs mha; num_kv_heads 8 vs 4")
    assert "tensor parallel size 4 rank 1" in message and "tensor parallel size 2 rank 0" in message
    with pytest.raises(TPLayoutError, match="tensor parallel size 3 does not divide 8 KV heads"):
        TPLayout(3, 0, 8, "gqa")


# ------------------------------------------------------------------- regressions from peers


@pytest.mark.parametrize("heads", [8, 2])
def test_vllm_43523_prefill_tp4_to_decode_tp1(heads):
    """vLLM #43523: prefill TP4 -> decode TP1 crashed every decode pod (KeyError in block_size_ratio)."""
    moves = plan_kv_moves(4, 1, heads, "gqa")
    assert {m.dst_rank for m in moves} == {0}
    received = [h for m in moves for h in range(m.head_start, m.head_stop)]
    assert received == list(range(heads))  # every head once, in order
    assert [m.dst_offset for m in moves] == [m.head_start for m in moves]
    if heads == 8:  # each source sends its two heads
        assert [(m.src_rank, m.head_start, m.head_stop, m.src_offset) for m in moves] == [
            (0, 0, 2, 0), (1, 2, 4, 0), (2, 4, 6, 0), (3, 6, 8, 0)]
    else:  # heads replicated on P: one replica of each is read
        assert [(m.src_rank, m.head_start, m.src_offset) for m in moves] == [(0, 0, 0), (2, 1, 0)]


@pytest.mark.parametrize("ctx_tp", [1, 2])
def test_sglang_31295_prefill_to_tp4_decode_two_kv_heads(ctx_tp):
    """SGLang #31295: prefill to a TP4 decode of a 2-KV-head model failed (NIXL_ERR_NOT_FOUND)."""
    moves = plan_kv_moves(ctx_tp, 4, 2, "gqa")
    assert len(moves) == 4
    for rank, m in enumerate(moves):
        assert (m.dst_rank, m.head_start, m.head_stop, m.dst_offset) == (rank, rank // 2, rank // 2 + 1, 0)
        src_heads = kv_heads_of_rank(ctx_tp, m.src_rank, 2, "gqa")
        assert m.head_start in src_heads
        # The read stays inside the source's own heads (the bug addressed past them).
        assert m.src_offset == m.head_start - src_heads.start
        assert m.src_offset + m.num_heads <= len(src_heads)


def test_sglang_22145_non_mla_head_offsets():
    """SGLang #22145: non-MLA models hung forever (wrong head offsets)."""
    # P=2 -> D=4: each source's 4 heads split in two; the second half starts at source offset 2.
    assert [(m.src_rank, m.dst_rank, m.head_start, m.src_offset, m.dst_offset)
            for m in plan_kv_moves(2, 4, 8, "gqa")] == [
        (0, 0, 0, 0, 0), (0, 1, 2, 2, 0), (1, 2, 4, 0, 0), (1, 3, 6, 2, 0)]
    # P=4 -> D=2: each destination gathers two sources; the second lands at destination offset 2.
    assert [(m.src_rank, m.dst_rank, m.head_start, m.src_offset, m.dst_offset)
            for m in plan_kv_moves(4, 2, 8, "gqa")] == [
        (0, 0, 0, 0, 0), (1, 0, 2, 0, 2), (2, 1, 4, 0, 0), (3, 1, 6, 0, 2)]
    assert all(m.num_heads == 2 for m in plan_kv_moves(4, 2, 8, "gqa"))


@pytest.mark.parametrize("heads", [4, 8])
def test_tensorrt_llm_6507_prefill_tp2_to_decode_tp1(heads):
    """TensorRT-LLM #6507: wrong outputs with prefill TP2 -> decode TP1."""
    half = heads // 2
    assert plan_kv_moves(2, 1, heads, "gqa") == (
        KVMove(src_rank=0, dst_rank=0, head_start=0, head_stop=half, src_offset=0, dst_offset=0),
        KVMove(src_rank=1, dst_rank=0, head_start=half, head_stop=heads, src_offset=0, dst_offset=half))

"""The KV-transfer map between tensor-parallel layouts. PURE (stdlib only): which KV heads each
TP rank holds, and the moves that carry a request's KV cache from a context (prefill) worker of
TP size P to a generation (decode) worker of TP size D. The data plane executes the moves.

The ownership rule (the model code shards attention by it, so it is the only rule allowed):

- MHA / GQA with ``num_kv_heads >= tp_size``: the heads split evenly and in order; rank r holds
  [r*k, (r+1)*k) with k = num_kv_heads // tp_size (tp_size must divide num_kv_heads).
- MHA / GQA with ``tp_size > num_kv_heads``: each KV head is replicated over
  n = tp_size // num_kv_heads consecutive ranks; rank r holds the single head r // n, the one its
  query heads attend with (vLLM's rule; num_kv_heads must divide tp_size).
- MLA: the compressed latent is the same on every rank. The map treats it as one KV head,
  range(0, 1), replicated on every rank (num_kv_heads must be 1), which is the rule above with
  one head, so MLA needs no code path of its own beyond that check.

A pool tensor holds only a rank's local heads ([layers, planes, blocks, tokens, local_heads,
head_dim]), so a move names a half-open range of global heads and where that range starts inside
the source's local heads (``src_offset``) and inside the destination's (``dst_offset``).

Invariants of ``plan_kv_moves`` (tests/unit/test_tp_map.py checks them against a brute-force
oracle):
- every destination rank receives each head it holds exactly once, and nothing else;
- a head several source ranks hold is read from one of them, ``holders[dst % len(holders)]``:
  destinations wanting the same head are consecutive ranks, so their reads land on distinct
  replicas instead of all on the first;
- contiguous heads of one (src, dst) pair form one move. A source's heads and a destination's
  heads are each a contiguous range, so each pair has at most one move: a request's transfer is
  at most P * D sends, never one per head.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

ATTENTION_KINDS = ("mha", "gqa", "mla")


class TPLayoutError(ValueError):
    """A TP size, rank, KV head count or attention kind the ownership rule cannot shard."""


def _check(tp_size: int, num_kv_heads: int, attention: str) -> None:
    if attention not in ATTENTION_KINDS:
        raise TPLayoutError(f"attention {attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TPLayoutError(f"tensor parallel size must be a positive integer, not {tp_size!r}")
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise TPLayoutError(f"the number of KV heads must be a positive integer, not {num_kv_heads!r}")
    if attention == "mla":
        if num_kv_heads != 1:
            raise TPLayoutError(f"MLA caches one latent shared by every head, so num_kv_heads must be 1, "
                                f"not {num_kv_heads}")
    elif num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise TPLayoutError(f"tensor parallel size {tp_size} does not divide {num_kv_heads} KV heads")
    elif tp_size % num_kv_heads:
        raise TPLayoutError(f"{num_kv_heads} KV heads do not divide tensor parallel size {tp_size}, so they "
                            "cannot be replicated evenly over its ranks")


def kv_heads_of_rank(tp_size: int, rank: int, num_kv_heads: int, attention: str) -> range:
    """The global KV head indices rank ``rank`` of a TP group of ``tp_size`` holds, in the order
    its pool stores them (local head i is global head ``start + i``)."""
    _check(tp_size, num_kv_heads, attention)
    if not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise TPLayoutError(f"rank {rank!r} is outside tensor parallel size {tp_size} "
                            f"(ranks 0 to {tp_size - 1})")
    if num_kv_heads >= tp_size:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def _holders(tp_size: int, head: int, num_kv_heads: int) -> range:
    """The ranks holding global head ``head``: the inverse of ``kv_heads_of_rank`` (checked)."""
    if num_kv_heads >= tp_size:
        rank = head // (num_kv_heads // tp_size)
        return range(rank, rank + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


@dataclass(frozen=True, slots=True)
class KVMove:
    """Copy global KV heads [head_start, head_stop) of every travelling block from context rank
    ``src_rank`` to generation rank ``dst_rank``. In the pools' local-head axis that is
    ``src_offset : src_offset + num_heads`` on the source and ``dst_offset : ...`` on the
    destination; every layer, plane, block and token of that slice travels."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_stop: int
    src_offset: int
    dst_offset: int

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start

    @property
    def src_heads(self) -> slice:
        """The slice of the source pool's local-head axis."""
        return slice(self.src_offset, self.src_offset + self.num_heads)

    @property
    def dst_heads(self) -> slice:
        """The slice of the destination pool's local-head axis."""
        return slice(self.dst_offset, self.dst_offset + self.num_heads)


# Cached: the plan depends only on four small values, and a worker asks for it per request.
@functools.lru_cache(maxsize=256)
def plan_kv_moves(ctx_tp: int, gen_tp: int, num_kv_heads: int, attention: str) -> tuple[KVMove, ...]:
    """The moves carrying a request's KV cache from a context worker of TP size ``ctx_tp`` to a
    generation worker of TP size ``gen_tp``, ordered by destination rank then head."""
    _check(ctx_tp, num_kv_heads, attention)
    _check(gen_tp, num_kv_heads, attention)
    moves: list[KVMove] = []
    for dst in range(gen_tp):
        wanted = kv_heads_of_rank(gen_tp, dst, num_kv_heads, attention)
        for head in wanted:
            holders = _holders(ctx_tp, head, num_kv_heads)
            src = holders[dst % len(holders)]
            last = moves[-1] if moves else None
            if last is not None and (last.dst_rank, last.src_rank, last.head_stop) == (dst, src, head):
                moves[-1] = replace(last, head_stop=head + 1)  # the same pair's next head: extend
                continue
            src_start = kv_heads_of_rank(ctx_tp, src, num_kv_heads, attention).start
            moves.append(KVMove(src, dst, head, head + 1, src_offset=head - src_start,
                                dst_offset=head - wanted.start))
    return tuple(moves)


def _bytes_by_rank(moves: Iterable[KVMove], side: str, tp_size: int, head_bytes: int) -> dict[int, int]:
    totals = dict.fromkeys(range(tp_size), 0)  # a rank that moves nothing still appears, with 0
    for move in moves:
        rank = getattr(move, side)
        if rank not in totals:
            raise TPLayoutError(f"a move names {side} {rank}, outside tensor parallel size {tp_size}")
        totals[rank] += move.num_heads * head_bytes
    return totals


def _head_bytes(num_blocks: int, num_layers: int, num_planes: int, tokens_per_block: int,
                head_dim: int, itemsize: int) -> int:
    """Bytes of one KV head over ``num_blocks`` blocks, all layers and planes (for MLA: one
    plane, ``head_dim`` the latent's width)."""
    return num_blocks * num_layers * num_planes * tokens_per_block * head_dim * itemsize


def bytes_per_dst_rank(moves: Iterable[KVMove], *, gen_tp: int, num_blocks: int, num_layers: int,
                       num_planes: int, tokens_per_block: int, head_dim: int,
                       itemsize: int) -> dict[int, int]:
    """The exact bytes each generation rank (0 .. gen_tp-1) receives moving ``num_blocks`` blocks."""
    return _bytes_by_rank(moves, "dst_rank", gen_tp, _head_bytes(
        num_blocks, num_layers, num_planes, tokens_per_block, head_dim, itemsize))


def bytes_per_src_rank(moves: Iterable[KVMove], *, ctx_tp: int, num_blocks: int, num_layers: int,
                       num_planes: int, tokens_per_block: int, head_dim: int,
                       itemsize: int) -> dict[int, int]:
    """The exact bytes each context rank (0 .. ctx_tp-1) sends moving ``num_blocks`` blocks."""
    return _bytes_by_rank(moves, "src_rank", ctx_tp, _head_bytes(
        num_blocks, num_layers, num_planes, tokens_per_block, head_dim, itemsize))


@dataclass(frozen=True, slots=True)
class TPLayout:
    """One side's tensor-parallel layout, as a pair-open handshake exchanges it. Constructing an
    impossible one raises ``TPLayoutError``."""

    tp_size: int
    rank: int
    num_kv_heads: int
    attention: str

    def __post_init__(self) -> None:
        kv_heads_of_rank(self.tp_size, self.rank, self.num_kv_heads, self.attention)

    @property
    def kv_heads(self) -> range:
        return kv_heads_of_rank(self.tp_size, self.rank, self.num_kv_heads, self.attention)

    def mismatch(self, other: TPLayout) -> str:
        """What stops ``plan_kv_moves`` from mapping between this side and the peer's layout
        ``other``: "" when they are compatible. TP sizes and ranks may differ (that is what the
        map is for; plan from the peer's reported tp_size); the model's KV heads and attention
        kind must not."""
        diffs = [f"{name} {getattr(self, name)} vs {getattr(other, name)}"
                 for name in ("attention", "num_kv_heads") if getattr(self, name) != getattr(other, name)]
        if not diffs:
            return ""
        return (f"{'; '.join(diffs)} (this side tensor parallel size {self.tp_size} rank {self.rank}, "
                f"the peer tensor parallel size {other.tp_size} rank {other.rank})")

"""The flat batch of one forward step and the index tensors its attention needs.

A step's batch is one flat run of T tokens mixing context chunks (several new tokens of one
sequence) and decode tokens (one new token per sequence). Each sequence's keys and values live in
a paged KV pool: token position p of a sequence sits in block ``block_table[p // B]`` at row
``p % B`` (B = tokens per block). ``AttentionMetadata.build`` turns the per-sequence
descriptions into index tensors once per step; every layer reuses them.

Decode sequences are batched: sorted by cache length and cut into a few groups whose padded
length wastes little. One gather per layer reads every group's K/V blocks back to back, then each
group is attended with one SDPA call. Context chunks are attended one sequence at a time (their
queries already fill a matmul).

With the "flex" attention backend (``flex_attention.py``) decode tokens and context chunks with
cached tokens are read from the pool in place instead: they go to ``AttentionMetadata.flex``
(block masks), not to decode groups or gathering chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .flex_attention import build_plan
# A new decode group starts when a sequence has fewer blocks than this fraction of the group's
# longest: bounds the padding waste of one SDPA call against the fixed cost of another call.
_GROUP_FILL_RATIO = 0.7
# A group takes sequences regardless of the fill ratio until it holds this many (per-call cost).
_MIN_GROUP_SEQS = 8
# Cap on one group's gathered K+V bytes per layer (more, smaller groups). With one gather per
# layer for all groups a cap no longer keeps a group's K/V cache-resident; on the 2-core CPU
# (8x512 GQA model, 64 decode sequences) 1 MiB, 8 MiB and no cap measured equal within noise,
# so the default is effectively no cap: fewest SDPA calls, i.e. fewest thread-pool regions.
GROUP_GATHER_BYTES = 1 << 40


@dataclass(frozen=True, slots=True)
class SeqBatchInfo:
    """One sequence's part of a step.

    start: index of its first new token in the flat batch.
    num_new_tokens: new tokens this step (>= 1): a context chunk, or 1 for a decode step.
    past_len: tokens of this sequence already in the KV pool; the new tokens have positions
        past_len .. past_len + num_new_tokens - 1.
    block_table: block ids covering at least past_len + num_new_tokens positions.
    """

    start: int
    num_new_tokens: int
    past_len: int
    block_table: Sequence[int]


@dataclass(slots=True)
class DecodeGroup:
    """Sequences with one new token each, attended together.

    token_index [n]: their rows in the flat batch.
    gather_rows [planes * n * max_blocks]: rows of a layer's pool viewed as
        [planes * num_blocks, B*kv*d]: all K blocks (seq-major, padded with block 0) then the
        same for V (MLA's one-plane pool: the latent blocks only).
    masks[window] [n, 1, 1, n_keys], the model dtype: additive, 0 where the key is attended and
        -inf elsewhere (every row attends at least its own token, so softmax stays finite).
    row_offset: where its rows start in AttentionMetadata.decode_gather_rows.
    """

    token_index: torch.Tensor
    gather_rows: torch.Tensor
    num_seqs: int
    max_blocks: int
    masks: dict[int | None, torch.Tensor]
    row_offset: int = 0


@dataclass(slots=True)
class ContextChunk:
    """num_new >= 2 new tokens of one sequence (a single new token always goes to a DecodeGroup).

    gather_rows: None when past_len == 0 (its keys are exactly the chunk's fresh K/V); otherwise
        [2 * num_blocks] rows like DecodeGroup's, covering the past_len + num_new keys.
    masks[window]: [num_new, n_keys] additive like DecodeGroup's (key position <= query position,
        inside the window), or None for plain causal attention over the chunk itself.
    """

    start: int
    num_new: int
    past_len: int
    gather_rows: torch.Tensor | None
    num_blocks: int
    masks: dict[int | None, torch.Tensor | None]


@dataclass(slots=True)
class PagedDecode:
    """Decode tokens for the "paged" backend: rows ``token_index`` [n] of the flat batch,
    ``tables`` [n, max_blocks] int64 block tables (padded with 0), ``lens`` [n] = past_len + 1
    keys each (the kernel applies each layer's window itself)."""

    token_index: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    tokens_per_block: int
    positions: torch.Tensor  # [T] long
    slots: torch.Tensor  # [T] long: block_id * B + offset, where each new token's K/V is written
    last_token_index: torch.Tensor  # [num_seqs] long: flat row of each sequence's last new token
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    context_chunks: list[ContextChunk] = field(default_factory=list)
    max_gather_rows: int = 0  # largest gather, to size the workspace once per step
    # Every decode group's gather_rows back to back: one gather per layer serves all groups
    # (one parallel region instead of one per group). None without decode tokens.
    decode_gather_rows: torch.Tensor | None = None
    # The flex backend's calls (flex_attention.FlexPlan): decode tokens and the context chunks
    # with cached tokens; None with the SDPA backend.
    flex: Any = None
    # The "paged" backend's decode tokens (cpu_kernels or gpu_kernels .paged_decode_attention read the pool in
    # place); None otherwise or without decode tokens.
    paged_decode: PagedDecode | None = None

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqBatchInfo],
        num_tokens: int,
        tokens_per_block: int,
        num_blocks: int,
        windows: Sequence[int | None],
        device: torch.device | str = "cpu",
        *,
        block_bytes: int = 0,
        group_bytes: int = GROUP_GATHER_BYTES,
        dtype: torch.dtype = torch.float32,
        num_planes: int = 2,
        backend: str = "sdpa",
    ) -> AttentionMetadata:
        """block_bytes: one block's K+V bytes in one layer; with group_bytes it caps the size of
        a decode group's gather (block_bytes 0: no cap). dtype: the model's, for the masks.
        num_planes: the pool's planes per layer (2: K and V; 1: MLA's latent); gathers read
        every plane's blocks, plane after plane. backend "flex": decode tokens and chunks with
        cached tokens get block masks in ``flex`` (a two-plane pool) instead of gathers."""
        flex = backend == "flex"
        if backend not in ("sdpa", "flex", "paged"):
            raise ValueError(f"unknown attention backend {backend!r}")
        if backend != "sdpa" and num_planes != 2:
            raise ValueError(f"the {backend} backend reads a two-plane (K, V) pool")
        B = tokens_per_block
        windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
        slots = [0] * num_tokens
        positions = [0] * num_tokens
        covered = [False] * num_tokens
        last: list[int] = []
        decode: list[SeqBatchInfo] = []
        flex_chunks: list[SeqBatchInfo] = []
        chunks: list[ContextChunk] = []
        max_rows = 0
        for s in seqs:
            n, past, bt = s.num_new_tokens, s.past_len, s.block_table
            total = past + n
            if n < 1 or past < 0 or s.start < 0 or s.start + n > num_tokens:
                raise ValueError(f"bad sequence slice {s!r} for a batch of {num_tokens} tokens")
            if len(bt) * B < total:
                raise ValueError(
                    f"block table of {len(bt)} blocks cannot hold {total} tokens (B={B})"
                )
            for i in range(n):
                row, pos = s.start + i, past + i
                if covered[row]:
                    raise ValueError(f"flat batch row {row} belongs to two sequences")
                covered[row] = True
                positions[row] = pos
                slots[row] = bt[pos // B] * B + pos % B
            last.append(s.start + n - 1)
            if n == 1:
                decode.append(s)
                continue
            if flex and past > 0:
                flex_chunks.append(s)
                continue
            nb = -(-total // B)
            rows = None
            if past > 0:
                ids = list(bt[:nb])
                rows = _plane_rows(ids, num_blocks, num_planes)
                max_rows = max(max_rows, num_planes * nb)
            q_pos = torch.arange(past, total)[:, None]  # [n, 1]
            k_pos = torch.arange(nb * B if past > 0 else n)[None, :]  # [1, n_keys]
            masks: dict[int | None, torch.Tensor | None] = {}
            for w in windows:
                if past == 0 and (w is None or w >= n):
                    masks[w] = None  # plain causal over the chunk itself
                else:
                    m = k_pos <= q_pos
                    if w is not None:
                        m &= k_pos > q_pos - w
                    masks[w] = _additive(m, dtype, device)
            chunks.append(ContextChunk(s.start, n, past, _to(rows, device), nb, masks))
        if not all(covered):
            raise ValueError("flat batch has rows that belong to no sequence")

        plan = paged = None
        if flex:
            plan = build_plan(decode, flex_chunks, B, num_blocks, windows, device)
            decode = []
        elif backend == "paged" and decode:
            paged = _paged_decode(decode, B, device)
            decode = []
        groups = [
            _decode_group(g, B, num_blocks, windows, dtype, device, num_planes)
            for g in _split_decode(decode, B, block_bytes, group_bytes)
        ]
        offset = 0
        for g in groups:
            g.row_offset = offset
            offset += g.gather_rows.numel()
        max_rows = max(max_rows, offset)
        return cls(
            num_tokens=num_tokens,
            tokens_per_block=B,
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            last_token_index=torch.tensor(last, dtype=torch.long, device=device),
            decode_groups=groups,
            context_chunks=chunks,
            max_gather_rows=max_rows,
            decode_gather_rows=torch.cat([g.gather_rows for g in groups]) if groups else None,
            flex=plan,
            paged_decode=paged,
        )


def _paged_decode(decode: list[SeqBatchInfo], B: int, device: torch.device | str) -> PagedDecode:
    nbs = [s.past_len // B + 1 for s in decode]
    width = max(nbs)
    tables = [list(s.block_table[:nb]) + [0] * (width - nb) for s, nb in zip(decode, nbs)]
    return PagedDecode(
        token_index=torch.tensor([s.start for s in decode], dtype=torch.long, device=device),
        tables=torch.tensor(tables, dtype=torch.long, device=device),
        lens=torch.tensor([s.past_len + 1 for s in decode], dtype=torch.long, device=device),
    )


def _plane_rows(ids: list[int], num_blocks: int, num_planes: int) -> torch.Tensor:
    """Rows of a layer's pool viewed as [planes * num_blocks, B * heads * d]: the blocks of
    plane 0 (K), then the same blocks of plane 1 (V) when there are two."""
    return torch.tensor([i + p * num_blocks for p in range(num_planes) for i in ids], dtype=torch.long)


def _to(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """bool mask -> additive float mask (0 kept, -inf masked). SDPA adds a float mask to the
    scores directly; a bool one is converted on every call, i.e. once per layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)


def _split_decode(
    decode: list[SeqBatchInfo], B: int, block_bytes: int, group_bytes: int
) -> list[list[SeqBatchInfo]]:
    """Longest first; cut where a sequence would pad to under _GROUP_FILL_RATIO of the group's
    longest (unless the group so far is too small to be worth its own call), and where the
    group's padded gather would pass group_bytes."""
    order = sorted(decode, key=lambda s: s.past_len, reverse=True)
    groups: list[list[SeqBatchInfo]] = []
    head_blocks, cap = 0, 0
    for s in order:
        nb = s.past_len // B + 1  # blocks covering past_len + 1 tokens
        if groups and len(groups[-1]) < cap and (
            nb >= _GROUP_FILL_RATIO * head_blocks or len(groups[-1]) < _MIN_GROUP_SEQS
        ):
            groups[-1].append(s)
        else:
            groups.append([s])
            head_blocks = nb
            cap = max(1, group_bytes // (nb * block_bytes)) if block_bytes > 0 else len(order)
    return groups


def _decode_group(
    seqs: list[SeqBatchInfo],
    B: int,
    num_blocks: int,
    windows: Sequence[int | None],
    dtype: torch.dtype,
    device: torch.device | str,
    num_planes: int = 2,
) -> DecodeGroup:
    max_blocks = max(s.past_len // B + 1 for s in seqs)
    ids: list[int] = []
    for s in seqs:
        nb = s.past_len // B + 1
        ids.extend(s.block_table[:nb])
        ids.extend([0] * (max_blocks - nb))
    rows = _plane_rows(ids, num_blocks, num_planes)
    lens = torch.tensor([s.past_len + 1 for s in seqs], dtype=torch.long)[:, None]  # [n, 1]
    k_pos = torch.arange(max_blocks * B)[None, :]  # [1, n_keys]
    masks: dict[int | None, torch.Tensor] = {}
    for w in windows:
        m = k_pos < lens
        if w is not None:
            m &= k_pos > lens - 1 - w
        masks[w] = _additive(m.view(len(seqs), 1, 1, -1), dtype, device)
    return DecodeGroup(
        token_index=torch.tensor([s.start for s in seqs], dtype=torch.long, device=device),
        gather_rows=rows.to(device),
        num_seqs=len(seqs),
        max_blocks=max_blocks,
        masks=masks,
    )


def static_decode_metadata(
    positions: torch.Tensor,  # [N] long, on the device: each sequence's query position (past_len)
    slots: torch.Tensor,  # [N] long: where each new token's K/V is written
    tables: torch.Tensor,  # [N, W] long: block tables padded (with any valid block id) to W blocks
    tokens_per_block: int,
    num_blocks: int,
    windows: Sequence[int | None],
    dtype: torch.dtype,
    num_planes: int = 2,
    *,
    paged: bool = False,
) -> AttentionMetadata:
    """A decode-only step's metadata computed on the device from fixed-shape tensors, with no
    host work and no shape that depends on the values: the form a CUDA graph can capture and
    replay (cuda_graphs.py). Every sequence is row i of the flat batch and one decode group pads
    all of them to W blocks; the masks hide the padding, so each row attends exactly the keys
    ``AttentionMetadata.build`` gives it (the same math, over more masked keys). ``paged``: the
    "paged" backend's form instead, the padded tables and the lengths (its kernel reads only
    each row's own keys)."""
    N, W = tables.shape
    B = tokens_per_block
    device = tables.device
    index = torch.arange(N, device=device)
    if paged:
        return AttentionMetadata(
            num_tokens=N, tokens_per_block=B, positions=positions, slots=slots, last_token_index=index,
            paged_decode=PagedDecode(token_index=index, tables=tables.contiguous(), lens=positions + 1),
        )
    flat = tables.reshape(-1)
    rows = torch.cat([flat + p * num_blocks for p in range(num_planes)]) if num_planes > 1 else flat
    lens = (positions + 1)[:, None]  # [N, 1]: keys 0 .. past_len
    k_pos = torch.arange(W * B, device=device)[None, :]
    masks: dict[int | None, torch.Tensor] = {}
    for w in sorted(set(windows), key=lambda w: -1 if w is None else w):
        allowed = k_pos < lens
        if w is not None:
            allowed = allowed & (k_pos > lens - 1 - w)
        masks[w] = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
            ~allowed, float("-inf")).view(N, 1, 1, W * B)
    group = DecodeGroup(token_index=index, gather_rows=rows, num_seqs=N, max_blocks=W, masks=masks)
    return AttentionMetadata(
        num_tokens=N, tokens_per_block=B, positions=positions, slots=slots, last_token_index=index,
        decode_groups=[group], context_chunks=[], max_gather_rows=rows.numel(), decode_gather_rows=rows,
    )

"""Paged attention through torch's FlexAttention: queries read the KV pool in place through the
block table, with no gather into a copy.

One layer's pool plane [num_blocks, B, kv_heads, d] is viewed as one long key sequence
[1, kv_heads, num_blocks * B, d]: key slot s is row s % B of block s // B. A ``BlockMask`` built
from the step's block tables lists, per sequence (decode) or per 128-query tile (context chunk),
the pool blocks its queries read, so the kernel touches only those blocks:

- "full" blocks, where every slot is attended by every query of the row (no mask evaluated);
- "partial" blocks (a sequence's last block, the block where a sliding window starts, a chunk's
  causal diagonal), where ``mask_mod`` decides per slot.

``mask_mod`` is exact on its own for any slot of the pool (flex's eager reference evaluates it
everywhere): slot s of block p is attended by query i of sequence b iff p is b's block at
logical index j = ``block_logical[p]`` (checked against b's own table, so a block that sits in
another sequence's table does not count) and its position j * B + s % B lies in
(qpos - window, qpos], qpos = i's position. ``block_logical`` is one [num_blocks] table per
step; it is well defined because a block read unmasked holds the K/V of exactly one position
range in every table it appears in (prefix reuse and forks share blocks at the same index; the
sliding-window scratch block is only ever read masked).

Decode tokens of the step are one call: query batch n (one query row each) against the pool,
batch-broadcast; each context chunk that has cached tokens (past_len > 0) is one call. Chunks
without cached tokens attend their own fresh K/V with SDPA as before (nothing to gather).

The kernel: ``torch.compile(flex_attention, dynamic=True)``, one compilation for all batch
shapes (Triton on CUDA; on CPU inductor's C++ template, which needs a C++ compiler). Choosing
the backend: ``default_backend`` ("paged" on CPU, "sdpa" on CUDA, see there; the environment
variable ``PDSERVE_ATTENTION_BACKEND`` = sdpa | flex | paged overrides it).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

# "sdpa": gather + SDPA; "flex": FlexAttention over the pool; "paged": decode tokens through
# pdserve's own kernel over the pool (cpu_kernels.py on CPU, gpu_kernels.py on CUDA), chunks as
# "sdpa".
BACKENDS = ("sdpa", "flex", "paged")
ENV_BACKEND = "PDSERVE_ATTENTION_BACKEND"
# Query rows per BlockMask row for context chunks (flex's default sparse block size; the CUDA
# kernels need a multiple of their BLOCK_M).
Q_TILE = 128


class FlexUnavailable(RuntimeError):
    """FlexAttention could not run here (import, compilation or kernel failure)."""


def _flex_module():
    try:
        from torch.nn.attention import flex_attention as fa
    except Exception:  # noqa: BLE001 - any import failure means no flex
        return None
    if not hasattr(fa, "BlockMask") or not hasattr(fa, "flex_attention"):
        return None
    return fa


def flex_supported(device: torch.device | str) -> bool:
    """Whether the flex backend can run on ``device``: FlexAttention imports, and on CPU the
    inductor C++ template's requirement (AVX2) holds. Compiling still needs a C++ compiler on
    CPU and Triton on CUDA; a failure there is caught at the first step (see DecoderLM)."""
    if _flex_module() is None:
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available()
    if dev.type == "cpu":
        try:
            from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
        except Exception:  # noqa: BLE001
            return False
        return bool(check_cpu_supported())
    return False


def paged_supported(device: torch.device | str, head_dim: int | None = None) -> bool:
    """Whether the "paged" backend's decode kernel runs here: on CPU pdserve's C++ kernel built
    and taking this head size (cpu_kernels.py), on CUDA its Triton kernel (gpu_kernels.py)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        from . import cpu_kernels

        return (head_dim is None or cpu_kernels.supports_head_dim(head_dim)) and cpu_kernels.available()
    if dev.type == "cuda":
        from . import gpu_kernels

        return gpu_kernels.available()
    return False


def default_backend(device: torch.device | str, head_dim: int | None = None) -> str:
    """"paged" on CPU where pdserve's C++ kernel builds and takes this head size (decode steps
    1.04-1.40x faster than gather + SDPA on the 2-core VM, docs/benchmarks.md section 23), else
    "sdpa"; the environment variable PDSERVE_ATTENTION_BACKEND overrides it. On CUDA "paged"
    (the Triton kernel) is opt-in: on an H200 its captured decode steps were 0.96-1.94x those
    of gather + SDPA, but whole engine runs with it measured 0.30-0.35x, unexplained so far
    (docs/benchmarks.md section 22). Never "flex" by
    default: on the CPU it measured no faster than gather + SDPA, and on an H200 with torch 2.11
    the recompilation with symbolic shapes that dynamo makes once a second batch shape arrives
    found no kernel config (NoValidChoicesError; static shapes compiled), so a worker paid a
    failed compilation before falling back (docs/benchmarks.md section 22)."""
    env = os.environ.get(ENV_BACKEND, "").strip().lower()
    if env:
        if env not in BACKENDS:
            raise ValueError(f"{ENV_BACKEND} must be one of {BACKENDS}, got {env!r}")
        return env
    if torch.device(device).type == "cpu" and paged_supported(device, head_dim):
        return "paged"
    return "sdpa"


# ---------------------------------------------------------------------------------- the kernel

_compiled: dict[str, Callable[..., torch.Tensor]] = {}
# False: flex's eager reference (materialises every score; for tests on tiny pools only).
COMPILE = True


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The compiled flex_attention (one per device type), created on first use."""
    if not COMPILE:
        fa = _flex_module()
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # no "use torch.compile" warning
        return fa.flex_attention
    fn = _compiled.get(device.type)
    if fn is None:
        fa = _flex_module()
        if fa is None:
            raise FlexUnavailable("torch.nn.attention.flex_attention does not import")
        import torch._dynamo.config as dynamo_config

        # Shapes 0/1 specialise and every window is its own mask graph: leave room for them.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        fn = torch.compile(fa.flex_attention)
        _compiled[device.type] = fn
    return fn


def _kernel_options(device: torch.device, B: int) -> dict[str, Any] | None:
    # The CUDA kernels iterate BLOCK_N keys at a time inside one sparse block: the pool's B
    # tokens per block bound it (their default, 64, must divide the sparse block size).
    if device.type == "cuda" and B < 64:
        return {"BLOCK_N": B}
    return None


def cuda_block_ok(B: int) -> bool:
    """Tokens per block the CUDA kernels accept: a multiple of 16 (tl.dot's minimum tile)."""
    return B % 16 == 0


# ---------------------------------------------------------------------------------- metadata


@dataclass(slots=True)
class FlexCall:
    """One flex_attention call: the queries it answers and one BlockMask per window.

    decode: rows ``token_index`` of the flat batch, as a batch of n single-query rows;
    chunk: rows start .. start + num_new - 1 as one batch row (token_index None)."""

    masks: dict[int | None, Any]
    token_index: torch.Tensor | None = None
    start: int = 0
    num_new: int = 0


@dataclass(slots=True)
class FlexPlan:
    """The step's flex calls: at most one decode call plus one per context chunk with cached
    tokens (``chunks``, keyed by the chunk's first row; those chunks are not in
    AttentionMetadata.context_chunks)."""

    decode: FlexCall | None = None
    chunks: dict[int, FlexCall] = field(default_factory=dict)


def _mask_mod(block_logical: torch.Tensor, tables: torch.Tensor, last_index: torch.Tensor,
              qpos0: torch.Tensor, B: int, window: int | None):
    """Slot kv of the pool is attended by query q of batch row b: see the module docstring.
    tables [rows, max_blocks] int32 (row b's block table, padded), last_index [rows] = its
    number of blocks - 1, qpos0 [rows] = position of the row's query 0."""

    def mask_mod(b, h, q_idx, kv_idx):
        blk = torch.clamp(kv_idx // B, min=0)  # (kv_idx >= 0 anyway)
        j = block_logical[blk]
        jc = torch.minimum(torch.clamp(j, min=0), last_index[b])
        pos = j * B + kv_idx % B
        qpos = qpos0[b] + q_idx
        ok = (j >= 0) & (tables[b, jc] == blk) & (pos <= qpos)
        if window is not None:
            ok = ok & (pos > qpos - window)
        return ok

    return mask_mod


def _pad_tables(tables: Sequence[Sequence[int]], nblocks: Sequence[int]) -> torch.Tensor:
    width = max(nblocks)
    rows = [list(t[:nb]) + [0] * (width - nb) for t, nb in zip(tables, nblocks)]
    return torch.tensor(rows, dtype=torch.int32)


def build_plan(
    decode: Sequence[Any],  # SeqBatchInfo with num_new_tokens == 1
    chunks: Sequence[Any],  # SeqBatchInfo with num_new_tokens >= 2 and past_len > 0
    B: int,
    num_blocks: int,
    windows: Sequence[int | None],
    device: torch.device | str,
) -> FlexPlan:
    """Block masks for the step's decode tokens and for its context chunks with cached tokens."""
    fa = _flex_module()
    if fa is None:
        raise FlexUnavailable("torch.nn.attention.flex_attention does not import")
    device = torch.device(device)
    used = [*decode, *chunks]
    plan = FlexPlan()
    if not used:
        return plan
    # The CPU kernel wants the index lists as wide as the pool (it checks that the listed
    # blocks could cover the whole key length); CUDA reads only the first num_blocks entries.
    wide = device.type == "cpu"
    nbs = [-(-(s.past_len + s.num_new_tokens) // B) for s in used]
    tables = _pad_tables([s.block_table for s in used], nbs).long()  # [seqs, maxb]
    maxb = tables.shape[1]
    width = num_blocks if wide else max(maxb, 1)
    nb_t = torch.tensor(nbs, dtype=torch.long)
    cols = torch.arange(maxb).expand(len(used), maxb)
    valid = cols < nb_t[:, None]
    logical = torch.full((num_blocks,), -1, dtype=torch.int32)
    logical[tables[valid]] = cols[valid].to(torch.int32)
    logical = logical.to(device)
    # The pool's size never changes: keep it a constant in the compiled kernel even when other
    # shapes turn dynamic (inductor's CPU template miscompiles gathers from tensors of symbolic
    # size: the generated C++ names an undeclared symbol).
    torch._dynamo.mark_static(logical)
    dev_tables = tables.to(torch.int32).to(device)
    last_index = (nb_t - 1).to(torch.int32).to(device)

    if decode:
        n = len(decode)
        pos = torch.tensor([s.past_len for s in decode], dtype=torch.long)  # the query's position
        qpos0 = pos.to(torch.int32).to(device)
        masks = {}
        for w in windows:
            lists = _block_lists(tables[:n], pos, pos, B, w, width)
            mm = _mask_mod(logical, dev_tables[:n], last_index[:n], qpos0, B, w)
            masks[w] = _block_mask(fa, lists, (n, 1), (1, num_blocks * B), B, mm, device)
        token_index = torch.tensor([s.start for s in decode], dtype=torch.long, device=device)
        plan.decode = FlexCall(masks, token_index=token_index)

    for k, s in enumerate(chunks):
        row = len(decode) + k
        tiles = -(-s.num_new_tokens // Q_TILE)
        q0 = s.past_len + torch.arange(tiles) * Q_TILE
        q1 = torch.clamp(q0 + Q_TILE - 1, max=s.past_len + s.num_new_tokens - 1)
        rows_tables = tables[row:row + 1].expand(tiles, maxb)
        qpos0 = torch.tensor([s.past_len], dtype=torch.int32, device=device)
        masks = {}
        for w in windows:
            lists = _block_lists(rows_tables, q0, q1, B, w, width)
            mm = _mask_mod(logical, dev_tables[row:row + 1], last_index[row:row + 1], qpos0, B, w)
            masks[w] = _block_mask(fa, lists, (1, tiles), (s.num_new_tokens, num_blocks * B), B, mm, device)
        plan.chunks[s.start] = FlexCall(masks, start=s.start, num_new=s.num_new_tokens)
    return plan


def _block_lists(tables: torch.Tensor, q0: torch.Tensor, q1: torch.Tensor, B: int,
                 window: int | None, width: int) -> tuple[torch.Tensor, ...]:
    """Per BlockMask row (queries at positions q0 .. q1 of the sequence whose table is the
    row of ``tables`` [rows, maxb]): the pool blocks it reads, split into partial and full,
    each list ascending, padded with zeros to ``width``. A block is full when every query of
    the row attends every key of it: key block [k0, k0 + B - 1] with k0 + B - 1 <= q0 and
    k0 > q1 - window."""
    rows, maxb = tables.shape
    cols = torch.arange(maxb)[None, :]
    if window is None:
        lo = torch.zeros_like(q0)
        full_lo = torch.zeros_like(q0)
    else:
        lo = torch.clamp(q0 - window + 1, min=0)  # lowest key any query of the row reads
        full_lo = (torch.clamp(q1 - window + 1, min=0) + B - 1) // B  # first block all attend
    read = (cols >= (lo // B)[:, None]) & (cols <= (q1 // B)[:, None])
    full = read & (cols >= full_lo[:, None]) & (cols < ((q0 + 1) // B)[:, None])
    part = read & ~full
    out = []
    for sel in (part, full):
        order = torch.where(sel, cols, cols + maxb).argsort(dim=1)  # selected columns first
        idx = torch.zeros((rows, width), dtype=torch.int32)
        idx[:, :maxb] = torch.gather(tables, 1, order).to(torch.int32)
        out += [sel.sum(1).to(torch.int32), idx]
    return tuple(out)


def _block_mask(fa, lists, batch_rows: tuple[int, int], seq_lengths: tuple[int, int], B: int,
                mask_mod, device: torch.device) -> Any:
    num_part, part_idx, num_full, full_idx = lists
    batch, rows = batch_rows
    width = part_idx.shape[1]
    return fa.BlockMask.from_kv_blocks(
        num_part.view(batch, 1, rows).to(device), part_idx.view(batch, 1, rows, width).to(device),
        num_full.view(batch, 1, rows).to(device), full_idx.view(batch, 1, rows, width).to(device),
        BLOCK_SIZE=(Q_TILE, B), mask_mod=mask_mod, seq_lengths=seq_lengths, compute_q_blocks=False,
    )


# ---------------------------------------------------------------------------------- attention


def pool_keys_values(layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, num_blocks, B, kv_heads, d] -> K, V as [1, kv_heads, num_blocks * B, d] views (no copy)."""
    _, nblk, B, kvh, d = layer_kv.shape
    flat = layer_kv.view(2, nblk * B, kvh, d).permute(0, 2, 1, 3)  # [2, kvh, slots, d]
    keys, values = flat[0].unsqueeze(0), flat[1].unsqueeze(0)
    torch._dynamo.mark_static(keys)
    torch._dynamo.mark_static(values)
    return keys, values


def attend(
    call: FlexCall,
    window: int | None,
    q: torch.Tensor,  # [T, h, d] every query of the step
    keys: torch.Tensor,
    values: torch.Tensor,  # [1, kv_heads, slots, d]
    scale: float | None,
    out: torch.Tensor,  # [T, h, d]: receives this call's rows
    B: int,
) -> None:
    h, kvh = q.shape[1], keys.shape[1]
    fn = _kernel(q.device)
    opts = _kernel_options(q.device, B)
    mask = call.masks[window]
    try:
        if call.token_index is not None:  # decode: [n, h, 1, d]
            qd = q.index_select(0, call.token_index).unsqueeze(2)
            o = fn(qd, keys, values, block_mask=mask, scale=scale, enable_gqa=h != kvh,
                   kernel_options=opts)
            out.index_copy_(0, call.token_index, o.squeeze(2))
        else:
            rows = slice(call.start, call.start + call.num_new)
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, m, d]
            o = fn(qc, keys, values, block_mask=mask, scale=scale, enable_gqa=h != kvh,
                   kernel_options=opts)
            out[rows] = o[0].transpose(0, 1)
    except (FlexUnavailable, torch.OutOfMemoryError):
        raise
    except Exception as e:  # compilation or kernel failure: the caller falls back to SDPA
        raise FlexUnavailable(f"flex_attention failed: {type(e).__name__}: {e}") from e

"""The flex attention backend (workers/model/flex_attention.py): FlexAttention reading the paged
KV pool in place through the block table.

- The block masks themselves: ``mask_mod`` is exact for every slot of the pool, and the block
  lists (the part the compiled kernels rely on: they visit only listed blocks and skip the mask
  on "full" ones) cover every attended slot, with full blocks wholly attended.
- Whole-model steps (context chunks over cached tokens, with more than one 128-query tile,
  decode batches of mixed lengths, sliding windows, GQA, qk-norm) give the gather + SDPA
  backend's logits within 1e-5 in fp32, through flex's eager reference: compiling FlexAttention
  on CPU takes minutes per shape family on a 2-core machine, so the compiled kernel runs only
  when PDSERVE_TEST_FLEX_COMPILE=1 (and in benchmarks/gpu_check.py on CUDA).
- Backend choice and the fallback to SDPA when the kernel cannot run.
"""
from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_models import windowed_qwen3  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.workers.model import SeqBatchInfo  # noqa: E402
from pdserve.workers.model import flex_attention as FA  # noqa: E402

pytestmark = pytest.mark.skipif(FA._flex_module() is None, reason="torch has no FlexAttention")

B = 4


def _truth(seq: SeqBatchInfo, num_blocks: int, window: int | None) -> torch.Tensor:
    """[num_new, num_blocks * B] bool: query i of the sequence attends pool slot s."""
    allowed = torch.zeros((seq.num_new_tokens, num_blocks * B), dtype=torch.bool)
    for i in range(seq.num_new_tokens):
        q = seq.past_len + i
        lo = 0 if window is None else max(0, q - window + 1)
        for p in range(lo, q + 1):
            allowed[i, seq.block_table[p // B] * B + p % B] = True
    return allowed


def _dense(mask, batch: int, num_q: int, num_slots: int) -> torch.Tensor:
    q = torch.arange(num_q)[:, None]
    kv = torch.arange(num_slots)[None, :]
    return mask.mask_mod(torch.tensor(batch), torch.tensor(0), q, kv)


def _listed(mask, batch: int, row: int) -> tuple[list[int], list[int]]:
    n_part = int(mask.kv_num_blocks[batch, 0, row])
    n_full = int(mask.full_kv_num_blocks[batch, 0, row])
    return (mask.kv_indices[batch, 0, row, :n_part].tolist(),
            mask.full_kv_indices[batch, 0, row, :n_full].tolist())


def _check_rows(mask, batch: int, truth: torch.Tensor, num_blocks: int) -> None:
    """truth [num_q, slots]: the block lists of each 128-query row cover it exactly."""
    dense = _dense(mask, batch, truth.shape[0], num_blocks * B)
    assert torch.equal(dense, truth)  # mask_mod alone is exact, anywhere in the pool
    for row in range(-(-truth.shape[0] // FA.Q_TILE)):
        rows = truth[row * FA.Q_TILE:(row + 1) * FA.Q_TILE].view(-1, num_blocks, B)  # [q, blk, B]
        part, full = _listed(mask, batch, row)
        assert len(set(part)) == len(part) and len(set(full)) == len(full) and not set(part) & set(full)
        read = set(torch.nonzero(rows.any(dim=(0, 2))).flatten().tolist())
        assert read <= set(part) | set(full)  # every attended slot lies in a listed block
        for blk in full:
            assert bool(rows[:, blk].all())  # full blocks: no mask needed


@pytest.mark.parametrize("window", [None, 1, 3, 4, 9, 17])
def test_block_masks_are_exact(window) -> None:
    rng = random.Random(window or 0)
    num_blocks = 90
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(3)]  # a reused prefix (3 blocks) in two tables
    decode, chunks, start = [], [], 0
    for past in (0, 3, 4, 11, 12, 13, 30):
        nb = past // B + 1
        table = tuple(shared + [free.pop() for _ in range(nb - 3)]) if past >= 12 else tuple(
            free.pop() for _ in range(nb))
        decode.append(SeqBatchInfo(start, 1, past, table))
        start += 1
    for past, n in ((5, 7), (8, 140), (1, 3)):
        table = tuple(free.pop() for _ in range(-(-(past + n) // B)))
        chunks.append(SeqBatchInfo(start, n, past, table))
        start += n
    plan = FA.build_plan(decode, chunks, B, num_blocks, [window], "cpu")
    dmask = plan.decode.masks[window]
    for b, s in enumerate(decode):
        _check_rows(dmask, b, _truth(s, num_blocks, window), num_blocks)
    for s in chunks:
        _check_rows(plan.chunks[s.start].masks[window], 0, _truth(s, num_blocks, window), num_blocks)


def test_window_scratch_block_repeated_in_tables() -> None:
    """Sliding-window virtual tables repeat one scratch block below the window (core
    ._block_table): its slots are never attended, and the live blocks still are."""
    window, num_blocks, scratch = 6, 40, 39
    decode = [SeqBatchInfo(0, 1, 21, (scratch,) * 4 + (7, 3)),  # positions 16..21 live in 7 and 3
              SeqBatchInfo(1, 1, 9, (scratch, 11, 12))]
    plan = FA.build_plan(decode, [], B, num_blocks, [window], "cpu")
    for b, s in enumerate(decode):
        truth = torch.zeros((1, num_blocks * B), dtype=torch.bool)
        for p in range(s.past_len - window + 1, s.past_len + 1):
            truth[0, s.block_table[p // B] * B + p % B] = True
        _check_rows(plan.decode.masks[window], b, truth, num_blocks)


# ------------------------------------------------------------------------------ whole model

_model = windowed_qwen3


class _Steps:
    """Runs the same flat batches through both backends, each on its own pool."""

    def __init__(self, cfg, model, num_blocks: int = 128) -> None:
        self.model, self.num_blocks = model, num_blocks
        self.pools = {b: KVPool.for_model(cfg, num_blocks, B) for b in ("sdpa", "flex")}
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.rng = random.Random(1)

    def step(self, parts: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        ids, seqs = [], []
        for name, n in parts:
            past = self.lens.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * B < past + n:
                table.append(self.free.pop())
            seqs.append(SeqBatchInfo(len(ids), n, past, tuple(table)))
            ids.extend(self.rng.randrange(300) for _ in range(n))
        out = {}
        for backend in ("sdpa", "flex"):
            self.model.attention_backend = backend
            out[backend] = self.model(torch.tensor(ids), None, seqs, self.pools[backend], all_logits=True)
            assert self.model.attention_backend == backend  # no fallback happened
        for name, n in parts:
            self.lens[name] = self.lens.get(name, 0) + n
        return out


def _run_schedule(compiled: bool, monkeypatch) -> None:
    monkeypatch.setattr(FA, "COMPILE", compiled)
    cfg, model = _model()
    steps = _Steps(cfg, model)
    schedule = [
        [("a", 9), ("b", 3)],  # prefills: SDPA over fresh K/V in both backends
        [("a", 1), ("b", 6), ("c", 13)],  # decode + a chunk over cached tokens
        [("c", 7), ("a", 1), ("b", 1), ("d", 2)],
        [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 5)],
        [("e", 150), ("a", 1), ("b", 1)],  # a chunk of two 128-query tiles
        [("e", 1), ("a", 1), ("b", 1), ("c", 1), ("d", 1)],  # decode lengths 2 .. 156
    ]
    for parts in schedule:
        out = steps.step(parts)
        diff = (out["sdpa"] - out["flex"]).abs().max().item()
        assert diff <= 1e-5, (parts, diff)


def test_flex_matches_sdpa_eager(monkeypatch) -> None:
    _run_schedule(False, monkeypatch)


@pytest.mark.skipif(os.environ.get("PDSERVE_TEST_FLEX_COMPILE") != "1",
                    reason="compiling FlexAttention on CPU takes minutes: set PDSERVE_TEST_FLEX_COMPILE=1")
@pytest.mark.skipif(not FA.flex_supported("cpu"), reason="inductor's CPU flex template needs AVX2")
def test_flex_matches_sdpa_compiled(monkeypatch) -> None:
    _run_schedule(True, monkeypatch)


def test_falls_back_to_sdpa_when_the_kernel_fails(monkeypatch) -> None:
    cfg, model = _model()
    steps = _Steps(cfg, model)
    steps.step([("a", 9), ("b", 3)])

    def broken(device):
        def fn(*args, **kwargs):
            raise RuntimeError("no compiler")
        return fn

    monkeypatch.setattr(FA, "_kernel", broken)
    ids = torch.tensor([5, 6])
    seqs = [SeqBatchInfo(0, 1, 9, tuple(steps.tables["a"])), SeqBatchInfo(1, 1, 3, tuple(steps.tables["b"]))]
    model.attention_backend = "sdpa"
    want = model(ids, None, seqs, steps.pools["sdpa"])
    model.attention_backend = "flex"
    got = model(ids, None, seqs, steps.pools["flex"])
    assert model.attention_backend == "sdpa"
    assert torch.equal(got, want)


def test_backend_choice(monkeypatch) -> None:
    from pdserve.workers.model import cpu_kernels

    monkeypatch.delenv(FA.ENV_BACKEND, raising=False)
    cpu_default = "paged" if cpu_kernels.available() else "sdpa"  # the C++ kernel where it builds
    assert FA.default_backend("cpu") == cpu_default
    assert FA.default_backend("cpu", head_dim=24) == "sdpa"  # a head size the kernel does not take
    monkeypatch.setenv(FA.ENV_BACKEND, "flex")
    assert FA.default_backend("cpu") == "flex"
    monkeypatch.setenv(FA.ENV_BACKEND, "nope")
    with pytest.raises(ValueError):
        FA.default_backend("cpu")
    monkeypatch.delenv(FA.ENV_BACKEND)
    _, model = _model()
    assert model.flex_capable and model.attention_backend == cpu_default
    with pytest.raises(ValueError):
        model.set_attention_backend("flash")

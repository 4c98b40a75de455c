"""pdserve's Triton decode-attention kernel (workers/model/gpu_kernels.py), the "paged" backend
on CUDA.

- The kernel against attention written out in torch (test_cpu_kernels's reference, fp64), over
  a pool with shuffled and shared blocks: GQA groups of 1, 2, 4 and 8, sliding windows, block
  sizes that are and are not powers of two or multiples of the key tile, head sizes that are
  not powers of two, query and output rows scattered in a wider flat batch. On CUDA in fp32
  (IEEE products), fp16 and bf16; without a GPU the same kernel runs in Triton's interpreter
  (TRITON_INTERPRET=1) on CPU tensors, in fp32 and fp16 (the interpreter's bf16 dot products
  are wrong: Triton 3.9 hands numpy bf16 bits as integers).
- On CUDA: whole-model steps through the "paged" backend give gather + SDPA's logits, and the
  captured decode graphs with the kernel give the eager steps' logits.

Triton is not a pdserve dependency (torch's CUDA builds bring it); without it these tests skip.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_models import StepDriver, decode_case, paged_matches_sdpa, windowed_qwen3  # noqa: E402
from test_cpu_kernels import _reference  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.workers.model import gpu_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture
def device(monkeypatch) -> str:
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_kernels.available()
    return "cuda" if CUDA else "cpu"


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,heads,kv_heads,d,window", [(16, 8, 2, 64, None), (4, 4, 4, 32, None),
                                                        (6, 8, 2, 32, 7), (16, 16, 4, 128, 40),
                                                        (32, 8, 1, 80, None), (128, 16, 2, 64, 100)])
def test_kernel_matches_reference(device, dtype, B, heads, kv_heads, d, window) -> None:
    lengths = (1, B, B + 1, 3 * B - 1, 70, 2 * B + 5, 200)
    q, kv, token_index, tables, lens, out = decode_case(B, heads, kv_heads, d, dtype, lengths, B * 100 + heads)
    scale = d ** -0.5
    ref = _reference(q, kv, token_index, tables, lens, scale, window)
    args = [t.to(device) for t in (q, kv, token_index, tables, lens)]
    out_dev = out.to(device)
    gpu_kernels.paged_decode_attention(*args, scale, window, out_dev)
    out = out_dev.cpu()
    T = out.shape[0]
    tol = 1e-5 if dtype == torch.float32 else (2e-3 if dtype == torch.float16 else 2e-2)
    assert (out[token_index].double() - ref[token_index]).abs().max().item() <= tol
    others = torch.ones(T, dtype=torch.bool)
    others[token_index] = False
    assert bool((out[others] == 7.0).all())  # rows of other tokens untouched


def test_kernel_refuses_ungrouped_heads(device) -> None:
    kv = torch.zeros(2, 4, 4, 3, 16, device=device)  # 3 KV heads for 4 query heads
    q = torch.zeros(1, 4, 16, device=device)
    ids = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        gpu_kernels.paged_decode_attention(q, kv, ids, ids[None], ids + 1, 1.0, None, torch.zeros_like(q))


@cuda_only
def test_paged_backend_matches_sdpa_over_steps_on_cuda() -> None:
    paged_matches_sdpa("cuda", 16, 1e-4)


@cuda_only
@pytest.mark.parametrize("backend", ["sdpa", "paged"])
def test_captured_decode_graphs_match_eager_steps_on_cuda(backend) -> None:
    """Decode steps replayed as CUDA graphs (with the kernel inside for "paged") against the
    same steps run eagerly over a second pool: logits within 1e-4, the same K/V."""
    cfg, model = windowed_qwen3("cuda")
    model.set_attention_backend(backend)
    assert model.attention_backend == backend
    pools = {m: KVPool.for_model(cfg, 200, 16, device="cuda") for m in ("eager", "graph")}
    graphs = model.enable_decode_graphs(pools["graph"], max_batch=12, max_blocks=16)
    steps = StepDriver(200, 16)

    def step(parts):
        ids, seqs = steps.batch(parts)
        out = {m: model(ids.cuda(), None, seqs, pool) for m, pool in pools.items()}
        steps.advance(parts)
        return out

    step([(i, 3 + 11 * i) for i in range(10)])  # prefills (eager in both)
    before = graphs.replays
    for k in range(20):
        active = list(range(10)) if k % 3 else list(range(1 + k % 7))
        out = step([(i, 1) for i in active])
        assert (out["graph"] - out["eager"]).abs().max().item() <= 1e-4, k
    assert graphs.replays - before == 20 and all(g is not None for g, _ in graphs.graphs.values())
    assert torch.allclose(pools["graph"].kv, pools["eager"].kv, atol=1e-4)

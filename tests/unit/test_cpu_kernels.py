"""pdserve's compiled CPU decode-attention kernel (workers/model/csrc/paged_attention.cpp,
loaded by workers/model/cpu_kernels.py) and the "paged" attention backend that uses it.

- The kernel against attention written out in torch, over a pool with shuffled and shared
  blocks: GQA groups of 1, 2 and 4, sliding windows, block sizes that are and are not powers of
  two, query and output rows scattered in a wider flat batch; fp32 within 1e-5, bf16 within
  bf16 rounding.
- Whole-model steps through the "paged" backend give the gather + SDPA backend's logits
  (fp32, 1e-5), and the engine's greedy tokens are identical.

The kernel is built on first use with the machine's g++ (about 15 s here, then cached).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_models import decode_case, greedy_tokens, paged_matches_sdpa  # noqa: E402

from pdserve.workers.model import cpu_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.available(), "the CPU kernels failed to build (see the log)"


def _reference(q, kv, token_index, tables, lens, scale, window):
    """Per sequence: gather its keys position by position, plain softmax attention in fp64."""
    out = torch.zeros_like(q, dtype=torch.float64)
    B, kvh = kv.shape[2], kv.shape[3]
    group = q.shape[1] // kvh
    for i in range(len(lens)):
        n = int(lens[i])
        lo = 0 if window is None else max(0, n - window)
        pos = torch.arange(lo, n)
        blocks = tables[i][pos // B]
        k = kv[0][blocks, pos % B].double()  # [L, kvh, d]
        v = kv[1][blocks, pos % B].double()
        qi = q[token_index[i]].double().view(kvh, group, -1)  # [kvh, group, d]
        s = torch.einsum("hgd,lhd->hgl", qi, k) * scale
        o = torch.einsum("hgl,lhd->hgd", s.softmax(-1), v)
        out[token_index[i]] = o.reshape(q.shape[1], -1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,heads,kv_heads,window", [(16, 8, 2, None), (4, 4, 4, None), (6, 8, 2, 7),
                                                      (16, 16, 4, 40), (8, 2, 1, None)])
def test_kernel_matches_reference(dtype, B, heads, kv_heads, window) -> None:
    d = 32
    q, kv, token_index, tables, lens, out = decode_case(B, heads, kv_heads, d, dtype,
                                                        (1, B, B + 1, 3 * B - 1, 70, 2 * B + 5), B * 100 + heads)
    T = out.shape[0]
    scale = d ** -0.5
    cpu_kernels.paged_decode_attention(q, kv, token_index, tables, lens, scale, window, out)
    ref = _reference(q, kv, token_index, tables, lens, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out[token_index].double() - ref[token_index]).abs().max().item() <= tol
    others = torch.ones(T, dtype=torch.bool)
    others[token_index] = False
    assert bool((out[others] == 7.0).all())  # rows of other tokens untouched


def test_kernel_splits_sequences_over_threads_with_one_result() -> None:
    """A step big enough to be split over torch's threads gives, bit for bit, the single-thread
    result (each sequence is computed whole by one thread either way)."""
    q, kv, token_index, tables, lens, out = decode_case(16, 8, 2, 64, torch.float32,
                                                        (300, 17, 260, 400, 1, 333, 129), 5)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            o = out.clone()
            cpu_kernels.paged_decode_attention(q, kv, token_index, tables, lens, 0.125, None, o)
            outs.append(o)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    ref = _reference(q, kv, token_index, tables, lens, 0.125, None)
    assert (outs[1][token_index].double() - ref[token_index]).abs().max().item() <= 1e-5


def test_kernel_refuses_bad_shapes() -> None:
    kv = torch.zeros(2, 4, 4, 2, 24)  # head_dim 24: not a multiple of 16
    q = torch.zeros(1, 4, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.paged_decode_attention(q, kv, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]),
                                           1.0, None, torch.zeros_like(q))


def test_paged_backend_matches_sdpa_over_steps() -> None:
    """Decode batches of mixed lengths beside context chunks, windowed and full layers."""
    paged_matches_sdpa("cpu", 4, 1e-5)


def test_engine_tokens_equal_across_backends(tmp_path) -> None:
    from pdserve.workers.loading.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", seed=4)
    prompts = [[(5 * i + 11 * j) % 250 + 3 for j in range(4 + 13 * i)] for i in range(5)]
    outs = {}
    for backend in ("sdpa", "paged"):
        def use(loaded, llm, backend=backend) -> None:
            loaded.model.set_attention_backend(backend)
            assert loaded.model.attention_backend == backend

        outs[backend] = greedy_tokens(path, prompts, 24, use, max_batch_size=8, num_kv_blocks=64)
    assert outs["paged"] == outs["sdpa"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16, 64, 200, 512, 1030])
def test_rms_norm_ops_match_the_torch_formula(dtype, n) -> None:
    """csrc/norms.cpp against transformers' formula: fp32 within float rounding of the sum
    order; bf16/fp16 normalised in fp32, rounded, then scaled (the same roundings). x as a row
    slice of a wider buffer, as the decoder layer passes it; add_rms_norm also updates x."""
    from pdserve.workers.model.layers import RMSNorm

    torch.manual_seed(n)
    eps = 1e-6
    base = torch.randn(9, n).to(dtype)
    x = base[2:7]  # rows 2..6: unit stride, a row offset into the buffer
    delta = torch.randn(5, n).to(dtype)
    w = (torch.rand(n) + 0.5).to(dtype)

    def ref(v):
        if dtype == torch.float32:
            return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))
        v32 = v.float()
        return w * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    tol = 2e-6 if dtype == torch.float32 else (1e-2 if dtype == torch.bfloat16 else 2e-3)
    y = torch.ops.pdserve_cpu.rms_norm(x, w, eps)
    assert (y.float() - ref(x).float()).abs().max().item() <= tol
    expect_x = (x.float() + delta.float()).to(dtype)
    expect_y = ref(expect_x)
    before = base.clone()
    y2 = torch.ops.pdserve_cpu.add_rms_norm(x, delta, w, eps)
    assert torch.equal(x, expect_x)  # the residual stream updated in place, rounded to dtype
    assert torch.equal(base[:2], before[:2]) and torch.equal(base[7:], before[7:])  # other rows untouched
    assert (y2.float() - expect_y.float()).abs().max().item() <= tol
    # The module takes the fused path for 2-D rows and torch's for other shapes, with one result.
    norm = RMSNorm(n, eps, dtype=dtype, device="cpu")
    norm.weight.data.copy_(w)
    assert norm._fused(x) and not norm._fused(x.view(5, 1, n))
    assert (norm(x).float() - norm(x.view(5, 1, n)).view(5, n).float()).abs().max().item() <= tol


def test_a_build_lock_is_waited_on_only_until_it_is_stale(tmp_path) -> None:
    """torch's builder would wait forever on a lock a killed build left: pdserve waits while
    the lock is young (a live build), and removes it once it is older than the limit."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    cpu_kernels._clear_stale_lock(lock, stale_s=1.0)  # no lock: returns at once
    lock.touch()
    old = time.time() - 10
    os.utime(lock, (old, old))
    cpu_kernels._clear_stale_lock(lock, stale_s=5.0)  # stale: removed
    assert not lock.exists()
    lock.touch()  # a fresh lock that a live build removes after 0.3 s
    threading.Timer(0.3, lock.unlink).start()
    t0 = time.monotonic()
    cpu_kernels._clear_stale_lock(lock, stale_s=30.0, poll_s=0.05)
    assert not lock.exists() and time.monotonic() - t0 < 5
    lock.touch()  # a fresh lock nobody removes: waited on until stale, then removed
    t0 = time.monotonic()
    cpu_kernels._clear_stale_lock(lock, stale_s=0.5, poll_s=0.05)
    assert not lock.exists() and 0.3 <= time.monotonic() - t0 < 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [16, 100, 1408])
def test_silu_mul_matches_torch(dtype, inter) -> None:
    """csrc/activations.cpp's silu(gate) * up against torch's two ops on the same [T, 2I] rows:
    within an ulp or two of fp32 (its exp is not libm's) and one rounding step in bf16/fp16;
    the result is contiguous, the input untouched, and GatedMLP gives torch's output with it."""
    import torch.nn.functional as F

    from pdserve.workers.model.layers import GatedMLP

    torch.manual_seed(inter)
    base = (torch.randn(7, 2 * inter) * 4).to(dtype)
    base[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp's clamps, and zero
    gate_up = base[1:6] if inter > 16 else base  # a row slice of a wider buffer, or all of it
    before = gate_up.clone()
    out = torch.ops.pdserve_cpu.silu_mul(gate_up, inter)
    gate, up = gate_up.float().split(inter, dim=-1)
    if dtype == torch.float32:
        ref = F.silu(gate) * up
        tol = 4e-7 * ref.abs().max().item() + 1e-30
    else:
        ref = (F.silu(gate_up[:, :inter]).float() * up).to(dtype).float()
        tol = (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) * ref.abs().max().item()
    assert out.is_contiguous() and out.shape == (gate_up.shape[0], inter)
    assert torch.equal(gate_up, before)
    assert (out.float() - ref).abs().max().item() <= tol
    if inter == 16:  # silu(-100) ~ 0, silu(100) = 100, silu(+-0) = 0, within the same bound
        assert (out[0, :4].float() - torch.tensor([0.0, 100.0, 0.0, 0.0]) * up[0, :4]).abs().max().item() <= tol
    mlp = GatedMLP(32, inter, False, dtype=dtype, device="cpu")
    for p in (mlp.gate_up_weight, mlp.down_weight):
        p.data.copy_(torch.randn(p.shape).to(dtype) * 0.1)
    x = torch.randn(5, 32).to(dtype)
    fused = mlp(x)
    g, u = F.linear(x.float(), mlp.gate_up_weight.float()).split(inter, dim=-1)
    plain = F.linear(F.silu(g) * u, mlp.down_weight.float())
    assert (fused.float() - plain).abs().max().item() <= (1e-5 if dtype == torch.float32 else 0.1) * max(1.0, plain.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 16), (2, 1, 128)])
def test_rope_store_equals_rotate_and_index_copy(dtype, heads, kv_heads, d) -> None:
    """csrc/activations.cpp's rope_store against the torch path it replaces (rotate_in_place on
    q and k, then index_copy_ of k and v into the pool): bit for bit in every dtype, the pool
    written at the given slots only; a slot outside the pool is an error, not a write."""
    from pdserve.workers.model.config import RopeConfig
    from pdserve.workers.model.layers import RotaryEmbedding, rotate_in_place

    torch.manual_seed(d + heads)
    T, num_blocks, B = 6, 5, 4
    qkv = torch.randn(T, heads + 2 * kv_heads, d).to(dtype)
    positions = torch.tensor([0, 1, 7, 300, 2047, 5])
    cos, sin = RotaryEmbedding(RopeConfig(theta=10000.0), d, device="cpu").cos_sin(positions, dtype)
    slots = torch.tensor([3, 0, 19, 8, 12, 5])
    pool = torch.randn(2, num_blocks, B, kv_heads, d).to(dtype)
    ref_qkv, ref_pool = qkv.clone(), pool.clone()
    rotate_in_place(ref_qkv[:, : heads + kv_heads], cos, sin)
    flat = ref_pool.view(2, num_blocks * B, kv_heads, d)
    flat[0].index_copy_(0, slots, ref_qkv[:, heads : heads + kv_heads])
    flat[1].index_copy_(0, slots, ref_qkv[:, heads + kv_heads :])
    torch.ops.pdserve_cpu.rope_store(qkv, cos, sin, slots, pool, heads)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(pool, ref_pool)
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.pdserve_cpu.rope_store(qkv, cos, sin, torch.tensor([0, 1, 2, 3, 4, num_blocks * B]), pool, heads)
    assert torch.equal(pool, ref_pool)  # checked before anything is written

"""pdserve's GPU kernel: decode attention that reads the paged KV pool in place, in Triton.

The CUDA counterpart of cpu_kernels.paged_decode_attention, with the same arguments: the
"paged" attention backend calls whichever matches the pool's device. One program per (decode
sequence, KV head) walks that sequence's keys BLOCK_N at a time through its block table,
loading each key's row from its pool block (no gathered copy), with the h // kv_heads query
heads that share the KV head as the rows of one tile (padded to tl.dot's 16), and an online
softmax in float32. float32 pools use IEEE dot products (no TF32), so float32 results match
gather + SDPA up to the order of sums. The loop bounds come from ``lens`` in device memory, so
a captured CUDA graph replays it for any lengths within its table width.

Triton comes with torch's CUDA builds; without it (or without CUDA) ``available()`` is False and
the engine uses gather + SDPA. ``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors
through Triton's interpreter, which is how the tests check it on a machine with no GPU.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

ENV_DISABLE = "PDSERVE_GPU_KERNELS"
BLOCK_N = 64  # keys per loop iteration
_lock = threading.Lock()
_state: dict[str, object] = {}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "").strip() in ("1", "true")


def available() -> bool:
    """Whether the kernel can run: Triton imports, and there is a CUDA device (or the
    interpreter is on)."""
    if os.environ.get(ENV_DISABLE, "").strip() in ("0", "false", "no", "off"):
        return False
    return (torch.cuda.is_available() or interpreting()) and _kernel() is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _kernel():
    """The jitted kernel, defined on first use (importing Triton is slow and optional)."""
    if "kernel" in _state:
        return _state["kernel"]
    with _lock:
        if "kernel" not in _state:
            _state["kernel"] = _define()
    return _state["kernel"]


def _define():
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # noqa: BLE001 - any import failure means no kernel
        log.info("Triton does not import (%s): no GPU decode kernel", e)
        return None

    # No specialisation on the integer arguments that vary from step to step (the table width,
    # the window): Triton would compile a variant for 1 and for multiples of 16, and such a
    # compilation inside a timed step (or a graph's first capture) costs 0.5-1 s.
    @triton.jit(do_not_specialize=["window", "s_tab"])
    def paged_decode(Q, KV, TOK, TAB, LENS, OUT, scale, window,
                     sq_t, sq_h, skv_p, skv_b, skv_s, skv_h, s_tab, so_t, so_h,
                     G: tl.constexpr, D: tl.constexpr, B: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        i = tl.program_id(0)  # decode sequence
        kh = tl.program_id(1)  # KV head
        t = tl.load(TOK + i)  # its row in the flat batch
        L = tl.load(LENS + i)  # keys 0 .. L - 1
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        heads = kh * G + g
        qmask = (g < G)[:, None] & (dd < D)[None, :]
        q = tl.load(Q + t * sq_t + heads[:, None] * sq_h + dd[None, :], mask=qmask, other=0.0)
        lo = L * 0
        if window > 0:
            lo = tl.maximum(L - window, 0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # Every iteration holds at least one key in [lo, L): the first starts at or below lo,
        # the last below L; so the running max never stays -inf (no NaN from exp(-inf + inf)).
        for k0 in range(lo // BLOCK_N * BLOCK_N, L, BLOCK_N):
            pos = k0 + n
            valid = (pos >= lo) & (pos < L)
            blk = tl.load(TAB + i * s_tab + pos // B, mask=valid, other=0)
            row = blk * skv_b + (pos % B) * skv_s + kh * skv_h
            kvmask = valid[:, None] & (dd < D)[None, :]
            k = tl.load(KV + row[:, None] + dd[None, :], mask=kvmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(KV + skv_p + row[:, None] + dd[None, :], mask=kvmask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(OUT + t * so_t + heads[:, None] * so_h + dd[None, :], o.to(OUT.dtype.element_ty), mask=qmask)

    return paged_decode


def paged_decode_attention(q: torch.Tensor, layer_kv: torch.Tensor, token_index: torch.Tensor,
                           tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None,
                           out: torch.Tensor) -> None:
    """out[token_index[i]] = attention of q[token_index[i]] ([T, h, d], unit stride over d) over
    keys max(0, lens[i] - window) .. lens[i] - 1 of sequence i, read from ``layer_kv``
    [2, num_blocks, B, kv_heads, d] (contiguous) through ``tables[i]`` (int64 block ids)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("Triton is not available; use the sdpa attention backend")
    n = token_index.numel()
    if n == 0:
        return
    _, _, B, kvh, d = layer_kv.shape
    h = q.shape[1]
    if h % kvh or q.stride(2) != 1 or out.stride(2) != 1 or not layer_kv.is_contiguous():
        raise ValueError("paged_decode_attention: q/out need unit stride over d, the pool contiguity, "
                         f"and query heads a multiple of KV heads (got {h} and {kvh})")
    G = h // kvh
    # fp32: IEEE products, no TF32 (the float32 results must match gather + SDPA).
    precision = "ieee" if layer_kv.dtype == torch.float32 else "tf32"
    kernel[(n, kvh)](
        q, layer_kv, token_index, tables, lens, out, float(scale), -1 if window is None else int(window),
        q.stride(0), q.stride(1), layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2),
        layer_kv.stride(3), tables.stride(0), out.stride(0), out.stride(1),
        G=G, D=d, B=B, BLOCK_G=max(16, _next_pow2(G)), BLOCK_D=max(16, _next_pow2(d)),
        BLOCK_N=BLOCK_N, PRECISION=precision, num_warps=4,
    )

"""Self-attention over a paged KV pool (grouped-query attention, RoPE).

One layer's pool slice is ``layer_kv`` [2, num_blocks, B, kv_heads, d] (0 = K, 1 = V). A layer's
attention runs in two parts so the per-token part can be tiled over the flat batch:

- ``project`` (per token tile): q, k, v of the tile's tokens, RoPE on q and k, in place in a
  step-wide [T, h + 2 * kv_heads, d] buffer; the new K/V are written into the pool.
- ``attend`` (whole batch): each query attends over its sequence's cached and new keys, read
  back through the block table. Reads gather whole blocks with one ``index_select`` of contiguous
  rows into a reused workspace (fresh large allocations cost more than the copy itself); with
  the flex backend (``meta.flex``, flex_attention.py) decode tokens and chunks with cached
  tokens read the pool in place instead, and with the "paged" backend (``meta.paged_decode``)
  decode tokens do, through pdserve's compiled CPU kernel (cpu_kernels.py) or its Triton kernel
  on CUDA (gpu_kernels.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels, flex_attention, gpu_kernels
from .batch import AttentionMetadata
from .config import ModelConfig
from .layers import PrepackedLinears, RMSNorm, _empty, fused_cpu, linear, rank0_only, rotate_in_place
from .parallel import SINGLE, Shard, TensorParallel


class Workspace:
    """Grow-only scratch buffers shared by all layers of a model, one per name: the block
    gathers and the step-wide activations. A large tensor allocated fresh in every layer costs
    page faults on every step; these are faulted in once."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous view of buffer ``name`` with this shape (contents undefined)."""
        need = 1
        for s in shape:
            need *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(need + need // 4, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:need].view(shape)

    def rows(self, n_rows: int, row_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The block-gather buffer as [n_rows, row_size]."""
        return self.get("gather", (n_rows, row_size), dtype, device)


class PagedAttention(PrepackedLinears, nn.Module):
    """One layer's attention weights and its parts: ``project`` and ``output`` per token tile,
    ``attend`` over the whole batch; the decoder layer drives them so that it can tile the
    tokens. Every attention kind (this GQA one, MLA) offers the same four methods.

    Options from the config: biases, per-head q/k RMSNorm before RoPE (``qk_norm``; Gemma's
    ``unit_offset`` scale), the softmax scale, the layer's sliding window.

    Under tensor parallelism (``tp``, parallel.py) the module holds its rank's query heads and
    KV heads only; ``output`` sums the ranks' partial projections (one all-reduce)."""

    LINEARS = ("qkv", "o")

    def __init__(
        self, config: ModelConfig, window: int | None, *, dtype: torch.dtype, device: torch.device | str,
        norm_unit_offset: bool = False, tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.q_heads = tp.split(config.num_attention_heads, "attention heads")  # global [start, stop)
        self.kv_range = tp.kv_heads(config.num_key_value_heads)
        self.num_heads = self.q_heads[1] - self.q_heads[0]  # this rank's
        self.num_kv_heads = self.kv_range[1] - self.kv_range[0]
        self.head_dim = config.head_dim
        self.window = window
        self.scale = config.attn_scale  # None: SDPA's default, head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_rows = q_size + 2 * kv_size
        # Fused projection; rows are q, then k, then v.
        self.qkv_weight = _empty((qkv_rows, config.hidden_size), dtype, device)
        self.qkv_bias = _empty((qkv_rows,), dtype, device) if config.qkv_bias else None
        self.o_weight = _empty((config.hidden_size, q_size), dtype, device)
        # Added after the all-reduce's sum, so only rank 0 loads it (the others' stays zero).
        self.o_bias = _empty((config.hidden_size,), dtype, device) if config.o_bias else None
        self._num_kv_heads_total = config.num_key_value_heads
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            kw = dict(dtype=dtype, device=device, unit_offset=norm_unit_offset)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **kw)

    @property
    def qkv_heads(self) -> int:
        return self.num_heads + 2 * self.num_kv_heads

    def step_buffers(self, T: int, workspace: Workspace, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Step-wide buffers shared by all layers: projections of every token, attention output."""
        qkv = workspace.get("qkv", (T, self.qkv_heads, self.head_dim), dtype, device)
        att = workspace.get("attn", (T, self.num_heads * self.head_dim), dtype, device)
        return qkv, att

    def output(self, att: torch.Tensor) -> torch.Tensor:  # [t, h * d] -> [t, H]
        return self.tp.all_reduce(linear(att, self.o_weight, self.o_bias, self.packed("o")))

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        """HF names (``prefix`` + q_proj/k_proj/v_proj/o_proj/q_norm/k_norm) -> what they fill
        (this rank's heads of each: a Shard under tensor parallelism)."""
        d, tp = self.head_dim, self.tp
        qs, kvs = self.num_heads * d, self.num_kv_heads * d
        full_q, full_kv = self.q_heads, self.kv_range
        nq = tp.size * self.num_heads * d  # the checkpoint's q rows
        nkv = self._num_kv_heads_total * d
        t: dict[str, torch.Tensor | Shard] = {}
        for name, lo, hi, (a, b), n in (("q", 0, qs, full_q, nq), ("k", qs, qs + kvs, full_kv, nkv),
                                        ("v", qs + kvs, qs + 2 * kvs, full_kv, nkv)):
            t[prefix + f"{name}_proj.weight"] = tp.shard(self.qkv_weight[lo:hi], 0, a * d, b * d, n)
            if self.qkv_bias is not None:
                t[prefix + f"{name}_proj.bias"] = tp.shard(self.qkv_bias[lo:hi], 0, a * d, b * d, n)
        t[prefix + "o_proj.weight"] = tp.shard(self.o_weight, 1, full_q[0] * d, full_q[1] * d, nq)
        if self.o_bias is not None:
            t[prefix + "o_proj.bias"] = rank0_only(self.o_bias, tp)
        if self.q_norm is not None:
            t[prefix + "q_norm.weight"] = self.q_norm.weight
            t[prefix + "k_norm.weight"] = self.k_norm.weight
        return t

    def project(
        self,
        x: torch.Tensor,  # [t, H], normalised hidden states of a tile of tokens
        cos: torch.Tensor,  # [t, 1, d/2]
        sin: torch.Tensor,  # [t, 1, d/2]
        slots: torch.Tensor,  # [t] long: pool slot of each token's K/V
        layer_kv: torch.Tensor,  # [2, num_blocks, B, kv_heads, d], the model's dtype
        qkv: torch.Tensor,  # [t, h + 2 * kv_heads, d] contiguous rows: receives q, k (rotated), v
    ) -> None:
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        flat = qkv.view(qkv.shape[0], -1)
        packed = self.packed("qkv")
        if packed is not None:
            flat.copy_(linear(x, self.qkv_weight, self.qkv_bias, packed))
        elif self.qkv_bias is None:
            torch.mm(x, self.qkv_weight.t(), out=flat)
        else:
            torch.addmm(self.qkv_bias, x, self.qkv_weight.t(), out=flat)
        if self.q_norm is not None:
            qkv[:, :h] = self.q_norm(qkv[:, :h])
            qkv[:, h : h + kvh] = self.k_norm(qkv[:, h : h + kvh])
        if (fused_cpu(qkv) and qkv.stride(1) == d and cos.dtype == qkv.dtype and 2 * cos.shape[-1] == d
                and layer_kv.dim() == 5 and layer_kv.is_contiguous() and slots.dtype == torch.long):
            # RoPE on q and k, and k and v into the pool, as one op (csrc/activations.cpp)
            torch.ops.pdserve_cpu.rope_store(qkv, cos, sin, slots.contiguous(), layer_kv, h)
            return
        rotate_in_place(qkv[:, : h + kvh], cos, sin)
        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        pool_slots = layer_kv.view(2, num_blocks * B, kvh, d)
        pool_slots[0].index_copy_(0, slots, qkv[:, h : h + kvh])
        pool_slots[1].index_copy_(0, slots, qkv[:, h + kvh :])

    def attend(
        self,
        qkv: torch.Tensor,  # [T, h + 2 * kv_heads, d] from project, every token of the step
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [2, num_blocks, B, kv_heads, d], holding this step's K/V too
        workspace: Workspace,
        out: torch.Tensor,  # [T, h * d] contiguous: receives the attention output
    ) -> None:
        T = qkv.shape[0]
        out = out.view(T, self.num_heads, self.head_dim)
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]  # [T, h|kvh|kvh, d]
        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        # Gathers read whole blocks as rows of this [2 * num_blocks, B * kvh * d] view.
        block_rows = layer_kv.view(2 * num_blocks, B * kvh * d)

        # Decode: the h // kvh query heads that share a KV head are that head's query rows, so
        # SDPA sees plain (non-grouped) attention with no K/V repeat: [n, kvh, h // kvh, d].
        out_grouped = out.view(T, kvh, h // kvh, d)
        if meta.decode_gather_rows is not None:
            rows_all = meta.decode_gather_rows
            gathered = workspace.rows(rows_all.numel(), B * kvh * d, layer_kv.dtype, layer_kv.device)
            torch.index_select(block_rows, 0, rows_all, out=gathered)
        for g in meta.decode_groups:
            n, L = g.num_seqs, g.max_blocks * B
            buf = gathered[g.row_offset : g.row_offset + g.gather_rows.numel()]
            kv = buf.view(2, n, L, kvh, d).transpose(2, 3)  # [2, n, kvh, L, d] (strided view)
            qg = q.index_select(0, g.token_index).view(n, kvh, h // kvh, d)
            o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.masks[self.window], scale=self.scale)
            out_grouped.index_copy_(0, g.token_index, o)  # o [n, kvh, h // kvh, d]
        for c in meta.context_chunks:
            rows = slice(c.start, c.start + c.num_new)
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
            if c.gather_rows is None:
                kc = k[rows].transpose(0, 1).unsqueeze(0)  # [1, kvh, n, d]
                vc = v[rows].transpose(0, 1).unsqueeze(0)
            else:
                buf = workspace.rows(c.gather_rows.numel(), B * kvh * d, layer_kv.dtype, layer_kv.device)
                torch.index_select(block_rows, 0, c.gather_rows, out=buf)
                kv = buf.view(2, 1, c.num_blocks * B, kvh, d).transpose(2, 3)
                kc, vc = kv[0], kv[1]  # [1, kvh, n_keys, d]
            mask = c.masks[self.window]
            o = F.scaled_dot_product_attention(
                qc, kc, vc, attn_mask=mask, is_causal=mask is None, enable_gqa=kvh != h, scale=self.scale,
            )  # [1, h, n, d]
            out[rows] = o[0].transpose(0, 1)
        if meta.paged_decode is not None:  # in place over the pool (cpu_kernels.py)
            pd = meta.paged_decode
            scale = self.scale if self.scale is not None else d ** -0.5
            kernels = gpu_kernels if layer_kv.device.type != "cpu" else cpu_kernels
            kernels.paged_decode_attention(q, layer_kv, pd.token_index, pd.tables, pd.lens, scale, self.window, out)
        if meta.flex is not None:
            keys, values = flex_attention.pool_keys_values(layer_kv)
            calls = [meta.flex.decode] if meta.flex.decode is not None else []
            for call in [*calls, *meta.flex.chunks.values()]:
                flex_attention.attend(call, self.window, q, keys, values, self.scale, out, B)

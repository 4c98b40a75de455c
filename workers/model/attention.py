"""Self-attention over a paged KV pool (grouped-query attention, RoPE).

One layer's pool slice is ``layer_kv`` [2, num_blocks, B, kv_heads, d] (0 = K, 1 = V). New keys
and values are written into it first; then each query attends over its sequence's cached and new
keys, read back through the block table. Reads gather whole blocks with one ``index_select`` of
contiguous rows into a reused workspace (fresh large allocations cost more than the copy itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import AttentionMetadata
from .config import ModelConfig
from .layers import _empty, apply_rotary


class Workspace:
    """A grow-only scratch buffer for block gathers, shared by all layers of a model."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, n_rows: int, row_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [n_rows, row_size] view of the buffer (contents undefined)."""
        need = n_rows * row_size
        buf = self._buf
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(need + need // 4, dtype=dtype, device=device)
            self._buf = buf
        return buf[:need].view(n_rows, row_size)


class PagedAttention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = window
        qkv_rows = config.q_size + 2 * config.kv_size
        # Fused projection; rows are q, then k, then v.
        self.qkv_weight = _empty((qkv_rows, config.hidden_size), dtype, device)
        self.qkv_bias = _empty((qkv_rows,), dtype, device) if config.qkv_bias else None
        self.o_weight = _empty((config.hidden_size, config.q_size), dtype, device)
        self.o_bias = _empty((config.hidden_size,), dtype, device) if config.o_bias else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, d]
        sin: torch.Tensor,  # [T, 1, d]
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [2, num_blocks, B, kv_heads, d], the model's dtype
        workspace: Workspace,
    ) -> torch.Tensor:  # [T, H]
        T = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(T, h + 2 * kvh, d)
        qk = apply_rotary(qkv[:, : h + kvh], cos, sin)  # [T, h + kvh, d]
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]  # [T, h, d], [T, kvh, d], [T, kvh, d]

        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        slots = layer_kv.view(2, num_blocks * B, kvh, d)
        slots[0].index_copy_(0, meta.slots, k)
        slots[1].index_copy_(0, meta.slots, v)
        # Gathers read whole blocks as rows of this [2 * num_blocks, B * kvh * d] view.
        block_rows = layer_kv.view(2 * num_blocks, B * kvh * d)

        out = torch.empty(T, h, d, dtype=x.dtype, device=x.device)
        for g in meta.decode_groups:
            n, L = g.num_seqs, g.max_blocks * B
            buf = workspace.rows(g.gather_rows.numel(), B * kvh * d, layer_kv.dtype, layer_kv.device)
            torch.index_select(block_rows, 0, g.gather_rows, out=buf)
            kv = buf.view(2, n, L, kvh, d).transpose(2, 3)  # [2, n, kvh, L, d] (strided view)
            qg = q.index_select(0, g.token_index).unsqueeze(2)  # [n, h, 1, d]
            o = F.scaled_dot_product_attention(
                qg, kv[0], kv[1], attn_mask=g.masks[self.window], enable_gqa=kvh != h
            )  # [n, h, 1, d]
            out.index_copy_(0, g.token_index, o.squeeze(2))
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
                qc, kc, vc, attn_mask=mask, is_causal=mask is None, enable_gqa=kvh != h
            )  # [1, h, n, d]
            out[rows] = o[0].transpose(0, 1)
        return F.linear(out.view(T, h * d), self.o_weight, self.o_bias)

"""Self-attention over a paged KV pool (grouped-query attention, RoPE).

One layer's pool slice is ``layer_kv`` [2, num_blocks, B, kv_heads, d] (0 = K, 1 = V). A layer's
attention runs in two parts so the per-token part can be tiled over the flat batch:

- ``project`` (per token tile): q, k, v of the tile's tokens, RoPE on q and k, in place in a
  step-wide [T, h + 2 * kv_heads, d] buffer; the new K/V are written into the pool.
- ``attend`` (whole batch): each query attends over its sequence's cached and new keys, read
  back through the block table. Reads gather whole blocks with one ``index_select`` of contiguous
  rows into a reused workspace (fresh large allocations cost more than the copy itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import AttentionMetadata
from .config import ModelConfig
from .layers import _empty, rotate_in_place


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


class PagedAttention(nn.Module):
    """One layer's attention weights and its two halves, ``project`` and ``attend``; the
    decoder layer drives them (and the output projection) so that it can tile the tokens."""

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

    @property
    def qkv_heads(self) -> int:
        return self.num_heads + 2 * self.num_kv_heads

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
        if self.qkv_bias is None:
            torch.mm(x, self.qkv_weight.t(), out=flat)
        else:
            torch.addmm(self.qkv_bias, x, self.qkv_weight.t(), out=flat)
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
        out: torch.Tensor,  # [T, h, d] contiguous: receives the attention output
    ) -> None:
        T = qkv.shape[0]
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
            o = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=g.masks[self.window])
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
                qc, kc, vc, attn_mask=mask, is_causal=mask is None, enable_gqa=kvh != h
            )  # [1, h, n, d]
            out[rows] = o[0].transpose(0, 1)

"""The KV cache tensors of one worker, indexed by block id.

``kv`` is one tensor [layers, planes, num_blocks, tokens_per_block, kv_heads, head_dim]: two
planes (K, V) for multi-head and grouped-query attention, one for MLA, whose cache is one
compressed latent per token (``kv_heads`` 1, ``head_dim`` kv_lora_rank + qk_rope_head_dim).
Block accounting (which ids are free, shared, cached) lives in ``pdserve.scheduler.kv_cache``;
this class only holds the numbers. ``gather_blocks``/``scatter_blocks`` move whole blocks (all
layers, K and V) in and out, for the disaggregated KV transfer.

It lives in ``transport/`` beside the data plane that reads it (``kv_groups.BlockMover``,
the sender and receiver), so no import runs from transport/ up to workers/; the workers' model
and executor import it from here.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

BlockIds = Sequence[int] | torch.Tensor


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        tokens_per_block: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_planes: int = 2,
    ) -> None:
        if min(num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim) < 1:
            raise ValueError("KVPool dimensions must all be positive")
        if num_planes not in (1, 2):
            raise ValueError(f"num_planes must be 1 (MLA latent) or 2 (K and V), got {num_planes}")
        self.num_planes = num_planes
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (num_layers, num_planes, num_blocks, tokens_per_block, num_kv_heads, head_dim), dtype=dtype,
            device=self.device,
        )
        self.block_numel = tokens_per_block * num_kv_heads * head_dim  # one block of one plane
        self.bytes_per_block = self.bytes_per_block_for(
            num_layers, tokens_per_block, num_kv_heads, head_dim, dtype, num_planes
        )
        # Row r * num_blocks + b of the [planes * layers * num_blocks, block_numel] view is block
        # b of (layer, plane) r; gathers index rows, the fast contiguous path of index_select.
        self._rows = self.kv.view(num_planes * num_layers * num_blocks, self.block_numel)
        self._plane_offsets = torch.arange(num_planes * num_layers, device=self.device)[:, None] * num_blocks

    # ----------------------------------------------------------------- sizing

    @staticmethod
    def bytes_per_block_for(
        num_layers: int, tokens_per_block: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        num_planes: int = 2,
    ) -> int:
        """Bytes of one block id across all layers and planes."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * num_planes * tokens_per_block * num_kv_heads * head_dim * itemsize

    @classmethod
    def for_model(
        cls,
        config: Any,
        num_blocks: int,
        tokens_per_block: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
    ) -> KVPool:
        """A pool shaped for a model config's KV cache (``num_hidden_layers``, ``kv_planes``,
        ``cache_heads``, ``cache_head_dim``: ``pdserve.workers.model.ModelConfig``);
        ``num_kv_heads``: a tensor-parallel rank's share of the cache heads instead."""
        return cls(
            config.num_hidden_layers, num_blocks, tokens_per_block,
            config.cache_heads if num_kv_heads is None else num_kv_heads,
            config.cache_head_dim, dtype=dtype, device=device, num_planes=config.kv_planes,
        )

    # ----------------------------------------------------------------- block copies

    def block_shape(self, n: int) -> tuple[int, ...]:
        """Shape of n gathered blocks: [layers, planes, n, B, kv_heads, head_dim]."""
        return (self.num_layers, self.num_planes, n, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def _row_index(self, block_ids: BlockIds) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long).to(self.device).view(1, -1)  # [1, n]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        return (self._plane_offsets + ids).view(-1)  # [planes * layers * n], plane-major

    def gather_blocks(self, block_ids: BlockIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy blocks out: contiguous [layers, planes, n, B, kv_heads, head_dim], in block_ids order.
        ``out`` (contiguous, that shape, the pool's dtype and device) avoids an allocation."""
        rows = self._row_index(block_ids)
        n = rows.numel() // (self.num_planes * self.num_layers)
        if out is None:
            out = torch.empty(self.block_shape(n), dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != self.block_shape(n) or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype} tensor of shape {self.block_shape(n)}")
        torch.index_select(self._rows, 0, rows, out=out.view(rows.numel(), self.block_numel))
        return out

    def scatter_blocks(self, block_ids: BlockIds, data: torch.Tensor) -> None:
        """Copy blocks in: data [layers, planes, n, B, kv_heads, head_dim] lands in block_ids order.
        Ids must be distinct (a duplicate would make the result depend on copy order)."""
        rows = self._row_index(block_ids)
        n = rows.numel() // (self.num_planes * self.num_layers)
        if tuple(data.shape) != self.block_shape(n):
            raise ValueError(f"data has shape {tuple(data.shape)}, expected {self.block_shape(n)}")
        if len(set(torch.as_tensor(block_ids).tolist())) != n:
            raise ValueError("scatter_blocks needs distinct block ids")
        src = data.to(device=self.device, dtype=self.dtype).contiguous()
        self._rows.index_copy_(0, rows, src.view(rows.numel(), self.block_numel))

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` becomes a copy of block ``src`` in every layer and plane (a forked
        sequence's copy-on-write of a partial block)."""
        self.kv[:, :, dst].copy_(self.kv[:, :, src])

    def layer(self, layer: int) -> torch.Tensor:
        """One layer's view [planes, num_blocks, B, kv_heads, head_dim] (what the model reads)."""
        return self.kv[layer]

    def __repr__(self) -> str:
        return (
            f"KVPool(layers={self.num_layers}, blocks={self.num_blocks}, B={self.tokens_per_block}, "
            f"planes={self.num_planes}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )

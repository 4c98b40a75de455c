"""Llama-family causal LM (Llama, Qwen2, Mistral configs) over a flat, paged batch.

One ``forward`` runs one engine step: T new tokens from any mix of sequences (context chunks and
decode tokens), K/V read from and written to a ``KVPool``. Parameters use the model dtype (fp32 on
CPU, bf16 on CUDA by default); logits come back in fp32.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import PagedAttention, Workspace
from .batch import GROUP_GATHER_BYTES, AttentionMetadata, SeqBatchInfo
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, RotaryEmbedding, _empty

if TYPE_CHECKING:
    from ..kv_pool import KVPool


class WeightLoadError(ValueError):
    """Checkpoint tensors do not match the model (missing, unexpected or misshapen)."""


# Tokens per tile of a layer's per-token work (norms, projections, RoPE, MLP) in big batches
# (prefill): intermediates such as the MLP's [tile, 2 * intermediate] stay small enough to be
# reused from the allocator's free lists, where step-sized ones are faulted in afresh in every
# layer (~10% of a 4096-token prefill on CPU); 512 rows still run matmuls at full speed.
TOKEN_TILE = 512


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.attn = PagedAttention(config, window, dtype=dtype, device=device)
        self.post_attn_norm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype=dtype, device=device)

    def forward(
        self,
        h: torch.Tensor,  # [T, H], updated in place
        cos: torch.Tensor,  # [T, 1, d/2]
        sin: torch.Tensor,
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [2, num_blocks, B, kv_heads, d]
        workspace: Workspace,
        token_tile: int = TOKEN_TILE,
    ) -> torch.Tensor:  # [T, H], the same tensor as h
        T = h.shape[0]
        attn = self.attn
        # Step-wide buffers, shared by all layers: q/k/v of every token, the attention output.
        qkv = workspace.get("qkv", (T, attn.qkv_heads, attn.head_dim), h.dtype, h.device)
        att = workspace.get("attn", (T, attn.num_heads, attn.head_dim), h.dtype, h.device)
        tiles = [slice(a, min(a + token_tile, T)) for a in range(0, T, token_tile)]
        for t in tiles:
            attn.project(self.input_norm(h[t]), cos[t], sin[t], meta.slots[t], layer_kv, qkv[t])
        attn.attend(qkv, meta, layer_kv, workspace, att)
        att_flat = att.view(T, -1)
        for t in tiles:
            x = h[t]
            x.add_(F.linear(att_flat[t], attn.o_weight, attn.o_bias))
            x.add_(self.mlp(self.post_attn_norm(x)))
        return h


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        H = config.hidden_size
        self.embed_weight = _empty((config.vocab_size, H), dtype, device)  # [V, H]
        self.layers = nn.ModuleList(
            DecoderLayer(config, w, dtype=dtype, device=device) for w in config.layer_windows
        )
        self.norm = RMSNorm(H, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head_weight = (
            self.embed_weight if config.tie_word_embeddings else _empty((config.vocab_size, H), dtype, device)
        )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device=device)
        self.workspace = Workspace()
        # Byte cap of one decode group's per-layer K/V gather (see batch.py); tunable.
        self.decode_group_bytes = GROUP_GATHER_BYTES
        self.token_tile = TOKEN_TILE  # tunable, see DecoderLayer

    # ----------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor | None,  # [T] long, or None to derive them from seqs
        seqs: Sequence[SeqBatchInfo],
        kv_pool: KVPool,
        *,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """One step over a flat batch. Writes the new tokens' K/V into ``kv_pool`` and returns
        fp32 logits [len(seqs), V] of each sequence's last new token (in ``seqs`` order), or
        [T, V] for every flat row when ``all_logits``. ``on_layer(n)`` runs after layer n - 1
        has written its K/V (layer-wise KV sends start from it)."""
        cfg = self.config
        if kv_pool.dtype != self.dtype or kv_pool.num_layers != cfg.num_hidden_layers:
            raise ValueError(f"{kv_pool!r} does not match the model ({cfg.num_hidden_layers} layers, {self.dtype})")
        if kv_pool.num_kv_heads != cfg.num_key_value_heads or kv_pool.head_dim != cfg.head_dim:
            raise ValueError(f"{kv_pool!r} does not match the model's kv heads / head_dim")
        T = input_ids.shape[0]
        meta = AttentionMetadata.build(
            seqs, T, kv_pool.tokens_per_block, kv_pool.num_blocks, cfg.layer_windows, self.device,
            block_bytes=2 * kv_pool.block_numel * kv_pool.kv.element_size(),
            group_bytes=self.decode_group_bytes, dtype=self.dtype,
        )
        if positions is not None and not torch.equal(positions.to(self.device), meta.positions):
            raise ValueError("positions disagree with the sequences' past_len")
        input_ids = input_ids.to(self.device)
        if meta.max_gather_rows:  # size the gather workspace once for the whole step
            self.workspace.rows(meta.max_gather_rows, kv_pool.block_numel, self.dtype, self.device)

        h = F.embedding(input_ids, self.embed_weight)  # [T, H]
        cos, sin = self.rotary.cos_sin(meta.positions, self.dtype)  # [T, 1, d/2] each
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, kv_pool.kv[i], self.workspace, self.token_tile)
            if on_layer is not None:
                on_layer(i + 1)
        if not all_logits:
            h = h.index_select(0, meta.last_token_index)  # [num_seqs, H]
        return F.linear(self.norm(h), self.lm_head_weight).float()  # [rows, V]

    # ----------------------------------------------------------------- weights

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """HF checkpoint tensor name -> the (slice of a) parameter it fills."""
        cfg = self.config
        qs, kvs, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        t: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.embed_weight,
            "model.norm.weight": self.norm.weight,
        }
        if not cfg.tie_word_embeddings:
            t["lm_head.weight"] = self.lm_head_weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = layer.attn, layer.mlp
            t[p + "input_layernorm.weight"] = layer.input_norm.weight
            t[p + "post_attention_layernorm.weight"] = layer.post_attn_norm.weight
            for name, lo, hi in (("q", 0, qs), ("k", qs, qs + kvs), ("v", qs + kvs, qs + 2 * kvs)):
                t[p + f"self_attn.{name}_proj.weight"] = a.qkv_weight[lo:hi]
                if a.qkv_bias is not None:
                    t[p + f"self_attn.{name}_proj.bias"] = a.qkv_bias[lo:hi]
            t[p + "self_attn.o_proj.weight"] = a.o_weight
            if a.o_bias is not None:
                t[p + "self_attn.o_proj.bias"] = a.o_bias
            t[p + "mlp.gate_proj.weight"] = m.gate_up_weight[:inter]
            t[p + "mlp.up_proj.weight"] = m.gate_up_weight[inter:]
            t[p + "mlp.down_proj.weight"] = m.down_weight
            if m.gate_up_bias is not None:
                t[p + "mlp.gate_proj.bias"] = m.gate_up_bias[:inter]
                t[p + "mlp.up_proj.bias"] = m.gate_up_bias[inter:]
                t[p + "mlp.down_proj.bias"] = m.down_bias
        return t

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs, casting to the model dtype.
        Raises WeightLoadError naming the first missing, unexpected or misshapen tensor."""
        targets = self._weight_targets()
        missing = set(targets)
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, stored by some old checkpoints
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head, as transformers does
            target = targets.get(name)
            if target is None:
                raise WeightLoadError(f"unexpected tensor {name!r} in checkpoint")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            missing.discard(name)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensor {sorted(missing)[0]!r} ({len(missing)} missing)")

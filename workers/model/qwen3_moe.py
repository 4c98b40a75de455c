"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm before RoPE, no biases unless
``attention_bias``) with a sparse MoE MLP on the sparse layers and a dense gated MLP of
``intermediate_size`` on the others (``mlp_only_layers``, or layers off ``decoder_sparse_step``).

Routing as transformers' Qwen3MoeTopKRouter: softmax over the experts in fp32, top
``num_experts_per_tok``, renormalised only when ``norm_topk_prob``, cast to the model dtype.
Checkpoints: hub per-expert tensors (``mlp.experts.{e}.gate_proj.weight`` ...) or
transformers-5 fused ones (``mlp.experts.gate_up_proj``/``down_proj``)."""
from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from .config import ModelConfigError, layer_windows_from_types, parse_common
from .decoder import DecoderLM
from .moe import MoeConfig, SparseMoE, softmax_topk, split_fused_experts


class Qwen3MoeForCausalLM(DecoderLM):
    config: MoeConfig

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        if not cfg.sparse_layers[layer]:
            return super().make_mlp(layer)
        route = functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok,
                                  renormalize=cfg.norm_topk_prob, out_dtype=self.dtype)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, route=route,
                         act=cfg.hidden_act, dtype=self.dtype, device=self.device, tp=self.tp)

    def convert_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return split_fused_experts(tensors)


def parse_moe_fields(cfg: Mapping[str, Any], layers: int, sparse_layers: tuple[bool, ...], *,
                     norm_topk_prob: bool) -> dict[str, Any]:
    """The MoeConfig extras; checks the expert counts and widths the sparse layers need."""
    # Hub configs say num_experts (Qwen) or num_local_experts (Mixtral; transformers 5 saves
    # Qwen3-MoE's under that name too).
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    width = int(cfg.get("moe_intermediate_size") or 0)
    if any(sparse_layers):
        if experts < 1 or not 1 <= top_k <= experts:
            raise ModelConfigError(
                f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})"
            )
        if width < 1:
            raise ModelConfigError("missing required field 'moe_intermediate_size'")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=norm_topk_prob, sparse_layers=sparse_layers)


def parse_qwen3_moe(cfg: Mapping[str, Any]) -> MoeConfig:
    fields = parse_common(cfg, "qwen3_moe")
    layers = fields["num_hidden_layers"]
    # transformers' Qwen3MoeConfig: every layer slides when use_sliding_window (no
    # max_window_layers / layer_types for this model).
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(int(i) for i in (cfg.get("mlp_only_layers") or ()))
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    if not all(sparse) and fields["intermediate_size"] < 1:
        raise ModelConfigError("missing required field 'intermediate_size' (the dense layers' MLP)")
    fields.update(mlp_bias=False, qk_norm=True,
                  layer_windows=layer_windows_from_types({"sliding_window": window}, layers))
    fields.update(parse_moe_fields(cfg, layers, sparse, norm_topk_prob=bool(cfg.get("norm_topk_prob", False))))
    return MoeConfig(**fields)

"""Mixtral: Mistral's attention (no biases; every layer slides when ``sliding_window`` is set)
with a sparse MoE MLP on every layer.

Routing as transformers' MixtralTopKRouter: softmax over ``num_local_experts`` in fp32, top
``num_experts_per_tok``, always renormalised, the weights kept in fp32. Checkpoints (hub):
``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate,
up, down); transformers-5 fused tensors (``mlp.gate.weight``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) are accepted too."""
from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from .config import layer_windows_from_types, parse_common
from .decoder import DecoderLM
from .moe import MIXTRAL_EXPERT_NAMES, MoeConfig, SparseMoE, softmax_topk, split_fused_experts
from .qwen3_moe import parse_moe_fields

MOE_PREFIX = ".block_sparse_moe."


class MixtralForCausalLM(DecoderLM):
    config: MoeConfig
    mlp_prefix = MOE_PREFIX[1:]

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        route = functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok, renormalize=True)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, route=route,
                         act=cfg.hidden_act, names=MIXTRAL_EXPERT_NAMES, dtype=self.dtype,
                         device=self.device, tp=self.tp)

    def convert_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # transformers 5 names the block "mlp" in memory (a Mixtral layer has no other MLP).
        renamed = ((name.replace(".mlp.", MOE_PREFIX), t) for name, t in tensors)
        return split_fused_experts(renamed, MIXTRAL_EXPERT_NAMES)


def parse_mixtral(cfg: Mapping[str, Any]) -> MoeConfig:
    fields = parse_common(cfg, "mixtral")
    layers = fields["num_hidden_layers"]
    fields.update(
        qkv_bias=False, o_bias=False, mlp_bias=False,
        layer_windows=layer_windows_from_types({"sliding_window": cfg.get("sliding_window")}, layers),
    )
    # Each expert is as wide as intermediate_size; there is no dense MLP.
    fields.update(parse_moe_fields({**cfg, "moe_intermediate_size": fields["intermediate_size"]}, layers,
                                   (True,) * layers, norm_topk_prob=True))
    return MoeConfig(**fields)

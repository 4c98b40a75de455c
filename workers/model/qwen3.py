"""Qwen3: Qwen2's decoder without projection biases (unless ``attention_bias``) and with an
RMSNorm over every q and k head before RoPE (``q_norm``/``k_norm``)."""
from __future__ import annotations

from typing import Any, Mapping

from .config import ModelConfig, parse_common
from .decoder import DecoderLM
from .llama import _require_mlp, qwen_layer_windows


class Qwen3ForCausalLM(DecoderLM):
    """The per-head q/k norms are PagedAttention's ``qk_norm`` option."""


def parse_qwen3(cfg: Mapping[str, Any]) -> ModelConfig:
    fields = parse_common(cfg, "qwen3")
    fields.update(mlp_bias=False, qk_norm=True,
                  layer_windows=qwen_layer_windows(cfg, fields["num_hidden_layers"]))
    return ModelConfig(**_require_mlp(fields))

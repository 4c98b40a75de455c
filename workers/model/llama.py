"""Llama, Qwen2 and Mistral: the plain decoder (``decoder.py``) with each config's biases and
sliding windows. They differ only in which projections carry biases and in which layers slide,
so one parser per model type and no model code of their own."""
from __future__ import annotations

from typing import Any, Mapping

from .config import ModelConfig, ModelConfigError, layer_windows_from_types, parse_common
from .decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    """Llama-family causal LM (Llama, Qwen2, Mistral configs)."""


def parse_llama(cfg: Mapping[str, Any]) -> ModelConfig:
    # Llama never slides, whatever sliding_window says.
    return ModelConfig(**_require_mlp(parse_common(cfg, "llama", default_window_layers=False)))


def parse_mistral(cfg: Mapping[str, Any]) -> ModelConfig:
    # Every layer slides when sliding_window is set; no biases anywhere.
    fields = parse_common(cfg, "mistral")
    fields["layer_windows"] = layer_windows_from_types({"sliding_window": cfg.get("sliding_window")},
                                                       fields["num_hidden_layers"])
    return ModelConfig(**_require_mlp({**fields, "qkv_bias": False, "o_bias": False, "mlp_bias": False}))


def parse_qwen2(cfg: Mapping[str, Any]) -> ModelConfig:
    fields = parse_common(cfg, "qwen2")
    fields.update(qkv_bias=True, o_bias=False, mlp_bias=False,
                  layer_windows=qwen_layer_windows(cfg, fields["num_hidden_layers"]))
    return ModelConfig(**_require_mlp(fields))


def qwen_layer_windows(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: the layers typed "sliding_attention" slide (derived from
    ``max_window_layers`` when ``layer_types`` is absent), and only when
    ``use_sliding_window`` is true, as the transformers classes do."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if cfg.get("layer_types") is None:
        max_window_layers = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
                 for i in range(layers)]
        cfg = {**cfg, "layer_types": types}
    return layer_windows_from_types(cfg, layers, window)


def _require_mlp(fields: dict[str, Any]) -> dict[str, Any]:
    if fields["intermediate_size"] < 1:
        raise ModelConfigError("missing required field 'intermediate_size'")
    return fields

"""Gemma 3 (text): ``Gemma3ForCausalLM``, model_type ``gemma3_text``.

What differs from the plain decoder, all through ``DecoderLM``'s hooks and config fields:

- norms scale by 1 + w (``norm_unit_offset``), including the per-head q/k norms before RoPE;
- each block's output is normalised again before its residual add (``sandwich_norms``:
  post_attention_layernorm, pre_/post_feedforward_layernorm);
- the embedding is multiplied by sqrt(hidden_size), that factor first rounded to the model dtype
  (transformers' ``Gemma3TextScaledWordEmbedding``);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``, not head_dim ** -0.5;
- local (sliding window) and global layers interleave (``layer_types``, or every
  ``sliding_window_pattern``-th layer global), each kind with its own RoPE: local layers
  ``rope_parameters["sliding_attention"]`` (formerly ``rope_local_base_freq``), global layers
  ``rope_parameters["full_attention"]`` (formerly ``rope_theta`` + ``rope_scaling``);
- GeGLU MLP (``hidden_activation`` gelu_pytorch_tanh), optional final logit soft-capping, the
  LM head tied to the embedding by default.

The window edge needs no conversion: transformers' sliding mask keeps keys with
``k > q - sliding_window``, pdserve's convention (``batch.py``).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .config import (
    ModelConfig,
    ModelConfigError,
    RopeConfig,
    layer_windows_from_types,
    parse_common,
    rope_from_params,
)
from .decoder import DecoderLM

MODEL_TYPE = "gemma3_text"
_ACT = "gelu_pytorch_tanh"
# Gemma3TextConfig's defaults where they differ from parse_common's fallbacks; a config.json
# that leaves a key out gets what transformers would use.
_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
_DEFAULT_GLOBAL_THETA = 1_000_000.0
_DEFAULT_LOCAL_THETA = 10_000.0
_DEFAULT_WINDOW = 4096
_DEFAULT_PATTERN = 6


class Gemma3ForCausalLM(DecoderLM):
    """The shared decoder with Gemma's norms and the scaled embedding; attention options
    (q/k norms, softmax scale, windows, per-layer RoPE) come from the parsed config."""

    norm_unit_offset = True
    sandwich_norms = True

    def __init__(self, config: ModelConfig, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        # transformers keeps sqrt(hidden) as an fp32 tensor cast to the weights' dtype before the
        # multiply: the same rounded factor, exactly representable in that dtype.
        # (On CPU: the model may be built under a meta-device context.)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device="cpu")
        self.embed_scale = scale.to(self.dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return super().embed(input_ids).mul_(self.embed_scale)


def parse_gemma3(cfg: Mapping[str, Any]) -> ModelConfig:
    """config.json (transformers 4 or 5 spelling of Gemma3TextConfig) -> ModelConfig."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelConfigError(
            f"attn_logit_softcapping={cfg['attn_logit_softcapping']!r} is not supported "
            "(attention-score soft-capping is Gemma 2's; Gemma 3 sets it to null)"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported (causal decoding only)")
    act = cfg.get("hidden_activation") or _ACT  # what Gemma3MLP uses; hidden_act is ignored
    if act != _ACT:
        raise ModelConfigError(f"unsupported hidden_activation {act!r} (supported: {_ACT})")
    cfg = {**_DEFAULTS, **cfg}
    # parse_common reads the sizes; RoPE, windows and the activation are Gemma's own here.
    common = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "hidden_act")}
    fields = parse_common({**common, "hidden_act": _ACT}, MODEL_TYPE, acts=(_ACT,),
                          default_window_layers=False)
    if fields["intermediate_size"] < 1:
        raise ModelConfigError("missing required field 'intermediate_size'")
    layers = fields["num_hidden_layers"]
    types = _layer_types(cfg, layers)
    window = cfg.get("sliding_window", _DEFAULT_WINDOW)
    if window is None and "sliding_attention" in types:
        raise ModelConfigError("sliding_window is null but layer_types has sliding_attention layers")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelConfigError(f"sliding_window={window!r} must be a positive integer")
    windows = layer_windows_from_types({"layer_types": types}, layers, window)

    global_rope, local_rope = _ropes(cfg, fields["max_position_embeddings"])
    sliding = [t == "sliding_attention" for t in types]
    extra: dict[str, Any] = {}
    if any(sliding):  # ropes[1] is the local one; without local layers it is never built
        extra = dict(extra_ropes=(local_rope,), layer_rope_index=tuple(int(s) for s in sliding))

    scalar = cfg.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or scalar <= 0:
        raise ModelConfigError(f"query_pre_attn_scalar={scalar!r} must be a positive number")
    cap = cfg.get("final_logit_softcapping")
    if cap is not None and (not isinstance(cap, (int, float)) or isinstance(cap, bool) or cap <= 0):
        raise ModelConfigError(f"final_logit_softcapping={cap!r} must be a positive number or null")

    fields.update(
        rope=global_rope, layer_windows=windows, mlp_bias=False, qk_norm=True,
        attn_scale=scalar**-0.5,  # the Python float transformers computes
        final_logit_softcap=None if cap is None else float(cap), **extra,
    )
    return ModelConfig(**fields)


def _layer_types(cfg: Mapping[str, Any], layers: int) -> list[str]:
    """``layer_types`` when given, else Gemma3TextConfig's derivation from the older
    ``sliding_window_pattern``: every pattern-th layer (1-based) global, the rest local."""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, (list, tuple)):
            raise ModelConfigError(f"layer_types must be a list, got {type(types).__name__}")
        return list(types)  # validated by layer_windows_from_types
    pattern = cfg.get("sliding_window_pattern", _DEFAULT_PATTERN)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise ModelConfigError(f"sliding_window_pattern={pattern!r} must be a positive integer")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _ropes(cfg: Mapping[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) RoPE as Gemma3TextConfig resolves them: ``rope_parameters`` nested by
    layer type; a transformers-4 ``rope_scaling`` applies to the global layers only; missing
    thetas come from ``rope_theta`` (global, default 1e6) and ``rope_local_base_freq`` (local,
    default 1e4). Keys of a flat (un-nested) ``rope_parameters`` are ignored, as there."""
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ModelConfigError(f"rope_parameters must be a mapping, got {type(params).__name__}")
    params = params or {}
    per_type: dict[str, dict[str, Any]] = {}
    for layer_type in ("full_attention", "sliding_attention"):
        value = params.get(layer_type)
        if value is not None and not isinstance(value, Mapping):
            raise ModelConfigError(f"rope_parameters[{layer_type!r}] must be a mapping")
        per_type[layer_type] = dict(value or {"rope_type": "default"})
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping) or any(isinstance(v, Mapping) for v in scaling.values()):
            raise ModelConfigError("rope_scaling must be a flat mapping (it applies to the global layers)")
        per_type["full_attention"].update(scaling)
    per_type["full_attention"].setdefault("rope_theta", cfg.get("rope_theta") or _DEFAULT_GLOBAL_THETA)
    per_type["sliding_attention"].setdefault(
        "rope_theta", cfg.get("rope_local_base_freq") or _DEFAULT_LOCAL_THETA
    )
    out = []
    for layer_type in ("full_attention", "sliding_attention"):
        p = per_type[layer_type]
        if cfg.get("partial_rotary_factor") is not None:
            p.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
        if p.get("rope_type", p.get("type")) == "yarn":  # transformers fills it in for yarn
            p.setdefault("original_max_position_embeddings", max_pos)
        out.append(rope_from_params(p, None, max_pos, where=f"rope_parameters[{layer_type!r}]"))
    return out[0], out[1]


def tiny_config(base: Mapping[str, Any]) -> dict[str, Any]:
    """``make-tiny-model --arch gemma3_text``: local and global layers alternating (the last of
    each pair global), a 32-token window, Gemma's local RoPE base, global base ``rope_theta``."""
    layers = int(base["num_hidden_layers"])
    return {
        "hidden_activation": _ACT,
        "hidden_act": _ACT,  # ignored by Gemma 3; written so the file does not contradict itself
        "query_pre_attn_scalar": base["head_dim"],
        "sliding_window": 32,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": _DEFAULT_LOCAL_THETA},
            "full_attention": {"rope_type": "default", "rope_theta": base["rope_theta"]},
        },
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }

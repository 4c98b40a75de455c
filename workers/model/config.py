"""Model configuration for the Llama family, parsed from a Hugging Face ``config.json`` dict.

One decoder covers Llama, Qwen2 and Mistral: they differ only in which projections carry biases,
in RoPE parameters and in sliding-window attention. Anything this decoder cannot run exactly
(another activation, another RoPE type, partial rotary embeddings, ...) is rejected here with a
``ModelConfigError`` instead of silently producing different logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# architectures entry -> model_type; config.json names either or both.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(SUPPORTED_ARCHITECTURES.values())
SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3"})


class ModelConfigError(ValueError):
    """config.json describes a model this decoder cannot run exactly."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE parameters after normalising the transformers-4 ``rope_scaling`` and the
    transformers-5 ``rope_parameters`` spellings."""

    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    qkv_bias: bool  # q_proj, k_proj and v_proj carry biases (Qwen2; Llama attention_bias)
    o_bias: bool  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool  # gate/up/down projections carry biases (Llama mlp_bias)
    tie_word_embeddings: bool
    # Per layer: attend to keys with position > query_position - window; None = full causal.
    layer_windows: tuple[int | None, ...]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        model_type = _model_type(cfg)
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu":
            raise ModelConfigError(f"unsupported hidden_act {act!r} (only 'silu' is supported)")
        hidden = _req_int(cfg, "hidden_size")
        heads = _req_int(cfg, "num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        if head_dim % 2:
            raise ModelConfigError(f"head_dim={head_dim} must be even for rotary embeddings")
        layers = _req_int(cfg, "num_hidden_layers")
        max_pos = int(cfg.get("max_position_embeddings") or 2048)

        attention_bias = bool(cfg.get("attention_bias", False))
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "mistral":
            qkv_bias, o_bias, mlp_bias = False, False, False
        else:
            qkv_bias, o_bias = attention_bias, attention_bias
            mlp_bias = bool(cfg.get("mlp_bias", False))

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),)
        )
        bos = cfg.get("bos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=_req_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req_int(cfg, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(cfg, max_pos),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_windows=_layer_windows(cfg, model_type, layers),
            bos_token_id=None if bos is None or isinstance(bos, list) else int(bos),
            eos_token_ids=eos_ids,
        )


def _req_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ModelConfigError(f"missing required field {key!r}")
    return int(value)


def _model_type(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
    model_type = cfg.get("model_type")
    if archs:
        from_arch = SUPPORTED_ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != from_arch:
            raise ModelConfigError(
                f"model_type {model_type!r} does not match architecture {archs[0]!r}"
            )
        return from_arch
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r} and no supported architecture "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return str(model_type)


def _rope_config(cfg: Mapping[str, Any], max_pos: int) -> RopeConfig:
    # transformers 5 writes everything into rope_parameters (theta included); transformers 4
    # wrote rope_theta at top level and the scaling dict as rope_scaling (key "type" or
    # "rope_type"). Merge: explicit scaling keys win over the top-level theta.
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ModelConfigError(f"{key} must be a mapping, got {type(value).__name__}")
        if any(isinstance(v, Mapping) for v in value.values()):
            raise ModelConfigError(f"per-layer-type {key} are not supported")
        params.update(value)
    theta = float(params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})"
        )
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in params:
        raise ModelConfigError(f"rope type {rope_type!r} needs a 'factor'")
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    try:
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    except KeyError as e:
        raise ModelConfigError(f"rope type 'llama3' needs {e.args[0]!r}") from None
    if high <= low:
        raise ModelConfigError("llama3 rope needs high_freq_factor > low_freq_factor")
    orig = int(params.get("original_max_position_embeddings") or max_pos)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=orig,
    )


def _layer_windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[int | None, ...]:
    """Sliding-window size per layer, following the transformers model classes exactly:
    Llama never slides; Mistral slides every layer when ``sliding_window`` is set; Qwen2 slides
    the layers typed "sliding_attention" (derived from ``max_window_layers`` when ``layer_types``
    is absent) and only when ``use_sliding_window`` is true."""
    if model_type == "llama":
        return (None,) * layers
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None and int(window) <= 0:
        raise ModelConfigError(f"sliding_window={window} must be positive")
    window = None if window is None else int(window)
    if model_type == "mistral":
        return (window,) * layers
    types = cfg.get("layer_types")
    if types is None:
        max_window_layers = int(cfg.get("max_window_layers", 28))
        types = [
            "sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
            for i in range(layers)
        ]
    if len(types) != layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    out: list[int | None] = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ModelConfigError(f"unsupported layer type {t!r}")
        out.append(window if t == "sliding_attention" else None)
    return tuple(out)

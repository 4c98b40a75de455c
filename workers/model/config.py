"""Model configuration, parsed from a Hugging Face ``config.json`` dict.

``ModelConfig`` holds what every decoder shares (sizes, RoPE, windows, the KV cache shape);
an architecture that needs more subclasses it in its own module (``registry.py`` lists them).
A config.json is parsed by ``registry.parse_config``; this module imports neither the registry
nor any family (they import it), so the model package has no import cycle.
``parse_common`` reads the shared fields; each architecture's parser adds its own and rejects
what it cannot run exactly with a ``ModelConfigError`` instead of silently producing different
logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "llama3", "yarn"})


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
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    # yarn only (transformers' _compute_yarn_parameters): the ramp between extrapolated and
    # interpolated frequencies, and the factor cos/sin are multiplied by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True
    rotary_dim: int | None = None  # None: the whole head; else the first rotary_dim dims


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
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_pytorch_tanh"
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    # Per layer: index into ``ropes``; () = every layer uses ``rope`` (ropes == (rope,)).
    layer_rope_index: tuple[int, ...] = ()
    extra_ropes: tuple[RopeConfig, ...] = ()  # ropes[1:], e.g. Gemma 3's local-layer base
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        return (self.rope, *self.extra_ropes)

    def rope_index(self, layer: int) -> int:
        return self.layer_rope_index[layer] if self.layer_rope_index else 0

    # The KV cache's shape per token and layer: ``kv_planes`` planes (2: K and V; 1: a single
    # latent, MLA) of ``cache_heads`` x ``cache_head_dim``. The pool, the transfer, the prefix
    # cache and the cost model size blocks by it, never by attention heads directly.
    @property
    def kv_planes(self) -> int:
        return 2

    @property
    def cache_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        return self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token holds across all layers."""
        return self.num_hidden_layers * self.kv_planes * self.cache_heads * self.cache_head_dim * itemsize

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def parse_common(
    cfg: Mapping[str, Any], model_type: str, *, acts: tuple[str, ...] = ("silu",),
    default_window_layers: bool = True,
) -> dict[str, Any]:
    """The fields every decoder shares, as ``ModelConfig`` keyword arguments. Projection biases
    default to Llama's keys (``attention_bias``, ``mlp_bias``); layer windows to ``layer_types``
    or the model's sliding-window keys (``default_window_layers`` False: every layer full)."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", acts[0])) or acts[0]
    if act not in acts:
        raise ModelConfigError(f"unsupported hidden_act {act!r} (supported: {', '.join(acts)})")
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
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
        () if eos is None else (int(eos),)
    )
    bos = cfg.get("bos_token_id")
    return dict(
        model_type=model_type,
        vocab_size=_req_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_config(cfg, max_pos),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_windows=(
            layer_windows_from_types(cfg, layers) if default_window_layers else (None,) * layers
        ),
        bos_token_id=None if bos is None or isinstance(bos, list) else int(bos),
        eos_token_ids=eos_ids,
        hidden_act=act,
    )


def layer_windows_from_types(
    cfg: Mapping[str, Any], layers: int, window: int | None | str = "config"
) -> tuple[int | None, ...]:
    """Per layer: the window for layers typed "sliding_attention" in ``layer_types`` (every
    layer when there is no ``layer_types``), None for "full_attention"."""
    if window == "config":
        window = cfg.get("sliding_window")
    if window is not None and int(window) <= 0:
        raise ModelConfigError(f"sliding_window={window} must be positive")
    window = None if window is None else int(window)
    types = cfg.get("layer_types")
    if types is None:
        return (window,) * layers
    if len(types) != layers:
        raise ModelConfigError(f"layer_types has {len(types)} entries for {layers} layers")
    out: list[int | None] = []
    for t in types:
        if t not in ("full_attention", "sliding_attention"):
            raise ModelConfigError(f"unsupported layer type {t!r}")
        out.append(window if t == "sliding_attention" else None)
    return tuple(out)


def _req_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise ModelConfigError(f"missing required field {key!r}")
    return int(value)


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
            raise ModelConfigError(f"per-layer-type {key} are not supported for this architecture")
        params.update(value)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = partial
    return rope_from_params(params, cfg.get("rope_theta"), max_pos)


def rope_from_params(
    params: Mapping[str, Any], default_theta: float | None, max_pos: int, *, where: str = "rope"
) -> RopeConfig:
    """One RoPE dict (transformers' rope_parameters for one layer type) -> RopeConfig."""
    theta = float(params.get("rope_theta", default_theta or 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported {where} type {rope_type!r} (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})"
        )
    partial = float(params.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor={partial} is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "yarn":
        return _yarn(params, theta, max_pos)
    if "factor" not in params:
        raise ModelConfigError(f"{where} type {rope_type!r} needs a 'factor'")
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    try:
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    except KeyError as e:
        raise ModelConfigError(f"{where} type 'llama3' needs {e.args[0]!r}") from None
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


def _yarn(params: Mapping[str, Any], theta: float, max_pos: int) -> RopeConfig:
    """YaRN as transformers computes it: ``factor`` defaults to max_pos / original, and the
    cos/sin factor to mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    given, else mscale(factor) (0.1 ln(factor) + 1)."""
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ModelConfigError("rope type 'yarn' needs 'original_max_position_embeddings'")
    orig = int(orig)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        attention_factor=float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )

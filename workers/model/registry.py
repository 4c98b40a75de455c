"""Every architecture pdserve runs: the ``architectures`` entry of config.json -> its model_type,
its config parser, its model class and how ``make-tiny-model`` writes one.

Adding an architecture is one module under ``workers/model`` (a ``DecoderLM`` subclass and a
parser) and one entry here; nothing else in the engine branches on the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .config import ModelConfig, ModelConfigError


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json "model_type"
    parse: Callable[[Mapping[str, Any]], ModelConfig]
    model_cls: type
    # make-tiny-model: extra config.json keys for a small random model of this family, given
    # the common sizes (hidden_size, num_layers, ...); see tiny_model.py.
    tiny_config: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda base: {})


def _architectures() -> dict[str, Architecture]:
    from . import deepseek_v3, llama, mixtral, qwen3, qwen3_moe
    from . import gemma3
    from . import gpt_oss

    archs = [
        Architecture("LlamaForCausalLM", "llama", llama.parse_llama, llama.LlamaForCausalLM,
                     lambda b: {"attention_bias": False, "mlp_bias": False}),
        Architecture("Qwen2ForCausalLM", "qwen2", llama.parse_qwen2, llama.LlamaForCausalLM,
                     lambda b: {"use_sliding_window": False, "sliding_window": None,
                                "max_window_layers": b["num_hidden_layers"]}),
        Architecture("MistralForCausalLM", "mistral", llama.parse_mistral, llama.LlamaForCausalLM,
                     lambda b: {"sliding_window": None}),
        Architecture("Qwen3ForCausalLM", "qwen3", qwen3.parse_qwen3, qwen3.Qwen3ForCausalLM,
                     lambda b: {"attention_bias": False, "use_sliding_window": False,
                                "sliding_window": None, "max_window_layers": b["num_hidden_layers"]}),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", qwen3_moe.parse_qwen3_moe, qwen3_moe.Qwen3MoeForCausalLM,
                     lambda b: {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                                "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                "moe_intermediate_size": b["hidden_size"] // 2, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
        Architecture("MixtralForCausalLM", "mixtral", mixtral.parse_mixtral, mixtral.MixtralForCausalLM,
                     lambda b: {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
        Architecture("DeepseekV3ForCausalLM", "deepseek_v3", deepseek_v3.parse_deepseek_v3,
                     deepseek_v3.DeepseekV3ForCausalLM, deepseek_v3.tiny_config),
        Architecture("Gemma3ForCausalLM", gemma3.MODEL_TYPE, gemma3.parse_gemma3, gemma3.Gemma3ForCausalLM,
                     gemma3.tiny_config),
        Architecture("GptOssForCausalLM", gpt_oss.MODEL_TYPE, gpt_oss.parse_gpt_oss, gpt_oss.GptOssForCausalLM,
                     gpt_oss.tiny_config),
    ]
    return {a.name: a for a in archs}


ARCHITECTURES: dict[str, Architecture] = _architectures()
BY_MODEL_TYPE: dict[str, Architecture] = {a.model_type: a for a in ARCHITECTURES.values()}
# architectures entry -> model_type (the public table the docs and errors list).
SUPPORTED_ARCHITECTURES: dict[str, str] = {a.name: a.model_type for a in ARCHITECTURES.values()}


def architecture_of(cfg: Mapping[str, Any]) -> Architecture:
    """The architecture config.json names (``architectures``, else ``model_type``)."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
            )
    model_type = cfg.get("model_type")
    if archs:
        found = ARCHITECTURES[archs[0]]
        if model_type is not None and model_type != found.model_type:
            raise ModelConfigError(f"model_type {model_type!r} does not match architecture {archs[0]!r}")
        return found
    if model_type not in BY_MODEL_TYPE:
        raise ModelConfigError(
            f"unsupported model_type {model_type!r} and no supported architecture "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return BY_MODEL_TYPE[str(model_type)]


def parse_config(cfg: Mapping[str, Any]) -> ModelConfig:
    return architecture_of(cfg).parse(cfg)


def build_model(config: ModelConfig, **kwargs: Any):
    """The model class for a parsed config (``dtype=``, ``device=`` pass through)."""
    return BY_MODEL_TYPE[config.model_type].model_cls(config, **kwargs)

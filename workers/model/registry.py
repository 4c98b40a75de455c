"""Every architecture pdserve runs: the ``architectures`` entry of config.json -> its model_type,
its config parser, its model class and how ``make-tiny-model`` writes one.

Adding an architecture is one module under ``workers/model`` (a ``DecoderLM`` subclass and a
parser) and one entry in ``_TABLE`` here; nothing else in the engine branches on the model.

The table names each family's parser and class as ``"module:attr"`` strings, imported
(``importlib``) the first time an entry's ``parse`` or ``model_cls`` is read. So this module
imports no family at module level, ``config.py`` imports neither this module nor any family,
and a family imports ``config.py`` without a way back: the model package has no import cycle
(``tests/unit/test_router_imports.py``), and parsing a Llama config loads only ``llama.py``.
Callers parse a config.json with ``parse_config``, build a model with ``build_model``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Mapping

from .config import ModelConfig, ModelConfigError

_PACKAGE = __name__.rpartition(".")[0]  # pdserve.workers.model


@cache
def resolve(ref: str) -> Any:
    """``"module:attr"`` (module relative to this package when it starts with a dot) -> the
    attribute, importing the module on first use; cached, so a lookup after the first is a dict
    read. importlib's module lock makes a first use from two threads import once."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module, _PACKAGE), attr)


@dataclass(frozen=True)
class Architecture:
    name: str  # config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
    model_type: str  # config.json "model_type"
    parser: str  # "module:attr" of its config parser, Mapping -> ModelConfig
    model_class: str  # "module:attr" of its DecoderLM subclass
    # make-tiny-model: extra config.json keys for a small random model of this family, given
    # the common sizes (hidden_size, num_layers, ...); see tiny_model.py. A function, or the
    # "module:attr" of one in the family's module.
    tiny: Callable[[dict[str, Any]], dict[str, Any]] | str = field(default=lambda base: {})

    @property
    def parse(self) -> Callable[[Mapping[str, Any]], ModelConfig]:
        return resolve(self.parser)

    @property
    def model_cls(self) -> type:
        return resolve(self.model_class)

    def tiny_config(self, base: dict[str, Any]) -> dict[str, Any]:
        tiny = resolve(self.tiny) if isinstance(self.tiny, str) else self.tiny
        return tiny(base)


def _tiny_qwen(base: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": base["num_hidden_layers"]}


def _tiny_qwen3_moe(base: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "moe_intermediate_size": base["hidden_size"] // 2, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


# model_type -> (architectures entry, parser, model class, tiny config keys). The model_type
# strings are the families' own (gemma3.MODEL_TYPE, gpt_oss.MODEL_TYPE; a test holds them equal).
_TABLE: dict[str, tuple[str, str, str, Callable[[dict[str, Any]], dict[str, Any]] | str]] = {
    "llama": ("LlamaForCausalLM", ".llama:parse_llama", ".llama:LlamaForCausalLM",
              lambda b: {"attention_bias": False, "mlp_bias": False}),
    "qwen2": ("Qwen2ForCausalLM", ".llama:parse_qwen2", ".llama:LlamaForCausalLM",
              lambda b: {"use_sliding_window": False, "sliding_window": None,
                         "max_window_layers": b["num_hidden_layers"]}),
    "mistral": ("MistralForCausalLM", ".llama:parse_mistral", ".llama:LlamaForCausalLM",
                lambda b: {"sliding_window": None}),
    "qwen3": ("Qwen3ForCausalLM", ".qwen3:parse_qwen3", ".qwen3:Qwen3ForCausalLM", _tiny_qwen),
    "qwen3_moe": ("Qwen3MoeForCausalLM", ".qwen3_moe:parse_qwen3_moe", ".qwen3_moe:Qwen3MoeForCausalLM",
                  _tiny_qwen3_moe),
    "mixtral": ("MixtralForCausalLM", ".mixtral:parse_mixtral", ".mixtral:MixtralForCausalLM",
                lambda b: {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "deepseek_v3": ("DeepseekV3ForCausalLM", ".deepseek_v3:parse_deepseek_v3",
                    ".deepseek_v3:DeepseekV3ForCausalLM", ".deepseek_v3:tiny_config"),
    "gemma3_text": ("Gemma3ForCausalLM", ".gemma3:parse_gemma3", ".gemma3:Gemma3ForCausalLM",
                    ".gemma3:tiny_config"),
    "gpt_oss": ("GptOssForCausalLM", ".gpt_oss:parse_gpt_oss", ".gpt_oss:GptOssForCausalLM",
                ".gpt_oss:tiny_config"),
}

BY_MODEL_TYPE: dict[str, Architecture] = {
    model_type: Architecture(name, model_type, parser, model_class, tiny)
    for model_type, (name, parser, model_class, tiny) in _TABLE.items()
}
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in BY_MODEL_TYPE.values()}
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
    """A config.json's ``ModelConfig``, through its architecture's own parser (which rejects
    what pdserve cannot run exactly: ``ModelConfigError``)."""
    return architecture_of(cfg).parse(cfg)


def build_model(config: ModelConfig, **kwargs: Any):
    """The model class for a parsed config (``dtype=``, ``device=`` pass through)."""
    return BY_MODEL_TYPE[config.model_type].model_cls(config, **kwargs)

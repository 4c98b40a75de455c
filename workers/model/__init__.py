"""Llama-family decoder (Llama, Qwen2, Mistral configs) with paged attention over a flat batch.

Entry points: ``ModelConfig.from_hf_dict(config_json)``, ``LlamaForCausalLM(config, dtype=,
device=)`` + ``load_weights(...)`` (or ``pdserve.workers.loader.load_model``), and
``LlamaForCausalLM.forward(input_ids, positions, seqs: list[SeqBatchInfo], kv_pool)``.
"""
from __future__ import annotations

from .batch import AttentionMetadata, SeqBatchInfo
from .config import ModelConfig, ModelConfigError, RopeConfig, SUPPORTED_ARCHITECTURES
from .llama import LlamaForCausalLM, WeightLoadError

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
    "SUPPORTED_ARCHITECTURES",
    "SeqBatchInfo",
    "WeightLoadError",
]

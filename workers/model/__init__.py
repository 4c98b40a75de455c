"""The decoders pdserve runs, with paged attention over a flat batch.

Entry points: ``ModelConfig.from_hf_dict(config_json)`` (dispatches to the architecture's
parser, ``registry.py``), ``build_model(config, dtype=, device=)`` + ``load_weights(...)`` (or
``pdserve.workers.loader.load_model``), and ``model.forward(input_ids, positions,
seqs: list[SeqBatchInfo], kv_pool)``.
"""
from __future__ import annotations

from .batch import AttentionMetadata, SeqBatchInfo
from .config import ModelConfig, ModelConfigError, RopeConfig
from .decoder import DecoderLM, WeightLoadError
from .llama import LlamaForCausalLM
from .registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, build_model

__all__ = [
    "ARCHITECTURES",
    "AttentionMetadata",
    "DecoderLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
    "SUPPORTED_ARCHITECTURES",
    "SeqBatchInfo",
    "WeightLoadError",
    "build_model",
]

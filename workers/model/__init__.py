"""The decoders pdserve runs, with paged attention over a flat batch.

Entry points: ``parse_config(config_json)`` (dispatches to the architecture's parser,
``registry.py``), ``build_model(config, dtype=, device=)`` + ``load_weights(...)`` (or
``pdserve.workers.loading.loader.load_model``), and ``model.forward(input_ids, positions,
seqs: list[SeqBatchInfo], kv_pool)``.

No family module (``llama.py``, ``qwen3.py``, ...) is imported here: the registry imports each
on first use, so importing the package loads none of them.
"""
from __future__ import annotations

from .batch import AttentionMetadata, SeqBatchInfo
from .config import ModelConfig, ModelConfigError, RopeConfig
from .decoder import DecoderLM, WeightLoadError
from .registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, build_model, parse_config

__all__ = [
    "ARCHITECTURES",
    "AttentionMetadata",
    "DecoderLM",
    "ModelConfig",
    "ModelConfigError",
    "RopeConfig",
    "SUPPORTED_ARCHITECTURES",
    "SeqBatchInfo",
    "WeightLoadError",
    "build_model",
    "parse_config",
]

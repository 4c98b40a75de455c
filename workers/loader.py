"""Load a local Hugging Face-format model directory without transformers.

Reads config.json, the weights (``model.safetensors`` or shards listed in
``model.safetensors.index.json``), ``tokenizer.json`` (through ``tokenizers``) and the EOS ids
(generation_config.json, falling back to config.json). Every failure is a ``ModelLoadError`` whose
message names the file, tensor or architecture at fault.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from .model import DecoderLM, ModelConfig, ModelConfigError, WeightLoadError, build_model

SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class ModelLoadError(ValueError):
    """The directory cannot be loaded; the message names the file or architecture at fault."""


class LoadedModel(NamedTuple):
    model: DecoderLM
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    model_dir: Path


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """None or "auto": fp32 on CPU, bf16 on CUDA. Strings name a dtype ("bf16", "float32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPE_NAMES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (use one of {', '.join(_DTYPE_NAMES)})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"missing {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        return ModelConfig.from_hf_dict(_read_json(path))
    except ModelConfigError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"missing tokenizer.json in {path.parent}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"cannot load {path}: {e}") from e


def load_eos_token_ids(model_dir: str | Path, config: ModelConfig | None = None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (int or list), else config.json's."""
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = _read_json(path).get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
    return (config or load_config(model_dir)).eos_token_ids


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights, checked to exist."""
    model_dir = Path(model_dir)
    index = model_dir / WEIGHTS_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / SINGLE_WEIGHTS).is_file():
        files = [model_dir / SINGLE_WEIGHTS]
    else:
        raise ModelLoadError(f"missing weights in {model_dir}: neither {SINGLE_WEIGHTS} nor {WEIGHTS_INDEX}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing weight shard {f.name} in {model_dir}")
    return files


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        except Exception as e:  # safetensors raises its own SafetensorError on corrupt files
            raise ModelLoadError(f"cannot read {f}: {e}") from e


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Build the model from model_dir with weights cast to ``dtype`` (default: fp32 on CPU,
    bf16 on CUDA) on ``device``, plus its tokenizer and EOS ids."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config = load_config(model_dir)
    files = weight_files(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos = load_eos_token_ids(model_dir, config)
    model = build_model(config, dtype=resolve_dtype(dtype, device), device=device)
    try:
        model.load_weights(_iter_tensors(files))
    except WeightLoadError as e:
        raise ModelLoadError(f"weights in {model_dir}: {e}") from e
    model.eval()
    return LoadedModel(model, config, tokenizer, eos, model_dir)

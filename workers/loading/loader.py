"""Load a Hugging Face-format model without transformers: a local directory, or a Hub repo id
(``ORG/NAME``, resolved through the Hub cache by ``hub.resolve_model``).

Reads config.json, the weights (``model.safetensors`` or shards listed in
``model.safetensors.index.json``, one file at a time, each tensor copied straight into its
parameter), ``tokenizer.json`` (through ``tokenizers``) and the EOS ids (generation_config.json,
falling back to config.json). Every failure is a ``ModelLoadError`` whose message names the
file, tensor or architecture at fault.

Before any weight is read, ``check_memory`` compares what the weights (sized from the
safetensors headers, at the dtype they will have) and the KV pool need with what the device
has, so a model that cannot fit fails at once with the numbers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from pdserve.workers.loading.hub import ModelResolveError, check_supported_options, resolve_model
from pdserve.workers.model.parallel import TensorParallel
from pdserve.workers.model.weights import LazyTensor
from pdserve.workers.model import DecoderLM, ModelConfig, ModelConfigError, WeightLoadError, build_model, parse_config

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


# Bytes per element of each safetensors dtype, and which of them are floating point (those
# are loaded at the model dtype; the rest keep their own size).
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
                "BOOL": 1}
_ST_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# Without a gpu_memory_utilization-style option in EngineConfig: the share of a GPU's memory
# the weights and the KV pool may take (vLLM's default); the rest is for activations and CUDA.
GPU_MEMORY_FRACTION = 0.9


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str,
                  stored: torch.dtype | None = None) -> torch.dtype:
    """None or "auto": the checkpoint's own dtype (``stored``, from config.json) when it is
    float32, bfloat16 or float16, except that float32 runs as bfloat16 on CUDA (as vLLM does);
    without one, fp32 on CPU and bf16 on CUDA. Strings name a dtype ("bf16", "float32", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        cuda = torch.device(device).type == "cuda"
        if stored in (torch.bfloat16, torch.float16):
            return stored
        return torch.bfloat16 if cuda else torch.float32
    try:
        return _DTYPE_NAMES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (use one of {', '.join(_DTYPE_NAMES)})") from None


def stored_dtype(model_dir: str | Path) -> torch.dtype | None:
    """The dtype config.json says the checkpoint holds (``torch_dtype``, or transformers 5's
    ``dtype``), when it is one pdserve runs; None otherwise."""
    raw = _read_json(Path(model_dir) / "config.json")
    name = raw.get("dtype") or raw.get("torch_dtype")
    if not isinstance(name, str):
        return None
    found = _DTYPE_NAMES.get(name.lower().removeprefix("torch."))
    return found if found in (torch.float32, torch.bfloat16, torch.float16) else None


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """The local directory for ``model``: itself, or the Hub cache's snapshot of the repo id it
    names (downloaded unless HF_HUB_OFFLINE forbids it)."""
    try:
        return resolve_model(model).path
    except ModelResolveError as e:
        raise ModelLoadError(str(e)) from None


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
        return parse_config(_read_json(path))
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


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, LazyTensor]]:
    """Each tensor as stored, one file open at a time, as a ``LazyTensor``: nothing is read
    until the model asks for its rank's region of it, which the caller copies into its
    parameter before the next (safetensors maps the file)."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    yield name, LazyTensor.of(sf.get_slice(name))
        except Exception as e:  # safetensors raises its own SafetensorError on corrupt files
            raise ModelLoadError(f"cannot read {f}: {e}") from e


def checkpoint_bytes(model_dir: str | Path, dtype: torch.dtype, config: ModelConfig | None = None) -> int:
    """Bytes the weights take once loaded at ``dtype``, from the safetensors headers alone (no
    tensor is read). Floating tensors count at ``dtype``, others at their own size; tensors the
    loader skips (a tied LM head, rotary inv_freq) do not count."""
    model_dir = Path(model_dir)
    tied = (config or load_config(model_dir)).tie_word_embeddings
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for f in weight_files(model_dir):
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                        continue
                    piece = sf.get_slice(name)
                    numel = 1
                    for dim in piece.get_shape():
                        numel *= int(dim)
                    kind = piece.get_dtype()
                    if kind == "U8" and name.endswith(("_blocks", "_scales")):
                        # MXFP4 (gpt-oss experts): dequantised at load, two values per block
                        # byte; the scales are folded in and not kept.
                        total += 2 * numel * itemsize if name.endswith("_blocks") else 0
                        continue
                    total += numel * (itemsize if kind in _ST_FLOATS else _ST_ITEMSIZE.get(kind, itemsize))
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read the header of {f}: {e}") from e
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def _cpu_available() -> int | None:
    """MemAvailable from /proc/meminfo, lowered to the room left under this process's cgroup
    limit when there is one (a container's MemAvailable is the host's); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return avail


def memory_budget(device: torch.device | str) -> tuple[int, str] | None:
    """(bytes the weights and the KV pool may take on ``device``, where that figure comes
    from), or None where it cannot be known. CUDA: GPU_MEMORY_FRACTION of the total, at most
    what is free; CPU: MemAvailable (within the cgroup's limit)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        budget = min(int(total * GPU_MEMORY_FRACTION), int(free))
        return budget, (f"{dev} ({GPU_MEMORY_FRACTION:g} of its {_gib(total)}, "
                        f"with {_gib(free)} free)")
    if dev.type == "cpu":
        avail = _cpu_available()
        return None if avail is None else (avail, "cpu (MemAvailable)")
    return None


def check_memory(weight_bytes: int, kv_cache_bytes: int, dtype: torch.dtype,
                 device: torch.device | str, budget: tuple[int, str] | None = None) -> None:
    """Raise ``ModelLoadError`` with the numbers when the weights and the KV pool do not fit
    ``budget`` (default: ``memory_budget(device)``; unknown: no check)."""
    budget = memory_budget(device) if budget is None else budget
    if budget is None:
        return
    room, where = budget
    if weight_bytes + kv_cache_bytes > room:
        smaller = "a smaller dtype (--dtype bfloat16), " if dtype == torch.float32 else ""
        raise ModelLoadError(
            f"weights need {_gib(weight_bytes)} ({str(dtype).removeprefix('torch.')}) and the KV "
            f"cache {_gib(kv_cache_bytes)}, but only {_gib(room)} is available on {where}: use "
            f"{smaller}a smaller KV pool (--num-kv-blocks, --kv-cache-memory-bytes) or a "
            "device with more memory")


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
    tp: TensorParallel | None = None,
) -> LoadedModel:
    """Build the model from ``model_dir`` (a local directory or a Hub repo id ``ORG/NAME``) on
    ``device`` with weights at ``dtype`` (default "auto": the checkpoint's own bfloat16 or
    float16, else fp32 on CPU and bf16 on CUDA), plus its tokenizer and EOS ids. ``revision``,
    a separate ``tokenizer`` and ``trust_remote_code`` are refused (ValueError), not ignored.
    ``tp``: build and read only this tensor-parallel rank's shard of every weight."""
    check_supported_options(model_dir, revision=revision, tokenizer=tokenizer,
                            trust_remote_code=trust_remote_code)
    model_dir = resolve_model_dir(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config = load_config(model_dir)
    files = weight_files(model_dir)
    tokenizer_ = load_tokenizer(model_dir)
    eos = load_eos_token_ids(model_dir, config)
    target = resolve_dtype(dtype, device, stored_dtype(model_dir))
    model = build_model(config, dtype=target, device=device, **({} if tp is None else {"tp": tp}))
    try:
        model.load_weights(_iter_tensors(files))
    except WeightLoadError as e:
        raise ModelLoadError(f"weights in {model_dir}: {e}") from e
    model.eval()
    return LoadedModel(model, config, tokenizer_, eos, model_dir)

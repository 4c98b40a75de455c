"""Engine configuration: the scheduler's knobs and the runtime's, shared by `LLM`, the workers
and `pdserve launch` (docs/design.md section 11, "Public interfaces")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.scheduler import CapacitySchedulerPolicy, ContextChunkingPolicy


_DTYPE_ALIASES = {"auto": "auto", "float32": "float32", "float": "float32", "fp32": "float32",
                  "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float16": "float16", "half": "float16", "fp16": "float16"}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    tokens_per_block: int = 16
    num_kv_blocks: int | None = None  # or kv_cache_memory_bytes; default: enough for the batch
    kv_cache_memory_bytes: int | None = None
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
    context_chunking_policy: ContextChunkingPolicy | None = None  # None: chunking off
    chunk_unit_size: int = 64
    enable_block_reuse: bool = True
    enable_prefix_aware_scheduling: bool = True
    max_input_len: int | None = None  # default: max_seq_len - 1
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    # None or "auto": the checkpoint's bfloat16/float16 (config.json), else float32 on CPU and
    # bfloat16 on CUDA (a float32 checkpoint runs as bfloat16 there, as in vLLM)
    dtype: str | None = None
    device: str | None = None  # default: cuda when available, else cpu
    # vLLM's flag: True runs every step eagerly; False (default) replays decode-only steps as
    # CUDA graphs on CUDA (workers/model/cuda_graphs.py). No effect on CPU.
    enforce_eager: bool = False
    # CPU intra-op threads by step size: a step of fewer than small_step_tokens tokens (decode
    # batches) runs on small_step_threads torch threads, a larger one (prefill chunks) on all the
    # process has. None (default): every step on all. "auto": measured per step size
    # (workers/runner/step_threads.py: 1, 2, 4 ... all, the fastest median). An integer: that many.
    # Decode steps of a few sequences are bound by memory bandwidth, where more threads gain
    # little and, on a machine whose other cores serve the router and the HTTP clients,
    # straggle (docs/benchmarks.md section 20). `pdserve launch --torch-threads auto` sets "auto".
    small_step_threads: int | str | None = None
    small_step_tokens: int = 64
    # Worker groups (vLLM's names): the ranks one model is split over (one process per rank,
    # workers/runner/group.py), and MoE experts split whole over them instead of by width.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # The deadline of every collective and of a rank's wait for its group (seconds).
    group_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.capacity_scheduler_policy, str):
            object.__setattr__(
                self, "capacity_scheduler_policy",
                _enum(CapacitySchedulerPolicy, self.capacity_scheduler_policy, "capacity_scheduler_policy"),
            )
        if isinstance(self.context_chunking_policy, str):
            value = self.context_chunking_policy
            object.__setattr__(
                self, "context_chunking_policy",
                None if value.upper() in ("", "NONE", "OFF")
                else _enum(ContextChunkingPolicy, value, "context_chunking_policy"),
            )
        for name in ("max_batch_size", "max_num_tokens", "tokens_per_block", "chunk_unit_size",
                     "small_step_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        small = self.small_step_threads
        if isinstance(small, str):  # from a flag or a YAML file: auto, off/none, or a count
            word = small.strip().lower()
            if word in ("none", "off", ""):
                small = None
            elif word != "auto":
                try:
                    small = int(word)
                except ValueError:
                    raise ValueError(f"small_step_threads must be a positive integer, auto or "
                                     f"off, got {self.small_step_threads!r}") from None
            else:
                small = "auto"
            object.__setattr__(self, "small_step_threads", small)
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_input_len", "max_seq_len",
                     "small_step_threads"):
            if name == "small_step_threads" and self.small_step_threads == "auto":
                continue
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got {self.enable_expert_parallel!r}")
        if not isinstance(self.group_timeout_s, (int, float)) or not self.group_timeout_s > 0:
            raise ValueError(f"group_timeout_s must be a positive number of seconds, got {self.group_timeout_s!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.dtype is not None:  # vLLM's spellings too; kept canonical for the workers
            canonical = _DTYPE_ALIASES.get(str(self.dtype).lower())
            if canonical is None:
                raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
            object.__setattr__(self, "dtype", canonical)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.name if hasattr(value, "name") else value
        return out


def _enum(enum_cls, value: str, field: str):
    try:
        return enum_cls[value.upper()]
    except KeyError:
        choices = ", ".join(m.name for m in enum_cls)
        raise ValueError(f"{field} must be one of {choices}, got {value!r}") from None


def auto_threads(node_cpus: int, workers_on_node: int) -> int:
    """--torch-threads auto: the node's CPUs (the machine's, not Ray's logical count) shared
    evenly by the pdserve workers on it, at least one each."""
    return max(1, node_cpus // max(1, workers_on_node))

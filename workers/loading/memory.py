"""A worker's memory plan: the KV pool's size and the check that the weights and the pool fit
the device, made once, before any weight is read.

``plan_memory`` is the one place that sizes a pool (``num_kv_blocks``, else as many blocks as
``kv_cache_memory_bytes`` holds, else a full batch of sequences within a default cap) and
compares weights + pool against what the device offers (``loader.memory_budget``); the engine
builder allocates exactly the plan's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.config import EngineConfig
from pdserve.workers.loading.loader import (check_memory, checkpoint_bytes, load_config,
                                          resolve_dtype, stored_dtype)
from pdserve.workers.model import ModelConfig
from pdserve.workers.model.parallel import TensorParallel, rank_cache_heads

# Default pool when neither num_kv_blocks nor kv_cache_memory_bytes is given: room for a full
# batch of sequences of up to this many tokens, within the memory cap below.
DEFAULT_TOKENS_PER_SEQ = 2048
DEFAULT_KV_MEMORY_CAP = 2 << 30


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """``kv_blocks``: the blocks the scheduler hands out; ``scratch_blocks``: pool blocks
    outside it (a sliding-window pool's scratch block). ``weight_bytes`` None: the weights were
    loaded already, so only the pool was sized."""

    dtype: torch.dtype
    kv_blocks: int
    scratch_blocks: int
    bytes_per_block: int
    weight_bytes: int | None

    @property
    def pool_blocks(self) -> int:
        return self.kv_blocks + self.scratch_blocks

    @property
    def kv_bytes(self) -> int:
        return self.pool_blocks * self.bytes_per_block


def sliding_window_of(mcfg: ModelConfig) -> int | None:
    """The window W when every layer attends to the last W keys only (Mistral, Mixtral, Qwen2/3
    with every layer sliding): then a sequence's KV blocks can leave the pool as the window
    passes them. None when any layer attends to the whole history (it needs every block)."""
    windows = set(mcfg.layer_windows)
    return windows.pop() if len(windows) == 1 and None not in windows else None


def scratch_blocks(mcfg: ModelConfig) -> int:
    """Pool blocks outside the KV manager: a sliding-window pool's scratch block."""
    return 1 if sliding_window_of(mcfg) is not None else 0


def kv_blocks_for(config: EngineConfig, mcfg: ModelConfig, bytes_per_block: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory_bytes
    if budget is None:
        B = config.tokens_per_block
        max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
        want = config.max_batch_size * -(-min(max_seq_len, DEFAULT_TOKENS_PER_SEQ) // B)
        budget = min(DEFAULT_KV_MEMORY_CAP, want * bytes_per_block)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {bytes_per_block} bytes")
    return num_blocks


def plan_memory(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype,
                device: torch.device | str, *, model_dir: str | Path | None = None,
                scratch_blocks: int = 0, budget: tuple[int, str] | None = None,
                check: bool = True, tp: TensorParallel | None = None) -> MemoryPlan:
    """The pool for ``mcfg`` at ``dtype``, and, with ``model_dir`` (weights still on disk),
    the check that weights + pool fit ``device`` (``ModelLoadError`` with the numbers when they
    do not; ``budget``: the room to check against instead of the device's own; ``check``
    False: only the figures, for a launch that sums a node's workers itself).

    ``tp``: one tensor-parallel rank's plan: its share of the KV heads per block (every rank
    has the same number of blocks: the KV manager's block ids are the group's) and the bytes of
    its own weight shards (kv_cache_memory_bytes is then per rank, as vLLM's is per GPU)."""
    heads = mcfg.cache_heads if tp is None else rank_cache_heads(mcfg, tp)
    per_block = KVPool.bytes_per_block_for(mcfg.num_hidden_layers, config.tokens_per_block,
                                           heads, mcfg.cache_head_dim, dtype, mcfg.kv_planes)
    weights = None
    if model_dir is not None:
        weights = (checkpoint_bytes(model_dir, dtype, mcfg) if tp is None or tp.size == 1
                   else rank_weight_bytes(mcfg, dtype, tp))
    plan = MemoryPlan(dtype, kv_blocks_for(config, mcfg, per_block), scratch_blocks, per_block, weights)
    if check and plan.weight_bytes is not None:
        check_memory(plan.weight_bytes, plan.kv_bytes, dtype, device, budget)
    return plan


def rank_weight_bytes(mcfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> int:
    """Bytes of one tensor-parallel rank's parameters at ``dtype``: the model built on the
    meta device for that rank (no memory, no weights read), each storage counted once (a tied
    LM head is the embedding)."""
    from pdserve.workers.model import build_model

    with torch.device("meta"):
        model = build_model(mcfg, dtype=dtype, device="meta", tp=tp)
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def plan_model_dir(model_dir: str | Path, config: EngineConfig, device: str, *,
                   check: bool = True, tp: TensorParallel | None = None) -> MemoryPlan:
    """The plan of a worker that loads ``model_dir`` (a local directory) with ``config`` on
    ``device``, from config.json and the safetensors headers alone: what the engine builder
    checks before reading a weight, and what a launch sums over the workers it places on one
    node (cluster/node_memory.py)."""
    mcfg = load_config(model_dir)
    dtype = resolve_dtype(config.dtype, device, stored_dtype(model_dir))
    if tp is None and config.tensor_parallel_size > 1:  # rank 0's plan (every rank's is alike)
        tp = TensorParallel(0, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel)
    return plan_memory(config, mcfg, dtype, device, model_dir=model_dir,
                       scratch_blocks=scratch_blocks(mcfg), check=check, tp=tp)

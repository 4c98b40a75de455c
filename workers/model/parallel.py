"""Tensor parallelism inside one worker: which slice of every weight a rank holds, and the
collectives of the forward.

A worker group of ``size`` ranks runs one model; rank r holds (Megatron's split, as vLLM does):

- attention: query heads [r * h / size, (r + 1) * h / size); KV heads split the same way while
  there are at least ``size`` of them, else each KV head replicated over ``size / kv_heads``
  consecutive ranks (rank r holds head r // (size / kv_heads), the one its query heads use);
  ``transport/tp_map.py`` states the same rule for the KV transfer, and a test holds them equal;
- MLP: a column slice of gate/up and the matching row slice of down (one all-reduce after down);
- the attention output projection: the columns of the rank's heads (one all-reduce after it);
- MoE experts (moe.py): every expert's width split as the MLP's, or with ``expert_parallel``
  whole experts [r * E / size, (r + 1) * E / size); the router replicated; one all-reduce;
- embedding and LM head: a vocabulary slice of ceil(V / size) rows (vocab-parallel; the last
  rank's slice may run past V, its extra rows stay zero and are cut from the gathered logits).

A bias after an all-reduce is added by rank 0 only, so the sum counts it once. Rank 0 of a size-1
group (``SINGLE``) runs no collective at all: the model is exactly the unsharded one.

Every collective waits at most the group's timeout (the gloo/NCCL group is built with one), so a
rank whose peer died raises instead of waiting forever (docs/design.md, worker groups). A CPU
group's collectives go through shared memory (``shm``, shm_group.py: same deadline, a dead peer
noticed within 0.1 s) for the tensors that fit its slots, through gloo for the rest.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch


class TPShapeError(ValueError):
    """A tensor-parallel size that cannot split the model; the message names the numbers."""


class Shard(NamedTuple):
    """Checkpoint tensor -> ``target``: the rows [start, stop) of the tensor's dim ``dim``
    (of size ``full`` in the checkpoint) fill ``target`` (``target.shape[dim]`` may exceed
    stop - start only for the padded last vocabulary slice; the extra rows stay zero)."""

    target: torch.Tensor
    dim: int
    start: int
    stop: int
    full: int

    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.target.shape)
        shape[self.dim] = self.full
        return tuple(shape)


class TensorParallel:
    """One rank's place in its worker group and the group's collectives."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None, *, expert_parallel: bool = False,
                 shm: Any = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise TPShapeError(f"rank {rank} is not in a tensor-parallel group of size {size}")
        self.rank = rank
        self.size = size
        self.group = group
        self.shm = shm  # a ShmCollectives (CPU groups), or None: gloo/NCCL only
        # MoE experts: split whole experts over the ranks (True, vLLM's --enable-expert-parallel)
        # or every expert's width (False, the default).
        self.expert_parallel = expert_parallel
        # Time spent in this rank's collectives (waiting for the slowest rank included), for
        # the benchmarks' "all-reduce share of a step".
        self.comm_seconds = 0.0
        self.comm_calls = 0

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, expert_parallel={self.expert_parallel})"

    # ----------------------------------------------------------------- splits

    def split(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of ``n`` items (``what`` names them)."""
        if n % self.size:
            raise TPShapeError(f"tensor parallel size {self.size} does not divide {n} {what}")
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of the global KV heads this rank holds (replicated when size > heads)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "KV heads")
        if self.size % num_kv_heads:
            raise TPShapeError(f"{num_kv_heads} KV heads cannot be replicated evenly over tensor parallel "
                               f"size {self.size} (the size must be a multiple of the KV heads)")
        head = self.rank // (self.size // num_kv_heads)
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary rows; every slice has vocab_rows() rows, the
        last one possibly fewer real ones (stop is capped at the vocabulary)."""
        per = self.vocab_rows(vocab_size)
        start = min(self.rank * per, vocab_size)
        return start, min(start + per, vocab_size)

    def vocab_rows(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def shard(self, target: torch.Tensor, dim: int, start: int, stop: int, full: int) -> torch.Tensor | Shard:
        """A weight-target entry: the whole tensor when unsharded, else a Shard."""
        if self.size == 1 and (start, stop) == (0, full) and target.shape[dim] == full:
            return target
        return Shard(target, dim, start, stop, full)

    # ----------------------------------------------------------------- collectives

    def _pg(self) -> Any:
        if self.group is None:
            raise TPShapeError(f"{self!r} has no process group (a layout for planning only)")
        return self.group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (x must be contiguous: gloo sends only those). The
        wait ends at the group's timeout: a dead peer raises here, never hangs."""
        if self.size > 1:
            t0 = time.perf_counter()
            if self.shm is None or not self.shm.all_reduce(x):
                self._pg().allreduce([x]).wait()
            self.comm_seconds += time.perf_counter() - t0
            self.comm_calls += 1
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's [rows, vocab_rows] logits -> [rows, vocab_size] on every rank."""
        if self.size == 1:
            return local
        local = local.contiguous()
        t0 = time.perf_counter()
        full = self.shm.all_gather(local) if self.shm is not None else None
        if full is None:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            self._pg().allgather([parts], [local]).wait()
            full = torch.cat(parts, dim=-1)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return full[..., :vocab_size]


SINGLE = TensorParallel()


def rank_cache_heads(config: Any, tp: TensorParallel) -> int:
    """How many of the KV cache's heads a rank's pool holds (``config.cache_heads`` split or
    replicated by the KV-head rule; an MLA latent, one "head", is on every rank)."""
    start, stop = tp.kv_heads(config.cache_heads)
    return stop - start

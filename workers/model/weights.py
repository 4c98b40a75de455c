"""Checkpoint tensors read lazily, so a tensor-parallel rank reads only its shard.

The loader yields a ``LazyTensor`` per checkpoint name: its shape and dtype come from the
safetensors header, and ``narrow``/``select`` only record a region. ``load()`` reads that region
and nothing else (safetensors' ``get_slice`` maps the file and copies the rows asked for). A
family whose ``convert_weights`` must see a whole tensor (a dequantisation, a permutation across
a dimension that is split) calls ``materialize``; every other tensor reaches its parameter as
the rank's slice only.
"""
from __future__ import annotations

from typing import Any, Union

import torch

from .parallel import Shard


# safetensors' dtype names -> torch's (what a region is read as: the stored dtype, never cast).
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool,
                       "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None)}


class LazyTensor:
    """A region of one safetensors tensor: per dimension [start, stop), with ``dropped``
    dimensions selected away (an index, not a range)."""

    def __init__(self, handle: Any, shape: tuple[int, ...], dtype: torch.dtype | None = None,
                 ranges: tuple[tuple[int, int], ...] | None = None, dropped: frozenset[int] = frozenset()) -> None:
        self._handle = handle  # safetensors PySafeSlice
        self._base_shape = tuple(int(s) for s in shape)
        self._ranges = ranges if ranges is not None else tuple((0, s) for s in self._base_shape)
        self._dropped = dropped
        self.dtype = dtype

    @classmethod
    def of(cls, handle: Any) -> LazyTensor:
        return cls(handle, tuple(handle.get_shape()), _SAFETENSORS_DTYPES.get(handle.get_dtype()))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for i, (a, b) in enumerate(self._ranges) if i not in self._dropped)

    def dim(self) -> int:
        return len(self.shape)

    def _base_dim(self, dim: int) -> int:
        kept = [i for i in range(len(self._ranges)) if i not in self._dropped]
        return kept[dim if dim >= 0 else dim + len(kept)]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        d = self._base_dim(dim)
        a, b = self._ranges[d]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside a dimension of {b - a}")
        ranges = tuple((a + start, a + start + length) if i == d else r for i, r in enumerate(self._ranges))
        return LazyTensor(self._handle, self._base_shape, self.dtype, ranges, self._dropped)

    def select(self, dim: int, index: int) -> LazyTensor:
        d = self._base_dim(dim)
        narrowed = self.narrow(dim, index, 1)
        return LazyTensor(self._handle, self._base_shape, self.dtype, narrowed._ranges, self._dropped | {d})

    def __getitem__(self, index: int) -> LazyTensor:
        if not isinstance(index, int):
            raise TypeError("a LazyTensor is indexed by one int (its first dimension)")
        return self.select(0, index)

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyTensor, ...]:
        n = self.shape[dim]
        if n % chunks:
            raise ValueError(f"cannot chunk a dimension of {n} into {chunks} equal parts")
        k = n // chunks
        return tuple(self.narrow(dim, i * k, k) for i in range(chunks))

    def load(self) -> torch.Tensor:
        """Read the region (only it) from the file."""
        region = self._handle[tuple(slice(a, b) for a, b in self._ranges)]
        if self._dropped:
            region = region.reshape(self.shape)
        return region


WeightSource = Union[torch.Tensor, LazyTensor]


def materialize(t: WeightSource) -> torch.Tensor:
    """The whole (remaining) tensor in memory."""
    return t.load() if isinstance(t, LazyTensor) else t


def read_shard(source: WeightSource, shard: Shard) -> torch.Tensor:
    """The rows [shard.start, shard.stop) of ``source``'s dim ``shard.dim``, read alone."""
    return materialize(source.narrow(shard.dim, shard.start, shard.stop - shard.start))

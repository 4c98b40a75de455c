"""CUDA graphs for decode steps: one graph per (batch size, block-table width) bucket, replayed
instead of launching every kernel of the step from Python.

A decode step with n sequences runs as the graph of the smallest captured batch size N >= n and
the smallest width W >= its longest block table (powers of two up to the model length). The
graph reads fixed buffers: token ids, positions, KV slots and block tables [N, W], written from
the host before each replay; its metadata (gather rows, masks) is computed on the device inside
the graph (``batch.static_decode_metadata``), so nothing in it depends on the step's values.

Padding rows repeat the last real sequence (same token, position, slot and table): they write
the same K/V to the same slot as that row, so the pool is unchanged by them, and their logits
are dropped. Each row attends exactly its own keys (masks), so a padded step's real rows equal
the eager step's up to the order of float sums.

Graphs are captured lazily, the first time a bucket is met: one eager warm-up run (first-use
allocations), then the capture on a side stream. Every buffer a graph writes comes from the
graphs' own memory pool, the scratch workspace included (a fresh one per capture): a buffer
allocated outside and later freed or regrown would leave the graph writing into memory the
allocator has given to something else (seen on an H200 as an illegal memory access). All graphs
share the pool; they are independent (inputs in the static buffers, each its own held output)
and never replayed concurrently, which is what sharing needs.

``capture=False`` runs the same fixed-shape path eagerly with no graph: tests check on the CPU
that bucketing, padding and the device-side metadata give the eager step's logits; only the
capture itself needs CUDA.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from .attention import Workspace
from .batch import AttentionMetadata, SeqBatchInfo, static_decode_metadata
from .config import ModelConfig

if TYPE_CHECKING:
    from pdserve.transport.kv_pool import KVPool

log = logging.getLogger(__name__)

# Fixed columns of the host -> device input row; the block table follows them.
_ID, _POS, _SLOT = 0, 1, 2
_COLS = 3


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 8 up to max_batch (vLLM's
    spacing: padding wastes at most 7 rows above 8), and max_batch itself."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sizes + [max_batch]


def width_buckets(max_blocks: int) -> list[int]:
    """Captured block-table widths: powers of two below max_blocks, and max_blocks."""
    widths, w = [], 1
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return widths + [max_blocks]


def _bucket(buckets: Sequence[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} is above the largest bucket {buckets[-1]}")


class GraphedModel(Protocol):
    """What the graphs read and run of a model (``decoder.DecoderLM`` is one; it builds its
    ``DecodeGraphs``, so this module names no decoder class and the two import no cycle)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def attention_backend(self) -> str: ...

    def run_layers(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: KVPool,
                   workspace: Workspace) -> torch.Tensor: ...


class DecodeGraphs:
    """The decode-step graphs of one model over one KV pool (see the module docstring)."""

    def __init__(self, model: GraphedModel, kv_pool: KVPool, *, max_batch: int, max_blocks: int,
                 capture: bool = True) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError("max_batch and max_blocks must be >= 1")
        if capture and kv_pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.device = kv_pool.device
        # One host-filled buffer: rows of [id, position, slot, table...]; a (N, W) step views its
        # first N * (3 + W) entries as [N, 3 + W] (contiguous, so the copy from the pinned twin is
        # one transfer). The graphs read these views, so the buffer is never reallocated.
        size = max_batch * (_COLS + max_blocks)
        self.inputs = torch.zeros(size, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        # The last host -> device copy: the pinned buffer is rewritten only once it has been read.
        self._copied = torch.cuda.Event() if cuda else None
        self.workspace = Workspace()  # the uncaptured path's (capture=False)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor]] = {}
        self._pool = None  # the graphs' shared memory pool, from the first capture
        self.replays = 0

    def supports(self, seqs: Sequence[SeqBatchInfo], kv_pool: KVPool) -> bool:
        """Whether this step can run as a graph: decode tokens only, the pool the graphs were made
        for, no more sequences and no longer tables than captured, every table long enough."""
        if kv_pool is not self.kv_pool or not seqs or len(seqs) > self.max_batch:
            return False
        B = kv_pool.tokens_per_block
        for s in seqs:
            nb = s.past_len // B + 1
            # A malformed step (table too short) goes the eager way, whose metadata says why.
            if s.num_new_tokens != 1 or nb > self.max_blocks or len(s.block_table) < nb:
                return False
        return True

    def run(self, input_ids: torch.Tensor, seqs: Sequence[SeqBatchInfo]) -> torch.Tensor:
        """fp32 logits [len(seqs), V] of the decode step (what ``DecoderLM.forward`` returns)."""
        n = len(seqs)
        B = self.kv_pool.tokens_per_block
        width = max(s.past_len // B + 1 for s in seqs)
        N, W = _bucket(self.batch_sizes, n), _bucket(self.widths, width)
        rows = []
        for i in range(N):
            s = seqs[min(i, n - 1)]  # padding repeats the last sequence
            pos = s.past_len
            nb = pos // B + 1
            table = list(s.block_table[:nb])
            # The id column first holds the token's row in input_ids; the gather below turns it
            # into the id on the device (no device -> host read of the ids).
            rows.append([s.start, pos, table[-1] * B + pos % B, *table, *[table[0]] * (W - nb)])
        count = N * (_COLS + W)
        if self._copied is not None:
            self._copied.synchronize()
        self._host[:count].copy_(torch.tensor(rows, dtype=torch.long).view(-1))
        self.inputs[:count].copy_(self._host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        id_column = self.inputs[:count].view(N, _COLS + W)[:, _ID]
        id_column.copy_(input_ids.index_select(0, id_column))
        graph, out = self.graphs.get((N, W)) or self._make(N, W)
        if graph is None:
            out = self._step(N, W, self.workspace)  # capture=False: the same fixed-shape step, eagerly
        else:
            graph.replay()
        self.replays += 1
        return out[:n].clone()

    def _step(self, N: int, W: int, workspace: Workspace) -> torch.Tensor:
        """The fixed-shape decode step over the static inputs (what a graph captures)."""
        model, pool = self.model, self.kv_pool
        inputs = self.inputs[:N * (_COLS + W)].view(N, _COLS + W)
        meta = static_decode_metadata(
            inputs[:, _POS], inputs[:, _SLOT], inputs[:, _COLS:_COLS + W], pool.tokens_per_block,
            pool.num_blocks, model.config.layer_windows, model.dtype, pool.num_planes,
            paged=model.attention_backend == "paged")
        return model.run_layers(inputs[:, _ID], meta, pool, workspace)

    def _make(self, N: int, W: int) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor]:
        if not self.capture:
            entry = (None, torch.empty(0))
            self.graphs[(N, W)] = entry
            return entry
        # Warm-up outside the graph (first-use allocations, the workspace's size), then capture
        # on a side stream as torch.cuda.graph does. The inputs hold this step's real rows: the
        # warm-up writes the same K/V the replay will, so running it is harmless.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(N, W, Workspace())
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: another thread's CUDA work (a KV transfer) does not break the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._step(N, W, Workspace())  # scratch allocated in (and kept by) the graph pool
        self.graphs[(N, W)] = (graph, out)
        log.debug("captured the decode graph for batch %d, width %d blocks", N, W)
        return graph, out

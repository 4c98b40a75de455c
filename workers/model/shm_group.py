"""A CPU worker group's collectives through shared memory (csrc/shm_collectives.cpp) instead of
gloo over TCP loopback: one all-reduce of a decode activation took ~1.3 ms through gloo on the
2-core VM, most of a TP 2 decode step.

``ShmCollectives.open`` runs on every rank of a group (after its gloo group is up) and returns
on every rank either a usable group or None (then the group uses gloo alone):

1. rank 0 creates the segment ``/dev/shm/pdserve-tp-<pid>-<random>`` (or decides against it:
   ``PDSERVE_TP_SHM=0``, no compiled kernels, no room) and publishes its name, "" for none,
   through the group's store; rank 0 decides for the group, so ranks never disagree on it;
2. every rank maps it and counts itself in, mapped or failed; the last to arrive unlinks the
   name, so the segment lives only as long as some rank's mapping (a killed rank leaves
   nothing); rank 0 also removes segments left by dead rank-0 processes of earlier groups;
3. the group uses shared memory only when every rank mapped it.

``all_reduce``/``all_gather`` take contiguous CPU tensors of float32, bfloat16 or float16 that
fit a slot (``PDSERVE_TP_SHM_SLOT_MB``, default 4 MiB: a decode step's activations and vocab
logits); ``TensorParallel`` sends the rest through gloo. The choice depends only on the tensor's
shape, dtype and layout, which every rank shares, so all ranks take the same path.
"""
from __future__ import annotations

import datetime
import logging
import os
import secrets
import weakref
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("pdserve.shm_group")

ENV_ENABLE = "PDSERVE_TP_SHM"
ENV_SLOT_MB = "PDSERVE_TP_SHM_SLOT_MB"
SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-tp-"
DEFAULT_SLOT_BYTES = 4 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "").strip().lower() not in ("0", "false", "no", "off")


def slot_bytes() -> int:
    mb = os.environ.get(ENV_SLOT_MB, "").strip()
    return int(float(mb) * (1 << 20)) if mb else DEFAULT_SLOT_BYTES


def _kernels() -> bool:
    from pdserve.workers.model import cpu_kernels

    return cpu_kernels.available()


def sweep_stale(directory: Path = SHM_DIR) -> list[str]:
    """Remove segments whose creator (the pid in the name) is gone: a rank 0 killed between
    creating a segment and the last rank mapping it. Returns the names removed."""
    removed = []
    for path in directory.glob(PREFIX + "*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed


class ShmCollectives:
    """One rank's handle on its group's segment (see the module doc)."""

    def __init__(self, handle: int, rank: int, size: int, slot_bytes: int, name: str) -> None:
        self.handle, self.rank, self.size, self.slot_bytes, self.name = handle, rank, size, slot_bytes, name
        # Unmap when dropped (an in-process rank 0 of many LLMs); the name is already gone.
        self._finalizer = weakref.finalize(self, torch.ops.pdserve_cpu.shm_group_close, handle)

    def __repr__(self) -> str:
        return f"ShmCollectives(rank={self.rank}, size={self.size}, slot={self.slot_bytes >> 10} KiB)"

    @classmethod
    def open(cls, store: Any, rank: int, size: int, timeout_s: float,
             *, directory: Path = SHM_DIR, slot: int | None = None) -> ShmCollectives | None:
        """Every rank of the group calls this (collectively, once); see the module doc."""
        store = torch.distributed.PrefixStore("pdserve/shm", store)
        slot = slot_bytes() if slot is None else slot
        handle, name = None, ""
        try:
            if rank == 0:
                if not enabled():
                    log.info("%s=0: the worker group's collectives use gloo", ENV_ENABLE)
                elif not _kernels():
                    log.info("no compiled CPU kernels: the worker group's collectives use gloo")
                else:
                    sweep_stale(directory)
                    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                    handle = cls._map(directory / name, rank, size, slot, timeout_s)
                    name = name if handle is not None else ""
                store.set("name", name)
            else:
                name = store.get("name").decode()
                if name and _kernels():
                    handle = cls._map(directory / name, rank, size, slot, timeout_s)
            if not name:
                return None
            store.add("mapped", int(handle is not None))
            if store.add("arrived", 1) == size:  # every rank has mapped it or given up
                (directory / name).unlink(missing_ok=True)
                store.set("done", "1")
            store.wait(["done"], datetime.timedelta(seconds=timeout_s))
            mapped = store.add("mapped", 0)
        except BaseException:
            if handle is not None:
                torch.ops.pdserve_cpu.shm_group_close(handle)
            if rank == 0 and name:
                (directory / name).unlink(missing_ok=True)
            raise
        if mapped != size:
            log.warning("%d of %d ranks mapped the shared-memory segment: the worker group's collectives "
                        "use gloo", mapped, size)
            if handle is not None:
                torch.ops.pdserve_cpu.shm_group_close(handle)
            return None
        return cls(handle, rank, size, slot, name)

    @staticmethod
    def _map(path: Path, rank: int, size: int, slot: int, timeout_s: float) -> int | None:
        try:
            return int(torch.ops.pdserve_cpu.shm_group_open(str(path), rank, size, slot, float(timeout_s)))
        except RuntimeError as e:
            log.warning("rank %d cannot map the shared-memory segment %s (%s)", rank, path,
                        str(e).splitlines()[0])
            return None

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place (rank order: bitwise the same on every rank); False,
        doing nothing, for a tensor that does not fit."""
        if not self.fits(x):
            return False
        torch.ops.pdserve_cpu.shm_all_reduce(self.handle, x)
        return True

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [..., k] -> [..., size * k] in rank order; None for a tensor that does
        not fit."""
        if not self.fits(x) or x.dim() == 0:
            return None
        return torch.ops.pdserve_cpu.shm_all_gather(self.handle, x)

    def close(self) -> None:
        """Unmap (later calls raise). Only once no collective of the group can run any more."""
        self._finalizer()

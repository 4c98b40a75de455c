"""A CPU worker group's shared-memory collectives (workers/model/csrc/shm_collectives.cpp,
workers/model/shm_group.py) between real processes, 2 and 3 ranks, each joined as a group's rank
is (``open_process_group``: gloo plus the segment):

- all-reduce equal to the sum in rank order (fp32 bitwise, bf16/fp16 the fp32 sum rounded once)
  and bitwise identical on every rank; the vocab all-gather; 2000 back-to-back calls of changing
  sizes with rank- and call-specific values (a torn or stale slot read would show);
- a tensor larger than the slot, or of another dtype, goes through gloo with the same results;
- the deadline: a rank that never calls makes its peer raise after the timeout naming it, the
  group is poisoned for both; a killed rank is noticed well before the deadline;
- no /dev/shm segment is left: none once the group is open, none after a rank is killed, none
  when the rendezvous fails, and a dead creator's leftover is swept.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.workers.model import cpu_kernels
from pdserve.workers.model.shm_group import PREFIX, SHM_DIR, ShmCollectives, sweep_stale
from pdserve.workers.runner.group import GroupAddress, open_process_group

MP = mp.get_context("spawn")
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="pdserve's CPU kernels are not built")


def _rank_input(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 101 + rank)).to(dtype)


def _ordered_sum(size: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    acc = _rank_input(0, n, dtype, seed).float()
    for r in range(1, size):
        acc += _rank_input(r, n, dtype, seed).float()
    return acc.to(dtype)


def _join(rank: int, size: int, port: int) -> object:
    torch.set_num_threads(1)
    return open_process_group(GroupAddress("127.0.0.1", port, 0, "", size, 60.0), rank, "cpu")


def _correctness_rank(rank: int, size: int, port: int, out: str) -> None:
    tp = _join(rank, size, port)
    assert tp.shm is not None and not (SHM_DIR / tp.shm.name).exists()  # unlinked once all mapped
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = _rank_input(rank, 3001, dtype)
        tp.all_reduce(x)
        assert torch.equal(x, _ordered_sum(size, 3001, dtype)), dtype
        results[str(dtype)] = x
    # Back to back, sizes changing, values specific to (rank, call): integers, exact in fp32.
    for i in range(2000):
        n = 1 + (i * 389) % 4096
        x = torch.arange(n, dtype=torch.float32) % 13 + rank * 10_000 + i
        tp.all_reduce(x)
        want = (torch.arange(n, dtype=torch.float32) % 13) * size + sum(r * 10_000 for r in range(size)) + i * size
        assert torch.equal(x, want), i
        if i % 7 == 0:  # the gather shares the slots and the sequence
            local = torch.full((3, 5 + i % 4), float(rank * 100 + i))
            full = tp.gather_vocab(local, size * local.shape[1] - 1)
            parts = [torch.full_like(local, float(r * 100 + i)) for r in range(size)]
            assert torch.equal(full, torch.cat(parts, -1)[..., :-1]), i
    # Larger than the slot, or not a float: through gloo, the same sums.
    big = _rank_input(rank, tp.shm.slot_bytes // 4 + 1, torch.float32)
    assert not tp.shm.fits(big)
    tp.all_reduce(big)
    assert torch.allclose(big, _ordered_sum(size, big.numel(), torch.float32), atol=1e-5)
    ints = torch.full((4,), rank + 1, dtype=torch.int64)
    assert torch.equal(tp.all_reduce(ints), torch.full((4,), size * (size + 1) // 2))
    torch.save(results, out)


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_across_processes(tmp_path, size: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, size + 1, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(size)]
    _run([(_correctness_rank, (r, size, store.port, outs[r])) for r in range(size)], expect=[0] * size)
    results = [torch.load(o) for o in outs]
    for key, x in results[0].items():  # bitwise the same on every rank
        assert all(torch.equal(x.view(torch.uint8), other[key].view(torch.uint8)) for other in results[1:]), key
    bf16 = results[0][str(torch.bfloat16)].float()
    assert torch.allclose(bf16, _ordered_sum(size, 3001, torch.float32), atol=0.05, rtol=0.01)


def _deadline_rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
    shm = ShmCollectives.open(store, rank, 2, 2.0)
    assert shm is not None
    x = torch.ones(16)
    shm.all_reduce(x)  # both arrive
    if rank == 1:
        time.sleep(3.5)  # misses the next call; then the group is poisoned for it too
        t0 = time.monotonic()
        try:
            shm.all_reduce(x)
        except RuntimeError as e:
            Path(out).write_text(f"{time.monotonic() - t0:.3f}\n{e}")
        return
    t0 = time.monotonic()
    try:
        shm.all_reduce(x)
        Path(out).write_text("no error")
        return
    except RuntimeError as e:
        first, waited = str(e), time.monotonic() - t0
    t0 = time.monotonic()
    try:
        shm.all_gather(x)
    except RuntimeError as e:
        Path(out).write_text(f"{waited:.3f}\n{first}\n{time.monotonic() - t0:.3f}\n{e}")


def test_deadline_names_the_missing_rank_and_poisons(tmp_path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = [tmp_path / "rank0.txt", tmp_path / "rank1.txt"]
    _run([(_deadline_rank, (r, store.port, str(outs[r]))) for r in range(2)], expect=[0, 0])
    waited, first, again, second = outs[0].read_text().split("\n", 3)
    assert 1.9 < float(waited) < 3.5, waited
    assert "rank(s) 1 " in first and "within 2 s" in first, first
    assert float(again) < 0.1 and "unusable" in second, second
    late, why = outs[1].read_text().split("\n", 1)
    assert float(late) < 0.1 and "rank 0 failed" in why and "rank(s) 1" in why, why


def _killed_rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=60))
    shm = ShmCollectives.open(store, rank, 2, 30.0)
    x = torch.ones(16)
    shm.all_reduce(x)
    Path(out).write_text(shm.name)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        shm.all_reduce(x)
    except RuntimeError as e:
        Path(out).write_text(f"{shm.name}\n{time.monotonic() - t0:.3f}\n{e}")


def test_a_killed_rank_is_noticed_and_leaves_no_segment(tmp_path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    outs = [tmp_path / "rank0.txt", tmp_path / "rank1.txt"]
    _run([(_killed_rank, (r, store.port, str(outs[r]))) for r in range(2)], expect=[0, -signal.SIGKILL])
    name, waited, why = outs[0].read_text().split("\n", 2)
    assert float(waited) < 2.0 and "rank 1 (pid" in why and "exited" in why, why
    assert name.startswith(PREFIX) and not (SHM_DIR / name).exists()


def _run(targets, expect: list[int], timeout_s: float = 120.0) -> None:
    procs = [MP.Process(target=fn, args=args, daemon=True) for fn, args in targets]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert [p.exitcode for p in procs] == expect


# ----------------------------------------------------------------- in one process


def _local_store(size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)


def test_two_threads_as_ranks_release_the_gil(tmp_path) -> None:
    """The op runs without the GIL: rank 0 waits in C++ while this thread (rank 1) gets there."""
    master = _local_store(2)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, 2, False, timeout=datetime.timedelta(seconds=30))]
    got: dict[int, ShmCollectives | None] = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(
        r, ShmCollectives.open(stores[r], r, 2, 5.0, directory=tmp_path))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = got[0], got[1]
    assert a is not None and b is not None and not list(tmp_path.iterdir())
    x0, x1 = torch.arange(6.0).view(2, 3), torch.ones(2, 3)
    t = threading.Thread(target=a.all_reduce, args=(x0,))
    t.start()
    time.sleep(0.2)  # rank 0 is waiting for rank 1 by now
    b.all_reduce(x1)
    t.join(5)
    assert torch.equal(x0, torch.arange(6.0).view(2, 3) + 1) and torch.equal(x0, x1)
    a.close()
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.all_reduce(x0)


def test_off_switch_and_failed_rendezvous(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_TP_SHM", "0")
    assert ShmCollectives.open(_local_store(1), 0, 1, 5.0, directory=tmp_path) is None
    monkeypatch.delenv("PDSERVE_TP_SHM")
    # Rank 1 never comes: rank 0's rendezvous raises at the deadline and removes its segment.
    with pytest.raises(Exception):
        ShmCollectives.open(_local_store(2), 0, 2, 1.0, directory=tmp_path)
    assert not list(tmp_path.iterdir())


def test_sweep_removes_segments_of_dead_creators(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale, live = tmp_path / f"{PREFIX}{dead}-abcd", tmp_path / f"{PREFIX}{os.getpid()}-abcd"
    stale.touch()
    live.touch()
    assert sweep_stale(tmp_path) == [stale.name] and live.exists()

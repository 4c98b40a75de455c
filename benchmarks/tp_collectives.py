"""One collective of a CPU worker group, gloo (TCP loopback) against the shared-memory segment
(workers/model/shm_group.py): two or more rank processes, one torch thread each, as a TP decode
step's all-reduce of [batch, hidden] and vocab all-gather.

    .venv/bin/python benchmarks/tp_collectives.py [--ranks 2] [--shapes 8x512,8x1024] [--calls 2000]

Each rank times ``calls`` back-to-back calls after a warm-up, per shape and path; the figure is
the median over the ranks of each rank's mean call (µs). Both paths run in the same processes,
alternating, so the machine's drift hits both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WARMUP = 200


def _rank(rank: int, size: int, port: int, shapes: list[tuple[int, int]], calls: int, rounds: int, queue: Any) -> None:
    from pdserve.workers.model.shm_group import ShmCollectives

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, size + 1, False, timeout=timeout)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pdserve/tp", store), rank, size, timeout)
    shm = ShmCollectives.open(store, rank, size, 60.0)
    assert shm is not None, "no shared-memory group (kernels not built, or PDSERVE_TP_SHM=0)"
    ops = {
        "all_reduce gloo": lambda x: pg.allreduce([x]).wait(),
        "all_reduce shm": shm.all_reduce,
        "all_gather gloo": lambda x: pg.allgather([[torch.empty_like(x) for _ in range(size)]], [x]).wait(),
        "all_gather shm": shm.all_gather,
    }
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for rows, cols in shapes:
            x = torch.randn(rows, cols)
            for name, op in ops.items():
                for _ in range(WARMUP):
                    op(x)
                t0 = time.perf_counter()
                for _ in range(calls):
                    op(x)
                out.setdefault(f"{name} [{rows}, {cols}]", []).append(1e6 * (time.perf_counter() - t0) / calls)
    queue.put((rank, {k: statistics.median(v) for k, v in out.items()}))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shapes", default="8x512,8x1024")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    store = dist.TCPStore("127.0.0.1", 0, args.ranks + 1, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, store.port, shapes, args.calls, args.rounds, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    figures = {k: statistics.median(per_rank[r][k] for r in per_rank) for k in per_rank[0]}
    print(f"{args.ranks} ranks, 1 thread each, fp32, mean µs per call (median of {args.rounds} rounds x "
          f"{args.calls} calls, median over ranks)")
    for name, us in figures.items():
        print(f"  {name:<28}{us:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "calls": args.calls, "rounds": args.rounds, "us": figures}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

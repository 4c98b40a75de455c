"""Worker memory over many KV transfers: a 1P1D cluster on the built-in tiny model serves short
requests (every one a KV transfer) at a fixed concurrency, and the workers' RSS is printed every
``--step`` requests, and once more at the end after ``malloc_trim(0)`` in each worker (what
glibc holds free but has not given back, against what is live).

    .venv/bin/python benchmarks/worker_memory.py                      # the workers' environment as shipped
    .venv/bin/python benchmarks/worker_memory.py --malloc-arena-max default   # glibc's own arenas

A leak keeps the trimmed figure high; memory that glibc holds free only the raw ones.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import sys
import time


def _trim(self) -> int:  # runs inside a worker actor
    return ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/worker_memory.py", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--step", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--malloc-arena-max", default=None,
                        help="the workers' MALLOC_ARENA_MAX; 'default': glibc's own (unset)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import grpc
    import ray

    from pdserve.cluster import launch as L
    from pdserve.cluster.client import Client
    from pdserve.cluster.router import RouterConfig
    from pdserve.cluster.rpc import router_pb2_grpc

    if args.malloc_arena_max == "default":
        L.WORKER_ENV.pop("MALLOC_ARENA_MAX", None)
    elif args.malloc_arena_max is not None:
        L.WORKER_ENV["MALLOC_ARENA_MAX"] = args.malloc_arena_max
    engine = dict(tokens_per_block=4, max_batch_size=64, max_num_tokens=128, num_kv_blocks=1024)
    L.ensure_ray(None, num_cpus=4)
    cluster = L.launch(L.LaunchConfig(engine=engine, router=RouterConfig(port=0)))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(6, 16))] for _ in range(100)]
    pids = {w: ray.get(h.__ray_call__.remote(lambda self: os.getpid())) for w, h in cluster.workers.items()}

    async def serve(n: int, tag: str) -> None:
        sem = asyncio.Semaphore(args.concurrency)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(i: int) -> None:
                request = Client.build_request(prompts[i % len(prompts)], max_tokens=4, temperature=0.0,
                                               ignore_eos=True, request_id=f"{tag}-{i}")
                async with sem:
                    async for _ in stub.Generate(request, timeout=300):
                        pass

            await asyncio.gather(*(one(i) for i in range(n)))

    rows = []
    print(f"MALLOC_ARENA_MAX={L.WORKER_ENV.get('MALLOC_ARENA_MAX', 'unset')}; RSS MiB per worker")
    start = time.monotonic()
    try:
        done = 0
        while done < args.requests:
            asyncio.run(serve(args.step, f"m{done}"))
            done += args.step
            raw = {w: _rss_mib(p) for w, p in pids.items()}
            rows.append({"requests": done, "seconds": round(time.monotonic() - start, 1), "raw_mib": raw})
            print(f"{done:>7} requests {rows[-1]['seconds']:>7.1f} s  "
                  + "  ".join(f"{w} {raw[w]}" for w in sorted(raw)), flush=True)
        # Trimmed only now: trimming between steps would hide what piles up.
        ray.get([h.__ray_call__.remote(_trim) for h in cluster.workers.values()])
        trimmed = {w: _rss_mib(p) for w, p in pids.items()}
        rows[-1]["trimmed_mib"] = trimmed
        print("after malloc_trim: " + "  ".join(f"{w} {trimmed[w]}" for w in sorted(trimmed)))
    finally:
        cluster.shutdown()
        ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "worker_memory", "malloc_arena_max": L.WORKER_ENV.get("MALLOC_ARENA_MAX"),
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

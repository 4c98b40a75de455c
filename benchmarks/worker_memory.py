"""Worker memory over many KV transfers: a 1P1D cluster on the built-in tiny model serves short
requests (every one a KV transfer) at a fixed concurrency, and the workers' RSS is printed every
``--step`` requests, and once more at the end after ``malloc_trim(0)`` in each worker (what
glibc holds free but has not given back, against what is live).

    .venv/bin/python benchmarks/worker_memory.py                      # the workers' environment as shipped
    .venv/bin/python benchmarks/worker_memory.py --malloc-arena-max default   # glibc's own arenas

A leak keeps the trimmed figure high; memory that glibc holds free only the raw ones.

``--context`` measures a context worker's own growth without the cluster: the engine core a
context worker builds (the built-in model, the launch's default engine settings) runs prefills
of random prompt lengths (1 to ``--max-prompt-len`` tokens, one output token each) at
``--concurrency``, in this process, RSS every ``--step`` requests, and the growth over the last
half of the run (a plateau: about 0). A cluster run takes ``--max-prompt-len`` too (prompts of
random lengths instead of the 6-16-token ones).

    .venv/bin/python benchmarks/worker_memory.py --context --requests 10000 --step 1000 \
        --concurrency 48 --max-prompt-len 512
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
    parser.add_argument("--context", action="store_true",
                        help="a context worker's engine core in this process, prefill only")
    parser.add_argument("--max-prompt-len", type=int, default=None,
                        help="prompts of random lengths 1..this (--context default: the engine's max_input_len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="--context: stop adding requests after this long and report the requests done")
    args = parser.parse_args(argv)
    if args.context:
        return _context(args)
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
    if args.max_prompt_len:
        # Long prompts: a prefill step as the launch's default takes, and KV for every request
        # in flight at its longest.
        engine.update(max_num_tokens=max(2048, args.max_prompt_len),
                      num_kv_blocks=args.concurrency * (-(-(args.max_prompt_len + 8) // 4)) + 64)
    L.ensure_ray(None, num_cpus=4)
    cluster = L.launch(L.LaunchConfig(engine=engine, router=RouterConfig(port=0)))
    rng = random.Random(args.seed)
    # Random lengths: a prompt each, so that no prefill is a prefix-cache hit.
    lens, count = ((1, args.max_prompt_len), args.requests) if args.max_prompt_len else ((6, 16), 100)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(*lens))] for _ in range(count)]
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


def _context(args) -> int:
    """The context worker's growth in-process: see the module's docstring."""
    import torch

    from pdserve.cluster.launch import builtin_model_dir
    from pdserve.scheduler import LlmRequest
    from pdserve.transport.requests import UpdateKind
    from pdserve.workers.config import EngineConfig
    from pdserve.workers.engine.build import build_engine_core
    from pdserve.workers.runner.sampling import SamplingParams

    pid = os.getpid()
    _, core = build_engine_core(builtin_model_dir(), EngineConfig.from_kwargs({}))
    max_len = args.max_prompt_len or core.max_input_len
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    print(f"context engine core in-process: prompts of 1..{max_len} tokens, concurrency "
          f"{args.concurrency}, {torch.get_num_threads()} threads; RSS at start {_rss_mib(pid)} MiB", flush=True)
    rows = []
    start = time.monotonic()
    added = done = 0
    live = 0
    target = args.requests
    while done < target:
        if args.max_seconds is not None and time.monotonic() - start > args.max_seconds and target == args.requests:
            target = added  # out of time: drain what is in flight, report what was reached
            print(f"--max-seconds reached: stopping at {target} requests", flush=True)
        while live < args.concurrency and added < target:
            prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, max_len))]
            core.add_request(LlmRequest(added, prompt, 1), params)
            added += 1
            live += 1
        for update in core.step():
            if update.kind in (UpdateKind.FINISHED, UpdateKind.FAILED):
                if update.kind == UpdateKind.FAILED:
                    raise RuntimeError(f"request {update.request_id} failed: {update.message}")
                done += 1
                live -= 1
                if done % args.step == 0 and done < target:
                    rows.append({"requests": done, "seconds": round(time.monotonic() - start, 1),
                                 "rss_mib": _rss_mib(pid)})
                    print(f"{done:>7} requests {rows[-1]['seconds']:>7.1f} s  ctx RSS {rows[-1]['rss_mib']} MiB",
                          flush=True)
    rows.append({"requests": done, "seconds": round(time.monotonic() - start, 1), "rss_mib": _rss_mib(pid)})
    print(f"{done:>7} requests {rows[-1]['seconds']:>7.1f} s  ctx RSS {rows[-1]['rss_mib']} MiB", flush=True)
    tracked = core.status(records=False).get("tracked")
    # Trimmed only now: trimming between steps would hide what piles up.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _rss_mib(pid)
    half = min(rows, key=lambda r: abs(r["requests"] - done / 2))
    growth = rows[-1]["rss_mib"] - half["rss_mib"]
    print(f"after malloc_trim: {trimmed} MiB; tracked requests after the drain: {tracked}")
    print(f"growth over the last half ({half['requests']}..{rows[-1]['requests']} requests): {growth} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "worker_memory", "mode": "context", "max_prompt_len": max_len,
                       "concurrency": args.concurrency, "rows": rows, "trimmed_mib": trimmed,
                       "last_half_growth_mib": growth}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Latency the router and the Ray hops add, against the in-process engine, for 1-token requests.

The same prompts (32 tokens) on the same built-in tiny model: first through ``LLM.generate`` in
this process, then over gRPC to a local 1P1D cluster (router actor -> context worker actor; a
1-token request finishes on the context worker, as TensorRT-LLM's disaggregated server returns
the context response directly). Requests are sent one at a time; p50 and p99 of each, and the
difference, are printed. Goal: at most 2 ms added at p50.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/router.py", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    import ray

    from pdserve import LLM, SamplingParams
    from pdserve.cluster.client import Client
    from pdserve.cluster.launch import LaunchConfig, builtin_model_dir, ensure_ray, launch
    from pdserve.cluster.router import RouterConfig

    engine = dict(tokens_per_block=16, num_kv_blocks=256, enable_block_reuse=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(32)] for _ in range(args.requests)]
    model = builtin_model_dir()

    import torch

    torch.set_num_threads(1)  # the worker actors run with one torch thread each, too
    llm = LLM(model, **engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:5], params)
    local = []
    for p in prompts:
        t0 = time.perf_counter()
        llm.generate([p], params)
        local.append((time.perf_counter() - t0) * 1000)

    owns = ensure_ray(num_cpus=4)
    cluster = launch(LaunchConfig(model=str(model), engine=engine, router=RouterConfig(port=0), metrics=True))
    try:
        remote = []
        with Client(f"127.0.0.1:{cluster.port}") as client:
            for p in prompts[:5]:
                client.generate(p, max_tokens=1, temperature=0.0, ignore_eos=True)
            for p in prompts:
                t0 = time.perf_counter()
                client.generate(p, max_tokens=1, temperature=0.0, ignore_eos=True)
                remote.append((time.perf_counter() - t0) * 1000)
    finally:
        cluster.shutdown()
        if owns:
            ray.shutdown()

    rows = {
        "in_process": {"p50_ms": _pct(local, 0.5), "p99_ms": _pct(local, 0.99), "mean_ms": statistics.fmean(local)},
        "grpc_ray": {"p50_ms": _pct(remote, 0.5), "p99_ms": _pct(remote, 0.99), "mean_ms": statistics.fmean(remote)},
    }
    added50 = rows["grpc_ray"]["p50_ms"] - rows["in_process"]["p50_ms"]
    added99 = rows["grpc_ray"]["p99_ms"] - rows["in_process"]["p99_ms"]
    print(f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['mean_ms']:8.2f}")
    print(f"added by router + Ray hops: p50 {added50:.2f} ms, p99 {added99:.2f} ms "
          f"(goal <= 2 ms at p50: {'met' if added50 <= 2 else 'NOT met'}); "
          f"ratio p50 {rows['grpc_ray']['p50_ms'] / rows['in_process']['p50_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "router", "requests": args.requests, **rows,
                       "added_p50_ms": added50, "added_p99_ms": added99}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

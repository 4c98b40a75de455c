"""Latency the router and the Ray hops add, against the in-process engine, for 1-token requests.

The same prompts (32 tokens) on the same built-in tiny model: first through ``LLM.generate`` in
this process, then over gRPC to a local 1P1D cluster (router actor -> context worker actor; a
1-token request finishes on the context worker, as TensorRT-LLM's disaggregated server returns
the context response directly). Requests are sent one at a time, alternating between the two
paths; p50 and p99 of each, and the difference, are printed, with the router's own view of each
request (arrival to last response, worker included) to split gRPC from the router and worker
hops. Goal: at most 2 ms added at p50.

The OpenAI-compatible HTTP front door runs in the same loop: the same prompt as a
non-streamed ``/v1/completions`` request (token-id prompt, ``max_tokens`` 1) over one keep-alive
connection. Its p50 minus the gRPC path's p50 is what HTTP adds; goal: at most 1 ms.

Then the worker hop alone, driver -> context worker, two ways in the same run: the router's
request channel (a socket with msgpack frames) and a Ray streaming-generator call to the same
actor's ``generate`` (how the router reached workers before the channel), with their ratio.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import time


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _worker_hops(worker, prompts) -> tuple[list[float], list[float]]:
    """1-token requests straight to one worker, alternating the request channel and a Ray
    streaming ``generate`` call; milliseconds to the finishing update, each way."""
    import asyncio

    import ray

    from pdserve.cluster.worker_channel import WorkerChannel
    from pdserve.transport.requests import WireRequest, SamplingParams

    info = ray.get(worker.info.remote(), timeout=60)
    ids = iter(range(1 << 40, 1 << 41))  # far from the router's attempt ids
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def wire(prompt):
        return WireRequest(next(ids), None, prompt, 1, deadline_s=60.0, sampling=greedy)

    async def run():
        channel = WorkerChannel("bench", info.request_endpoint, info.request_token)
        await channel.connect(10.0)
        by_channel, by_ray = [], []
        try:
            for i, p in enumerate(prompts):
                w = wire(p)
                t0 = time.perf_counter()
                updates = channel.attempt(w.request_id)
                channel.generate(w)
                while True:
                    async with asyncio.timeout(60):
                        update = await updates.get()
                    if update.finished:
                        break
                channel.forget(w.request_id)
                if i >= 10:
                    by_channel.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                async for ref in worker.generate.remote(wire(p)):
                    if (await ref).finished:
                        break
                if i >= 10:
                    by_ray.append((time.perf_counter() - t0) * 1000)
        finally:
            channel.close()
        return by_channel, by_ray

    return asyncio.run(run())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/router.py", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
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
    owns = ensure_ray(num_cpus=4)
    cluster = launch(LaunchConfig(model=str(model), engine=engine, router=RouterConfig(port=0, http_port=0),
                                  metrics=True))
    llm = LLM(model, **engine)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    local, remote, router_e2e, over_http = [], [], [], []
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)

    def complete_over_http(prompt) -> None:
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")

    try:
        with Client(f"127.0.0.1:{cluster.port}") as client:
            for p in prompts[:10]:  # warm-up: first calls, the channel's connect, caches
                llm.generate([p], params)
                client.generate(p, max_tokens=1, temperature=0.0, ignore_eos=True)
                complete_over_http(p)
            # Interleaved, so every path runs under the same background (the idle cluster's
            # processes, whatever else the machine does) and drift hits them alike.
            for p in prompts:
                t0 = time.perf_counter()
                llm.generate([p], params)
                local.append((time.perf_counter() - t0) * 1000)
                t0 = time.perf_counter()
                out = client.generate(p, max_tokens=1, temperature=0.0, ignore_eos=True)
                remote.append((time.perf_counter() - t0) * 1000)
                router_e2e.append(out.timings.e2e_ms)
                t0 = time.perf_counter()
                complete_over_http(p)
                over_http.append((time.perf_counter() - t0) * 1000)
        hop_channel, hop_ray = _worker_hops(cluster.workers["ctx-0"], prompts)
    finally:
        conn.close()
        cluster.shutdown()
        if owns:
            ray.shutdown()

    rows = {
        "in_process": {"p50_ms": _pct(local, 0.5), "p99_ms": _pct(local, 0.99), "mean_ms": statistics.fmean(local)},
        "grpc_ray": {"p50_ms": _pct(remote, 0.5), "p99_ms": _pct(remote, 0.99), "mean_ms": statistics.fmean(remote)},
        "http_openai": {"p50_ms": _pct(over_http, 0.5), "p99_ms": _pct(over_http, 0.99),
                        "mean_ms": statistics.fmean(over_http)},
        # inside the router: from Generate's arrival to its last response (worker included)
        "router_e2e": {"p50_ms": _pct(router_e2e, 0.5), "p99_ms": _pct(router_e2e, 0.99),
                       "mean_ms": statistics.fmean(router_e2e)},
        # the worker hop alone (driver -> context worker, 1-token request)
        "hop_channel": {"p50_ms": _pct(hop_channel, 0.5), "p99_ms": _pct(hop_channel, 0.99),
                        "mean_ms": statistics.fmean(hop_channel)},
        "hop_ray_call": {"p50_ms": _pct(hop_ray, 0.5), "p99_ms": _pct(hop_ray, 0.99),
                         "mean_ms": statistics.fmean(hop_ray)},
    }
    added50 = rows["grpc_ray"]["p50_ms"] - rows["in_process"]["p50_ms"]
    added99 = rows["grpc_ray"]["p99_ms"] - rows["in_process"]["p99_ms"]
    print(f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, r in rows.items():
        print(f"{name:<12} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['mean_ms']:8.2f}")
    print(f"added by router + Ray hops: p50 {added50:.2f} ms, p99 {added99:.2f} ms "
          f"(goal <= 2 ms at p50: {'met' if added50 <= 2 else 'NOT met'}); "
          f"ratio p50 {rows['grpc_ray']['p50_ms'] / rows['in_process']['p50_ms']:.2f}x")
    http_added = rows["http_openai"]["p50_ms"] - rows["grpc_ray"]["p50_ms"]
    print(f"added by HTTP over gRPC: p50 {http_added:.2f} ms (goal <= 1 ms: {'met' if http_added <= 1 else 'NOT met'}); "
          f"ratio p50 {rows['http_openai']['p50_ms'] / rows['grpc_ray']['p50_ms']:.2f}x")
    print(f"worker hop: request channel p50 {rows['hop_channel']['p50_ms']:.2f} ms vs Ray "
          f"streaming call {rows['hop_ray_call']['p50_ms']:.2f} ms "
          f"({rows['hop_ray_call']['p50_ms'] / rows['hop_channel']['p50_ms']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "router", "requests": args.requests, **rows,
                       "added_p50_ms": added50, "added_p99_ms": added99, "http_added_p50_ms": http_added},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

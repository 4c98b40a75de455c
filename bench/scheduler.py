"""Time one full scheduler step (capacity pass + micro-batch pass) at scale.

Setup per size N: N active requests, half decoding (their KV allocated and grown), half waiting
for prefill, a quarter of which share a prefix with a decoding request (so reuse analysis has
real matches); 16 tokens per block, 65,536 blocks, block reuse on, chunked prefill
(FIRST_COME_FIRST_SERVED, unit 256). max_batch_size = N and max_num_tokens = 16,384 so the
schedulers look at every request. The step is repeated on the same state (schedule() only
decides; it allocates nothing), and the median is reported.

Goal: <= 2 ms per full step with 1,024 active requests. For scale, TensorRT-LLM's own Python port
measured 17.4 ms per iteration (10.5 ms fused, 2.9 ms compiled with mypyc).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
    LlmRequestState,
    MicroBatchScheduler,
    SimpleScheduler,
)

SIZES = (64, 256, 1024, 4096)
NUM_BLOCKS = 65_536
TOKENS_PER_BLOCK = 16
MAX_NUM_TOKENS = 16_384


def build(n: int, policy: CapacitySchedulerPolicy, seed: int = 0):
    rng = random.Random(seed)
    kv = KVCacheManager(NUM_BLOCKS, TOKENS_PER_BLOCK, enable_block_reuse=True)
    active: list[LlmRequest] = []
    prefixes: list[list[int]] = []
    for i in range(n):
        prompt_len = rng.randint(64, 512)
        if i % 2 == 0:
            prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
            req = LlmRequest(i, prompt, rng.randint(32, 512))
            kv.add_sequence(req)
            req.context_current_position = req.prompt_len
            kv.store_context_blocks(req)
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            for _ in range(rng.randint(1, 24)):
                req.add_new_token(rng.randrange(3, 32000))
                kv.add_token(i)
            prefixes.append(prompt)
        else:
            if i % 4 == 1 and prefixes:
                shared = rng.choice(prefixes)
                cut = (len(shared) // 2) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
                prompt = shared[:cut] + [rng.randrange(3, 32000) for _ in range(prompt_len - cut)]
            else:
                prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
            req = LlmRequest(i, prompt, rng.randint(32, 512))
        active.append(req)
    capacity = CapacityScheduler(n, policy)
    micro = MicroBatchScheduler(
        ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 256), MAX_NUM_TOKENS
    )
    scheduler = SimpleScheduler(
        capacity, micro, kv_cache_manager=kv, max_batch_size=n, max_num_tokens=MAX_NUM_TOKENS
    )
    return scheduler, active


def profile_step(n: int, policy: CapacitySchedulerPolicy, repeats: int, top: int = 15) -> None:
    """cProfile over ``repeats`` steps on the benchmark's state; prints the top functions by
    own time (profiling inflates call-heavy code, so read it for shares, not for timings)."""
    import cProfile
    import pstats

    scheduler, active = build(n, policy)
    scheduler.schedule(active, set())
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        scheduler.schedule(active, set())
    profiler.disable()
    print(f"\n--- profile: {n} active, {policy.name}, {repeats} steps ---")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def time_step(n: int, policy: CapacitySchedulerPolicy, repeats: int) -> dict:
    scheduler, active = build(n, policy)
    out = scheduler.schedule(active, set())  # warm caches (per-request block keys)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        out = scheduler.schedule(active, set())
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
    return {
        "active": n,
        "policy": policy.name,
        "median_us": statistics.median(samples),
        "p90_us": sorted(samples)[int(0.9 * (len(samples) - 1))],
        "context": len(out.context_requests),
        "generation": len(out.generation_requests),
        "paused": len(out.paused_requests),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/scheduler.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=0, help="0 = chosen per size")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--profile", action="store_true",
        help="after the table, print a cProfile top list per size and policy",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    print(f"{'active':>7} {'policy':<20} {'median us':>10} {'p90 us':>10} {'ctx':>5} {'gen':>5} {'paused':>6}")
    for n in sizes:
        repeats = args.repeats or max(5, min(200, 20_000 // n))
        for policy in CapacitySchedulerPolicy:
            row = time_step(n, policy, repeats)
            rows.append(row)
            print(
                f"{n:>7} {policy.name:<20} {row['median_us']:>10.0f} {row['p90_us']:>10.0f} "
                f"{row['context']:>5} {row['generation']:>5} {row['paused']:>6}",
                flush=True,
            )
    goal = [r for r in rows if r["active"] == 1024]
    if goal:
        worst = max(r["median_us"] for r in goal)
        print(f"\ngoal: <= 2000 us per full step at 1,024 active; worst policy median {worst:.0f} us "
              f"({'met' if worst <= 2000 else 'NOT met'}); TensorRT-LLM's Python port: 17,400 us "
              f"(ratio {17400 / worst:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "scheduler_step", "rows": rows}, f, indent=2)
    if args.profile:
        for n in sizes:
            for policy in CapacitySchedulerPolicy:
                profile_step(n, policy, args.repeats or max(5, min(200, 20_000 // n)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay a production trace through the real schedulers on a simulated worker.

Each step runs the capacity and micro-batch schedulers, pauses what the capacity pass evicted,
allocates and frees KV blocks through the real KVCacheManager, and advances every scheduled
request as the model would (one token per decode step, chunked prefill). Arrivals follow the
trace's timestamps on a simulated clock whose step time grows with the tokens in the batch.
Lengths are scaled so the trace fits a small KV pool.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from pdserve.traces import fit_scale, load_trace, synth_prompt
from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    LlmRequest,
    MicroBatchScheduler,
    SimpleScheduler,
)
from pdserve.scheduler.sim_worker import SimulatedWorker, StepRecord

POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    trace: str = "azure_llm_2023_conv.csv"
    num_requests: int = 200
    policy: str = "MAX_UTILIZATION"
    num_blocks: int = 192
    tokens_per_block: int = 16
    max_batch_size: int = 32
    max_num_tokens: int = 512
    chunking: str | None = "FIRST_COME_FIRST_SERVED"
    chunk_unit_size: int = 64
    max_input_len: int = 768
    max_output_len: int = 128
    enable_block_reuse: bool = True
    step_base_ms: float = 8.0  # simulated step time: base + per-token cost
    step_token_ms: float = 0.05
    time_scale: float = 0.02  # trace seconds -> simulated seconds (compresses arrivals)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    steps: int
    finished: int
    pauses: int
    paused_requests: int
    context_tokens: int
    generated_tokens: int
    reused_blocks: int
    peak_used_blocks: int
    mean_batch_tokens: float
    sim_seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float


def build_worker(cfg: ReplayConfig) -> SimulatedWorker:
    kv = KVCacheManager(
        cfg.num_blocks, cfg.tokens_per_block, enable_block_reuse=cfg.enable_block_reuse
    )
    capacity = CapacityScheduler(cfg.max_batch_size, CapacitySchedulerPolicy[cfg.policy])
    chunk_config = (
        ContextChunkingConfig(ContextChunkingPolicy[cfg.chunking], cfg.chunk_unit_size)
        if cfg.chunking
        else None
    )
    micro = MicroBatchScheduler(chunk_config, cfg.max_num_tokens)
    scheduler = SimpleScheduler(
        capacity,
        micro,
        kv_cache_manager=kv,
        max_batch_size=cfg.max_batch_size,
        max_num_tokens=cfg.max_num_tokens,
    )
    return SimulatedWorker(scheduler, kv, max_input_len=cfg.max_input_len)


def make_requests(cfg: ReplayConfig) -> list[tuple[float, LlmRequest]]:
    rows = load_trace(cfg.trace, cfg.num_requests)
    # Every request must fit the pool on its own (prompt + output), or GNE could never admit it.
    pool_tokens = cfg.num_blocks * cfg.tokens_per_block
    max_in = min(cfg.max_input_len, pool_tokens // 2)
    scale = fit_scale(rows, max_in, min(cfg.max_output_len, pool_tokens // 4))
    out = []
    for i, row in enumerate(rows):
        prompt = synth_prompt(row, i, scale, vocab=(3, 1000))
        out.append(
            (row.arrival_s * cfg.time_scale, LlmRequest(i, prompt, scale.output_len(row.output_len)))
        )
    return out


def replay(cfg: ReplayConfig, on_step=None) -> ReplayResult:
    worker = build_worker(cfg)
    pending = make_requests(cfg)
    by_id = {request.request_id: request for _, request in pending}
    pending.reverse()  # pop from the end in arrival order
    arrival: dict[int, float] = {}
    first_token: dict[int, float] = {}
    clock = 0.0
    batch_tokens = []
    while pending or not worker.idle:
        while pending and pending[-1][0] <= clock:
            t, request = pending.pop()
            arrival[request.request_id] = t
            worker.add_request(request)
        if worker.idle:
            clock = pending[-1][0]
            continue
        record = worker.step()
        step_s = (cfg.step_base_ms + cfg.step_token_ms * record.num_tokens) / 1000.0
        clock += step_s
        batch_tokens.append(record.num_tokens)
        for rid, _ in record.context:
            request = by_id[rid]
            if rid not in first_token and request.get_num_tokens(0) > request.orig_prompt_len:
                first_token[rid] = clock
        if on_step is not None:
            on_step(record)
        if worker.iteration > 200_000:
            raise RuntimeError("replay did not converge")
    ttfts = sorted((first_token[r] - arrival[r]) * 1000.0 for r in first_token)
    return ReplayResult(
        policy=cfg.policy,
        steps=worker.stats.steps,
        finished=worker.stats.finished,
        pauses=worker.stats.pauses,
        paused_requests=len(set(worker.stats.paused_ids)),
        context_tokens=worker.stats.context_tokens,
        generated_tokens=worker.stats.generated_tokens,
        reused_blocks=worker.kv.num_reused_blocks,
        peak_used_blocks=worker.stats.peak_used_blocks,
        mean_batch_tokens=statistics.fmean(batch_tokens) if batch_tokens else 0.0,
        sim_seconds=clock,
        ttft_p50_ms=_pct(ttfts, 0.50),
        ttft_p99_ms=_pct(ttfts, 0.99),
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _ids(ids, limit: int = 10) -> str:
    ids = list(ids)
    text = ",".join(str(i) for i in ids[:limit])
    return text + (f",…(+{len(ids) - limit})" if len(ids) > limit else "")


def _step_table(title: str) -> Table:
    table = Table(title=title, show_lines=False, expand=False)
    for col in ("step", "context id:chunk", "generation ids", "#gen", "paused", "free blocks"):
        table.add_column(col, overflow="fold")
    return table


def main(argv: list[str] | None = None) -> int:
    D = ReplayConfig()
    parser = argparse.ArgumentParser(
        prog="pdserve demo-scheduler",
        description="Replay the Azure conversation trace through pdserve's schedulers.",
    )
    parser.add_argument("--policy", default="all", choices=("all",) + POLICIES)
    parser.add_argument("--trace", default=D.trace)
    parser.add_argument("--num-requests", type=int, default=D.num_requests)
    parser.add_argument("--num-blocks", type=int, default=D.num_blocks)
    parser.add_argument("--max-batch-size", type=int, default=D.max_batch_size)
    parser.add_argument("--max-num-tokens", type=int, default=D.max_num_tokens)
    parser.add_argument("--chunking", default=D.chunking,
                        choices=("none", "FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS", "FORCE_CHUNK"))
    parser.add_argument("--table-rows", type=int, default=40,
                        help="per-step rows to print per policy (steps with pauses first)")
    parser.add_argument("--json", metavar="FILE", help="also write the summaries as JSON")
    args = parser.parse_args(argv)

    console = Console(width=max(Console().width, 140))
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = []
    for policy in policies:
        cfg = ReplayConfig(
            trace=args.trace,
            num_requests=args.num_requests,
            policy=policy,
            num_blocks=args.num_blocks,
            max_batch_size=args.max_batch_size,
            max_num_tokens=args.max_num_tokens,
            chunking=None if args.chunking == "none" else args.chunking,
        )
        records: list[StepRecord] = []
        result = replay(cfg, records.append)
        results.append(result)
        table = _step_table(
            f"{policy}: {cfg.num_requests} requests of {cfg.trace}, {cfg.num_blocks} blocks x "
            f"{cfg.tokens_per_block} tokens"
        )
        # The first steps show admission; steps with pauses show eviction under KV pressure.
        shown = records[: args.table_rows // 2]
        paused_steps = [r for r in records[args.table_rows // 2 :] if r.paused]
        shown += paused_steps[: args.table_rows - len(shown)]
        for r in shown:
            table.add_row(
                str(r.iteration),
                _ids((f"{rid}:{n}" for rid, n in r.context), 6),
                _ids(r.generation, 8),
                str(len(r.generation)),
                _ids(r.paused, 8) or "-",
                str(r.free_blocks),
            )
        console.print(table)
        console.print(
            f"  ({len(records)} steps in all; {len(shown)} shown, "
            f"{sum(1 for r in records if r.paused)} with pauses)\n"
        )

    summary = Table(title="Summary (simulated worker, real schedulers and KV accounting)")
    for col in ("policy", "steps", "done", "pauses", "paused", "ctx tok", "gen tok",
                "reused blk", "peak blk", "batch tok", "TTFT p50", "TTFT p99"):
        summary.add_column(col, justify="right", no_wrap=True)
    for r in results:
        summary.add_row(
            r.policy, str(r.steps), str(r.finished), str(r.pauses), str(r.paused_requests),
            str(r.context_tokens), str(r.generated_tokens), str(r.reused_blocks),
            str(r.peak_used_blocks), f"{r.mean_batch_tokens:.1f}",
            f"{r.ttft_p50_ms:.0f} ms", f"{r.ttft_p99_ms:.0f} ms",
        )
    console.print(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_asdict(r) for r in results], f, indent=2)
    return 0


def _asdict(result: ReplayResult) -> dict:
    return {name: getattr(result, name) for name in ReplayResult.__slots__}


if __name__ == "__main__":
    sys.exit(main())

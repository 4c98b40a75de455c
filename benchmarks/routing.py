"""KV-aware routing, simulated (issue 13): does routing on the workers' real caches, known to the
router only through their KV events, find the prefix hits an all-knowing router would, and does
it pay off in TTFT?

Workload: the Mooncake conversation trace (``mooncake_fast25_conversation.jsonl``; a turn's
``hash_ids`` extend the previous turn's, and equal ids become equal token blocks, so a
conversation's prompts share their prefix), lengths scaled to Llama-3-8B's window as ``pdserve
simulate`` does, offered at ``--rate`` requests/s with the trace's own arrival pattern
compressed. Cluster: Llama-3-8B on simulated H100s (``bench/sizing.py``'s engine: 32-token
blocks, block reuse on), 4P4D and 8 colocated workers, under each routing mode of the simulator
(``bench/simulator.py``, the router's own policy classes):

- round-robin / least-loaded: the router's modes that ignore the caches;
- kv-aware: ``KvAwarePolicy`` on the router's prefix index, fed by every worker's KV events one
  control-plane hop after each step;
- oracle: the same policy on each worker's exact cache at decision time.

Figures per run: prefix hit rate (prompt tokens the prefill worker reused / prompt tokens), TTFT
p50/p90, goodput (requests meeting the SLO per second of the run, ``bench/metrics.py``) and SLO
attainment, prediction accuracy (share of requests whose predicted match on the prefill worker
equals what it reused). "ceiling": the hit rate of one infinite cache that saw every earlier
prompt. Then a sweep of ``KvAwareWeights`` (overlap x decode) for kv-aware at 4P4D on a shorter
slice, ranked by TTFT p90, then goodput: how the defaults are chosen.

Run: .venv/bin/python benchmarks/routing.py --json bench/out/routing.json   (about 5 minutes here)
     .venv/bin/python benchmarks/routing.py --requests 3000 --no-sweep      (a quick look)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

from pdserve.bench.cost_model import GPU_PRESETS, MODELS, CostModel, min_tp
from pdserve.bench.simulator import simulate
from pdserve.bench.simulator_spec import SIM_ROUTING_MODES, ClusterSpec, WorkerSpec
from pdserve.bench.sizing import DEFAULT_SLO, GPU_LATENCY, TRACE_ALIASES, at_rate, gpu_worker_spec, gpu_workload, parse_layout
from pdserve.bench.workload import WorkItem, mean_rate
from pdserve.cluster.policies import KvAwareWeights
from pdserve.scheduler.radix_tree import prompt_block_keys
from pdserve.traces import load_trace

MODEL, GPU, TRACE = "llama-3-8b", "H100", "mooncake"
LAYOUTS = ("4P4D", "colocated-x8")
OVERLAP_WEIGHTS = (0.5, 1.0, 2.0, 4.0)
DECODE_WEIGHTS = (0.0, 0.1, 0.25, 0.5)


def workload(num_requests: int | None, rate: float) -> list[WorkItem]:
    model = MODELS[MODEL]
    n = num_requests or len(load_trace(TRACE_ALIASES[TRACE]))
    return at_rate(gpu_workload(TRACE, model, n), rate, "trace")


def hit_ceiling(work: Sequence[WorkItem], tokens_per_block: int) -> float:
    """Prompt tokens one infinite cache would reuse (whole blocks, never the last prompt token,
    as ``prompt_block_keys``), having seen every earlier prompt of the slice."""
    seen: set[bytes] = set()
    reused = total = 0
    for item in sorted(work, key=lambda w: w.arrival_s):
        keys = prompt_block_keys(item.prompt, tokens_per_block)
        n = next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        reused += n * tokens_per_block
        total += len(item.prompt)
        seen.update(keys)
    return reused / total if total else math.nan


def run_one(layout: str, routing: str, work: Sequence[WorkItem], cost: CostModel, worker: WorkerSpec,
            weights: KvAwareWeights = KvAwareWeights()) -> dict:
    ctx, gen = parse_layout(layout)
    spec = ClusterSpec(ctx, gen, worker, worker, routing=routing, latency=GPU_LATENCY,
                       kv_overlap_weight=weights.overlap, kv_decode_weight=weights.decode)
    t0 = time.perf_counter()
    result = simulate(spec, cost, work)
    wall = time.perf_counter() - t0
    s = result.summary(DEFAULT_SLO[MODEL])
    r = s["routing"]
    return {"layout": spec.label, "routing": routing, "overlap": weights.overlap, "decode": weights.decode,
            "requests": s["requests"], "completed": s["completed"],
            "hit_rate": r["prefix_hit_rate"], "prediction_accuracy": r["prediction_accuracy"],
            "over_predicted": r["over_predicted"], "under_predicted": r["under_predicted"],
            "index_resyncs": r["index_resyncs"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
            "kv_gb_moved": s["kv_transfer"]["bytes"] / 1e9, "wall_s": wall}


def goals(rows: Sequence[dict]) -> dict:
    """Per layout: kv-aware reaches >= 95% of the oracle's hit rate; it beats round-robin's
    TTFT p90."""
    out = {}
    for label in dict.fromkeys(r["layout"] for r in rows):
        by = {r["routing"]: r for r in rows if r["layout"] == label}
        if not {"kv-aware", "oracle", "round-robin"} <= set(by):
            continue
        kv, oracle, rr = by["kv-aware"], by["oracle"], by["round-robin"]
        share = kv["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else math.nan
        out[label] = {"hit_share_of_oracle": share, "hit_goal_met": share >= 0.95,
                      "ttft_p90_vs_round_robin": kv["ttft_p90_ms"] / rr["ttft_p90_ms"],
                      "ttft_goal_met": kv["ttft_p90_ms"] < rr["ttft_p90_ms"]}
    return out


def _table(rows: Sequence[dict], key_cols: Sequence[str]) -> str:
    cols = [*key_cols, "hit", "TTFT p50", "TTFT p90", "goodput", "SLO", "predicted ok", "wall"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if c in key_cols else "---:" for c in cols) + "|"]
    for r in rows:
        keys = [f"{r[c]:g}" if isinstance(r[c], float) else str(r[c]) for c in key_cols]
        lines.append("| " + " | ".join(keys + [
            f"{100 * r['hit_rate']:.1f} %", f"{r['ttft_p50_ms']:.0f} ms", f"{r['ttft_p90_ms']:.0f} ms",
            f"{r['goodput_rps']:.2f}", f"{100 * r['slo_attainment']:.1f} %",
            f"{100 * r['prediction_accuracy']:.1f} %", f"{r['wall_s']:.0f} s"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="trace rows (default: all 12031)")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="offered requests/s (the trace's arrival pattern compressed)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--modes", default=",".join(SIM_ROUTING_MODES))
    parser.add_argument("--sweep-requests", type=int, default=4000, help="slice for the weight sweep")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    model, hw = MODELS[MODEL], GPU_PRESETS[GPU]
    cost = CostModel(model, hw, min_tp(model, hw))
    worker = gpu_worker_spec(cost)
    slo = DEFAULT_SLO[MODEL]
    work = workload(args.requests, args.rate)
    ceiling = hit_ceiling(work, worker.tokens_per_block)
    print(f"{MODEL} on {GPU} (TP{cost.tp}), {len(work)} requests of {TRACE_ALIASES[TRACE]} at "
          f"{mean_rate(work):.1f} req/s, SLO TTFT {slo.ttft_ms:g} ms / TPOT {slo.tpot_ms:g} ms, "
          f"{worker.num_kv_blocks} KV blocks of {worker.tokens_per_block} tokens per worker; "
          f"one infinite cache would reuse {100 * ceiling:.1f} % of the prompt tokens", flush=True)
    rows = []
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            rows.append(run_one(layout, mode, work, cost, worker))
            r = rows[-1]
            print(f"  {r['layout']:<13} {mode:<13} hit {100 * r['hit_rate']:5.1f} %  TTFT p90 "
                  f"{r['ttft_p90_ms']:6.0f} ms  ({r['wall_s']:.0f} s)", flush=True)
    print()
    print(_table(rows, ("layout", "routing")))
    met = goals(rows)
    for label, g in met.items():
        print(f"{label}: kv-aware hit rate = {100 * g['hit_share_of_oracle']:.1f} % of the oracle's "
              f"(goal >= 95 %: {'met' if g['hit_goal_met'] else 'NOT met'}); TTFT p90 "
              f"{g['ttft_p90_vs_round_robin']:.2f}x round-robin's "
              f"(goal < 1: {'met' if g['ttft_goal_met'] else 'NOT met'})")
    out = {"model": MODEL, "gpu": GPU, "tp": cost.tp, "trace": TRACE_ALIASES[TRACE],
           "requests": len(work), "rate_rps": mean_rate(work), "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
           "kv_blocks_per_worker": worker.num_kv_blocks, "tokens_per_block": worker.tokens_per_block,
           "hop_s": GPU_LATENCY.hop_s, "hit_ceiling": ceiling, "runs": rows, "goals": met}

    if not args.no_sweep:
        sweep_work = workload(args.sweep_requests, args.rate)
        print(f"\nweight sweep: kv-aware at 4P4D, {len(sweep_work)} requests at {mean_rate(sweep_work):.1f} req/s "
              f"(ceiling {100 * hit_ceiling(sweep_work, worker.tokens_per_block):.1f} %)", flush=True)
        points = [run_one("4P4D", "kv-aware", sweep_work, cost, worker, KvAwareWeights(o, d))
                  for o, d in itertools.product(OVERLAP_WEIGHTS, DECODE_WEIGHTS)]
        baseline = run_one("4P4D", "round-robin", sweep_work, cost, worker)
        ranked = sorted(points, key=lambda r: (r["ttft_p90_ms"], -r["goodput_rps"]))
        print(_table(ranked, ("overlap", "decode")))
        print(f"round-robin on the same slice: hit {100 * baseline['hit_rate']:.1f} %, TTFT p90 "
              f"{baseline['ttft_p90_ms']:.0f} ms, goodput {baseline['goodput_rps']:.2f}")
        best = ranked[0]
        default = KvAwareWeights()
        rank = next(i for i, r in enumerate(ranked) if (r["overlap"], r["decode"]) == (default.overlap, default.decode))
        print(f"best: overlap {best['overlap']:g}, decode {best['decode']:g} (TTFT p90 {best['ttft_p90_ms']:.0f} ms); "
              f"the defaults ({default.overlap:g}, {default.decode:g}) rank {rank + 1} of {len(ranked)} "
              f"(TTFT p90 {ranked[rank]['ttft_p90_ms']:.0f} ms)")
        out["sweep"] = {"requests": len(sweep_work), "rate_rps": mean_rate(sweep_work), "points": ranked,
                        "round_robin": baseline, "best": best, "default_rank": rank + 1}
        default_run = next((r for r in rows if r["layout"] == "4P4D" and r["routing"] == "kv-aware"), None)
        if rank and default_run is not None:  # the sweep's best on the main workload, beside the defaults
            check = run_one("4P4D", "kv-aware", work, cost, worker, KvAwareWeights(best["overlap"], best["decode"]))
            print(f"on the main workload at 4P4D: best weights hit {100 * check['hit_rate']:.1f} %, TTFT p90 "
                  f"{check['ttft_p90_ms']:.0f} ms, goodput {check['goodput_rps']:.2f}; defaults hit "
                  f"{100 * default_run['hit_rate']:.1f} %, TTFT p90 {default_run['ttft_p90_ms']:.0f} ms, "
                  f"goodput {default_run['goodput_rps']:.2f}")
            out["sweep"]["best_on_main_workload"] = check
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``pdserve simulate``: size a deployment with the discrete-event simulator.

- ``simulate run``: one cluster layout on one trace slice; the figures ``bench serve`` reports.
- ``simulate search``: DistServe-style goodput search. For each model, GPU, trace, P:D layout
  (and colocated layouts) and capacity policy, the highest request rate whose SLO attainment
  (TTFT and TPOT both met) is at least ``--attainment`` is found by bisection on the rate; the
  best layout is the one with the most goodput per GPU (rate / GPUs, a TP group counting its
  every GPU). A rate is offered either as the trace's own arrival pattern time-scaled (its
  bursts stay bursts) or, as DistServe does, as Poisson arrivals with the trace's lengths.
- ``simulate validate``: calibrate the cost model to this CPU, measure the live cluster, and
  compare simulated with measured TTFT/TPOT (see ``bench/calibrate.py``).

Every simulated worker runs the real pdserve.scheduler code; step times come from the roofline
model in ``bench/cost_model.py`` on H100 / H200 / A100 presets, KV transfers from a link
bandwidth.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from pdserve.bench.cost_model import GPU_PRESETS, MODELS, CostModel, LinkSpec, ModelShape, min_tp
from pdserve.bench.metrics import Slo
from pdserve.bench.simulator import SimResult, simulate
from pdserve.bench.simulator_spec import SIM_ROUTING_MODES, ClusterSpec, Latency, WorkerSpec
from pdserve.bench.workload import WorkItem, WorkloadSpec, build_workload, mean_rate, rescaled, with_poisson_arrivals
from pdserve.cluster.policies import KvAwareWeights

TRACE_ALIASES = {"conv": "azure_llm_2023_conv.csv", "code": "azure_llm_2023_code.csv",
                 "mooncake": "mooncake_fast25_conversation.jsonl",
                 "mooncake-synthetic": "mooncake_fast25_synthetic.jsonl"}
# Default SLOs per model (DistServe-style: looser for the larger model).
DEFAULT_SLO = {"llama-3-8b": Slo(ttft_ms=500.0, tpot_ms=50.0), "llama-3-70b": Slo(ttft_ms=1000.0, tpot_ms=100.0)}
# Router and control-plane latency assumed for GPU clusters (gRPC + RPC hop; KV request round trip).
GPU_LATENCY = Latency(hop_s=0.5e-3, kv_control_s=1e-3)
# Layouts searched: (context workers, generation workers); 0 context workers = colocated.
DEFAULT_LAYOUTS = ("1:1", "1:2", "2:1", "1:3", "3:1", "2:3", "3:2", "0:1", "0:2")
POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION")


def gpu_worker_spec(cost: CostModel, policy: str = "GUARANTEED_NO_EVICT") -> WorkerSpec:
    """A TensorRT-LLM-like engine on a GPU (TP group): 32-token blocks, up to 256 sequences and
    8192 tokens per step, chunked prefill, the KV pool sized from memory left after the weights."""
    return WorkerSpec(max_batch_size=256, max_num_tokens=8192, tokens_per_block=32,
                      num_kv_blocks=cost.num_kv_blocks(32), capacity_scheduler_policy=policy,
                      context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=256,
                      max_input_len=cost.model.max_seq_len - 1)


def parse_layout(text: str) -> tuple[int, int]:
    """(context workers, generation workers) from "1P2D", "1:2", "0:2", "colocated" or
    "colocated-x2" (colocated: no context workers, prefill and decode on each worker)."""
    t = text.strip().lower()
    if t.startswith("colocated"):
        return 0, int(t[len("colocated"):].lstrip(" -x") or 1)
    a, sep, b = t.replace("p", ":").replace("d", "").partition(":")
    if not sep:
        raise ValueError(f"layout {text!r}: expected e.g. 1P2D, 1:2 or colocated-x2")
    return int(a), int(b)


def layout_spec(layout: tuple[int, int], worker: WorkerSpec, link: LinkSpec, latency: Latency, *,
                routing: str = "round-robin", kv_overlap_weight: float = KvAwareWeights().overlap,
                kv_decode_weight: float = KvAwareWeights().decode) -> ClusterSpec:
    return ClusterSpec(num_context_workers=layout[0], num_generation_workers=layout[1],
                       context=worker, generation=worker, link=link, latency=latency,
                       routing=routing, kv_overlap_weight=kv_overlap_weight,
                       kv_decode_weight=kv_decode_weight)


def gpu_workload(trace: str, model: ModelShape, num_requests: int, start: int = 0, seed: int = 0,
                 max_output_len: int = 2048) -> list[WorkItem]:
    """A trace slice at the trace's own rate, lengths scaled to the model's context window."""
    spec = WorkloadSpec(trace=TRACE_ALIASES.get(trace, trace), num_requests=num_requests, start=start,
                        max_input_len=model.max_seq_len - max_output_len, max_output_len=max_output_len,
                        vocab=(0, model.vocab_size), seed=seed)
    return build_workload(spec)[0]


@dataclass(frozen=True, slots=True)
class SearchPoint:
    layout: str
    policy: str
    gpus: int
    goodput_rps: float  # highest rate with attainment >= target
    goodput_per_gpu: float
    attainment: float  # at that rate
    ttft_p50_ms: float
    tpot_p50_ms: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    sims: int


def at_rate(work: Sequence[WorkItem], rate: float, arrivals: str = "trace", seed: int = 0) -> list[WorkItem]:
    """The slice offered at ``rate``: its own arrival pattern compressed or stretched uniformly
    ("trace", bursts stay bursts), or Poisson arrivals with its lengths ("poisson", DistServe)."""
    if arrivals == "poisson":
        return with_poisson_arrivals(work, rate, seed)
    if arrivals != "trace":
        raise ValueError(f"arrivals must be trace or poisson, got {arrivals!r}")
    return rescaled(work, mean_rate(work) / rate)


def max_rate_under_slo(spec: ClusterSpec, cost: CostModel, work: Sequence[WorkItem], slo: Slo, *,
                       attainment: float = 0.9, iterations: int = 7, arrivals: str = "trace"
                       ) -> tuple[float, dict | None, int]:
    """The highest offered rate (requests/s) at which at least ``attainment`` of the requests
    meet the SLO. Bracket by doubling / halving from the trace's own rate, then bisect in log
    space."""
    base = mean_rate(work)
    sims = 0

    def attain(rate: float) -> dict:
        nonlocal sims
        sims += 1
        result = simulate(spec, cost, at_rate(work, rate, arrivals))
        return result.summary(slo)

    lo, hi, best = None, None, None
    rate = base
    for _ in range(12):  # bracket
        s = attain(rate)
        if s["slo_attainment"] >= attainment:
            lo, best = rate, s
            if hi is not None:
                break
            rate *= 2.0
        else:
            hi = rate
            if lo is not None:
                break
            rate /= 2.0
    if lo is None:
        return 0.0, None, sims
    if hi is None:
        return lo, best, sims
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        s = attain(mid)
        if s["slo_attainment"] >= attainment:
            lo, best = mid, s
        else:
            hi = mid
    return lo, best, sims


def search(model_name: str, gpu: str, trace: str, *, layouts: Sequence[str] = DEFAULT_LAYOUTS,
           policies: Sequence[str] = POLICIES, num_requests: int = 300, slo: Slo | None = None,
           attainment: float = 0.9, link: LinkSpec = LinkSpec(), latency: Latency = GPU_LATENCY,
           iterations: int = 6, tp: int | None = None, refine: int = 2, arrivals: str = "trace",
           routing: str = "round-robin", log=print) -> dict:
    model = MODELS[model_name]
    hw = GPU_PRESETS[gpu]
    tp = tp or min_tp(model, hw)
    cost = CostModel(model, hw, tp)
    slo = slo or DEFAULT_SLO.get(model_name, Slo())
    work = gpu_workload(trace, model, num_requests)
    points: list[SearchPoint] = []
    # Every layout under the first policy; the other policies on the best `refine` layouts.
    plan = [(parse_layout(text), policies[0]) for text in layouts]
    for layout, policy in _extend(plan, points, policies, refine):
        spec = layout_spec(layout, gpu_worker_spec(cost, policy), link, latency, routing=routing)
        t0 = time.perf_counter()
        rate, s, sims = max_rate_under_slo(spec, cost, work, slo, attainment=attainment,
                                           iterations=iterations, arrivals=arrivals)
        gpus = spec.num_workers * tp
        get = (lambda m, q: s[m][q]) if s else (lambda m, q: math.nan)
        points.append(SearchPoint(spec.label, policy, gpus, rate, rate / gpus,
                                  s["slo_attainment"] if s else math.nan, get("ttft_ms", "p50"),
                                  get("tpot_ms", "p50"), get("ttft_ms", "p90"), get("tpot_ms", "p90"), sims))
        log(f"  {model_name} {gpu} TP{tp} {trace:<5} {spec.label:<13} {policy:<19} goodput "
            f"{rate:7.2f} req/s = {rate / gpus:6.2f} req/s/GPU ({sims} sims, {time.perf_counter() - t0:.1f} s)")
    best = max(points, key=lambda p: p.goodput_per_gpu)
    return {"model": model_name, "gpu": gpu, "tp": tp, "trace": TRACE_ALIASES.get(trace, trace),
            "num_requests": len(work), "trace_rate_rps": mean_rate(work), "slo": asdict(slo),
            "attainment_target": attainment, "arrivals": arrivals, "routing": routing,
            "kv_blocks_per_worker": cost.num_kv_blocks(32),
            "link": asdict(link), "latency": asdict(latency),
            "points": [asdict(p) for p in points], "best": asdict(best)}


def _extend(plan: list, points: list[SearchPoint], policies: Sequence[str], refine: int):
    """Yields the plan; once its first pass is done, the best ``refine`` layouts so far under
    each remaining policy."""
    yield from list(plan)
    best = sorted(points, key=lambda p: -p.goodput_per_gpu)[:refine]
    for p in best:
        for policy in policies[1:]:
            yield parse_layout(p.layout), policy


def print_search(results: Sequence[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    arrivals = sorted({r.get("arrivals", "trace") for r in results})
    table = Table(title=f"simulated goodput per GPU ({'/'.join(arrivals)} arrivals; best policy per "
                        f"layout; * = best layout)")
    for col in ("model", "GPU", "TP", "trace", "SLO ttft/tpot ms", "layout", "policy", "goodput req/s",
                "req/s/GPU", "TTFT p50", "TPOT p50"):
        table.add_column(col, justify="right")
    for res in results:
        by_layout: dict[str, dict] = {}
        for p in res["points"]:
            if p["layout"] not in by_layout or p["goodput_per_gpu"] > by_layout[p["layout"]]["goodput_per_gpu"]:
                by_layout[p["layout"]] = p
        for p in sorted(by_layout.values(), key=lambda p: -p["goodput_per_gpu"]):
            star = "*" if p is by_layout[res["best"]["layout"]] and p["policy"] == res["best"]["policy"] else ""
            table.add_row(res["model"], res["gpu"], str(res["tp"]), Path(res["trace"]).stem.split("_")[-1],
                          f"{res['slo']['ttft_ms']:g}/{res['slo']['tpot_ms']:g}", p["layout"] + star,
                          p["policy"].replace("GUARANTEED_NO_EVICT", "GNE").replace("MAX_UTILIZATION", "MAX_UTIL"),
                          f"{p['goodput_rps']:.2f}", f"{p['goodput_per_gpu']:.2f}",
                          f"{p['ttft_p50_ms']:.0f}", f"{p['tpot_p50_ms']:.1f}")
        table.add_section()
    Console(width=170).print(table)


# ---------------------------------------------------------------------------- command line

def _run(args) -> int:
    from pdserve.bench.serve_report import print_table

    model = MODELS[args.model]
    hw = GPU_PRESETS[args.gpu]
    tp = args.tp or min_tp(model, hw)
    cost = CostModel(model, hw, tp)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms else DEFAULT_SLO.get(args.model, Slo())
    link = LinkSpec(args.link_gbytes_s * 1e9)
    work = gpu_workload(args.trace, model, args.num_requests, args.start, args.seed)
    if args.rate:
        work = at_rate(work, args.rate, args.arrivals, args.seed)
    summaries, results = {}, {}
    for layout_text in args.layouts.split(","):
        spec = layout_spec(parse_layout(layout_text), gpu_worker_spec(cost, args.policy), link, GPU_LATENCY,
                           routing=args.routing, kv_overlap_weight=args.kv_overlap_weight,
                           kv_decode_weight=args.kv_decode_weight)
        result = simulate(spec, cost, work, seed=args.seed, step_jitter=args.step_jitter)
        summaries[spec.label] = result.summary(slo)
        results[spec.label] = result
    print_table(f"simulated: {args.model} on {args.gpu} (TP{tp}), {len(work)} requests of "
                f"{TRACE_ALIASES.get(args.trace, args.trace)} at {mean_rate(work):.2f} req/s, {args.policy}, "
                f"routing {args.routing}",
                summaries)
    if args.out_dir:
        _figures(Path(args.out_dir), results, f"simulated {args.model} {args.gpu}")
    if args.json:
        Path(args.json).write_text(json.dumps({"simulate": "run", "model": args.model, "gpu": args.gpu,
                                               "tp": tp, "trace": args.trace, "routing": args.routing,
                                               "summaries": summaries},
                                              indent=1, default=str))
    return 0


def _figures(out_dir: Path, results: dict[str, SimResult], title: str) -> None:
    from pdserve.bench.plots import write_figures

    samples = {label: [{"t": t, "router_queue": q, "in_flight": f} for t, q, f in r.queue_series]
               for label, r in results.items()}
    write_figures(out_dir, {label: r.records for label, r in results.items()}, samples, title)


def _search(args) -> int:
    results = []
    models = args.models.split(",")
    for model_name in models:
        for gpu in args.gpus.split(","):
            for trace in args.traces.split(","):
                slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms else None
                results.append(search(model_name, gpu, trace, layouts=args.layouts.split(","),
                                      policies=args.policies.split(","), num_requests=args.num_requests,
                                      slo=slo, attainment=args.attainment,
                                      link=LinkSpec(args.link_gbytes_s * 1e9), iterations=args.iterations,
                                      refine=args.refine, arrivals=args.arrivals, routing=args.routing))
    print_search(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"simulate": "search", "results": results}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve simulate",
                                     description="Size a deployment with the discrete-event simulator.")
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="simulate layouts on one trace slice")
    run.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS))
    run.add_argument("--gpu", default="H100", choices=sorted(GPU_PRESETS))
    run.add_argument("--tp", type=int, default=None, help="default: the smallest TP group the weights fit")
    run.add_argument("--trace", default="conv", help=f"a file or one of {sorted(TRACE_ALIASES)}")
    run.add_argument("--layouts", default="1P1D,colocated", help="e.g. 1P1D,2P3D,colocated-x2")
    run.add_argument("--policy", default="GUARANTEED_NO_EVICT", choices=POLICIES + ("STATIC_BATCH",))
    run.add_argument("--num-requests", type=int, default=300)
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--rate", type=float, default=None, help="requests/s (default: the trace's own)")
    run.add_argument("--arrivals", choices=("trace", "poisson"), default="trace",
                     help="with --rate: the trace's pattern time-scaled, or Poisson")
    run.add_argument("--step-jitter", type=float, default=0.0, help="lognormal sigma on step times")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out-dir", default=None, help="write latency/throughput/queue figures here")
    run.add_argument("--kv-overlap-weight", type=float, default=KvAwareWeights().overlap,
                     help="kv-aware / oracle: the cache-hit weight (policies.KvAwareWeights)")
    run.add_argument("--kv-decode-weight", type=float, default=KvAwareWeights().decode,
                     help="kv-aware / oracle: the weight of KV blocks in use")
    s = sub.add_parser("search", help="best goodput per GPU over layouts and policies")
    s.add_argument("--models", default="llama-3-8b,llama-3-70b")
    s.add_argument("--gpus", default="H100")
    s.add_argument("--traces", default="conv,code")
    s.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS))
    s.add_argument("--policies", default=",".join(POLICIES))
    s.add_argument("--num-requests", type=int, default=1000,
                   help="slice size; keep it well above the in-flight cap (256 per generation worker)")
    s.add_argument("--refine", type=int, default=2, help="best layouts re-run under the other policies")
    s.add_argument("--arrivals", choices=("trace", "poisson"), default="trace",
                   help="trace: the slice's own arrival pattern, time-scaled to each rate (bursts stay); "
                        "poisson: Poisson arrivals at each rate with the slice's lengths (DistServe)")
    s.add_argument("--attainment", type=float, default=0.9)
    s.add_argument("--iterations", type=int, default=5, help="bisection steps per layout")
    for p in (run, s):
        p.add_argument("--slo-ttft-ms", type=float, default=None)
        p.add_argument("--slo-tpot-ms", type=float, default=None)
        p.add_argument("--link-gbytes-s", type=float, default=50.0, help="KV link per GPU, GB/s")
        p.add_argument("--json", metavar="FILE")
        p.add_argument("--routing", default="round-robin", choices=SIM_ROUTING_MODES,
                       help="how the router picks workers (as pdserve router --routing); oracle: "
                            "kv-aware on the workers' exact caches, no event delay")
    v = sub.add_parser("validate", help="calibrate to this CPU and compare with the live cluster")
    from pdserve.bench.calibrate import add_arguments

    add_arguments(v)
    args = parser.parse_args(argv)
    if args.action in ("run", "search") and (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
        parser.error("give both --slo-ttft-ms and --slo-tpot-ms, or neither")
    if args.action == "run":
        return _run(args)
    if args.action == "search":
        return _search(args)
    from pdserve.bench.calibrate import run_validation

    return run_validation(args)


if __name__ == "__main__":
    sys.exit(main())

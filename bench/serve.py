"""``pdserve bench serve`` and ``pdserve bench compare``: replay a production trace against a
pdserve cluster over gRPC (or any OpenAI-compatible server over HTTP) and report what clients see.

serve: against a running cluster (``--port``), or one it launches itself (``--launch 1P1D``), or,
with ``--backend openai --url URL``, any OpenAI-compatible server (pdserve's HTTP front door,
vLLM, SGLang, trtllm-serve), streamed, with the same figures and goodput.
Each trace row becomes a request sent at its (time-scaled) arrival time, or at Poisson times for
``--rate``; prompts are synthesised at lengths scaled to the cluster's limits (Mooncake hash ids
-> shared prefix blocks), outputs are forced to the trace's scaled length (greedy, EOS ignored).
Reports TTFT, TPOT, ITL and end-to-end latency (p50/p90/p99), throughput, goodput under a TTFT
and TPOT SLO, KV transfer GB/s and pauses; writes JSON and PNG figures (latency CDFs,
throughput and queue depth over time; the queue is sampled from GetClusterStatus).

compare: the same trace slice, in one run, against 1P1D (disaggregated), one colocated worker
(prefill and decode on the same worker: no context workers, the router prefills locally) and
two colocated workers, all with the same engine settings; prints a side-by-side table.

This module: the layouts it launches and the command line. The load generator and its two
backends are in ``serve_replay.py``; the table, JSON and figures in ``serve_report.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from pdserve.bench.metrics import RequestRecord, Slo
from pdserve.bench.serve_replay import ServeRun, cluster_limits, replay, replay_openai
from pdserve.bench.serve_report import print_table, write_outputs
from pdserve.bench.workload import WorkItem, WorkloadSpec, build_workload, mean_rate

# The built-in tiny model's engine for benchmarks: a 4096-token KV pool per worker, chunked
# prefill, GUARANTEED_NO_EVICT (the engine default).
DEFAULT_ENGINE: dict[str, Any] = dict(
    tokens_per_block=16, max_batch_size=16, max_num_tokens=512,
    context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=64, num_kv_blocks=256)
LAYOUTS: dict[str, tuple[int, int]] = {"1P1D": (1, 1), "2P1D": (2, 1), "colocated": (0, 1),
                                       "colocated-x2": (0, 2), "1P1D-layerwise": (1, 1)}


def kv_transfer_mode(layout: str) -> str:
    """The router's kv_transfer_mode a layout runs with."""
    return "layerwise" if layout.endswith("-layerwise") else "after_prefill"


# ---------------------------------------------------------------------------- clusters

def launch_layout(layout: str, engine: dict[str, Any], *, model: str | None = None,
                  routing: str = "round-robin", context_engine: dict[str, Any] | None = None):
    from pdserve.cluster.launch import LaunchConfig, launch
    from pdserve.cluster.router import RouterConfig

    num_ctx, num_gen = LAYOUTS[layout]
    return launch(LaunchConfig(model=model, num_context_workers=num_ctx, num_generation_workers=num_gen,
                               engine=dict(engine), context_engine=dict(context_engine or {}),
                               router=RouterConfig(port=0, routing=routing,
                                                   kv_transfer_mode=kv_transfer_mode(layout))))


def run_layouts(layouts: Sequence[str], engine: dict[str, Any], spec: WorkloadSpec, *,
                model: str | None = None, progress: bool = True, warmup: int = 2,
                status_interval_s: float = 0.5, num_cpus: int | None = None,
                routings: Sequence[str] = (), context_engine: dict[str, Any] | None = None
                ) -> tuple[list[WorkItem], dict[str, ServeRun]]:
    """Launch each layout (with each routing mode, when given: runs "<layout>/<mode>") in turn
    on one Ray instance, replay the same slice, shut it down."""
    import ray

    from pdserve.cluster.launch import ensure_ray

    owns = ensure_ray(num_cpus=num_cpus or max(4, os.cpu_count() or 1))
    runs: dict[str, ServeRun] = {}
    work: list[WorkItem] | None = None
    runs_to_do = [(f"{layout}/{mode}" if routings else layout, layout, mode)
                  for layout in layouts for mode in (routings or ["round-robin"])]
    try:
        for label, layout, mode in runs_to_do:
            cluster = launch_layout(layout, engine, model=model, routing=mode,
                                    context_engine=context_engine)
            try:
                address = f"127.0.0.1:{cluster.port}"
                if work is None:
                    work = _fit_work(spec, address)
                runs[label] = replay(address, work, label=label, progress=progress, warmup=warmup,
                                     status_interval_s=status_interval_s)
            finally:
                cluster.shutdown()
    finally:
        if owns:
            ray.shutdown()
    return work or [], runs


def _fit_work(spec: WorkloadSpec, address: str, connection=None) -> list[WorkItem]:
    max_in, max_out = cluster_limits(address, connection)
    spec = WorkloadSpec(**{**asdict(spec), "max_input_len": min(spec.max_input_len, max_in),
                           "max_output_len": min(spec.max_output_len, max_out)})
    return build_workload(spec)[0]


# ---------------------------------------------------------------------------- command line

def add_workload_arguments(parser: argparse.ArgumentParser, *, num_requests: int = 100) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--trace", default="azure_llm_2023_conv.csv",
                   help="a bundled trace (azure_llm_2023_conv.csv, azure_llm_2023_code.csv, "
                        "mooncake_fast25_conversation.jsonl, mooncake_fast25_synthetic.jsonl) or the path "
                        "of a trace file of yours (Azure CSV or Mooncake JSONL, optionally .xz/.gz)")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply the trace's arrival gaps (0.5 = twice the rate)")
    g.add_argument("--rate", type=float, default=None,
                   help="override: Poisson arrivals at this many requests/s (inf: all at once)")
    g.add_argument("--max-input-len", type=int, default=512, help="cap on scaled prompt lengths")
    g.add_argument("--max-output-len", type=int, default=64, help="cap on scaled output lengths")
    g.add_argument("--vocab-size", type=int, default=259, help="prompt token ids drawn from [3, V)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-ttft-ms", type=float, default=Slo().ttft_ms)
    g.add_argument("--slo-tpot-ms", type=float, default=Slo().tpot_ms)


def workload_from_args(args) -> tuple[WorkloadSpec, Slo]:
    spec = WorkloadSpec(trace=args.trace, num_requests=args.num_requests, start=args.start,
                        time_scale=args.time_scale, rate=args.rate, max_input_len=args.max_input_len,
                        max_output_len=args.max_output_len, vocab=(3, args.vocab_size), seed=args.seed)
    return spec, Slo(args.slo_ttft_ms, args.slo_tpot_ms)


def parse_engine(pairs: Sequence[str]) -> dict[str, Any]:
    engine = dict(DEFAULT_ENGINE)
    for pair in pairs:
        key, _, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if value.lower() in ("true", "false"):
            engine[key] = value.lower() == "true"
        elif value.lower() in ("none", "off", ""):
            engine[key] = None
        else:
            try:
                engine[key] = int(value)
            except ValueError:
                engine[key] = value
    return engine


def _replot(path: Path, out_dir: Path) -> int:
    from pdserve.bench.plots import write_figures

    doc = json.loads(path.read_text())
    w = doc["workload"]
    records = {name: [RequestRecord.from_dict(r) for r in run["requests"]] for name, run in doc["runs"].items()}
    samples = {name: run.get("status_samples", []) for name, run in doc["runs"].items()}
    for p in write_figures(out_dir, records, samples, title=f"{w['trace']} [{w['start']}:{w['start'] + w['num_requests']}]"):
        print(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    from pdserve.cluster.auth import SecurityConfigError, client_api_key
    from pdserve.cluster.client import add_connection_arguments, connection_from_args

    parser = argparse.ArgumentParser(prog="pdserve bench",
                                     description="Replay a production trace against pdserve (gRPC) or any "
                                                 "OpenAI-compatible server (HTTP).")
    sub = parser.add_subparsers(dest="action", required=True)
    serve = sub.add_parser("serve", help="replay a trace against one cluster")
    serve.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                       help="grpc: pdserve's router; openai: any OpenAI-compatible server at --url")
    serve.add_argument("--url", default=None, help="--backend openai: the server, e.g. http://127.0.0.1:8000")
    serve.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                       help="--backend openai: /v1/completions (token-id prompts) or /v1/chat/completions")
    serve.add_argument("--served-model", default=None, help="--backend openai: model id (default: the first "
                       "one /v1/models lists)")
    serve.add_argument("--host", default="127.0.0.1", help="the router's host; https://NAME for TLS")
    serve.add_argument("--port", type=int, default=None, help="a running cluster's gRPC port")
    serve.add_argument("--launch", choices=sorted(LAYOUTS), default=None,
                       help="launch this layout on an embedded Ray cluster instead (built-in tiny model)")
    # --api-key and --tls-ca also apply to --backend openai (bearer key, CA of an https --url)
    add_connection_arguments(serve)
    compare = sub.add_parser("compare", help="1P1D vs 1 colocated vs 2 colocated on the same slice "
                                              "(or: each routing mode on one layout)")
    compare.add_argument("--layouts", default="1P1D,colocated,colocated-x2")
    compare.add_argument("--routing", default=None,
                         help="comma-separated routing modes (round-robin,least-loaded,kv-aware): "
                              "each layout runs once per mode, on the same slice")
    compare.add_argument("--context-engine", action="append", default=[], metavar="KEY=VALUE",
                         help="engine option for the context workers only (e.g. num_kv_blocks=64)")
    plot = sub.add_parser("plot", help="draw the figures again from a serve/compare JSON file")
    plot.add_argument("file", help="a --json file written by bench serve or bench compare")
    plot.add_argument("--out-dir", required=True)
    if argv and argv[0] == "plot":
        args = parser.parse_args(argv)
        return _replot(Path(args.file), Path(args.out_dir))
    for p in (serve, compare):
        add_workload_arguments(p)
        p.add_argument("--model", default=None, help="model directory for launched clusters")
        p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                       help=f"engine option for launched clusters (defaults: {DEFAULT_ENGINE})")
        p.add_argument("--out-dir", default="bench/out/serve", help="where the PNG figures go")
        p.add_argument("--json", metavar="FILE", help="write the figures and every request as JSON")
        p.add_argument("--warmup", type=int, default=2, help="short requests sent first, not counted")
        p.add_argument("--status-interval", type=float, default=0.25, help="seconds between status samples")
        p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    spec, slo = workload_from_args(args)
    engine = parse_engine(args.engine)
    out_dir = Path(args.out_dir) if args.out_dir else None
    progress = not args.no_progress

    if args.action == "serve":
        if args.backend == "openai":
            if args.url is None:
                parser.error("bench serve --backend openai needs --url")
            work = build_workload(spec)[0]  # lengths capped by --max-input-len/--max-output-len
            runs = {"openai": replay_openai(args.url, work, endpoint=args.endpoint, model=args.served_model,
                                            progress=progress, warmup=args.warmup,
                                            api_key=client_api_key(args.api_key), tls_ca=args.tls_ca)}
        elif args.port is None and args.launch is None:
            parser.error("bench serve needs --port (a running cluster) or --launch LAYOUT")
        elif args.port is not None:
            try:
                connection = connection_from_args(args, f"{args.host}:{args.port}")
            except SecurityConfigError as exc:
                parser.error(str(exc))
            address = connection.target
            work = _fit_work(spec, address, connection)
            runs = {"cluster": replay(address, work, label="cluster", progress=progress, warmup=args.warmup,
                                      status_interval_s=args.status_interval, connection=connection)}
        else:
            work, runs = run_layouts([args.launch], engine, spec, model=args.model, progress=progress,
                                     warmup=args.warmup, status_interval_s=args.status_interval)
    else:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        unknown = [x for x in layouts if x not in LAYOUTS]
        if unknown:
            parser.error(f"unknown layouts {unknown}; known: {sorted(LAYOUTS)}")
        routings = [x.strip() for x in (args.routing or "").split(",") if x.strip()]
        context_engine = {k: v for k, v in parse_engine(args.context_engine).items()
                          if k in {p.partition("=")[0].strip().replace("-", "_") for p in args.context_engine}}
        work, runs = run_layouts(layouts, engine, spec, model=args.model, progress=progress,
                                 warmup=args.warmup, status_interval_s=args.status_interval,
                                 routings=routings, context_engine=context_engine)
    summaries = write_outputs(args.action, runs, work, spec, engine, slo, out_dir, args.json)
    print_table(f"bench {args.action}: {len(work)} requests of {spec.trace} from row {spec.start}, "
                f"offered {mean_rate(work):.2f} req/s; SLO TTFT <= {slo.ttft_ms:g} ms, "
                f"TPOT <= {slo.tpot_ms:g} ms", summaries)
    if out_dir is not None:
        print(f"figures: {', '.join(str(out_dir / f) for f in ('latency_cdf.png', 'throughput.png', 'queue_depth.png'))}")
    failed = sum(s["failed"] for s in summaries.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

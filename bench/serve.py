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
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pdserve.bench.metrics import RequestRecord, Slo, summarize
from pdserve.bench.workload import WorkItem, WorkloadSpec, build_workload, mean_rate

# The built-in tiny model's engine for benchmarks: a 4096-token KV pool per worker, chunked
# prefill, GUARANTEED_NO_EVICT (the engine default).
DEFAULT_ENGINE: dict[str, Any] = dict(
    tokens_per_block=16, max_batch_size=16, max_num_tokens=512,
    context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=64, num_kv_blocks=256)
LAYOUTS: dict[str, tuple[int, int]] = {"1P1D": (1, 1), "colocated": (0, 1), "colocated-x2": (0, 2)}
LAYOUT_TITLES = {"1P1D": "1P1D disaggregated", "colocated": "1 colocated worker",
                 "colocated-x2": "2 colocated workers"}


@dataclass(slots=True)
class ServeRun:
    label: str
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)  # GetClusterStatus over time
    wall_s: float = 0.0
    final_status: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- the client side

async def _replay(address: str, work: Sequence[WorkItem], *, label: str, timeout_s: float,
                  status_interval_s: float, progress: bool, warmup: int) -> ServeRun:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.cluster.client import Client
    from pdserve.cluster.rpc import router_pb2 as pb
    from pdserve.cluster.rpc import router_pb2_grpc

    records = [RequestRecord(w.index, w.arrival_s, len(w.prompt), w.max_tokens) for w in work]
    samples: list[dict] = []
    tag = "".join(c if c.isalnum() or c in "._:-" else "-" for c in label)  # a valid request id part
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(warmup):  # first calls pay one-time costs (threads, allocator, JIT paths)
            req = Client.build_request(list(work[i % len(work)].prompt[:32]), max_tokens=4,
                                       temperature=0.0, ignore_eos=True, request_id=f"warmup-{i}")
            async for _ in stub.Generate(req, timeout=timeout_s):
                pass
        bar = _progress(progress, label, len(work))
        t0 = time.monotonic()

        async def one(item: WorkItem, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
            rec.arrival_s = time.monotonic() - t0
            req = Client.build_request(item.prompt, max_tokens=item.max_tokens, temperature=0.0,
                                       ignore_eos=True, request_id=f"bench-{tag}-{item.index}")
            try:
                async for delta in stub.Generate(req, timeout=timeout_s):
                    now = time.monotonic() - t0
                    n = len(delta.token_ids)
                    if n:
                        rec.deltas.append((now, n))
                        rec.num_tokens += n
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                    if delta.finish_reason:
                        rec.finish_s = now
                        t = delta.timings
                        rec.queue_ms, rec.server_ttft_ms, rec.server_e2e_ms = t.queue_ms, t.ttft_ms, t.e2e_ms
                        rec.kv_bytes, rec.kv_ms, rec.pauses = t.kv_transfer_bytes, t.kv_transfer_ms, t.pauses
                        rec.local_prefill, rec.worker = t.local_prefill, t.gen_worker
                        rec.cached_tokens = delta.usage.cached_prompt_tokens
                        if delta.finish_reason not in ("length", "stop"):
                            rec.error = f"finish_reason={delta.finish_reason}"
            except grpc.aio.AioRpcError as exc:
                rec.error = f"{exc.code().name}: {exc.details()}"
            if bar is not None:
                bar[0].advance(bar[1])

        async def poll_status(stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    st = await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
                    samples.append(_sample(time.monotonic() - t0, st))
                except grpc.aio.AioRpcError:
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), status_interval_s)
                except asyncio.TimeoutError:
                    pass

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_status(stop))
        try:
            await asyncio.gather(*(one(w, r) for w, r in zip(work, records)))
        finally:
            stop.set()
            await poller
            if bar is not None:
                bar[0].stop()
        wall = time.monotonic() - t0
        final = MessageToDict(await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30))
    return ServeRun(label, records, samples, wall, final)


# Chat prompts are text: each synthetic token id becomes one common word (most tokenizers give a
# common word with its leading space one token), so equal id prefixes stay equal text prefixes.
CHAT_WORDS = tuple("the of and to in is it that for on with as was at by be this from or have an are "
                   "not but had his they you were her she which their all there been one has more when "
                   "will would who so no if out up what about into than them can only other new some "
                   "time could these two may first then do any like my now over such our man me".split())


def words_for(token_ids: Sequence[int]) -> str:
    return " ".join(CHAT_WORDS[t % len(CHAT_WORDS)] for t in token_ids)


async def _replay_openai(url: str, work: Sequence[WorkItem], *, endpoint: str, model: str | None, label: str,
                         timeout_s: float, progress: bool, warmup: int) -> ServeRun:
    """The same replay against any OpenAI-compatible server: streamed /v1/completions (token-id
    prompts, exact lengths) or /v1/chat/completions (word prompts), ``ignore_eos`` and
    ``max_tokens`` forcing the output length, usage from ``stream_options.include_usage``. pdserve's
    own per-request figures are read from ``pdserve_timings`` when the server sends them."""
    import aiohttp

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    records = [RequestRecord(w.index, w.arrival_s, len(w.prompt), w.max_tokens) for w in work]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        if model is None:
            async with session.get(f"{base}/models") as resp:
                model = (await resp.json())["data"][0]["id"]

        def body(item_prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
            out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                   "stream_options": {"include_usage": True}, "ignore_eos": True}
            if endpoint == "chat":
                out["messages"] = [{"role": "user", "content": words_for(item_prompt)}]
            else:
                out["prompt"] = list(item_prompt)
            return out

        path = f"{base}/{'chat/completions' if endpoint == 'chat' else 'completions'}"

        async def stream(item_prompt, max_tokens, rec: RequestRecord | None, t0: float) -> None:
            async with session.post(path, json=body(item_prompt, max_tokens)) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {") or rec is None:
                        continue
                    now = time.monotonic() - t0
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec.error = f"stream error: {chunk['error'].get('message')}"
                        continue
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text") if endpoint != "chat" else (choice.get("delta") or {}).get("content")
                        if text:
                            rec.deltas.append((now, 1))
                            if rec.first_token_s is None:
                                rec.first_token_s = now
                        if choice.get("finish_reason"):
                            rec.finish_s = now
                            if choice["finish_reason"] not in ("length", "stop"):
                                rec.error = f"finish_reason={choice['finish_reason']}"
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        rec.num_tokens = usage["completion_tokens"]
                        rec.prompt_len = usage["prompt_tokens"]
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    timings = chunk.get("pdserve_timings")
                    if timings:
                        rec.queue_ms, rec.server_ttft_ms = timings["queue_ms"], timings["ttft_ms"]
                        rec.server_e2e_ms, rec.kv_bytes = timings["e2e_ms"], timings["kv_transfer_bytes"]
                        rec.kv_ms, rec.pauses = timings["kv_transfer_ms"], timings["pauses"]
                        rec.local_prefill, rec.worker = timings["local_prefill"], timings["gen_worker"]
            if rec is not None and rec.deltas and rec.num_tokens > len(rec.deltas):
                # A chunk can carry several tokens (text held back for a multi-byte character):
                # the last delta takes the tokens the chunks did not account for.
                t, n = rec.deltas[-1]
                rec.deltas[-1] = (t, n + rec.num_tokens - len(rec.deltas))

        for i in range(warmup):
            await stream(list(work[i % len(work)].prompt[:32]), 4, None, time.monotonic())
        bar = _progress(progress, label, len(work))
        t0 = time.monotonic()

        async def one(item: WorkItem, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
            rec.arrival_s = time.monotonic() - t0
            try:
                await stream(item.prompt, item.max_tokens, rec, t0)
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            if bar is not None:
                bar[0].advance(bar[1])

        try:
            await asyncio.gather(*(one(w, r) for w, r in zip(work, records)))
        finally:
            if bar is not None:
                bar[0].stop()
        wall = time.monotonic() - t0
    return ServeRun(label, records, [], wall, {})


def replay_openai(url: str, work: Sequence[WorkItem], *, endpoint: str = "completions", model: str | None = None,
                  label: str = "openai", timeout_s: float = 600.0, progress: bool = True,
                  warmup: int = 2) -> ServeRun:
    return asyncio.run(_replay_openai(url, work, endpoint=endpoint, model=model, label=label,
                                      timeout_s=timeout_s, progress=progress, warmup=warmup))


def _progress(enabled: bool, label: str, total: int):
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=False)
    bar.start()
    return bar, bar.add_task(label, total=total)


def _sample(t: float, st) -> dict:
    return {"t": t, "router_queue": st.router_queue_depth, "in_flight": st.totals.in_flight,
            "workers": {w.worker_id: {"active": w.active_requests, "queue": w.queue_depth,
                                      "free_blocks": w.free_kv_blocks, "total_blocks": w.total_kv_blocks}
                        for w in st.workers}}


def replay(address: str, work: Sequence[WorkItem], *, label: str = "run", timeout_s: float = 600.0,
           status_interval_s: float = 0.5, progress: bool = True, warmup: int = 2) -> ServeRun:
    """Send ``work`` to the router at ``address`` at its arrival times; every request's record."""
    return asyncio.run(_replay(address, work, label=label, timeout_s=timeout_s,
                               status_interval_s=status_interval_s, progress=progress, warmup=warmup))


def cluster_limits(address: str) -> tuple[int, int]:
    """(max prompt tokens, max output tokens) every worker's KV pool can hold for one request
    under GUARANTEED_NO_EVICT: the smallest pool, half to the prompt, a quarter to the output."""
    from pdserve.cluster.client import Client

    with Client(address) as client:
        st = client.status()
    pool = min(w.total_kv_blocks * max(1, w.tokens_per_block) for w in st.workers)
    return pool // 2, pool // 4


# ---------------------------------------------------------------------------- clusters

def launch_layout(layout: str, engine: dict[str, Any], *, model: str | None = None):
    from pdserve.cluster.launch import LaunchConfig, launch
    from pdserve.cluster.router import RouterConfig

    num_ctx, num_gen = LAYOUTS[layout]
    return launch(LaunchConfig(model=model, num_context_workers=num_ctx, num_generation_workers=num_gen,
                               engine=dict(engine), router=RouterConfig(port=0)))


def run_layouts(layouts: Sequence[str], engine: dict[str, Any], spec: WorkloadSpec, *,
                model: str | None = None, progress: bool = True, warmup: int = 2,
                status_interval_s: float = 0.5, num_cpus: int | None = None) -> tuple[list[WorkItem], dict[str, ServeRun]]:
    """Launch each layout in turn on one Ray instance, replay the same slice, shut it down."""
    import ray

    from pdserve.cluster.launch import ensure_ray

    owns = ensure_ray(num_cpus=num_cpus or max(4, os.cpu_count() or 1))
    runs: dict[str, ServeRun] = {}
    work: list[WorkItem] | None = None
    try:
        for layout in layouts:
            cluster = launch_layout(layout, engine, model=model)
            try:
                address = f"127.0.0.1:{cluster.port}"
                if work is None:
                    work = _fit_work(spec, address)
                runs[layout] = replay(address, work, label=layout, progress=progress, warmup=warmup,
                                      status_interval_s=status_interval_s)
            finally:
                cluster.shutdown()
    finally:
        if owns:
            ray.shutdown()
    return work or [], runs


def _fit_work(spec: WorkloadSpec, address: str) -> list[WorkItem]:
    max_in, max_out = cluster_limits(address)
    spec = WorkloadSpec(**{**asdict(spec), "max_input_len": min(spec.max_input_len, max_in),
                           "max_output_len": min(spec.max_output_len, max_out)})
    return build_workload(spec)[0]


# ---------------------------------------------------------------------------- reporting

def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "gpu": _gpu_name()}


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def _fmt(d: dict, key: str) -> str:
    return " / ".join("-" if math.isnan(d[key][q]) else f"{d[key][q]:.1f}" for q in ("p50", "p90", "p99"))


TABLE_ROWS = [
    ("requests ok / sent", lambda s: f"{s['completed']} / {s['requests']}"),
    ("TTFT p50/p90/p99 ms", lambda s: _fmt(s, "ttft_ms")),
    ("TPOT p50/p90/p99 ms", lambda s: _fmt(s, "tpot_ms")),
    ("ITL p50/p90/p99 ms", lambda s: _fmt(s, "itl_ms")),
    ("E2E p50/p90/p99 ms", lambda s: _fmt(s, "e2e_ms")),
    ("throughput req/s", lambda s: f"{s['throughput']['requests_per_s']:.2f}"),
    ("output tokens/s", lambda s: f"{s['throughput']['output_tokens_per_s']:.1f}"),
    ("goodput req/s (SLO met)", lambda s: f"{s['goodput_rps']:.2f} ({100 * s['slo_attainment']:.0f}%)"),
    ("KV transfers / GB moved", lambda s: f"{s['kv_transfer']['transfers']} / {s['kv_transfer']['bytes'] / 1e9:.4f}"),
    ("KV transfer GB/s (per transfer)", lambda s: f"{s['kv_transfer']['gb_per_s']:.3f}"),
    ("pauses (requests paused)", lambda s: f"{s['pauses']} ({s['paused_requests']})"),
    ("local prefills", lambda s: str(s["local_prefills"])),
    ("duration s", lambda s: f"{s['duration_s']:.1f}"),
]


def print_table(title: str, summaries: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("figure")
    for name in summaries:
        table.add_column(LAYOUT_TITLES.get(name, name), justify="right")
    for label, fn in TABLE_ROWS:
        table.add_row(label, *(fn(s) for s in summaries.values()))
    Console(width=max(100, 40 + 28 * len(summaries))).print(table)


def write_outputs(kind: str, runs: dict[str, ServeRun], work: Sequence[WorkItem], spec: WorkloadSpec,
                  engine: dict, slo: Slo, out_dir: Path | None, json_path: str | None) -> dict[str, dict]:
    from pdserve.bench.plots import write_figures

    summaries = {name: summarize(run.records, slo) for name, run in runs.items()}
    figures: list[str] = []
    if out_dir is not None:
        figures = [str(p) for p in write_figures(
            out_dir, {n: r.records for n, r in runs.items()}, {n: r.samples for n, r in runs.items()},
            title=f"{spec.trace} [{spec.start}:{spec.start + spec.num_requests}]")]
    if json_path:
        doc = {
            "benchmark": f"bench {kind}", "machine": machine_info(), "workload": asdict(spec),
            "offered_rate_rps": mean_rate(work) if work else None, "engine": engine,
            "slo": asdict(slo), "figures": figures,
            "runs": {name: {"summary": summaries[name], "wall_s": run.wall_s,
                            "status_samples": run.samples, "final_status": run.final_status,
                            "requests": [r.to_dict() for r in run.records]}
                     for name, run in runs.items()},
        }
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(doc, indent=1, default=_json_default))
    return summaries


def _json_default(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return str(value)


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
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="a running cluster's gRPC port")
    serve.add_argument("--launch", choices=sorted(LAYOUTS), default=None,
                       help="launch this layout on an embedded Ray cluster instead (built-in tiny model)")
    compare = sub.add_parser("compare", help="1P1D vs 1 colocated vs 2 colocated on the same slice")
    compare.add_argument("--layouts", default="1P1D,colocated,colocated-x2")
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
                                            progress=progress, warmup=args.warmup)}
        elif args.port is None and args.launch is None:
            parser.error("bench serve needs --port (a running cluster) or --launch LAYOUT")
        elif args.port is not None:
            address = f"{args.host}:{args.port}"
            work = _fit_work(spec, address)
            runs = {"cluster": replay(address, work, label="cluster", progress=progress, warmup=args.warmup,
                                      status_interval_s=args.status_interval)}
        else:
            work, runs = run_layouts([args.launch], engine, spec, model=args.model, progress=progress,
                                     warmup=args.warmup, status_interval_s=args.status_interval)
    else:
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        unknown = [x for x in layouts if x not in LAYOUTS]
        if unknown:
            parser.error(f"unknown layouts {unknown}; known: {sorted(LAYOUTS)}")
        work, runs = run_layouts(layouts, engine, spec, model=args.model, progress=progress,
                                 warmup=args.warmup, status_interval_s=args.status_interval)
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

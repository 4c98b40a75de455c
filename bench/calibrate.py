"""``pdserve simulate validate``: calibrate the cost model to this machine from measurements,
then check the simulator against the live cluster on the same trace slice.

1. Step costs. The in-process engine (the built-in tiny model, the cluster's engine settings,
   one torch thread as in the worker actors) runs a sweep of batches: single prefills of 8-512
   tokens, decode batches of 1-16 sequences at several context lengths, and a mixed stream.
   Each step is timed; ``cost_model.calibrate`` fits step overhead, per-sequence overhead,
   seconds per FLOP and per byte (non-negative least squares on relative error).
2. The cluster. Probes sent one at a time through gRPC to the launched cluster, by the same
   client code as the replay, before and after it (pooled), measure what the in-process engine
   cannot see:
   - decode steps inside the worker actor: ``e2e - TTFT`` for 4- and 20-token requests; its slope
     over tokens is the actor's decode step at batch 1, and the difference to the fitted model is
     added to the step overhead (the actor's loop, streaming and metrics cost per step);
   - the hop (client -> router -> worker, one way): ``(TTFT - prefill step) / 2`` over the
     short-prompt probes;
   - the prefill inside the actor: ``TTFT - 2 hops`` of 448-token prompts; the fitted FLOP and
     byte rates are scaled so the model's prefill matches (alternating with the two above);
   - the KV link (1P1D): latency and bandwidth fitted to the per-transfer bytes and seconds the
     router reports for 64- and 448-token prompts; the rest of the hand-off (control round
     trip) is what ``e2e - TTFT`` leaves after hops, transfer and decode steps.
3. Drift. This machine is shared: its load changes from minute to minute. A CPU gauge samples
   the kernel's count of runnable tasks R twenty times a second throughout; a CPU-bound step
   runs about max(1, R / cores) times slower than alone, and the ratio of that slowdown's mean
   during the replay to its mean during the probes stretches every simulated step, hop and
   transfer alike (``--no-load-gauge`` turns this off).
4. Serving load (optional, ``--serving-fit``). While serving, the workers share the machine's
   cores with each other, the router, the client and anything else running, so steps can take
   longer than a probe's. A calibration slice of the same trace, disjoint from the validated one
   (by default the rows right after it), is replayed; one factor on every step time and one extra
   hop delay are fitted so the simulator reproduces its TPOT and TTFT p50.
5. The validated slice is replayed against the cluster (``bench serve``'s client) and simulated
   with the calibrated model; TTFT and TPOT p50 (and more) are printed side by side with the
   relative error, against the tolerance (25% by default).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from pdserve.bench.cost_model import CostModel, LinkSpec, ModelShape, SeqWork, calibrate
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.simulator import ClusterSpec, Latency, WorkerSpec, simulate
from pdserve.bench.workload import WorkItem, mean_rate


# ---------------------------------------------------------------------------- step timing

class _ShapeCapture:
    """Wraps the executor's scheduler and keeps the batch of the latest step (reuse is off in
    the calibration engine, so positions at scheduling time are the computed ones)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.last: list[SeqWork] = []

    def schedule(self, active_requests, inflight_request_ids=None):
        out = self.scheduler.schedule(active_requests, inflight_request_ids)
        self.last = [SeqWork(r.context_chunk_size, r.context_current_position,
                             r.context_current_position + r.context_chunk_size >= r.prompt_len)
                     for r in out.context_requests if r.context_chunk_size > 0]
        self.last += [SeqWork(1, r.get_num_tokens(0) - 1, True) for r in out.generation_requests]
        return out

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)


def measure_steps(model_dir: str | Path, engine: dict[str, Any], *, repeats: int = 2,
                  seed: int = 0) -> list[tuple[list[SeqWork], float]]:
    """Timed steps of the in-process engine over a sweep of batch shapes."""
    import torch

    from pdserve.workers.engine import LLMEngine
    from pdserve.workers.sampling import SamplingParams

    torch.set_num_threads(1)  # the worker actors run one torch thread each (LaunchConfig)
    llm = LLMEngine(model_dir, **{**engine, "enable_block_reuse": False})
    capture = _ShapeCapture(llm.executor.scheduler)
    llm.executor.scheduler = capture
    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size
    max_prompt = min(512, engine.get("max_num_tokens", 512))
    samples: list[tuple[list[SeqWork], float]] = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def drain(record: bool = True) -> None:
        while llm.has_unfinished:
            t0 = time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t0
            if record and capture.last:
                samples.append((list(capture.last), dt))

    def add(n: int, out: int) -> None:
        llm.add_request(prompt(n), SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))

    for _ in range(3):  # warm-up
        add(64, 4)
    drain(record=False)
    for _ in range(repeats):
        for n in (8, 16, 32, 64, 128, 192, 256, 384, max_prompt):
            add(n, 1)
            drain()
        for b in (1, 2, 4, 8, 12, 16):
            for ctx in (32, 160, 400):
                for _ in range(b):
                    add(ctx, 8)
                drain()
        # A mixed stream: arrivals while others decode give context + generation batches.
        for i in range(40):
            add(rng.randint(8, 300), rng.randint(2, 24))
            t0 = time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t0
            if capture.last:
                samples.append((list(capture.last), dt))
        drain()
    return samples


# ---------------------------------------------------------------------------- cluster probes

PROBE_GAP_S = 0.3  # probes are spaced so each runs alone on the cluster


def probe_work(vocab: int, n: int, *, disaggregated: bool, seed: int) -> list[WorkItem]:
    """Requests sent one at a time: n each of (32-token prompt, 1 token), (64, 4), (64, 20) and
    (448, 2): short prefills for the hop, two decode lengths for the decode step, a long prefill
    for the prefill cost (and, disaggregated, a second transfer size)."""
    rng = random.Random(seed)
    kinds = [(32, 1), (64, 4), (64, 20), (448, 2)]
    items = []
    for i in range(n * len(kinds)):
        length, out = kinds[i % len(kinds)]
        items.append(WorkItem(i, i * PROBE_GAP_S, [rng.randrange(3, vocab) for _ in range(length)], out))
    return items


def _rescale_rates(cost: CostModel, factor: float) -> CostModel:
    """Token-proportional costs (FLOPs, bytes) ``factor`` times as expensive; overheads kept."""
    hw = cost.hardware
    return replace(cost, hardware=replace(hw, peak_flops=hw.peak_flops / factor, mem_bw=hw.mem_bw / factor))


def analyse_probes(records, cost: CostModel, *, disaggregated: bool, rounds: int = 4) -> dict[str, Any]:
    """From probe records (same client path as the replay), inside the worker actors: the decode
    step, the long prefill, the hop and (disaggregated) the link and control overhead. The
    in-process fit keeps its shape; its token-proportional rates are scaled to the actor's
    448-token prefill and its step overhead shifted to the actor's decode step (alternately,
    since each moves the other). Returns the adjusted cost model and latencies."""
    ok = [r for r in records if r.ok]
    by_kind: dict[tuple[int, int], list] = {}
    for r in ok:
        by_kind.setdefault((r.prompt_len, r.max_tokens), []).append(r)
    gap = lambda r: (r.finish_s - r.first_token_s)  # noqa: E731
    # The actor's decode step at batch 1 (~64 tokens of context): slope of e2e - TTFT over tokens.
    d4 = statistics.median(gap(r) for r in by_kind[(64, 4)])
    d20 = statistics.median(gap(r) for r in by_kind[(64, 20)])
    d_meas = (d20 - d4) / (20 - 4)
    ttft448 = statistics.median(r.ttft_ms / 1000 for r in by_kind[(448, 2)])
    decode, long_prefill = [SeqWork(1, 70, True)], [SeqWork(448, 0, True)]
    d_model = cost.step_time(decode)
    adjusted, hop, rate_factor = cost, 0.0, 1.0
    for _ in range(rounds):
        hw = adjusted.hardware
        adjusted = replace(adjusted, hardware=replace(
            hw, step_overhead_s=max(0.0, hw.step_overhead_s + d_meas - adjusted.step_time(decode))))
        # TTFT of a request sent alone = hop + its prefill step + hop; the short prompts give the
        # hop (their prefill is a small share), the 448-token one the prefill cost.
        hop = max(0.0, statistics.median(
            (r.ttft_ms / 1000 - adjusted.step_time([SeqWork(r.prompt_len, 0, True)])) / 2
            for r in ok if r.prompt_len <= 64))
        fixed = adjusted.hardware.step_overhead_s + adjusted.hardware.seq_overhead_s
        var = adjusted.step_time(long_prefill) - fixed
        want = ttft448 - 2 * hop - fixed
        if var > 0 and want > 0:
            k = min(4.0, max(0.25, want / var))
            rate_factor *= k
            adjusted = _rescale_rates(adjusted, k)
    ttft1 = statistics.median(r.ttft_ms / 1000 for r in by_kind[(32, 1)])
    out: dict[str, Any] = {"probes": len(ok), "decode_step_actor_ms": 1000 * d_meas,
                           "decode_step_model_ms": 1000 * d_model,
                           "prefill448_actor_ms": 1000 * (ttft448 - 2 * hop),
                           "prefill448_model_ms": 1000 * cost.step_time(long_prefill),
                           "rate_factor": rate_factor,
                           "step_overhead_added_ms": 1000 * (adjusted.hardware.step_overhead_s
                                                             - cost.hardware.step_overhead_s),
                           "ttft_1token_ms": 1000 * ttft1, "hop_ms": 1000 * hop}
    link, control = LinkSpec(), 0.0
    transfers = [(r.kv_bytes, r.kv_ms / 1000) for r in ok if r.kv_bytes > 0]
    if disaggregated and transfers:
        link = _fit_link(transfers)
        small = [r.kv_ms / 1000 for r in by_kind[(64, 4)] if r.kv_bytes > 0]
        xfer = statistics.median(small) if small else 0.0
        # e2e - TTFT of a 4-token request: hop to the generation worker, control round trip,
        # transfer, 3 decode steps, hop back.
        control = max(0.0, d4 - 2 * hop - xfer - 3 * adjusted.step_time(decode))
        out.update(link_gb_per_s=link.bytes_per_s / 1e9, link_latency_ms=1000 * link.latency_s,
                   kv_control_ms=1000 * control, transfers=len(transfers))
    out["cost"] = adjusted
    out["latency"] = Latency(hop_s=hop, kv_control_s=control)
    out["link"] = link
    return out


def _fit_link(transfers: Sequence[tuple[int, float]]) -> LinkSpec:
    """seconds = latency + bytes / bandwidth, least squares over the measured transfers."""
    xs = [b for b, _ in transfers]
    ys = [s for _, s in transfers]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return LinkSpec(bytes_per_s=mx / my if my > 0 else math.inf, latency_s=0.0)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    if slope <= 0:
        return LinkSpec(bytes_per_s=mx / my if my > 0 else math.inf, latency_s=0.0)
    return LinkSpec(bytes_per_s=1.0 / slope, latency_s=max(0.0, my - slope * mx))


class CpuGauge:
    """How contended this machine's CPUs are: a thread samples the kernel's count of runnable
    tasks (``procs_running`` in /proc/stat) every ``interval_s``. With R runnable tasks on C
    cores a CPU-bound step runs about max(1, R / C) times slower than alone; the ratio of that
    slowdown's mean over two windows says how much slower steps ran in one than in the other
    (other jobs on the machine, and the cluster's own processes competing for the cores)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        import threading

        self.cores = os.cpu_count() or 1
        self.samples: list[tuple[float, int]] = []  # (wall time, runnable tasks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                with open("/proc/stat") as f:
                    for line in f:
                        if line.startswith("procs_running"):
                            # this sampling thread is one of them
                            self.samples.append((time.time(), max(0, int(line.split()[1]) - 1)))
                            break
            except OSError:
                return

    def slowdown(self, windows: Sequence[tuple[float, float]]) -> float:
        xs = [max(1.0, (r + 1) / self.cores) for t, r in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(xs) if xs else math.nan

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def scaled_cost(cost: CostModel, factor: float) -> CostModel:
    """Every step ``factor`` times as long (overheads up, rates down)."""
    hw = cost.hardware
    return replace(cost, hardware=replace(
        hw, step_overhead_s=hw.step_overhead_s * factor, seq_overhead_s=hw.seq_overhead_s * factor,
        peak_flops=hw.peak_flops / factor, mem_bw=hw.mem_bw / factor))


def fit_serving(cost: CostModel, cluster: ClusterSpec, work: Sequence[WorkItem], measured: dict,
                slo: Slo, rounds: int = 4) -> tuple[CostModel, ClusterSpec, dict[str, float]]:
    """Under load the workers share this machine's cores with each other, the router, the
    client and whatever else runs, so a step while serving takes longer than a probe's step
    alone. On a calibration slice (disjoint from the validated one) fit one factor on every step
    time (to its measured TPOT p50) and one extra hop delay (to its TTFT p50), alternately."""
    factor, hop = 1.0, cluster.latency.hop_s
    for _ in range(rounds):
        s = simulate(replace(cluster, latency=replace(cluster.latency, hop_s=hop)),
                     scaled_cost(cost, factor), work).summary(slo)
        if s["tpot_ms"]["p50"] > 0 and measured["tpot_ms"]["p50"] > 0:
            factor *= measured["tpot_ms"]["p50"] / s["tpot_ms"]["p50"]
        s = simulate(replace(cluster, latency=replace(cluster.latency, hop_s=hop)),
                     scaled_cost(cost, factor), work).summary(slo)
        hop = max(0.0, hop + (measured["ttft_ms"]["p50"] - s["ttft_ms"]["p50"]) / 2000.0)
    fitted = replace(cluster, latency=replace(cluster.latency, hop_s=hop))
    return scaled_cost(cost, factor), fitted, {"step_factor": factor, "hop_ms": 1000 * hop,
                                                "hop_added_ms": 1000 * (hop - cluster.latency.hop_s)}


# ---------------------------------------------------------------------------- the validation

def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.bench.serve import add_workload_arguments

    add_workload_arguments(parser, num_requests=80)
    parser.add_argument("--layouts", default="1P1D,colocated", help="cluster layouts to validate")
    parser.add_argument("--calibration-start", type=int, default=None,
                        help="first row of the calibration slice (default: right after the validated one)")
    parser.add_argument("--serving-fit", action="store_true",
                        help="also fit a step factor and a hop delay on a calibration slice (step 3); "
                             "off by default: on a machine shared with other jobs the load drifts "
                             "between slices and the fit can overshoot")
    parser.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the calibration sweep")
    parser.add_argument("--probes", type=int, default=8, help="probe requests per kind, before and after")
    parser.add_argument("--tolerance", type=float, default=0.25)
    parser.add_argument("--no-load-gauge", action="store_true",
                        help="do not correct for the CPU share measured during the replay vs the probes")
    parser.add_argument("--out-dir", default="bench/out/validate")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--no-progress", action="store_true")


def run_validation(args) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from pdserve.bench.plots import write_figures
    from pdserve.bench.serve import LAYOUTS, _fit_work, launch_layout, machine_info, parse_engine, replay, workload_from_args
    from pdserve.cluster.launch import builtin_model_dir, ensure_ray

    spec, slo = workload_from_args(args)
    engine = parse_engine(args.engine)
    model_dir = builtin_model_dir()
    shape = ModelShape.from_hf_config(model_dir, dtype_bytes=4)  # fp32 on CPU
    print(f"1/3 calibrating step costs on the in-process engine ({shape.name}) ...", flush=True)
    samples = measure_steps(model_dir, engine, repeats=args.repeats, seed=args.seed)
    fit = calibrate(shape, samples, name="this-cpu")
    base_cost = CostModel(shape, fit.hardware)
    print(f"    {fit.num_samples} steps: overhead {1e3 * fit.coefficients['step']:.2f} ms/step, "
          f"{1e3 * fit.coefficients['seq']:.3f} ms/sequence, {_rate(fit.hardware.peak_flops, 'FLOP/s')}, "
          f"{_rate(fit.hardware.mem_bw, 'B/s')}; fit rel. RMSE {100 * fit.rel_rmse:.1f}%", flush=True)

    owns = ensure_ray(num_cpus=max(4, os.cpu_count() or 1))
    gauge = CpuGauge() if not args.no_load_gauge else None
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    measured, probes, work = {}, {}, None
    cal_spec = replace(spec, start=args.calibration_start if args.calibration_start is not None
                       else spec.start + spec.num_requests)
    cal_measured, cal_work = {}, None
    try:
        for layout in layouts:
            print(f"2/3 {layout}: launching, probing, replaying the slice ...", flush=True)
            cluster = launch_layout(layout, engine)
            try:
                address = f"127.0.0.1:{cluster.port}"
                if work is None:
                    work = _fit_work(spec, address)
                disagg = LAYOUTS[layout][0] > 0
                # Probes before and after the replay, pooled: the machine's load drifts.
                pw = probe_work(spec.vocab[1], args.probes, disaggregated=disagg, seed=args.seed + 1)
                t0 = time.time()
                before = replay(address, pw, label=f"probe-a-{layout}", progress=False)
                t1 = time.time()
                if cal_work is None and args.serving_fit:
                    cal_work = _fit_work(cal_spec, address)
                if args.serving_fit:
                    cal_measured[layout] = replay(address, cal_work, label=f"calibration {layout}",
                                                  progress=not args.no_progress, warmup=0)
                t2 = time.time()
                measured[layout] = replay(address, work, label=f"measured {layout}",
                                          progress=not args.no_progress, warmup=0)
                t3 = time.time()
                after = replay(address, pw, label=f"probe-b-{layout}", progress=False, warmup=0)
                t4 = time.time()
                probes[layout] = analyse_probes(before.records + after.records, base_cost,
                                                disaggregated=disagg)
                if gauge is not None:
                    at_probes = gauge.slowdown([(t0, t1), (t3, t4)])
                    at_replay = gauge.slowdown([(t2, t3)])
                    probes[layout]["cpu_slowdown"] = {"probes": at_probes, "replay": at_replay}
                    probes[layout]["load_factor"] = at_replay / at_probes if at_probes > 0 else 1.0
            finally:
                cluster.shutdown()
    finally:
        if gauge is not None:
            gauge.close()
        if owns:
            ray.shutdown()

    print("3/3 simulating the same slice with the calibrated model ...", flush=True)
    for layout in layouts:
        c = probes[layout].get("cpu_slowdown")
        if c:
            print(f"    {layout}: CPU slowdown {c['probes']:.2f}x during the probes, {c['replay']:.2f}x "
                  f"during the replay: steps, hops and transfers x{probes[layout]['load_factor']:.2f}")
    rows, doc_layouts, sim_records = [], {}, {}
    ok = True
    for layout in layouts:
        p = probes[layout]
        num_ctx, num_gen = LAYOUTS[layout]
        worker = WorkerSpec.from_engine(engine, max_seq_len=shape.max_seq_len,
                                        num_kv_blocks=engine.get("num_kv_blocks") or 256)
        cluster = ClusterSpec(num_ctx, num_gen, worker, worker, link=p["link"], latency=p["latency"])
        cost = p["cost"]
        probe_only = simulate(cluster, cost, work).summary(slo)
        load = p.get("load_factor", 1.0)
        if load and math.isfinite(load) and load != 1.0:
            # The replay ran with more (or less) CPU to go round than the probes: every step and
            # hop stretches alike. The transfer and its control messages too, as CPU work here.
            cost = scaled_cost(cost, load)
            lat = cluster.latency
            cluster = replace(cluster, latency=Latency(lat.hop_s * load, lat.kv_control_s * load),
                              link=replace(cluster.link, bytes_per_s=cluster.link.bytes_per_s / load,
                                           latency_s=cluster.link.latency_s * load))
        serving_fit = None
        if layout in cal_measured:
            cost, cluster, serving_fit = fit_serving(cost, cluster, cal_work,
                                                     summarize(cal_measured[layout].records, slo), slo)
        sim = simulate(cluster, cost, work)
        sim_records[layout] = sim.records
        m_sum = summarize(measured[layout].records, slo)
        s_sum = sim.summary(slo)
        checks = {}
        for metric in ("ttft_ms", "tpot_ms"):
            mv, sv = m_sum[metric]["p50"], s_sum[metric]["p50"]
            err = _rel(sv, mv)
            checks[metric] = {"measured": mv, "simulated": sv, "rel_error": err,
                              "within": abs(err) <= args.tolerance}  # NaN (nothing measured) fails
            ok &= checks[metric]["within"]
        rows.append((layout, m_sum, s_sum, checks))
        doc_layouts[layout] = {
            "probe": {k: v for k, v in p.items() if k not in ("cost", "latency", "link")},
            "serving_fit": serving_fit,
            "calibration_slice": summarize(cal_measured[layout].records, slo) if layout in cal_measured else None,
            "hardware": cost.hardware.to_dict(), "latency": asdict(cluster.latency),
            "link": asdict(cluster.link), "measured": m_sum, "simulated": s_sum,
            "simulated_probes_only": {k: probe_only[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms")},
            "checks": checks,
        }
    if args.out_dir:
        runs = {}
        for layout in layouts:
            runs[f"measured {layout}"] = measured[layout].records
            runs[f"simulated {layout}"] = sim_records[layout]
        write_figures(Path(args.out_dir), runs, {f"measured {l}": measured[l].samples for l in layouts},
                      title="validation: measured vs simulated")
    if args.json:
        doc = {"simulate": "validate", "machine": machine_info(), "workload": asdict(spec),
               "calibration_workload": asdict(cal_spec),
               "offered_rate_rps": mean_rate(work), "engine": engine, "slo": asdict(slo),
               "calibration": {"samples": fit.num_samples, "coefficients": fit.coefficients,
                               "rel_rmse": fit.rel_rmse, "hardware": fit.hardware.to_dict()},
               "tolerance": args.tolerance, "layouts": doc_layouts, "passed": ok}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    _print_validation(rows, args.tolerance, work)
    return 0 if ok else 1


def _rel(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured if measured else math.nan


def _rate(value: float, unit: str) -> str:
    if math.isinf(value):
        return f"(no {unit} term)"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def _print_validation(rows, tolerance: float, work: Sequence[WorkItem]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"simulated vs measured on the same slice ({len(work)} requests, "
                        f"{mean_rate(work):.2f} req/s offered); tolerance {100 * tolerance:.0f}% on p50")
    for col in ("layout", "figure", "measured", "simulated", "error"):
        table.add_column(col, justify="right")
    for layout, m, s, checks in rows:
        for metric, name in (("ttft_ms", "TTFT p50 ms"), ("tpot_ms", "TPOT p50 ms")):
            c = checks[metric]
            mark = "ok" if c["within"] else "OUT"
            table.add_row(layout, name, f"{c['measured']:.2f}", f"{c['simulated']:.2f}",
                          f"{100 * c['rel_error']:+.1f}% {mark}")
        for metric, q, name in (("ttft_ms", "p90", "TTFT p90 ms"), ("tpot_ms", "p90", "TPOT p90 ms"),
                                ("e2e_ms", "p50", "E2E p50 ms")):
            mv, sv = m[metric][q], s[metric][q]
            table.add_row(layout, name, f"{mv:.2f}", f"{sv:.2f}", f"{100 * _rel(sv, mv):+.1f}%")
        mt, st = m["throughput"]["output_tokens_per_s"], s["throughput"]["output_tokens_per_s"]
        table.add_row(layout, "output tokens/s", f"{mt:.1f}", f"{st:.1f}", f"{100 * _rel(st, mt):+.1f}%")
        table.add_section()
    Console(width=110).print(table)

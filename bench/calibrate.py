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

This module: the validation driver (``add_arguments``, ``run_validation``) and its table. The
measurements are in ``calibrate_measure.py``, the fits in ``calibrate_fit.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

from pdserve.bench.calibrate_fit import analyse_probes, fit_serving, scaled_cost
from pdserve.bench.calibrate_measure import CpuGauge, measure_steps, probe_work
from pdserve.bench.cost_model import CostModel, ModelShape, calibrate
from pdserve.bench.metrics import summarize
from pdserve.bench.simulator import simulate
from pdserve.bench.simulator_spec import ClusterSpec, Latency, WorkerSpec
from pdserve.bench.workload import WorkItem, mean_rate


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
    from pdserve.bench.serve import (
        LAYOUTS, _fit_work, kv_transfer_mode, launch_layout, parse_engine, workload_from_args,
    )
    from pdserve.bench.serve_replay import replay
    from pdserve.bench.serve_report import machine_info
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

    for layout in layouts:
        # A layer-wise transfer's seconds include waiting for the forward, so its probes cannot
        # measure the link: it takes the link and the control round trip of the after-prefill
        # layout of the same run (the simulator adds the overlap itself).
        base = layout.removesuffix("-layerwise")
        if kv_transfer_mode(layout) == "layerwise":
            if base in probes:
                probes[layout]["link"] = probes[base]["link"]
                probes[layout]["latency"] = replace(
                    probes[layout]["latency"], kv_control_s=probes[base]["latency"].kv_control_s)
            else:
                print(f"    {layout}: no {base} run to take the KV link from; its own probes "
                      "(transfer seconds include waiting for the forward) are used", flush=True)
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
        cluster = ClusterSpec(num_ctx, num_gen, worker, worker, link=p["link"], latency=p["latency"],
                              kv_transfer_mode=kv_transfer_mode(layout))
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

"""The fits of ``pdserve simulate validate`` (steps 2 and 4 of ``bench/calibrate.py``): the cost
model and latencies adjusted to the probes inside the worker actors (``analyse_probes``), the KV
link (``_fit_link``), and the step factor and hop delay fitted to a serving slice
(``fit_serving``, with ``scaled_cost``).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any, Sequence

from pdserve.bench.cost_model import CostModel, LinkSpec, SeqWork
from pdserve.bench.metrics import Slo
from pdserve.bench.simulator import simulate
from pdserve.bench.simulator_spec import ClusterSpec, Latency
from pdserve.bench.workload import WorkItem


# ---------------------------------------------------------------------------- probes

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


# ---------------------------------------------------------------------------- serving load

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

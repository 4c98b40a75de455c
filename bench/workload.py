"""A trace slice turned into requests: arrival times (time-scaled, or Poisson at an override
rate), prompts synthesised at scaled lengths (Mooncake hash ids -> shared prefix blocks) and
output lengths. ``bench serve`` sends these over gRPC; the simulator replays the same list.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from pdserve.traces import LengthScale, TraceRequest, fit_scale, load_trace, synth_prompt


class WorkItem(NamedTuple):
    index: int
    arrival_s: float  # seconds after the first request of the slice
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    trace: str = "azure_llm_2023_conv.csv"
    num_requests: int = 100
    start: int = 0  # first trace row of the slice
    time_scale: float = 1.0  # arrival gaps are multiplied by this (0.5: twice the rate)
    rate: float | None = None  # requests/s: Poisson arrivals instead of the trace's (inf: all at once)
    max_input_len: int = 512
    max_output_len: int = 64
    min_output_len: int = 1
    vocab: tuple[int, int] = (3, 259)  # [low, high) token ids to draw prompts from
    seed: int = 0


def load_slice(spec: WorkloadSpec) -> list[TraceRequest]:
    rows = load_trace(spec.trace, spec.start + spec.num_requests)[spec.start:]
    if not rows:
        raise ValueError(f"trace {spec.trace} has no rows from {spec.start}")
    return rows


def arrivals(rows: Sequence[TraceRequest], spec: WorkloadSpec) -> list[float]:
    """Trace arrivals relative to the slice's first row, times ``time_scale``; or, with ``rate``,
    a seeded Poisson process (all at 0 for an infinite rate)."""
    if spec.rate is not None:
        if spec.rate <= 0:
            raise ValueError(f"rate must be > 0, got {spec.rate}")
        return poisson_arrivals(len(rows), spec.rate, spec.seed)
    if spec.time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {spec.time_scale}")
    t0 = rows[0].arrival_s
    return [(r.arrival_s - t0) * spec.time_scale for r in rows]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times of a Poisson process at ``rate`` per second, the first at 0; seeded."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def with_poisson_arrivals(items: Sequence[WorkItem], rate: float, seed: int = 0) -> list[WorkItem]:
    """The same requests (lengths, prompts) arriving as a Poisson process (DistServe's setup)."""
    return [w._replace(arrival_s=t) for w, t in zip(items, poisson_arrivals(len(items), rate, seed))]


def build_workload(spec: WorkloadSpec, rows: Sequence[TraceRequest] | None = None) -> tuple[list[WorkItem], LengthScale]:
    """The slice's requests. Lengths are scaled by one factor (95th percentile of prompts to
    ``max_input_len``, never up), then clamped, so relative sizes survive and everything fits."""
    rows = list(rows) if rows is not None else load_slice(spec)
    scale = fit_scale(rows, spec.max_input_len, spec.max_output_len)
    times = arrivals(rows, spec)
    items = []
    for i, (row, t) in enumerate(zip(rows, times)):
        prompt = synth_prompt(row, spec.start + i, scale, spec.vocab, seed=spec.seed)
        out = max(spec.min_output_len, scale.output_len(row.output_len))
        items.append(WorkItem(i, t, prompt, out))
    return items, scale


def mean_rate(items: Sequence[WorkItem]) -> float:
    """Requests per second over the slice's arrival span (inf when they all arrive at once)."""
    span = max(w.arrival_s for w in items) - min(w.arrival_s for w in items)
    return (len(items) - 1) / span if span > 0 else math.inf


def rescaled(items: Sequence[WorkItem], factor: float) -> list[WorkItem]:
    """The same requests with every arrival time multiplied by ``factor`` (0.5: twice the rate)."""
    return [w._replace(arrival_s=w.arrival_s * factor) for w in items]

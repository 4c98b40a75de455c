"""Per-request records and the figures computed from them, shared by ``bench serve`` (measured
over gRPC) and the simulator, so measured and simulated numbers are computed the same way.

TTFT: send -> first token. TPOT: (e2e - TTFT) / (tokens - 1), per request. ITL: the gap between
consecutive streamed deltas, spread over the tokens of the later delta. Goodput: requests per
second that meet both the TTFT and the TPOT SLO (a one-token request has no TPOT and meets it).
Percentiles interpolate linearly between order statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0


@dataclass(slots=True)
class RequestRecord:
    index: int
    arrival_s: float  # send time, seconds from the start of the run
    prompt_len: int
    max_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_tokens: int = 0
    # (time, tokens) of each streamed delta that carried tokens
    deltas: list[tuple[float, int]] = field(default_factory=list)
    queue_ms: float = 0.0
    server_ttft_ms: float = 0.0  # the router's own view (receipt -> first token sent)
    server_e2e_ms: float = 0.0
    kv_bytes: int = 0
    kv_ms: float = 0.0
    pauses: int = 0
    cached_tokens: int = 0
    # The prefill worker's cached prompt prefix: what the router's prefix index predicted when it
    # chose the worker, and what the worker reused (-1: not reported).
    predicted_tokens: int = 0
    reused_tokens: int = -1
    local_prefill: bool = False
    worker: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_s is not None and self.first_token_s is not None

    @property
    def ttft_ms(self) -> float:
        return 1000.0 * (self.first_token_s - self.arrival_s)

    @property
    def e2e_ms(self) -> float:
        return 1000.0 * (self.finish_s - self.arrival_s)

    @property
    def tpot_ms(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return 1000.0 * (self.finish_s - self.first_token_s) / (self.num_tokens - 1)

    def itls_ms(self) -> list[float]:
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.deltas, self.deltas[1:]):
            if n > 0:
                out.extend([1000.0 * (t1 - t0) / n] * n)
        return out

    def meets(self, slo: Slo) -> bool:
        tpot = self.tpot_ms
        return self.ok and self.ttft_ms <= slo.ttft_ms and (tpot is None or tpot <= slo.tpot_ms)

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__slots__ if name != "deltas"}
        d["deltas"] = [[round(t, 6), n] for t, n in self.deltas]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        rec = cls(**{k: v for k, v in d.items() if k != "deltas"})
        rec.deltas = [(float(t), int(n)) for t, n in d.get("deltas", ())]
        return rec


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 1]; linear interpolation between order statistics; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 0.5), "p90": percentile(values, 0.9),
            "p99": percentile(values, 0.99),
            "mean": sum(values) / len(values) if values else math.nan, "n": len(values)}


def summarize(records: Sequence[RequestRecord], slo: Slo, *, duration_s: float | None = None) -> dict:
    """The figures of one run. ``duration_s`` defaults to first send -> last finish."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = (max(r.finish_s for r in ok) - min(r.arrival_s for r in records)) if ok else 0.0
    duration_s = max(duration_s, 1e-9)
    ttft = [r.ttft_ms for r in ok]
    tpot = [t for t in (r.tpot_ms for r in ok) if t is not None]
    itl = [x for r in ok for x in r.itls_ms()]
    e2e = [r.e2e_ms for r in ok]
    good = sum(1 for r in ok if r.meets(slo))
    kv_bytes = sum(r.kv_bytes for r in ok)
    kv_s = sum(r.kv_ms for r in ok) / 1000.0
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "ttft_ms": dist(ttft),
        "tpot_ms": dist(tpot),
        "itl_ms": dist(itl),
        "e2e_ms": dist(e2e),
        "throughput": {
            "requests_per_s": len(ok) / duration_s,
            "output_tokens_per_s": sum(r.num_tokens for r in ok) / duration_s,
            "input_tokens_per_s": sum(r.prompt_len for r in ok) / duration_s,
        },
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "goodput_rps": good / duration_s,
        "slo_attainment": good / len(records) if records else math.nan,
        "kv_transfer": {
            "transfers": sum(1 for r in ok if r.kv_bytes > 0),
            "bytes": kv_bytes,
            "seconds": kv_s,
            "gb_per_s": (kv_bytes / 1e9) / kv_s if kv_s > 0 else 0.0,
            "gb_per_s_wall": (kv_bytes / 1e9) / duration_s,
        },
        "pauses": sum(r.pauses for r in ok),
        "paused_requests": sum(1 for r in ok if r.pauses),
        "local_prefills": sum(1 for r in ok if r.local_prefill),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "prefix": _prefix_figures(ok),
    }


def _prefix_figures(ok: Sequence[RequestRecord]) -> dict:
    """Prefix-cache hits on the prefill worker and how well the router predicted them."""
    reported = [r for r in ok if r.reused_tokens >= 0]
    prompt_tokens = sum(r.prompt_len for r in reported)
    return {
        "hit_rate": sum(r.reused_tokens for r in reported) / prompt_tokens if prompt_tokens else 0.0,
        "prediction_exact": (sum(r.predicted_tokens == r.reused_tokens for r in reported) / len(reported)
                             if reported else math.nan),
        "reported": len(reported),
    }


def throughput_series(records: Iterable[RequestRecord], bin_s: float = 1.0) -> dict[str, list[float]]:
    """Output tokens/s and completed requests/s per ``bin_s`` bin, from the delta times."""
    records = [r for r in records if r.ok]
    if not records:
        return {"t": [], "output_tokens_per_s": [], "requests_per_s": []}
    end = max(r.finish_s for r in records)
    n = int(end // bin_s) + 1
    tokens = [0.0] * n
    done = [0.0] * n
    for r in records:
        for t, k in r.deltas:
            tokens[min(n - 1, int(t // bin_s))] += k
        done[min(n - 1, int(r.finish_s // bin_s))] += 1
    return {"t": [i * bin_s for i in range(n)],
            "output_tokens_per_s": [x / bin_s for x in tokens],
            "requests_per_s": [x / bin_s for x in done]}

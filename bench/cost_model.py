"""Roofline step-time model for sizing: FLOPs and bytes of one executor step for a model shape,
on a hardware preset (H100, H200, A100) or on hardware calibrated from measured steps.

One step is a flat batch of sequences, each with ``new_tokens`` computed on top of ``past_len``
tokens already in the KV cache (a context chunk, or 1 for a decode step). Per device:

    t = step_overhead + seq_overhead * num_seqs + combine(flops / F, bytes / B) + allreduce

where ``combine`` is ``max`` (the roofline: compute and memory traffic overlap, as on a GPU) or
``sum`` (a calibrated CPU, where one thread does both in turn). Tensor parallelism splits FLOPs,
weights and KV over ``tp`` devices and adds two all-reduces of the activations per layer.

Pure stdlib: the simulator calls this once per simulated step.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence


class SeqWork(NamedTuple):
    """One sequence's share of a step."""

    new_tokens: int  # tokens computed this step (chunk size, or 1 when decoding)
    past_len: int  # tokens already in the KV cache
    logits: bool  # produces a token this step (last context chunk, or a decode)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family decoder's shape (what the FLOP and byte counts need)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    max_seq_len: int = 8192

    @property
    def linear_params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o + k, v
        return attn + 3 * h * self.intermediate_size  # gate, up, down

    @property
    def num_params(self) -> int:
        """Weights including the embedding table and the LM head (untied)."""
        return self.num_layers * self.linear_params_per_layer + 2 * self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights read on every step: all linear layers and the LM head (the embedding table is
        gathered row by row, so its traffic is negligible)."""
        return (self.num_layers * self.linear_params_per_layer
                + self.hidden_size * self.vocab_size) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, model_dir: str | Path, *, dtype_bytes: int = 4) -> ModelShape:
        """The shape of a local HF-format model (``config.json``); fp32 on CPU by default."""
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(
            name=Path(model_dir).name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            dtype_bytes=dtype_bytes,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
        )


# Meta's published configs (config.json of Meta-Llama-3-8B / -70B); bf16 weights and KV.
MODELS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-3-70b": ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
}


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One device. ``peak_flops`` and ``mem_bw`` are peaks; the efficiencies turn them into what
    a serving engine sustains. A calibrated spec has efficiencies of 1 (its rates are measured)."""

    name: str
    peak_flops: float  # dense FLOP/s in the serving dtype
    mem_bw: float  # bytes/s
    mem_bytes: float  # device memory
    interconnect_bw: float = 0.0  # bytes/s one way between devices of a TP group
    compute_efficiency: float = 1.0  # achieved fraction of peak FLOP/s (MFU)
    bandwidth_efficiency: float = 1.0  # achieved fraction of peak bandwidth (MBU)
    step_overhead_s: float = 0.0  # per step: scheduling, launch, sampling
    seq_overhead_s: float = 0.0  # per sequence in the batch (metadata, per-sequence kernels)
    allreduce_latency_s: float = 0.0
    overlap: bool = True  # roofline max(compute, memory); False: their sum

    @property
    def flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def bytes_per_s(self) -> float:
        return self.mem_bw * self.bandwidth_efficiency

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> HardwareSpec:
        inf_ok = ("peak_flops", "mem_bw")
        return cls(**{k: (math.inf if k in inf_ok and v is None else v) for k, v in d.items()})


# Datasheet peaks (dense BF16 tensor FLOP/s, HBM bandwidth, memory, NVLink one way). The
# efficiencies and the step overhead are assumptions of this model, not measurements: 60% MFU on
# large GEMMs, 80% of HBM bandwidth on weight/KV streaming, 0.5 ms per step of runtime overhead.
_EFF = dict(compute_efficiency=0.6, bandwidth_efficiency=0.8, step_overhead_s=0.5e-3,
            allreduce_latency_s=10e-6)
GPU_PRESETS: dict[str, HardwareSpec] = {
    "H100": HardwareSpec("H100", 989e12, 3.35e12, 80e9, interconnect_bw=450e9, **_EFF),
    "H200": HardwareSpec("H200", 989e12, 4.8e12, 141e9, interconnect_bw=450e9, **_EFF),
    "A100": HardwareSpec("A100", 312e12, 2.039e12, 80e9, interconnect_bw=300e9, **_EFF),
}


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """The KV-transfer link from a context worker to a generation worker (per device: a TP
    group sends its shards over its devices' links in parallel)."""

    bytes_per_s: float = 50e9  # 400 Gb/s (InfiniBand NDR) per device
    latency_s: float = 20e-6

    def transfer_time(self, nbytes: int, tp: int = 1) -> float:
        return self.latency_s + nbytes / (self.bytes_per_s * max(1, tp)) if nbytes > 0 else 0.0


class StepCost(NamedTuple):
    seconds: float
    flops: float  # whole step, all devices
    bytes: float  # per device


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelShape
    hardware: HardwareSpec
    tp: int = 1

    def step_flops(self, seqs: Iterable[SeqWork]) -> float:
        m = self.model
        linear = 2.0 * m.num_layers * m.linear_params_per_layer
        attn = 4.0 * m.num_layers * m.num_heads * m.head_dim  # QK^T and AV, per (query, key)
        head = 2.0 * m.hidden_size * m.vocab_size
        total = 0.0
        for s in seqs:
            n, p = s.new_tokens, s.past_len
            keys = n * p + n * (n + 1) / 2  # causal: query i sees p + i keys
            total += linear * n + attn * keys + (head if s.logits else 0.0)
        return total

    def step_bytes(self, seqs: Iterable[SeqWork]) -> float:
        """Per device: the streamed weights once, each sequence's KV read, the new KV written."""
        m = self.model
        kv = 0
        for s in seqs:
            kv += (s.past_len + 2 * s.new_tokens) * m.kv_bytes_per_token
        return (m.streamed_weight_bytes + kv) / self.tp

    def step(self, seqs: Sequence[SeqWork]) -> StepCost:
        if not seqs:
            return StepCost(0.0, 0.0, 0.0)
        hw = self.hardware
        flops = self.step_flops(seqs)
        nbytes = self.step_bytes(seqs)
        compute = flops / self.tp / hw.flops if hw.flops else 0.0
        memory = nbytes / hw.bytes_per_s if hw.bytes_per_s else 0.0
        body = max(compute, memory) if hw.overlap else compute + memory
        seconds = hw.step_overhead_s + hw.seq_overhead_s * len(seqs) + body
        if self.tp > 1:
            tokens = sum(s.new_tokens for s in seqs)
            size = tokens * self.model.hidden_size * self.model.dtype_bytes
            per_allreduce = 2.0 * (self.tp - 1) / self.tp * size / hw.interconnect_bw
            seconds += 2 * self.model.num_layers * (per_allreduce + hw.allreduce_latency_s)
        return StepCost(seconds, flops, nbytes)

    def step_time(self, seqs: Sequence[SeqWork]) -> float:
        return self.step(seqs).seconds

    def kv_block_bytes(self, tokens_per_block: int) -> int:
        return tokens_per_block * self.model.kv_bytes_per_token

    def num_kv_blocks(self, tokens_per_block: int, mem_fraction: float = 0.9) -> int:
        """KV blocks that fit a TP group's memory after the weights (``mem_fraction`` of device
        memory is usable; the rest is activations and workspace)."""
        free = self.hardware.mem_bytes * self.tp * mem_fraction - self.model.weight_bytes
        return max(0, int(free // self.kv_block_bytes(tokens_per_block)))


def min_tp(model: ModelShape, hardware: HardwareSpec, weight_fraction: float = 0.8) -> int:
    """The smallest power-of-two TP group whose memory holds the weights within
    ``weight_fraction`` (leaving room for KV)."""
    tp = 1
    while model.weight_bytes > hardware.mem_bytes * tp * weight_fraction:
        tp *= 2
        if tp > 64:
            raise ValueError(f"{model.name} does not fit 64 x {hardware.name}")
    return tp


# ---------------------------------------------------------------------------- calibration

class Calibration(NamedTuple):
    hardware: HardwareSpec
    coefficients: dict[str, float]  # seconds per unit of each feature
    rel_rmse: float  # root-mean-square relative error of the fit over the samples kept
    num_samples: int  # samples kept (the rest were preempted outliers)


FEATURES = ("step", "seq", "flop", "byte")


def _features(model: CostModel, seqs: Sequence[SeqWork]) -> list[float]:
    return [1.0, float(len(seqs)), model.step_flops(seqs), model.step_bytes(seqs)]


def calibrate(
    model: ModelShape, samples: Sequence[tuple[Sequence[SeqWork], float]], *, name: str = "calibrated",
    rounds: int = 3,
) -> Calibration:
    """Fit step overhead, per-sequence overhead, seconds per FLOP and seconds per byte to
    measured steps: non-negative least squares on relative error (every step counts alike, so
    small decode steps are fitted as well as long prefills). On a shared machine some steps are
    preempted; each round drops the steps whose relative residual exceeds 3x the median one
    (at least 15%) and refits, so the fit describes an unpreempted step. The result has
    ``overlap=False``: on a CPU thread compute and memory traffic add up. A zero coefficient
    means the feature explained nothing (its rate is then infinite)."""
    probe = CostModel(model, HardwareSpec(name, 1.0, 1.0, 0.0, overlap=False))
    rows = [(_features(probe, seqs), t) for seqs, t in samples if seqs and t > 0]
    if len(rows) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(rows)}")
    # Scale each column to unit size so the normal equations stay well conditioned.
    scale = [max(abs(x[j] / t) for x, t in rows) or 1.0 for j in range(len(FEATURES))]
    kept = rows
    for _ in range(max(1, rounds)):
        X = [[x[j] / t / scale[j] for j in range(len(FEATURES))] for x, t in kept]  # divided by t
        beta = _nnls(X, [1.0] * len(kept))  # t / t: relative error
        coef = [b / s for b, s in zip(beta, scale)]
        residual = [abs(sum(c * f for c, f in zip(coef, x)) / t - 1.0) for x, t in rows]
        limit = max(0.15, 3.0 * sorted(residual)[len(residual) // 2])
        next_kept = [row for row, r in zip(rows, residual) if r <= limit]
        if len(next_kept) < len(FEATURES) or len(next_kept) == len(kept):
            break
        kept = next_kept
    errors = [sum(c * f for c, f in zip(coef, x)) / t - 1.0 for x, t in kept]
    rel_rmse = math.sqrt(sum(e * e for e in errors) / len(errors))
    hw = HardwareSpec(
        name,
        peak_flops=1.0 / coef[2] if coef[2] > 0 else math.inf,
        mem_bw=1.0 / coef[3] if coef[3] > 0 else math.inf,
        mem_bytes=0.0,
        step_overhead_s=coef[0],
        seq_overhead_s=coef[1],
        overlap=False,
    )
    return Calibration(hw, dict(zip(FEATURES, coef)), rel_rmse, len(kept))


def _nnls(X: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: the best unconstrained solution over
    every subset of columns whose coefficients are all >= 0 (exact for small column counts)."""
    k = len(X[0])
    best, best_sse = [0.0] * k, sum(v * v for v in y)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = _lstsq([[row[j] for j in cols] for row in X], y)
        if sol is None or any(b < 0 for b in sol):
            continue
        full = [0.0] * k
        for j, b in zip(cols, sol):
            full[j] = b
        sse = sum((sum(f * c for f, c in zip(row, full)) - v) ** 2 for row, v in zip(X, y))
        if sse < best_sse - 1e-15:
            best, best_sse = full, sse
    return best


def _lstsq(X: list[list[float]], y: list[float]) -> list[float] | None:
    """Normal equations solved by Gaussian elimination with partial pivoting; None if singular."""
    k = len(X[0])
    A = [[sum(r[i] * r[j] for r in X) for j in range(k)] + [sum(r[i] * v for r, v in zip(X, y))]
         for i in range(k)]
    for c in range(k):
        pivot = max(range(c, k), key=lambda r: abs(A[r][c]))
        if abs(A[pivot][c]) < 1e-12:
            return None
        A[c], A[pivot] = A[pivot], A[c]
        for r in range(k):
            if r != c:
                f = A[r][c] / A[c][c]
                A[r] = [a - f * b for a, b in zip(A[r], A[c])]
    return [A[i][k] / A[i][i] for i in range(k)]


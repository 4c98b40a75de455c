"""Roofline step-time model for sizing: FLOPs and bytes of one core step for a model shape,
on a hardware preset (H100, H200, A100) or on hardware calibrated from measured steps.

One step is a flat batch of sequences, each with ``new_tokens`` computed on top of ``past_len``
tokens already in the KV cache (a context chunk, or 1 for a decode step). Per device:

    t = step_overhead + seq_overhead * num_seqs + combine(flops / F, bytes / B) + allreduce

where ``combine`` is ``max`` (the roofline: compute and memory traffic overlap, as on a GPU) or
``sum`` (a calibrated CPU, where one thread does both in turn). Tensor parallelism splits FLOPs
and weights over ``tp`` devices, the KV cache over at most its cache heads (an MLA latent is one
head, so every device holds all of it), and adds two all-reduces of the activations per layer.

Mixture-of-experts models (``MoEShape``) store every expert but compute each token's ``top_k``
(plus shared experts); the weights a step reads depend on how many distinct experts its tokens
touch. Multi-head latent attention (``MLAShape``, DeepSeek-V2/V3) caches one latent plane per
token and layer and is costed in its absorbed form. MoE experts of a TP group are spread over the
same devices (EP = TP); the all-to-all of expert parallelism is not modelled apart from the
all-reduces.

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
class MoEShape:
    """The mixture-of-experts MLPs of a model: each MoE layer has ``num_experts`` routed experts
    (gated MLPs of width ``expert_intermediate_size``), a router, and optionally shared experts
    every token goes through (``shared_intermediate_size``: their total width; 0 = none)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_moe_layers: int  # the other layers have a dense MLP of ModelShape.intermediate_size
    shared_intermediate_size: int = 0

    def expected_experts(self, tokens: int) -> float:
        """Distinct routed experts one MoE layer reads for ``tokens`` tokens, in expectation.

        Assumes uniform routing: a token picks ``top_k`` of ``num_experts``, so it misses a given
        expert with probability 1 - k/E, and T tokens routed independently all miss it with
        probability (1 - k/E)^T. Real routers are skewed; for the same T that touches fewer
        distinct experts (the sum of 1 - (1 - p_i)^T is largest at uniform p_i), so this is an
        upper bound on the weight bytes a step reads."""
        if tokens <= 0:
            return 0.0
        e, k = self.num_experts, min(self.top_k, self.num_experts)
        return e * (1.0 - (1.0 - k / e) ** tokens)


@dataclass(frozen=True, slots=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V come from a ``kv_lora_rank`` latent
    plus a ``qk_rope_head_dim`` rotary key shared by all heads; both are what the cache holds."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state (DeepSeek-V2-Lite)

    @property
    def cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder's shape (what the FLOP and byte counts need): Llama-family attention and gated
    MLPs, optionally with MoE layers (``moe``) and latent attention (``mla``)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # a dense layer's MLP width
    vocab_size: int
    dtype_bytes: int = 2  # activations and the KV cache
    max_seq_len: int = 8192
    moe: MoEShape | None = None
    mla: MLAShape | None = None
    weight_dtype_bytes: float | None = None  # None: dtype_bytes; 1 for FP8 weights

    @property
    def weight_itemsize(self) -> float:
        return self.dtype_bytes if self.weight_dtype_bytes is None else self.weight_dtype_bytes

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is None:
            d = self.head_dim
            return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o + k, v
        a, n = self.mla, self.num_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (h * a.q_lora_rank + a.q_lora_rank * n * qk) if a.q_lora_rank else h * n * qk  # q_a, q_b
        kv_a = h * a.cache_dim  # the latent and the rotary key
        kv_b = a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim)  # latent -> K_nope, V
        return q + kv_a + kv_b + n * a.v_head_dim * h  # + o

    @property
    def linear_params_per_layer(self) -> int:
        """A dense layer's linear weights: attention and the gated MLP (gate, up, down)."""
        return self.attention_params_per_layer + 3 * self.hidden_size * self.intermediate_size

    def _linear_params(self, experts: float) -> float:
        """Linear weights of all layers with ``experts`` routed experts per MoE layer."""
        if self.moe is None:
            return self.num_layers * self.linear_params_per_layer
        m, h = self.moe, self.hidden_size
        dense = self.num_layers - m.num_moe_layers
        moe_layer = (h * m.num_experts + 3 * h * m.shared_intermediate_size  # router, shared
                     + experts * 3 * h * m.expert_intermediate_size)
        return (self.num_layers * self.attention_params_per_layer
                + dense * 3 * h * self.intermediate_size + m.num_moe_layers * moe_layer)

    @property
    def num_params(self) -> int:
        """Weights stored, every expert included, with the embedding table and the LM head
        (untied)."""
        experts = self.moe.num_experts if self.moe else 0
        return int(self._linear_params(experts)) + 2 * self.hidden_size * self.vocab_size

    @property
    def active_linear_params(self) -> int:
        """Linear weights one token is multiplied by: ``top_k`` routed experts (and the shared
        ones) per MoE layer. Two FLOPs each per token."""
        return int(self._linear_params(self.moe.top_k if self.moe else 0))

    @property
    def num_active_params(self) -> int:
        """Parameters per token, counted like ``num_params`` (embedding table and LM head
        included; DeepSeek's own 36.6B for V3 leaves out the 0.9B input embedding)."""
        return self.active_linear_params + 2 * self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int | float:
        return self.num_params * self.weight_itemsize

    @property
    def streamed_weight_bytes(self) -> int | float:
        """Weights read on a step that touches every expert: all linear layers and the LM head
        (the embedding table is gathered row by row, so its traffic is negligible)."""
        experts = self.moe.num_experts if self.moe else 0
        return (int(self._linear_params(experts)) + self.hidden_size * self.vocab_size) * self.weight_itemsize

    def step_weight_bytes(self, tokens: int) -> int | float:
        """Weights one step of ``tokens`` tokens reads: all of a dense model; of an MoE model
        only the experts its tokens touch (``MoEShape.expected_experts``)."""
        if self.moe is None:
            return self.streamed_weight_bytes
        params = self._linear_params(self.moe.expected_experts(tokens)) + self.hidden_size * self.vocab_size
        return params * self.weight_itemsize

    @property
    def attention_flops_per_query_key(self) -> float:
        """FLOPs of one (query, key) pair over all layers. MHA/GQA: QK^T and AV over head_dim per
        head. MLA in its absorbed form (W_UK folded into the query, W_UV applied after; those
        projections are counted with kv_b in the linear FLOPs): scores over the latent plus the
        rotary key, values over the latent, per head."""
        if self.mla is None:
            return 4.0 * self.num_layers * self.num_heads * self.head_dim
        a = self.mla
        return 2.0 * self.num_layers * self.num_heads * (a.cache_dim + a.kv_lora_rank)

    @property
    def cache_heads(self) -> int:
        """Heads of the KV cache: the unit TP can split it by (one MLA latent)."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        if self.mla is not None:
            return self.num_layers * self.mla.cache_dim * self.dtype_bytes  # one latent plane
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, model_dir: str | Path, *, dtype_bytes: int = 4,
                       weight_dtype_bytes: float | None = None) -> ModelShape:
        """The shape of a local HF-format model (a folder with ``config.json``, or the file
        itself); fp32 on CPU by default."""
        path = Path(model_dir)
        name = path.stem if path.is_file() else path.name
        cfg = json.loads((path if path.is_file() else path / "config.json").read_text())
        return cls.from_config_dict(cfg, name=name, dtype_bytes=dtype_bytes,
                                    weight_dtype_bytes=weight_dtype_bytes)

    @classmethod
    def from_config_dict(cls, cfg: dict, *, name: str = "model", dtype_bytes: int = 4,
                         weight_dtype_bytes: float | None = None) -> ModelShape:
        """A ``config.json`` dict: Llama-family keys, plus the MoE keys of Mixtral / gpt-oss
        (``num_local_experts``), Qwen2/3-MoE (``num_experts``, ``decoder_sparse_step``,
        ``mlp_only_layers``) and DeepSeek (``n_routed_experts``, ``first_k_dense_replace``,
        ``moe_layer_freq``), and DeepSeek's MLA keys (``kv_lora_rank`` ...)."""
        heads = cfg["num_attention_heads"]
        mla = None
        if cfg.get("kv_lora_rank"):
            mla = MLAShape(kv_lora_rank=cfg["kv_lora_rank"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                           qk_nope_head_dim=cfg["qk_nope_head_dim"], v_head_dim=cfg["v_head_dim"],
                           q_lora_rank=cfg.get("q_lora_rank") or 0)
        head_dim = (mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla
                    else cfg.get("head_dim") or cfg["hidden_size"] // heads)
        return cls(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg.get("intermediate_size") or 0,
            vocab_size=cfg["vocab_size"],
            dtype_bytes=dtype_bytes,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            moe=_moe_from_config(cfg),
            mla=mla,
            weight_dtype_bytes=weight_dtype_bytes,
        )


def _moe_from_config(cfg: dict) -> MoEShape | None:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if experts <= 1:
        return None
    top_k = cfg.get("num_experts_per_tok") or cfg.get("experts_per_token")
    if not top_k:
        raise ValueError(f"an MoE config ({experts} experts) without num_experts_per_tok")
    # Mixtral and gpt-oss give the expert width as intermediate_size (they have no dense layers).
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * width
    # A layer is sparse unless one of the families' keys makes it dense (each family sets only
    # its own keys; the others keep their defaults).
    first_dense = cfg.get("first_k_dense_replace") or 0  # DeepSeek
    freq = cfg.get("moe_layer_freq") or 1  # DeepSeek
    step = cfg.get("decoder_sparse_step") or 1  # Qwen2/3-MoE
    mlp_only = set(cfg.get("mlp_only_layers") or ())  # Qwen2/3-MoE
    moe_layers = sum(1 for i in range(cfg["num_hidden_layers"])
                     if i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in mlp_only)
    return MoEShape(num_experts=experts, top_k=top_k, expert_intermediate_size=width,
                    num_moe_layers=moe_layers, shared_intermediate_size=shared)


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

    @property
    def kv_shards(self) -> int:
        """Devices the KV cache is split over: by cache head, so at most ``cache_heads`` (an MLA
        latent, one head, is whole on every device of the group)."""
        return min(self.tp, self.model.cache_heads)

    def step_flops(self, seqs: Iterable[SeqWork]) -> float:
        m = self.model
        linear = 2.0 * m.active_linear_params  # per token; an MoE token's top_k experts only
        attn = m.attention_flops_per_query_key
        head = 2.0 * m.hidden_size * m.vocab_size
        total = 0.0
        for s in seqs:
            n, p = s.new_tokens, s.past_len
            keys = n * p + n * (n + 1) / 2  # causal: query i sees p + i keys
            total += linear * n + attn * keys + (head if s.logits else 0.0)
        return total

    def step_bytes(self, seqs: Iterable[SeqWork]) -> float:
        """Per device: the weights the step reads once (an MoE model's: the experts its tokens
        touch), each sequence's KV read, the new KV written."""
        m = self.model
        kv = tokens = 0
        for s in seqs:
            kv += (s.past_len + 2 * s.new_tokens) * m.kv_bytes_per_token
            tokens += s.new_tokens
        # kv * (tp / shards) is kv itself when the cache splits over every device.
        return (m.step_weight_bytes(tokens) + kv * (self.tp / self.kv_shards)) / self.tp

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
        # A block takes tp / kv_shards times its bytes of the group's memory (1 unless the cache
        # is replicated, as an MLA latent is).
        return max(0, int(free // (self.kv_block_bytes(tokens_per_block) * (self.tp / self.kv_shards))))


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


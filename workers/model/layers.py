"""Decoder building blocks: RMSNorm, rotary embeddings, the SwiGLU MLP.

Every tensor here is flat over tokens: [T, ...] with T = tokens in the step's batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels
from .config import RopeConfig
from .parallel import SINGLE, Shard, TensorParallel

_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold this [N, K] weight in its own blocked layout: a CPU tensor in fp32,
    or bf16 where the CPU has native bf16 (avx512_bf16/AMX)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> oneDNN's opaque reordered copy for ``linear``. The GEMM then skips
    re-laying the weight out on every call, which dominates at decode batch sizes: on this
    2-core VM a 16 x 512 x 2816 fp32 product took 0.7-0.9 ms instead of 1.5-1.8 ms
    (docs/benchmarks.md section 21). Results differ from MKL's sgemm by reassociation only
    (~2e-6 relative)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# oneDNN's prepacked GEMM is slowest below 4 rows: its 1- and 2-row kernels stream the weight
# at a fraction of the bandwidth the 4-row one reaches (benchmarks/gemm_rows.py, docs/benchmarks.md
# section 21: the medium model's projections took 39.0 ms at 1 row, 46.0 at 2, 30.6 at 4, on
# 1 thread). Decode steps of 1-3 sequences therefore run as 4 rows, the extra ones zero. The
# 1-row fp32 kernel also sums K in another order; padded, a row's result no longer depends on
# how many rows share the GEMM (tests/unit/test_prepacked_linear.py).
MIN_PACKED_ROWS = 4

# oneDNN builds (JIT-compiles) one primitive per GEMM shape and keeps it in its primitive cache
# (up to 1,024 by default, ONEDNN_PRIMITIVE_CACHE_CAPACITY), 0.5-0.7 MiB of RSS per shape as
# measured (its code and buffers). A context worker sees a new row count in almost every
# prefill step (tiles of 1..TOKEN_TILE tokens), so without a bound on the row counts its RSS
# grew by ~500 MiB over a few hundred random-length prompts (docs/benchmarks.md section 18).
# Row counts up to EXACT_PACKED_ROWS (decode batches) run as they are; larger ones run
# zero-padded up to the next of PACKED_ROW_STEPS sizes per doubling, so a weight sees at most
# EXACT_PACKED_ROWS + PACKED_ROW_STEPS * log2(max rows / EXACT_PACKED_ROWS) shapes and a GEMM
# computes under 1 / PACKED_ROW_STEPS extra rows. The padding changes no row's result: oneDNN
# sums each row over K in the same order whatever the row count from MIN_PACKED_ROWS up
# (tests/unit/test_prepacked_linear.py).
EXACT_PACKED_ROWS = 32
PACKED_ROW_STEPS = 8


def packed_rows(rows: int) -> int:
    """The row count an input of ``rows`` rows runs as on a prepacked weight."""
    if rows < MIN_PACKED_ROWS:
        return MIN_PACKED_ROWS
    if rows <= EXACT_PACKED_ROWS:
        return rows
    # PACKED_ROW_STEPS (a power of two) multiples of ``step`` per doubling of the row count.
    step = 1 << max(rows.bit_length() - PACKED_ROW_STEPS.bit_length(), 0)
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, through the prepacked weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else -1
    run = packed_rows(rows) if rows > 0 else rows
    if run != rows:
        padded = x.new_empty((run, x.shape[1]))
        padded[:rows].copy_(x)
        padded[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PrepackedLinears:
    """Mixin for a module whose dense projections may run on prepacked weights.
    ``LINEARS`` names them (the weight attribute is ``<name>_weight``); ``prepack()`` builds the
    packed copies (kept apart from the parameters: weight loading and state_dict still see the
    plain tensors) and ``packed(name)`` hands one to ``linear`` (None before prepack)."""

    LINEARS: tuple[str, ...] = ()

    def prepack(self) -> None:
        self._packed = {}
        for name in self.LINEARS:
            w = getattr(self, name + "_weight")
            if can_prepack(w):
                self._packed[name] = prepack_weight(w)

    def packed(self, name: str) -> torch.Tensor | None:
        cache = self.__dict__.get("_packed")
        return None if cache is None else cache.get(name)


def fused_cpu(x: torch.Tensor) -> bool:
    """Whether pdserve's compiled CPU ops (cpu_kernels) take x: CPU rows [T, n] or [T, heads, d]
    with unit last stride, a float dtype they handle, and kernels that built."""
    return (x.device.type == "cpu" and x.stride(-1) == 1 and x.dtype in _NORM_DTYPES
            and cpu_kernels.available())


class RMSNorm(nn.Module):
    """RMSNorm over the last ``size`` elements. ``unit_offset``: the checkpoint stores w and the
    scale is 1 + w (Gemma), computed in fp32 and rounded to the model dtype at the end."""

    def __init__(
        self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str,
        unit_offset: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _empty((size,), dtype, device)
        self.eps = eps
        self.size = size
        self.unit_offset = unit_offset

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether pdserve's one-op CPU RMSNorm (csrc/norms.cpp) takes x: rows [T, size] with
        unit stride on a CPU whose kernels built; not Gemma's 1 + w scale."""
        return not self.unit_offset and x.dim() == 2 and fused_cpu(x)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then self(x): one op on CPU."""
        if self._fused(x) and delta.shape == x.shape and delta.stride(-1) == 1 and delta.dtype == x.dtype:
            return torch.ops.pdserve_cpu.add_rms_norm(x, delta, self.weight, self.eps)
        x.add_(delta)
        return self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if self._fused(x):
            return torch.ops.pdserve_cpu.rms_norm(x, self.weight, self.eps)
        if self.unit_offset:
            normed = F.rms_norm(x.float(), (self.size,), None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        # Low precision: normalise in fp32, round to the model dtype, then scale, the order
        # transformers uses, so bf16 outputs round the same way.
        return self.weight * F.rms_norm(x.float(), (self.size,), None, self.eps).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band in
        # between interpolated smoothly (Llama 3.1 long-context recipe).
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolated (slowed by ``factor``) frequencies below the correction range,
    extrapolated (unchanged) ones above it, a linear ramp between."""
    base, orig = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as transformers does
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


class RotaryEmbedding(nn.Module):
    """cos/sin tables for one RoPE config over ``head_dim`` rotary dims (YaRN's
    attention factor folded in, as transformers multiplies cos and sin by it)."""

    def __init__(self, rope: RopeConfig, head_dim: int, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim).to(device), persistent=False)
        self.scale = rope.attention_factor if rope.rope_type == "yarn" else 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim // 2] in `dtype` (broadcast over heads).
        The angles are computed in fp32 from the integer positions, never accumulated. Both halves
        of a head share these angles, so only one half is materialised."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place: x [T, heads, d] (unit last stride), cos/sin [T, 1, d/2]. Rotates the two
    halves of each head (the "rotate_half" convention of HF checkpoints) to
    [x1 c - x2 s, x2 c + x1 s], each product rounded before the sum as transformers'
    x * cos + rotate_half(x) * sin does, without materialising the rotated copy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x2_sin = torch.mul(x2, sin)  # [T, heads, d/2]
    x1_sin = torch.mul(x1, sin)
    x1.mul_(cos).sub_(x2_sin)
    x2.mul_(cos).add_(x1_sin)


class GatedMLP(PrepackedLinears, nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) with gate and up fused into one matmul. act is
    SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma). Under tensor parallelism a rank
    holds a column slice of gate and up and the matching rows of down; the forward ends in one
    all-reduce of the partial sums (``reduce=False`` leaves it to the caller, e.g. a MoE block
    that sums its shared expert with its routed ones first)."""

    LINEARS = ("gate_up", "down")

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, *, dtype: torch.dtype, device: torch.device | str,
        act: str = "silu", tp: TensorParallel = SINGLE, reduce: bool = True,
    ) -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {act!r}")
        self.act = act
        self.tp = tp
        self.reduce = reduce
        self.full_intermediate = intermediate
        self.columns = tp.split(intermediate, "MLP intermediate size")
        intermediate = self.columns[1] - self.columns[0]
        self.intermediate = intermediate
        self.gate_up_weight = _empty((2 * intermediate, hidden), dtype, device)  # rows: gate, up
        self.gate_up_bias = _empty((2 * intermediate,), dtype, device) if bias else None
        self.down_weight = _empty((hidden, intermediate), dtype, device)
        self.down_bias = _empty((hidden,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.packed("gate_up"))  # [T, 2I]
        if self.act == "silu" and fused_cpu(gate_up):  # one op, contiguous rows for down
            act = torch.ops.pdserve_cpu.silu_mul(gate_up, self.intermediate)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)  # row-strided views [T, I]
            # In place: no fresh [T, I] tensors (large ones cost page faults on every step).
            if self.act == "silu":
                act = F.silu(gate, inplace=True).mul_(up)
            else:
                act = F.gelu(gate, approximate="tanh").mul_(up)
        out = linear(act, self.down_weight, self.down_bias, self.packed("down"))
        return self.tp.all_reduce(out) if self.reduce else out

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        """HF names (``prefix`` + gate_proj/up_proj/down_proj) -> the slices they fill (this
        rank's columns of gate and up, rows of down; the down bias on rank 0 only)."""
        inter, tp, full = self.intermediate, self.tp, self.full_intermediate
        a, b = self.columns
        t: dict[str, torch.Tensor | Shard] = {
            prefix + "gate_proj.weight": tp.shard(self.gate_up_weight[:inter], 0, a, b, full),
            prefix + "up_proj.weight": tp.shard(self.gate_up_weight[inter:], 0, a, b, full),
            prefix + "down_proj.weight": tp.shard(self.down_weight, 1, a, b, full),
        }
        if self.gate_up_bias is not None:
            t[prefix + "gate_proj.bias"] = tp.shard(self.gate_up_bias[:inter], 0, a, b, full)
            t[prefix + "up_proj.bias"] = tp.shard(self.gate_up_bias[inter:], 0, a, b, full)
            t[prefix + "down_proj.bias"] = rank0_only(self.down_bias, tp)
        return t


def rank0_only(bias: torch.Tensor, tp: TensorParallel) -> torch.Tensor | Shard:
    """A bias added after an all-reduce: rank 0 loads it, the others read none of it (theirs
    stays zero, so the sum counts it once)."""
    if tp.rank == 0:
        return bias
    return Shard(bias, 0, 0, 0, bias.shape[0])

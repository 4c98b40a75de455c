"""Decoder building blocks: RMSNorm, rotary embeddings, the SwiGLU MLP.

Every tensor here is flat over tokens: [T, ...] with T = tokens in the step's batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _empty((size,), dtype, device)
        self.eps = eps
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        # Low precision: normalise in fp32, round to the model dtype, then scale, the order
        # transformers uses, so bf16 outputs round the same way.
        return self.weight * F.rms_norm(x.float(), (self.size,), None, self.eps).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
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


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, head_dim // 2] in `dtype` (broadcast over heads).
        The angles are computed in fp32 from the integer positions, never accumulated. Both halves
        of a head share these angles, so only one half is materialised."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


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


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(
        self, hidden: int, intermediate: int, bias: bool, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_weight = _empty((2 * intermediate, hidden), dtype, device)  # rows: gate, up
        self.gate_up_bias = _empty((2 * intermediate,), dtype, device) if bias else None
        self.down_weight = _empty((hidden, intermediate), dtype, device)
        self.down_bias = _empty((hidden,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)  # [T, 2I]
        gate, up = gate_up.split(self.intermediate, dim=-1)  # row-strided views [T, I]
        # In place: no fresh [T, I] tensors (large ones cost page faults on every step).
        act = F.silu(gate, inplace=True).mul_(up)
        return F.linear(act, self.down_weight, self.down_bias)

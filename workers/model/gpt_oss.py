"""gpt-oss (``GptOssForCausalLM``): the shared decoder with attention sinks, alternating sliding
windows, YaRN RoPE and a sparse MoE of clamped-SwiGLU experts.

What differs from the plain decoder, as transformers' ``modeling_gpt_oss`` computes it:

- Attention (``SinkAttention``): q/k/v/o carry biases (``attention_bias``, default true); each
  head has a learned sink logit (``self_attn.sinks`` [heads]) that joins every query's softmax
  denominator and contributes no value: p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)). RoPE is
  the usual rotate-half layout. ``layer_types`` alternate sliding and full layers; the window
  edge is transformers' ``k > q - sliding_window``, the same as ``batch.py``'s.
- MoE (``GptOssMoE``, the shared ``SparseMoE``): the router has a bias; the top k of the router
  logits are taken first and only those k are softmaxed. Every expert has biases and applies
  the clamped SwiGLU: gate clamped above at ``swiglu_limit``, up clamped to +-limit,
  ``(up + 1) * gate * sigmoid(alpha * gate)``. Checkpoints fuse each layer's experts as
  ``experts.gate_up_proj`` [E, H, 2I] (columns interleaved gate, up, gate, up, ...) and
  ``experts.down_proj`` [E, I, H], both x @ W (transposed relative to nn.Linear). pdserve
  stores them as [E, 2I, H] (rows still interleaved) and [E, H, I], so the checkpoint tensors
  are transposed views of the parameters.
- MXFP4 checkpoints (the released ones: ``quantization_config.quant_method == "mxfp4"``) store
  the expert weights as ``*_blocks`` (uint8, two FP4 e2m1 values per byte, low nibble first)
  and ``*_scales`` (uint8 E8M0 exponents, one per 32 values). pdserve has no MXFP4 kernel, so
  ``convert_weights`` dequantises them at load time into the model dtype: the experts then take
  about 4x the checkpoint's size in bf16 (8x in fp32).
"""
from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .attention import PagedAttention, Workspace
from .batch import AttentionMetadata
from .config import ModelConfig, ModelConfigError, layer_windows_from_types, parse_common
from .decoder import DecoderLM, WeightLoadError
from .layers import RMSNorm, _empty, rank0_only
from .moe import SparseMoE
from .parallel import SINGLE, Shard, TensorParallel
from .weights import materialize

log = logging.getLogger(__name__)

MODEL_TYPE = "gpt_oss"

# transformers' GptOssConfig defaults, for keys a config.json may leave out.
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULTS: dict[str, Any] = {
    "attention_bias": True, "rms_norm_eps": 1e-5, "head_dim": 64, "sliding_window": 128,
    "max_position_embeddings": 131072, "num_local_experts": 128, "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
}

# FP4 e2m1 code -> value: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127

# Sink attention computes scores a key tile at a time; a tile holds at most this many scores
# (fp32: 128 MiB), so a long prefill chunk never materialises [heads, queries, keys] at once.
SCORE_TILE_ELEMENTS = 1 << 25


@dataclass(frozen=True, slots=True)
class GptOssConfig(ModelConfig):
    num_experts: int = 0  # num_local_experts
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quant_method: str | None = None  # "mxfp4": expert weights stored as blocks + scales


# ----------------------------------------------------------------- config


def parse_gpt_oss(cfg: Mapping[str, Any]) -> GptOssConfig:
    # transformers' defaults fill absent keys (a null head_dim means hidden / heads, a null
    # sliding_window means no window, as there).
    merged = dict(DEFAULTS)
    for key, value in cfg.items():
        if value is not None or key in ("head_dim", "sliding_window") or key not in DEFAULTS:
            merged[key] = value
    if "num_local_experts" not in cfg and cfg.get("num_experts") is not None:
        merged["num_local_experts"] = cfg["num_experts"]  # transformers' attribute_map alias
    if merged.get("rope_parameters") is None and merged.get("rope_scaling") is None:
        merged["rope_parameters"] = dict(DEFAULT_ROPE)
    if merged.get("rope_theta") is None:
        merged["rope_theta"] = DEFAULT_ROPE_THETA
    fields = parse_common(merged, MODEL_TYPE)
    layers = fields["num_hidden_layers"]
    if fields["intermediate_size"] < 1:
        raise ModelConfigError("missing required field 'intermediate_size'")
    # The experts always carry biases; mlp_bias is not a gpt-oss key.
    fields["mlp_bias"] = False

    types = merged.get("layer_types")
    if types is None:  # transformers' default: even layers slide, odd layers are full
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    window = merged.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ModelConfigError("sliding_window is null but layer_types has sliding_attention layers")
    fields["layer_windows"] = layer_windows_from_types({"layer_types": types}, layers, window)

    experts = _int("num_local_experts", merged["num_local_experts"])
    top_k = _int("num_experts_per_tok", merged["num_experts_per_tok"])
    if top_k > experts:
        raise ModelConfigError(f"num_experts_per_tok={top_k} exceeds num_local_experts={experts}")
    alpha = _float("swiglu_alpha", merged["swiglu_alpha"])
    limit = _float("swiglu_limit", merged["swiglu_limit"])
    if limit <= 0:
        raise ModelConfigError(f"swiglu_limit={limit} must be positive")

    quant = merged.get("quantization_config")
    method = None
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, Mapping) else None
        if method != "mxfp4":
            raise ModelConfigError(
                f"quantization_config quant_method {method!r} is not supported (gpt-oss: only 'mxfp4', "
                "dequantised at load time)"
            )
    return GptOssConfig(**fields, num_experts=experts, num_experts_per_tok=top_k, swiglu_alpha=alpha,
                        swiglu_limit=limit, quant_method=method)


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"{key}={value!r} must be an integer >= 1")
    return value


def _float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelConfigError(f"{key}={value!r} must be a finite number")
    return float(value)


def tiny_config(base: dict[str, Any]) -> dict[str, Any]:
    """make-tiny-model: 4 experts (top 2), alternating windows of 32 tokens, gpt-oss's YaRN."""
    layers, max_pos = base["num_hidden_layers"], base["max_position_embeddings"]
    return {
        "attention_bias": True, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 32, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "rope_parameters": {**DEFAULT_ROPE, "rope_theta": base["rope_theta"],
                            "original_max_position_embeddings": max(1, max_pos // 32)},
    }


# ----------------------------------------------------------------- attention with sinks


def sink_attention(
    q: torch.Tensor,  # [..., m, d]
    k: torch.Tensor,  # [..., L, d] (batch dims broadcast against q's)
    v: torch.Tensor,  # [..., L, d]
    sink: torch.Tensor,  # broadcastable to [..., m, 1]: each row's sink logit
    scale: float,
    mask: torch.Tensor | None = None,  # additive, broadcastable to [..., m, L]
    *,
    causal: bool = False,  # without a mask: query row i sees keys 0..i (m == L)
    key_tile: int | None = None,
) -> torch.Tensor:  # [..., m, d] in q's dtype
    """softmax(q k^T * scale + mask) v with one extra logit per row (the sink) in the softmax
    denominator. Keys are processed a tile at a time with a running max and sum (fp32)
    started from the sink, so no row is ever all -inf and memory stays bounded."""
    m, L = q.shape[-2], k.shape[-2]
    if key_tile is None:
        rows = m * math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
        key_tile = max(128, SCORE_TILE_ELEMENTS // max(rows, 1))
    run_max = sink.float()  # [..., m | 1, 1]
    denom = torch.ones_like(run_max)  # exp(sink - run_max)
    acc = None
    q_idx = torch.arange(m, device=q.device)[:, None] if causal else None
    for a in range(0, L, key_tile):
        b = min(a + key_tile, L)
        if causal and a >= m:
            break
        s = torch.matmul(q, k[..., a:b, :].transpose(-1, -2)).float().mul_(scale)  # [..., m, t]
        if mask is not None:
            s.add_(mask[..., a:b])
        elif causal:
            s.masked_fill_(torch.arange(a, b, device=q.device)[None, :] > q_idx, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s.sub_(new_max))
        correction = torch.exp(run_max - new_max)
        denom = denom * correction + p.sum(dim=-1, keepdim=True)
        pv = torch.matmul(p.to(v.dtype), v[..., a:b, :]).float()
        acc = pv if acc is None else acc.mul_(correction).add_(pv)
        run_max = new_max
    return (acc / denom).to(q.dtype)


class SinkAttention(PagedAttention):
    """PagedAttention with gpt-oss's per-head sinks: ``project``/``output`` as usual, ``attend``
    through ``sink_attention`` (decode groups and context chunks, windows through the same
    masks as every other model).

    Under tensor parallelism it splits as PagedAttention does (the rank's query and KV heads,
    o_proj's columns, its bias on rank 0 only); a sink belongs to its query head, so the rank
    holds the sinks of its own query heads."""

    def __init__(self, config: ModelConfig, window: int | None, *, dtype: torch.dtype,
                 device: torch.device | str, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, window, dtype=dtype, device=device, tp=tp)
        self.sinks = _empty((self.num_heads,), dtype, device)  # the rank's query heads only
        self._num_heads_total = config.num_attention_heads
        self.softmax_scale = config.attn_scale if config.attn_scale is not None else self.head_dim ** -0.5

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        a, b = self.q_heads
        sinks = self.tp.shard(self.sinks, 0, a, b, self._num_heads_total)
        return {**super().weight_targets(prefix), prefix + "sinks": sinks}

    def attend(
        self,
        qkv: torch.Tensor,  # [T, h + 2 * kv_heads, d] from project
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [2, num_blocks, B, kv_heads, d]
        workspace: Workspace,
        out: torch.Tensor,  # [T, h * d]
    ) -> None:
        T = qkv.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = h // kvh  # query heads per KV head: head i reads KV head i // g
        out = out.view(T, kvh, g, d)
        q, k, v = qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :]
        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        block_rows = layer_kv.view(2 * num_blocks, B * kvh * d)
        sinks = self.sinks.view(kvh, g)

        if meta.decode_gather_rows is not None:
            rows_all = meta.decode_gather_rows
            gathered = workspace.rows(rows_all.numel(), B * kvh * d, layer_kv.dtype, layer_kv.device)
            torch.index_select(block_rows, 0, rows_all, out=gathered)
        for grp in meta.decode_groups:
            n, L = grp.num_seqs, grp.max_blocks * B
            buf = gathered[grp.row_offset : grp.row_offset + grp.gather_rows.numel()]
            kv = buf.view(2, n, L, kvh, d).transpose(2, 3)  # [2, n, kvh, L, d]
            qg = q.index_select(0, grp.token_index).view(n, kvh, g, d)  # a KV head's g queries as rows
            o = sink_attention(qg, kv[0], kv[1], sinks.view(1, kvh, g, 1), self.softmax_scale,
                               grp.masks[self.window])  # mask [n, 1, 1, L]
            out.index_copy_(0, grp.token_index, o)
        for c in meta.context_chunks:
            rows = slice(c.start, c.start + c.num_new)
            n = c.num_new
            qc = q[rows].view(n, kvh, g, d).permute(1, 2, 0, 3)  # [kvh, g, n, d]
            if c.gather_rows is None:
                kc = k[rows].transpose(0, 1).unsqueeze(1)  # [kvh, 1, n, d]
                vc = v[rows].transpose(0, 1).unsqueeze(1)
            else:
                buf = workspace.rows(c.gather_rows.numel(), B * kvh * d, layer_kv.dtype, layer_kv.device)
                torch.index_select(block_rows, 0, c.gather_rows, out=buf)
                kv = buf.view(2, c.num_blocks * B, kvh, d).transpose(1, 2).unsqueeze(2)
                kc, vc = kv[0], kv[1]  # [kvh, 1, n_keys, d]
            mask = c.masks[self.window]  # [n, n_keys], or None: causal over the chunk itself
            o = sink_attention(qc, kc, vc, sinks.view(kvh, g, 1, 1), self.softmax_scale, mask,
                               causal=mask is None)  # [kvh, g, n, d]
            out[rows] = o.permute(2, 0, 1, 3)


# ----------------------------------------------------------------- MoE


def topk_then_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: the k largest router logits, softmaxed among themselves (logits' dtype)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[t, 2I] with interleaved columns (gate, up, gate, up, ...) -> [t, I]."""
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


class GptOssMoE(SparseMoE):
    """``SparseMoE`` with gpt-oss's routing and activation; ``gate_up_weight`` rows interleave
    gate and up as the checkpoint's columns do, so checkpoint tensors are transposed views.

    Split by width, a rank's intermediate units [a, b) are the checkpoint's gate_up columns
    [2a, 2b) (unit j is columns 2j, 2j + 1: gate, up), one contiguous slice that is still
    interleaved, so ``clamped_swiglu`` runs on it unchanged; down takes rows [a, b). Expert
    parallelism slices the fused tensors' expert dimension instead."""

    def __init__(self, config: GptOssConfig, *, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(
            config.hidden_size, config.intermediate_size, config.num_experts,
            route=functools.partial(topk_then_softmax, top_k=config.num_experts_per_tok),
            act=functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit),
            router_bias=True, expert_bias=True, router_name="router", dtype=dtype, device=device, tp=tp,
        )

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        tp, E, I = self.tp, self.num_experts, self.full_intermediate
        gate_up = self.gate_up_weight.transpose(1, 2)  # [E, H, 2I] (this rank's share)
        down = self.down_weight.transpose(1, 2)  # [E, I, H]
        if self.expert_parallel:
            e0, e1 = self.expert_range
            gate_up, gate_up_bias, down, down_bias = (tp.shard(t, 0, e0, e1, E) for t in (
                gate_up, self.gate_up_bias, down, self.down_bias))
        else:
            a, b = self.columns
            gate_up = tp.shard(gate_up, 2, 2 * a, 2 * b, 2 * I)
            gate_up_bias = tp.shard(self.gate_up_bias, 1, 2 * a, 2 * b, 2 * I)
            down = tp.shard(down, 1, a, b, I)
            down_bias = rank0_only(self.down_bias, tp)  # added before the all-reduce: once
        return {
            prefix + "router.weight": self.router_weight,  # [E, H], replicated
            prefix + "router.bias": self.router_bias,  # [E]
            prefix + "experts.gate_up_proj": gate_up,
            prefix + "experts.gate_up_proj_bias": gate_up_bias,  # [E, 2I]
            prefix + "experts.down_proj": down,
            prefix + "experts.down_proj_bias": down_bias,  # [E, H]
        }


# ----------------------------------------------------------------- MXFP4


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> ``dtype``: blocks [..., G, B] uint8 (two e2m1 codes per byte, the low nibble
    the earlier value), scales [..., G] uint8 (E8M0: 2 ** (e - 127) for the group's 2B values)
    -> [..., G * 2B]. One leading slice at a time, so the fp32 temporaries stay one expert's."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise WeightLoadError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.dim() < 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise WeightLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} (blocks = scales + [bytes])"
        )
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    *lead, G, nbytes = blocks.shape
    out = torch.empty(*lead, G, 2 * nbytes, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, G, nbytes) if lead else blocks.unsqueeze(0)
    flat_s = scales.reshape(-1, G) if lead else scales.unsqueeze(0)
    flat_o = out.view(-1, G, 2 * nbytes)
    for i in range(flat_b.shape[0]):
        b = flat_b[i].long()
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).view(G, 2 * nbytes)
        exp2 = torch.exp2(flat_s[i].float() - E8M0_BIAS)  # exact powers of two in fp32
        flat_o[i].copy_(values.mul_(exp2[:, None]))
    return out.view(*lead, G * 2 * nbytes)


_MXFP4_NAME = re.compile(r"^(?P<base>.*\.experts\.(?:gate_up_proj|down_proj))_(?P<part>blocks|scales)$")


# ----------------------------------------------------------------- the model


class GptOssRMSNorm(RMSNorm):
    """transformers' GptOssRMSNorm: normalise in fp32, scale by the weight in fp32, then round
    (the shared RMSNorm rounds before scaling in low precision)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.size,), self.weight, self.eps)
        return (F.rms_norm(x.float(), (self.size,), None, self.eps) * self.weight.float()).to(x.dtype)


class GptOssForCausalLM(DecoderLM):
    config: GptOssConfig

    def make_norm(self, size: int | None = None) -> RMSNorm:
        return GptOssRMSNorm(size or self.config.hidden_size, self.config.rms_norm_eps, dtype=self.dtype,
                             device=self.device)

    def make_attention(self, layer: int) -> nn.Module:
        return SinkAttention(self.config, self.config.layer_windows[layer], dtype=self.dtype, device=self.device,
                             tp=self.tp)

    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoE(self.config, dtype=self.dtype, device=self.device, tp=self.tp)

    def convert_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass tensors through, except MXFP4 expert pairs (``<name>_blocks`` + ``<name>_scales``,
        in any order), which become ``<name>`` dequantised to the model dtype."""
        pending: dict[str, tuple[str, torch.Tensor]] = {}
        announced = False
        for name, tensor in tensors:
            m = _MXFP4_NAME.match(name)
            if m is None:
                yield name, tensor
                continue
            base, part = m["base"], m["part"]
            other = pending.pop(base, None)
            if other is None:
                pending[base] = (part, materialize(tensor))  # read now: its file may close first
                continue
            if other[0] == part:
                raise WeightLoadError(f"tensor {name!r} appears twice in checkpoint")
            if not announced:
                announced = True
                log.info("gpt-oss: dequantising MXFP4 expert weights to %s at load time (no MXFP4 kernel; "
                         "the experts take about 4x their stored size in bf16)", self.dtype)
            blocks, scales = (tensor, other[1]) if part == "blocks" else (other[1], tensor)
            # Dequantised whole: an MXFP4 block of 32 values spans the split dimension.
            blocks, scales = materialize(blocks), materialize(scales)
            # [E, out, in] as dequantised; the checkpoint name's layout is [E, in, out].
            yield base, dequantize_mxfp4(blocks, scales, self.dtype).transpose(1, 2)
        if pending:
            base, (part, _) = next(iter(pending.items()))
            missing = "scales" if part == "blocks" else "blocks"
            raise WeightLoadError(f"checkpoint has {base}_{part} but lacks {base}_{missing!s}")

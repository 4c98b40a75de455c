"""DeepSeek-V3: multi-head latent attention (MLA) over a one-plane latent KV cache, and a
mixture of experts with sigmoid, group-limited routing.

MLA (``MLAttention``): each token's keys and values are one compressed latent
``c = kv_a_layernorm(c_kv)`` [kv_lora_rank] plus one RoPE'd key ``k_pe`` [qk_rope_head_dim]
shared by every head; per head, ``k_nope = W_UK c`` and ``v = W_UV c`` (``kv_b_proj``). The
pool caches only [c, k_pe] (``kv_planes`` 1, ``cache_heads`` 1), which is also exactly what
the disaggregated transfer moves. Two equal ways to attend:

- decode (one query per sequence, long cached history): "absorbed". W_UK is folded into the
  query (``q_nope W_UK`` lives in latent space), so every head attends straight over the cached
  [c, k_pe] as multi-query attention with key size kv_lora_rank + rope and value size
  kv_lora_rank; W_UV is applied to the attention output. No per-head K/V is ever built.
- context chunks (many queries): the per-head K/V are expanded from the latents through
  kv_b_proj once per key and attended as ordinary multi-head attention: the products
  transformers computes, and cheaper when many queries share the keys (per query-key pair and
  head, qk + v multiply-adds instead of 2 kv_lora_rank + rope).

Both stay token-exact against transformers in fp32 (the absorbed form only reassociates).

MoE layers (every layer from ``first_k_dense_replace`` on): routed experts plus always-on shared
experts; ``DeepseekV3Router`` (see its docstring) is the routing function of the shared MoE layer
(``moe.SparseMoE``). Checkpoints: hub per-expert tensors or transformers-5 fused ones; layers
past ``num_hidden_layers`` (multi-token prediction, ``model.layers.61.*``) are skipped.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Workspace
from .batch import AttentionMetadata
from .config import ModelConfig, ModelConfigError, parse_common
from .decoder import DecoderLM
from .layers import GatedMLP, RMSNorm, _empty, rank0_only, rotate_in_place
from .moe import SparseMoE, split_fused_experts
from .parallel import SINGLE, Shard, TensorParallel

log = logging.getLogger(__name__)

# q_a_layernorm and kv_a_layernorm are built with the RMSNorm default eps in transformers (and
# in DeepSeek's reference code), not with rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class DeepseekV3Config(ModelConfig):
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # also head_dim: the rotary embedding's size
    v_head_dim: int = 0
    # Checkpoint q/k rope dims come in interleaved pairs (x0, x1), (x2, x3), ...; loading
    # reorders those weight rows to [evens, odds] so the usual rotate-half RoPE applies.
    rope_interleave: bool = True
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    # One latent [c, k_pe] per token and layer.
    @property
    def kv_planes(self) -> int:
        return 1

    @property
    def cache_heads(self) -> int:
        return 1

    @property
    def cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def _mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _rope_params(cfg: Mapping[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), Mapping):
            params.update(cfg[key])
    return params


# transformers' DeepseekV3Config defaults (DeepSeek-V3's own sizes): a config.json without a
# key means this value there, so it must here too.
DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
}


def parse_deepseek_v3(cfg: Mapping[str, Any]) -> DeepseekV3Config:
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") if isinstance(
            cfg["quantization_config"], Mapping) else "?"
        raise ModelConfigError(
            f"quantization_config ({method}) is not supported: load a bf16/fp32 conversion of the checkpoint"
        )

    def integer(key: str, *, low: int = 1) -> int:
        value = cfg.get(key, DEFAULTS.get(key))
        if value is None:
            raise ModelConfigError(f"missing required field {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ModelConfigError(f"{key}={value!r} must be an integer >= {low}")
        return value

    rope_dim = integer("qk_rope_head_dim")
    if rope_dim % 2:
        raise ModelConfigError(f"qk_rope_head_dim={rope_dim} must be even for rotary embeddings")
    # The rotary embedding spans qk_rope_head_dim (transformers sets head_dim to it).
    fields = parse_common({**cfg, "head_dim": rope_dim}, "deepseek_v3", default_window_layers=False)
    heads, layers = fields["num_attention_heads"], fields["num_hidden_layers"]
    if fields["num_key_value_heads"] != heads:
        # transformers expands the latent to one K/V per query head; a smaller count breaks it.
        raise ModelConfigError(
            f"num_key_value_heads={fields['num_key_value_heads']} must equal num_attention_heads={heads} for MLA"
        )
    q_lora = cfg.get("q_lora_rank", DEFAULTS["q_lora_rank"])  # an explicit null: q_proj
    if q_lora is not None:
        q_lora = integer("q_lora_rank")
    experts = integer("n_routed_experts")
    n_group = integer("n_group")
    topk_group = integer("topk_group")
    top_k = integer("num_experts_per_tok")
    if experts % n_group:
        raise ModelConfigError(f"n_routed_experts={experts} is not a multiple of n_group={n_group}")
    if experts // n_group < 2:
        # Groups are ranked by the sum of their two best scores.
        raise ModelConfigError(f"n_group={n_group} leaves fewer than 2 experts per group")
    if topk_group > n_group:
        raise ModelConfigError(f"topk_group={topk_group} exceeds n_group={n_group}")
    if top_k > topk_group * (experts // n_group):
        raise ModelConfigError(
            f"num_experts_per_tok={top_k} exceeds the {topk_group * (experts // n_group)} experts of "
            f"topk_group={topk_group} groups"
        )
    dense = integer("first_k_dense_replace", low=0)
    if dense > layers:
        raise ModelConfigError(f"first_k_dense_replace={dense} exceeds num_hidden_layers={layers}")
    if dense and fields["intermediate_size"] < 1:
        raise ModelConfigError("missing required field 'intermediate_size' (dense layers)")
    scaling = cfg.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"])
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or not scaling > 0:
        raise ModelConfigError(f"routed_scaling_factor={scaling!r} must be a positive number")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelConfigError(f"topk_method={cfg['topk_method']!r} is not supported (only 'noaux_tc')")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelConfigError(f"scoring_func={cfg['scoring_func']!r} is not supported (only 'sigmoid')")

    nope, v_dim = integer("qk_nope_head_dim"), integer("v_head_dim")
    rope = fields["rope"]
    # Softmax scale as DeepseekV3Attention: 1/sqrt(qk_head_dim), times mscale(factor,
    # mscale_all_dim)^2 for any scaled RoPE that sets mscale_all_dim (YaRN's attention
    # temperature for the full head, where cos/sin only carry mscale / mscale_all_dim).
    scale = (nope + rope_dim) ** -0.5
    m_all = _rope_params(cfg).get("mscale_all_dim")
    if rope.rope_type != "default" and m_all:
        scale *= _mscale(rope.factor, float(m_all)) ** 2
    fields.update(head_dim=rope_dim, attn_scale=scale, qkv_bias=False)
    return DeepseekV3Config(
        **fields,
        q_lora_rank=q_lora,
        kv_lora_rank=integer("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        moe_intermediate_size=integer("moe_intermediate_size"),
        n_routed_experts=experts,
        n_shared_experts=integer("n_shared_experts", low=0),
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=dense,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(scaling),
    )


class MLAttention(nn.Module):
    """One layer's multi-head latent attention (the attention interface of ``PagedAttention``).

    The step buffer holds, per token, the query [h, nope + rope] (RoPE applied to its rope part)
    followed by the token's cache entry [kv_lora_rank + rope].

    Under tensor parallelism (as vLLM splits MLA) a rank holds the query heads
    [r * h / size, (r + 1) * h / size): their rows of q_b_proj (q_proj) and kv_b_proj, their
    columns of o_proj (one all-reduce in ``output``, its bias on rank 0 only). The latent path
    (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is replicated: every rank
    computes the whole cache entry and its pool holds the whole latent (``cache_heads`` 1 on
    every rank), so attention needs no other collective."""

    def __init__(self, config: DeepseekV3Config, *, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        c = config
        H = c.hidden_size
        self.tp = tp
        self.q_heads = tp.split(c.num_attention_heads, "attention heads")  # global [start, stop)
        self.num_heads = self.q_heads[1] - self.q_heads[0]  # this rank's
        self._num_heads_total = c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_dim = self.nope + self.rope
        self.entry_dim = c.cache_head_dim
        self.scale = c.attn_scale
        bias = bool(c.o_bias)  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        q_rows = self.num_heads * self.qk_dim
        self.q_lora_rank = c.q_lora_rank
        if c.q_lora_rank is None:
            self.q_weight = _empty((q_rows, H), dtype, device)
        else:
            self.q_a_weight = _empty((c.q_lora_rank, H), dtype, device)
            self.q_a_bias = _empty((c.q_lora_rank,), dtype, device) if bias else None
            self.q_a_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
            self.q_weight = _empty((q_rows, c.q_lora_rank), dtype, device)  # q_b_proj
        self.kv_a_weight = _empty((self.entry_dim, H), dtype, device)  # rows: c_kv, k_pe
        self.kv_a_bias = _empty((self.entry_dim,), dtype, device) if bias else None
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, device=device)
        # kv_b_proj: per head, nope rows of W_UK then v_dim rows of W_UV, over the latent.
        self.kv_b_weight = _empty((self.num_heads * (self.nope + self.v_dim), self.kv_lora_rank), dtype, device)
        self.o_weight = _empty((H, self.num_heads * self.v_dim), dtype, device)
        # Added after the all-reduce's sum, so only rank 0 loads it (the others' stays zero).
        self.o_bias = _empty((H,), dtype, device) if bias else None

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [h, nope, c] and W_UV [h, v, c]: views of kv_b_proj."""
        w = self.kv_b_weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def step_buffers(self, T: int, workspace: Workspace, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        proj = workspace.get("mla_proj", (T, self.num_heads * self.qk_dim + self.entry_dim), dtype, device)
        att = workspace.get("attn", (T, self.num_heads * self.v_dim), dtype, device)
        return proj, att

    def output(self, att: torch.Tensor) -> torch.Tensor:  # [t, h * v] -> [t, H]
        return self.tp.all_reduce(F.linear(att, self.o_weight, self.o_bias))

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        """HF names -> what they fill: the rank's heads' rows of q_b_proj (q_proj) and
        kv_b_proj and columns of o_proj (Shards under tensor parallelism), the rest whole."""
        tp, (a, b), n = self.tp, self.q_heads, self._num_heads_total
        qk, kvb = self.qk_dim, self.nope + self.v_dim  # rows per head
        t: dict[str, torch.Tensor | Shard] = {}
        q = tp.shard(self.q_weight, 0, a * qk, b * qk, n * qk)
        if self.q_lora_rank is None:
            t[prefix + "q_proj.weight"] = q
        else:
            t[prefix + "q_a_proj.weight"] = self.q_a_weight
            if self.q_a_bias is not None:
                t[prefix + "q_a_proj.bias"] = self.q_a_bias
            t[prefix + "q_a_layernorm.weight"] = self.q_a_norm.weight
            t[prefix + "q_b_proj.weight"] = q
        t[prefix + "kv_a_proj_with_mqa.weight"] = self.kv_a_weight
        if self.kv_a_bias is not None:
            t[prefix + "kv_a_proj_with_mqa.bias"] = self.kv_a_bias
        t[prefix + "kv_a_layernorm.weight"] = self.kv_a_norm.weight
        t[prefix + "kv_b_proj.weight"] = tp.shard(self.kv_b_weight, 0, a * kvb, b * kvb, n * kvb)
        t[prefix + "o_proj.weight"] = tp.shard(self.o_weight, 1, a * self.v_dim, b * self.v_dim, n * self.v_dim)
        if self.o_bias is not None:
            t[prefix + "o_proj.bias"] = rank0_only(self.o_bias, tp)
        return t

    @torch.no_grad()
    def deinterleave_rope(self) -> None:
        """Once loaded: the rope rows of each held query head and of the cache entry, stored
        interleaved (x0, x1, x2, ...) in checkpoints, -> (x0, x2, ..., x1, x3, ...): the rotated
        pairs become the two halves rotate_in_place works on, so RoPE and the cached k_pe come
        out as transformers' apply_rotary_pos_emb_interleave writes them. A permutation within
        each head, so it is the same on a rank's shard as on the whole tensor."""
        rope = self.rope
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]).to(self.q_weight.device)
        heads = self.q_weight.view(self.num_heads, self.qk_dim, -1)
        heads[:, self.nope :] = heads[:, self.nope :][:, order]
        c = self.kv_lora_rank
        self.kv_a_weight[c:] = self.kv_a_weight[c:][order]
        if self.kv_a_bias is not None:
            self.kv_a_bias[c:] = self.kv_a_bias[c:][order]

    def project(
        self,
        x: torch.Tensor,  # [t, H], normalised hidden states of a tile of tokens
        cos: torch.Tensor,  # [t, 1, rope/2]
        sin: torch.Tensor,
        slots: torch.Tensor,  # [t] long: pool slot of each token's latent
        layer_kv: torch.Tensor,  # [1, num_blocks, B, 1, kv_lora_rank + rope]
        proj: torch.Tensor,  # [t, h * (nope + rope) + kv_lora_rank + rope]: receives q and the entry
    ) -> None:
        t, h = x.shape[0], self.num_heads
        q_cols = h * self.qk_dim
        q, entry = proj[:, :q_cols], proj[:, q_cols:]
        if self.q_lora_rank is None:
            torch.mm(x, self.q_weight.t(), out=q)
        else:
            torch.mm(self.q_a_norm(F.linear(x, self.q_a_weight, self.q_a_bias)), self.q_weight.t(), out=q)
        if self.kv_a_bias is None:
            torch.mm(x, self.kv_a_weight.t(), out=entry)
        else:
            torch.addmm(self.kv_a_bias, x, self.kv_a_weight.t(), out=entry)
        latent = entry[:, : self.kv_lora_rank]
        latent.copy_(self.kv_a_norm(latent))
        rotate_in_place(q.view(t, h, self.qk_dim)[:, :, self.nope :], cos, sin)
        rotate_in_place(entry[:, None, self.kv_lora_rank :], cos, sin)
        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        layer_kv.view(num_blocks * B, self.entry_dim).index_copy_(0, slots, entry)

    def attend(
        self,
        proj: torch.Tensor,  # [T, h * (nope + rope) + entry] from project, every token of the step
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [1, num_blocks, B, 1, entry], holding this step's entries too
        workspace: Workspace,
        out: torch.Tensor,  # [T, h * v] contiguous: receives the attention output
    ) -> None:
        T, h, nope, c, E = proj.shape[0], self.num_heads, self.nope, self.kv_lora_rank, self.entry_dim
        q = proj[:, : h * self.qk_dim].view(T, h, self.qk_dim)
        entries = proj[:, h * self.qk_dim :]  # [T, E]
        out = out.view(T, h, self.v_dim)
        num_blocks, B = layer_kv.shape[1], layer_kv.shape[2]
        block_rows = layer_kv.view(num_blocks, B * E)
        w_uk, w_uv = self._w_uk_uv()

        if meta.decode_gather_rows is not None:
            rows_all = meta.decode_gather_rows
            gathered = workspace.rows(rows_all.numel(), B * E, layer_kv.dtype, layer_kv.device)
            torch.index_select(block_rows, 0, rows_all, out=gathered)
        for g in meta.decode_groups:
            n, L = g.num_seqs, g.max_blocks * B
            keys = gathered[g.row_offset : g.row_offset + g.gather_rows.numel()].view(n, 1, L, E)
            qg = q.index_select(0, g.token_index)  # [n, h, nope + rope]
            # Absorbed query [n, 1, h, c + rope]: q_nope W_UK per head, then q_pe.
            q_abs = torch.empty((n, 1, h, E), dtype=q.dtype, device=q.device)
            q_abs[:, 0, :, :c] = torch.bmm(qg[:, :, :nope].transpose(0, 1), w_uk).transpose(0, 1)
            q_abs[:, 0, :, c:] = qg[:, :, nope:]
            o = F.scaled_dot_product_attention(
                q_abs, keys, keys[..., :c], attn_mask=g.masks[None], scale=self.scale,
            )  # [n, 1, h, c]: attention-weighted latents
            ov = torch.bmm(o[:, 0].transpose(0, 1), w_uv.transpose(1, 2))  # [h, n, v]
            out.index_copy_(0, g.token_index, ov.transpose(0, 1))
        for ch in meta.context_chunks:
            rows = slice(ch.start, ch.start + ch.num_new)
            if ch.gather_rows is None:
                keys = entries[rows]  # [n, E]: the chunk's own fresh entries
            else:
                buf = workspace.rows(ch.gather_rows.numel(), B * E, layer_kv.dtype, layer_kv.device)
                torch.index_select(block_rows, 0, ch.gather_rows, out=buf)
                keys = buf.view(ch.num_blocks * B, E)
            L = keys.shape[0]
            # Expanded per-head keys [h, L, nope + rope] and values [h, L, v].
            kv = F.linear(keys[:, :c], self.kv_b_weight).view(L, h, nope + self.v_dim)
            k = torch.empty((h, L, self.qk_dim), dtype=q.dtype, device=q.device)
            k[:, :, :nope] = kv[:, :, :nope].transpose(0, 1)
            k[:, :, nope:] = keys[None, :, c:]
            v = kv[:, :, nope:].transpose(0, 1)
            mask = ch.masks[None]
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                scale=self.scale,
            )  # [1, h, n, v]
            out[rows] = o[0].transpose(0, 1)


class DeepseekV3Router(nn.Module):
    """DeepSeek-V3's routing function (``noaux_tc``), as transformers' DeepseekV3TopkRouter:

    scores = sigmoid(logits); the selection adds ``e_score_correction_bias`` (the load-balancing
    bias, a checkpoint tensor): experts fall in ``n_group`` groups, a group ranks by the sum of
    its two best corrected scores, the best ``topk_group`` groups stay and the top k corrected
    scores among their experts are picked. The weights are the picked experts' uncorrected
    scores, divided by their sum when ``norm_topk_prob``, times ``routed_scaling_factor``; fp32.
    """

    def __init__(self, config: DeepseekV3Config, *, device: torch.device | str) -> None:
        super().__init__()
        c = config
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.num_experts = c.n_routed_experts
        self.renormalize, self.scaling = c.norm_topk_prob, c.routed_scaling_factor
        # fp32 whatever the model dtype (transformers keeps it so).
        self.e_score_correction_bias = _empty((c.n_routed_experts,), torch.float32, device)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "e_score_correction_bias": self.e_score_correction_bias}

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] fp32
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        T, G = choice.shape[0], self.n_group
        group_scores = choice.view(T, G, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        kept = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)  # [T, G]
        choice = choice.masked_fill(dropped[:, :, None].expand(T, G, self.num_experts // G).reshape(T, -1),
                                    float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class DeepseekV3MoE(SparseMoE):
    """The shared sparse MoE with DeepSeek's router; the router's logits are computed in fp32
    from an fp32 ``gate.weight`` whatever the model dtype, as transformers does. Under tensor
    parallelism the router (weight and correction bias) is whole on every rank, so every rank
    picks the same experts; the shared experts are split by width even with expert parallelism
    (as vLLM) and their partial sum joins the routed one before the block's one all-reduce."""

    def __init__(self, config: DeepseekV3Config, *, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = SINGLE) -> None:
        c = config
        shared = None
        if c.n_shared_experts:
            shared = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, False,
                              dtype=dtype, device=device, tp=tp, reduce=False)
        super().__init__(c.hidden_size, c.moe_intermediate_size, c.n_routed_experts,
                         route=DeepseekV3Router(c, device=device), act=c.hidden_act,
                         shared_experts=shared, dtype=dtype, device=device, tp=tp)
        self.router_weight = _empty((c.n_routed_experts, c.hidden_size), torch.float32, device)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32
        return F.linear(x.float(), self.router_weight)


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(DecoderLM):
    """MLA attention in every layer; dense MLPs in the first ``first_k_dense_replace`` layers,
    MoE after."""

    config: DeepseekV3Config

    def make_attention(self, layer: int) -> nn.Module:
        return MLAttention(self.config, dtype=self.dtype, device=self.device, tp=self.tp)

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        if not cfg.is_moe_layer(layer):
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, dtype=self.dtype, device=self.device,
                            tp=self.tp)
        return DeepseekV3MoE(cfg, dtype=self.dtype, device=self.device, tp=self.tp)

    def convert_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        skipped: set[int] = set()
        for name, tensor in split_fused_experts(tensors):
            m = _LAYER_NAME.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                # Multi-token-prediction modules are stored as extra layers (model.layers.61.*
                # in DeepSeek-V3); this decoder does not run them.
                layer = int(m.group(1))
                if layer not in skipped:
                    skipped.add(layer)
                    log.info("skipping checkpoint layer %d (beyond num_hidden_layers=%d: multi-token "
                             "prediction)", layer, cfg.num_hidden_layers)
                continue
            yield name, tensor

    def after_load(self) -> None:
        # The RoPE row order is fixed here, on each rank's loaded shard, so no checkpoint
        # tensor has to be read whole for it (MLAttention.deinterleave_rope).
        if self.config.rope_interleave:
            for layer in self.layers:
                layer.attn.deinterleave_rope()


def tiny_config(base: Mapping[str, Any]) -> dict[str, Any]:
    """make-tiny-model's DeepSeek-V3 keys: MLA over a latent of half the hidden size, the first
    layer dense, then 8 routed experts (top 2, from the best of 2 groups) and 1 shared expert."""
    hidden, head_dim = base["hidden_size"], base["head_dim"]
    return {
        "num_key_value_heads": base["num_attention_heads"],
        "head_dim": head_dim, "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 2,
        "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim, "v_head_dim": head_dim,
        "moe_intermediate_size": max(base["intermediate_size"] // 4, 8), "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "first_k_dense_replace": min(1, base["num_hidden_layers"]), "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_interleave": True, "attention_bias": False,
        "num_nextn_predict_layers": 0,
        # What pdserve and transformers assume; vLLM builds the correction bias only when told.
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }

"""Sparse mixture-of-experts MLP: a router picks k experts per token, each a gated MLP; the
token's output is the weighted sum of its experts' outputs.

API (other architectures reuse the parts separately):

- ``SparseMoE(hidden_size, intermediate_size, num_experts, route=..., act=..., ...)``: an MLP
  (``forward(x [T, H]) -> [T, H]``, ``weight_targets(prefix)``) holding every expert's weights
  stacked: ``gate_up_weight`` [E, 2I, H] (rows: gate then up, as transformers fuses them),
  ``down_weight`` [E, H, I], optional ``gate_up_bias`` [E, 2I] / ``down_bias`` [E, H], and the
  router ``router_weight`` [E, H] with optional ``router_bias`` [E].
- A routing function ``route(logits [T, E]) -> (topk_weights [T, k], topk_ids [T, k] int64)``.
  ``softmax_topk`` covers Mixtral and Qwen3-MoE. A router with parameters of its own (DeepSeek's
  ``e_score_correction_bias``) is an ``nn.Module`` whose ``forward`` is the routing function;
  ``SparseMoE`` registers it as a submodule and adds its ``weight_targets(prefix + router_name
  + ".")`` when it has one. Weights may be fp32 or the model dtype: each expert's output is
  multiplied by them and then cast to the model dtype before summing (transformers' order).
- An expert activation ``act(gate_up [t, 2I]) -> [t, I]``: ``silu_and_mul`` (default) or
  ``gelu_tanh_and_mul`` for halves [gate | up]; gpt-oss passes its clamped SwiGLU over
  interleaved columns.
- ``grouped_experts(x, topk_weights, topk_ids, gate_up_weight, down_weight, act, ...)``: the
  expert computation alone. The (token, expert) pairs are sorted by expert and each expert that
  has tokens runs one GEMM pair over its contiguous slice; outputs are scattered back with
  ``index_add_`` in ascending expert order. The Python loop is over active experts, never tokens.
- Checkpoint names: ``weight_targets`` lists the hub format, one tensor per expert
  (``experts.{e}.gate_proj.weight`` ...; ``ExpertNames`` renames them, e.g. Mixtral's w1/w3/w2),
  each target a view of its expert's slice so a loader writes experts one at a time.
  ``split_fused_experts`` turns transformers-5's fused tensors (``experts.gate_up_proj``
  [E, 2I, H], ``experts.down_proj`` [E, H, I], optional ``_bias``) into those per-expert names.
- Shared experts (DeepSeek's ``n_shared_experts``): pass any MLP (a ``GatedMLP``) as
  ``shared_experts``; every token goes through it and its output is added to the routed sum.
  Its checkpoint names sit under ``prefix + "shared_experts."``.
- ``MoeConfig``: the ``ModelConfig`` fields Mixtral and Qwen3-MoE add (``sparse_layers`` says
  per layer whether its MLP is the MoE or a dense ``GatedMLP`` of ``intermediate_size``).

Tensor parallelism (``tp``, parallel.py), the two layouts vLLM has:

- expert-tensor-parallel (the default): every rank holds every expert, each expert's
  intermediate width split as a dense MLP's (rank r: gate/up rows and down columns
  ``tp.split(I)``); the down biases are loaded by rank 0 only (``rank0_only``).
- expert-parallel (``tp.expert_parallel``, ``--enable-expert-parallel``): rank r holds the whole
  experts ``tp.split(E)`` at full width and computes only the (token, expert) pairs routed to
  them; other ranks' expert tensors are accepted by ``weight_targets`` and read nothing.

Either way the router is replicated and every rank routes the same all-reduced hidden states
with the same deterministic top-k, so each pair is computed exactly once over the group (an
expert-parallel rank trusts its peers to compute the pairs it skips: nothing random or
rank-dependent may enter routing). Shared experts are split by width in both layouts and leave
their all-reduce to the block (``reduce=False``): the block ends in one all-reduce of the
routed sum plus the shared output.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import _empty, rank0_only
from .parallel import SINGLE, Shard, TensorParallel

RoutingFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
ExpertActivation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MoeConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's gated MLP width
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1
    sparse_layers: tuple[bool, ...] = ()  # per layer: MoE MLP (True) or dense GatedMLP (False)


# ----------------------------------------------------------------- routing


def softmax_topk(logits: torch.Tensor, top_k: int, *, renormalize: bool,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, then the top k; ``renormalize``: the k weights are
    divided by their sum (Mixtral always, Qwen3-MoE when ``norm_topk_prob``). ``out_dtype``:
    cast the weights (Qwen3-MoE casts them to the logits' dtype; Mixtral keeps fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if out_dtype is not None:
        weights = weights.to(out_dtype)
    return weights, ids


# ----------------------------------------------------------------- activations


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [t, 2I] -> [t, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [t, 2I] -> [t, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


ACTIVATIONS: dict[str, ExpertActivation] = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


# ----------------------------------------------------------------- expert computation


def grouped_experts(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int
    gate_up_weight: torch.Tensor,  # [E, 2I, H]
    down_weight: torch.Tensor,  # [E, H, I]
    act: ExpertActivation = silu_and_mul,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
    down_bias: torch.Tensor | None = None,  # [E, H]
    expert_start: int | None = None,
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_j w[t, j] * down_e(act(gate_up_e(x[t]))) over each token's experts e = ids[t, j].
    ``expert_start`` (expert parallelism): the weights hold only the global experts
    [expert_start, expert_start + E); pairs of any other expert are skipped (another rank's)."""
    T, k = topk_ids.shape
    out = torch.zeros_like(x)
    if T == 0:
        return out
    num_experts = gate_up_weight.shape[0]
    flat_ids = topk_ids.reshape(-1)
    if expert_start is not None:
        # Local ids; every foreign pair becomes id E, which sorts after all local ones and is
        # never run (the loop below stops at E).
        flat_ids = flat_ids - expert_start
        flat_ids = flat_ids.masked_fill((flat_ids < 0) | (flat_ids >= num_experts), num_experts)
    # Stable: within an expert the pairs keep token order. Pair p is token p // k.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # the one host sync
    tokens = order // k
    pair_weights = topk_weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts[:num_experts]):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        h = F.linear(x.index_select(0, rows), gate_up_weight[e],
                     None if gate_up_bias is None else gate_up_bias[e])  # [n, 2I]
        y = F.linear(act(h), down_weight[e], None if down_bias is None else down_bias[e])  # [n, H]
        y = (y * pair_weights[start:start + n, None]).to(x.dtype)
        out.index_add_(0, rows, y)
        start += n
    return out


# ----------------------------------------------------------------- the layer


@dataclass(frozen=True)
class ExpertNames:
    """Per-expert checkpoint names under ``experts.{e}.`` (``.weight``/``.bias`` appended)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


HF_EXPERT_NAMES = ExpertNames()
MIXTRAL_EXPERT_NAMES = ExpertNames(gate="w1", up="w3", down="w2")


class SparseMoE(nn.Module):
    """Router + stacked experts; see the module docstring. Under tensor parallelism the expert
    parameters hold this rank's experts ``expert_range`` (global ids), each of its intermediate
    columns ``columns``; the router is whole on every rank."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, *,
        route: RoutingFn, act: ExpertActivation | str = "silu", router_bias: bool = False,
        expert_bias: bool = False, names: ExpertNames = HF_EXPERT_NAMES, router_name: str = "gate",
        shared_experts: nn.Module | None = None, dtype: torch.dtype, device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if isinstance(act, str):
            if act not in ACTIVATIONS:
                raise ValueError(f"unsupported expert activation {act!r}")
            act = ACTIVATIONS[act]
        if shared_experts is not None and getattr(shared_experts, "reduce", False) and tp.size > 1:
            # Its partial sum must join the routed one before the block's single all-reduce.
            raise ValueError("shared experts must leave the all-reduce to the MoE block (reduce=False)")
        self.act = act
        self.route = route  # an nn.Module router registers as a submodule (its parameters load)
        self.hidden_size = hidden_size
        self.full_intermediate = intermediate_size
        self.num_experts = num_experts
        self.names = names
        self.router_name = router_name
        self.tp = tp
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        if self.expert_parallel:  # whole experts per rank
            self.expert_range = tp.split(num_experts, "experts (--enable-expert-parallel)")
            self.columns = (0, intermediate_size)
        else:  # every expert on every rank, its width split
            self.expert_range = (0, num_experts)
            self.columns = tp.split(intermediate_size, "MoE expert intermediate size")
        E = self.expert_range[1] - self.expert_range[0]
        I = self.intermediate = self.columns[1] - self.columns[0]
        H = hidden_size
        self.router_weight = _empty((num_experts, H), dtype, device)
        self.router_bias = _empty((num_experts,), dtype, device) if router_bias else None
        self.gate_up_weight = _empty((E, 2 * I, H), dtype, device)
        self.gate_up_bias = _empty((E, 2 * I), dtype, device) if expert_bias else None
        self.down_weight = _empty((E, H, I), dtype, device)
        self.down_bias = _empty((E, H), dtype, device) if expert_bias else None
        self.shared_experts = shared_experts

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E], x.dtype
        return F.linear(x, self.router_weight, self.router_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        # Every rank routes the same x through the same router: identical ids everywhere.
        weights, ids = self.route(self.router_logits(x))
        out = grouped_experts(x, weights, ids, self.gate_up_weight, self.down_weight, self.act,
                              self.gate_up_bias, self.down_bias,
                              self.expert_range[0] if self.expert_parallel else None)
        if self.shared_experts is not None:
            out.add_(self.shared_experts(x))
        return self.tp.all_reduce(out)  # the partial sums (nothing at size 1)

    def owns(self, e: int) -> bool:
        """Whether global expert e's weights are on this rank."""
        return self.expert_range[0] <= e < self.expert_range[1]

    def down_bias_target(self, bias: torch.Tensor) -> torch.Tensor | Shard:
        """A down bias is added inside its expert: by its owner under expert parallelism, by
        rank 0 only when the experts' widths are split (the all-reduce then counts it once)."""
        return bias if self.expert_parallel else rank0_only(bias, self.tp)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor | Shard]:
        """Hub names: ``{router_name}.weight`` (and ``.bias``), the router module's own
        tensors, and per expert ``experts.{e}.{gate,up,down}.weight`` (and ``.bias``), each a
        view of its expert's slice (this rank's columns), or a Shard that reads nothing for
        another rank's expert (expert parallelism)."""
        I, n, tp = self.intermediate, self.names, self.tp
        a, b = self.columns
        full = self.full_intermediate
        r = prefix + self.router_name + "."
        t: dict[str, torch.Tensor | Shard] = {r + "weight": self.router_weight}
        if self.router_bias is not None:
            t[r + "bias"] = self.router_bias
        if isinstance(self.route, nn.Module) and hasattr(self.route, "weight_targets"):
            t.update(self.route.weight_targets(r))
        if self.shared_experts is not None:
            t.update(self.shared_experts.weight_targets(prefix + "shared_experts."))
        for e in range(self.num_experts):
            p = f"{prefix}experts.{e}."
            if not self.owns(e):
                # Zero-length Shards: the shapes are checked, no byte is read.
                skip = functools.partial(Shard, dim=0, start=0, stop=0)
                t[f"{p}{n.gate}.weight"] = skip(self.gate_up_weight[0, :0], full=full)
                t[f"{p}{n.up}.weight"] = skip(self.gate_up_weight[0, :0], full=full)
                t[f"{p}{n.down}.weight"] = skip(self.down_weight[0, :0], full=self.hidden_size)
                if self.gate_up_bias is not None:
                    t[f"{p}{n.gate}.bias"] = skip(self.gate_up_bias[0, :0], full=full)
                    t[f"{p}{n.up}.bias"] = skip(self.gate_up_bias[0, :0], full=full)
                    t[f"{p}{n.down}.bias"] = skip(self.down_bias[0, :0], full=self.hidden_size)
                continue
            i = e - self.expert_range[0]
            t[f"{p}{n.gate}.weight"] = tp.shard(self.gate_up_weight[i, :I], 0, a, b, full)
            t[f"{p}{n.up}.weight"] = tp.shard(self.gate_up_weight[i, I:], 0, a, b, full)
            t[f"{p}{n.down}.weight"] = tp.shard(self.down_weight[i], 1, a, b, full)
            if self.gate_up_bias is not None:
                t[f"{p}{n.gate}.bias"] = tp.shard(self.gate_up_bias[i, :I], 0, a, b, full)
                t[f"{p}{n.up}.bias"] = tp.shard(self.gate_up_bias[i, I:], 0, a, b, full)
                t[f"{p}{n.down}.bias"] = self.down_bias_target(self.down_bias[i])
        return t


_FUSED = re.compile(r"^(?P<prefix>.*\.)experts\.(?P<which>gate_up_proj|down_proj)(?P<bias>_bias)?$")


def split_fused_experts(
    tensors: Iterable[tuple[str, torch.Tensor]], names: ExpertNames = HF_EXPERT_NAMES,
    rename_prefix: Callable[[str], str] = lambda p: p,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, except transformers-5's fused expert tensors (``...experts.
    gate_up_proj`` [E, 2I, H], ``...experts.down_proj`` [E, H, I], and ``_bias`` [E, 2I] /
    [E, H]), which become per-expert hub names as views (no copies). ``rename_prefix`` maps the
    fused tensor's module prefix (``model.layers.0.mlp.``) to the one ``weight_targets`` uses
    (Mixtral: ``block_sparse_moe.``)."""
    for name, tensor in tensors:
        m = _FUSED.match(name)
        if m is None:
            yield name, tensor
            continue
        p = rename_prefix(m["prefix"])
        kind = "bias" if m["bias"] else "weight"
        for e in range(tensor.shape[0]):
            if m["which"] == "down_proj":
                yield f"{p}experts.{e}.{names.down}.{kind}", tensor[e]
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{p}experts.{e}.{names.gate}.{kind}", gate
                yield f"{p}experts.{e}.{names.up}.{kind}", up

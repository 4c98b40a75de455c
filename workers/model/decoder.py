"""The decoder every architecture shares, over a flat, paged batch.

One ``forward`` runs one engine step: T new tokens from any mix of sequences (context chunks and
decode tokens), the KV cache read from and written to a ``KVPool``. ``DecoderLM`` owns the
embedding, the layer stack, the final norm and the LM head; an architecture (one module under
``workers/model``, listed in ``registry.py``) subclasses it and overrides only the hooks where it
differs: ``make_attention``, ``make_mlp``, ``make_norm``, ``embed``, ``convert_weights``. The layer
runs pre-norm residual blocks, with Gemma's extra post-norms when ``sandwich_norms``.

Parameters use the model dtype (fp32 on CPU, bf16 on CUDA by default); logits come back in fp32.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import flex_attention
from .attention import PagedAttention, Workspace
from .batch import GROUP_GATHER_BYTES, AttentionMetadata, SeqBatchInfo
from .cuda_graphs import DecodeGraphs
from .config import ModelConfig
from .layers import (GatedMLP, PrepackedLinears, RMSNorm, RotaryEmbedding, _empty, can_prepack, linear,
                     prepack_weight)
from .parallel import SINGLE, Shard, TensorParallel, rank_cache_heads
from .weights import WeightSource, read_shard

if TYPE_CHECKING:
    from pdserve.transport.kv_pool import KVPool


log = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    """Checkpoint tensors do not match the model (missing, unexpected or misshapen)."""


# Tokens per tile of a layer's per-token work (norms, projections, RoPE, MLP) in big batches
# (prefill): intermediates such as the MLP's [tile, 2 * intermediate] stay small enough to be
# reused from the allocator's free lists, where step-sized ones are faulted in afresh in every
# layer (~10% of a 4096-token prefill on CPU); 512 rows still run matmuls at full speed.
TOKEN_TILE = 512


class DecoderLayer(nn.Module):
    """Pre-norm residual attention and MLP blocks. ``sandwich``: each block's output is
    normalised again before the residual add (Gemma's post_attention/post_feedforward norms,
    with pre_feedforward_layernorm as the MLP's input norm)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, make_norm: Callable[[], RMSNorm],
                 *, rope_index: int = 0, sandwich: bool = False) -> None:
        super().__init__()
        self.input_norm = make_norm()
        self.attn = attn
        self.post_attn_norm = make_norm()
        self.mlp = mlp
        self.sandwich = sandwich
        self.rope_index = rope_index
        if sandwich:
            self.pre_mlp_norm = make_norm()
            self.post_mlp_norm = make_norm()

    def forward(
        self,
        h: torch.Tensor,  # [T, H], updated in place
        cos_sin: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per rope: [T, 1, rot/2] each
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # this layer's pool view [planes, num_blocks, B, heads, d]
        workspace: Workspace,
        token_tile: int = TOKEN_TILE,
    ) -> torch.Tensor:  # [T, H], the same tensor as h
        T = h.shape[0]
        attn = self.attn
        cos, sin = cos_sin[self.rope_index]
        qkv, att = attn.step_buffers(T, workspace, h.dtype, h.device)
        tiles = [slice(a, min(a + token_tile, T)) for a in range(0, T, token_tile)]
        for t in tiles:
            attn.project(self.input_norm(h[t]), cos[t], sin[t], meta.slots[t], layer_kv, qkv[t])
        attn.attend(qkv, meta, layer_kv, workspace, att)
        for t in tiles:
            x = h[t]
            if self.sandwich:
                x.add_(self.post_attn_norm(attn.output(att[t])))
                x.add_(self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x))))
            else:
                x.add_(self.mlp(self.post_attn_norm.add_norm(x, attn.output(att[t]))))
        return h

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        t = {
            prefix + "input_layernorm.weight": self.input_norm.weight,
            prefix + "post_attention_layernorm.weight": self.post_attn_norm.weight,
        }
        if self.sandwich:
            t[prefix + "pre_feedforward_layernorm.weight"] = self.pre_mlp_norm.weight
            t[prefix + "post_feedforward_layernorm.weight"] = self.post_mlp_norm.weight
        t.update(self.attn.weight_targets(prefix + "self_attn."))
        t.update(self.mlp.weight_targets(prefix + self.mlp_prefix))
        return t

    mlp_prefix = "mlp."


class DecoderLM(nn.Module):
    """A decoder-only causal LM; architectures override the hooks below."""

    # Norms scale by 1 + w (Gemma) rather than w.
    norm_unit_offset: ClassVar[bool] = False
    sandwich_norms: ClassVar[bool] = False
    # Where each layer's MLP lives in checkpoint names (Mixtral: "block_sparse_moe.").
    mlp_prefix: ClassVar[str] = "mlp."

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp  # set before the hooks run: they size their shards by it
        H = config.hidden_size
        V = tp.vocab_rows(config.vocab_size)  # this rank's vocabulary slice (all of it at size 1)
        self.embed_weight = _empty((V, H), dtype, device)  # [V, H]
        layers = []
        for i in range(config.num_hidden_layers):
            layer = DecoderLayer(self.make_attention(i), self.make_mlp(i), self.make_norm,
                                 rope_index=config.rope_index(i), sandwich=self.sandwich_norms)
            layer.mlp_prefix = self.mlp_prefix
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = self.make_norm()
        self.lm_head_weight = (
            self.embed_weight if config.tie_word_embeddings else _empty((V, H), dtype, device)
        )
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(rope, rope.rotary_dim or config.head_dim, device=device) for rope in config.ropes
        )
        self.workspace = Workspace()
        self._lm_head_packed: torch.Tensor | None = None
        # Byte cap of one decode group's per-layer K/V gather (see batch.py); tunable.
        self.decode_group_bytes = GROUP_GATHER_BYTES
        self.token_tile = TOKEN_TILE  # tunable, see DecoderLayer
        # "sdpa" (gather + SDPA), "flex" (FlexAttention over the pool in place, flex_attention.py)
        # or "paged" (decode through pdserve's kernel: cpu_kernels.py, gpu_kernels.py on CUDA).
        self.attention_backend = "sdpa"
        # CUDA graphs of decode steps (cuda_graphs.py), set by enable_decode_graphs.
        self.decode_graphs: DecodeGraphs | None = None
        if self.flex_capable:
            self.set_attention_backend(flex_attention.default_backend(self.device, config.head_dim))

    @property
    def flex_capable(self) -> bool:
        """Every layer is plain paged GQA attention (not MLA, not gpt-oss's sinks)."""
        return all(type(layer.attn).attend is PagedAttention.attend for layer in self.layers)

    @property
    def graph_capable(self) -> bool:
        """Plain paged GQA attention and dense MLPs in every layer (enable_decode_graphs)."""
        return self.flex_capable and all(isinstance(layer.mlp, GatedMLP) for layer in self.layers)

    def set_attention_backend(self, backend: str) -> None:
        """"sdpa", "flex" or "paged" (flex_attention.BACKENDS); "flex" needs a flex-capable
        model and FlexAttention on this device (on CUDA also tokens per block a multiple of 16,
        checked at the first step); "paged" plain GQA attention with pdserve's decode kernel on
        this device (the CPU kernel built, or Triton on CUDA). Otherwise "sdpa", with a warning."""
        if backend not in flex_attention.BACKENDS:
            raise ValueError(f"attention backend must be one of {flex_attention.BACKENDS}, got {backend!r}")
        if backend == "flex" and not (self.flex_capable and flex_attention.flex_supported(self.device)):
            log.warning("flex attention is not available for this model on %s; using sdpa", self.device)
            backend = "sdpa"
        if backend == "paged" and not (self.flex_capable and flex_attention.paged_supported(
                self.device, self.config.head_dim)):
            log.warning("the paged decode kernel is not available for this model on %s; using sdpa", self.device)
            backend = "sdpa"
        self.attention_backend = backend

    def enable_decode_graphs(self, kv_pool: KVPool, *, max_batch: int, max_blocks: int,
                             capture: bool = True) -> DecodeGraphs | None:
        """Run decode-only steps over ``kv_pool`` as CUDA graphs (``capture=False``: the same
        fixed-shape path eagerly, for tests off CUDA). Only plain paged GQA attention (not MLA,
        not gpt-oss's sinks) with dense MLPs has it: a sparse MoE reads its routing on the host
        (one sync per layer), which a graph cannot hold. Other models keep eager steps (None)."""
        if not self.graph_capable or kv_pool.num_planes != 2:
            log.info("CUDA graphs: %s has layers without a fixed-shape decode path; eager steps",
                     type(self).__name__)
            return None
        self.decode_graphs = DecodeGraphs(self, kv_pool, max_batch=max_batch, max_blocks=max_blocks,
                                          capture=capture)
        return self.decode_graphs

    # ----------------------------------------------------------------- hooks

    def make_norm(self, size: int | None = None) -> RMSNorm:
        return RMSNorm(size or self.config.hidden_size, self.config.rms_norm_eps, dtype=self.dtype,
                       device=self.device, unit_offset=self.norm_unit_offset)

    def make_attention(self, layer: int) -> nn.Module:
        return PagedAttention(self.config, self.config.layer_windows[layer], dtype=self.dtype,
                              device=self.device, norm_unit_offset=self.norm_unit_offset, tp=self.tp)

    def make_mlp(self, layer: int) -> nn.Module:
        cfg = self.config
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype=self.dtype,
                        device=self.device, act=cfg.hidden_act, tp=self.tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        tp = self.tp
        if tp.size == 1:
            return F.embedding(input_ids, self.embed_weight)
        # Vocab-parallel: each rank looks up the ids in its slice (zeros elsewhere); the sum
        # over the ranks is the full lookup, exactly (one rank contributes each row).
        start, stop = tp.vocab(self.config.vocab_size)
        mine = (input_ids >= start) & (input_ids < stop)
        local = torch.where(mine, input_ids - start, 0)
        h = F.embedding(local, self.embed_weight)
        h.mul_(mine[:, None].to(h.dtype))
        return tp.all_reduce(h)

    def convert_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint (name, tensor) pairs -> the names ``weight_targets`` uses (an architecture
        whose checkpoints fuse, split or quantise tensors rewrites them here)."""
        yield from tensors

    # ----------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor | None,  # [T] long, or None to derive them from seqs
        seqs: Sequence[SeqBatchInfo],
        kv_pool: KVPool,
        *,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """One step over a flat batch. Writes the new tokens' KV into ``kv_pool`` and returns
        fp32 logits [len(seqs), V] of each sequence's last new token (in ``seqs`` order), or
        [T, V] for every flat row when ``all_logits``. ``on_layer(n)`` runs after layer n - 1
        has written its KV (layer-wise KV sends start from it)."""
        cfg = self.config
        if kv_pool.dtype != self.dtype or kv_pool.num_layers != cfg.num_hidden_layers:
            raise ValueError(f"{kv_pool!r} does not match the model ({cfg.num_hidden_layers} layers, {self.dtype})")
        if (kv_pool.num_planes, kv_pool.num_kv_heads, kv_pool.head_dim) != (
            cfg.kv_planes, rank_cache_heads(cfg, self.tp), cfg.cache_head_dim
        ):
            raise ValueError(f"{kv_pool!r} does not match the model's KV cache shape")
        graphs = self.decode_graphs
        if (graphs is not None and positions is None and not all_logits and on_layer is None
                and graphs.supports(seqs, kv_pool)):
            return graphs.run(input_ids, seqs)
        backend = self.attention_backend
        if backend == "flex" and self.device.type == "cuda" and not flex_attention.cuda_block_ok(kv_pool.tokens_per_block):
            log.warning("flex attention needs tokens_per_block a multiple of 16 on CUDA (got %d); using sdpa",
                        kv_pool.tokens_per_block)
            backend = self.attention_backend = "sdpa"
        try:
            return self._forward(input_ids, positions, seqs, kv_pool, backend, all_logits, on_layer)
        except flex_attention.FlexUnavailable as e:
            if not getattr(e, "before_first_layer", True):
                raise
            # The kernel failed to compile or run before any layer finished (nothing sent by
            # on_layer yet): run this step and every later one with gather + SDPA.
            log.warning("%s; falling back to the sdpa attention backend", e)
            self.attention_backend = "sdpa"
            return self._forward(input_ids, positions, seqs, kv_pool, "sdpa", all_logits, on_layer)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None, seqs: Sequence[SeqBatchInfo],
                 kv_pool: KVPool, backend: str, all_logits: bool,
                 on_layer: Callable[[int], None] | None) -> torch.Tensor:
        cfg = self.config
        T = input_ids.shape[0]
        meta = AttentionMetadata.build(
            seqs, T, kv_pool.tokens_per_block, kv_pool.num_blocks, cfg.layer_windows, self.device,
            block_bytes=kv_pool.num_planes * kv_pool.block_numel * kv_pool.kv.element_size(),
            group_bytes=self.decode_group_bytes, dtype=self.dtype, num_planes=kv_pool.num_planes,
            backend=backend,
        )
        if positions is not None and not torch.equal(positions.to(self.device), meta.positions):
            raise ValueError("positions disagree with the sequences' past_len")
        return self.run_layers(input_ids.to(self.device), meta, kv_pool, self.workspace, all_logits, on_layer)

    def run_layers(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_pool: KVPool, workspace: Workspace,
                   all_logits: bool = False, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The step's computation once its metadata is built: embedding, layers, norm, LM head
        (fp32 logits of each sequence's last row, or of every row). With device-side metadata
        and static buffers this is what a CUDA graph captures (cuda_graphs.py)."""
        cfg = self.config
        if meta.max_gather_rows:  # size the gather workspace once for the whole step
            workspace.rows(meta.max_gather_rows, kv_pool.block_numel, self.dtype, self.device)

        h = self.embed(input_ids)  # [T, H]
        cos_sin = [r.cos_sin(meta.positions, self.dtype) for r in self.rotaries]
        for i, layer in enumerate(self.layers):
            try:
                h = layer(h, cos_sin, meta, kv_pool.kv[i], workspace, self.token_tile)
            except flex_attention.FlexUnavailable as e:
                e.before_first_layer = i == 0
                raise
            if on_layer is not None:
                on_layer(i + 1)
        if not all_logits:
            h = h.index_select(0, meta.last_token_index)  # [num_seqs, H]
        logits = linear(self.norm(h), self.lm_head_weight, None, self._lm_head_packed)  # [rows, V (/ tp)]
        logits = self.tp.gather_vocab(logits, cfg.vocab_size).float()
        cap = cfg.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ----------------------------------------------------------------- weights

    def weight_targets(self) -> dict[str, torch.Tensor | Shard]:
        """HF checkpoint tensor name -> the (slice of a) parameter it fills, or the ``Shard`` of
        the checkpoint tensor this rank holds (tensor parallelism, parallel.py)."""
        V = self.config.vocab_size
        start, stop = self.tp.vocab(V)
        t: dict[str, torch.Tensor | Shard] = {
            "model.embed_tokens.weight": self.tp.shard(self.embed_weight[: stop - start], 0, start, stop, V),
            "model.norm.weight": self.norm.weight,
        }
        if not self.config.tie_word_embeddings:
            t["lm_head.weight"] = self.tp.shard(self.lm_head_weight[: stop - start], 0, start, stop, V)
        for i, layer in enumerate(self.layers):
            t.update(layer.weight_targets(f"model.layers.{i}."))
        return t

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, WeightSource]]) -> None:
        """Fill every parameter from (HF name, tensor) pairs, casting to the model dtype; a
        ``LazyTensor`` source is read only where this rank's ``Shard`` of it lies. Raises
        WeightLoadError naming the first missing, unexpected or misshapen tensor."""
        targets = self.weight_targets()
        missing = set(targets)
        for name, tensor in self.convert_weights(tensors):
            if name.endswith("rotary_emb.inv_freq"):
                continue  # derived from the config, stored by some old checkpoints
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head, as transformers does
            target = targets.get(name)
            if target is None:
                raise WeightLoadError(f"unexpected tensor {name!r} in checkpoint")
            expected = target.checkpoint_shape() if isinstance(target, Shard) else tuple(target.shape)
            if tuple(tensor.shape) != expected:
                raise WeightLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            if isinstance(target, Shard):
                if target.target.shape[target.dim] != target.stop - target.start:
                    target.target.zero_()  # rows no checkpoint slice fills (padding, rank 0's bias)
                if target.stop > target.start:  # an empty one (another rank's) reads nothing
                    part = read_shard(tensor, target)
                    target.target.narrow(target.dim, 0, part.shape[target.dim]).copy_(part)
            else:
                target.copy_(tensor.load() if not isinstance(tensor, torch.Tensor) else tensor)
            missing.discard(name)
        if missing:
            raise WeightLoadError(f"checkpoint lacks tensor {sorted(missing)[0]!r} ({len(missing)} missing)")
        self.after_load()
        self.prepack_linears()

    def after_load(self) -> None:
        """A family's fix-ups once every tensor is in place (DeepSeek's RoPE row order)."""

    def prepack_linears(self) -> None:
        """Give the CPU GEMM library its own layout of every dense projection (attention,
        MLP, LM head) once the weights are final; a no-op off CPU. Called by load_weights: code
        that changes weights afterwards must call it again."""
        for m in self.modules():
            if isinstance(m, PrepackedLinears):
                m.prepack()
        w = self.lm_head_weight
        self._lm_head_packed = prepack_weight(w) if can_prepack(w) else None

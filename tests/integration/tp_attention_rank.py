"""The attention modules of gpt-oss (``SinkAttention``) and DeepSeek-V3 (``MLAttention``) run
alone, for test_tensor_parallel_attention.py: one rank of a gloo group, or the unsharded module
(``run_case(case, SINGLE)``), over a few prefill and decode steps of a paged pool.

Not a test module (no test_ prefix); imported with its folder on sys.path so that
``torch.multiprocessing`` spawn children can import it too.
"""
from __future__ import annotations

import datetime
import random
from typing import Any

import torch
import torch.distributed as dist

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.loading.tiny_model import _config_json
from pdserve.workers.model import SeqBatchInfo, parse_config
from pdserve.workers.model.attention import Workspace
from pdserve.workers.model.batch import AttentionMetadata
from pdserve.workers.model.deepseek_v3 import MLAttention
from pdserve.workers.model.gpt_oss import SinkAttention
from pdserve.workers.model.layers import RotaryEmbedding
from pdserve.workers.model.parallel import SINGLE, Shard, TensorParallel, rank_cache_heads
from pdserve.workers.model.weights import read_shard

# name -> (family, config overrides). The gpt-oss cases split the KV heads (2 over 2 ranks)
# and replicate one; layer 0 slides over 5 tokens, layer 1 is full. The DeepSeek cases cover
# q-LoRA and plain q_proj, interleaved RoPE rows (de-interleaved per shard) and biases.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_oss_kv2": ("gpt_oss", {"num_key_value_heads": 2, "sliding_window": 5}),
    "gpt_oss_kv1": ("gpt_oss", {"num_key_value_heads": 1, "sliding_window": 5}),
    "mla_q_lora": ("deepseek_v3", {}),
    "mla_q_proj_bias": ("deepseek_v3", {"q_lora_rank": None, "attention_bias": True}),
}
HEADS, HIDDEN, LAYERS, VOCAB = 4, 64, 2, 300
BLOCKS, B = 32, 4
# Steps of (sequence, new tokens): fresh chunks, a chunk over cached tokens beside decodes
# and a fresh chunk, then decode steps; "a" runs past layer 0's window.
SCHEDULE = [[("a", 9), ("b", 3)], [("a", 1), ("b", 6), ("c", 7)], [("a", 1), ("b", 1), ("c", 1)],
            [("c", 1), ("a", 1), ("b", 1)]]


def config(case: str) -> Any:
    family, overrides = CASES[case]
    cfg = _config_json(family, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                       num_kv_heads=HEADS, intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                       max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
    return parse_config({**cfg, **overrides})


def build(cfg: Any, layer: int, tp: TensorParallel) -> torch.nn.Module:
    if cfg.model_type == "gpt_oss":
        return SinkAttention(cfg, cfg.layer_windows[layer], dtype=torch.float32, device="cpu", tp=tp)
    return MLAttention(cfg, dtype=torch.float32, device="cpu", tp=tp)


def checkpoint(cfg: Any, layer: int) -> dict[str, torch.Tensor]:
    """Seeded random checkpoint tensors of one layer's attention, whole (the unsharded
    module's targets): weights N(0, 1 / fan_in), so the activations stay of order 1."""
    gen = torch.Generator().manual_seed(100 + layer)
    out = {}
    for name, t in sorted(build(cfg, layer, SINGLE).weight_targets("").items()):
        if t.dim() == 2:
            out[name] = torch.randn(t.shape, generator=gen) / t.shape[1] ** 0.5
        elif "norm" in name:
            out[name] = 1 + 0.1 * torch.randn(t.shape, generator=gen)
        else:  # biases, sinks
            out[name] = 0.5 * torch.randn(t.shape, generator=gen)
    return out


@torch.no_grad()
def load(module: torch.nn.Module, tensors: dict[str, torch.Tensor], cfg: Any) -> None:
    """Fill every target as DecoderLM.load_weights does (a Shard reads its rows only), then
    the fix-ups after loading (DeepSeek's RoPE rows) and the CPU prepack."""
    targets = module.weight_targets("")
    assert set(targets) == set(tensors)
    for name, target in targets.items():
        tensor = tensors[name]
        if isinstance(target, Shard):
            assert tuple(tensor.shape) == target.checkpoint_shape(), name
            if target.target.shape[target.dim] != target.stop - target.start:
                target.target.zero_()
            part = read_shard(tensor, target)
            target.target.narrow(target.dim, 0, part.shape[target.dim]).copy_(part)
        else:
            assert tuple(tensor.shape) == tuple(target.shape), name
            target.copy_(tensor)
    if isinstance(module, MLAttention) and cfg.rope_interleave:  # DeepseekV3ForCausalLM.after_load
        module.deinterleave_rope()
    if hasattr(module, "prepack"):
        module.prepack()


@torch.no_grad()
def run_case(case: str, tp: TensorParallel) -> dict[str, Any]:
    """Every step's attention output [T, H] per layer (summed over the ranks) and the final pool."""
    cfg = config(case)
    layers = []
    for i in range(LAYERS):
        attn = build(cfg, i, tp)
        load(attn, checkpoint(cfg, i), cfg)
        layers.append(attn)
    pool = KVPool.for_model(cfg, BLOCKS, B, num_kv_heads=rank_cache_heads(cfg, tp))
    rotaries = [RotaryEmbedding(r, r.rotary_dim or cfg.head_dim, device="cpu") for r in cfg.ropes]
    ws = Workspace()
    free = list(range(BLOCKS))
    random.Random(0).shuffle(free)
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    outputs = []
    for step, parts in enumerate(SCHEDULE):
        seqs, T = [], 0
        for name, n in parts:
            table = tables.setdefault(name, [])
            while len(table) * B < lens.get(name, 0) + n:
                table.append(free.pop())
            seqs.append(SeqBatchInfo(T, n, lens.get(name, 0), tuple(table)))
            T += n
        meta = AttentionMetadata.build(
            seqs, T, B, BLOCKS, cfg.layer_windows, "cpu",
            block_bytes=pool.num_planes * pool.block_numel * pool.kv.element_size(),
            dtype=torch.float32, num_planes=pool.num_planes)
        x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(step))
        per_layer = []
        for i, attn in enumerate(layers):
            cos, sin = rotaries[cfg.rope_index(i)].cos_sin(meta.positions, torch.float32)
            proj, att = attn.step_buffers(T, ws, torch.float32, torch.device("cpu"))
            attn.project(x, cos, sin, meta.slots, pool.kv[i], proj)
            attn.attend(proj, meta, pool.kv[i], ws, att)
            per_layer.append(attn.output(att).clone())
        outputs.append(per_layer)
        for name, n in parts:
            lens[name] = lens.get(name, 0) + n
    kv_range = tp.kv_heads(cfg.cache_heads)
    return {"outputs": outputs, "kv": pool.kv.clone(), "kv_range": kv_range}


def rank_main(rank: int, size: int, store_path: str, cases: list[str], out_dir: str) -> None:
    """One rank (torch.multiprocessing.spawn's entry): join the gloo group over a FileStore,
    run every case, save the results as out_dir/rank{rank}.pt."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.FileStore(store_path, size)
    pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    tp = TensorParallel(rank, size, pg)
    torch.save({case: run_case(case, tp) for case in cases}, f"{out_dir}/rank{rank}.pt")

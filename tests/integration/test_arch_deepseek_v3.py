"""DeepSeek-V3 against transformers: multi-head latent attention over a one-plane latent cache
(absorbed for decode, expanded for context chunks), dense then MoE layers with grouped sigmoid
routing and a shared expert. Forward logits over flat batches that mix chunks and decode tokens
(with and without YaRN's mscale), greedy tokens through the engine (chunking, prefix reuse,
pauses) and across a 1P1D split, where the transfer must move exactly the latent."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.workers.loading.loader import load_model  # noqa: E402
from pdserve.workers.model import ModelConfigError, SeqBatchInfo, parse_config  # noqa: E402
from pdserve.workers.model.deepseek_v3 import DeepseekV3Router  # noqa: E402
from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

ATOL = 1e-4
LAYERS, KV_LORA_RANK, ROPE_DIM = 3, 32, 16
DS = dict(
    num_hidden_layers=LAYERS, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=KV_LORA_RANK,
    qk_nope_head_dim=16, qk_rope_head_dim=ROPE_DIM, v_head_dim=16, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5,
)
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    # q straight from the hidden state, projection biases, rotate-half RoPE, raw top-k weights
    "q_proj_bias_noninterleaved": {"q_lora_rank": None, "attention_bias": True, "rope_interleave": False,
                                   "norm_topk_prob": False, "n_shared_experts": 2},
    # YaRN with DeepSeek's mscale / mscale_all_dim: cos/sin scaled by their ratio, the softmax
    # scale by mscale(factor, mscale_all_dim)^2; prompts run past the original 32 positions.
    "yarn_mscale": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                     "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}


def build(tmp: Path, name: str) -> tuple[Any, Path]:
    hf, path = P.build_hf_model(tmp, "DeepseekV3Config", {**DS, **VARIANTS[name]}, name=name)
    with torch.no_grad():
        # The correction bias (a buffer, left at 0 by init) must change which experts are
        # picked, and router scores spread enough that the choice is not float noise.
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.mul_(50)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build(tmp_path_factory.mktemp("dsv3"), "base")


def _hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, P.VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Cache:
    """A one-plane pool with shuffled (non-contiguous) block tables."""

    def __init__(self, lm: Any, num_blocks: int = 96, B: int = 4) -> None:
        self.lm, self.pool = lm, KVPool.for_model(lm.config, num_blocks, B)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, parts: list[tuple[str, list[int]]]) -> torch.Tensor:  # all flat rows' logits
        ids, seqs = [], []
        for name, new in parts:
            past = self.lens.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * self.pool.tokens_per_block < past + len(new):
                table.append(self.free.pop())
            seqs.append(SeqBatchInfo(len(ids), len(new), past, tuple(table)))
            ids.extend(new)
        out = self.lm.model(torch.tensor(ids), None, seqs, self.pool, all_logits=True)
        for name, new in parts:
            self.lens[name] = self.lens.get(name, 0) + len(new)
        return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_matches_transformers(variant, base, tmp_path):
    hf, path = base if variant == "base" else build(tmp_path, variant)
    lm = load_model(path)
    cfg = lm.config
    assert (cfg.kv_planes, cfg.cache_heads, cfg.cache_head_dim) == (1, 1, KV_LORA_RANK + ROPE_DIM)
    if variant == "yarn_mscale":
        assert cfg.rope.rope_type == "yarn" and cfg.attn_scale > 32 ** -0.5
    cache = Cache(lm)
    assert cache.pool.num_planes == 1
    full = {name: _tokens(n, seed=10 + i) for i, (name, n) in enumerate([("a", 41), ("b", 34), ("c", 22), ("d", 9)])}
    # History through chunks (one ending mid-block), then one flat step mixing decode tokens,
    # a chunk over a cached prefix and a fresh prompt; then decode steps of every sequence.
    cache.step([("a", full["a"][:20]), ("b", full["b"][:33])])
    cache.step([("a", full["a"][20:39]), ("c", full["c"][:13])])
    parts = [("a", full["a"][39:40]), ("c", full["c"][13:21]), ("b", full["b"][33:]), ("d", full["d"])]
    got = cache.step(parts)
    ends = dict(cache.lens)
    more = cache.step([("a", full["a"][40:]), ("c", full["c"][21:])])
    row = 0
    for name, new in parts:
        ref = _hf_logits(hf, full[name])
        end = ends[name]
        torch.testing.assert_close(got[row:row + len(new)], ref[end - len(new):end], atol=ATOL, rtol=0)
        row += len(new)
    torch.testing.assert_close(more[0], _hf_logits(hf, full["a"])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(more[1], _hf_logits(hf, full["c"])[-1], atol=ATOL, rtol=0)


def test_router_matches_transformers():
    cfg = transformers.DeepseekV3Config(**{**P.SMALL, **DS, "n_routed_experts": 16, "n_group": 4,
                                           "topk_group": 2, "num_experts_per_tok": 3})
    ref = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    ours = DeepseekV3Router(parse_config({**cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}),
                            device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        ref.weight.normal_()
        ref.e_score_correction_bias.normal_(0, 0.3)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
        x = torch.randn(64, cfg.hidden_size)
        _, ref_w, ref_ids = ref(x)
        w, ids = ours(torch.nn.functional.linear(x, ref.weight))
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), atol=0, rtol=0)
    # the bias changed some choices (it selects, it does not weigh)
    plain = torch.topk(torch.sigmoid(torch.nn.functional.linear(x, ref.weight)), 3, dim=-1)[1].sort(-1)[0]
    assert not torch.equal(plain, ids.sort(-1)[0])


def test_engine_matches_transformers(base):
    hf, path = base
    figures = P.check_engine_parity(hf, path)
    assert figures["reused_blocks"] > 0 and figures["pauses"] > 0


def test_1p1d_moves_exactly_the_latent(base, tmp_path):
    hf, path = base
    latent = KV_LORA_RANK + ROPE_DIM
    assert load_model(path).config.kv_bytes_per_token(4) == LAYERS * latent * 4  # fp32
    # Unrelated prompts, so the generation side reuses no cached block and every block of
    # every prompt travels (the last one partly filled).
    batch = P.prompts(seed=2, shared_prefix=False)
    figures = P.check_disagg_parity(hf, path, tmp_path, batch=batch)
    B = P.DISAGG_ENGINE["tokens_per_block"]
    per_block = B * LAYERS * latent * 4  # one plane, one cache head: the latent and k_pe only
    blocks = [-(-len(p) // B) for p in batch]
    assert sorted(r["nbytes"] for r in figures["records"]) == sorted(n * per_block for n in blocks)
    assert figures["bytes"] == sum(blocks) * per_block


def test_make_tiny_model_loads_in_both(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", arch="deepseek_v3", num_layers=2, vocab_size=300)
    lm = load_model(path)
    assert lm.config.first_k_dense_replace == 1 and lm.config.kv_planes == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    tokens = _tokens(13, seed=5)
    got = Cache(lm).step([("a", tokens)])
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_fused_experts_and_mtp_layers_load(tmp_path, caplog):
    """transformers-5's fused expert tensors load like the hub's per-expert ones, and a
    multi-token-prediction layer past num_hidden_layers is skipped with a log line."""
    import logging
    import re

    from safetensors.torch import load_file, save_file

    path = make_tiny_model(tmp_path / "tiny", arch="deepseek_v3", num_layers=2, vocab_size=300)
    tokens = _tokens(11, seed=6)
    want = Cache(load_model(path)).step([("a", tokens)])
    w = load_file(str(path / "model.safetensors"))
    E, prefix = 8, "model.layers.1.mlp.experts."
    fused = {n: t for n, t in w.items() if not n.startswith(prefix)}
    fused[prefix + "gate_up_proj"] = torch.stack(
        [torch.cat([w[f"{prefix}{e}.gate_proj.weight"], w[f"{prefix}{e}.up_proj.weight"]]) for e in range(E)])
    fused[prefix + "down_proj"] = torch.stack([w[f"{prefix}{e}.down_proj.weight"] for e in range(E)])
    for n, t in w.items():  # an MTP module stored as layer 2 of a 2-layer model
        if n.startswith("model.layers.1."):
            fused[re.sub(r"^model\.layers\.1\.", "model.layers.2.", n)] = t.clone()
    fused["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(fused, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="pdserve.workers.model.deepseek_v3"):
        got = Cache(load_model(path)).step([("a", tokens)])
    assert torch.equal(got, want)
    assert any("skipping checkpoint layer 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("key,value,needle", [
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
    ("n_group", 3, "n_group"),
    ("topk_group", 4, "topk_group"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("first_k_dense_replace", 9, "first_k_dense_replace"),
    ("kv_lora_rank", None, "kv_lora_rank"),
    ("scoring_func", "softmax", "scoring_func"),
    ("topk_method", "greedy", "topk_method"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
])
def test_bad_config_names_the_key(key, value, needle):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **P.SMALL, **DS}
    cfg[key] = value
    with pytest.raises(ModelConfigError, match=needle):
        parse_config(cfg)

"""Qwen3-MoE and Mixtral against transformers: the paged forward over flat batches mixing context
chunks and decode tokens (norm_topk_prob on and off, a dense layer through mlp_only_layers, a
sliding window), both checkpoint formats, make-tiny-model output, and greedy tokens in process
(chunked prefill, prefix reuse, pause and recompute) and across a 1P1D split."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from test_model_parity import ATOL, Cache, _hf_logits, _step, _tokens  # noqa: E402

from pdserve.workers.loading.loader import load_model  # noqa: E402
from pdserve.workers.model.moe import SparseMoE  # noqa: E402
from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# name -> (config class, overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe_norm_dense1": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": True, "mlp_only_layers": [1],
                                                 "head_dim": 24}),
    "qwen3_moe_no_norm": ("Qwen3MoeConfig", {**MOE, "norm_topk_prob": False}),
    "mixtral_window": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                         "intermediate_size": 32, "sliding_window": 7}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Any, Path]]:
    tmp = tmp_path_factory.mktemp("moe")
    return {name: P.build_hf_model(tmp, cls, overrides, name=name) for name, (cls, overrides) in VARIANTS.items()}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_matches_transformers(built, name):
    hf, path = built[name]
    lm = load_model(path)
    kinds = [type(layer.mlp).__name__ for layer in lm.model.layers]
    assert kinds == (["SparseMoE", "GatedMLP"] if name.endswith("dense1") else ["SparseMoE"] * 2)
    prompt = _tokens(41, seed=1)
    torch.testing.assert_close(_step(lm, Cache(lm), [("a", prompt)], all_logits=True),
                               _hf_logits(hf, prompt), atol=ATOL, rtol=0)
    # One flat step: a decode token, a context chunk over a cached prefix, another decode
    # token, two fresh prompts (beyond the window for Mixtral's sequences).
    full = {n: _tokens(k, seed=10 + i) for i, (n, k) in enumerate([("a", 21), ("b", 34), ("c", 22), ("d", 9), ("e", 2)])}
    cache = Cache(lm)
    _step(lm, cache, [("a", full["a"][:20]), ("b", full["b"][:33])])
    _step(lm, cache, [("c", full["c"][:12])])
    parts = [("a", full["a"][20:]), ("c", full["c"][12:]), ("b", full["b"][33:]), ("d", full["d"]), ("e", full["e"])]
    got = _step(lm, cache, parts, all_logits=True)
    row = 0
    for n, new in parts:
        ref = _hf_logits(hf, full[n])[-len(new):]
        torch.testing.assert_close(got[row:row + len(new)], ref, atol=ATOL, rtol=0)
        row += len(new)


def test_fused_expert_checkpoints_load(built, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj,
    Mixtral's block named mlp) loads to the same model as the hub's per-expert tensors."""
    for name in ("qwen3_moe_no_norm", "mixtral_window"):
        hf, path = built[name]
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        fused = tmp_path / name
        fused.mkdir()
        for f in ("config.json", "tokenizer.json"):
            (fused / f).write_bytes((path / f).read_bytes())
        save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
        a, b = load_model(path).model, load_model(fused).model
        for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert na == nb and torch.equal(ta, tb), na


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tiny_model_loads_in_transformers(arch, tmp_path):
    path = make_tiny_model(tmp_path / arch, arch=arch, seed=3)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    lm = load_model(path)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in lm.model.layers)
    prompt = _tokens(12, seed=4)
    torch.testing.assert_close(_step(lm, Cache(lm), [("a", prompt)], all_logits=True),
                               _hf_logits(hf.eval(), prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_moe_norm_dense1", "mixtral_window"])
def test_engine_matches_transformers(built, name):
    hf, path = built[name]
    figures = P.check_engine_parity(hf, path)
    assert figures["reused_blocks"] > 0 and figures["pauses"] > 0


@pytest.mark.parametrize("name", ["qwen3_moe_norm_dense1", "mixtral_window"])
def test_1p1d_matches_transformers(built, name, tmp_path):
    hf, path = built[name]
    figures = P.check_disagg_parity(hf, path, tmp_path)
    head_dim = 24 if name.startswith("qwen3") else 16
    per_token = 2 * 2 * 2 * head_dim * 4  # K and V, 2 layers, 2 KV heads, fp32
    assert figures["bytes"] % (4 * per_token) == 0

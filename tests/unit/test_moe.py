"""The grouped expert computation against a naive per-token loop, on random data with uneven
expert loads (some experts with no tokens), and the routing and checkpoint-name helpers."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pdserve.workers.model.moe import (
    MIXTRAL_EXPERT_NAMES, SparseMoE, gelu_tanh_and_mul, grouped_experts, silu_and_mul,
    softmax_topk, split_fused_experts,
)

E, H, I, K = 6, 16, 8, 2


def naive(x, w, ids, gate_up, down, act, gate_up_b=None, down_b=None):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t] + (0 if gate_up_b is None else gate_up_b[e])
            y = down[e] @ act(h[None])[0] + (0 if down_b is None else down_b[e])
            out[t] += w[t, j] * y
    return out


def uneven_ids(T: int, gen: torch.Generator) -> torch.Tensor:
    """Top-2 ids that favour experts 0 and 1, never use experts 4 and 5, distinct per row."""
    ids = torch.empty(T, K, dtype=torch.long)
    for t in range(T):
        first = 0 if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(1, 4, (1,), generator=gen))
        second = (first + 1 + int(torch.randint(0, 3, (1,), generator=gen))) % 4
        ids[t] = torch.tensor([first, second])
    return ids


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", [silu_and_mul, gelu_tanh_and_mul])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_grouped_equals_naive(T, act, bias):
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    gb = torch.randn(E, 2 * I, generator=gen, dtype=torch.float64) if bias else None
    db = torch.randn(E, H, generator=gen, dtype=torch.float64) if bias else None
    ids = uneven_ids(T, gen)
    w = torch.rand(T, K, generator=gen, dtype=torch.float64)
    got = grouped_experts(x, w, ids, gate_up, down, act, gb, db)
    torch.testing.assert_close(got, naive(x, w, ids, gate_up, down, act, gb, db))


def test_grouped_splits_sum_to_the_whole():
    """Expert parallelism (each half of the experts, other pairs skipped) and a split of every
    expert's width (down bias on one part only) both sum to the unsplit result."""
    gen = torch.Generator().manual_seed(5)
    T = 13
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    gb = torch.randn(E, 2 * I, generator=gen, dtype=torch.float64)
    db = torch.randn(E, H, generator=gen, dtype=torch.float64)
    ids, w = uneven_ids(T, gen), torch.rand(T, K, generator=gen, dtype=torch.float64)
    whole = grouped_experts(x, w, ids, gate_up, down, silu_and_mul, gb, db)
    h = E // 2
    by_experts = sum(grouped_experts(x, w, ids, gate_up[s], down[s], silu_and_mul, gb[s], db[s], expert_start=s.start)
                     for s in (slice(0, h), slice(h, E)))
    torch.testing.assert_close(by_experts, whole)
    c = I // 2
    parts = []
    for cols, bias in ((slice(0, c), db), (slice(c, I), torch.zeros_like(db))):
        rows = torch.cat([torch.arange(I)[cols], I + torch.arange(I)[cols]])  # gate then up
        parts.append(grouped_experts(x, w, ids, gate_up[:, rows], down[:, :, cols], silu_and_mul,
                                     gb[:, rows], bias))
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_grouped_handles_no_tokens():
    out = grouped_experts(torch.empty(0, H), torch.empty(0, K), torch.empty(0, K, dtype=torch.long),
                          torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    assert out.shape == (0, H)


def test_weights_cast_after_the_product():
    # fp32 routing weights on a bf16 expert output: product in fp32, then rounded (Mixtral).
    x = torch.randn(5, H).bfloat16()
    ids = torch.tensor([[0, 1]] * 5)
    w = torch.full((5, K), 1 / 3)
    gate_up, down = torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()
    got = grouped_experts(x, w, ids, gate_up, down)
    assert got.dtype == torch.bfloat16
    ref = sum(((F.linear(silu_and_mul(F.linear(x, gate_up[e])), down[e]) * w[:, j:j + 1]).bfloat16()
               for j, e in enumerate((0, 1))), torch.zeros(5, H, dtype=torch.bfloat16))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_softmax_topk_orders_and_normalises():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    w, ids = softmax_topk(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, probs[:, [1, 2]])
    w, _ = softmax_topk(logits, 2, renormalize=True, out_dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16
    torch.testing.assert_close(w.float(), (probs[:, [1, 2]] / probs[:, [1, 2]].sum()), atol=1e-2, rtol=0)


def test_sparse_moe_targets_and_fused_names():
    # Seeded: unit-scale random weights leave a few fp32 outputs past assert_close's 1e-5 in
    # about 5% of draws (the grouped and naive sums round differently).
    torch.manual_seed(0)
    moe = SparseMoE(H, I, E, route=functools.partial(softmax_topk, top_k=K, renormalize=True),
                    names=MIXTRAL_EXPERT_NAMES, dtype=torch.float32, device="cpu")
    targets = moe.weight_targets("m.block_sparse_moe.")
    assert len(targets) == 1 + 3 * E
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    fused = [("m.mlp.experts.gate_up_proj", gate_up), ("m.mlp.experts.down_proj", down), ("other", torch.ones(1))]
    split = dict(split_fused_experts(fused, MIXTRAL_EXPERT_NAMES,
                                     lambda p: p.replace(".mlp.", ".block_sparse_moe.")))
    assert split.pop("other").item() == 1
    assert set(split) == set(targets) - {"m.block_sparse_moe.gate.weight"}
    for name, t in split.items():
        targets[name].copy_(t)
    assert torch.equal(moe.gate_up_weight, gate_up) and torch.equal(moe.down_weight, down)
    moe.router_weight.copy_(torch.randn(E, H))
    x = torch.randn(9, H)
    w, ids = softmax_topk(F.linear(x, moe.router_weight), K, renormalize=True)
    torch.testing.assert_close(moe(x), naive(x, w, ids, gate_up, down, silu_and_mul))


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
             "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def test_qwen3_moe_sparse_layers_and_refusals():
    from pdserve.workers.model import ModelConfigError, parse_config

    cfg = parse_config({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.sparse_layers == (False, True, False, False) and cfg.norm_topk_prob is False
    # transformers 5 saves num_experts as num_local_experts.
    cfg = parse_config({**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"},
                        "num_local_experts": 4, "norm_topk_prob": True})
    assert cfg.num_experts == 4 and all(cfg.sparse_layers) and cfg.norm_topk_prob
    for bad, match in [({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                       ({"moe_intermediate_size": None}, "moe_intermediate_size"),
                       ({"mlp_only_layers": [0], "intermediate_size": None}, "intermediate_size"),
                       ({"hidden_act": "relu"}, "hidden_act")]:
        with pytest.raises(ModelConfigError, match=match):
            parse_config({**QWEN3_MOE, **bad})


def test_mixtral_config():
    from pdserve.workers.model import parse_config

    cfg = parse_config({**QWEN3_MOE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                        "num_local_experts": 8, "num_experts": None, "sliding_window": 16})
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 128, True)
    assert cfg.layer_windows == (16,) * 4 and all(cfg.sparse_layers)

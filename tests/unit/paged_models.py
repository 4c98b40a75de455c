"""A small random-weight decoder for the paged-attention tests (test_flex_attention.py,
test_cuda_graphs.py): Qwen3 with GQA, qk-norm and one sliding-window layer between two full ones."""
from __future__ import annotations

import torch

from pdserve.workers.model import ModelConfig, build_model

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
)


def windowed_qwen3():
    """(config, fp32 CPU model with seeded random weights, prepacked)."""
    cfg = ModelConfig.from_hf_dict(CONFIG)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.prepack_linears()
    return cfg, model

"""gpt-oss against transformers: attention sinks, alternating sliding windows (smaller than the
prompts), YaRN without truncation, the MoE with a biased top-k-then-softmax router and clamped
SwiGLU experts (scaled up so the clamps bite); forward logits, the in-process engine (chunked
prefill, prefix reuse, pauses), a 1P1D split, MXFP4 checkpoints dequantised at load, and
``make_tiny_model(arch="gpt_oss")``."""
from __future__ import annotations

import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.workers.loading.loader import checkpoint_bytes, load_model  # noqa: E402
from pdserve.workers.model import ModelConfigError, SeqBatchInfo, parse_config  # noqa: E402
from pdserve.workers.model.gpt_oss import FP4_E2M1_VALUES, dequantize_mxfp4, sink_attention  # noqa: E402
from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

ATOL = 1e-4
WINDOW = 5
CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64, "rope_theta": 150000.0},
)
# Expert gate/up weights scaled so |gate| and |up| pass swiglu_limit (7) for many tokens.
EXPERT_SCALE = 40.0


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    hf, path = P.build_hf_model(tmp_path_factory.mktemp("gpt_oss"), "GptOssConfig", CONFIG)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.mul_(EXPERT_SCALE)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, P.VOCAB) for _ in range(n)]


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _clamp_fraction(hf, tokens: list[int]) -> float:
    """Share of expert gate values above the limit in layer 0 (the clamp must matter)."""
    seen = []
    experts = hf.model.layers[0].mlp.experts
    handle = type(experts)._apply_gate
    def spy(self, gate_up):
        seen.append((gate_up[..., ::2] > self.limit).float().mean().item())
        return handle(self, gate_up)
    type(experts)._apply_gate = spy
    try:
        _hf_logits(hf, tokens)
    finally:
        type(experts)._apply_gate = handle
    return sum(seen) / max(len(seen), 1)


def test_gpt_oss_forward_matches_transformers(gpt_oss):
    hf, path = gpt_oss
    lm = load_model(path)
    cfg = lm.config
    assert cfg.layer_windows == (WINDOW, None) and cfg.rope.rope_type == "yarn" and not cfg.rope.truncate
    assert cfg.qkv_bias and cfg.o_bias and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    a, b = _prompt(23, 0), _prompt(14, 1)
    assert _clamp_fraction(hf, a) > 0.05
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)

    pool = KVPool.for_model(cfg, 64, 4)
    full = lm.model(torch.tensor(a), None, [SeqBatchInfo(0, len(a), 0, tuple(range(10, 16)))], pool,
                    all_logits=True)
    torch.testing.assert_close(full, ref_a, atol=ATOL, rtol=0)

    # Chunks past the window, then a step mixing a chunk of b with decode tokens of a.
    pool = KVPool.for_model(cfg, 64, 4)
    ta, tb = (40, 3, 21, 7, 33, 2), (50, 11, 5, 60)
    got_a = [lm.model(torch.tensor(a[:9]), None, [SeqBatchInfo(0, 9, 0, ta)], pool, all_logits=True),
             lm.model(torch.tensor(a[9:17]), None, [SeqBatchInfo(0, 8, 9, ta)], pool, all_logits=True)]
    mixed = lm.model(torch.tensor(b[:10] + a[17:18]), None,
                     [SeqBatchInfo(0, 10, 0, tb), SeqBatchInfo(10, 1, 17, ta)], pool, all_logits=True)
    got_a.append(mixed[10:])
    got_b = [mixed[:10]]
    for j in range(5):  # decode a (and b while it has tokens) together
        pairs = [(a[18 + j], SeqBatchInfo(0, 1, 18 + j, ta))]
        if 10 + j < len(b):
            pairs.append((b[10 + j], SeqBatchInfo(1, 1, 10 + j, tb)))
        step = lm.model(torch.tensor([t for t, _ in pairs]), None, [s for _, s in pairs], pool, all_logits=True)
        got_a.append(step[:1])
        got_b.append(step[1:])
    torch.testing.assert_close(torch.cat(got_a), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), ref_b, atol=ATOL, rtol=0)

    # The sinks matter: without them the logits move well past the tolerance.
    with torch.no_grad():
        for layer in lm.model.layers:
            layer.attn.sinks.fill_(float("-inf"))
    pool = KVPool.for_model(cfg, 64, 4)
    no_sinks = lm.model(torch.tensor(a), None, [SeqBatchInfo(0, len(a), 0, tuple(range(6)))], pool, all_logits=True)
    assert (no_sinks - ref_a).abs().max() > 100 * ATOL


def test_sink_attention_tiles_match_eager():
    """Tiled online softmax (any key tile, masks or causal) equals transformers' eager formula:
    the sink column concatenated to the scores, softmaxed, dropped."""
    torch.manual_seed(0)
    kvh, g, n, L, d = 2, 3, 7, 19, 8
    q, k, v = torch.randn(kvh, g, n, d), torch.randn(kvh, 1, L, d), torch.randn(kvh, 1, L, d)
    sinks = torch.randn(kvh, g, 1, 1)
    q_pos = torch.arange(L - n, L)[:, None]
    allowed = (torch.arange(L)[None, :] <= q_pos) & (torch.arange(L)[None, :] > q_pos - 6)
    mask = torch.zeros(n, L).masked_fill_(~allowed, float("-inf"))

    def eager(q, k, v, mask):
        s = q @ k.transpose(-1, -2) * 0.25 + mask
        combined = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], dim=-1)
        probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
        return probs @ v

    ref = eager(q, k, v, mask)
    for tile in (1, 4, 19, None):
        torch.testing.assert_close(sink_attention(q, k, v, sinks, 0.25, mask, key_tile=tile), ref)
    causal = torch.zeros(n, n).masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = eager(q, k[..., :n, :], v[..., :n, :], causal)
    for tile in (2, 5, None):
        torch.testing.assert_close(sink_attention(q, k[..., :n, :], v[..., :n, :], sinks, 0.25, causal=True,
                                                  key_tile=tile), ref)


def test_gpt_oss_engine_matches_transformers(gpt_oss):
    hf, path = gpt_oss
    figures = P.check_engine_parity(hf, path)
    assert figures["reused_blocks"] > 0 and figures["pauses"] > 0


def test_gpt_oss_over_1p1d_matches_transformers(gpt_oss, tmp_path):
    hf, path = gpt_oss
    figures = P.check_disagg_parity(hf, path, tmp_path)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head_dim x fp32 bytes
    assert figures["bytes"] % (4 * per_token) == 0


# ----------------------------------------------------------------- MXFP4


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K % 32 == 0) -> blocks [..., K/32, 16] uint8, scales [..., K/32] uint8: each
    group of 32 scaled by a power of two so its largest magnitude is at most 6, every value
    rounded to the nearest e2m1 magnitude, the sign in bit 3, two codes per byte (even value
    in the low nibble)."""
    groups = w.reshape(*w.shape[:-1], -1, 32).float()
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0))
    scaled = groups / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8])
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(3, 64, 48) * torch.logspace(-3, 2, 48)  # an expert tensor [E, in, out]
    blocks, scales = encode_mxfp4(w.transpose(1, 2))  # quantised along `in`: [E, out, in/32, 16]
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    deq = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1).transpose(1, 2)  # group scale
    assert ((deq - w).abs() <= step).all()  # e2m1 gaps are at most 2 x scale: within one of w
    # Every code and the nibble order: random bytes and scales, against transformers again.
    blocks = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8)
    scales = torch.randint(100, 150, (2, 5, 3), dtype=torch.uint8)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2),
                       convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


def test_mxfp4_checkpoint_loads_like_transformers(gpt_oss, tmp_path, caplog):
    hf, path = gpt_oss
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[name + "_scales"], tensors[name + "_blocks"] = scales, blocks  # scales first: any order
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "tokenizer.json").write_text((path / "tokenizer.json").read_text())

    # The memory check counts the experts as loaded (dequantised), not as stored.
    assert checkpoint_bytes(out, torch.float32) == checkpoint_bytes(path, torch.float32)
    with caplog.at_level("INFO", logger="pdserve.workers.model.gpt_oss"):
        lm = load_model(out)
    assert lm.config.quant_method == "mxfp4" and "MXFP4" in caplog.text
    ref_hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    tokens = _prompt(19, 3)
    ref = _hf_logits(ref_hf, tokens)
    assert (ref - _hf_logits(hf, tokens)).abs().max() > ATOL  # the quantisation did change the model
    pool = KVPool.for_model(lm.config, 32, 4)
    got = lm.model(torch.tensor(tokens), None, [SeqBatchInfo(0, len(tokens), 0, tuple(range(5)))], pool,
                   all_logits=True)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    # A blocks tensor without its scales is named.
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks but lacks .*down_proj_scales"):
        load_model(out)


# ----------------------------------------------------------------- tiny model and config errors


def test_make_tiny_gpt_oss_loads_in_both(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", arch="gpt_oss", hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, intermediate_size=32, vocab_size=300, max_position_embeddings=512)
    lm = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    tokens = _prompt(40, 4)  # past the 32-token window
    pool = KVPool.for_model(lm.config, 32, 4)
    got = lm.model(torch.tensor(tokens), None, [SeqBatchInfo(0, len(tokens), 0, tuple(range(10)))], pool,
                   all_logits=True)
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-5, rtol=0)


BASE = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}


def test_gpt_oss_config_defaults_and_errors():
    cfg = parse_config(BASE)  # transformers' defaults for the keys left out
    assert cfg.layer_windows == (128, None) and cfg.rms_norm_eps == 1e-5 and cfg.qkv_bias and cfg.o_bias
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == ("yarn", 150000.0, 32.0, False)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert parse_config({**BASE, "attention_bias": False}).qkv_bias is False
    bad = {
        "quantization_config": {"quant_method": "fp8"},
        "num_experts_per_tok": 5,
        "num_local_experts": 0,
        "sliding_window": None,
        "swiglu_limit": "7",
        "layer_types": ["sliding_attention", "chunked_attention"],
    }
    for key, value in bad.items():
        with pytest.raises(ModelConfigError, match=key if key != "layer_types" else "layer type"):
            parse_config({**BASE, key: value})

"""The roofline cost model: model shapes, FLOP/byte counts, GPU presets, TP sizing, KV pool
sizing, the link, and calibration from measured steps."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest

from pdserve.bench.cost_model import (
    GPU_PRESETS,
    MODELS,
    CostModel,
    HardwareSpec,
    LinkSpec,
    ModelShape,
    SeqWork,
    calibrate,
    min_tp,
)

L8, L70 = MODELS["llama-3-8b"], MODELS["llama-3-70b"]


def test_llama3_shapes_match_the_published_sizes():
    assert 7.9e9 < L8.num_params < 8.1e9  # Meta-Llama-3-8B: 8.03B parameters
    assert 70.0e9 < L70.num_params < 71.0e9  # Meta-Llama-3-70B: 70.6B parameters
    assert L8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert L70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_prefill_flops_are_two_per_parameter_per_token_plus_attention():
    cost = CostModel(L8, GPU_PRESETS["H100"])
    n = 1024
    flops = cost.step_flops([SeqWork(n, 0, True)])
    linear = 2 * L8.num_layers * L8.linear_params_per_layer * n
    attention = 4 * L8.num_layers * L8.num_heads * L8.head_dim * (n * (n + 1) / 2)
    head = 2 * L8.hidden_size * L8.vocab_size
    assert flops == pytest.approx(linear + attention + head)
    # The same tokens split over two chunks cost the same linear FLOPs and the same attention.
    split = cost.step_flops([SeqWork(512, 0, False)]) + cost.step_flops([SeqWork(512, 512, True)])
    assert split == pytest.approx(flops)


def test_decode_is_memory_bound_and_long_prefill_compute_bound():
    cost = CostModel(L8, GPU_PRESETS["H100"])
    hw = cost.hardware
    decode = [SeqWork(1, 1000, True)]
    assert cost.step_bytes(decode) / hw.bytes_per_s > cost.step_flops(decode) / hw.flops
    prefill = [SeqWork(4096, 0, True)]
    assert cost.step_flops(prefill) / hw.flops > cost.step_bytes(prefill) / hw.bytes_per_s
    # Roofline: the step is the slower of the two plus the fixed overhead.
    expected = hw.step_overhead_s + cost.step_bytes(decode) / hw.bytes_per_s
    assert cost.step_time(decode) == pytest.approx(expected)
    assert cost.step_time([]) == 0.0


def test_more_bandwidth_speeds_decode_not_prefill():
    h100, h200 = CostModel(L8, GPU_PRESETS["H100"]), CostModel(L8, GPU_PRESETS["H200"])
    decode = [SeqWork(1, 2000, True)] * 32
    prefill = [SeqWork(8192, 0, True)]
    assert h200.step_time(decode) < h100.step_time(decode)
    assert h200.step_time(prefill) == pytest.approx(h100.step_time(prefill), rel=1e-3)
    a100 = CostModel(L8, GPU_PRESETS["A100"])
    assert a100.step_time(prefill) > 2.5 * h100.step_time(prefill)


def test_tensor_parallelism_splits_work_and_adds_all_reduce():
    one = CostModel(L70, GPU_PRESETS["H100"], tp=1)
    four = CostModel(L70, GPU_PRESETS["H100"], tp=4)
    prefill = [SeqWork(4096, 0, True)]
    assert four.step_bytes(prefill) == pytest.approx(one.step_bytes(prefill) / 4)
    t1, t4 = one.step_time(prefill), four.step_time(prefill)
    assert t1 / 4 < t4 < t1 / 2  # compute splits four ways, the all-reduces cost something


def test_min_tp_fits_the_weights():
    assert min_tp(L8, GPU_PRESETS["H100"]) == 1
    assert min_tp(L70, GPU_PRESETS["H100"]) == 4
    assert min_tp(L70, GPU_PRESETS["H200"]) == 2
    assert min_tp(L70, GPU_PRESETS["A100"]) == 4


def test_kv_pool_is_memory_left_after_the_weights():
    cost = CostModel(L8, GPU_PRESETS["H100"])
    blocks = cost.num_kv_blocks(32, mem_fraction=0.9)
    expected = (80e9 * 0.9 - L8.weight_bytes) // (32 * L8.kv_bytes_per_token)
    assert blocks == expected > 10_000
    assert CostModel(L70, GPU_PRESETS["H100"], tp=1).num_kv_blocks(32) == 0  # weights do not fit


def test_link_transfer_time():
    link = LinkSpec(bytes_per_s=10e9, latency_s=1e-4)
    assert link.transfer_time(0) == 0.0
    assert link.transfer_time(10**9) == pytest.approx(0.1001)
    assert link.transfer_time(10**9, tp=4) == pytest.approx(0.0251)


def test_shape_from_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": 259, "max_position_embeddings": 2048}))
    shape = ModelShape.from_hf_config(tmp_path)
    assert (shape.head_dim, shape.num_kv_heads, shape.dtype_bytes, shape.max_seq_len) == (32, 2, 4, 2048)
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4


def _steps(rng: random.Random, n: int) -> list[list[SeqWork]]:
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append([SeqWork(rng.randint(8, 512), 0, True)])
        else:
            out.append([SeqWork(1, rng.randint(10, 500), True) for _ in range(rng.randint(1, 16))])
    return out


def test_calibration_recovers_a_known_machine():
    shape = ModelShape("tiny", 4, 128, 4, 2, 32, 256, 259, dtype_bytes=4)
    truth = HardwareSpec("truth", peak_flops=20e9, mem_bw=4e9, mem_bytes=0, step_overhead_s=1e-3,
                         seq_overhead_s=5e-5, overlap=False)
    model = CostModel(shape, truth)
    steps = _steps(random.Random(0), 200)
    fit = calibrate(shape, [(s, model.step_time(s)) for s in steps])
    assert fit.hardware.peak_flops == pytest.approx(20e9, rel=1e-6)
    assert fit.hardware.mem_bw == pytest.approx(4e9, rel=1e-6)
    assert fit.hardware.step_overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert fit.hardware.seq_overhead_s == pytest.approx(5e-5, rel=1e-6)
    assert fit.rel_rmse < 1e-9 and not fit.hardware.overlap


def test_calibration_ignores_preempted_steps():
    """A few steps are stretched (another process held the core): the fit describes the rest."""
    shape = ModelShape("tiny", 4, 128, 4, 2, 32, 256, 259, dtype_bytes=4)
    truth = HardwareSpec("truth", peak_flops=30e9, mem_bw=math.inf, mem_bytes=0, step_overhead_s=2e-3,
                         overlap=False)
    model = CostModel(shape, truth)
    rng = random.Random(1)
    samples = []
    for s in _steps(rng, 300):
        t = model.step_time(s)
        samples.append((s, t + (0.004 if rng.random() < 0.1 else 0.0)))
    fit = calibrate(shape, samples)
    assert fit.num_samples < 300  # the stretched ones were dropped
    assert fit.hardware.step_overhead_s == pytest.approx(2e-3, rel=0.05)
    assert fit.hardware.peak_flops == pytest.approx(30e9, rel=0.05)


def test_calibration_needs_enough_samples():
    shape = ModelShape("tiny", 4, 128, 4, 2, 32, 256, 259)
    with pytest.raises(ValueError):
        calibrate(shape, [([SeqWork(8, 0, True)], 1e-3)])


def test_hardware_spec_round_trips_through_json_with_infinite_rates():
    hw = HardwareSpec("cpu", math.inf, 3e9, 0.0, step_overhead_s=1e-3, overlap=False)
    d = json.loads(json.dumps(hw.to_dict()))
    assert d["peak_flops"] is None
    assert HardwareSpec.from_dict(d) == hw


# ---------------------------------------------------------------------------- MoE and MLA

CONFIGS = Path(__file__).parent / "model_configs"  # published config.json files


def _shape(name: str, **kw) -> ModelShape:
    return ModelShape.from_hf_config(CONFIGS / f"{name}.json", dtype_bytes=2, **kw)


def test_deepseek_v3_sizes():
    """671B stored, ~37B per token (DeepSeek: 36.6B without the 0.9B input embedding), and a
    576-wide latent per token and layer."""
    ds = _shape("deepseek-v3")
    assert ds.mla is not None and ds.moe is not None
    assert ds.moe.num_moe_layers == 61 - 3 and ds.moe.shared_intermediate_size == 2048
    assert ds.num_params == pytest.approx(671e9, rel=0.01)
    assert ds.num_active_params == pytest.approx(37e9, rel=0.02)
    assert ds.num_active_params - ds.hidden_size * ds.vocab_size == pytest.approx(36.6e9, rel=0.01)
    assert ds.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    assert ds.cache_heads == 1
    # q_a, q_b, kv_a (latent + rotary key), kv_b (latent -> K_nope and V per head), o.
    assert ds.attention_params_per_layer == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576
                                             + 512 * 128 * 256 + 128 * 128 * 7168)
    # Absorbed attention: scores over 512 + 64, values over 512, per head and layer.
    assert ds.attention_flops_per_query_key == 2 * 61 * 128 * (576 + 512)


def test_mixtral_and_qwen3_moe_sizes():
    mixtral = _shape("mixtral-8x7b")
    assert mixtral.mla is None and mixtral.moe.num_moe_layers == 32
    assert mixtral.num_params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.num_active_params == pytest.approx(12.9e9, rel=0.01)
    assert mixtral.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    qwen = _shape("qwen3-30b-a3b")
    assert qwen.moe.num_experts == 128 and qwen.moe.top_k == 8 and qwen.moe.num_moe_layers == 48
    assert qwen.num_params == pytest.approx(30.5e9, rel=0.01)  # Qwen3-30B-A3B: 30.5B, 3.3B active
    assert qwen.num_active_params == pytest.approx(3.3e9, rel=0.02)
    assert qwen.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2


def test_dense_layers_of_each_moe_family():
    base = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                moe_intermediate_size=32, num_experts_per_tok=2, vocab_size=100)
    qwen = ModelShape.from_config_dict(dict(base, num_experts=16, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert qwen.moe.num_moe_layers == 3  # layers 1, 5, 7 (3 is MLP-only)
    deepseek = ModelShape.from_config_dict(dict(base, n_routed_experts=16, first_k_dense_replace=3,
                                                n_shared_experts=2))
    assert deepseek.moe.num_moe_layers == 5 and deepseek.moe.shared_intermediate_size == 64
    gpt_oss = ModelShape.from_config_dict(dict(base, num_local_experts=16, experts_per_token=4,
                                               num_experts_per_tok=None, moe_intermediate_size=None))
    assert (gpt_oss.moe.num_moe_layers, gpt_oss.moe.top_k, gpt_oss.moe.expert_intermediate_size) == (8, 4, 256)
    dense = ModelShape.from_config_dict(dict(base, num_experts=0))
    assert dense.moe is None
    # One MoE layer stores all experts and computes top_k; a dense layer the full MLP.
    h = 64
    per_moe_layer = h * 16 + 3 * h * 64 + 16 * 3 * h * 32
    assert deepseek.num_params == 8 * deepseek.attention_params_per_layer + 3 * 3 * h * 256 \
        + 5 * per_moe_layer + 2 * h * 100
    assert deepseek.active_linear_params == 8 * deepseek.attention_params_per_layer + 3 * 3 * h * 256 \
        + 5 * (per_moe_layer - 14 * 3 * h * 32)


def test_expected_distinct_experts_under_uniform_routing():
    moe = _shape("deepseek-v3").moe
    assert moe.expected_experts(0) == 0.0
    assert moe.expected_experts(1) == pytest.approx(8.0)
    assert moe.expected_experts(32) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 32))
    assert moe.expected_experts(4096) == pytest.approx(256.0)
    counts = [moe.expected_experts(t) for t in (1, 2, 8, 64, 512)]
    assert counts == sorted(counts)
    # Monte Carlo: top-8 of 256 without replacement, 20 tokens.
    rng = random.Random(0)
    trials = [len({e for _ in range(20) for e in rng.sample(range(256), 8)}) for _ in range(2000)]
    assert sum(trials) / len(trials) == pytest.approx(moe.expected_experts(20), rel=0.01)


def test_moe_step_reads_the_experts_its_tokens_touch():
    ds = _shape("deepseek-v3", weight_dtype_bytes=1)
    cost = CostModel(ds, GPU_PRESETS["H200"], tp=8)
    one = [SeqWork(1, 0, True)]
    # One token reads exactly its active weights (LM head included, embedding gathered).
    active_read = (ds.active_linear_params + ds.hidden_size * ds.vocab_size) * 1
    assert ds.step_weight_bytes(1) == pytest.approx(active_read)
    assert cost.step_bytes(one) == pytest.approx(active_read / 8 + 2 * ds.kv_bytes_per_token)
    # A big batch reads (nearly) every expert; never more than all the weights.
    assert ds.step_weight_bytes(8192) == pytest.approx(ds.streamed_weight_bytes, rel=1e-6)
    assert ds.step_weight_bytes(64) < ds.step_weight_bytes(256) < ds.streamed_weight_bytes
    # FLOPs: two per active parameter per token, whatever the batch touches.
    decode = [SeqWork(1, 0, False)] * 64
    assert cost.step_flops(decode) == pytest.approx(64 * (2 * ds.active_linear_params + ds.attention_flops_per_query_key))
    # Decode is memory bound and grows sublinearly with the batch until the experts saturate.
    t1, t64 = cost.step_time([SeqWork(1, 1000, True)]), cost.step_time([SeqWork(1, 1000, True)] * 64)
    assert t1 < t64 < 64 * t1


def test_mla_latent_is_whole_on_every_device_of_a_tp_group():
    ds = _shape("deepseek-v3", weight_dtype_bytes=1)
    one, eight = CostModel(ds, GPU_PRESETS["H200"], 1), CostModel(ds, GPU_PRESETS["H200"], 8)
    assert (one.kv_shards, eight.kv_shards) == (1, 1)
    long_decode = [SeqWork(1, 100_000, True)]
    kv = (100_000 + 2) * ds.kv_bytes_per_token
    assert eight.step_bytes(long_decode) == pytest.approx(ds.step_weight_bytes(1) / 8 + kv)
    # The pool per device: memory left after a device's share of the weights, over a whole block.
    free = 141e9 * 0.9 - ds.weight_bytes / 8
    assert eight.num_kv_blocks(32) == int(free // (32 * ds.kv_bytes_per_token))
    # A GQA cache splits by KV head, at most over its KV heads.
    assert CostModel(L70, GPU_PRESETS["H100"], 4).kv_shards == 4
    assert CostModel(L70, GPU_PRESETS["H100"], 16).kv_shards == 8


def test_benchmarks_doc_sizing_table_is_what_the_command_prints(capsys):
    """docs/benchmarks.md shows a DeepSeek-V3 sizing table under the command that prints it."""
    import shlex

    from model_sizing import main  # benchmarks/, on sys.path through tests/conftest.py

    doc = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    joined = re.sub(r"\\\n\s*", " ", doc)  # shell continuation lines
    lines = [line.strip() for line in joined.splitlines() if "benchmarks/model_sizing.py --config" in line]
    assert lines, "docs/benchmarks.md runs no benchmarks/model_sizing.py"
    for line in lines:
        words = shlex.split(line)
        assert main(words[words.index("benchmarks/model_sizing.py") + 1:]) == 0
        printed = capsys.readouterr().out.strip()
        assert printed in doc, f"docs/benchmarks.md is not what `{line}` prints now:\n{printed}"

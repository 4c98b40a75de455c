"""The roofline cost model: model shapes, FLOP/byte counts, GPU presets, TP sizing, KV pool
sizing, the link, and calibration from measured steps."""
from __future__ import annotations

import json
import math
import random

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

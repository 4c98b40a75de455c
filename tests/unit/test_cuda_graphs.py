"""Decode steps as CUDA graphs (workers/model/cuda_graphs.py), checked off CUDA.

The graph path is a fixed-shape decode step (batch and block-table width rounded up to a bucket,
padding rows repeating the last sequence, metadata computed on the device) that a CUDA graph
captures. With ``capture=False`` the same step runs eagerly, so on the CPU these tests check
everything but the capture itself: the logits equal the eager step's (fp32, 1e-5) over mixed
lengths, sliding windows and padded buckets, the pool holds the same K/V afterwards, and steps
the graphs cannot take (chunks, too many sequences, too long tables) go the eager way.
benchmarks/gpu_check.py runs the captured graphs on CUDA against transformers.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_models import StepDriver, greedy_tokens, windowed_qwen3  # noqa: E402

from pdserve.transport.kv_pool import KVPool  # noqa: E402
from pdserve.workers.model import SeqBatchInfo, build_model, parse_config  # noqa: E402
from pdserve.workers.model.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets  # noqa: E402

B = 4
_model = windowed_qwen3


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert width_buckets(1) == [1]
    assert width_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert width_buckets(65) == [1, 2, 4, 8, 16, 32, 64, 65]


def test_capture_needs_cuda() -> None:
    cfg, model = _model()
    pool = KVPool.for_model(cfg, 16, B)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(model, pool, max_batch=4, max_blocks=4)


@pytest.mark.parametrize("backend", ["sdpa", "paged"])
def test_graph_steps_match_eager_steps(backend) -> None:
    """Two pools fed the same steps: one always eager, one through the fixed-shape path for
    every decode-only step. Logits within 1e-5 and the same K/V in the pools. Both forms of
    the fixed-shape metadata: padded gathers with masks (sdpa), padded tables (paged)."""
    if backend == "paged" and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: pdserve's CPU decode kernel cannot be built")
    cfg, model = _model()
    model.set_attention_backend(backend)
    assert model.attention_backend == backend
    num_blocks = 200
    pools = {"eager": KVPool.for_model(cfg, num_blocks, B), "graph": KVPool.for_model(cfg, num_blocks, B)}
    graphs = model.enable_decode_graphs(pools["graph"], max_batch=12, max_blocks=16, capture=False)
    assert graphs is not None and model.decode_graphs is graphs
    driver = StepDriver(num_blocks, B)

    def step(parts: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        ids, seqs = driver.batch(parts)
        lens = driver.lens
        out = {}
        for mode, pool in pools.items():
            before = graphs.replays
            out[mode] = model(ids, None, seqs, pool)
            took_graph = graphs.replays > before
            assert took_graph == (mode == "graph" and all(n == 1 for _, n in parts)
                                  and len(parts) <= 12 and max(lens.get(k, 0) for k, _ in parts) // B < 16)
        driver.advance(parts)
        return out

    step([(i, 3 + 5 * i) for i in range(10)])  # prefills of 3 .. 48 tokens (eager in both)
    for k in range(14):
        active = list(range(10)) if k % 3 else list(range(1 + k % 7))  # batches of 1 .. 10
        out = step([(i, 1) for i in active])
        assert out["graph"].shape == (len(active), cfg.vocab_size)
        assert (out["graph"] - out["eager"]).abs().max().item() <= 1e-5, k
    step([(3, 4), (4, 1)])  # a chunk in the step: eager
    step([(i, 1) for i in range(10)] + [(10, 1), (11, 1), (12, 1)])  # 13 > 12 sequences: eager
    assert torch.allclose(pools["graph"].kv, pools["eager"].kv, atol=1e-5)
    # Buckets met: batch 1, 2, 4, 8 and 12 (10 rounds up to 12); widths up to 16.
    assert {n for n, _ in graphs.graphs} <= {1, 2, 4, 8, 12} and {12, 8}.issubset({n for n, _ in graphs.graphs})


def test_engine_greedy_tokens_equal_with_graph_path(tmp_path) -> None:
    """LLM.generate through the fixed-shape decode path gives the eager engine's tokens."""
    from pdserve.workers.loading.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", seed=3)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(6)]
    made = []

    def graphs_on(loaded, llm) -> None:
        made.append(loaded.model.enable_decode_graphs(llm.engine.kv_pool, max_batch=8, max_blocks=32,
                                                      capture=False))

    kw = dict(max_batch_size=8, num_kv_blocks=64, tokens_per_block=B)
    outs = {"eager": greedy_tokens(path, prompts, 20, **kw), "graph": greedy_tokens(path, prompts, 20, graphs_on, **kw)}
    assert made[0].replays >= 19  # every decode-only step went through it
    assert outs["graph"] == outs["eager"]


def test_enforce_eager_option() -> None:
    """vLLM's enforce_eager: a bool engine option (LLM keyword, `pdserve launch --enforce-eager`);
    on CPU the engine never enables graphs, whatever its value."""
    from pdserve.workers.config import EngineConfig

    assert EngineConfig().enforce_eager is False
    assert EngineConfig.from_kwargs({"enforce_eager": True}).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes")


def test_engine_on_cpu_has_no_graphs(tmp_path) -> None:
    from pdserve import LLM
    from pdserve.workers.loading.loader import load_model
    from pdserve.workers.loading.tiny_model import make_tiny_model

    loaded = load_model(make_tiny_model(tmp_path / "tiny", seed=3), dtype=torch.float32, device="cpu")
    LLM(loaded, device="cpu", max_batch_size=4, num_kv_blocks=16)
    assert loaded.model.decode_graphs is None


def test_models_without_a_fixed_shape_path_stay_eager() -> None:
    """A sparse MoE reads its routing on the host: no graphs for it."""
    cfg = parse_config(dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
        max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2))
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    assert not model.graph_capable
    assert model.enable_decode_graphs(KVPool.for_model(cfg, 8, B), max_batch=4, max_blocks=4,
                                      capture=False) is None
    _, dense = _model()
    assert dense.graph_capable


def test_a_malformed_step_is_refused_as_the_eager_step_refuses_it() -> None:
    cfg, model = _model()
    pool = KVPool.for_model(cfg, 16, B)
    graphs = model.enable_decode_graphs(pool, max_batch=4, max_blocks=4, capture=False)
    bad = [SeqBatchInfo(0, 1, 9, (1, 2))]  # 10 tokens need 3 blocks of 4
    assert not graphs.supports(bad, pool)
    with pytest.raises(ValueError, match="block table"):
        model(torch.tensor([5]), None, bad, pool)

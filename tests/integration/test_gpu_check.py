"""benchmarks/gpu_check.py's parity checks, on a tiny model on CPU in fp32 (the script itself runs
them on CUDA in bf16): the forward through every attention path and the engine's greedy
generation against transformers, plus the bf16 acceptance rule."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gpu_check  # noqa: E402  (benchmarks/, on sys.path through tests/conftest.py)
from pdserve import LLM  # noqa: E402
from pdserve.workers.loading.loader import load_model  # noqa: E402

SPEC = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            vocab_size=384, max_position_embeddings=1024, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = gpu_check.make_model(SPEC, tmp_path_factory.mktemp("gpu_check"))
    loaded = load_model(path, dtype=torch.float32, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return loaded, hf


def test_forward_parity_fp32(models) -> None:
    loaded, hf = models
    stats = gpu_check.forward_parity(loaded, hf, hf, "cpu", num_seqs=3, prompt_lens=(9, 40, 70), decode_steps=5)
    assert stats["positions"] == 9 + 40 + 70 + 3 * 5
    ok, msg = gpu_check.forward_ok(stats, torch.float32)
    assert ok, msg
    assert stats["argmax_pd_vs_fp32"] == stats["positions"]


def test_generation_parity_fp32(models) -> None:
    loaded, hf = models
    llm = LLM(loaded, device="cpu", max_batch_size=8, num_kv_blocks=64, tokens_per_block=16)
    prompts = [[5, 17, 200, 3], list(range(10, 60)), [7] * 21]
    result = gpu_check.generation_parity(llm, hf, hf, "cpu", prompts, 8, tie_tol=None)
    assert result["identical"] == 3 and result["ok"], result


def test_bf16_rule() -> None:
    stats = {"max_pd_fp32": 0.03, "max_hf_fp32": 0.02, "mean_pd_fp32": 0.002, "mean_hf_fp32": 0.002}
    assert gpu_check.forward_ok(stats, torch.bfloat16)[0]
    assert not gpu_check.forward_ok({**stats, "max_pd_fp32": 0.05}, torch.bfloat16)[0]
    assert not gpu_check.forward_ok({**stats, "mean_pd_fp32": 0.0041}, torch.bfloat16)[0]

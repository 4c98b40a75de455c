"""EngineConfig.small_step_threads: decode-sized steps run on fewer torch threads than prefill
chunks, switched per step by the executor; None leaves every step on the process's count."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.loader import load_model
from pdserve.workers.tiny_model import make_tiny_model


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_per_step(tmp_path, **engine) -> list[tuple[int, int]]:
    loaded = load_model(make_tiny_model(tmp_path / "m", seed=5), dtype=torch.float32, device="cpu")
    llm = LLM(loaded, device="cpu", max_batch_size=4, num_kv_blocks=64, **engine)
    seen: list[tuple[int, int]] = []
    forward = loaded.model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    loaded.model.forward = spy
    prompts = [[(3 * i + j) % 200 + 3 for j in range(80)] for i in range(2)]
    llm.generate(prompts, [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * 2)
    return seen


def test_small_steps_run_on_fewer_threads(tmp_path, two_threads) -> None:
    seen = _threads_per_step(tmp_path, small_step_threads=1, small_step_tokens=64)
    assert any(n >= 64 for n, _ in seen) and any(n < 64 for n, _ in seen)
    assert all(threads == (2 if n >= 64 else 1) for n, threads in seen), seen


def test_without_the_option_every_step_keeps_the_process_count(tmp_path, two_threads) -> None:
    assert {threads for _, threads in _threads_per_step(tmp_path)} == {2}


def test_the_options_are_checked() -> None:
    for bad in (dict(small_step_threads=0), dict(small_step_tokens=0), dict(small_step_threads="1")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)

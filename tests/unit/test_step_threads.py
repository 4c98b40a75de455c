"""EngineConfig.small_step_threads: decode-sized steps run on fewer torch threads than prefill
chunks, switched per step by the engine core; None leaves every step on the process's count; "auto"
measures the count per step size (workers/runner/step_threads.py, tested here as pure logic too)."""
from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.loading.loader import load_model
from pdserve.workers.runner.step_threads import StepThreads, bucket, candidates
from pdserve.workers.loading.tiny_model import make_tiny_model


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_per_step(tmp_path, max_tokens: int = 5, **engine) -> list[tuple[int, int]]:
    loaded = load_model(make_tiny_model(tmp_path / "m", seed=5), dtype=torch.float32, device="cpu")
    llm = LLM(loaded, device="cpu", max_batch_size=4, num_kv_blocks=64, **engine)
    seen: list[tuple[int, int]] = []
    forward = loaded.model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], torch.get_num_threads()))
        return forward(input_ids, *args, **kwargs)

    loaded.model.forward = spy
    prompts = [[(3 * i + j) % 200 + 3 for j in range(80)] for i in range(2)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * 2)
    seen.append(tuple(tuple(o.token_ids) for o in outs))  # last: the tokens
    return seen


def test_small_steps_run_on_fewer_threads(tmp_path, two_threads) -> None:
    seen = _threads_per_step(tmp_path, small_step_threads=1, small_step_tokens=64)[:-1]
    assert any(n >= 64 for n, _ in seen) and any(n < 64 for n, _ in seen)
    assert all(threads == (2 if n >= 64 else 1) for n, threads in seen), seen


def test_without_the_option_every_step_keeps_the_process_count(tmp_path, two_threads) -> None:
    assert {threads for _, threads in _threads_per_step(tmp_path)[:-1]} == {2}


def test_the_options_are_checked() -> None:
    for bad in (dict(small_step_threads=0), dict(small_step_tokens=0), dict(small_step_threads="two"),
                dict(small_step_threads="0"), dict(small_step_threads=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)
    # Flags and YAML give strings: a count, auto (any case) or off.
    assert EngineConfig(small_step_threads="3").small_step_threads == 3
    assert EngineConfig(small_step_threads=" AUTO ").small_step_threads == "auto"
    assert EngineConfig(small_step_threads="off").small_step_threads is None


def test_auto_times_both_counts_on_small_steps_and_keeps_the_tokens(tmp_path, two_threads) -> None:
    """With "auto", prefill-sized steps run on every thread, decode steps are timed on 1 and 2
    threads (nine steps each per size, then the faster), and the tokens are those of a run on
    two threads throughout: the result does not depend on the count."""
    seen = _threads_per_step(tmp_path, max_tokens=30, small_step_threads="auto", small_step_tokens=64)
    tokens, steps = seen[-1], seen[:-1]
    assert all(threads == 2 for n, threads in steps if n >= 64)
    small = [threads for n, threads in steps if n < 64]
    assert small.count(1) >= 9 and small.count(2) >= 9, small
    assert tokens == _threads_per_step(tmp_path / "plain", max_tokens=30)[-1]


# ---------------------------------------------------------------- StepThreads as pure logic


def test_candidates_and_buckets() -> None:
    assert candidates(1) == [1] and candidates(2) == [1, 2] and candidates(6) == [1, 2, 4, 6]
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def _drive(tuner: StepThreads, tokens: int, steps: int, cost) -> list[int]:
    """Run steps of ``tokens`` tokens whose time is cost(threads); returns the counts used."""
    used = []
    for _ in range(steps):
        t = tuner.threads_for(tokens)
        used.append(t)
        tuner.observe(tokens, t, cost(t))
    return used


def test_the_faster_count_is_chosen_per_step_size() -> None:
    tuner = StepThreads(2, 64, window=5, reprobe_every=100)
    # 4-token steps: one thread is faster (memory-bound); 16-token steps: two are.
    used4 = _drive(tuner, 4, 60, lambda t: {1: 0.008, 2: 0.009}[t])
    used16 = _drive(tuner, 16, 60, lambda t: {1: 0.015, 2: 0.012}[t])
    assert used4[:10].count(1) == 5 and used4[:10].count(2) == 5  # measured first, alternating
    assert set(used4[10:]) == {1} and set(used16[10:]) == {2}
    assert tuner.choices() == {4: 1, 16: 2}
    assert tuner.threads_for(64) == 2 and tuner.threads_for(500) == 2  # prefill: all threads


def test_medians_shrug_off_outliers_and_reprobes_follow_a_change() -> None:
    tuner = StepThreads(2, 64, window=5, reprobe_every=10)
    costs = {1: [0.008, 0.5, 0.008, 0.008, 0.008], 2: [0.009] * 5}  # one stalled 1-thread step
    for i in range(5):
        for t in (1, 2):
            tuner.observe(4, t, costs[t][i])
    assert tuner.threads_for(4) == 1  # the stall does not move the median
    # The machine changes: 1 thread is now slow. One re-timing every 10 steps moves the median
    # after enough of them, and the choice follows.
    used = _drive(tuner, 4, 200, lambda t: {1: 0.02, 2: 0.009}[t])
    assert 2 in used[:20] and set(used[-20:]) <= {1, 2} and used[-20:].count(2) >= 18
    assert tuner.choices() == {4: 2}


def test_a_fixed_count_or_a_single_thread_is_not_tuned() -> None:
    fixed = StepThreads(4, 32, fixed=1)
    assert [fixed.threads_for(n) for n in (1, 31, 32, 100)] == [1, 1, 4, 4]
    single = StepThreads(1, 32)
    assert not single.tuning and {single.threads_for(n) for n in (1, 8, 200)} == {1}
    with pytest.raises(ValueError):
        StepThreads(0, 32)

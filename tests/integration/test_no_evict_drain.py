"""Issue 46 through the offline API, as a new user would meet it: ``LLM.generate`` on the built-in
model under GUARANTEED_NO_EVICT with prefix reuse and FCFS chunking must return, with every
request finished.

The workload (B = 2 tokens per block, a pool of 21-24 blocks, max_num_tokens 16, FCFS chunks of
unit 1): prompts of 12 and 25 tokens sharing their first 12, an unrelated one of 21, 4 new
tokens each. Before the fix the 25-token request, skipped on the first step because the
12-token one was about to store their shared blocks, came back ahead of the 21-token one, which
had started prefilling meanwhile; it no longer fitted and its misfit ended the capacity pass
before the started request, so neither ever ran again and ``generate()`` spun forever
(scheduling.md 2.2; the scheduler-level test is tests/unit/test_scheduler_drain.py).

A hang must fail the test, not block the run: the engine's ``step`` is wrapped so that
``generate()`` raises after a bound far above the 10 steps the workload needs.
"""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

ENGINE = dict(
    tokens_per_block=2, max_num_tokens=16, context_chunking_policy="FIRST_COME_FIRST_SERVED",
    chunk_unit_size=1, enable_block_reuse=True, capacity_scheduler_policy="GUARANTEED_NO_EVICT",
)
PREFIX = [40 + i for i in range(25)]
PROMPTS = [PREFIX[:12], PREFIX[:25], [100 + i for i in range(21)]]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MAX_STEPS = 200


@pytest.fixture(scope="module")
def model_dir():
    from pdserve.cluster.launch import builtin_model_dir

    return builtin_model_dir()


def _bound_steps(llm: LLM, max_steps: int) -> list[int]:
    """Makes ``llm.generate`` raise once it has taken ``max_steps`` steps; returns a one-item
    list holding the number of steps taken."""
    engine = llm.engine
    step = engine.step
    taken = [0]

    def bounded_step():
        if taken[0] >= max_steps:
            core = engine.core
            states = [(r.request_id, r.state.name, r.context_current_position, r.prompt_len)
                      for r in core.active]
            raise AssertionError(
                f"generate() still running after {max_steps} steps: {states}, "
                f"{core.kv.get_num_free_blocks()} of {core.kv.num_blocks} blocks free")
        taken[0] += 1
        return step()

    engine.step = bounded_step  # generate() calls self.engine.step()
    return taken


@pytest.mark.parametrize("num_kv_blocks", [21, 22, 23, 24])
def test_generate_returns_with_every_request_finished(model_dir, num_kv_blocks):
    llm = LLM(model_dir, num_kv_blocks=num_kv_blocks, **ENGINE)
    taken = _bound_steps(llm, MAX_STEPS)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    kv = llm.engine.core.kv
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert taken[0] < 40

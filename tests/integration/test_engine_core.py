"""The engine core and the model runner meet only through plain data: the StepPlan a step
sends is ints, bools and tuples (msgpack carries it as it is), and a runner that receives the
plan as bytes produces exactly the engine's output. That is what lets a worker group send each
step's plan to its other ranks (their samplers stay on the rank that samples)."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.scheduler import LlmRequest
from pdserve.transport.kv_pool import KVPool
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.core import EngineCore
from pdserve.workers.loading.loader import load_model
from pdserve.workers.loading.tiny_model import make_tiny_model
from pdserve.workers.runner.model_runner import ModelRunner
from pdserve.workers.runner.plan import ScheduledSequence, StepPlan
from pdserve.workers.runner.sampling import SamplingParams

ENGINE = dict(max_batch_size=4, max_num_tokens=16, tokens_per_block=4, num_kv_blocks=64,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
              enable_block_reuse=True)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
           [11, 12, 13, 14, 15, 16, 17, 18, 40, 41], [90, 91, 92]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("core") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=259, seed=7)
    return load_model(path)


def _plain(value) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int))


class WireRunner(ModelRunner):
    """Runs each plan as another rank would get it: packed to bytes and rebuilt."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plans: list[StepPlan] = []

    def execute(self, plan, sampling, on_layer=None):
        self.plans.append(plan)
        wire = msgpack.packb([plan.input_ids, [dataclasses.astuple(s) for s in plan.sequences],
                              plan.num_context, plan.stream_request_ids])
        ids, seqs, num_context, streams = msgpack.unpackb(wire)
        rebuilt = StepPlan(tuple(ids), tuple(ScheduledSequence(*s[:4], tuple(s[4]), *s[5:7], tuple(s[7]))
                                             for s in seqs), num_context, tuple(streams))
        assert rebuilt == plan
        return super().execute(rebuilt, sampling, on_layer)


def _run(loaded, runner_cls) -> tuple[dict[int, list[int]], ModelRunner]:
    config = EngineConfig.from_kwargs(ENGINE)
    pool = KVPool.for_model(loaded.config, config.num_kv_blocks, config.tokens_per_block,
                            dtype=loaded.model.dtype, device="cpu")
    runner = runner_cls(loaded.model, pool)
    core = EngineCore(runner, config, eos_token_ids=loaded.eos_token_ids,
                      vocab_size=loaded.config.vocab_size,
                      max_seq_len=loaded.config.max_position_embeddings)
    for rid, prompt in enumerate(PROMPTS):
        core.add_request(LlmRequest(rid, prompt, 6),
                         SamplingParams(max_tokens=6, temperature=0.8, seed=rid, ignore_eos=True,
                                        logprobs=2, prompt_logprobs=1 if rid == 2 else None))
    out: dict[int, list[int]] = {}
    for _ in range(100):
        if not core.has_work:
            break
        for update in core.step():
            out.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert not core.has_work and core.status()["violations"] == []
    return out, runner


def test_a_plan_is_plain_data_and_enough_for_the_forward(loaded):
    direct, _ = _run(loaded, ModelRunner)
    wired, runner = _run(loaded, WireRunner)
    assert wired == direct and all(len(t) == 6 for t in direct.values())
    assert runner.plans and all(_plain(dataclasses.astuple(s)) for p in runner.plans for s in p.sequences)
    first = runner.plans[0]
    assert first.num_context == len(first.sequences)  # the first step is all prefill chunks
    assert sum(s.num_new_tokens for s in first.sequences) == first.num_tokens <= ENGINE["max_num_tokens"]
    decode = [p for p in runner.plans if p.num_context == 0]
    assert decode and all(s.num_new_tokens == 1 and s.samples for p in decode for s in p.sequences)
    # Every row's table covers its positions (B = 4).
    assert all(len(s.block_table) * 4 >= s.past_len + s.num_new_tokens
               for p in runner.plans for s in p.sequences)

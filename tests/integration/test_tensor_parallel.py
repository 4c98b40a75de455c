"""Tensor parallelism on this machine: gloo, float32, random weights (issue 43, part 7).

A worker group of 2 ranks (``LLM(model, tensor_parallel_size=2)``: rank 0 here, rank 1 a child
process) must produce what one rank does: greedy tokens identical and every logprob within
1e-4, for each family pdserve serves. The models are made so that the split is real: more KV
heads than ranks and fewer (replicated), a vocabulary the ranks do not divide evenly (the last
vocab slice is padded), biases after the all-reduce (Qwen2's qkv, gpt-oss's o_proj).
"""
from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.workers.loading.tiny_model import make_tiny_model

PROMPTS = ["hello world", "the quick brown fox jumps over", "tensor parallel"]
ENGINE = dict(tokens_per_block=4, num_kv_blocks=96, max_batch_size=4, max_num_tokens=32,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def run(model_dir, **engine) -> list:
    with LLM(str(model_dir), **ENGINE, **engine) as llm:
        return llm.generate(PROMPTS, GREEDY)


def assert_same(one: list, two: list) -> None:
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id
            assert abs(la.logprob - lb.logprob) < 1e-4, (la, lb)
            for (ta, pa), (tb, pb) in zip(la.top, lb.top, strict=True):
                assert abs(pa - pb) < 1e-4


@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("llama", 1), ("qwen2", 4), ("qwen3", 2),
                                           ("gemma3", 1)])
def test_tp2_matches_tp1(tmp_path, arch: str, kv_heads: int) -> None:
    d = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=kv_heads, vocab_size=301, seed=3)
    assert_same(run(d), run(d, tensor_parallel_size=2))

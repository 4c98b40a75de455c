"""Tensor-parallel attention of gpt-oss (sinks) and DeepSeek-V3 (MLA): 2 ranks against 1.

The attention modules alone (tp_attention_rank.py), two gloo ranks spawned as processes: every
step's attention output (after the all-reduce) within 1e-5 of the unsharded module's, over
prefill chunks, a chunk over cached tokens and decode steps, on a windowed and a full layer.
The pool each rank holds is the unsharded pool's part: gpt-oss's KV heads of the rank (split,
or one replicated), MLA's whole latent on every rank. Then whole models through
``LLM(tensor_parallel_size=2)`` against one rank (greedy tokens equal, logprobs within 1e-4):
DeepSeek-V3 with every layer dense, gpt-oss (its MoE not yet split on this branch: every rank
computes all of it). And TP sizes that cannot split the query heads.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

import tp_attention_rank as R
from pdserve import LLM, SamplingParams
from pdserve.workers.loading.tiny_model import _random_weights, make_tiny_model
from pdserve.workers.model.parallel import TensorParallel, TPShapeError

TOL = 1e-5


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    """Both ranks' results of every case (one spawn for all of them)."""
    d = tmp_path_factory.mktemp("tp_attn")
    mp.spawn(R.rank_main, args=(2, str(d / "store"), list(R.CASES), str(d)), nprocs=2, join=True)
    return [torch.load(d / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", list(R.CASES))
def test_attention_tp2_matches_tp1(tp2_results, case: str) -> None:
    ref = R.run_case(case, TensorParallel())
    for rank, results in enumerate(tp2_results):
        got = results[case]
        for step, (ref_layers, got_layers) in enumerate(zip(ref["outputs"], got["outputs"], strict=True)):
            for layer, (a, b) in enumerate(zip(ref_layers, got_layers, strict=True)):
                err = (a - b).abs().max().item()
                assert err < TOL, (case, rank, step, layer, err)
        # [layers, planes, blocks, B, heads, d]: the rank's cache heads of the whole pool.
        lo, hi = got["kv_range"]
        assert (lo, hi) == ((rank, rank + 1) if case == "gpt_oss_kv2" else (0, 1))
        assert (ref["kv"][..., lo:hi, :] - got["kv"]).abs().max().item() < TOL


def test_mla_latent_is_replicated_exactly(tp2_results) -> None:
    # The latent path is replicated (same weights, same inputs): the ranks' pools are equal bit
    # for bit, so either rank can serve as the KV transfer's source.
    for case in ("mla_q_lora", "mla_q_proj_bias"):
        assert torch.equal(tp2_results[0][case]["kv"], tp2_results[1][case]["kv"])


@pytest.mark.parametrize("case", ["gpt_oss_kv2", "mla_q_lora"])
def test_tp_size_not_dividing_query_heads_names_the_numbers(case: str) -> None:
    cfg = R.config(case)
    with pytest.raises(TPShapeError, match="tensor parallel size 3 does not divide 4 attention heads"):
        R.build(cfg, 0, TensorParallel(0, 3))


PROMPTS = ["hello world", "the quick brown fox jumps over", "tensor parallel"]
ENGINE = dict(tokens_per_block=4, num_kv_blocks=96, max_batch_size=4, max_num_tokens=32,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


def _tiny(tmp_path, arch: str):
    if arch == "gpt_oss":  # one KV head, replicated over the ranks; the MoE as it is on this branch
        return make_tiny_model(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=1, vocab_size=301, seed=3)
    # DeepSeek-V3 with every layer dense (first_k_dense_replace = layers: no MoE weights) and
    # attention biases: o_proj's is added once (rank 0), q_a/kv_a's are replicated.
    d = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=4, vocab_size=301, seed=3)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(first_k_dense_replace=cfg["num_hidden_layers"], attention_bias=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(_random_weights(cfg, 3), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_llm_tp2_matches_tp1(tmp_path, arch: str) -> None:
    # The whole model through the worker group and the lazy shard reads of the loader.
    d = _tiny(tmp_path, arch)
    outs = []
    for engine in ({}, {"tensor_parallel_size": 2}):
        with LLM(str(d), **ENGINE, **engine) as llm:
            outs.append(llm.generate(PROMPTS, GREEDY))
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.token_id == lb.token_id
            assert abs(la.logprob - lb.logprob) < 1e-4, (la, lb)

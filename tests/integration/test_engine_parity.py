"""The in-process engine against transformers: token-exact greedy parity in fp32 on tiny random
Llama and Qwen2 models saved with ``save_pretrained`` and loaded through pdserve's loader, under
every scheduling configuration that changes how a prompt is computed (chunking, eviction and
recompute, prefix reuse), plus the engine's own contracts (seeded sampling, abort, pool drain,
bad model directories)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers.loading.loader import ModelLoadError  # noqa: E402
from pdserve.workers.loading.tiny_model import build_byte_tokenizer  # noqa: E402

VOCAB = 300
MAX_NEW = 12
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
}


def _save(tmp: Path, arch: str, seed: int = 0):
    cls_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cls_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, **extra,
    )
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        # Spread the logits (random init makes them nearly flat) so greedy choices are not
        # decided by float noise between the paged and the dense attention.
        hf.get_output_embeddings().weight.mul_(20.0)
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp / arch
    hf.save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    return hf, out


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, tmp_path_factory):
    return _save(tmp_path_factory.mktemp("engine"), request.param)


def _prompts(seed: int = 1, shared_prefix: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(24)]
    prompts = []
    for n in (3, 9, 17, 30, 47, 6):
        tail = [rng.randrange(3, VOCAB) for _ in range(n)]
        prompts.append(prefix[: 8 + n % 16] + tail if shared_prefix else tail)
    return prompts


def _reference(hf, prompts: list[list[int]]) -> list[list[int]]:
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0
    )
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                generation_config=gen,
            )
            out.append(ids[0, len(p):].tolist())
    return out


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

CONFIGS = {
    "no_chunking": dict(max_num_tokens=512),
    "fcfs_chunks": dict(context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4, max_num_tokens=16),
    "equal_progress_chunks": dict(context_chunking_policy="EQUAL_PROGRESS", chunk_unit_size=4, max_num_tokens=16),
    "force_chunk": dict(context_chunking_policy="FORCE_CHUNK", chunk_unit_size=4, max_num_tokens=16),
    "guaranteed_no_evict_small_pool": dict(
        capacity_scheduler_policy="GUARANTEED_NO_EVICT", num_kv_blocks=20, max_num_tokens=128
    ),
    "max_utilization_pauses": dict(
        capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=20, max_num_tokens=128
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers(model, name):
    hf, path = model
    prompts = _prompts()
    kwargs = dict(tokens_per_block=4, num_kv_blocks=128, max_batch_size=8, enable_block_reuse=False)
    kwargs.update(CONFIGS[name])
    llm = LLM(path, **kwargs)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == _reference(hf, prompts)
    assert all(o.finish_reason == "length" for o in outs)
    kv = llm.engine.core.kv
    assert kv.get_num_free_blocks() == kv.num_blocks
    if name == "max_utilization_pauses":
        assert llm.stats.pauses > 0, "the pool was meant to be small enough to force pauses"
        # Each pause has its event and, since every request finished, a resume after it.
        events = llm.engine.core.events.drain()
        pauses = [e for e in events if e.kind == "pause"]
        resumes = [e for e in events if e.kind == "resume"]
        assert len(pauses) == len(resumes) == llm.stats.pauses
        assert all(e.policy == "MAX_UTILIZATION" and e.blocks_freed > 0 for e in pauses)
        assert ({(e.request_id, e.pause_index) for e in pauses}
                == {(e.request_id, e.pause_index) for e in resumes})
        assert not llm.engine.core.paused_since
    if name.endswith("chunks") or name == "force_chunk":
        assert llm.stats.steps > len(prompts) + MAX_NEW - 1  # prompts really were split


def test_block_reuse_with_shared_prefixes(model):
    hf, path = model
    prompts = _prompts(seed=3, shared_prefix=True)
    llm = LLM(path, tokens_per_block=4, num_kv_blocks=128, max_batch_size=8, enable_block_reuse=True,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=8, max_num_tokens=32)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    kv = llm.engine.core.kv
    assert kv.num_reused_blocks > 0
    assert [o.token_ids for o in first + rest] == _reference(hf, prompts)
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_seeded_sampling_is_reproducible(model):
    _, path = model
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    prompts = _prompts(seed=5)[:3]
    a = LLM(path, tokens_per_block=4, num_kv_blocks=64).generate(prompts, params)
    # Same seed, different batch company and pool: the same tokens.
    b = LLM(path, tokens_per_block=8, num_kv_blocks=40).generate(prompts[::-1], params)[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=4321, ignore_eos=True)
    c = LLM(path, tokens_per_block=4, num_kv_blocks=64).generate(prompts, other)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_seeded_sampling_is_unchanged_by_pauses_and_chunking(model):
    # Draws are keyed by (seed, position): recompute after a pause, and chunked prefill, draw
    # exactly what an unconstrained engine draws.
    _, path = model
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=99, ignore_eos=True)
    prompts = _prompts()
    base = dict(tokens_per_block=4, max_batch_size=8, enable_block_reuse=False)
    free = LLM(path, num_kv_blocks=128, max_num_tokens=512, **base).generate(prompts, params)
    paused_llm = LLM(path, **base, **CONFIGS["max_utilization_pauses"])
    paused = paused_llm.generate(prompts, params)
    chunked = LLM(path, num_kv_blocks=128, **base, **CONFIGS["fcfs_chunks"]).generate(prompts, params)
    assert paused_llm.stats.pauses > 0
    assert [o.token_ids for o in paused] == [o.token_ids for o in free]
    assert [o.token_ids for o in chunked] == [o.token_ids for o in free]


def test_abort_frees_every_block(model):
    _, path = model
    llm = LLM(path, tokens_per_block=4, num_kv_blocks=64, enable_block_reuse=True)
    engine = llm.engine
    rids = [engine.add_request(p, GREEDY) for p in _prompts(seed=7)]
    for _ in range(3):
        engine.step()
    kv = engine.core.kv
    assert kv.get_num_free_blocks() < kv.num_blocks
    for rid in rids:
        assert engine.abort(rid)
    assert not engine.has_unfinished
    assert kv.get_num_free_blocks() == kv.num_blocks
    assert not engine.abort(rids[0])  # already gone


def test_streaming_deltas_add_up_and_early_close_aborts(model):
    _, path = model
    llm = LLM(path, tokens_per_block=4, num_kv_blocks=64)
    prompts = _prompts(seed=9)[:2]
    whole = llm.generate(prompts, GREEDY)
    got: dict[int, list[int]] = {}
    finished = set()
    for delta in llm.generate_stream(prompts, GREEDY):
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        if delta.finished:
            finished.add(delta.request_id)
    assert sorted(map(len, got.values())) == [MAX_NEW, MAX_NEW] and len(finished) == 2
    assert sorted(got.values()) == sorted(o.token_ids for o in whole)
    stream = llm.generate_stream(prompts, GREEDY)
    next(stream)
    stream.close()  # the consumer went away: everything it started is aborted
    kv = llm.engine.core.kv
    assert not llm.engine.has_unfinished and kv.get_num_free_blocks() == kv.num_blocks


def test_text_prompts_round_trip_through_the_tokenizer(model):
    _, path = model
    llm = LLM(path, tokens_per_block=4, num_kv_blocks=64)
    out = llm.generate(["héllo wörld"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) == len("héllo wörld".encode())  # byte-level tokenizer
    assert llm.engine.decode(out.prompt_token_ids) == "héllo wörld"
    assert len(out.token_ids) == 4 and isinstance(out.text, str)


def test_bad_requests_are_rejected_with_the_field_named(model):
    _, path = model
    llm = LLM(path, tokens_per_block=4, num_kv_blocks=16, max_seq_len=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, VOCAB + 5]], GREEDY)
    with pytest.raises(ValueError, match="max_input_len"):
        llm.generate([[5] * 80], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(path, max_batch=3)
    kv = llm.engine.core.kv
    assert kv.get_num_free_blocks() == kv.num_blocks and not llm.engine.has_unfinished


def test_bad_model_directory_is_a_clear_error(tmp_path, model):
    _, path = model
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="GPT2"):
        LLM(broken)


def test_max_seq_len_past_the_models_positions_is_refused(model):
    _, path = model  # max_position_embeddings 256
    with pytest.raises(ValueError, match=r"max_seq_len \(300\) is greater than the model's max_position_embeddings \(256"):
        LLM(path, tokens_per_block=4, num_kv_blocks=16, max_seq_len=300)
    assert LLM(path, tokens_per_block=4, num_kv_blocks=16, max_seq_len=256).engine.core.max_seq_len == 256

"""The sampling record against transformers as the reference (vLLM's formulas where transformers
has no processor of its own): greedy outputs under each penalty, logit_bias, bad_words and
min_tokens are identical token for token; top-k logprobs of generated tokens and of the prompt
(echo's path) agree within 1e-4 in float32; seeded sampling is reproducible whatever the batch.
Everything runs through pdserve's offline LLM (the same core and sampler the workers run)."""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers.loading.tiny_model import build_byte_tokenizer  # noqa: E402

VOCAB = 300
MAX_NEW = 12
EOS = 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=256, eos_token_id=EOS)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(20.0)  # spread the logits (see test_engine_parity)
    out = tmp_path_factory.mktemp("sampling") / "llama"
    hf.save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    llm = LLM(out, tokens_per_block=4, num_kv_blocks=256, max_batch_size=8, max_seq_len=128)
    return hf, llm


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 11, 19, 7)]


class _VllmPenalties(transformers.LogitsProcessor):
    """vLLM's presence/frequency penalties (output tokens only), which transformers lacks."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:]
        if out.numel():
            counts = torch.bincount(out, minlength=scores.shape[-1]).to(scores.dtype)
            scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        return scores


class _Bias(transformers.LogitsProcessor):
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


class _Trace(transformers.LogitsProcessor):
    """Keeps the raw scores of every step (the first processor, so nothing changed them yet)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        self.steps.append(scores[0].float().clone())
        return scores


def _hf_greedy(hf, prompt, processors=(), **gen_kwargs) -> list[int]:
    config = dict(do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0)
    gen = transformers.GenerationConfig(**{**config, **gen_kwargs})
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          generation_config=gen,
                          logits_processor=transformers.LogitsProcessorList(list(processors)))
    return ids[0, len(prompt):].tolist()


CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8), ()),
    "frequency_penalty": (dict(frequency_penalty=1.5), {}, ("vllm", 0.0, 1.5)),
    "presence_penalty": (dict(presence_penalty=1.9), {}, ("vllm", 1.9, 0.0)),
    "all_three": (dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
                  dict(repetition_penalty=1.3), ("vllm", -0.4, 0.7)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_penalties_matches_token_for_token(model, case):
    hf, llm = model
    ours, theirs, extra = CASES[case]
    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **ours)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    plain = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                        ignore_eos=True))]
    want = []
    for p in prompts:
        processors = [_VllmPenalties(len(p), extra[1], extra[2])] if extra else []
        want.append(_hf_greedy(hf, p, processors, **theirs))
    assert got == want
    assert got != plain  # the penalty changed something, so the comparison means something


def test_logit_bias_bad_words_and_min_tokens_match(model):
    hf, llm = model
    prompts = _prompts(9)
    plain = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    # Ban each prompt's favourite token by bias, push another one up.
    for p, base in zip(prompts, plain):
        banned, favoured = base.token_ids[0], (base.token_ids[0] + 7) % VOCAB
        bias = {banned: -100.0, favoured: 3.0}
        got = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                               logit_bias=bias))[0].token_ids
        assert got == _hf_greedy(hf, p, [_Bias(bias)])
        assert banned not in got[:1]
    # bad_words: a one-token "word" never appears; a two-token one is never completed.
    tok = llm.engine.tokenizer
    p = prompts[0]
    base = plain[0].token_ids
    word1 = tok.decode([base[0]])
    got = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                           bad_words=[word1]))[0].token_ids
    banned_ids = [[base[0]]]
    spaced = tok.encode(" " + word1.lstrip(), add_special_tokens=False).ids
    if len(spaced) == 1 and spaced[0] != base[0]:
        banned_ids.append(spaced)
    assert got == _hf_greedy(hf, p, bad_words_ids=banned_ids)
    assert base[0] not in got
    # min_tokens: EOS is held back until then. Make EOS the model's favourite with a bias.
    favour_eos = {EOS: 50.0}
    short = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias=favour_eos))[0]
    assert short.token_ids == [EOS] and short.finish_reason == "stop"
    held = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias=favour_eos,
                                            min_tokens=5))[0]
    assert len(held.token_ids) == 6 and held.token_ids[-1] == EOS and EOS not in held.token_ids[:5]
    want = _hf_greedy(hf, p, [_Bias(favour_eos)], min_new_tokens=5, eos_token_id=EOS)
    assert held.token_ids == want


def test_logprobs_and_prompt_logprobs_match_within_1e4(model):
    hf, llm = model
    prompts = _prompts(13)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5,
                                                prompt_logprobs=5))
    for p, out in zip(prompts, outs):
        trace = _Trace()
        want_tokens = _hf_greedy(hf, p, [trace])[:6]
        assert out.token_ids == want_tokens
        assert len(out.logprobs) == 6
        for step, entry in zip(trace.steps, out.logprobs):
            lp = torch.log_softmax(step, dim=-1)
            assert entry.logprob == pytest.approx(lp[entry.token_id].item(), abs=1e-4)
            assert entry.rank == 1  # greedy: the most likely token
            values, ids = torch.topk(lp, 5)
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
        assert len(out.prompt_logprobs) == len(p) - 1
        for i, entry in enumerate(out.prompt_logprobs):
            assert entry.token_id == p[i + 1]
            assert entry.logprob == pytest.approx(full[i, p[i + 1]].item(), abs=1e-4)
            assert entry.rank == int((full[i] > full[i, p[i + 1]]).sum()) + 1
            assert [t for t, _ in entry.top] == torch.topk(full[i], 5).indices.tolist()


def test_seeded_sampling_with_every_processor_is_reproducible_whatever_the_batch(model):
    _, llm = model
    prompts = _prompts(21)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_k=50, top_p=0.95, min_p=0.02,
                            presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                            seed=1234, ignore_eos=True, logprobs=2)
    alone = [llm.generate([p], params)[0] for p in prompts]
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in alone] == [o.token_ids for o in together]
    for a, b in zip(alone, together):
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)
    other_seed = llm.generate(prompts, params.replace(seed=99))
    assert [o.token_ids for o in other_seed] != [o.token_ids for o in together]


def test_n_candidates_fork_one_prefill_and_count_against_the_batch(model):
    """Candidate i of n is what a single request with seed + i gives, whatever the batch size
    (n candidates are n sequences: with max_batch_size 2 they take turns) and with greedy
    candidates identical; every block is free afterwards."""
    _, llm = model
    prompt = _prompts(31)[1]
    params = SamplingParams(n=4, max_tokens=MAX_NEW, temperature=0.8, seed=11, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params)[0]
    singles = [llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=11 + i,
                                                      ignore_eos=True, logprobs=1))[0] for i in range(4)]
    assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    for c, s in zip(out.outputs, singles):
        assert [e.logprob for e in c.logprobs] == pytest.approx([e.logprob for e in s.logprobs], abs=1e-5)
        assert c.cumulative_logprob == pytest.approx(sum(e.logprob for e in s.logprobs), abs=1e-4)
    narrow = LLM(llm.engine.loaded, tokens_per_block=4, num_kv_blocks=256, max_batch_size=2, max_seq_len=128)
    scheduled = []
    scheduler = narrow.engine.core.scheduler
    schedule = scheduler.schedule

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        scheduled.append(len(out.context_requests) + len(out.generation_requests))
        return out

    scheduler.schedule = counting_schedule
    again = narrow.generate([prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert max(scheduled) == 2  # four candidates, two at a time
    greedy = llm.generate([prompt], SamplingParams(n=3, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    best = llm.generate([prompt], SamplingParams(n=2, best_of=4, max_tokens=MAX_NEW, temperature=0.8, seed=11,
                                                 ignore_eos=True))[0]
    ranked = sorted(singles, key=lambda s: -sum(e.logprob for e in s.logprobs))[:2]
    assert [c.token_ids for c in best.outputs] == [s.token_ids for s in ranked]
    for engine in (llm, narrow):
        kv = engine.engine.core.kv
        assert kv.get_num_free_blocks() == kv.num_blocks

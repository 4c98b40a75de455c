"""pdserve's Llama-family decoder against transformers, in fp32, on tiny random models.

Each model is built with transformers' config classes, saved with ``save_pretrained``
(safetensors), loaded through pdserve's loader and run through the paged forward: a full prefill,
the same prompt in chunks, flat batches mixing context chunks and decode tokens, and greedy
decoding against ``generate(do_sample=False)``.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.loading.loader import LoadedModel, load_model
from pdserve.workers.model import SeqBatchInfo
from pdserve.workers.model.batch import GROUP_GATHER_BYTES
from pdserve.workers.loading.tiny_model import build_byte_tokenizer

ATOL = 1e-4
VOCAB = 300
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
)

# name -> (config class name, extra config kwargs)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_gqa": ("LlamaConfig", {}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama_mha_bias": ("LlamaConfig", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "llama_rope_linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    "llama_rope_llama3": (
        "LlamaConfig",
        {
            "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },  # head_dim 16, theta 1e4: wavelengths 6, 20, 63, 199, ... hit all three bands
            "rope_theta": 10000.0,
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_sliding_layer": (
        "Qwen2Config", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
    ),
    "mistral_window": ("MistralConfig", {"sliding_window": 7, "head_dim": 24}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),
    "qwen3_bias_sliding_yarn": (
        "Qwen3Config",
        {
            "attention_bias": True, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        },
    ),
}


def _build(tmp: Path, name: str, seed: int = 0) -> tuple[Any, LoadedModel]:
    cls_name, extra = VARIANTS[name]
    cfg = getattr(transformers, cls_name)(**{**SMALL, **extra})
    cfg.architectures = [cls_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so they matter
        for pname, p in hf.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp / name
    hf.save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    return hf, load_model(out)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    return _build(tmp_path_factory.mktemp("parity"), request.param)


def _hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class Cache:
    """A KV pool plus a trivial allocator: shuffled block ids, so tables are non-contiguous."""

    def __init__(self, lm: LoadedModel, num_blocks: int = 96, B: int = 4, seed: int = 0) -> None:
        self.pool = KVPool.for_model(lm.config, num_blocks, B)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def reserve(self, seq: str, total_len: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.pool.tokens_per_block < total_len:
            table.append(self.free.pop())
        return table


def _step(lm: LoadedModel, cache: Cache, parts: list[tuple[str, list[int]]], all_logits: bool = False) -> torch.Tensor:
    """Run one flat batch: parts are (sequence name, its new tokens), in flat order."""
    ids: list[int] = []
    seqs: list[SeqBatchInfo] = []
    for name, new in parts:
        past = cache.lens.get(name, 0)
        table = cache.reserve(name, past + len(new))
        seqs.append(SeqBatchInfo(len(ids), len(new), past, tuple(table)))
        ids.extend(new)
    positions = torch.tensor([s.past_len + i for s in seqs for i in range(s.num_new_tokens)])
    out = lm.model(torch.tensor(ids), positions, seqs, cache.pool, all_logits=all_logits)
    for name, new in parts:
        cache.lens[name] = cache.lens.get(name, 0) + len(new)
    return out


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def test_full_prefill_matches(pair: tuple[Any, LoadedModel]) -> None:
    hf, lm = pair
    prompt = _tokens(41, seed=1)
    ref = _hf_logits(hf, prompt)
    cache = Cache(lm)
    got_all = _step(lm, cache, [("a", prompt)], all_logits=True)
    torch.testing.assert_close(got_all, ref, atol=ATOL, rtol=0)
    got_last = _step(lm, Cache(lm), [("a", prompt)])
    assert got_last.shape == (1, lm.config.vocab_size)
    torch.testing.assert_close(got_last[0], ref[-1], atol=ATOL, rtol=0)


def test_chunked_prefill_through_paged_cache_matches(pair: tuple[Any, LoadedModel]) -> None:
    hf, lm = pair
    prompt = _tokens(40, seed=2)
    ref = _hf_logits(hf, prompt)
    cache = Cache(lm)
    # Chunk edges inside and on block boundaries (B=4), and a one-token chunk (decode path).
    edges = [0, 7, 8, 16, 29, 30, 40]
    got = torch.cat([_step(lm, cache, [("a", prompt[a:b])], all_logits=True) for a, b in zip(edges, edges[1:])])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_mixed_flat_batch_matches(pair: tuple[Any, LoadedModel]) -> None:
    hf, lm = pair
    full = {name: _tokens(n, seed=10 + i) for i, (name, n) in enumerate([("a", 21), ("b", 34), ("c", 22), ("d", 9), ("e", 2)])}
    cache = Cache(lm)
    # History: a, b fully prefilled but for their last token; c has its first 12 tokens cached.
    _step(lm, cache, [("a", full["a"][:20]), ("b", full["b"][:33])])
    _step(lm, cache, [("c", full["c"][:12])])
    # One step: decode a, a context chunk of c, decode b, a fresh prompt d, a 2-token prompt e.
    parts = [("a", full["a"][20:]), ("c", full["c"][12:]), ("b", full["b"][33:]), ("d", full["d"]), ("e", full["e"])]
    got_all = _step(lm, cache, parts, all_logits=True)
    for name in "acbde":  # every flat row against transformers at that position
        cache.lens[name] -= len(dict(parts)[name])
    got_last = _step(lm, cache, parts)
    row = 0
    for i, (name, new) in enumerate(parts):
        ref = _hf_logits(hf, full[name])[-len(new):]
        torch.testing.assert_close(got_all[row : row + len(new)], ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(got_last[i], ref[-1], atol=ATOL, rtol=0)
        row += len(new)


def test_many_decode_groups_match(pair: tuple[Any, LoadedModel]) -> None:
    """Decode sequences of very different lengths, one step, split into several groups."""
    hf, lm = pair
    lengths = [3, 40, 17, 5, 33, 1, 26, 9, 12, 38]
    prompts = {f"s{i}": _tokens(n + 1, seed=100 + i) for i, n in enumerate(lengths)}
    refs = [_hf_logits(hf, toks)[-1] for toks in prompts.values()]
    for group_bytes in (1, 1 << 30):  # one sequence per group; fill-ratio cuts only
        lm.model.decode_group_bytes = group_bytes
        try:
            cache = Cache(lm, num_blocks=160)
            _step(lm, cache, [(name, toks[:-1]) for name, toks in prompts.items()])
            got = _step(lm, cache, [(name, toks[-1:]) for name, toks in prompts.items()])
        finally:
            lm.model.decode_group_bytes = GROUP_GATHER_BYTES
        for i, ref in enumerate(refs):
            torch.testing.assert_close(got[i], ref, atol=ATOL, rtol=0)


def _greedy(lm: LoadedModel, prompts: list[list[int]], max_new: int, eos: set[int]) -> list[list[int]]:
    """Batched greedy decoding through the paged forward: all prompts prefilled in one step,
    then one decode token per live sequence per step."""
    cache = Cache(lm)
    names = [f"p{i}" for i in range(len(prompts))]
    logits = _step(lm, cache, list(zip(names, prompts)))
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        nxt = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(live, nxt):
            outs[i].append(tok)
            if tok not in eos and len(outs[i]) < max_new:
                still.append(i)
        live = still
        if live:
            logits = _step(lm, cache, [(names[i], [outs[i][-1]]) for i in live])
    return outs


def test_greedy_decode_matches_generate(pair: tuple[Any, LoadedModel]) -> None:
    hf, lm = pair
    prompts = [_tokens(n, seed=200 + n) for n in (5, 11, 23)]
    got = _greedy(lm, prompts, max_new=8, eos=set(lm.eos_token_ids))
    for prompt, ours in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=8, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert ours == ref


def test_sdpa_reference_agrees_for_one_variant(tmp_path: Path) -> None:
    """transformers' SDPA path (not only eager) agrees too, on the Qwen2 bias model."""
    hf, lm = _build(tmp_path, "qwen2", seed=3)
    hf_sdpa = transformers.AutoModelForCausalLM.from_pretrained(lm.model_dir, attn_implementation="sdpa").eval()
    prompt = _tokens(30, seed=4)
    torch.testing.assert_close(
        _step(lm, Cache(lm), [("a", prompt)], all_logits=True), _hf_logits(hf_sdpa, prompt), atol=ATOL, rtol=0
    )


def test_forward_rejects_inconsistent_batches(pair: tuple[Any, LoadedModel]) -> None:
    _, lm = pair
    cache = Cache(lm)
    ids = torch.tensor(_tokens(6, seed=5))
    table = tuple(cache.reserve("a", 6))
    bad: list[Callable[[], Any]] = [
        lambda: lm.model(ids, None, [SeqBatchInfo(0, 6, 0, table[:1])], cache.pool),  # table too short
        lambda: lm.model(ids, None, [SeqBatchInfo(0, 5, 0, table)], cache.pool),  # uncovered row
        lambda: lm.model(ids, None, [SeqBatchInfo(0, 6, 0, table), SeqBatchInfo(5, 1, 0, table)], cache.pool),
        lambda: lm.model(ids, torch.arange(1, 7), [SeqBatchInfo(0, 6, 0, table)], cache.pool),  # positions
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
    wrong_pool = KVPool(lm.config.num_hidden_layers + 1, 8, 4, lm.config.num_key_value_heads, lm.config.head_dim)
    with pytest.raises(ValueError):
        lm.model(ids, None, [SeqBatchInfo(0, 6, 0, (0, 1))], wrong_pool)

"""The paged forward's tiled per-token work and its grouped-query decode path against transformers.

``token_tile`` cuts a step's norms, projections, RoPE and MLP into tiles of rows; attention still
sees every token of the step. A tile size that splits context chunks mid-way (and that splits
the flat batch between a chunk and decode tokens) must not change any logit. fp32, a GQA model
(4 query heads per KV head) and a multi-head one.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.loading.loader import LoadedModel, load_model
from pdserve.workers.model import SeqBatchInfo
from pdserve.workers.loading.tiny_model import make_tiny_model

ATOL = 1e-4
VOCAB = 300


@pytest.fixture(scope="module", params=[(8, 2), (4, 4)], ids=["gqa", "mha"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    heads, kv_heads = request.param
    out: Path = tmp_path_factory.mktemp("tiling") / f"h{heads}kv{kv_heads}"
    make_tiny_model(
        out, hidden_size=64, num_layers=2, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=256, seed=3,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return hf.eval(), load_model(out)


def _hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:  # [V]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _run(lm: LoadedModel, steps: list[list[tuple[str, list[int]]]], B: int = 4) -> torch.Tensor:
    """Runs flat batches in order through one pool (shuffled block ids); returns the last step's
    logits, one row per part."""
    pool = KVPool.for_model(lm.config, 128, B)
    free = list(range(128))
    random.Random(0).shuffle(free)
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    logits = torch.empty(0)
    for parts in steps:
        ids: list[int] = []
        seqs: list[SeqBatchInfo] = []
        for name, new in parts:
            past = lens.get(name, 0)
            table = tables.setdefault(name, [])
            while len(table) * B < past + len(new):
                table.append(free.pop())
            seqs.append(SeqBatchInfo(len(ids), len(new), past, tuple(table)))
            ids.extend(new)
            lens[name] = past + len(new)
        logits = lm.model(torch.tensor(ids), None, seqs, pool)
    return logits


@pytest.mark.parametrize("tile", [1, 5, 1 << 20])
def test_tiled_steps_match_transformers(pair, tile: int) -> None:
    hf, lm = pair
    full = {name: _tokens(n, seed=i) for i, (name, n) in enumerate([("a", 23), ("b", 40), ("c", 9), ("d", 17)])}
    # Step 1 prefills a and b (b only partly); step 2 mixes a decode token, b's next chunk
    # (past_len > 0, read back through the pool), a fresh prompt c and d's one-token prompt.
    steps = [
        [("a", full["a"][:-1]), ("b", full["b"][:26])],
        [("a", full["a"][-1:]), ("b", full["b"][26:]), ("c", full["c"]), ("d", full["d"][:1])],
    ]
    lm.model.token_tile = tile
    try:
        got = _run(lm, steps)
    finally:
        lm.model.token_tile = type(lm.model)(lm.config).token_tile
    refs = [full["a"], full["b"], full["c"], full["d"][:1]]
    for i, toks in enumerate(refs):
        torch.testing.assert_close(got[i], _hf_last_logits(hf, toks), atol=ATOL, rtol=0)


def test_decode_groups_of_mixed_lengths_match_transformers(pair) -> None:
    """Many decode sequences of different lengths in one step, each decode group small enough
    that its padding and additive mask matter."""
    hf, lm = pair
    lengths = [2, 30, 7, 19, 11, 1, 25, 4]
    prompts = {f"s{i}": _tokens(n + 1, seed=50 + i) for i, n in enumerate(lengths)}
    steps = [
        [(name, toks[:-1]) for name, toks in prompts.items()],
        [(name, toks[-1:]) for name, toks in prompts.items()],
    ]
    lm.model.decode_group_bytes = 1
    try:
        got = _run(lm, steps)
    finally:
        lm.model.decode_group_bytes = type(lm.model)(lm.config).decode_group_bytes
    for i, toks in enumerate(prompts.values()):
        torch.testing.assert_close(got[i], _hf_last_logits(hf, toks), atol=ATOL, rtol=0)

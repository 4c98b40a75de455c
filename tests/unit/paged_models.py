"""A small random-weight decoder for the paged-attention tests (test_flex_attention.py,
test_cuda_graphs.py): Qwen3 with GQA, qk-norm and one sliding-window layer between two full ones."""
from __future__ import annotations

import torch

from pdserve.workers.model import build_model, parse_config

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
)


def windowed_qwen3(device: str = "cpu"):
    """(config, fp32 model on ``device`` with seeded random weights, prepacked)."""
    cfg = parse_config(CONFIG)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=torch.float32, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty(p.shape).normal_(1.0 if "norm" in name else 0.0, 0.1))  # same on any device
    model.prepack_linears()
    return cfg, model


class StepDriver:
    """Flat batches for a schedule of steps: ``batch(parts)`` turns [(sequence name, new
    tokens)] into (token ids, SeqBatchInfo list) over block tables drawn from a shuffled pool of
    ``num_blocks`` blocks; ``advance(parts)`` records that the step ran."""

    def __init__(self, num_blocks: int, tokens_per_block: int, vocab: int = 300) -> None:
        import random

        self.B, self.vocab = tokens_per_block, vocab
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.rng = random.Random(1)
        self.tables: dict = {}
        self.lens: dict = {}

    def batch(self, parts):
        from pdserve.workers.model import SeqBatchInfo

        ids, seqs = [], []
        for name, n in parts:
            past = self.lens.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * self.B < past + n:
                table.append(self.free.pop())
            seqs.append(SeqBatchInfo(len(ids), n, past, tuple(table)))
            ids.extend(self.rng.randrange(self.vocab) for _ in range(n))
        return torch.tensor(ids), seqs

    def advance(self, parts) -> None:
        for name, n in parts:
            self.lens[name] = self.lens.get(name, 0) + n


def greedy_tokens(model_dir, prompts, max_tokens: int, setup=None, **llm_kwargs):
    """Token ids of ``LLM.generate`` (greedy, EOS ignored) on a fresh fp32 CPU load of the
    model; ``setup(loaded, llm)`` runs before generating (a backend, graphs)."""
    from pdserve import LLM, SamplingParams
    from pdserve.workers.loading.loader import load_model

    loaded = load_model(model_dir, dtype=torch.float32, device="cpu")
    llm = LLM(loaded, device="cpu", **llm_kwargs)
    if setup is not None:
        setup(loaded, llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]


def decode_case(B: int, heads: int, kv_heads: int, d: int, dtype, lengths, seed: int):
    """A decode-attention kernel's inputs (test_cpu_kernels.py, test_gpu_kernels.py): a pool
    holding sequences of ``lengths`` keys in shuffled blocks, two of them sharing a two-block
    prefix, their tables padded with 0, and queries at scattered rows of a wider flat batch (q a
    strided view of a qkv buffer, as in the model). Returns (q, kv, token_index, tables, lens,
    out) with ``out`` filled with 7 so untouched rows can be checked."""
    import random

    rng = random.Random(seed)
    num_blocks = sum(-(-n // B) for n in lengths) + 2
    kv = torch.randn(2, num_blocks, B, kv_heads, d).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(2)]
    tables = []
    for k, n in enumerate(lengths):
        nb = -(-n // B)
        own = [free.pop() for _ in range(nb)]
        tables.append((shared + own)[:nb] if k in (3, 4) and nb >= 2 else own)
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    T = 2 * len(lengths) + 3
    token_index = torch.tensor(sorted(rng.sample(range(T), len(lengths))))
    q = torch.randn(T, heads + 2 * kv_heads, d).to(dtype)[:, :heads]
    out = torch.full((T, heads, d), 7.0, dtype=dtype)
    return q, kv, token_index, tables_t, torch.tensor(list(lengths)), out


MIXED_SCHEDULE = [[("a", 9), ("b", 3)], [("a", 1), ("b", 6), ("c", 13)], [("c", 7), ("a", 1), ("b", 1), ("d", 2)],
                  [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 5)], [("e", 40), ("a", 1), ("b", 1)],
                  [("e", 1), ("a", 1), ("b", 1), ("c", 1), ("d", 1)]]


def paged_matches_sdpa(device: str, tokens_per_block: int, tol: float) -> None:
    """Decode batches of mixed lengths beside context chunks, windowed and full layers, through
    the "paged" backend and through gather + SDPA over two pools: every row's logits within tol."""
    from pdserve.transport.kv_pool import KVPool

    cfg, model = windowed_qwen3(device)
    pools = {b: KVPool.for_model(cfg, 128, tokens_per_block, device=device) for b in ("sdpa", "paged")}
    steps = StepDriver(128, tokens_per_block)
    for parts in MIXED_SCHEDULE:
        ids, seqs = steps.batch(parts)
        out = {}
        for backend, pool in pools.items():
            model.set_attention_backend(backend)
            assert model.attention_backend == backend
            out[backend] = model(ids.to(device), None, seqs, pool, all_logits=True)
        assert (out["sdpa"] - out["paged"]).abs().max().item() <= tol, parts
        steps.advance(parts)

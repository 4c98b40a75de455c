"""A small random-weight decoder for the paged-attention tests (test_flex_attention.py,
test_cuda_graphs.py): Qwen3 with GQA, qk-norm and one sliding-window layer between two full ones."""
from __future__ import annotations

import torch

from pdserve.workers.model import ModelConfig, build_model

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
    max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
)


def windowed_qwen3(device: str = "cpu"):
    """(config, fp32 model on ``device`` with seeded random weights, prepacked)."""
    cfg = ModelConfig.from_hf_dict(CONFIG)
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
    from pdserve.workers.loader import load_model

    loaded = load_model(model_dir, dtype=torch.float32, device="cpu")
    llm = LLM(loaded, device="cpu", **llm_kwargs)
    if setup is not None:
        setup(loaded, llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]

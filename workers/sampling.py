"""Sampling parameters and the batched sampler.

Greedy rows (temperature 0) take the argmax in one batched op. Sampled rows apply temperature,
then top-k, then top-p, and draw with the request's own ``torch.Generator``, re-seeded for every
token from (the request's seed, the token's position in the sequence). A draw then depends on
nothing but the seed, the position and the logits: not on what else shares the batch, not on a
pause (recompute keeps positions), and not on which worker draws it, so a disaggregated request
(first token on the context worker, the rest on the generation worker) and a retry that
continues after streamed tokens draw exactly what one colocated engine would.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # (0, 1]
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as a tuple so params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at ``position`` (tokens before it in the sequence): a
    splitmix64 finalizer over both, so nearby positions and seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1  # < 2**63


class RequestSampler:
    """Per-request sampling state: the seed (drawn at random when the request gave none) and a
    generator re-seeded per token (see the module docstring)."""

    __slots__ = ("params", "seed", "generator")

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        if not params.greedy:
            self.generator = torch.Generator(device=device)


def sample(logits: torch.Tensor, samplers: list[RequestSampler], positions: list[int]) -> list[int]:
    """logits: [n, vocab] (any float dtype) -> one token id per row. ``positions[i]``: how many
    tokens row i's sequence holds before the one drawn now."""
    n = logits.shape[0]
    if n == 0:
        return []
    tokens = logits.argmax(dim=-1).tolist()
    for row, sampler in enumerate(samplers):
        if sampler.params.greedy:
            continue
        tokens[row] = _sample_row(logits[row].float(), sampler, positions[row])
    return tokens


def _sample_row(logits: torch.Tensor, sampler: RequestSampler, position: int) -> int:
    p = sampler.params
    sampler.generator.manual_seed(position_seed(sampler.seed, position))
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = cumulative - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=sampler.generator).item())

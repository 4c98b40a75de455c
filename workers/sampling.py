"""Sampling parameters and the batched sampler.

Greedy rows (temperature 0) take the argmax in one batched op. Sampled rows apply temperature,
then top-k, then top-p, and draw with the request's own ``torch.Generator``, seeded once, so a
seeded request reproduces its tokens whatever else shares its batches.
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


class RequestSampler:
    """Per-request sampling state: the generator survives pauses, so recompute does not change
    what a seeded request draws next."""

    __slots__ = ("params", "generator")

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)


def sample(logits: torch.Tensor, samplers: list[RequestSampler]) -> list[int]:
    """logits: [n, vocab] (any float dtype) -> one token id per row."""
    n = logits.shape[0]
    if n == 0:
        return []
    tokens = logits.argmax(dim=-1).tolist()
    for row, sampler in enumerate(samplers):
        if sampler.params.greedy:
            continue
        tokens[row] = _sample_row(logits[row].float(), sampler)
    return tokens


def _sample_row(logits: torch.Tensor, sampler: RequestSampler) -> int:
    p = sampler.params
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

"""The batched sampler: the sampling record (``pdserve.transport.requests.sampling``) applied
to a step's logits.

Per row, in vLLM's order (its v1 sampler), so a request gets the same answer from either server:
1. raw logprobs when asked (log-softmax of the model's logits, float32);
2. the grammar mask of a structured-output request;
3. bad words, then min_tokens (EOS and stop token ids masked), then logit_bias;
4. repetition, frequency and presence penalties;
5. greedy rows take the argmax of what is left; sampled rows divide by the temperature, drop
   tokens under min_p x the top probability, then apply top-k and top-p and draw.

Rows that need none of 1-4 (the common case) skip straight to 5 as one batched argmax. The draw
uses the request's own ``torch.Generator``, re-seeded for every token from (the request's seed,
the token's position in the sequence). A draw then depends on nothing but the seed, the
position and the logits: not on what else shares the batch, not on a pause (recompute keeps
positions), and not on which worker draws it, so a disaggregated request (first token on the
context worker, the rest on the generation worker) and a retry that continues after streamed
tokens draw exactly what one colocated engine would. Penalties and min_tokens count the
request's output from ``output_start`` (a retry folds streamed tokens into its prompt), so they
follow the request across workers too.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from pdserve.transport.requests.sampling import SamplingError, SamplingLimits, SamplingParams
from pdserve.transport.requests.types import TokenLogprobs

__all__ = ["SamplingParams", "SamplingError", "SamplingLimits", "RequestSampler", "sample",
           "position_seed"]

MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at ``position`` (tokens before it in the sequence): a
    splitmix64 finalizer over both, so nearby positions and seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1  # < 2**63


class RequestSampler:
    """Per-request sampling state: the seed (drawn at random when the request gave none), a
    generator re-seeded per token (see the module docstring), where the output starts in the
    token list, the stop ids min_tokens holds back, and the grammar matcher of a
    structured-output request (``matcher``: accept(token), mask(logits_row))."""

    __slots__ = ("params", "seed", "generator", "output_start", "held_back", "matcher",
                 "processes")

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", *,
                 output_start: int = 0, eos_token_ids: Sequence[int] = (), matcher=None) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        if not params.greedy:
            self.generator = torch.Generator(device=device)
        self.output_start = output_start
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.held_back = sorted(stops)
        self.matcher = matcher
        # Anything besides the batched argmax/draw: logprobs, a grammar, penalties, biases...
        self.processes = (params.needs_logits_processing or params.logprobs is not None
                          or matcher is not None)


def sample(logits: torch.Tensor, samplers: list[RequestSampler], sequences: Sequence[Sequence[int]]
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [n, vocab] (any float dtype); ``sequences[i]``: row i's tokens so far (prompt and
    output; the drawn token's position is its length). Returns one token id per row and, for
    rows whose request asked for logprobs, the drawn token's TokenLogprobs (else None)."""
    n = logits.shape[0]
    if n == 0:
        return [], []
    logprobs: list[TokenLogprobs | None] = [None] * n
    if not any(s.processes for s in samplers):
        tokens = logits.argmax(dim=-1).tolist()
        for row, sampler in enumerate(samplers):
            if not sampler.params.greedy:
                tokens[row] = _draw(logits[row].float(), sampler, len(sequences[row]))
        return tokens, logprobs
    tokens = [0] * n
    greedy_rows = [row for row, s in enumerate(samplers) if s.params.greedy and not s.processes]
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.long, device=logits.device)
        for row, token in zip(greedy_rows, logits.index_select(0, index).argmax(dim=-1).tolist()):
            tokens[row] = token
    for row, sampler in enumerate(samplers):
        if sampler.params.greedy and not sampler.processes:
            continue
        seq = sequences[row]
        raw = logits[row].float()
        lp = torch.log_softmax(raw, dim=-1) if sampler.params.logprobs is not None else None
        processed = _process(raw, sampler, seq) if sampler.processes else raw
        if sampler.params.greedy:
            token = int(processed.argmax().item())
        else:
            token = _draw(processed, sampler, len(seq))
        tokens[row] = token
        if lp is not None:
            logprobs[row] = token_logprobs(lp, token, sampler.params.logprobs)
    return tokens, logprobs


def token_logprobs(lp: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``lp``: one position's log-softmax [vocab]."""
    value = lp[token]
    rank = int((lp > value).sum().item()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(lp, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(int(token), float(value.item()), rank, top)


def _process(logits: torch.Tensor, sampler: RequestSampler, seq: Sequence[int]) -> torch.Tensor:
    """Steps 2-4 of the module docstring on one row (float32, a copy)."""
    p = sampler.params
    logits = logits.clone()
    if sampler.matcher is not None:
        sampler.matcher.mask(logits)
    output = seq[sampler.output_start:]
    if p.bad_words_token_ids:
        for word in p.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix == 0 or (len(output) >= prefix and tuple(output[-prefix:]) == word[:-1]):
                if word[-1] < logits.shape[0]:
                    logits[word[-1]] = float("-inf")
    if (len(output) < p.min_tokens and sampler.held_back
            and (sampler.matcher is None or not sampler.matcher.is_accepting())):
        # (A complete structured output may only end: holding EOS back would leave nothing.)
        logits[torch.tensor(sampler.held_back, dtype=torch.long, device=logits.device)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
        logits.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype,
                                               device=logits.device))
    if p.has_penalties:
        vocab = logits.shape[0]
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            if seq:
                seen[torch.tensor(list(seq), dtype=torch.long, device=logits.device)] = True
            scale = torch.where(logits > 0, 1.0 / p.repetition_penalty, p.repetition_penalty)
            logits = torch.where(seen, logits * scale, logits)
        if output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            counts = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=logits.device),
                                    minlength=vocab)[:vocab]
            counts = counts.to(logits.dtype)
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _draw(logits: torch.Tensor, sampler: RequestSampler, position: int) -> int:
    p = sampler.params
    sampler.generator.manual_seed(position_seed(sampler.seed, position))
    logits = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
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

"""min_p, top_k and top_p against the exact set of tokens each allows, on fixed logits.

The reference (``allowed``) is vLLM's v1 sampler written out in float64: temperature first, then
min_p (drop p < min_p x the largest p), then top-k (the k largest logits), then top-p on what is
left, renormalized (keep the smallest run of most likely tokens whose mass reaches top_p, the
token that crosses it included, so never fewer than one). pdserve's sampler draws many times
with different seeds: every draw must lie in the set, every member must be drawn, and each
member about as often as its renormalized probability. The logits are chosen so that no token
sits within 1e-3 of a threshold: float32 rounding cannot move one across it."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.workers.runner.sampling import RequestSampler, SamplingParams, sample

LOGITS = [2.0, 1.7, 1.3, 1.0, 0.6, 0.2, -0.3, -0.9, -1.6, -2.5, -3.5, -5.0]
DRAWS = 2000
MARGIN = 1e-3


def allowed(logits: list[float], *, temperature: float = 1.0, min_p: float = 0.0, top_k: int = 0,
            top_p: float = 1.0) -> dict[int, float]:
    """The tokens vLLM's rule allows, with their probabilities renormalized over the set."""
    z = [v / temperature for v in logits]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    p = [v / sum(e) for v in e]
    keep = list(range(len(logits)))
    if min_p > 0.0:
        threshold = min_p * max(p)
        assert all(abs(q - threshold) > MARGIN * threshold for q in p), "a token on the min_p threshold"
        keep = [i for i in keep if p[i] >= threshold]
    if top_k:
        ranked = sorted(keep, key=lambda i: -logits[i])
        if len(ranked) > top_k:
            assert logits[ranked[top_k - 1]] - logits[ranked[top_k]] > MARGIN, "a tie at the k-th logit"
        keep = ranked[:top_k]
    if top_p < 1.0:
        mass = sum(p[i] for i in keep)
        above, kept = 0.0, []
        for i in sorted(keep, key=lambda i: -p[i]):
            assert abs(above - top_p) > MARGIN, "a token on the top_p threshold"
            if above < top_p:  # the mass of the more likely tokens has not reached top_p yet
                kept.append(i)
            above += p[i] / mass
        keep = kept
    mass = sum(p[i] for i in keep)
    return {i: p[i] / mass for i in keep}


def draws(params: SamplingParams, *, logprobs: int | None = None, n: int = DRAWS) -> list[int]:
    """``n`` draws from LOGITS, one row per seed (seeds 0..n-1; positions vary too), in one
    batch. ``logprobs``: also through the per-row processing path (the fast path otherwise,
    unless min_p already takes the row there)."""
    rows = torch.tensor([LOGITS] * n, dtype=torch.float32)
    samplers = [RequestSampler(params.replace(seed=seed, logprobs=logprobs)) for seed in range(n)]
    sequences = [[0] * (seed % 7) for seed in range(n)]
    tokens, _ = sample(rows, samplers, sequences)
    return tokens


def check(params: SamplingParams, want: dict[int, float], *, logprobs: int | None = None) -> None:
    tokens = draws(params, logprobs=logprobs)
    outside = sorted(set(tokens) - set(want))
    assert not outside, f"drawn outside the allowed set {sorted(want)}: {outside}"
    assert set(tokens) == set(want), f"never drawn: {sorted(set(want) - set(tokens))}"
    for token, prob in want.items():
        freq = tokens.count(token) / len(tokens)
        sigma = math.sqrt(prob * (1 - prob) / len(tokens))
        assert abs(freq - prob) <= 5 * sigma + 1e-9, (token, freq, prob)


CASES = {
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.2),
    "min_p_cold": dict(temperature=0.5, min_p=0.2),  # temperature before min_p: fewer tokens
    "min_p_hot": dict(temperature=2.0, min_p=0.2),  # ... or more
    "min_p_then_top_p": dict(min_p=0.1, top_p=0.7),  # top_p on min_p's renormalized survivors
    "top_k_then_top_p": dict(top_k=5, top_p=0.7),
    "all_three": dict(temperature=0.7, min_p=0.05, top_k=4, top_p=0.75),
}


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_draw_is_in_the_allowed_set_and_every_member_is_drawn(case, logprobs):
    fields = CASES[case]
    want = allowed(LOGITS, **fields)
    assert 1 < len(want) < len(LOGITS)  # the filter removes tokens and leaves a choice
    check(SamplingParams(**{"temperature": 1.0, **fields}), want, logprobs=logprobs)


def test_the_sets_depend_on_the_order_of_the_filters():
    """The cases above tell the orders apart: the reference's sets differ from what another
    order (or no renormalization) would allow, so a sampler in another order fails them."""
    assert sorted(allowed(LOGITS, top_p=0.7)) == [0, 1, 2, 3]
    assert sorted(allowed(LOGITS, min_p=0.1, top_p=0.7)) == [0, 1, 2]  # renormalized after min_p
    assert sorted(allowed(LOGITS, top_k=5, top_p=0.7)) == [0, 1, 2]  # renormalized after top-k
    assert sorted(allowed(LOGITS, min_p=0.2)) == [0, 1, 2, 3, 4]
    assert sorted(allowed(LOGITS, temperature=0.5, min_p=0.2)) == [0, 1, 2]
    assert sorted(allowed(LOGITS, temperature=2.0, min_p=0.2)) == list(range(8))


@pytest.mark.parametrize("fields", [dict(top_p=0.05), dict(top_k=1), dict(min_p=0.9),
                                    dict(temperature=0.1, min_p=0.5)])
def test_a_set_of_one_token_always_draws_it(fields):
    want = allowed(LOGITS, **fields)
    assert list(want) == [0]
    tokens = draws(SamplingParams(**{"temperature": 1.0, **fields}), n=300)
    assert set(tokens) == {0}
    # Without the filter the same seeds draw other tokens: the filter is what decided.
    assert set(draws(SamplingParams(temperature=fields.get("temperature", 1.0)), n=300)) != {0}


def test_without_min_p_the_same_seeds_draw_outside_its_set():
    """min_p is what keeps the draws in its set: the same seeds without it leave the set."""
    want = allowed(LOGITS, min_p=0.2)
    plain = draws(SamplingParams(temperature=1.0))
    assert set(plain) - set(want)
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.2))) <= set(want)

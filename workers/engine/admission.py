"""Admission: whether a worker can take a request, checked before anything is allocated.

Pure (no torch): every refusal is a ValueError whose message names the field, which the
request channel turns into the client's error. ``check_request`` reads the request and its
sampling record and returns what the engine core applies; it changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from pdserve.scheduler import CapacitySchedulerPolicy, LlmRequest
from pdserve.transport.requests.sampling import SamplingLimits, SamplingParams


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What a worker's model and pool allow. ``pool_blocks``: the blocks the KV manager hands
    out; ``can_send``/``can_receive``: the worker moves KV as a context / generation side."""

    vocab_size: int
    max_seq_len: int
    max_input_len: int
    pool_blocks: int
    policy: CapacitySchedulerPolicy
    can_send: bool = False
    can_receive: bool = False


def max_request_tokens(kv, pool_blocks: int, max_seq_len: int) -> int:
    """The longest prompt + output (tokens) one request of one candidate can have on this
    worker: the largest total <= ``max_seq_len`` that ``check_request``'s test (the KV manager's
    ``blocks_to_completion_bound`` against ``pool_blocks``) passes however it splits into
    prompt and output; 0 when not even one token fits. What the worker tells the router, so
    the router refuses up front only what this worker would refuse.

    Full attention: ceil(total / B) blocks, the pool's tokens at most. A window that slides over
    every layer holds about W + T tokens whatever the length, so the model's own max_seq_len
    usually fits. The bound is monotone in the total for a fixed split, and its worst split is
    at an end: the whole output sliding the window (a one-token prompt), or the whole prompt
    (one output token); so the bisection tests both ends."""
    def need(total: int) -> int:
        if total <= 1:
            return kv.blocks_to_completion_bound(total, 0)
        return max(kv.blocks_to_completion_bound(1, total - 1),
                   kv.blocks_to_completion_bound(total - 1, 1))

    if need(max_seq_len) <= pool_blocks:
        return max_seq_len
    fits, too_long = 0, max_seq_len  # invariant: need(fits) fits (0: trivially), need(too_long) does not
    while too_long - fits > 1:
        mid = (fits + too_long) // 2
        if need(mid) <= pool_blocks:
            fits = mid
        else:
            too_long = mid
    return fits


class Admitted(NamedTuple):
    max_new_tokens: int  # clamped to what max_seq_len leaves after the prompt
    output_start: int
    forced: list[int]
    emitted: list[int]  # tokens the client already has (a generation-only request's first)


def check_request(request: LlmRequest, params: SamplingParams, limits: AdmissionLimits,
                  kv, *, forced_tokens: Sequence[int] = (), stream_kv: bool = False,
                  output_start: int | None = None,
                  choice_tokens: Sequence[Sequence[int]] = ()) -> Admitted:
    """Raises ValueError naming the field when the worker cannot run the request. ``kv``: the
    KV manager, for ``blocks_to_completion_bound`` (a request that can never fit the pool would
    wait forever under GUARANTEED_NO_EVICT)."""
    params.validate(SamplingLimits.vocab_only(limits.vocab_size))
    vocab = limits.vocab_size
    if output_start is None:
        output_start = request.prompt_len
    if not 0 <= output_start <= request.prompt_len:
        raise ValueError(f"output_start {output_start} is outside the prompt [0, "
                         f"{request.prompt_len}]")
    forced = [int(t) for t in forced_tokens]
    if any(not 0 <= t < vocab for t in forced):
        raise ValueError(f"forced_tokens are outside the vocabulary [0, {vocab})")
    if len(forced) > request.max_new_tokens:
        raise ValueError(f"forced_tokens ({len(forced)}) exceed max_new_tokens "
                         f"({request.max_new_tokens})")
    prompt = request.get_prompt_tokens()
    if len(prompt) > limits.max_input_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens, more than max_input_len {limits.max_input_len}")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    max_new = min(request.max_new_tokens, limits.max_seq_len - request.prompt_len)
    candidates = params.candidates
    # Under a sliding window every candidate holds its own window: charged for each unless
    # MAX_UTILIZATION (which pauses a candidate that finds no room).
    charged = (candidates if candidates > 1 and not request.is_context_only_request
               and limits.policy != CapacitySchedulerPolicy.MAX_UTILIZATION else 1)
    needed = kv.blocks_to_completion_bound(request.prompt_len, max_new, charged)
    if needed > limits.pool_blocks:
        each = f" for {charged} candidates (n/best_of)" if needed != kv.blocks_to_completion_bound(
            request.prompt_len, max_new) else ""
        raise ValueError(f"prompt + max_tokens{each} needs {needed} KV blocks but the pool "
                         f"has {limits.pool_blocks}")
    if candidates > 1 and (forced or stream_kv or request.beam_width != 1):
        raise ValueError("n/best_of: a request of several candidates starts from its prompt")
    if request.is_generation_only_request and len(choice_tokens) != candidates - 1:
        raise ValueError(f"choice_tokens: {candidates - 1} first tokens expected (n/best_of "
                         f"{candidates}), got {len(choice_tokens)}")
    if stream_kv and not request.is_context_only_request:
        raise ValueError("stream_kv is for context-only requests")
    emitted = list(forced)
    if request.is_generation_only_request:
        cpp = request.context_phase_params
        if not limits.can_receive:
            raise ValueError("generation-only requests need a worker with a KV receiver")
        # No first token: layer-wise, it arrives with the KV (then nothing may be forced).
        if cpp is None or len(cpp.first_gen_tokens) not in (
                request.beam_width, 0 if not forced else request.beam_width):
            raise ValueError("context_phase_params must carry the first generated token")
        if forced and forced[0] != cpp.first_gen_tokens[0]:
            raise ValueError("forced_tokens must start with the context phase's first token")
        # The context worker's first token reached the client through the router already.
        emitted = forced or list(cpp.first_gen_tokens)
    elif request.is_context_only_request and not limits.can_send:
        raise ValueError("context-only requests need a worker with a KV sender")
    return Admitted(max_new, output_start, forced, emitted)

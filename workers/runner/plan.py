"""What the engine core hands the model runner for one step, and what it gets back.

The engine core (requests, schedulers, KV manager, outputs) decides a step as a ``StepPlan``;
the model runner (model, KV pool, forward, sampling) carries it out and returns a
``StepResult``. Both are plain data: ints, lists and tuples, no requests, no tensors, so a
plan can be sent as it is to the other ranks of a worker group, which run the same forward on
their shards. Sampling state (each request's generator, penalties, grammar matcher) stays on
the rank that samples: it travels beside the plan as a ``SamplingBatch``, never inside it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Sequence

from pdserve.transport.requests.types import TokenLogprobs

if TYPE_CHECKING:
    from pdserve.workers.runner.sampling import RequestSampler


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's rows of the flat batch: ``num_new_tokens`` tokens from
    ``plan.input_ids[start:]`` at positions ``past_len ..``, reading and writing the KV blocks
    of ``block_table`` (one entry per block of positions 0 .. past_len + num_new_tokens - 1).

    ``samples``: the sequence's last new token produces the next token (a decode, or a
    context's last chunk). ``prompt_logprobs``: the request asked for the top-k logprobs of its
    prompt tokens (k, or None): the runner scores ``prompt_targets[j]`` at row j, the prompt
    token each row predicts, up to the prompt's end."""

    request_id: int
    start: int
    num_new_tokens: int
    past_len: int
    block_table: tuple[int, ...]
    samples: bool
    prompt_logprobs: int | None = None
    prompt_targets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: context chunks first, then decode tokens (``num_context`` sequences are
    chunks). ``stream_request_ids``: context-only requests whose KV is sent layer by layer while
    this forward writes it (the runner reports each layer it finished)."""

    input_ids: tuple[int, ...]
    sequences: tuple[ScheduledSequence, ...]
    num_context: int
    stream_request_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def sampled_request_ids(self) -> list[int]:
        return [s.request_id for s in self.sequences if s.samples]


class SampledToken(NamedTuple):
    token: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class SamplingBatch:
    """The local half of a step's sampling, aligned with the plan's sampling rows (sequences
    with ``samples``, in plan order): each row's sampler and its tokens so far (penalties and
    the position seed read them). ``extra[i]``: more samplers that draw from row i's logits too
    (the other candidates of an n/best_of request at the end of its prefill)."""

    samplers: list[RequestSampler]
    sequences: list[Sequence[int]]
    extra: dict[int, list[RequestSampler]] = field(default_factory=dict)


@dataclass(slots=True)
class StepResult:
    """What one step produced. ``tokens[i]``: the token sampled for the plan's i-th sampling
    row. ``extra[request_id]``: the other candidates' first tokens (``SamplingBatch.extra``).
    ``prompt_logprobs[request_id]``: one entry per prompt position this step scored, in order,
    starting at the sequence's ``past_len + 1``."""

    tokens: list[SampledToken] = field(default_factory=list)
    extra: dict[int, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    forward_seconds: float = 0.0

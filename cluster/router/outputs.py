"""What the router core hands its front doors: a request's outputs (``RouterOutput``, with
``RequestTimings`` and ``RequestUsage`` on the last one) and the cluster's state
(``ClusterSnapshot``, ``LiveCounters``). Plain values: each door turns them into its own
messages (proto in ``cluster/front/grpc/convert.py``, OpenAI JSON in ``cluster/front/openai/``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.transport.requests import WorkerEvent, WorkerInfo, WorkerStatus

from .request_state import RouterRequest


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Per-request figures, on the last output only."""

    queue_ms: float
    ttft_ms: float
    e2e_ms: float
    kv_transfer_bytes: int
    kv_transfer_ms: float
    pauses: int
    ctx_worker: str
    gen_worker: str
    retries: int
    fallbacks: int
    local_prefill: bool
    prefix_predicted_tokens: int
    prefix_reused_tokens: int


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class RouterOutput:
    """One step of a request's stream: new tokens and their text (deltas). The last output has
    ``finish_reason`` (``stop``, ``length`` or ``abort``), ``timings`` and ``usage``; errors end
    the stream with a ``RouterError`` instead."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    timings: RequestTimings | None = None
    usage: RequestUsage | None = None
    # TokenLogprobs per token of token_ids (when the request asked for logprobs), and the
    # prompt's (prompt_logprobs), once, on the first output.
    logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None
    # n / best_of: the candidate these tokens belong to, and a candidate's own end (the
    # request goes on until every candidate has ended; the last output has finish_reason).
    index: int = 0
    choice_finish_reason: str | None = None


def token_output(req: RouterRequest, tokens: list[int], text: str, logprobs=None,
                 prompt_logprobs=None, index: int = 0,
                 choice_finish_reason: str | None = None) -> RouterOutput:
    return RouterOutput(req.external_id, tokens, text, logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, index=index,
                        choice_finish_reason=choice_finish_reason)


def final_output(req: RouterRequest, tokens: list[int], finish_reason: str, text: str = "",
                 logprobs=None, prompt_logprobs=None, index: int = 0) -> RouterOutput:
    now = time.monotonic()
    timings = RequestTimings(
        queue_ms=1000 * ((req.dispatched or now) - req.received),
        ttft_ms=1000 * ((req.first_token or now) - req.received),
        e2e_ms=1000 * (now - req.received), kv_transfer_bytes=req.kv_bytes,
        kv_transfer_ms=1000 * req.kv_seconds, pauses=req.pauses, ctx_worker=req.ctx_worker,
        gen_worker=req.gen_worker, retries=req.retries, fallbacks=req.fallbacks,
        local_prefill=req.local_prefill, prefix_predicted_tokens=req.predicted_tokens,
        prefix_reused_tokens=req.reused_tokens or 0)
    usage = RequestUsage(prompt_tokens=len(req.prompt),
                         completion_tokens=sum(len(c.streamed) for c in req.candidates),
                         cached_prompt_tokens=req.cached_tokens)
    return RouterOutput(req.external_id, tokens, text, finish_reason, timings, usage, logprobs,
                        prompt_logprobs, index, finish_reason)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One worker as the router sees it: its ``info`` (limits, node), whether requests are routed
    to it, and the status its open channel last brought (None, with ``missing``, when there is
    none)."""

    worker_id: str
    info: WorkerInfo
    healthy: bool
    status: WorkerStatus | None
    status_age_s: float = 0.0
    missing: str = ""


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The cluster for a status call: every worker (fresh statuses where they answered), the
    router's queue, totals and limits, and the workers' recent events (oldest first)."""

    workers: list[WorkerSnapshot]
    queue_depth: int
    in_flight: int
    totals: dict[str, int]
    kv_paths: dict[str, int]
    prefix: dict[str, int]
    context_policy: str
    generation_policy: str
    events: list[WorkerEvent]
    max_input_len: int
    max_seq_len: int
    max_prompt_bytes: int


@dataclass(frozen=True, slots=True)
class LiveCounters:
    """The router's counters now, without asking any worker (a door's /metrics)."""

    totals: dict[str, int]
    queue_depth: int
    in_flight: int
    serving: bool
    workers_healthy: dict[str, bool] = field(default_factory=dict)

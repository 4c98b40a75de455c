"""The request channel's types: what crosses the socket, as frozen dataclasses. The package
docstring (``transport/requests/__init__.py``) describes the protocol; ``codec.py`` encodes it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from pdserve.scheduler.kv_events import KVEvent
from pdserve.scheduler.request import ContextPhaseParams, LlmRequest, LlmRequestType

from .sampling import SamplingParams

PROTOCOL_VERSION = 7  # 2: KV events (KvEvents, KvSnapshotQuery, KvSnapshot); 3: KvPeers, kv_pairs;
# 4: KvControl (the direct KV control link, transport/kv_link.py); 5: layer-wise KV
# (Generate.stream_kv, the CONTEXT_STREAMING update); 6: the sampling record as a map,
# logprobs on updates; 7: n / best_of (Generate.choice_tokens, Update.index, CHOICE_DONE)
MAX_FRAME_BYTES = 64 << 20  # a prompt of millions of tokens still fits; a garbage length does not


class ProtocolError(ValueError):
    """A frame that does not follow this protocol (wrong shape, type or version)."""


class UpdateKind(enum.IntEnum):
    TOKENS = 1  # new tokens; the request goes on
    CONTEXT_DONE = 2  # a context-only request finished its prefill; its KV is leased
    FINISHED = 3  # ended normally: finish_reason "stop" or "length"
    ABORTED = 4  # ended by an abort (the router's or an overtaken submission)
    FAILED = 5  # ended by an error: see ErrorKind and message
    # A layer-wise context-only request's last chunk is being computed and its KV is leased:
    # the generation side may ask for it now (params without the first token). Not final.
    CONTEXT_STREAMING = 6
    # One candidate of a request with several (n / best_of) ended, with finish_reason; the
    # others go on. Not final: the last candidate's end is FINISHED.
    CHOICE_DONE = 7


class ErrorKind(enum.IntEnum):
    NONE = 0
    WORKER = 1  # the executor or its step loop failed the request
    TRANSFER = 2  # the request's KV transfer failed
    DEADLINE = 3  # the request's deadline passed on the worker
    REJECTED = 4  # the request itself is invalid; no worker would take it
    UNAVAILABLE = 5  # this worker takes no requests (its step loop is dead)


FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True, slots=True)
class UpdateInfo:
    """Per-request figures: on the first decode after a receive (transfer fields only) and on
    the final update. ``kv_transfer_blocks`` is None unless a receive completed (0: the
    generation worker's cache held the whole prompt)."""

    pauses: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_blocks: int | None = None
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's log-probabilities (the model's raw log-softmax): the token's own, its rank
    (1 = the most likely) and the ``top`` most likely (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class WireUpdate:
    """What one step produced for one request: tokens not reported before, and how it ended.
    Build it with the constructors below; they keep kind, finish_reason and error consistent."""

    request_id: int
    kind: UpdateKind
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # FINISHED only: "stop" | "length"
    context_phase_params: ContextPhaseParams | None = None  # CONTEXT_DONE, CONTEXT_STREAMING
    error: ErrorKind = ErrorKind.NONE  # FAILED only
    message: str | None = None  # FAILED: what went wrong
    info: UpdateInfo | None = None
    # With the request's ``logprobs`` set: one entry per token of new_token_ids.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # With ``prompt_logprobs`` set, once (on the update that brings the first token): one entry
    # per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # The candidate (n / best_of) the tokens belong to. CONTEXT_DONE of a request of several
    # candidates carries every candidate's first token: new_token_ids[i] is candidate i's.
    index: int = 0

    @classmethod
    def tokens(cls, request_id: int, new: list[int], info: UpdateInfo | None = None, *,
               logprobs=None, prompt_logprobs=None, index: int = 0) -> "WireUpdate":
        return cls(request_id, UpdateKind.TOKENS, new, info=info, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs, index=index)

    @classmethod
    def choice_done(cls, request_id: int, index: int, new: list[int], reason: str,
                    info: UpdateInfo | None = None, *, logprobs=None,
                    prompt_logprobs=None) -> "WireUpdate":
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {reason!r}")
        return cls(request_id, UpdateKind.CHOICE_DONE, new, finish_reason=reason, info=info,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=index)

    @classmethod
    def context_done(cls, request_id: int, new: list[int], params: ContextPhaseParams,
                     info: UpdateInfo | None = None, *, logprobs=None,
                     prompt_logprobs=None) -> "WireUpdate":
        return cls(request_id, UpdateKind.CONTEXT_DONE, new, context_phase_params=params, info=info,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @classmethod
    def context_streaming(cls, request_id: int, params: ContextPhaseParams) -> "WireUpdate":
        return cls(request_id, UpdateKind.CONTEXT_STREAMING, context_phase_params=params)

    @classmethod
    def finished_with(cls, request_id: int, new: list[int], reason: str,
                      info: UpdateInfo | None = None, *, logprobs=None,
                      prompt_logprobs=None, index: int = 0) -> "WireUpdate":
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {reason!r}")
        return cls(request_id, UpdateKind.FINISHED, new, finish_reason=reason, info=info,
                   logprobs=logprobs, prompt_logprobs=prompt_logprobs, index=index)

    @classmethod
    def aborted(cls, request_id: int) -> "WireUpdate":
        return cls(request_id, UpdateKind.ABORTED)

    @classmethod
    def failed(cls, request_id: int, error: ErrorKind, message: str) -> "WireUpdate":
        return cls(request_id, UpdateKind.FAILED, error=error, message=message)

    @property
    def finished(self) -> bool:
        """The request's last update: nothing more comes for it."""
        return self.kind not in (UpdateKind.TOKENS, UpdateKind.CONTEXT_STREAMING, UpdateKind.CHOICE_DONE)

    @property
    def outcome(self) -> str | None:
        """The ending as one word (None while it runs): stop, length, context_done, abort,
        deadline or error. For logs, tests and the offline API's finish_reason."""
        kind = self.kind
        if kind in (UpdateKind.TOKENS, UpdateKind.CONTEXT_STREAMING):
            return None
        if kind == UpdateKind.CHOICE_DONE:
            return self.finish_reason
        if kind == UpdateKind.FINISHED:
            return self.finish_reason
        if kind == UpdateKind.CONTEXT_DONE:
            return "context_done"
        if kind == UpdateKind.ABORTED:
            return "abort"
        return "deadline" if self.error == ErrorKind.DEADLINE else "error"


@dataclass(frozen=True, slots=True)
class WireRequest:
    """One attempt of a request, as a worker receives it. ``request_id`` is the router's
    attempt id (unique per router); ``client_id`` what the client called the request.
    ``deadline_s``: seconds the attempt has left when sent (the worker aborts it after).
    ``forced_tokens``: a retry's first generated tokens, already streamed to the client."""

    request_id: int
    client_id: str | None
    prompt: list[int]
    max_new_tokens: int
    priority: float = 0.5
    type: LlmRequestType = LlmRequestType.CONTEXT_AND_GENERATION
    agent_hierarchy: list[tuple[str, int]] | None = None
    context_phase_params: ContextPhaseParams | None = None
    sampling: SamplingParams = SamplingParams()  # max_tokens is the attempt's
    deadline_s: float | None = None
    forced_tokens: tuple[int, ...] = ()
    stream_kv: bool = False  # context-only: send the KV layer by layer (CONTEXT_STREAMING)
    # Where the request's output begins in ``prompt`` (a retry folds tokens it streamed into its
    # prompt; penalties and min_tokens count from here); None: the end of the prompt.
    output_start: int | None = None
    # Generation-only, n / best_of: candidates 1.. and the tokens each has (its first token,
    # drawn by the context worker); candidate 0's is in context_phase_params.
    choice_tokens: tuple[tuple[int, ...], ...] = ()

    def to_llm_request(self) -> LlmRequest:
        """Raises ValueError for a request the scheduler's types refuse."""
        return LlmRequest(self.request_id, self.prompt, self.max_new_tokens,
                          priority=self.priority, agent_hierarchy=self.agent_hierarchy,
                          llm_request_type=self.type,
                          context_phase_params=self.context_phase_params,
                          client_id=self.client_id)

    @classmethod
    def from_llm_request(cls, request: LlmRequest, sampling: SamplingParams, *,
                         deadline_s: float | None = None,
                         forced_tokens: tuple[int, ...] = (),
                         stream_kv: bool = False,
                         output_start: int | None = None,
                         choice_tokens: tuple[tuple[int, ...], ...] = ()) -> "WireRequest":
        hierarchy = request.agent_hierarchy
        return cls(request.request_id, request.client_id, list(request.get_prompt_tokens()),
                   request.max_new_tokens, request.priority, request.llm_request_type,
                   [tuple(level) for level in hierarchy] if hierarchy is not None else None,
                   request.context_phase_params, sampling, deadline_s, tuple(forced_tokens),
                   stream_kv, output_start, choice_tokens)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Who a worker is and how to reach it; fixed for one incarnation (a restart changes
    ``pid``, ``incarnation`` and the endpoints). Returned by the actors' ``info`` over Ray."""

    worker_id: str
    role: str  # "context" | "generation"
    pid: int
    num_kv_blocks: int
    tokens_per_block: int
    max_batch_size: int
    max_input_len: int | None
    max_seq_len: int | None
    max_num_tokens: int
    vocab_size: int
    endpoint: str  # the KV store (torch.distributed rendezvous) of this incarnation
    incarnation: int
    request_endpoint: str  # the request channel
    request_token: str  # the request channel's hello token
    node_id: str = ""  # the Ray node it runs on (hex id) and that node's IP; "" off Ray
    node_ip: str = ""
    # The model as the worker was launched with it (a directory, or a Hub repo id) and the dtype
    # its weights run at ("bfloat16", ...): what `pdserve status` and `top` show; "" unknown.
    model: str = ""
    dtype: str = ""
    # The longest prompt + output one request (one candidate) can have here, by the worker's
    # own KV manager's bound against its pool (workers/engine/admission.py ``max_request_tokens``):
    # at most max_seq_len, and more than the pool's tokens under a sliding window. None: not
    # reported (the router then assumes full attention: the pool's tokens).
    max_request_tokens: int | None = None
    # Ranks the worker's model is split over (tensor parallelism): what status and top show.
    tensor_parallel_size: int = 1


@dataclass(frozen=True, slots=True)
class TransferTotals:
    """A worker's KV transfers since it started (both directions)."""

    sent: int = 0
    received: int = 0
    failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """A transfer (generation side), pause or resume on a worker (``workers/engine/events.py``).
    ``request_id`` is the client's id when there is one (how a person knows the request)."""

    kind: str  # "transfer" | "pause" | "resume"
    t: float  # unix time
    request_id: str
    worker_id: str
    ctx_worker_id: str | None = None
    gen_worker_id: str | None = None
    blocks: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    outcome: str | None = None
    reason: str | None = None
    policy: str | None = None
    generated_tokens: int | None = None
    blocks_freed: int | None = None
    paused_seconds: float | None = None
    pause_index: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A worker's state as of its last step: load, KV blocks, counters, the invariant checks
    (``violations``, empty when healthy) and the events since the previous status."""

    worker_id: str
    role: str
    healthy: bool
    pid: int
    incarnation: int
    capacity_policy: str
    max_batch_size: int
    tokens_per_block: int
    num_active: int
    queue_depth: int
    requests_by_state: dict[str, int]
    free_blocks: int
    total_blocks: int
    quarantined_blocks: int
    pauses: int
    paused_requests: int
    queued_prefill_tokens: int  # prompt tokens admitted and not yet prefilled
    # Generation-only requests this worker prefilled without a pause forcing it (their KV was
    # meant to arrive by transfer): always 0 unless something is wrong.
    unexpected_recomputes: int
    generated_tokens: int
    context_tokens: int
    steps: int
    transfers: TransferTotals
    violations: list[str]
    events: list[WorkerEvent] = field(default_factory=list)
    # Generation side: ctx worker id -> the state of the KV pair with it ("ready", "opening",
    # "down", "gone"; kv_receiver_pair.PairState). The router sends a KV transfer only over a
    # ready pair.
    kv_pairs: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    token: str


@dataclass(frozen=True, slots=True)
class HelloAck:
    version: int
    worker_id: str


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


@dataclass(frozen=True, slots=True)
class Generate:
    request: WireRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: int


@dataclass(frozen=True, slots=True)
class StatusQuery:
    query_id: int


@dataclass(frozen=True, slots=True)
class Update:
    update: WireUpdate


@dataclass(frozen=True, slots=True)
class StatusReply:
    query_id: int
    status: WorkerStatus


@dataclass(frozen=True, slots=True)
class Heartbeat:
    status: WorkerStatus


@dataclass(frozen=True, slots=True)
class KvEvents:
    """What the worker's prefix cache did since the previous batch (``scheduler/kv_events.py``).
    ``seq`` numbers the batches of one worker process: each is the previous one's plus 1."""

    seq: int
    events: list[KVEvent]


@dataclass(frozen=True, slots=True)
class KvPeers:
    """router -> generation worker: the context workers (id -> KV endpoint) to set KV pairs up
    with now. Sent when the channel opens and whenever a context worker comes back as a new
    process; a generation worker reports healthy once each pair's first set-up is over."""

    peers: dict[str, str]


@dataclass(frozen=True, slots=True)
class KvSnapshotQuery:
    """The router asks for the whole cache (after connecting, or after a gap)."""


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """Every cached block as ``BlocksStored`` events, parents before children; the next
    ``KvEvents`` batch is numbered ``seq``."""

    seq: int
    events: list[KVEvent]


@dataclass(frozen=True, slots=True)
class KvControl:
    """generation worker -> context worker, on the direct KV control link (not the router's
    channel): one encoded KV control message (``transport/protocol.py``) for the context
    worker whose KV locator is ``endpoint`` (another incarnation's is dropped)."""

    endpoint: str
    payload: bytes


Frame = Union[Hello, HelloAck, Refused, Generate, Abort, StatusQuery, Update, StatusReply, Heartbeat,
              KvEvents, KvSnapshotQuery, KvSnapshot, KvPeers, KvControl]


class FrameType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    REFUSED = 3
    GENERATE = 4
    ABORT = 5
    STATUS_QUERY = 6
    UPDATE = 7
    STATUS_REPLY = 8
    HEARTBEAT = 9
    KV_EVENTS = 10
    KV_SNAPSHOT_QUERY = 11
    KV_SNAPSHOT = 12
    KV_PEERS = 13
    KV_CONTROL = 14

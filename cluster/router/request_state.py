"""One request as the router tracks it: a typed state machine.

Phases (``Phase``; ``Router.request_phases`` shows them)::

    QUEUED --dispatch--> PREFILL --context done--> TRANSFER --first decoded token--> DECODE
               |                                                                     ^
               +--------> LOCAL (prefilled on the generation worker) ----------------+

A failed attempt goes back to PREFILL or LOCAL on a retry (``policies.plan_retry`` decides
where); DONE is terminal (finished, failed or cancelled). Any other move is a router bug and
raises ``IllegalTransition``, which the attempt loop turns into INTERNAL for that request only.

What the client already has (``streamed``) is the fact retries are built on: a retry
continues after it (``continuation``), so the client sees no duplicate and no gap.
"""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from pdserve.cluster import validation as V
from pdserve.cluster.text_stream import TextStream
from pdserve.scheduler import LlmRequest
from pdserve.transport.requests import UpdateInfo
from pdserve.transport.requests.sampling import SamplingParams


class Phase(enum.StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"  # the context worker runs the prompt
    LOCAL = "local"  # the generation worker prefills it itself
    TRANSFER = "transfer"  # the first token is out; the KV moves to the generation worker
    DECODE = "decode"
    DONE = "done"


_MOVES = {
    Phase.QUEUED: {Phase.PREFILL, Phase.LOCAL, Phase.DONE},
    Phase.PREFILL: {Phase.TRANSFER, Phase.PREFILL, Phase.LOCAL, Phase.DONE},
    Phase.LOCAL: {Phase.DECODE, Phase.PREFILL, Phase.LOCAL, Phase.DONE},
    Phase.TRANSFER: {Phase.DECODE, Phase.PREFILL, Phase.LOCAL, Phase.DONE},
    Phase.DECODE: {Phase.DECODE, Phase.PREFILL, Phase.LOCAL, Phase.DONE},
    Phase.DONE: set(),
}


class IllegalTransition(RuntimeError):
    """A phase change the state machine does not allow (a router bug)."""


class Candidate:
    """One candidate's stream (n / best_of): the tokens the client has, their text, its end."""

    __slots__ = ("streamed", "text", "finish_reason")

    def __init__(self, streamed: list[int], text: TextStream) -> None:
        self.streamed = streamed
        self.text = text
        self.finish_reason: str | None = None


@dataclass(slots=True, eq=False)
class RouterRequest:
    internal_id: int
    external_id: str
    spec: V.GenerateSpec
    prompt: list[int]
    sampling: SamplingParams  # the spec's record, bad words resolved to token ids
    queue_entry: LlmRequest  # the reorder policies' view of this request
    received: float
    deadline: float  # time.monotonic()
    text: TextStream
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # responses for the front door
    phase: Phase = Phase.QUEUED
    streamed: list[int] = field(default_factory=list)  # tokens the client has
    attempts: list[tuple[str, int]] = field(default_factory=list)  # live (worker id, attempt id)
    dispatched: float | None = None
    first_token: float | None = None
    ctx_worker: str = ""
    gen_worker: str = ""
    retries: int = 0
    fallbacks: int = 0  # after failed KV transfers (not retries: no worker died)
    local_prefill: bool = False
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    pauses: int = 0
    cached_tokens: int = 0
    kv_blocks: int | None = None  # blocks the generation worker's receive moved (kv_path)
    # The prefill worker's cached prefix: what the prefix index predicted when the worker was
    # chosen, and what the worker reported it reused (None until it reported).
    predicted_tokens: int = 0
    reused_tokens: int | None = None
    cancelled: bool = False
    task: asyncio.Task | None = None
    # n / best_of: every candidate's stream; candidate 0's shares ``streamed`` and ``text``.
    candidates: list["Candidate"] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = self.sampling.candidates
        stop = self.text.stop
        self.candidates = [Candidate(self.streamed, self.text)] + [
            Candidate([], TextStream(self.text.decode, stop, include_stop=self.text.include_stop,
                                     min_tokens=self.text.min_tokens))
            for _ in range(count - 1)]

    @property
    def several(self) -> bool:
        return len(self.candidates) > 1

    def move(self, phase: Phase) -> None:
        if phase not in _MOVES[self.phase]:
            raise IllegalTransition(f"request {self.external_id}: {self.phase} -> {phase}")
        self.phase = phase

    def start_remote(self, ctx_id: str, gen_id: str) -> None:
        """An attempt on a (context, generation) pair begins with the prefill."""
        self.move(Phase.PREFILL)
        self.ctx_worker, self.gen_worker, self.local_prefill = ctx_id, gen_id, False
        self.kv_blocks = None

    def start_local(self, gen_id: str) -> None:
        self.move(Phase.LOCAL)
        self.ctx_worker, self.gen_worker, self.local_prefill = "", gen_id, True

    def note_info(self, info: UpdateInfo | None) -> None:
        """A worker's per-request figures (the first decode after a receive, final updates)."""
        if info is None:
            return
        if info.kv_transfer_blocks is not None:
            self.kv_blocks = info.kv_transfer_blocks
        self.pauses += info.pauses
        self.kv_bytes += info.kv_transfer_bytes
        self.kv_seconds += info.kv_transfer_seconds
        self.cached_tokens = max(self.cached_tokens, info.cached_tokens)

    def continuation(self, max_input_len: int | None) -> tuple[list[int], int, list[int]]:
        """A retry continues after what the client already has: streamed tokens join the prompt
        as far as max_input_len allows; the rest are forced as the first generated tokens (the
        worker regenerates those positions as exactly these tokens and does not report them).
        Returns (prompt, max_new_tokens counted from that prompt, forced tokens)."""
        room = len(self.streamed)
        if max_input_len is not None:
            room = max(0, min(room, max_input_len - len(self.prompt)))
        return self.prompt + self.streamed[:room], self.spec.max_tokens - room, self.streamed[room:]

    def kv_path(self) -> str:
        """For a completed request: prefilled on its generation worker; or the generation
        worker received KV (0 blocks moved: its cache held the whole prompt); or it ended on
        the context worker's token before any generation worker had its KV."""
        if self.local_prefill:
            return "local_prefill"
        if self.kv_blocks is None:
            return "context_finished"
        return "transferred" if self.kv_blocks > 0 else "prefix_cached"

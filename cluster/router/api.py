"""The narrow interface the front doors adapt: what a door may ask of the router core. ``Router``
(core.py) implements it; a door holds only this, so a third door (the tokenize endpoints, another
API dialect) needs nothing else of the core."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from pdserve.cluster.validation import GenerateSpec, ValidationLimits

from .outputs import ClusterSnapshot, LiveCounters, RouterOutput
from .request_state import RouterRequest


class FrontDoorApi(Protocol):
    limits: ValidationLimits  # what admission accepts (a door may need them before admitting)
    max_prompt_bytes: int  # the longest text prompt in UTF-8 bytes that can fit max_input_len
    serving: bool  # health: SERVING
    accepting: bool  # False once the router stops

    async def admit(self, spec: GenerateSpec, time_remaining_s: float | None = None) -> RouterRequest:
        """Validate and queue; raises ``RouterError``. The handle's ``external_id`` is the
        request's id."""

    def results(self, req: RouterRequest) -> AsyncIterator[RouterOutput]:
        """The request's outputs, the last with ``finish_reason``; raises ``RouterError``.
        Leaving it early (close it: ``contextlib.aclosing``) cancels the request."""

    async def abort(self, request_id: str) -> bool:
        """End a request in flight with finish reason ``abort``; False if there is none."""

    async def cluster_status(self) -> ClusterSnapshot: ...

    def live_counters(self) -> LiveCounters: ...

    async def tokenize(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """A text's token ids, as admission tokenizes them, with or without the tokenizer's
        special tokens (its BOS); raises ``ValidationError`` naming ``field``."""

    def note_rejected(self) -> None:
        """Count a request the door refused before admit() (the router's rejected total)."""

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (logprobs name tokens with it)."""

    def detokenize(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included."""

    def add_health_listener(self, listener: Callable[[bool], Awaitable[None] | None]) -> None: ...

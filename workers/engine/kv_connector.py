"""The one interface through which the engine core moves KV between workers (vLLM's
``KVConnectorBase_V1`` plays this part there; TensorRT-LLM's cache transceiver here).

The core calls these methods and reads nothing else of the implementation: ``KVTransceiver``
(transceiver.py) implements it over the transport, ``NoKVConnector`` is a worker that moves
no KV (the offline engine, a colocated worker). Every method that frees or keeps blocks takes
the KV manager, so the connector holds no second copy of block ownership.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.scheduler import ContextPhaseParams, KVCacheManager, LlmRequest

    from pdserve.workers.engine.events import WorkerEvents


class KVConnector(Protocol):
    """Context side: ``hand_off`` (prefill done: lease the blocks), and for a layer-wise
    request ``begin_stream`` / ``layers_written`` / ``end_stream``. Generation side:
    ``start_receive`` at DISAGG_GENERATION_INIT (the reservation), then ``poll`` until the
    request is DISAGG_GENERATION_TRANS_COMPLETE. Both: ``abort``, ``held_requests``."""

    @property
    def can_send(self) -> bool: ...

    @property
    def can_receive(self) -> bool: ...

    @property
    def has_work(self) -> bool:
        """Requests the connector still holds (leased sends, draining receives)."""
        ...

    def attach_events(self, events: WorkerEvents) -> None: ...

    # ---- context side
    def hand_off(self, request: LlmRequest, kv: KVCacheManager, first_token: int, *,
                 lease_s: float | None = None) -> ContextPhaseParams: ...

    def begin_stream(self, request: LlmRequest, kv: KVCacheManager, *,
                     lease_s: float | None = None) -> ContextPhaseParams: ...

    def layers_written(self, request_ids: list[int], layers: int, device) -> None: ...

    def end_stream(self, request: LlmRequest, reason: str) -> None: ...

    def is_streaming(self, request_id: int) -> bool: ...

    # ---- generation side
    def start_receive(self, request: LlmRequest, kv: KVCacheManager, *,
                      timeout_s: float | None = None) -> None: ...

    def poll(self, active: list[LlmRequest], kv: KVCacheManager, *,
             wait_s: float = 0.0) -> list[tuple[LlmRequest, str]]:
        """Applies finished transfers; returns the generation requests whose receive failed."""
        ...

    def has_received(self, request_id: int) -> bool: ...

    def take_received(self, request_id: int) -> tuple[int, float, int] | None:
        """(bytes, seconds, blocks) of the request's completed receive, once."""
        ...

    def receive_state(self, request_id: int) -> str | None: ...

    # ---- both
    def abort(self, request: LlmRequest, kv: KVCacheManager) -> bool:
        """True when the connector frees the request's blocks later (a transfer may still
        touch them); False: nothing was pending, the caller frees them."""
        ...

    def abort_handed_off(self, request_id: int, kv: KVCacheManager) -> bool:
        """Aborts a request the core no longer tracks but whose KV the connector holds (a
        leased send); False when it holds none."""
        ...

    def held_requests(self) -> tuple[dict[int, LlmRequest], dict[int, LlmRequest]]:
        """(leased context requests, aborted receives draining), by id."""
        ...

    def status(self, *, records: bool = True) -> dict:
        """Transfer counters and session figures for the worker's status."""
        ...


class NoKVConnector:
    """A worker that moves no KV: it takes neither context-only nor generation-only
    requests (admission refuses them), so nothing here is ever asked to move a block."""

    can_send = False
    can_receive = False
    has_work = False

    def attach_events(self, events) -> None:
        pass

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError("this worker has no KV connector")

    hand_off = begin_stream = layers_written = end_stream = start_receive = _refuse

    def is_streaming(self, request_id: int) -> bool:
        return False

    def poll(self, active, kv, *, wait_s: float = 0.0) -> list:
        return []

    def has_received(self, request_id: int) -> bool:
        return False

    def take_received(self, request_id: int) -> None:
        return None

    def receive_state(self, request_id: int) -> None:
        return None

    def abort(self, request, kv) -> bool:
        return False

    def abort_handed_off(self, request_id: int, kv) -> bool:
        return False

    def held_requests(self) -> tuple[dict, dict]:
        return {}, {}

    def status(self, *, records: bool = True) -> dict:
        return {"quarantined_blocks": 0, "transfer_sessions": 0, "tracked": 0, "transfers": None}

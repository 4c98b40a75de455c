"""The engine core's side of disaggregated serving (TensorRT-LLM's cache transceiver, reference
sections 1.4 and 7): context-only requests hand their KV off under a lease, generation-only
requests reserve KV at DISAGG_GENERATION_INIT and receive it.

Context side: at the end of prefill a context-only request is DISAGG_CONTEXT_TRANS_IN_PROGRESS;
its slot is freed at once but its blocks stay, leased to the transport until a generation worker
claims them. When the send is over (or the lease expires, or it fails) the transport hands the
session back and the blocks are freed: DISAGG_CONTEXT_COMPLETE or DISAGG_TRANS_ERROR.

Layer-wise (the router's ``kv_transfer_mode``): a context-only request that asks for it
(``stream_kv``) is leased when its last prefill chunk is scheduled (``begin_stream``), and the
router hears of it then (CONTEXT_STREAMING) and starts the generation side at once; the forward
reports each layer it wrote (``layers_written``) so the send runs alongside the prefill, and
``hand_off`` adds the first token. A generation-only request whose params carry no first token
is a layer-wise one: the first token arrives with its KV.

Generation side: a generation-only request enters in DISAGG_GENERATION_INIT; when the capacity
scheduler reserves it (``fitting_disagg_gen_init``) its blocks are allocated, blocks its own
prefix cache already holds are skipped, and a KV request goes out through the driver's control
plane (``outbox``). Completion moves it to DISAGG_GENERATION_TRANS_COMPLETE, a failure or timeout
to DISAGG_TRANS_ERROR. Blocks a receive may still be writing into are never freed early: the
transport quarantines them and hands the session back only once the data plane is quiet.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from pdserve.scheduler import ContextPhaseParams, LlmRequest, LlmRequestState, lifecycle
from pdserve.transport.protocol import encode_message
from pdserve.transport.sessions import TransferLog

from pdserve.workers.engine.events import WorkerEvents, label, transfer_task_name

if TYPE_CHECKING:
    from pdserve.transport.torch_dist import KVReceiver, KVSender

log = logging.getLogger("pdserve.transceiver")
S = LlmRequestState
SENT_CLIENTS_KEPT = 4096  # finished context requests whose client id a late record may ask for


class ControlMessage(NamedTuple):
    """A KV control message for the driver to deliver to a context worker."""

    ctx_worker_id: str
    payload: bytes  # encoded KVRequest or CancelTransfer
    endpoint: str  # the context worker's KV endpoint it is meant for
    task_name: str  # what the dashboard calls the call that carries it
    # The context worker's method: a pair open takes the control concurrency group, so that
    # transfers waiting for it (they run after op 0 of their group) cannot starve it of threads.
    method: str = "kv_transfer"


class KVTransceiver:
    def __init__(
        self,
        worker_id: str,
        *,
        sender: KVSender | None = None,
        receiver: KVReceiver | None = None,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.worker_id = worker_id
        self.sender = sender
        self.receiver = receiver
        self.lease_s = lease_s
        self.transfer_timeout_s = transfer_timeout_s
        # The worker's one count of finished transfers, kept by the transport sessions as they
        # hand them back (a worker with both roles counts both sides into the sender's log).
        sides = [side for side in (sender, receiver) if side is not None]
        self.transfers: TransferLog = sides[0].sessions.transfers if sides else TransferLog()
        for side in sides[1:]:
            side.sessions.count_into(self.transfers)
        # Context side: finished context-only requests whose blocks are leased.
        self.transmitting: dict[int, LlmRequest] = {}
        # ... and layer-wise ones leased this step, before their forward (begin_stream).
        self.streaming: set[int] = set()
        # ... and the client ids of the latest that finished: a KV request's Ray copy (the
        # dashboard's record) may arrive after the send its direct copy started is over.
        self._sent_clients: OrderedDict[int, str | None] = OrderedDict()
        # Generation side: aborted requests whose receive must go quiet before blocks are freed.
        self.draining: dict[int, LlmRequest] = {}
        # Generation side: request id -> (bytes, seconds, blocks moved) of its completed
        # receive, until the engine core reports it.
        self.received: dict[int, tuple[int, float, int]] = {}
        # Generation side: request id -> (client label, ctx worker id, blocks asked for, bytes)
        # of each receive in flight, for its event when it ends.
        self._receiving: dict[int, tuple[str, str, int, int]] = {}
        # Generation side: receives that leave leading blocks unwritten (see start_receive).
        self._unfilled: set[int] = set()
        # Control messages for the driver to deliver; replies come back through
        # ``deliver_reply`` from any thread.
        self.outbox: queue.SimpleQueue[ControlMessage] = queue.SimpleQueue()
        self.events: WorkerEvents | None = None  # the engine core sets its own
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    # ------------------------------------------------------------------ KVConnector

    @property
    def can_send(self) -> bool:
        return self.sender is not None

    @property
    def can_receive(self) -> bool:
        return self.receiver is not None

    @property
    def has_work(self) -> bool:
        return bool(self.transmitting or self.draining)

    def attach_events(self, events: WorkerEvents) -> None:
        if self.events is None:
            self.events = events

    def is_streaming(self, request_id: int) -> bool:
        return request_id in self.streaming

    def has_received(self, request_id: int) -> bool:
        return request_id in self.received

    def take_received(self, request_id: int) -> tuple[int, float, int] | None:
        return self.received.pop(request_id, None)

    def held_requests(self) -> tuple[dict[int, LlmRequest], dict[int, LlmRequest]]:
        return self.transmitting, self.draining

    def abort_handed_off(self, request_id: int, kv) -> bool:
        request = self.transmitting.get(request_id)
        if request is None:
            return False
        self.abort(request, kv)  # blocks freed once the send is quiet
        return True

    def status(self, *, records: bool = True) -> dict:
        ts = self.transfers
        return {
            "quarantined_blocks": self.num_quarantined_blocks,
            "transfer_sessions": self.num_in_flight_sessions,
            "tracked": len(self.received),
            "transfers": {
                "sent": ts.sent, "received": ts.received, "failed": ts.failed,
                "leases_expired": ts.leases_expired, "bytes_sent": ts.bytes_sent,
                "bytes_received": ts.bytes_received, "seconds": ts.seconds,
                "outcomes": dict(ts.outcomes),
                **({"records": [r._asdict() for r in list(ts.records)[-64:]]} if records else {}),
            },
        }

    # ------------------------------------------------------------------ context side

    @property
    def endpoint(self) -> str | None:
        """This worker's KV endpoint as generation workers address it: unique per process."""
        return self.sender.locator if self.sender is not None else None

    def hand_off(self, request: LlmRequest, kv, first_token: int, *,
                 lease_s: float | None = None) -> ContextPhaseParams:
        """A context-only request finished its prefill: lease its blocks and describe them.
        ``lease_s`` (the request's remaining deadline) shortens the lease, never lengthens it."""
        if self.sender is None:
            raise RuntimeError("context-only request on a worker without a KV sender")
        block_ids = kv.get_block_ids(request.request_id)
        self.streaming.discard(request.request_id)
        self.sender.hold(request.request_id, block_ids, lease_s=self._lease(lease_s),
                         first_token=first_token)
        self.transmitting[request.request_id] = request
        return self._params(request, block_ids, [first_token])

    def begin_stream(self, request: LlmRequest, kv, *,
                     lease_s: float | None = None) -> ContextPhaseParams:
        """The last prefill chunk of a layer-wise context-only request is scheduled: lease its
        blocks now (they are all allocated; the forward is about to write the chunk's KV) and
        describe them, without a first token. ``hand_off`` or ``end_stream`` follows after
        this step's forward."""
        if self.sender is None:
            raise RuntimeError("context-only request on a worker without a KV sender")
        block_ids = kv.get_block_ids(request.request_id)
        self.sender.begin_stream(request.request_id, block_ids, lease_s=self._lease(lease_s))
        self.streaming.add(request.request_id)
        return self._params(request, block_ids, [])

    def layers_written(self, request_ids: list[int], layers: int, device) -> None:
        """The forward wrote the first ``layers`` layers of these streamed requests' KV. On
        CUDA the send must not read them before the kernels ran: it waits on an event."""
        event = None
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            event = torch.cuda.Event()
            event.record()
        self.sender.layers_written(request_ids, layers, event)

    def end_stream(self, request: LlmRequest, reason: str) -> None:
        """A streamed context request ended without a hand-off (a stop token first, a failed
        step): the send is cancelled, and its blocks are freed once the data plane is quiet."""
        self.streaming.discard(request.request_id)
        self.sender.end_stream(request.request_id, reason)
        self.transmitting[request.request_id] = request

    def _lease(self, lease_s: float | None) -> float:
        return self.lease_s if lease_s is None else max(0.0, min(self.lease_s, lease_s))

    def _params(self, request: LlmRequest, block_ids, first: list[int]) -> ContextPhaseParams:
        return ContextPhaseParams(
            ctx_request_id=request.request_id,
            first_gen_tokens=first,
            opaque_state=self.sender.locator.encode(),
            draft_tokens=None,
            prompt_token_ids=list(request.get_prompt_tokens()),
            ctx_worker_id=self.worker_id,
            num_blocks=len(block_ids),
        )

    # ------------------------------------------------------------------ generation side

    def start_receive(self, request: LlmRequest, kv, *, timeout_s: float | None = None) -> None:
        """For a request the capacity scheduler reserved: allocate (the reservation), skip what the
        own prefix cache holds, and ask the context worker for the rest. ``timeout_s`` (the
        request's remaining deadline) shortens the transfer deadline, never lengthens it. A
        context endpoint known to be gone fails the transfer at once (handed back by ``poll``)."""
        if self.receiver is None:
            raise RuntimeError("generation-only request on a worker without a KV receiver")
        params = request.context_phase_params
        if params is None or params.ctx_worker_id is None or not params.opaque_state:
            raise ValueError(f"request {request.request_id} lacks context phase params")
        lifecycle.reserve_generation_init(request, kv)
        cached_blocks = request.prepopulated_prompt_len // kv.tokens_per_block
        held = len(kv.get_block_ids(request.request_id))
        if 0 < params.num_blocks < held - cached_blocks:
            # A sliding window: the context worker kept fewer trailing blocks than this one holds
            # (its temporary window is smaller). Both tables end on the prompt's last block, so
            # the trailing ones travel; the leading ones only ever sit outside the window, and
            # are not cached for reuse (they hold no KV of this prompt).
            cached_blocks = held - params.num_blocks
            self._unfilled.add(request.request_id)
        endpoint = params.opaque_state.decode()
        timeout = self.transfer_timeout_s if timeout_s is None else max(
            1e-3, min(self.transfer_timeout_s, timeout_s))
        kv_request = self.receiver.start(
            request.request_id,
            ctx_worker_id=params.ctx_worker_id,
            ctx_endpoint=endpoint,
            ctx_request_id=params.ctx_request_id,
            block_ids=kv.get_block_ids(request.request_id),
            num_cached_blocks=cached_blocks,
            timeout_s=timeout,
            stream=not params.first_gen_tokens,  # layer-wise: the token comes with the KV
        )
        client = label(request.request_id, request.client_id)
        moved = len(kv.get_block_ids(request.request_id)) - cached_blocks
        nbytes = moved * self.receiver.layout.bytes_per_block
        self._receiving[request.request_id] = (client, params.ctx_worker_id, moved, nbytes)
        if kv_request is not None:
            name = transfer_task_name(client, params.ctx_worker_id, self.worker_id,
                                      kv_request.num_blocks,
                                      kv_request.num_blocks * kv_request.bytes_per_block)
            self.outbox.put(ControlMessage(params.ctx_worker_id, encode_message(kv_request),
                                           endpoint, name))

    def deliver_reply(self, payload: bytes | None) -> None:
        """Thread-safe: the context worker's answer to a KV request."""
        if payload:
            self._replies.put(payload)

    # ------------------------------------------------------------------ both sides

    def poll(self, active: list[LlmRequest], kv, *, wait_s: float = 0.0) -> list[tuple[LlmRequest, str]]:
        """Apply finished transfers. Returns generation requests whose transfer failed, with the
        reason; their blocks are already free. With ``wait_s`` > 0 and every active request
        receiving, waits up to that long for one receive to finish (scheduling.md 1.4 step 2)."""
        failed: list[tuple[LlmRequest, str]] = []
        if self.sender is not None:
            for result in self.sender.poll():
                self._finish_send(result, kv)
        if self.receiver is None:
            return failed
        deadline = time.monotonic() + wait_s
        while True:
            while True:
                try:
                    self.receiver.handle(self._replies.get_nowait())
                except queue.Empty:
                    break
            results = self.receiver.poll()
            if results or time.monotonic() >= deadline:
                break
            time.sleep(0.0005)
        by_id = {r.request_id: r for r in active}
        for result in results:
            moved = self._transfer_event(result)
            unfilled = result.request_id in self._unfilled
            self._unfilled.discard(result.request_id)
            first_token = self.receiver.take_first_token(result.request_id)
            request = by_id.get(result.request_id)
            drained = self.draining.pop(result.request_id, None)
            if drained is not None:  # aborted while receiving: the blocks are quiet now
                lifecycle.finish_request(drained, kv, S.GENERATION_COMPLETE)
                continue
            if request is None:
                continue
            if result.ok and not request.context_phase_params.first_gen_tokens:
                if first_token is None:  # a layer-wise receive always brings it
                    lifecycle.finish_request(request, kv, S.DISAGG_TRANS_ERROR)
                    failed.append((request, "layer-wise receive ended without a first token"))
                    continue
                request.context_phase_params.first_gen_tokens = [first_token]
            if result.ok:
                request.state = S.DISAGG_GENERATION_TRANS_COMPLETE
                self.received[request.request_id] = (result.nbytes, result.seconds, moved)
                if kv.enable_block_reuse and not unfilled:
                    # The received prompt blocks serve later requests' prefixes too.
                    kv.store_context_blocks(request)
            else:
                lifecycle.finish_request(request, kv, S.DISAGG_TRANS_ERROR)
                failed.append((request, result.reason))
        return failed

    def abort(self, request: LlmRequest, kv) -> bool:
        """Abort a request the transport may still touch. Returns True when its blocks will be
        freed later (after the transport hands the session back), False if nothing was pending."""
        rid = request.request_id
        if rid in self.transmitting:
            self.sender.cancel(rid, "aborted")
            return True  # freed by _finish_send once the transport hands the session back
        if request.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS and self.receiver is not None:
            cancel = self.receiver.cancel(rid, "aborted")
            if cancel is not None:
                params = request.context_phase_params
                name = (f"kv_transfer cancel req={label(rid, request.client_id)} "
                        f"{params.ctx_worker_id}->{self.worker_id}")
                self.outbox.put(ControlMessage(params.ctx_worker_id, encode_message(cancel),
                                               params.opaque_state.decode(), name))
            self.draining[rid] = request
            return True
        return False

    def receive_state(self, request_id: int) -> str | None:
        """The transport session's state name of a generation request (e.g. RECEIVING while
        its payload lands), None when it has no live session."""
        if self.receiver is None or request_id in self.draining:
            return None
        state = self.receiver.sessions.state_of(request_id)
        return None if state is None else state.name

    @property
    def num_in_flight_sessions(self) -> int:
        """Live or quarantined transport sessions on both sides (0 once everything is quiet)."""
        return sum(side.sessions.num_active for side in (self.sender, self.receiver)
                   if side is not None)

    @property
    def num_quarantined_blocks(self) -> int:
        total = 0
        for side in (self.sender, self.receiver):
            if side is not None:
                total += side.sessions.num_quarantined_blocks
        return total

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()

    def client_of(self, ctx_request_id: int) -> str | None:
        """The client id of a context request whose KV is (or was lately) leased; any thread."""
        held = self.transmitting.get(ctx_request_id)  # dict reads: atomic under the GIL
        if held is not None:
            return held.client_id
        return self._sent_clients.get(ctx_request_id)

    def _finish_send(self, result, kv) -> None:
        request = self.transmitting.pop(result.request_id, None)
        if request is None:
            return
        self._sent_clients[result.request_id] = request.client_id
        while len(self._sent_clients) > SENT_CLIENTS_KEPT:
            self._sent_clients.popitem(last=False)
        state = S.DISAGG_CONTEXT_COMPLETE if result.ok else S.DISAGG_TRANS_ERROR
        if result.state.name == "EXPIRED":  # counted by the transport's TransferLog
            log.warning("request %d: lease expired before a generation worker claimed its KV; "
                        "%d blocks freed", result.request_id, len(result.block_ids))
        lifecycle.finish_request(request, kv, state)

    def _transfer_event(self, result) -> int:
        """Record the ended receive; returns the blocks it was to move."""
        started = self._receiving.pop(result.request_id, None)
        if started is None:
            return 0
        client, ctx_worker_id, moved, planned_bytes = started
        if self.events is not None:
            self.events.transfer(client=client, ctx_worker_id=ctx_worker_id, blocks=moved,
                                 nbytes=result.nbytes if result.ok else planned_bytes,
                                 seconds=result.seconds, outcome=result.state.name,
                                 reason="" if result.ok else result.reason)
        return moved

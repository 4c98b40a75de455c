"""The two sides' session state machines, on the shared base in ``sessions`` (where the
buffer-safety invariant is stated; it holds for both). PURE (stdlib + ``protocol``).

Flow (docs/design.md section 3; scheduling.md 1.4 and 7.3):
  ctx:  lease(blocks) -> claim(KVRequest) -> [data plane: begin_op ... op_finished] -> poll()
  gen:  reserve(blocks) -> request() -> KVRequest to ctx -> [begin_op ... op_finished] -> poll()
The generation side names the trailing blocks it needs; leading blocks it holds through its own
prefix cache never travel (scheduling.md 7.3, "only the last k block ids are sent").
"""
from __future__ import annotations

import dataclasses
import enum
import time

from .protocol import (
    WHOLE_POOLS, HeadSlice, KVLayout, KVRequest, TransferDescriptor, TransferRejected,
    group_order, tp_mismatch, transfer_mismatch,
)
from .sessions import (
    _RECV_EDGES, _SEND_EDGES, MAX_TRANSFER_RECORDS, Clock, RecvState, SendState, TransitionError,
    _Session, _Sessions,
)


class SenderSessions(_Sessions):
    """Context side: LEASED -> SENDING -> SENT | FAILED | CANCELLED, and LEASED -> EXPIRED |
    CANCELLED. SENDING -> LEASED (``release_claim``) when the claiming op was dropped with its
    pair group before it began; the same transfer may then claim again, or re-claim at once
    on a newer group of the same generation worker (``claim``)."""

    _side = "send"
    _edges = _SEND_EDGES
    _success = SendState.SENT
    _failed = SendState.FAILED
    _cancelled = SendState.CANCELLED

    def __init__(self, worker_id: str, layout: KVLayout, *, clock: Clock = time.monotonic,
                 lease_s: float = 30.0, max_records: int = MAX_TRANSFER_RECORDS,
                 tp: tuple[int, int] = (1, 0)) -> None:
        super().__init__(worker_id, layout, clock=clock, default_timeout_s=lease_s,
                         max_records=max_records)
        self.tp = tuple(tp)  # (tensor parallel size, rank) of this context worker

    def lease(self, ctx_request_id: int, block_ids: tuple[int, ...] | list[int], *,
              lease_s: float | None = None) -> None:
        """Hold a finished context request's blocks until a KV request claims them."""
        lease_s = self.default_timeout_s if lease_s is None else lease_s
        with self._lock:
            self._add(_Session(ctx_request_id, tuple(block_ids), SendState.LEASED,
                               self._clock() + lease_s))

    def claim(self, req: KVRequest) -> TransferDescriptor:
        """LEASED -> SENDING for a KV request; raises TransferRejected if it cannot be served.
        A transfer re-issued on a newer pair group (its first op was queued on a group that
        broke) takes over its own claim while that op has not begun."""
        # First: a request meant for another rank names another rank's request ids
        differs = tp_mismatch((req.ctx_tp_size, req.ctx_rank), self.tp)
        if differs:
            raise TransferRejected(differs)
        with self._lock:
            s = self._sessions.get(req.ctx_request_id)
            if s is None:
                raise TransferRejected(f"unknown context request {req.ctx_request_id}")
            d = s.descriptor
            if (s.state == SendState.SENDING and not s.in_flight and d is not None
                    and (d.transfer_id, d.gen_worker_id) == (req.transfer_id, req.gen_worker_id)
                    and group_order(req.group) > group_order(d.group)):
                s.descriptor = dataclasses.replace(d, seq=req.seq, group=req.group)
                s.deadline = self._clock() + req.timeout_s
                return s.descriptor
            if s.state != SendState.LEASED:
                raise TransferRejected(f"context request {req.ctx_request_id} is {s.state.name}")
            if self._clock() >= s.deadline:
                self._finish(s, SendState.EXPIRED, "lease expired")
                raise TransferRejected(f"lease of context request {req.ctx_request_id} expired")
            mine = self.layout
            differs = transfer_mismatch(mine, req.layout, req.heads)
            if differs:
                raise TransferRejected(f"KV layout mismatch (ours vs theirs): {differs}")
            if req.num_blocks > len(s.block_ids):
                raise TransferRejected(
                    f"asked for {req.num_blocks} blocks, context request has {len(s.block_ids)}")
            src = s.block_ids[len(s.block_ids) - req.num_blocks:]
            s.descriptor = TransferDescriptor(
                req.transfer_id, req.seq, req.group, self.worker_id, req.gen_worker_id,
                req.ctx_request_id, req.gen_request_id, src, req.gen_block_ids,
                req.num_cached_blocks, mine, req.stream, req.src_head_offset,
                req.dst_head_offset, req.num_heads, req.ctx_tp_size, req.ctx_rank)
            s.peer = req.gen_worker_id
            s.deadline = self._clock() + req.timeout_s
            self._transition(s, SendState.SENDING)
            return s.descriptor

    def release_claim(self, d: TransferDescriptor) -> bool:
        """SENDING -> LEASED when ``d`` is still the session's claim and its op never began (its
        group was dropped first). The lease runs to the claim's deadline. False otherwise (the
        transfer re-claimed on a newer group, or the session moved on)."""
        with self._lock:
            s = self._sessions.get(d.ctx_request_id)
            if s is None or s.state != SendState.SENDING or s.in_flight or s.descriptor != d:
                return False
            self._transition(s, SendState.LEASED)
            return True

    def fail_claim(self, d: TransferDescriptor, reason: str) -> bool:
        """Fail the session only while ``d`` is still its claim (an op of an older group must
        not fail the transfer that re-claimed it on a newer one)."""
        with self._lock:
            s = self._sessions.get(d.ctx_request_id)
            if s is None or s.descriptor != d:
                return False
            return self.fail(d.ctx_request_id, reason)

    def _expired_state(self, s: _Session) -> enum.IntEnum:
        return SendState.EXPIRED if s.state == SendState.LEASED else SendState.FAILED

    def _may_begin(self, s: _Session) -> bool:
        return s.state == SendState.SENDING


class ReceiverSessions(_Sessions):
    """Generation side: RESERVED -> REQUESTED -> RECEIVING -> COMPLETE, with FAILED | TIMED_OUT
    | CANCELLED reachable from every live state."""

    _side = "recv"
    _edges = _RECV_EDGES
    _success = RecvState.COMPLETE
    _failed = RecvState.FAILED
    _cancelled = RecvState.CANCELLED

    def __init__(self, worker_id: str, layout: KVLayout, *, clock: Clock = time.monotonic,
                 default_timeout_s: float = 30.0,
                 max_records: int = MAX_TRANSFER_RECORDS) -> None:
        super().__init__(worker_id, layout, clock=clock, default_timeout_s=default_timeout_s,
                         max_records=max_records)
        self._next_transfer_id = 0

    def reserve(self, gen_request_id: int, *, ctx_worker_id: str, ctx_request_id: int,
                block_ids: tuple[int, ...] | list[int], num_cached_blocks: int = 0,
                timeout_s: float | None = None, stream: bool = False,
                heads: HeadSlice = WHOLE_POOLS, ctx_tp: tuple[int, int] = (1, 0)) -> None:
        """``block_ids``: the generation blocks for the context's blocks, in order; the first
        ``num_cached_blocks`` already hold the right KV (own prefix cache) and are not sent.
        The deadline covers the whole transfer, from now. ``stream``: layer-wise (the context
        request may still be prefilling; the first token comes in the op's trailer).
        ``heads``: the KV heads that travel (tensor parallelism); ``ctx_tp``: (tensor parallel
        size, rank) the context worker must have, or it refuses."""
        if not 0 <= num_cached_blocks <= len(block_ids):
            raise ValueError(f"num_cached_blocks={num_cached_blocks} outside [0, {len(block_ids)}]")
        pool_heads = self.layout.kv_shape[2]
        if heads.dst_offset + heads.num_heads > pool_heads:
            raise ValueError(f"{heads} does not fit this pool's {pool_heads} local KV heads")
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        s = _Session(gen_request_id, tuple(block_ids), RecvState.RESERVED,
                     self._clock() + timeout_s, peer=ctx_worker_id)
        s.descriptor = TransferDescriptor(
            -1, 0, "", ctx_worker_id, self.worker_id, ctx_request_id, gen_request_id, (),
            s.block_ids[num_cached_blocks:], num_cached_blocks, self.layout, stream,
            heads.src_offset, heads.dst_offset, heads.num_heads, *ctx_tp)
        with self._lock:
            self._add(s)

    def request(self, gen_request_id: int, *, group: str, seq: int) -> KVRequest:
        """RESERVED -> REQUESTED: the op gets its place (group, seq) on the pair; returns the
        KV request for the context worker. The full descriptor is ``descriptor(id)``."""
        with self._lock:
            s = self._sessions.get(gen_request_id)
            if s is None:
                raise TransitionError(f"request {gen_request_id} has no session")
            self._transition(s, RecvState.REQUESTED)
            d = s.descriptor
            assert d is not None
            s.descriptor = dataclasses.replace(d, transfer_id=self._next_transfer_id, seq=seq,
                                               group=group)
            self._next_transfer_id += 1
            remaining = max(s.deadline - self._clock(), 1e-3)
            return KVRequest.for_descriptor(s.descriptor, remaining)

    def reissue(self, gen_request_id: int, *, group: str, seq: int) -> KVRequest | None:
        """A REQUESTED op whose group broke before it began gets a new place (group, seq) on the
        rebuilt group, with the same transfer id and deadline. None when the session is no
        longer waiting for its op (final, receiving, or past its deadline)."""
        with self._lock:
            s = self._sessions.get(gen_request_id)
            if s is None or s.state != RecvState.REQUESTED or s.in_flight:
                return None
            remaining = s.deadline - self._clock()
            if remaining <= 0:
                return None
            assert s.descriptor is not None
            s.descriptor = dataclasses.replace(s.descriptor, seq=seq, group=group)
            return KVRequest.for_descriptor(s.descriptor, remaining)

    def current_op(self, gen_request_id: int) -> tuple[str, int] | None:
        """(group, seq) of the session's op, or None when it has none."""
        with self._lock:
            s = self._sessions.get(gen_request_id)
            if s is None or s.descriptor is None or s.descriptor.transfer_id < 0:
                return None
            return s.descriptor.group, s.descriptor.seq

    def find_transfer(self, transfer_id: int, ctx_request_id: int) -> int | None:
        """The generation request whose live session issued this transfer, if any."""
        with self._lock:
            for s in self._sessions.values():
                d = s.descriptor
                if d is not None and (d.transfer_id, d.ctx_request_id) == (transfer_id,
                                                                          ctx_request_id):
                    return s.request_id
            return None

    def _expired_state(self, s: _Session) -> enum.IntEnum:
        return RecvState.TIMED_OUT

    def _may_begin(self, s: _Session) -> bool:
        if s.state != RecvState.REQUESTED:
            return False
        self._transition(s, RecvState.RECEIVING)
        return True

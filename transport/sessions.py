"""KV transfer sessions, the part both sides share: session states and their legal transitions,
what ``poll`` hands back (``TransferResult``, ``TransferRecord``), ``TransferLog``, and
``_Sessions``, the bookkeeping under ``SenderSessions`` / ``ReceiverSessions`` (``session_sides``).
PURE (stdlib + ``protocol``): every decision about a transfer is made here, in ``session_sides``
and in ``protocol``; ``torch_dist`` only moves bytes and reports back.

Buffer-safety invariant: a session whose data-plane op is in flight is never released by a
cancel or a deadline. It is QUARANTINED (state already final, blocks held and counted) until the
data plane reports quiescence (``op_finished`` or ``group_destroyed``). ``poll`` yields each
session exactly once, when it is final AND quiescent: then its blocks belong to the executor.
"""
from __future__ import annotations

import enum
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .protocol import KVLayout, TransferDescriptor

Clock = Callable[[], float]


class TransitionError(RuntimeError):
    """An illegal session state transition (a programming error in the caller)."""


class SendState(enum.IntEnum):
    """Context (sender) side of one finished context request."""

    LEASED = 0  # blocks held until a KV request claims them or the lease runs out
    SENDING = 1  # claimed: queued on the pair thread, then in flight
    SENT = 2  # final: blocks may be freed
    FAILED = 3
    EXPIRED = 4  # the lease ran out unclaimed
    CANCELLED = 5


class RecvState(enum.IntEnum):
    """Generation (receiver) side of one generation-only request."""

    RESERVED = 0  # blocks allocated
    REQUESTED = 1  # KV request issued, recv queued on the pair thread
    RECEIVING = 2  # payload is landing in the blocks
    COMPLETE = 3
    FAILED = 4
    TIMED_OUT = 5
    CANCELLED = 6


_SEND_EDGES = {
    SendState.LEASED: {SendState.SENDING, SendState.EXPIRED, SendState.CANCELLED},
    # SENDING -> LEASED: a claimed op that never began was dropped with its pair group; the
    # blocks stay leased for the generation side to ask again on the rebuilt group.
    SendState.SENDING: {SendState.SENT, SendState.FAILED, SendState.CANCELLED, SendState.LEASED},
}
_RECV_EDGES = {
    RecvState.RESERVED: {RecvState.REQUESTED, RecvState.FAILED, RecvState.TIMED_OUT,
                         RecvState.CANCELLED},
    RecvState.REQUESTED: {RecvState.RECEIVING, RecvState.FAILED, RecvState.TIMED_OUT,
                          RecvState.CANCELLED},
    RecvState.RECEIVING: {RecvState.COMPLETE, RecvState.FAILED, RecvState.TIMED_OUT,
                          RecvState.CANCELLED},
}


class TransferResult(NamedTuple):
    """What ``poll`` yields once per session: its final state; its blocks are the executor's
    again."""

    request_id: int
    transfer_id: int  # -1 when no transfer was ever claimed/issued
    state: enum.IntEnum
    ok: bool
    reason: str
    nbytes: int
    seconds: float
    block_ids: tuple[int, ...]


class SessionStats(NamedTuple):
    num_active: int  # live sessions plus quarantined ones
    num_quarantined_blocks: int
    outcomes: dict[str, int]  # final state name -> sessions handed back
    total_bytes: int  # bytes of successful transfers


MAX_TRANSFER_RECORDS = 10_000  # records a TransferLog keeps: a long-running worker stays bounded


class TransferRecord(NamedTuple):
    """One finished session, as ``poll`` handed it back (a worker's status lists these)."""

    transfer_id: int  # -1 when no transfer was ever claimed/issued
    request_id: int
    peer: str  # the other side's worker id ("" for a lease no KV request claimed)
    nbytes: int  # 0 unless the transfer succeeded
    seconds: float
    outcome: str  # the final state's name
    reason: str
    side: str  # "send" (context side) | "recv" (generation side)


class TransferLog:
    """The count of finished transfers: cumulative totals plus the most recent records. The
    sessions add each one as ``poll`` hands it back, so the thread that polls (the executor's)
    can read the fields without a lock; ``Executor.status()`` and the worker metrics read them.
    A worker with both roles has its two sides count into one log (``_Sessions.count_into``)."""

    def __init__(self, max_records: int = MAX_TRANSFER_RECORDS) -> None:
        self.sent = 0
        self.received = 0
        self.failed = 0  # every other final state, expired leases included
        self.leases_expired = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.seconds = 0.0  # successful transfers only
        self.outcomes: Counter[str] = Counter()  # final state name -> transfers
        self.records: deque[TransferRecord] = deque(maxlen=max_records)

    def add(self, record: TransferRecord, *, ok: bool) -> None:
        if ok:
            if record.side == "send":
                self.sent += 1
                self.bytes_sent += record.nbytes
            else:
                self.received += 1
                self.bytes_received += record.nbytes
            self.seconds += record.seconds
        else:
            self.failed += 1
            if record.outcome == SendState.EXPIRED.name:  # only a lease (send side) expires
                self.leases_expired += 1
        self.outcomes[record.outcome] += 1
        self.records.append(record)


@dataclass(slots=True)
class _Session:
    request_id: int
    block_ids: tuple[int, ...]
    state: enum.IntEnum
    deadline: float
    peer: str = ""
    descriptor: TransferDescriptor | None = None
    in_flight: bool = False  # the data plane may be touching the blocks right now
    quarantined: bool = False  # final while in flight: held until quiescence
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class _Sessions:
    """Shared bookkeeping of both sides. Thread-safe: the executor thread and the pair threads
    call in concurrently."""

    _side: str  # TransferRecord.side of this side's sessions
    _edges: dict[enum.IntEnum, set[enum.IntEnum]]  # legal transitions; keys = live states
    _success: enum.IntEnum
    _failed: enum.IntEnum
    _cancelled: enum.IntEnum

    def __init__(self, worker_id: str, layout: KVLayout, *, clock: Clock = time.monotonic,
                 default_timeout_s: float = 30.0,
                 max_records: int = MAX_TRANSFER_RECORDS) -> None:
        self.worker_id = worker_id
        self.layout = layout
        self._clock = clock
        self.default_timeout_s = default_timeout_s
        self._lock = threading.RLock()
        self._sessions: dict[int, _Session] = {}
        # final and quiescent, not handed back yet; the record is counted when it is
        self._ready: deque[tuple[TransferResult, TransferRecord]] = deque()
        self._quarantined_blocks = 0
        self.transfers = TransferLog(max_records)

    # --------------------------------------------------------------- counts and queries

    @property
    def num_active(self) -> int:
        """Live sessions plus quarantined ones (final, op still in flight)."""
        with self._lock:
            return len(self._sessions)

    @property
    def num_quarantined_blocks(self) -> int:
        with self._lock:
            return self._quarantined_blocks

    def transfer_records(self) -> list[TransferRecord]:
        """The most recent sessions handed back (bytes, seconds, outcome), oldest first."""
        with self._lock:
            return list(self.transfers.records)

    def stats(self) -> SessionStats:
        with self._lock:
            t = self.transfers
            return SessionStats(len(self._sessions), self._quarantined_blocks,
                                dict(t.outcomes), t.bytes_sent + t.bytes_received)

    def count_into(self, transfers: TransferLog) -> None:
        """Count handed-back sessions into ``transfers`` from now on (a worker with both roles
        keeps one log for its sends and receives)."""
        with self._lock:
            self.transfers = transfers

    def state_of(self, request_id: int) -> enum.IntEnum | None:
        with self._lock:
            s = self._sessions.get(request_id)
            return None if s is None else s.state

    def in_flight(self, request_id: int) -> bool:
        """Whether the session's data-plane op has begun and not finished."""
        with self._lock:
            s = self._sessions.get(request_id)
            return s is not None and s.in_flight

    def descriptor(self, request_id: int) -> TransferDescriptor | None:
        with self._lock:
            s = self._sessions.get(request_id)
            return None if s is None else s.descriptor

    def remaining_s(self, request_id: int) -> float:
        """Seconds left before the session's deadline (0 when past or unknown)."""
        with self._lock:
            s = self._sessions.get(request_id)
            return 0.0 if s is None else max(0.0, s.deadline - self._clock())

    def poll(self) -> list[TransferResult]:
        """Apply deadlines, then hand back every session that is final and quiescent."""
        self.check_deadlines()
        with self._lock:
            out = []
            for result, record in self._ready:
                self.transfers.add(record, ok=result.ok)
                out.append(result)
            self._ready.clear()
            return out

    def check_deadlines(self) -> int:
        now = self._clock()
        with self._lock:
            due = [s for s in self._sessions.values()
                   if s.state in self._edges and now >= s.deadline]
            for s in due:
                self._finish(s, self._expired_state(s), "deadline exceeded")
            return len(due)

    # --------------------------------------------------------------- data plane reports

    def begin_op(self, request_id: int) -> bool:
        """The pair thread is about to touch the blocks. False: the session is gone or final
        (cancelled, past its deadline), so the op must not touch them."""
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or s.state not in self._edges:
                return False
            if s.in_flight:
                raise TransitionError(f"request {request_id}: op already in flight")
            if self._clock() >= s.deadline:
                self._finish(s, self._expired_state(s), "deadline exceeded")
                return False
            if not self._may_begin(s):
                return False
            s.in_flight = True
            return True

    def op_finished(self, request_id: int, *, ok: bool, nbytes: int, seconds: float,
                    reason: str = "") -> None:
        """The op that ``begin_op`` allowed is over (ok or not): the blocks are quiescent."""
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or not s.in_flight:
                raise TransitionError(f"request {request_id}: op_finished without begin_op")
            s.in_flight = False
            s.nbytes, s.seconds = nbytes, seconds
            if s.quarantined:
                self._release(s)
            else:
                self._finish(s, self._success if ok else self._failed, "" if ok else reason)

    def group_destroyed(self, group: str) -> int:
        """The pair group is torn down, so no op on it can still write: release its quarantine.
        Returns how many sessions were released."""
        with self._lock:
            hit = [s for s in self._sessions.values()
                   if s.in_flight and s.descriptor is not None and s.descriptor.group == group]
            for s in hit:
                self.op_finished(s.request_id, ok=False, nbytes=0, seconds=0.0,
                                 reason="process group destroyed")
            return len(hit)

    def fail(self, request_id: int, reason: str) -> bool:
        """Failure seen outside an op (refused, group reset before the op began). Returns False
        when the session is already final or unknown (a race with cancel/deadline)."""
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or s.state not in self._edges:
                return False
            self._finish(s, self._failed, reason)
            return True

    def expire(self, request_id: int, reason: str = "deadline exceeded") -> bool:
        """The data plane ran out of time waiting for this session's op (its wait uses the same
        deadline): final as the expired state, not as a failure, even when the clock check in
        ``poll`` has not run yet. An in-flight session is quarantined until ``op_finished``.
        False when the session is already final or unknown."""
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or s.state not in self._edges:
                return False
            self._finish(s, self._expired_state(s), reason)
            return True

    def cancel(self, request_id: int, reason: str = "cancelled") -> bool:
        """Cancel a live session; an in-flight one is quarantined. False if unknown or final."""
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or s.state not in self._edges:
                return False
            self._finish(s, self._cancelled, reason)
            return True

    # --------------------------------------------------------------- internals

    def _expired_state(self, s: _Session) -> enum.IntEnum:
        raise NotImplementedError

    def _may_begin(self, s: _Session) -> bool:
        raise NotImplementedError

    def _add(self, s: _Session) -> None:
        if s.request_id in self._sessions:
            raise TransitionError(f"request {s.request_id} already has a live session")
        self._sessions[s.request_id] = s

    def _transition(self, s: _Session, new: enum.IntEnum) -> None:
        if new not in self._edges.get(s.state, ()):
            raise TransitionError(
                f"request {s.request_id}: {s.state.name} -> {new.name} is illegal")
        s.state = new

    def _finish(self, s: _Session, new: enum.IntEnum, reason: str) -> None:
        self._transition(s, new)
        s.reason = reason
        if s.in_flight:
            s.quarantined = True
            self._quarantined_blocks += len(s.block_ids)
        else:
            self._emit(s)

    def _release(self, s: _Session) -> None:
        s.quarantined = False
        self._quarantined_blocks -= len(s.block_ids)
        self._emit(s)

    def _emit(self, s: _Session) -> None:
        del self._sessions[s.request_id]
        ok = s.state == self._success
        tid = -1 if s.descriptor is None else s.descriptor.transfer_id
        nbytes = s.nbytes if ok else 0
        self._ready.append((
            TransferResult(s.request_id, tid, s.state, ok, s.reason, nbytes, s.seconds,
                           s.block_ids),
            TransferRecord(tid, s.request_id, s.peer, nbytes, s.seconds, s.state.name, s.reason,
                           self._side)))


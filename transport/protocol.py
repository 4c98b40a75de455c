"""KV transfer protocol: descriptors, msgpack control messages, wire header and the per-side
session state machines. PURE (stdlib + msgpack): every decision about a transfer is made here;
``torch_dist`` only moves bytes and reports back.

Flow (DESIGN.md "Request lifecycle", reference 1.4 and 7.3):
  ctx:  lease(blocks) -> claim(KVRequest) -> [data plane: begin_op ... op_finished] -> poll()
  gen:  reserve(blocks) -> request() -> KVRequest to ctx -> [begin_op ... op_finished] -> poll()
The generation side names the trailing blocks it needs; leading blocks it holds through its own
prefix cache never travel (reference 7.3, "only the last k block ids are sent").

Buffer-safety invariant: a session whose data-plane op is in flight is never released by a
cancel or a deadline. It is QUARANTINED (state already final, blocks held and counted) until the
data plane reports quiescence (``op_finished`` or ``group_destroyed``). ``poll`` yields each
session exactly once, when it is final AND quiescent: then its blocks belong to the executor.
"""
from __future__ import annotations

import enum
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple

import msgpack

PROTOCOL_VERSION = 1
Clock = Callable[[], float]


class ProtocolError(ValueError):
    """A control message or wire header is malformed (unknown type, missing or mistyped field)."""


class TransitionError(RuntimeError):
    """An illegal session state transition (a programming error in the caller)."""


class TransferRejected(Exception):
    """The context side refuses a KV request (unknown request, lease gone, layout mismatch)."""


# ---------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must match on both sides for blocks to be copied byte for byte."""

    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", "float16"
    bytes_per_block: int  # one block id across all layers, K and V
    kv_shape: tuple[int, int, int, int]  # (num_layers, tokens_per_block, num_kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class TransferDescriptor:
    """One transfer, as the data plane executes it. Block ids are those that TRAVEL: the trailing
    ``num_blocks`` blocks of the context sequence into the generation blocks right after its
    ``num_cached_blocks`` prefix-cached ones. ``ctx_block_ids`` is () on the generation side."""

    transfer_id: int  # unique per generation worker
    seq: int  # position in the pair group's op order (both sides run ops in seq order)
    group: str  # name of the pair's process group (generation side chooses it)
    ctx_worker_id: str
    gen_worker_id: str
    ctx_request_id: int
    gen_request_id: int
    ctx_block_ids: tuple[int, ...]
    gen_block_ids: tuple[int, ...]
    num_cached_blocks: int
    layout: KVLayout

    def __post_init__(self) -> None:
        if self.ctx_block_ids and len(self.ctx_block_ids) != len(self.gen_block_ids):
            raise ValueError("ctx and gen block lists of a transfer differ in length")
        if self.num_cached_blocks < 0 or self.seq < 0:
            raise ValueError("num_cached_blocks and seq must be >= 0")

    @property
    def num_blocks(self) -> int:
        return len(self.gen_block_ids)

    @property
    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block


def group_name(ctx_worker_id: str, gen_worker_id: str, incarnation: int, epoch: int) -> str:
    """Store prefix of a pair's process group, chosen by the generation side. A new epoch (after
    a failure) or incarnation (a restarted generation worker; its start time in ns, so later
    incarnations order after earlier ones) gives fresh rendezvous keys, never stale ones."""
    return f"pdserve-kv/{ctx_worker_id}/{gen_worker_id}/{incarnation}/{epoch}"


def group_order(name: str) -> tuple[int, int]:
    """(incarnation, epoch) of a group name: the context side serves only the newest group of a
    generation worker and refuses older ones (their ops were abandoned by the peer)."""
    parts = name.rsplit("/", 2)
    try:
        return int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise ProtocolError(f"malformed group name {name!r}") from None


# ---------------------------------------------------------------------------- control messages


@dataclass(frozen=True, slots=True)
class KVRequest:
    """gen -> ctx: send me the trailing ``num_blocks`` blocks of ``ctx_request_id``.
    ``timeout_s`` is the deadline relative to sending (two processes' clocks do not compare)."""

    transfer_id: int
    seq: int
    group: str
    gen_worker_id: str
    ctx_request_id: int
    gen_request_id: int
    num_blocks: int
    num_cached_blocks: int
    gen_block_ids: tuple[int, ...]
    dtype: str
    bytes_per_block: int
    kv_shape: tuple[int, int, int, int]
    timeout_s: float

    def __post_init__(self) -> None:
        if self.num_blocks != len(self.gen_block_ids):
            raise ProtocolError("num_blocks differs from len(gen_block_ids)")
        if min(self.num_blocks, self.num_cached_blocks, self.seq, self.bytes_per_block) < 0:
            raise ProtocolError("negative count in kv_request")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ProtocolError("kv_request timeout_s must be positive and finite")

    @classmethod
    def for_descriptor(cls, d: TransferDescriptor, timeout_s: float) -> KVRequest:
        return cls(
            d.transfer_id, d.seq, d.group, d.gen_worker_id, d.ctx_request_id, d.gen_request_id,
            d.num_blocks, d.num_cached_blocks, d.gen_block_ids, d.layout.dtype,
            d.layout.bytes_per_block, d.layout.kv_shape, timeout_s,
        )


@dataclass(frozen=True, slots=True)
class TransferDone:
    """ctx -> gen (the answer to a KV request): how the send ended."""

    transfer_id: int
    ctx_request_id: int
    ok: bool
    reason: str  # "" when ok
    nbytes: int
    seconds: float
    # Refused because the KV endpoint the request was meant for belongs to a previous
    # incarnation of the context worker: nothing aimed at that endpoint can succeed any more.
    endpoint_gone: bool = False


@dataclass(frozen=True, slots=True)
class CancelTransfer:
    """gen -> ctx: the generation request is gone; do not send (or stop caring)."""

    transfer_id: int
    ctx_request_id: int
    gen_worker_id: str
    reason: str


Message = KVRequest | TransferDone | CancelTransfer
_INT, _STR, _FLOAT, _BOOL, _INTS, _SHAPE = "int", "str", "float", "bool", "ints", "shape"
_SCHEMAS: dict[str, tuple[type, dict[str, str]]] = {
    "kv_request": (KVRequest, {
        "transfer_id": _INT, "seq": _INT, "group": _STR, "gen_worker_id": _STR,
        "ctx_request_id": _INT, "gen_request_id": _INT, "num_blocks": _INT,
        "num_cached_blocks": _INT, "gen_block_ids": _INTS, "dtype": _STR,
        "bytes_per_block": _INT, "kv_shape": _SHAPE, "timeout_s": _FLOAT,
    }),
    "done": (TransferDone, {
        "transfer_id": _INT, "ctx_request_id": _INT, "ok": _BOOL, "reason": _STR,
        "nbytes": _INT, "seconds": _FLOAT, "endpoint_gone": _BOOL,
    }),
    "cancel": (CancelTransfer, {
        "transfer_id": _INT, "ctx_request_id": _INT, "gen_worker_id": _STR, "reason": _STR,
    }),
}
_TYPE_OF = {cls: name for name, (cls, _) in _SCHEMAS.items()}
# Fields a message may leave out (added after version 1 shipped): their value when absent.
_DEFAULTS: dict[str, dict[str, Any]] = {"done": {"endpoint_gone": False}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(kind: str, name: str, v: Any) -> Any:
    ok = {
        _INT: _is_int(v),
        _STR: isinstance(v, str),
        _FLOAT: (_is_int(v) or isinstance(v, float)),
        _BOOL: isinstance(v, bool),
        _INTS: isinstance(v, (list, tuple)) and all(_is_int(x) for x in v),
        _SHAPE: isinstance(v, (list, tuple)) and len(v) == 4 and all(_is_int(x) for x in v),
    }[kind]
    if not ok:
        raise ProtocolError(f"field {name!r} must be {kind}, got {type(v).__name__}")
    if kind in (_INTS, _SHAPE):
        return tuple(v)
    return float(v) if kind == _FLOAT else v


def encode_message(msg: Message) -> bytes:
    kind = _TYPE_OF.get(type(msg))
    if kind is None:
        raise ProtocolError(f"not a control message: {type(msg).__name__}")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": kind}
    for f in fields(msg):
        value = getattr(msg, f.name)
        body[f.name] = list(value) if isinstance(value, tuple) else value
    return msgpack.packb(body, use_bin_type=True)


def decode_message(data: bytes) -> Message:
    """Bytes -> message. Anything malformed raises ProtocolError; unknown extra keys are ignored
    so a newer peer may add fields."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"control message must be bytes, got {type(data).__name__}")
    try:
        body = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable control message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("control message must be a map")
    if body.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {body.get('v')!r}")
    kind = body.get("type")
    if kind not in _SCHEMAS:
        raise ProtocolError(f"unknown message type {kind!r}")
    cls, schema = _SCHEMAS[kind]
    defaults = _DEFAULTS.get(kind, {})
    missing = [name for name in schema if name not in body and name not in defaults]
    if missing:
        raise ProtocolError(f"{kind} message lacks {', '.join(missing)}")
    return cls(**{name: _field(k, name, body[name]) if name in body else defaults[name]
                  for name, k in schema.items()})


# ---------------------------------------------------------------------------- wire header


class WireStatus(enum.IntEnum):
    OK = 0  # payload chunks follow
    REJECTED = 1  # no payload: the context side refused the request
    CANCELLED = 2  # no payload: cancelled or past its deadline before the send began


class WireHeader(NamedTuple):
    """First message of every op on a pair group (int64[HEADER_LEN]). The context side sends one
    for every seq it is asked for, payload or not, so the two op streams always pair up; the
    generation side checks it against its own descriptor before it touches a block."""

    seq: int
    status: int
    transfer_id: int
    ctx_request_id: int
    num_blocks: int
    bytes_per_block: int
    chunk_planes: int  # payload chunking (see plan_chunks); 0 when no payload follows
    chunk_blocks: int

    def to_ints(self) -> list[int]:
        return [WIRE_MAGIC, *self]

    @classmethod
    def from_ints(cls, values: list[int]) -> WireHeader:
        if len(values) != HEADER_LEN or values[0] != WIRE_MAGIC:
            raise ProtocolError("bad wire header (desynchronised stream?)")
        header = cls(*values[1:])
        if header.status not in WireStatus.__members__.values():
            raise ProtocolError(f"bad wire status {header.status}")
        if header.status == WireStatus.OK and header.num_blocks > 0 and min(
                header.chunk_planes, header.chunk_blocks) < 1:
            raise ProtocolError("wire header with payload but no chunk size")
        return header


WIRE_MAGIC = 0x5044_4B56  # "PDKV"
HEADER_LEN = 1 + len(WireHeader._fields)


class Chunk(NamedTuple):
    """One payload message: planes [plane_start, plane_stop) (plane = layer * 2 + K/V) of the
    transfer's blocks [block_start, block_stop), laid out [planes, blocks, block bytes]."""

    plane_start: int
    plane_stop: int
    block_start: int
    block_stop: int

    @property
    def num_rows(self) -> int:
        return (self.plane_stop - self.plane_start) * (self.block_stop - self.block_start)


def consecutive_fraction(block_ids: tuple[int, ...] | list[int]) -> float:
    """Share of neighbouring ids that are consecutive (1.0 for one run or a single block)."""
    if len(block_ids) < 2:
        return 1.0
    hits = sum(1 for x, y in zip(block_ids, block_ids[1:]) if y == x + 1)
    return hits / (len(block_ids) - 1)


def choose_chunking(num_planes: int, num_blocks: int, plane_block_bytes: int,
                    target_chunk_bytes: int, *, runs: bool = False, min_chunks: int = 4,
                    max_direct_bytes: int = 8 << 20) -> tuple[int, int]:
    """(planes per chunk, blocks per chunk) of a payload.

    - Up to target_chunk_bytes in all: one chunk (every message costs thread hand-offs).
    - ``runs`` (a side's block ids are mostly consecutive): single-plane chunks of up to
      max_direct_bytes; a chunk whose ids form a run on a side is one contiguous slice of that
      side's pool, which that side sends from / receives into without a copy.
    - Otherwise every chunk is gathered/scattered through staging: about target_chunk_bytes
      each and at least min_chunks of them, so the copies overlap the wire."""
    plane_bytes = num_blocks * plane_block_bytes
    if num_blocks == 0 or plane_bytes * num_planes <= target_chunk_bytes:
        return num_planes, max(1, num_blocks)
    if runs:
        return 1, max(1, min(num_blocks, max_direct_bytes // plane_block_bytes))
    target = min(target_chunk_bytes, math.ceil(plane_bytes * num_planes / min_chunks))
    if plane_bytes >= target:
        return 1, max(1, target // plane_block_bytes)
    return max(1, target // plane_bytes), num_blocks


def plan_chunks(num_planes: int, num_blocks: int, chunk_planes: int,
                chunk_blocks: int) -> list[Chunk]:
    """The payload's messages in wire order (plane-major). Both sides derive it from the header."""
    if num_blocks == 0:
        return []
    return [Chunk(p, min(p + chunk_planes, num_planes), a, min(a + chunk_blocks, num_blocks))
            for p in range(0, num_planes, chunk_planes)
            for a in range(0, num_blocks, chunk_blocks)]


def wire_tag(seq: int, index: int) -> int:
    """Gloo tag of message ``index`` (0 = header, i + 1 = chunk i) of op ``seq``: a mismatched
    pairing then never matches silently. Fits a non-negative int32."""
    return ((seq % (1 << 19)) << 12) | (index % (1 << 12))


# ---------------------------------------------------------------------------- sessions


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
    SendState.SENDING: {SendState.SENT, SendState.FAILED, SendState.CANCELLED},
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


class SenderSessions(_Sessions):
    """Context side: LEASED -> SENDING -> SENT | FAILED | CANCELLED, and LEASED -> EXPIRED |
    CANCELLED."""

    _side = "send"
    _edges = _SEND_EDGES
    _success = SendState.SENT
    _failed = SendState.FAILED
    _cancelled = SendState.CANCELLED

    def __init__(self, worker_id: str, layout: KVLayout, *, clock: Clock = time.monotonic,
                 lease_s: float = 30.0, max_records: int = MAX_TRANSFER_RECORDS) -> None:
        super().__init__(worker_id, layout, clock=clock, default_timeout_s=lease_s,
                         max_records=max_records)

    def lease(self, ctx_request_id: int, block_ids: tuple[int, ...] | list[int], *,
              lease_s: float | None = None) -> None:
        """Hold a finished context request's blocks until a KV request claims them."""
        lease_s = self.default_timeout_s if lease_s is None else lease_s
        with self._lock:
            self._add(_Session(ctx_request_id, tuple(block_ids), SendState.LEASED,
                               self._clock() + lease_s))

    def claim(self, req: KVRequest) -> TransferDescriptor:
        """LEASED -> SENDING for a KV request; raises TransferRejected if it cannot be served."""
        with self._lock:
            s = self._sessions.get(req.ctx_request_id)
            if s is None:
                raise TransferRejected(f"unknown context request {req.ctx_request_id}")
            if s.state != SendState.LEASED:
                raise TransferRejected(f"context request {req.ctx_request_id} is {s.state.name}")
            if self._clock() >= s.deadline:
                self._finish(s, SendState.EXPIRED, "lease expired")
                raise TransferRejected(f"lease of context request {req.ctx_request_id} expired")
            mine = self.layout
            theirs = KVLayout(req.dtype, req.bytes_per_block, req.kv_shape)
            if theirs != mine:
                raise TransferRejected(f"KV layout mismatch: ours {mine}, theirs {theirs}")
            if req.num_blocks > len(s.block_ids):
                raise TransferRejected(
                    f"asked for {req.num_blocks} blocks, context request has {len(s.block_ids)}")
            src = s.block_ids[len(s.block_ids) - req.num_blocks:]
            s.descriptor = TransferDescriptor(
                req.transfer_id, req.seq, req.group, self.worker_id, req.gen_worker_id,
                req.ctx_request_id, req.gen_request_id, src, req.gen_block_ids,
                req.num_cached_blocks, mine)
            s.peer = req.gen_worker_id
            s.deadline = self._clock() + req.timeout_s
            self._transition(s, SendState.SENDING)
            return s.descriptor

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
                timeout_s: float | None = None) -> None:
        """``block_ids``: the generation blocks for the context's blocks, in order; the first
        ``num_cached_blocks`` already hold the right KV (own prefix cache) and are not sent.
        The deadline covers the whole transfer, from now."""
        if not 0 <= num_cached_blocks <= len(block_ids):
            raise ValueError(f"num_cached_blocks={num_cached_blocks} outside [0, {len(block_ids)}]")
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        s = _Session(gen_request_id, tuple(block_ids), RecvState.RESERVED,
                     self._clock() + timeout_s, peer=ctx_worker_id)
        s.descriptor = TransferDescriptor(
            -1, 0, "", ctx_worker_id, self.worker_id, ctx_request_id, gen_request_id, (),
            s.block_ids[num_cached_blocks:], num_cached_blocks, self.layout)
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
            s.descriptor = TransferDescriptor(
                self._next_transfer_id, seq, group, d.ctx_worker_id, d.gen_worker_id,
                d.ctx_request_id, d.gen_request_id, (), d.gen_block_ids, d.num_cached_blocks,
                d.layout)
            self._next_transfer_id += 1
            remaining = max(s.deadline - self._clock(), 1e-3)
            return KVRequest.for_descriptor(s.descriptor, remaining)

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

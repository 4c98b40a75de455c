"""The request channel's frame codec: each frame is a msgpack array ``[FrameType, fields...]``
(a dataclass's fields in order, so the layout is the protocol version); decoding checks every
shape and type and raises ``ProtocolError`` naming the field."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterator

import msgpack

from pdserve.scheduler.kv_events import AllCleared, BlocksRemoved, BlocksStored, KVEvent
from pdserve.scheduler.request import ContextPhaseParams, LlmRequestType

from . import types as T
from .sampling import SamplingError, SamplingParams
from .types import (
    FINISH_REASONS,
    PROTOCOL_VERSION,
    Abort,
    ErrorKind,
    Frame,
    FrameType,
    Generate,
    Heartbeat,
    Hello,
    HelloAck,
    KvEvents,
    KvControl,
    KvPeers,
    KvSnapshot,
    KvSnapshotQuery,
    ProtocolError,
    Refused,
    StatusQuery,
    StatusReply,
    TransferTotals,
    Update,
    UpdateInfo,
    UpdateKind,
    WireRequest,
    TokenLogprobs,
    WireUpdate,
    WorkerEvent,
    WorkerStatus,
)

# ------------------------------------------------------------------ encoding (type -> list)


def _params(p: ContextPhaseParams | None) -> list | None:
    if p is None:
        return None
    return [p.ctx_request_id, list(p.first_gen_tokens), p.opaque_state, p.draft_tokens,
            p.prompt_token_ids, p.ctx_worker_id, p.num_blocks]


def _request(r: WireRequest) -> list:
    return [r.request_id, r.client_id, r.prompt, r.max_new_tokens, r.priority, int(r.type),
            [list(level) for level in r.agent_hierarchy] if r.agent_hierarchy is not None else None,
            _params(r.context_phase_params), r.sampling.to_wire(),
            r.deadline_s, list(r.forced_tokens), r.stream_kv, r.output_start,
            [list(c) for c in r.choice_tokens]]


def _info(i: UpdateInfo | None) -> list | None:
    if i is None:
        return None
    return [i.pauses, i.kv_transfer_bytes, i.kv_transfer_seconds, i.kv_transfer_blocks,
            i.cached_tokens]


def _update(u: WireUpdate) -> list:
    return [u.request_id, int(u.kind), u.new_token_ids, u.finish_reason,
            _params(u.context_phase_params), int(u.error), u.message, _info(u.info),
            _logprobs(u.logprobs), _logprobs(u.prompt_logprobs), u.index]


def _logprobs(entries: tuple[TokenLogprobs, ...] | None) -> list | None:
    if entries is None:
        return None
    return [[e.token_id, e.logprob, e.rank, [list(t) for t in e.top]] for e in entries]


def _logprobs_from(v: Any, what: str) -> tuple[TokenLogprobs, ...] | None:
    if v is None:
        return None
    _check(type(v) is list, f"{what}: expected a list or nil")
    out = []
    for e in v:
        _check(type(e) is list and len(e) == 4 and type(e[0]) is int and type(e[1]) is float
               and type(e[2]) is int and type(e[3]) is list
               and all(type(t) is list and len(t) == 2 and type(t[0]) is int and type(t[1]) is float
                       for t in e[3]), f"{what}: bad entry")
        out.append(TokenLogprobs(e[0], e[1], e[2], tuple((t[0], t[1]) for t in e[3])))
    return tuple(out)


def _status(s: WorkerStatus) -> dict[str, Any]:
    # A map, not a list: it travels twice a second, and a map stays readable in a packet dump.
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(WorkerStatus)}
    d["transfers"] = {f.name: getattr(s.transfers, f.name) for f in dataclasses.fields(TransferTotals)}
    d["events"] = [[getattr(e, f.name) for f in _EVENT_FIELDS] for e in s.events]
    return d


_EVENT_FIELDS = dataclasses.fields(WorkerEvent)


_STORED, _REMOVED, _CLEARED = 1, 2, 3


def _events(events: list[KVEvent]) -> list:
    out = []
    for e in events:
        t = type(e)
        if t is BlocksStored:
            out.append([_STORED, e.parent, list(e.keys)])
        elif t is BlocksRemoved:
            out.append([_REMOVED, list(e.keys)])
        elif t is AllCleared:
            out.append([_CLEARED])
        else:
            raise TypeError(f"not a KV event: {e!r:.200}")
    return out


def encode_frame(frame: Frame) -> bytes:
    """One frame as bytes (msgpack array: [FrameType, fields...])."""
    t = type(frame)
    if t is Update:
        body = [FrameType.UPDATE, *_update(frame.update)]
    elif t is Generate:
        body = [FrameType.GENERATE, *_request(frame.request)]
    elif t is Heartbeat:
        body = [FrameType.HEARTBEAT, _status(frame.status)]
    elif t is StatusReply:
        body = [FrameType.STATUS_REPLY, frame.query_id, _status(frame.status)]
    elif t is KvEvents:
        body = [FrameType.KV_EVENTS, frame.seq, _events(frame.events)]
    elif t is Abort:
        body = [FrameType.ABORT, frame.request_id]
    elif t is KvSnapshot:
        body = [FrameType.KV_SNAPSHOT, frame.seq, _events(frame.events)]
    elif t is KvSnapshotQuery:
        body = [FrameType.KV_SNAPSHOT_QUERY]
    elif t is KvPeers:
        body = [FrameType.KV_PEERS, dict(frame.peers)]
    elif t is KvControl:
        body = [FrameType.KV_CONTROL, frame.endpoint, bytes(frame.payload)]
    elif t is StatusQuery:
        body = [FrameType.STATUS_QUERY, frame.query_id]
    elif t is Hello:
        body = [FrameType.HELLO, frame.version, frame.token]
    elif t is HelloAck:
        body = [FrameType.HELLO_ACK, frame.version, frame.worker_id]
    elif t is Refused:
        body = [FrameType.REFUSED, frame.reason]
    else:
        raise TypeError(f"not a request-channel frame: {frame!r:.200}")
    return msgpack.packb(body, use_bin_type=True)


# ------------------------------------------------------------------ decoding (list -> type)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError(what)


def _int(v: Any, what: str) -> int:
    _check(type(v) is int, f"{what}: expected an integer, got {type(v).__name__}")
    return v


def _ints(v: Any, what: str) -> list[int]:
    _check(type(v) is list and all(type(x) is int for x in v), f"{what}: expected a list of integers")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    _check(v is None or type(v) is str, f"{what}: expected a string or nil")
    return v


def _num(v: Any, what: str) -> float:
    _check(type(v) in (int, float), f"{what}: expected a number, got {type(v).__name__}")
    return v


def _fields(body: list, n: int, what: str) -> list:
    _check(type(body) is list and len(body) == n, f"{what}: expected {n} fields, got "
           f"{len(body) if type(body) is list else type(body).__name__}")
    return body


def _params_from(v: Any) -> ContextPhaseParams | None:
    if v is None:
        return None
    f = _fields(v, 7, "context_phase_params")
    _check(f[2] is None or type(f[2]) is bytes, "context_phase_params.opaque_state: expected bytes")
    return ContextPhaseParams(
        _int(f[0], "context_phase_params.ctx_request_id"),
        _ints(f[1], "context_phase_params.first_gen_tokens"), f[2],
        None if f[3] is None else _ints(f[3], "context_phase_params.draft_tokens"),
        None if f[4] is None else _ints(f[4], "context_phase_params.prompt_token_ids"),
        _opt_str(f[5], "context_phase_params.ctx_worker_id"),
        _int(f[6], "context_phase_params.num_blocks"))


def _enum(cls: type[enum.IntEnum], v: Any, what: str):
    try:
        return cls(_int(v, what))
    except ValueError:
        raise ProtocolError(f"{what}: unknown {cls.__name__} {v}") from None


def _request_from(f: list) -> WireRequest:
    f = _fields(f, 14, "generate")
    hierarchy = f[6]
    if hierarchy is not None:
        _check(type(hierarchy) is list and all(
            type(h) is list and len(h) == 2 and type(h[0]) is str and type(h[1]) is int
            for h in hierarchy), "generate.agent_hierarchy: expected [[agent_type, node_id], ...]")
        hierarchy = [tuple(h) for h in hierarchy]
    try:
        sampling = SamplingParams.from_wire(f[8])
    except SamplingError as exc:
        raise ProtocolError(f"generate.sampling.{exc}") from None
    _check(f[9] is None or type(f[9]) in (int, float), "generate.deadline_s: expected a number or nil")
    _check(type(f[11]) is bool, "generate.stream_kv: expected a boolean")
    _check(f[12] is None or type(f[12]) is int, "generate.output_start: expected an integer or nil")
    _check(type(f[13]) is list, "generate.choice_tokens: expected a list")
    choice_tokens = tuple(tuple(_ints(c, "generate.choice_tokens")) for c in f[13])
    return WireRequest(_int(f[0], "generate.request_id"), _opt_str(f[1], "generate.client_id"),
                       _ints(f[2], "generate.prompt"), _int(f[3], "generate.max_new_tokens"),
                       _num(f[4], "generate.priority"),
                       _enum(LlmRequestType, f[5], "generate.type"), hierarchy,
                       _params_from(f[7]), sampling, f[9],
                       tuple(_ints(f[10], "generate.forced_tokens")), f[11], f[12], choice_tokens)


def _update_from(f: list) -> WireUpdate:
    f = _fields(f, 11, "update")
    kind = _enum(UpdateKind, f[1], "update.kind")
    info = None
    if f[7] is not None:
        i = _fields(f[7], 5, "update.info")
        _check(i[3] is None or type(i[3]) is int, "update.info.kv_transfer_blocks: expected an integer or nil")
        info = UpdateInfo(_int(i[0], "update.info.pauses"), _int(i[1], "update.info.kv_transfer_bytes"),
                          _num(i[2], "update.info.kv_transfer_seconds"), i[3],
                          _int(i[4], "update.info.cached_tokens"))
    reason = _opt_str(f[3], "update.finish_reason")
    _check((reason in FINISH_REASONS) == (kind in (UpdateKind.FINISHED, UpdateKind.CHOICE_DONE)),
           f"update.finish_reason {reason!r} does not fit kind {kind.name}")
    params = _params_from(f[4])
    _check((params is not None) == (kind in (UpdateKind.CONTEXT_DONE, UpdateKind.CONTEXT_STREAMING)),
           f"update.context_phase_params does not fit kind {kind.name}")
    error = _enum(ErrorKind, f[5], "update.error")
    _check((error != ErrorKind.NONE) == (kind == UpdateKind.FAILED),
           f"update.error {error.name} does not fit kind {kind.name}")
    return WireUpdate(_int(f[0], "update.request_id"), kind, _ints(f[2], "update.new_token_ids"),
                      reason, params, error, _opt_str(f[6], "update.message"), info,
                      _logprobs_from(f[8], "update.logprobs"),
                      _logprobs_from(f[9], "update.prompt_logprobs"), _int(f[10], "update.index"))


def _status_from(d: Any) -> WorkerStatus:
    _check(type(d) is dict, "status: expected a map")
    try:
        t = d["transfers"]
        _check(type(t) is dict, "status.transfers: expected a map")
        transfers = TransferTotals(**{f.name: t[f.name] for f in dataclasses.fields(TransferTotals)})
        events = []
        for e in d["events"]:
            _check(type(e) is list and len(e) == len(_EVENT_FIELDS), "status.events: bad event")
            events.append(WorkerEvent(*e))
        values = {f.name: d[f.name] for f in dataclasses.fields(WorkerStatus)}
    except KeyError as exc:
        raise ProtocolError(f"status: missing field {exc.args[0]!r}") from None
    values.update(transfers=transfers, events=events)
    for name in ("num_active", "queue_depth", "free_blocks", "total_blocks", "max_batch_size",
                 "tokens_per_block"):
        _int(values[name], f"status.{name}")
    _check(type(values["requests_by_state"]) is dict, "status.requests_by_state: expected a map")
    _check(_str_map(values["kv_pairs"]), "status.kv_pairs: expected a map of strings")
    _check(type(values["violations"]) is list, "status.violations: expected a list")
    return WorkerStatus(**values)


def _str_map(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str and type(x) is str for k, x in v.items())


def _keys(v: Any, what: str) -> tuple[bytes, ...]:
    _check(type(v) is list and all(type(k) is bytes for k in v), f"{what}: expected a list of keys")
    return tuple(v)


def _events_from(v: Any, what: str) -> list[KVEvent]:
    _check(type(v) is list, f"{what}: expected a list of events")
    out: list[KVEvent] = []
    for e in v:
        _check(type(e) is list and len(e) >= 1, f"{what}: an event must be a non-empty array")
        kind = e[0]
        if kind == _STORED and len(e) == 3:
            _check(e[1] is None or type(e[1]) is bytes, f"{what}: stored.parent: expected a key or nil")
            out.append(BlocksStored(e[1], _keys(e[2], f"{what}: stored.keys")))
        elif kind == _REMOVED and len(e) == 2:
            out.append(BlocksRemoved(_keys(e[1], f"{what}: removed.keys")))
        elif kind == _CLEARED and len(e) == 1:
            out.append(AllCleared())
        else:
            raise ProtocolError(f"{what}: unknown event {e!r:.100}")
    return out


def _decode(body: Any) -> Frame:
    _check(type(body) is list and len(body) >= 1, "a frame must be a non-empty array")
    kind = _enum(FrameType, body[0], "frame type")
    rest = body[1:]
    if kind == FrameType.UPDATE:
        return Update(_update_from(rest))
    if kind == FrameType.GENERATE:
        return Generate(_request_from(rest))
    if kind == FrameType.HEARTBEAT:
        return Heartbeat(_status_from(_fields(rest, 1, "heartbeat")[0]))
    if kind == FrameType.STATUS_REPLY:
        f = _fields(rest, 2, "status reply")
        return StatusReply(_int(f[0], "status reply.query_id"), _status_from(f[1]))
    if kind == FrameType.KV_EVENTS:
        f = _fields(rest, 2, "kv events")
        return KvEvents(_int(f[0], "kv events.seq"), _events_from(f[1], "kv events"))
    if kind == FrameType.KV_SNAPSHOT:
        f = _fields(rest, 2, "kv snapshot")
        return KvSnapshot(_int(f[0], "kv snapshot.seq"), _events_from(f[1], "kv snapshot"))
    if kind == FrameType.KV_PEERS:
        peers = _fields(rest, 1, "kv peers")[0]
        _check(_str_map(peers), "kv peers.peers: expected a map of strings")
        return KvPeers(peers)
    if kind == FrameType.KV_CONTROL:
        f = _fields(rest, 2, "kv control")
        _check(type(f[0]) is str, "kv control.endpoint: expected a string")
        _check(type(f[1]) is bytes, "kv control.payload: expected bytes")
        return KvControl(f[0], f[1])
    if kind == FrameType.KV_SNAPSHOT_QUERY:
        _fields(rest, 0, "kv snapshot query")
        return KvSnapshotQuery()
    if kind == FrameType.ABORT:
        return Abort(_int(_fields(rest, 1, "abort")[0], "abort.request_id"))
    if kind == FrameType.STATUS_QUERY:
        return StatusQuery(_int(_fields(rest, 1, "status query")[0], "status query.query_id"))
    if kind == FrameType.HELLO:
        f = _fields(rest, 2, "hello")
        _check(type(f[1]) is str, "hello.token: expected a string")
        return Hello(_int(f[0], "hello.version"), f[1])
    if kind == FrameType.HELLO_ACK:
        f = _fields(rest, 2, "hello ack")
        _check(type(f[1]) is str, "hello ack.worker_id: expected a string")
        return HelloAck(_int(f[0], "hello ack.version"), f[1])
    f = _fields(rest, 1, "refused")
    _check(type(f[0]) is str, "refused.reason: expected a string")
    return Refused(f[0])


def decode_frame(data: bytes) -> Frame:
    """One whole frame from bytes; raises ProtocolError."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"not a msgpack frame: {exc!r}") from None
    return _decode(body)


class FrameReader:
    """Splits a byte stream into frames: ``feed`` what arrived, then iterate. A partial frame
    waits for the rest; a frame over MAX_FRAME_BYTES or one that breaks the protocol raises
    ProtocolError (the stream cannot be trusted after that)."""

    def __init__(self) -> None:
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=T.MAX_FRAME_BYTES)

    def feed(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise ProtocolError(f"a frame over {T.MAX_FRAME_BYTES} bytes") from None

    def __iter__(self) -> Iterator[Frame]:
        while True:
            try:
                body = next(self._unpacker)
            except StopIteration:
                return
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
                    msgpack.BufferFull) as exc:
                raise ProtocolError(f"garbled stream: {exc!r}") from None
            yield _decode(body)


def check_hello(frame: Frame, token: str, compare=None) -> str | None:
    """The worker's check of the first frame: None to accept, else why it is refused.
    ``compare``: a constant-time string comparison (``secrets.compare_digest``)."""
    if not isinstance(frame, Hello):
        return f"the first frame must be a hello, got {type(frame).__name__}"
    if frame.version != PROTOCOL_VERSION:
        return (f"protocol version {frame.version} is not spoken here "
                f"(this worker speaks {PROTOCOL_VERSION})")
    same = compare(frame.token, token) if compare is not None else frame.token == token
    return None if same else "wrong token"

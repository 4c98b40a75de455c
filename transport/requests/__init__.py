"""The request channel's protocol: every type that crosses the socket between the router and a
worker, and the frame codec. PURE (stdlib + msgpack), so the router needs no torch.

The channel (``workers/process/channel_server.py`` serves it, ``cluster/worker_channel.py`` dials it)
is one TCP connection per router and worker, carrying msgpack arrays back to back. Each frame
is ``[FrameType, fields...]``; a type's fields are its dataclass fields in order, so the
positional layout is the version: adding, removing or reordering a field means bumping
``PROTOCOL_VERSION``. The first frame each way is the handshake:

  router -> worker  Hello(version, token)        a wrong token or an unknown version is Refused
  worker -> router  HelloAck(version, worker_id)  or Refused(reason), then the worker closes

then

  router -> worker  Generate(WireRequest) | Abort(request_id) | StatusQuery(query_id)
  worker -> router  Update(WireUpdate) | StatusReply(query_id, WorkerStatus) | Heartbeat(WorkerStatus)
                    | KvEvents(seq, events) | KvSnapshot(seq, events)
  router -> worker  KvSnapshotQuery()    (after connecting, and after a gap in the seqs)
  router -> worker  KvPeers(peers)       (generation workers: the context workers' KV
                                          endpoints, to set KV pairs up with before serving)

The direct KV control link (``transport/kv_link.py``) speaks the same framing between a
generation worker and a context worker: Hello(version, link token), then only

  generation -> context  KvControl(endpoint, payload)   a KV request or a cancel

An update says what happened with an explicit ``UpdateKind``: tokens (more to come), the
context phase done (its ``ContextPhaseParams`` lease the KV to a generation worker), finished
(stop or length), aborted, or failed with an ``ErrorKind``. A request the worker refuses is a
FAILED update with ``ErrorKind.REJECTED``: retrying it elsewhere cannot help.

Decoding checks shapes and types and raises ``ProtocolError`` naming what is wrong; a peer
that sends one is cut off (the stream cannot be trusted after it).
"""
from .codec import FrameReader, check_hello, decode_frame, encode_frame
from .sampling import SamplingError, SamplingLimits, SamplingParams
from .types import (
    FINISH_REASONS,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Abort,
    ErrorKind,
    Frame,
    FrameType,
    Generate,
    Heartbeat,
    Hello,
    HelloAck,
    KvControl,
    KvEvents,
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
    WorkerInfo,
    WorkerStatus,
)

__all__ = [
    "FINISH_REASONS", "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "Abort", "ErrorKind", "Frame",
    "FrameReader", "FrameType", "Generate", "Heartbeat", "Hello", "HelloAck", "KvControl", "KvEvents", "KvPeers",
    "KvSnapshot", "KvSnapshotQuery", "ProtocolError",
    "Refused", "SamplingError", "SamplingLimits", "SamplingParams", "StatusQuery", "StatusReply", "TransferTotals", "Update", "UpdateInfo",
    "UpdateKind", "WireRequest", "TokenLogprobs", "WireUpdate", "WorkerEvent", "WorkerInfo",
    "WorkerStatus", "check_hello", "decode_frame", "encode_frame",
]

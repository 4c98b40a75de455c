"""KV transfer protocol: descriptors, msgpack control messages and their codec, the wire header
and chunk planning. PURE (stdlib + msgpack). The per-side session state machines that decide a
transfer's fate are in ``sessions`` (shared base) and ``session_sides`` (``SenderSessions``,
``ReceiverSessions``); ``torch_dist`` only moves bytes and reports back.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import msgpack

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A control message or wire header is malformed (unknown type, missing or mistyped field)."""


class TransferRejected(Exception):
    """The context side refuses a KV request (unknown request, lease gone, layout mismatch)."""


# ---------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, slots=True)
class KVLayout:
    """A pool's layout, as the two sides of a transfer compare it: equal when whole blocks
    travel (``mismatch``); equal but for the local head count when a head slice does
    (``transfer_mismatch``)."""

    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", "float16"
    bytes_per_block: int  # one block id across all layers and planes
    kv_shape: tuple[int, int, int, int]  # (num_layers, tokens_per_block, num_kv_heads, head_dim)
    # Cache planes per layer: 2 (K and V) or 1 (MLA's compressed latent). Part of the layout,
    # not implied by the size: a latent pool and a K+V pool of half its width have the same
    # bytes per block, yet their rows mean different things.
    num_planes: int = 2

    def mismatch(self, other: KVLayout) -> str:
        """What differs from ``other``: "" when its blocks copy into ours byte for byte."""
        diffs = []
        if self.num_planes != other.num_planes:
            diffs.append(f"planes per layer {plane_names(self.num_planes)} vs "
                         f"{plane_names(other.num_planes)}")
        for name in ("dtype", "kv_shape", "bytes_per_block"):
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                diffs.append(f"{name} {ours} vs {theirs}")
        return "; ".join(diffs)


def plane_names(num_planes: int) -> str:
    return {1: "1 (MLA latent)", 2: "2 (K and V)"}.get(num_planes, str(num_planes))


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Tensor parallelism: the local KV heads of a transfer. Heads ``src_offset : src_offset +
    num_heads`` of the context pool travel into ``dst_offset : ...`` of the generation pool
    (a ``tp_map.KVMove``'s offsets and head count). ``num_heads`` 0: every head of both pools,
    which must then hold the same heads (the only transfer before tensor parallelism)."""

    src_offset: int = 0
    dst_offset: int = 0
    num_heads: int = 0

    def __post_init__(self) -> None:
        check_head_slice(self.src_offset, self.dst_offset, self.num_heads, ValueError)


def check_head_slice(src_offset: int, dst_offset: int, num_heads: int,
                     error: type[Exception]) -> None:
    if min(src_offset, dst_offset, num_heads) < 0:
        raise error(f"negative head slice ({src_offset}, {dst_offset}, {num_heads})")
    if num_heads == 0 and (src_offset or dst_offset):
        raise error("a head offset needs num_heads (0 means every head of both pools)")


WHOLE_POOLS = HeadSlice()  # the default: every head of two pools that hold the same heads


def check_tp(tp_size: int, rank: int, error: type[Exception]) -> None:
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise error(f"rank {rank} is outside tensor parallel size {tp_size}")


def covers_pool(offset: int, num_heads: int, pool_heads: int) -> bool:
    """Whether a side's slice is all of its pool's heads: its blocks then travel whole (the
    contiguous rows, and the copy-free path for consecutive ids)."""
    return num_heads == 0 or (offset == 0 and num_heads == pool_heads)


def transfer_mismatch(ctx: KVLayout, gen: KVLayout, heads: HeadSlice) -> str:
    """What stops the context pool ``ctx`` from sending ``heads`` into the generation pool
    ``gen``: "" when nothing. Whole pools (num_heads 0): the layouts must be equal, as before
    tensor parallelism. A slice: everything but the local head count must match (dtype,
    layers, tokens per block, head dim, planes), and the slice must lie inside both pools."""
    if heads.num_heads == 0:
        return ctx.mismatch(gen)
    diffs = []
    if ctx.num_planes != gen.num_planes:
        diffs.append(f"planes per layer {plane_names(ctx.num_planes)} vs "
                     f"{plane_names(gen.num_planes)}")
    if ctx.dtype != gen.dtype:
        diffs.append(f"dtype {ctx.dtype} vs {gen.dtype}")
    for name, i in (("num_layers", 0), ("tokens_per_block", 1), ("head_dim", 3)):
        if ctx.kv_shape[i] != gen.kv_shape[i]:
            diffs.append(f"{name} {ctx.kv_shape[i]} vs {gen.kv_shape[i]}")
    src_heads, dst_heads = ctx.kv_shape[2], gen.kv_shape[2]
    # the sizes must agree with the shapes: one head's bytes are what the slice counts by
    if not diffs and ctx.bytes_per_block * dst_heads != gen.bytes_per_block * src_heads:
        diffs.append(f"bytes_per_block {ctx.bytes_per_block} vs {gen.bytes_per_block} for "
                     f"{src_heads} vs {dst_heads} local KV heads")
    n, s, d = heads.num_heads, heads.src_offset, heads.dst_offset
    if s + n > src_heads or d + n > dst_heads:
        diffs.append(f"head slice [{s}, {s + n}) of the context pool's {src_heads} local KV heads "
                     f"-> [{d}, {d + n}) of the generation pool's {dst_heads} does not fit")
    return "; ".join(diffs)


def tp_mismatch(expected: tuple[int, int], actual: tuple[int, int]) -> str:
    """"" when the context rank is the one the generation side expects, else why not."""
    if tuple(expected) == tuple(actual):
        return ""
    return (f"tensor parallel mismatch: the generation side expects context tensor parallel size "
            f"{expected[0]} rank {expected[1]}, this context worker is size {actual[0]} rank "
            f"{actual[1]}")


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
    # Layer-wise: the context side sends each layer's planes as its forward writes them, then a
    # trailer with the first token (see WireTrailer); the prefill may still be running.
    stream: bool = False
    # Tensor parallelism (HeadSlice): the local KV heads that travel, and the context rank the
    # generation side expects. The defaults are a transfer between whole, equal pools.
    src_head_offset: int = 0
    dst_head_offset: int = 0
    num_heads: int = 0
    ctx_tp_size: int = 1
    ctx_rank: int = 0

    def __post_init__(self) -> None:
        if self.ctx_block_ids and len(self.ctx_block_ids) != len(self.gen_block_ids):
            raise ValueError("ctx and gen block lists of a transfer differ in length")
        if self.num_cached_blocks < 0 or self.seq < 0:
            raise ValueError("num_cached_blocks and seq must be >= 0")
        check_head_slice(self.src_head_offset, self.dst_head_offset, self.num_heads, ValueError)
        check_tp(self.ctx_tp_size, self.ctx_rank, ValueError)

    @property
    def num_blocks(self) -> int:
        return len(self.gen_block_ids)

    @property
    def heads(self) -> HeadSlice:
        return HeadSlice(self.src_head_offset, self.dst_head_offset, self.num_heads)

    @property
    def heads_moved(self) -> int:
        """How many local KV heads travel (``layout`` is this side's pool)."""
        return self.num_heads or self.layout.kv_shape[2]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block on the wire: the slice's heads, over all layers and planes (the
        whole block when every head travels). Both sides compute the same value."""
        return self.layout.bytes_per_block // self.layout.kv_shape[2] * self.heads_moved

    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block  # the bytes that travel (the slice's)


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
    stream: bool = False  # layer-wise: payload by layer, then a trailer (TransferDescriptor)
    num_planes: int = 2  # KVLayout.num_planes; a peer that predates the field has K and V
    # The head slice (HeadSlice; 0, 0, 0: whole pools) and the context rank expected to serve
    # it. A peer that predates these fields sends whole pools and expects a TP-1 context.
    src_head_offset: int = 0
    dst_head_offset: int = 0
    num_heads: int = 0
    ctx_tp_size: int = 1
    ctx_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_blocks != len(self.gen_block_ids):
            raise ProtocolError("num_blocks differs from len(gen_block_ids)")
        if min(self.num_blocks, self.num_cached_blocks, self.seq, self.bytes_per_block) < 0:
            raise ProtocolError("negative count in kv_request")
        if self.num_planes < 1:
            raise ProtocolError("kv_request num_planes must be >= 1")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ProtocolError("kv_request timeout_s must be positive and finite")
        check_head_slice(self.src_head_offset, self.dst_head_offset, self.num_heads,
                         ProtocolError)
        check_tp(self.ctx_tp_size, self.ctx_rank, ProtocolError)

    @classmethod
    def for_descriptor(cls, d: TransferDescriptor, timeout_s: float) -> KVRequest:
        return cls(
            d.transfer_id, d.seq, d.group, d.gen_worker_id, d.ctx_request_id, d.gen_request_id,
            d.num_blocks, d.num_cached_blocks, d.gen_block_ids, d.layout.dtype,
            d.layout.bytes_per_block, d.layout.kv_shape, timeout_s, d.stream, d.layout.num_planes,
            d.src_head_offset, d.dst_head_offset, d.num_heads, d.ctx_tp_size, d.ctx_rank,
        )

    @property
    def heads(self) -> HeadSlice:
        return HeadSlice(self.src_head_offset, self.dst_head_offset, self.num_heads)

    @property
    def layout(self) -> KVLayout:
        """The layout of the generation side's pool, as the request describes it."""
        return KVLayout(self.dtype, self.bytes_per_block, self.kv_shape, self.num_planes)


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
    # The op this answers: a generation side that re-issued the transfer on a newer group
    # ignores the answer of the old op. ("", -1) from a peer that predates these fields.
    group: str = ""
    seq: int = -1
    # The op never began and the context side kept the blocks leased: the generation side
    # may ask again (on a rebuilt group) within the deadline.
    retryable: bool = False


@dataclass(frozen=True, slots=True)
class PairOpen:
    """gen -> ctx: set up pair group ``group`` now, as its op 0 (a header of status OPEN and no
    payload), so that no transfer ever pays the rendezvous or a lazy communicator creation.
    Answered with a TransferDone(transfer_id=-1) for that group once the header is sent."""

    group: str
    gen_worker_id: str
    timeout_s: float
    # the context rank the generation side expects at the other end (refused if it is not)
    ctx_tp_size: int = 1
    ctx_rank: int = 0

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ProtocolError("pair_open timeout_s must be positive and finite")
        check_tp(self.ctx_tp_size, self.ctx_rank, ProtocolError)


@dataclass(frozen=True, slots=True)
class CancelTransfer:
    """gen -> ctx: the generation request is gone; do not send (or stop caring)."""

    transfer_id: int
    ctx_request_id: int
    gen_worker_id: str
    reason: str


Message = KVRequest | TransferDone | CancelTransfer | PairOpen
_INT, _STR, _FLOAT, _BOOL, _INTS, _SHAPE = "int", "str", "float", "bool", "ints", "shape"
_SCHEMAS: dict[str, tuple[type, dict[str, str]]] = {
    "kv_request": (KVRequest, {
        "transfer_id": _INT, "seq": _INT, "group": _STR, "gen_worker_id": _STR,
        "ctx_request_id": _INT, "gen_request_id": _INT, "num_blocks": _INT,
        "num_cached_blocks": _INT, "gen_block_ids": _INTS, "dtype": _STR,
        "bytes_per_block": _INT, "kv_shape": _SHAPE, "timeout_s": _FLOAT, "stream": _BOOL,
        "num_planes": _INT, "src_head_offset": _INT, "dst_head_offset": _INT, "num_heads": _INT,
        "ctx_tp_size": _INT, "ctx_rank": _INT,
    }),
    "done": (TransferDone, {
        "transfer_id": _INT, "ctx_request_id": _INT, "ok": _BOOL, "reason": _STR,
        "nbytes": _INT, "seconds": _FLOAT, "endpoint_gone": _BOOL, "group": _STR, "seq": _INT,
        "retryable": _BOOL,
    }),
    "pair_open": (PairOpen, {"group": _STR, "gen_worker_id": _STR, "timeout_s": _FLOAT,
                             "ctx_tp_size": _INT, "ctx_rank": _INT}),
    "cancel": (CancelTransfer, {
        "transfer_id": _INT, "ctx_request_id": _INT, "gen_worker_id": _STR, "reason": _STR,
    }),
}
_TYPE_OF = {cls: name for name, (cls, _) in _SCHEMAS.items()}
# Fields a message may leave out (added after version 1 shipped): their value when absent.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "kv_request": {"stream": False, "num_planes": 2, "src_head_offset": 0, "dst_head_offset": 0,
                   "num_heads": 0, "ctx_tp_size": 1, "ctx_rank": 0},
    "pair_open": {"ctx_tp_size": 1, "ctx_rank": 0},
    "done": {"endpoint_gone": False, "group": "", "seq": -1, "retryable": False}}


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
    OPEN = 3  # op 0 of a group set up by PairOpen: no payload, no transfer


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
TRAILER_MAGIC = 0x5044_4B54  # "PDKT"


class WireTrailer(NamedTuple):
    """Last message of a layer-wise op (int64[HEADER_LEN], after the payload): the context
    request's first token, which exists only once its prefill is over. CANCELLED when the context
    request ended instead (a stop token first, an abort, a failed step): the payload already
    sent is then garbage, and the generation side fails the transfer. An op whose header was
    not OK has no payload and no trailer."""

    seq: int
    status: int  # WireStatus.OK or WireStatus.CANCELLED
    first_token: int  # -1 unless OK

    def to_ints(self) -> list[int]:
        return [TRAILER_MAGIC, *self] + [0] * (HEADER_LEN - 1 - len(self))

    @classmethod
    def from_ints(cls, values: list[int]) -> WireTrailer:
        if len(values) != HEADER_LEN or values[0] != TRAILER_MAGIC:
            raise ProtocolError("bad wire trailer (desynchronised stream?)")
        trailer = cls(*values[1:1 + len(cls._fields)])
        if trailer.status not in (WireStatus.OK, WireStatus.CANCELLED):
            raise ProtocolError(f"bad trailer status {trailer.status}")
        if trailer.status == WireStatus.OK and trailer.first_token < 0:
            raise ProtocolError("trailer OK without a first token")
        return trailer


class Chunk(NamedTuple):
    """One payload message: planes [plane_start, plane_stop) (plane = layer * planes_per_layer
    + K/V, or just the layer for a 1-plane MLA pool) of the transfer's blocks
    [block_start, block_stop), laid out [planes, blocks, block bytes]."""

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


def layer_aligned(chunk_planes: int, planes_per_layer: int) -> int:
    """A layer-wise op's planes per chunk: at most one layer's, so each chunk can go as soon as
    its layer is written (a chunk of more planes spans all blocks: see choose_chunking)."""
    return min(chunk_planes, planes_per_layer)


def chunk_layer(c: Chunk, planes_per_layer: int) -> int:
    """The last layer whose planes chunk ``c`` carries: it may be sent once that layer is
    written."""
    return (c.plane_stop - 1) // planes_per_layer


class LayerArrivals:
    """The generation side's count of a payload's chunks as their receives complete, in any
    order. A chunk that is not in the plan, or that arrives twice, is a protocol error (the op's
    stream is out of step); ``complete`` only when every chunk of every layer has landed, and
    ``layers_landed`` is how many leading layers have."""

    def __init__(self, chunks: list[Chunk], num_layers: int, planes_per_layer: int) -> None:
        self._chunks = chunks
        self._landed = [False] * len(chunks)
        self._left = len(chunks)
        self._planes_per_layer = planes_per_layer
        # per layer: chunks still to come that carry (some of) its planes
        self._per_layer = [0] * num_layers
        for c in chunks:
            for layer in self._layers(c):
                self._per_layer[layer] += 1

    def _layers(self, c: Chunk) -> range:
        return range(c.plane_start // self._planes_per_layer,
                     chunk_layer(c, self._planes_per_layer) + 1)

    def arrive(self, index: int) -> None:
        if not 0 <= index < len(self._chunks):
            raise ProtocolError(f"chunk {index} is not in the payload's plan of {len(self._chunks)}")
        if self._landed[index]:
            raise ProtocolError(f"chunk {index} arrived twice")
        self._landed[index] = True
        self._left -= 1
        for layer in self._layers(self._chunks[index]):
            self._per_layer[layer] -= 1

    @property
    def complete(self) -> bool:
        return self._left == 0

    @property
    def layers_landed(self) -> int:
        n = 0
        for left in self._per_layer:
            if left:
                break
            n += 1
        return n


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

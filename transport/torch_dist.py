"""torch.distributed data plane of the KV transfer: one process group per (context worker,
generation worker) pair and one dedicated thread per pair on each side.

Every decision (leases, deadlines, quarantine, what to send) is ``protocol``'s; this module moves
bytes and reports back. Pair protocol, per op ``seq`` of a group (both sides run ops in seq order):
  ctx -> gen  header int64[HEADER_LEN] (tag seq/0), always, even for a refused or cancelled op
  ctx -> gen  payload chunk i (tag seq/i+1): raw bytes [planes, blocks, block bytes] of one
              rectangle of (layer, K/V) planes x transfer blocks (``protocol.plan_chunks``)
Chunks are pipelined: the gather (ctx) or scatter (gen) of one chunk through a ring of reused
staging buffers overlaps the send/recv of its neighbours (torch ops and gloo I/O release the
GIL). A single-plane chunk whose block ids are consecutive on a side is a contiguous slice of that
side's pool and is sent from / received into the pool without a copy.

Failure rule: any exception or timeout on a pair poisons its group on that side; the group is
aborted (the peer's pending ops then fail at once with "connection closed") and the generation
side rebuilds under a new epoch (fresh store prefix) on the next request. Other pairs have their
own groups and threads, so one dead peer touches nobody else.

Restarts: a context worker advertises a ``locator`` ("host:port#incarnation"), unique per
process. When a generation worker sees a new locator for a context worker, or is told that a
locator is gone, every op for the old one fails at once (no rendezvous with a store that no
longer exists), and requests still carrying it are refused before they touch the pair.
"""
from __future__ import annotations

import datetime
import math
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # transport sits below workers: the pool is only a type here
    from ..workers.kv_pool import KVPool
from .protocol import (
    HEADER_LEN, CancelTransfer, Chunk, KVLayout, KVRequest, ProtocolError, ReceiverSessions,
    SenderSessions, TransferDescriptor, TransferDone, TransferRejected, TransferResult,
    WireHeader, WireStatus, choose_chunking, consecutive_fraction, decode_message,
    encode_message, group_name, group_order, plan_chunks, wire_tag,
)

SendHook = Callable[[TransferDescriptor, int], None]  # (descriptor, chunk index), sender thread
RUNS_THRESHOLD = 0.9  # a side's ids this consecutive: single-plane chunks (copy-free runs)
STORE_CONNECT_POLL_S = 0.2  # how often a store connect in progress checks its endpoint (_connect_store)
MAX_OUTSTANDING = 16  # posted chunk sends/recvs per op (staged ones are also bounded by staging)
MAX_GONE_ENDPOINTS = 1024  # context endpoints remembered as gone (restarts are rare)
INCARNATION_KEY = "pdserve/incarnation"  # set in a context worker's store: whose store it is
CTX_RANK, GEN_RANK = 0, 1


@dataclass(frozen=True, slots=True)
class TransportConfig:
    host: str = "127.0.0.1"
    port: int = 0  # context side's TCPStore port; 0 picks a free one
    connect_timeout_s: float = 10.0  # store connect and pair-group rendezvous
    default_timeout_s: float = 30.0  # lease (ctx) / transfer deadline (gen) when none is given
    chunk_bytes: int = 4 << 20  # target payload chunk when blocks are gathered
    num_staging: int = 3  # staging buffers per pair thread (pipeline depth)


def layout_of(pool: KVPool) -> KVLayout:
    return KVLayout(str(pool.dtype).removeprefix("torch."), pool.bytes_per_block,
                    (pool.num_layers, pool.tokens_per_block, pool.num_kv_heads, pool.head_dim))


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-3))


class _Deadline:
    """A real-time (monotonic) deadline for the waits of one op."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() >= self.at

    def left(self, what: str) -> datetime.timedelta:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"deadline passed before {what}")
        # c10d takes whole milliseconds, rounded down: ask for one more, so that a wait that
        # runs out (gloo raises rather than returning False) means the deadline has passed
        return datetime.timedelta(milliseconds=math.ceil(left * 1000) + 1)

    def wait(self, work: dist.Work, what: str) -> None:
        if not work.wait(self.left(what)):
            raise TimeoutError(f"{what} did not complete in time")


class _Group:
    """One pair process group (2 ranks) on a PrefixStore, never the global default group."""

    def __init__(self, store: dist.Store, name: str, rank: int, device: torch.device,
                 timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.peer = 1 - rank
        prefixed = dist.PrefixStore(name, store)
        if device.type == "cuda":  # both sides hold CUDA tensors: NCCL (not on CPU builds)
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no ProcessGroupNCCL")
            opts = nccl.Options()
            opts._timeout = _td(timeout_s)
            self.pg = nccl(prefixed, rank, 2, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, _td(timeout_s))

    def send(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self.pg.send([t], self.peer, tag)

    def recv(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self.pg.recv([t], self.peer, tag)

    def destroy(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - teardown of a broken group must not raise
            pass


class _Staging:
    """A ring of flat byte buffers reused across transfers. After a failed op the ring is
    dropped (a pending gloo op of the aborted group may still reference it)."""

    def __init__(self, depth: int, device: torch.device) -> None:
        self.depth, self.device = depth, device
        self.bufs: list[torch.Tensor] = []

    def get(self, nbytes: int) -> list[torch.Tensor]:
        if not self.bufs or self.bufs[0].numel() < nbytes:
            # zero-filled so the pages are touched once here, not inside the timed path
            self.bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                         for _ in range(self.depth)]
        return self.bufs

    def drop(self) -> None:
        self.bufs = []


class _Mover:
    """Moves one transfer's chunks between the pool and the wire. The pool is viewed as rows
    [2 * layers * num_blocks, block_numel] (row p * num_blocks + b = block b of plane p), so a
    single-plane chunk over consecutive block ids is one contiguous slice: it is sent from (or
    received into) the pool itself. Other chunks go through a staging buffer."""

    def __init__(self, pool: KVPool, block_ids: tuple[int, ...], chunk_planes: int,
                 chunk_blocks: int) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= pool.num_blocks):
            raise IndexError(f"block id out of range [0, {pool.num_blocks})")
        self.nb = pool.num_blocks
        self.num_planes = 2 * pool.num_layers
        self.rows = pool.kv.view(self.num_planes * self.nb, -1)  # [planes * blocks, block_numel]
        self.row_bytes = pool.bytes_per_block // self.num_planes
        self.ids = block_ids
        self.ids_t = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
        self.chunks = plan_chunks(self.num_planes, len(block_ids), chunk_planes, chunk_blocks)
        self.staging_bytes = max((c.num_rows for c in self.chunks), default=0) * self.row_bytes
        run = [1] * len(block_ids)  # run[i]: consecutive ids starting at position i
        for i in range(len(block_ids) - 2, -1, -1):
            if block_ids[i + 1] == block_ids[i] + 1:
                run[i] = run[i + 1] + 1
        self.run = run

    def nbytes(self, c: Chunk) -> int:
        return c.num_rows * self.row_bytes

    def direct(self, c: Chunk) -> torch.Tensor | None:
        """The chunk's bytes inside the pool when they are contiguous there, else None."""
        n = c.block_stop - c.block_start
        if c.plane_stop - c.plane_start != 1 or self.run[c.block_start] < n:
            return None
        first = c.plane_start * self.nb + self.ids[c.block_start]
        return self.rows[first:first + n].view(-1).view(torch.uint8)

    def _index(self, c: Chunk) -> torch.Tensor:
        planes = torch.arange(c.plane_start, c.plane_stop, device=self.ids_t.device)
        return (planes[:, None] * self.nb + self.ids_t[None, c.block_start:c.block_stop]).view(-1)

    def _as_rows(self, buf: torch.Tensor, c: Chunk) -> torch.Tensor:
        return buf[: self.nbytes(c)].view(self.rows.dtype).view(c.num_rows, -1)

    def gather(self, c: Chunk, buf: torch.Tensor) -> torch.Tensor:
        torch.index_select(self.rows, 0, self._index(c), out=self._as_rows(buf, c))
        return buf[: self.nbytes(c)]

    def scatter(self, c: Chunk, buf: torch.Tensor) -> None:
        self.rows.index_copy_(0, self._index(c), self._as_rows(buf, c))


def _header_tensor(device: torch.device, values: list[int] | None = None) -> torch.Tensor:
    if values is None:
        return torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _incarnation(endpoint: str) -> int:
    """The incarnation in a locator "host:port#incarnation" (0 for a bare "host:port")."""
    _, _, inc = endpoint.partition("#")
    return int(inc) if inc.isdigit() else 0


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# ---------------------------------------------------------------------------- context side


@dataclass(slots=True)
class _SendOp:
    request: KVRequest
    descriptor: TransferDescriptor | None  # None: refused, the op sends a header only
    reason: str  # why refused; "" when claimed
    deadline: _Deadline
    future: Future = field(default_factory=Future)


class _SenderPair:
    """Context side of one pair. Serves only the newest group the generation side uses, its ops
    in seq order; an op that waits past its deadline for a missing predecessor poisons the group
    (the generation side is then stuck on that seq too and rebuilds)."""

    def __init__(self, owner: KVSender, gen_worker_id: str) -> None:
        self.owner = owner
        self.gen_worker_id = gen_worker_id
        self.cond = threading.Condition()
        self.pending: dict[str, dict[int, _SendOp]] = {}
        self.current: str | None = None
        self.next_seq = 0
        self.retired: set[str] = set()
        self.stopping = False
        self.group: _Group | None = None  # touched by the pair thread only
        self.staging = _Staging(owner.config.num_staging, owner.pool.device)
        self._doomed: list[tuple[_SendOp, str]] = []
        self.thread = threading.Thread(target=self._run, name=f"pdserve-kv-send-{gen_worker_id}",
                                       daemon=True)
        self.thread.start()

    def enqueue(self, op: _SendOp) -> None:
        g, seq = op.request.group, op.request.seq
        with self.cond:
            if self.stopping:
                reason = "transport closed"
            elif g in self.retired or (self.current is not None
                                       and group_order(g) < group_order(self.current)):
                reason = f"pair group {g} was retired"
            elif seq in self.pending.get(g, {}) or (g == self.current and seq < self.next_seq):
                reason = f"duplicate seq {seq} on pair group {g}"
            else:
                self.pending.setdefault(g, {})[seq] = op
                self.cond.notify()
                return
        self.owner._abandon(op, reason)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    # ------------------------------------------------------------ pair thread

    def _run(self) -> None:
        while True:
            with self.cond:
                op = self._next_locked()
                doomed, self._doomed = self._doomed, []
            for d_op, reason in doomed:
                self.owner._abandon(d_op, reason)
            if self.group is not None and self.group.name in self.retired:
                self._drop_group()  # the peer's pending ops on it fail now, not at a deadline
            if op is None:
                if self.stopping:
                    self._drop_group()
                    return
                continue
            self._execute(op)

    def _next_locked(self) -> _SendOp | None:
        """The op to run next, or None when there is something to do outside the lock first."""
        while True:
            if self.stopping:
                for g in list(self.pending):
                    self._retire_locked(g, "transport closed")
                return None
            newer = [g for g in self.pending if g != self.current]
            if newer:
                newest = max(newer, key=group_order)
                if self.current is None or group_order(newest) > group_order(self.current):
                    for g in [self.current, *newer]:
                        if g is not None and g != newest:
                            self._retire_locked(g, "superseded by a newer pair group")
                    self.current, self.next_seq = newest, 0
            ops = self.pending.get(self.current, {}) if self.current is not None else {}
            op = ops.pop(self.next_seq, None)
            if op is not None:
                return op
            if self._doomed:
                return None
            if ops:  # later ops wait for a seq that has not arrived
                wait_s = min(o.deadline.at for o in ops.values()) - time.monotonic()
                if wait_s <= 0:
                    assert self.current is not None
                    self._retire_locked(self.current, f"seq {self.next_seq} never arrived")
                    return None
                self.cond.wait(wait_s)
            else:
                self.cond.wait()

    def _retire_locked(self, g: str, reason: str) -> None:
        self.retired.add(g)
        self._doomed.extend((op, reason) for op in self.pending.pop(g, {}).values())

    def _poison(self, reason: str) -> None:
        with self.cond:
            if self.current is not None:
                self._retire_locked(self.current, f"pair group poisoned: {reason}")
            doomed, self._doomed = self._doomed, []
        self._drop_group()
        for op, why in doomed:
            self.owner._abandon(op, why)

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.staging.drop()

    def _ensure_group(self, name: str, deadline: _Deadline) -> _Group:
        if self.group is not None and self.group.name == name:
            return self.group
        self._drop_group()
        left = min(self.owner.config.connect_timeout_s, deadline.left("rendezvous").total_seconds())
        self.group = _Group(self.owner._store, name, CTX_RANK, self.owner.pool.device, left)
        return self.group

    def _execute(self, op: _SendOp) -> None:
        req, d, sessions, pool = op.request, op.descriptor, self.owner.sessions, self.owner.pool
        proceed, t0 = False, time.perf_counter()
        try:
            group = self._ensure_group(req.group, op.deadline)
            proceed = d is not None and sessions.begin_op(d.ctx_request_id)
            if proceed:
                assert d is not None
                status, reason = WireStatus.OK, ""
                runs = max(consecutive_fraction(d.ctx_block_ids),
                           consecutive_fraction(d.gen_block_ids)) >= RUNS_THRESHOLD
                planes, blocks = choose_chunking(2 * pool.num_layers, d.num_blocks,
                                                 pool.bytes_per_block // (2 * pool.num_layers),
                                                 self.owner.config.chunk_bytes, runs=runs)
            else:
                status = WireStatus.REJECTED if d is None else WireStatus.CANCELLED
                reason = op.reason or "cancelled or past its deadline before the send"
                planes = blocks = 0
            nblocks = d.num_blocks if proceed and d is not None else 0
            header = WireHeader(req.seq, int(status), req.transfer_id, req.ctx_request_id,
                                nblocks, pool.bytes_per_block, planes, blocks)
            t0 = time.perf_counter()
            hdr = _header_tensor(pool.device, header.to_ints())
            hdr_work = group.send(hdr, wire_tag(req.seq, 0))  # payload follows without waiting
            if proceed:
                assert d is not None
                self._send_payload(group, d, _Mover(pool, d.ctx_block_ids, planes, blocks),
                                   op.deadline)
            op.deadline.wait(hdr_work, "header send")
        except Exception as exc:  # noqa: BLE001 - every failure poisons the pair group
            why = _why(exc)
            if proceed and d is not None:
                sessions.op_finished(d.ctx_request_id, ok=False, nbytes=0,
                                     seconds=time.perf_counter() - t0, reason=why)
            self._poison(why)
            self.owner._abandon(op, why, fail_session=not proceed)
            return
        seconds = time.perf_counter() - t0
        nbytes = d.total_bytes if proceed and d is not None else 0
        with self.cond:
            self.next_seq += 1
        if proceed and d is not None:
            sessions.op_finished(d.ctx_request_id, ok=True, nbytes=nbytes, seconds=seconds)
        op.future.set_result(TransferDone(req.transfer_id, req.ctx_request_id, proceed, reason,
                                          nbytes, seconds))

    def _send_payload(self, group: _Group, d: TransferDescriptor, mover: _Mover,
                      deadline: _Deadline) -> None:
        """Gather the next chunk (pool -> staging) while earlier ones are on the wire; chunks
        contiguous in the pool are sent from it directly. A staging buffer is reused only after
        its send completed."""
        hook = self.owner.send_hook
        bufs = self.staging.get(mover.staging_bytes)
        free = deque(range(len(bufs)))
        pending: deque[tuple[dist.Work, int | None]] = deque()

        def retire_oldest() -> None:
            work, slot = pending.popleft()
            deadline.wait(work, "chunk send")
            if slot is not None:
                free.append(slot)

        for i, c in enumerate(mover.chunks):
            src, slot = mover.direct(c), None
            if src is None:
                while not free:
                    retire_oldest()
                slot = free.popleft()
                src = mover.gather(c, bufs[slot])
            while len(pending) >= MAX_OUTSTANDING:
                retire_oldest()
            if hook is not None:
                hook(d, i)
            pending.append((group.send(src, wire_tag(d.seq, i + 1)), slot))
        while pending:
            retire_oldest()


class KVSender:
    """Context worker's end of the KV transfer. Owns the TCPStore that the pair groups rendezvous
    on (its address is ``endpoint``, advertised in the context-phase params) and one thread per
    generation worker that asked for blocks.

    Executor calls: ``hold`` when a context-only request finishes (state
    DISAGG_CONTEXT_TRANS_IN_PROGRESS), ``poll`` each step (SENT -> DISAGG_CONTEXT_COMPLETE, any
    other final state -> DISAGG_TRANS_ERROR; the result's blocks may be freed), ``cancel`` on
    abort. Control plane (Ray method in the transfer concurrency group): ``handle(bytes)``.
    """

    def __init__(self, worker_id: str, pool: KVPool, *, config: TransportConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 send_hook: SendHook | None = None) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.config = config or TransportConfig()
        self.layout = layout_of(pool)
        self.send_hook = send_hook  # test hook: runs before each chunk is sent (stall, fail, ...)
        self.sessions = SenderSessions(worker_id, self.layout, clock=clock,
                                       lease_s=self.config.default_timeout_s)
        self._store = dist.TCPStore(self.config.host, self.config.port, None, True,
                                    _td(self.config.connect_timeout_s), wait_for_workers=False)
        self.endpoint = f"{self.config.host}:{self._store.port}"
        # A restarted worker may get the same port: the incarnation tells the two apart (and
        # orders them: a later process has a larger one).
        self.incarnation = time.time_ns()
        self.locator = f"{self.endpoint}#{self.incarnation}"
        self._store.set(INCARNATION_KEY, str(self.incarnation))
        self._pairs: dict[str, _SenderPair] = {}
        self._lock = threading.Lock()
        self._closed = False

    def hold(self, ctx_request_id: int, block_ids: list[int] | tuple[int, ...], *,
             lease_s: float | None = None) -> None:
        """Lease a finished context request's blocks until a KV request claims them."""
        self.sessions.lease(ctx_request_id, block_ids, lease_s=lease_s)

    def submit(self, request: KVRequest) -> Future:
        """Queue the send a KV request asks for; the future resolves to a TransferDone when the
        bytes are on the wire (or the op failed). A refused request still sends a header."""
        op_deadline = _Deadline(request.timeout_s)
        try:
            group_order(request.group)
        except ProtocolError as exc:
            op = _SendOp(request, None, str(exc), op_deadline)
            self._abandon(op, str(exc))
            return op.future
        try:
            op = _SendOp(request, self.sessions.claim(request), "", op_deadline)
        except TransferRejected as exc:
            op = _SendOp(request, None, str(exc), op_deadline)
        self._pair(request.gen_worker_id).enqueue(op)
        return op.future

    def cancel(self, ctx_request_id: int, reason: str = "cancelled", *,
               transfer_id: int | None = None, gen_worker_id: str | None = None) -> bool:
        """Cancel a lease or a claimed send. With transfer_id/gen_worker_id given (a cancel from
        a generation worker) a session claimed by another transfer is left alone."""
        d = self.sessions.descriptor(ctx_request_id)
        if d is not None and (
            (transfer_id is not None and d.transfer_id != transfer_id)
            or (gen_worker_id is not None and d.gen_worker_id != gen_worker_id)
        ):
            return False
        return self.sessions.cancel(ctx_request_id, reason)

    def handle(self, payload: bytes) -> bytes | None:
        """A control message from a generation worker: a KV request (answered with an encoded
        TransferDone once the send is over) or a cancel (no answer)."""
        msg = decode_message(payload)
        if isinstance(msg, CancelTransfer):
            self.cancel(msg.ctx_request_id, msg.reason, transfer_id=msg.transfer_id,
                        gen_worker_id=msg.gen_worker_id)
            return None
        if not isinstance(msg, KVRequest):
            raise ProtocolError(f"a context worker does not take {type(msg).__name__}")
        future = self.submit(msg)
        try:  # the pair thread's waits are bounded; this margin covers the rendezvous
            done = future.result(timeout=msg.timeout_s + self.config.connect_timeout_s + 5.0)
        except TimeoutError:
            done = TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                "pair thread did not answer in time", 0, 0.0)
        return encode_message(done)

    def poll(self) -> list[TransferResult]:
        return self.sessions.poll()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
        for p in pairs:
            p.stop()
        for p in pairs:
            p.thread.join(timeout_s)

    def _pair(self, gen_worker_id: str) -> _SenderPair:
        with self._lock:
            pair = self._pairs.get(gen_worker_id)
            if pair is None:
                pair = self._pairs[gen_worker_id] = _SenderPair(self, gen_worker_id)
                if self._closed:
                    pair.stop()
            return pair

    def _abandon(self, op: _SendOp, reason: str, *, fail_session: bool = True) -> None:
        """An op that will not (or did not) send its payload: fail its session, answer."""
        if fail_session and op.descriptor is not None:
            self.sessions.fail(op.descriptor.ctx_request_id, reason)
        if not op.future.done():
            op.future.set_result(TransferDone(op.request.transfer_id, op.request.ctx_request_id,
                                              False, reason, 0, 0.0))


# ---------------------------------------------------------------------------- generation side


@dataclass(slots=True)
class _RecvOp:
    gen_request_id: int
    descriptor: TransferDescriptor
    deadline: _Deadline


class _ReceiverPair:
    """Generation side of one pair: receives in the order ``issue`` was called (= seq order).
    After a failure the group is poisoned: epoch + 1, seq from 0, queued ops fail."""

    def __init__(self, owner: KVReceiver, ctx_worker_id: str, endpoint: str) -> None:
        self.owner = owner
        self.ctx_worker_id = ctx_worker_id
        self.cond = threading.Condition()
        self.queue: deque[_RecvOp] = deque()
        self.endpoint = endpoint
        self.epoch = 0
        self.next_seq = 0
        self.stopping = False
        self.store: dist.TCPStore | None = None  # the pair thread's; reconnected on reset
        self.store_endpoint = ""
        self.group: _Group | None = None
        self.staging = _Staging(owner.config.num_staging, owner.pool.device)
        self.thread = threading.Thread(target=self._run, name=f"pdserve-kv-recv-{ctx_worker_id}",
                                       daemon=True)
        self.thread.start()

    @property
    def group_name(self) -> str:
        return group_name(self.ctx_worker_id, self.owner.worker_id, self.owner.incarnation,
                          self.epoch)

    def set_endpoint(self, endpoint: str) -> None:
        """A restarted context worker has a new store address: later ops use a new group, and
        the old address is gone for good (one store per context process). An endpoint of an
        older incarnation than the current one is the one that is gone: the pair stays."""
        with self.cond:
            if endpoint == self.endpoint:
                return
            if _incarnation(endpoint) < _incarnation(self.endpoint):
                stale = endpoint
                doomed = []
            else:
                stale, self.endpoint = self.endpoint, endpoint
                doomed = self._reset_locked()
        self.owner.mark_gone(stale, _notify_pair=False)
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, "context worker moved to a new endpoint")

    def endpoint_gone(self, endpoint: str) -> None:
        """Fail every queued op: they all target ``endpoint``, which no longer exists."""
        with self.cond:
            if endpoint != self.endpoint:
                return
            doomed = self._reset_locked()
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, f"context worker endpoint {endpoint} is gone")

    def issue(self, gen_request_id: int) -> KVRequest:
        with self.cond:
            if self.stopping:
                raise RuntimeError("transport closed")
            msg = self.owner.sessions.request(gen_request_id, group=self.group_name,
                                              seq=self.next_seq)
            self.next_seq += 1
            d = self.owner.sessions.descriptor(gen_request_id)
            assert d is not None
            self.queue.append(_RecvOp(gen_request_id, d, _Deadline(msg.timeout_s)))
            self.cond.notify()
            return msg

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _reset_locked(self) -> list[_RecvOp]:
        self.epoch += 1
        self.next_seq = 0
        doomed = list(self.queue)
        self.queue.clear()
        return doomed

    # ------------------------------------------------------------ pair thread

    def _run(self) -> None:
        sessions = self.owner.sessions
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    doomed = list(self.queue)
                    self.queue.clear()
                else:
                    doomed = []
                    op = self.queue.popleft()
                    current, endpoint = self.group_name, self.endpoint
            for d_op in doomed:
                sessions.fail(d_op.gen_request_id, "transport closed")
            if self.stopping:
                self._drop_group(store_too=True)
                return
            if op.descriptor.group != current:
                sessions.fail(op.gen_request_id, "pair group was reset before this transfer began")
                continue
            if self.owner.is_gone(endpoint):  # no rendezvous with a store that is gone
                sessions.fail(op.gen_request_id, f"context worker endpoint {endpoint} is gone")
                self._drop_group(store_too=True)
                continue
            self._execute(op, endpoint)

    def _poison(self, reason: str, group: str) -> None:
        """The op on ``group`` failed. The ops queued behind it are doomed only if that group
        is still current: after a reset (new endpoint) they belong to a newer group."""
        with self.cond:
            doomed = self._reset_locked() if group == self.group_name else []
        self._drop_group(store_too=True)
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, f"pair group poisoned: {reason}")

    def _drop_group(self, *, store_too: bool) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.staging.drop()
        if store_too:
            self.store = None

    def _ensure_group(self, name: str, endpoint: str, deadline: _Deadline) -> _Group:
        if self.group is not None and self.group.name == name:
            return self.group
        self._drop_group(store_too=endpoint != self.store_endpoint)
        left = min(self.owner.config.connect_timeout_s, deadline.left("rendezvous").total_seconds())
        if self.store is None:
            host, port = endpoint.split("#", 1)[0].rsplit(":", 1)
            self._probe(endpoint, host, int(port), left)
            store = self._connect_store(endpoint, host, int(port), left)
            if _incarnation(endpoint) and not (store.check([INCARNATION_KEY]) and int(
                    store.get(INCARNATION_KEY)) == _incarnation(endpoint)):
                # another process listens on the port now: the one we want is gone
                self.owner.mark_gone(endpoint)
                raise RuntimeError(f"context endpoint {endpoint} is gone (its port was reused)")
            self.store, self.store_endpoint = store, endpoint
        self.group = _Group(self.store, name, GEN_RANK, self.owner.pool.device, left)
        return self.group

    def _connect_store(self, endpoint: str, host: str, port: int, timeout_s: float) -> dist.TCPStore:
        """The context worker's store, connected on a helper thread that this one watches.

        c10d's client bounds its connect but not its validation read: a port that another kind
        of server took over after the context process died accepts the connection and never
        answers, and the constructor blocks until that server closes it (forever for a mute
        one; measured: > 120 s with a 1 s timeout). So this thread waits for the helper in
        slices and gives up at the deadline, or as soon as ``endpoint`` is gone or replaced
        (the restarted worker's first request arrived): a stale op must not hold the pair
        thread while the new incarnation waits for it to join a group. An abandoned helper ends
        when the far side closes its socket; what it connected, if anything, is dropped."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def connect() -> None:
            try:
                outcome["store"] = dist.TCPStore(host, port, None, False, _td(timeout_s))
            except BaseException as exc:  # noqa: BLE001 - handed to the pair thread
                outcome["error"] = exc
            finally:
                done.set()

        threading.Thread(target=connect, name=f"pdserve-kv-store-{self.ctx_worker_id}", daemon=True).start()
        end = time.monotonic() + timeout_s
        while not done.wait(STORE_CONNECT_POLL_S):
            with self.cond:
                replaced = self.endpoint != endpoint
            if replaced or self.owner.is_gone(endpoint):
                raise RuntimeError(f"context endpoint {endpoint} was replaced while connecting to its store")
            if time.monotonic() >= end:
                raise TimeoutError(f"the store at {endpoint} did not answer within {timeout_s:.1f} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["store"]

    def _probe(self, endpoint: str, host: str, port: int, timeout_s: float) -> None:
        """A refused connection means no store listens there any more (its process is gone):
        fail now and remember it, instead of retrying the connect until the timeout."""
        try:
            socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
        except ConnectionRefusedError:
            self.owner.mark_gone(endpoint)
            raise RuntimeError(f"context endpoint {endpoint} refused the connection: gone") from None
        except OSError:  # slow or unreachable: not proof; the store connect has its own timeout
            pass

    def _execute(self, op: _RecvOp, endpoint: str) -> None:
        d, sessions, rid = op.descriptor, self.owner.sessions, op.gen_request_id
        proceed, t0 = False, time.perf_counter()
        try:
            group = self._ensure_group(d.group, endpoint, op.deadline)
            hdr = _header_tensor(self.owner.pool.device)
            op.deadline.wait(group.recv(hdr, wire_tag(d.seq, 0)), "header recv")
            header = WireHeader.from_ints(hdr.tolist())
            self._check(header, d)
            if header.status != WireStatus.OK:
                sessions.fail(rid, f"context side answered {WireStatus(header.status).name}")
                return
            # blocks are written only from here on; a session cancelled meanwhile drains the
            # payload into staging so the op stream stays paired
            proceed = sessions.begin_op(rid)
            t0 = time.perf_counter()
            mover = _Mover(self.owner.pool, d.gen_block_ids, header.chunk_planes,
                           header.chunk_blocks)
            self._recv_payload(group, d, mover, op.deadline, land=proceed)
        except Exception as exc:  # noqa: BLE001 - every failure poisons the pair group
            why = _why(exc)
            if op.deadline.passed():
                # the transfer deadline passed while waiting (for the rendezvous or the data):
                # TIMED_OUT, whichever of this thread and the session's clock check noticed first
                sessions.expire(rid, "deadline exceeded")
            if proceed:
                sessions.op_finished(rid, ok=False, nbytes=0, seconds=time.perf_counter() - t0,
                                     reason=why)
            else:
                sessions.fail(rid, why)
            self._poison(why, d.group)
            return
        if proceed:
            sessions.op_finished(rid, ok=True, nbytes=d.total_bytes,
                                 seconds=time.perf_counter() - t0)

    def _check(self, h: WireHeader, d: TransferDescriptor) -> None:
        if (h.seq, h.transfer_id, h.ctx_request_id) != (d.seq, d.transfer_id, d.ctx_request_id):
            raise ProtocolError(f"header {h} does not belong to transfer {d.transfer_id}")
        planes = 2 * self.owner.pool.num_layers
        if h.status == WireStatus.OK and d.num_blocks > 0 and (
            h.num_blocks != d.num_blocks or h.bytes_per_block != d.bytes_per_block
            or not 1 <= h.chunk_planes <= planes or not 1 <= h.chunk_blocks <= d.num_blocks
            or (h.chunk_planes > 1 and h.chunk_blocks != d.num_blocks)
        ):
            raise ProtocolError(f"header {h} does not match the reserved blocks")

    def _recv_payload(self, group: _Group, d: TransferDescriptor, mover: _Mover,
                      deadline: _Deadline, *, land: bool) -> None:
        """Recvs of later chunks stay posted while a chunk is scattered (staging -> pool); a
        chunk contiguous in the pool is received into it directly. With land=False (session
        cancelled or timed out before the payload) everything is drained into staging."""
        chunks = mover.chunks
        if land and len(set(d.gen_block_ids)) != len(d.gen_block_ids):
            raise ValueError("duplicate generation block ids")
        bufs = self.staging.get(mover.staging_bytes) if chunks else []
        free = deque(range(len(bufs)))
        posted: deque[tuple[int, dist.Work, int | None]] = deque()
        nxt = 0
        while nxt < len(chunks) or posted:
            while nxt < len(chunks) and len(posted) < MAX_OUTSTANDING:
                dst, slot = (mover.direct(chunks[nxt]) if land else None), None
                if dst is None:
                    if not free:
                        break
                    slot = free.popleft()
                    dst = bufs[slot][: mover.nbytes(chunks[nxt])]
                posted.append((nxt, group.recv(dst, wire_tag(d.seq, nxt + 1)), slot))
                nxt += 1
            i, work, slot = posted.popleft()
            deadline.wait(work, "chunk recv")
            if slot is not None:
                if land:
                    mover.scatter(chunks[i], bufs[slot])
                free.append(slot)


class KVReceiver:
    """Generation worker's end of the KV transfer: one thread and one pair group per context
    worker it receives from.

    Executor calls, for a request in ``fitting_disagg_gen_init`` whose blocks it just allocated:
    ``start(...)`` (reserve + request) -> send the returned KVRequest (``encode_message``) to the
    context worker, feed its answer to ``handle``; ``poll`` each step (COMPLETE ->
    DISAGG_GENERATION_TRANS_COMPLETE, other final states -> DISAGG_TRANS_ERROR, blocks free);
    ``cancel`` on abort (forward the returned CancelTransfer to the context worker).
    """

    def __init__(self, worker_id: str, pool: KVPool, *, config: TransportConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.config = config or TransportConfig()
        self.layout = layout_of(pool)
        self.sessions = ReceiverSessions(worker_id, self.layout, clock=clock,
                                         default_timeout_s=self.config.default_timeout_s)
        # start time: a restarted worker's groups order after (and never reuse keys of) the old
        self.incarnation = time.time_ns()
        self._pairs: dict[str, _ReceiverPair] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Context endpoints known to be gone (restarted or dead), most recent last; bounded.
        self._gone: dict[str, None] = {}
        self._gone_lock = threading.Lock()

    # ---------------------------------------------------------------- peers that went away

    def is_gone(self, endpoint: str) -> bool:
        with self._gone_lock:
            return endpoint in self._gone

    def mark_gone(self, endpoint: str, *, _notify_pair: bool = True) -> None:
        """``endpoint`` (a context worker's locator) will never answer again: queued ops for it
        fail now and later requests carrying it are refused at once."""
        with self._gone_lock:
            self._gone[endpoint] = None
            while len(self._gone) > MAX_GONE_ENDPOINTS:
                del self._gone[next(iter(self._gone))]
        if _notify_pair:
            with self._lock:
                pairs = list(self._pairs.values())
            for pair in pairs:
                pair.endpoint_gone(endpoint)

    def pair_endpoint(self, ctx_worker_id: str) -> str | None:
        """The endpoint the pair with this context worker currently uses (None: no pair yet)."""
        with self._lock:
            pair = self._pairs.get(ctx_worker_id)
        return None if pair is None else pair.endpoint

    def reserve(self, gen_request_id: int, *, ctx_worker_id: str, ctx_endpoint: str,
                ctx_request_id: int, block_ids: list[int] | tuple[int, ...],
                num_cached_blocks: int = 0, timeout_s: float | None = None) -> None:
        """``block_ids``: this request's blocks covering the context's blocks, in order; the
        first ``num_cached_blocks`` already hold the KV (own prefix cache) and are not sent."""
        self._pair(ctx_worker_id, ctx_endpoint)
        self.sessions.reserve(gen_request_id, ctx_worker_id=ctx_worker_id,
                              ctx_request_id=ctx_request_id, block_ids=block_ids,
                              num_cached_blocks=num_cached_blocks, timeout_s=timeout_s)

    def request(self, gen_request_id: int) -> KVRequest:
        """RESERVED -> REQUESTED: queue the receive on the pair thread and return the KV request
        to send to the context worker (seq order = the order of these calls)."""
        d = self.sessions.descriptor(gen_request_id)
        if d is None:
            raise KeyError(f"request {gen_request_id} has no reservation")
        with self._lock:
            pair = self._pairs[d.ctx_worker_id]
        return pair.issue(gen_request_id)

    def start(self, gen_request_id: int, *, ctx_worker_id: str, ctx_endpoint: str,
              ctx_request_id: int, block_ids: list[int] | tuple[int, ...],
              num_cached_blocks: int = 0, timeout_s: float | None = None) -> KVRequest | None:
        """``reserve`` then ``request``. None when ``ctx_endpoint`` is known to be gone: the
        session is then already failed (``poll`` hands it back) and nothing is to be sent."""
        if not self.is_gone(ctx_endpoint):
            self._pair(ctx_worker_id, ctx_endpoint)  # may find ctx_endpoint stale
        if self.is_gone(ctx_endpoint):
            self.sessions.reserve(gen_request_id, ctx_worker_id=ctx_worker_id,
                                  ctx_request_id=ctx_request_id, block_ids=block_ids,
                                  num_cached_blocks=num_cached_blocks, timeout_s=timeout_s)
            self.sessions.fail(gen_request_id, f"context worker endpoint {ctx_endpoint} is gone "
                                               "(the worker restarted; its KV is lost)")
            return None
        self.reserve(gen_request_id, ctx_worker_id=ctx_worker_id, ctx_endpoint=ctx_endpoint,
                     ctx_request_id=ctx_request_id, block_ids=block_ids,
                     num_cached_blocks=num_cached_blocks, timeout_s=timeout_s)
        return self.request(gen_request_id)

    def handle(self, payload: bytes) -> None:
        """The context worker's TransferDone. A refusal fails the session at once (blocks are
        not written before a payload header, so they are free)."""
        msg = decode_message(payload)
        if not isinstance(msg, TransferDone):
            raise ProtocolError(f"a generation worker does not take {type(msg).__name__}")
        self.on_done(msg)

    def on_done(self, done: TransferDone) -> None:
        if done.ok:
            return
        rid = self.sessions.find_transfer(done.transfer_id, done.ctx_request_id)
        if rid is not None:
            self.sessions.fail(rid, f"context side: {done.reason}")

    def cancel(self, gen_request_id: int, reason: str = "cancelled") -> CancelTransfer | None:
        """Cancel; returns the message to forward to the context worker when a KV request had
        gone out. An in-flight receive keeps its blocks quarantined until it is over."""
        d = self.sessions.descriptor(gen_request_id)
        if not self.sessions.cancel(gen_request_id, reason) or d is None or d.transfer_id < 0:
            return None
        return CancelTransfer(d.transfer_id, d.ctx_request_id, self.worker_id, reason)

    def poll(self) -> list[TransferResult]:
        return self.sessions.poll()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
        for p in pairs:
            p.stop()
        for p in pairs:
            p.thread.join(timeout_s)

    def _pair(self, ctx_worker_id: str, endpoint: str) -> _ReceiverPair:
        with self._lock:
            if self._closed:
                raise RuntimeError("transport closed")
            pair = self._pairs.get(ctx_worker_id)
            if pair is None:
                pair = self._pairs[ctx_worker_id] = _ReceiverPair(self, ctx_worker_id, endpoint)
        if not self.is_gone(endpoint):  # a stale endpoint never moves the pair back
            pair.set_endpoint(endpoint)
        return pair

"""Context side of the KV data plane: ``KVSender`` owns the TCPStore that pair groups rendezvous
on and one thread per generation worker (``_SenderPair``) that sends the KV requests' blocks,
in seq order (pair protocol and failure rule: ``kv_groups``).

A generation worker that sets its groups up eagerly opens each with a ``PairOpen`` (op 0 of
the group: an OPEN header, no payload). When a group breaks, only the op in flight on it
fails: claimed ops that never began give their claim back (the blocks stay leased) and are
answered ``retryable``, so the generation side re-issues them on the rebuilt group.

Each KV request arrives twice, by the direct link (``kv_link``, fast) and by Ray (the
dashboard's record): ``submit`` runs the first copy and hands the second the same future.

Layer-wise (``KVRequest.stream``): the context request's session is leased when its last
prefill chunk is scheduled (``begin_stream``), before the forward that writes it. Its op sends
the header at once, then each chunk (at most one layer's planes) once the forward has written
that layer (``LayerProgress``, advanced by the step loop), then a trailer with the first token
(``hold`` gives it at the end of the step). The op waits at most one forward: the generation
side asks only after the context worker announced the last chunk, so a stream never blocks
the pair behind a prefill that has not started.

Tensor parallelism: a KV request may name a head slice (``protocol.HeadSlice``), and only those
heads travel (``BlockMover``); it also names the context (tensor parallel size, rank) it
expects, and a ``KVSender`` of another (``tp_size``, ``rank``) refuses it, as it refuses such
a ``PairOpen``.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch.distributed as dist

if TYPE_CHECKING:  # transport sits below workers: the pool is only a type here
    from .kv_pool import KVPool
from .kv_groups import (
    CTX_RANK, INCARNATION_KEY, MAX_OUTSTANDING, BlockMover, Deadline, PairGroup, StagingRing,
    TransportConfig, as_timedelta, failure_reason, layout_of, wire_planes,
)
from .protocol import (
    CancelTransfer, KVRequest, PairOpen, ProtocolError, TransferDescriptor, TransferDone,
    TransferRejected, WireHeader, WireStatus, WireTrailer, check_tp, choose_chunking, chunk_layer,
    consecutive_fraction, covers_pool, decode_message, encode_message, group_order,
    layer_aligned, tp_mismatch, wire_tag,
)
from .kv_link import LINK_KEY, KvLinkServer
from .layer_progress import LayerProgress
from .session_sides import SenderSessions
from .sessions import TransferResult

SendHook = Callable[[TransferDescriptor, int], None]  # (descriptor, chunk index), sender thread
RUNS_THRESHOLD = 0.9  # a side's ids this consecutive: single-plane chunks (copy-free runs)
# How long an op is remembered after it was submitted, beyond its own timeout: the second copy
# of a KV request (direct link and Ray both carry it) folds into the first within this window.
DEDUP_MARGIN_S = 60.0


@dataclass(slots=True)
class _SendOp:
    request: KVRequest | PairOpen  # PairOpen: op 0 of a group, a header of status OPEN only
    descriptor: TransferDescriptor | None  # None: refused (or an open), a header only
    reason: str  # why refused; "" when claimed
    deadline: Deadline
    future: Future = field(default_factory=Future)

    @property
    def group(self) -> str:
        return self.request.group

    @property
    def seq(self) -> int:
        return 0 if isinstance(self.request, PairOpen) else self.request.seq

    def done(self, ok: bool, reason: str, nbytes: int = 0, seconds: float = 0.0, *,
             retryable: bool = False) -> TransferDone:
        """The answer to this op (transfer id -1 for an open)."""
        req = self.request
        tid, crid = (-1, -1) if isinstance(req, PairOpen) else (req.transfer_id, req.ctx_request_id)
        return TransferDone(tid, crid, ok, reason, nbytes, seconds, group=req.group,
                            seq=self.seq, retryable=retryable)


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
        self.group: PairGroup | None = None  # touched by the pair thread only
        self.staging = StagingRing(owner.config.num_staging, owner.pool.device)
        self._doomed: list[tuple[_SendOp, str, bool]] = []  # (op, why, may be re-issued)
        self.thread = threading.Thread(target=self._run, name=f"pdserve-kv-send-{gen_worker_id}",
                                       daemon=True)
        self.thread.start()

    def enqueue(self, op: _SendOp) -> None:
        g, seq = op.group, op.seq
        retryable = False
        with self.cond:
            if self.stopping:
                reason = "transport closed"
            elif g in self.retired or (self.current is not None
                                       and group_order(g) < group_order(self.current)):
                reason, retryable = f"pair group {g} was retired", True
            elif seq in self.pending.get(g, {}) or (g == self.current and seq < self.next_seq):
                reason = f"duplicate seq {seq} on pair group {g}"
            else:
                self.pending.setdefault(g, {})[seq] = op
                self.cond.notify()
                return
        self.owner._abandon(op, reason, retryable=retryable)

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
            for d_op, reason, retryable in doomed:
                self.owner._abandon(d_op, reason, retryable=retryable)
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
                    self._retire_locked(g, "transport closed", retryable=False)
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
                    # past the deadline of every op waiting: nothing left to re-issue
                    self._retire_locked(self.current, f"seq {self.next_seq} never arrived",
                                        retryable=False)
                    return None
                self.cond.wait(wait_s)
            else:
                self.cond.wait()

    def _retire_locked(self, g: str, reason: str, *, retryable: bool = True) -> None:
        """Drop group ``g``. Its queued ops never began: their claims go back (retryable)."""
        self.retired.add(g)
        self._doomed.extend((op, reason, retryable) for op in self.pending.pop(g, {}).values())

    def _poison(self, reason: str) -> None:
        with self.cond:
            if self.current is not None:
                self._retire_locked(self.current, f"pair group poisoned: {reason}")
            doomed, self._doomed = self._doomed, []
        self._drop_group()
        for op, why, retryable in doomed:
            self.owner._abandon(op, why, retryable=retryable)

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.staging.drop()

    def _ensure_group(self, name: str, deadline: Deadline) -> PairGroup:
        if self.group is not None and self.group.name == name:
            return self.group
        self._drop_group()
        left = min(self.owner.config.connect_timeout_s, deadline.left("rendezvous").total_seconds())
        self.group = PairGroup(self.owner._store, name, CTX_RANK, self.owner.pool.device, left)
        return self.group

    def _open(self, op: _SendOp) -> None:
        """Op 0 of an eagerly set-up group: the rendezvous, then an OPEN header (which also
        creates a NCCL communicator here, not inside a transfer)."""
        t0 = time.perf_counter()
        try:
            group = self._ensure_group(op.group, op.deadline)
            hdr = self.staging.header(
                WireHeader(0, int(WireStatus.OPEN), -1, -1, 0, 0, 0, 0).to_ints())
            op.deadline.wait(group.send(hdr, wire_tag(0, 0)), "open header send")
        except Exception as exc:  # noqa: BLE001 - a failed open poisons the group like an op
            why = failure_reason(exc)
            self._poison(why)
            self.owner._abandon(op, why)
            return
        with self.cond:
            self.next_seq += 1
        op.future.set_result(op.done(True, "", seconds=time.perf_counter() - t0))

    def _execute(self, op: _SendOp) -> None:
        if isinstance(op.request, PairOpen):
            self._open(op)
            return
        req, d, sessions, pool = op.request, op.descriptor, self.owner.sessions, self.owner.pool
        proceed, t0 = False, time.perf_counter()
        try:
            group = self._ensure_group(req.group, op.deadline)
            progress = self.owner.progress_of(d.ctx_request_id) if d is not None and d.stream else None
            # (read before begin_op: a test that holds the forward until the op begins sees
            # the prefill still running here)
            during_prefill = progress is not None and progress.first_token is None
            proceed = d is not None and sessions.begin_op(d.ctx_request_id)
            if proceed:
                assert d is not None
                status, reason = WireStatus.OK, ""
                # a side's consecutive ids allow copy-free chunks only where whole rows travel
                sides = ((d.ctx_block_ids, covers_pool(d.src_head_offset, d.num_heads,
                                                       pool.num_kv_heads)),
                         (d.gen_block_ids, covers_pool(d.dst_head_offset, d.num_heads,
                                                       req.kv_shape[2])))
                runs = max((consecutive_fraction(ids) for ids, whole in sides if whole),
                           default=0.0) >= RUNS_THRESHOLD
                # chunk sizes count the bytes that travel: the slice's, not the pool's blocks'
                planes, blocks = choose_chunking(wire_planes(pool), d.num_blocks,
                                                 d.bytes_per_block // wire_planes(pool),
                                                 self.owner.config.chunk_bytes, runs=runs)
                if d.stream:
                    planes = layer_aligned(planes, pool.num_planes)
            else:
                status = WireStatus.REJECTED if d is None else WireStatus.CANCELLED
                reason = op.reason or "cancelled or past its deadline before the send"
                planes = blocks = 0
            nblocks = d.num_blocks if proceed and d is not None else 0
            header = WireHeader(req.seq, int(status), req.transfer_id, req.ctx_request_id,
                                nblocks, d.bytes_per_block if proceed and d is not None
                                else pool.bytes_per_block, planes, blocks)
            t0 = time.perf_counter()
            hdr = self.staging.header(header.to_ints())
            hdr_work = group.send(hdr, wire_tag(req.seq, 0))  # payload follows without waiting
            first_token, stream_reason = None, ""
            if proceed:
                assert d is not None
                mover = BlockMover(pool, d.ctx_block_ids, planes, blocks, self.staging,
                                   heads=(d.src_head_offset, d.heads_moved))
                if during_prefill:
                    self.owner.overlapped += 1  # the send began while the prefill was running
                self._send_payload(group, d, mover, op.deadline, progress)
                if d.stream:
                    # The trailer: the first token, or CANCELLED when the context request ended
                    # otherwise (the payload sent is then filler to keep the op stream paired).
                    if progress is None:
                        stream_reason = "no prefill of this request is running or leased"
                    else:
                        first_token, stream_reason = progress.wait_token(op.deadline)
                    trailer = WireTrailer(req.seq, int(WireStatus.OK if first_token is not None
                                                       else WireStatus.CANCELLED),
                                          -1 if first_token is None else first_token)
                    op.deadline.wait(group.send(self.staging.trailer(trailer.to_ints()),
                                                wire_tag(req.seq, len(mover.chunks) + 1)),
                                     "trailer send")
            op.deadline.wait(hdr_work, "header send")
        except Exception as exc:  # noqa: BLE001 - every failure poisons the pair group
            why = failure_reason(exc)
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
        if proceed and d is not None and d.stream and first_token is None:
            reason = f"the context request ended before its first token: {stream_reason}"
            sessions.op_finished(d.ctx_request_id, ok=False, nbytes=0, seconds=seconds,
                                 reason=reason)
            op.future.set_result(op.done(False, reason, 0, seconds))
            return
        if proceed and d is not None:
            sessions.op_finished(d.ctx_request_id, ok=True, nbytes=nbytes, seconds=seconds)
        if not op.future.done():  # a refused op may have been answered at submit
            op.future.set_result(op.done(proceed, reason, nbytes, seconds))

    def _send_payload(self, group: PairGroup, d: TransferDescriptor, mover: BlockMover,
                      deadline: Deadline, progress: LayerProgress | None = None) -> None:
        """Gather the next chunk (pool -> staging) while earlier ones are on the wire; chunks
        contiguous in the pool are sent from it directly. A staging buffer is reused only after
        its send completed. With ``progress`` (layer-wise) a chunk goes once its layer is
        written; after a cancel the rest goes at once."""
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
            if progress is not None and not progress.wait_layer(
                    chunk_layer(c, self.owner.pool.num_planes), deadline):
                progress = None
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
                 send_hook: SendHook | None = None, tp_size: int = 1, rank: int = 0) -> None:
        check_tp(tp_size, rank, ValueError)
        self.worker_id = worker_id
        self.pool = pool
        self.config = config or TransportConfig()
        self.layout = layout_of(pool)
        self.send_hook = send_hook  # test hook: runs before each chunk is sent (stall, fail, ...)
        # This context worker's (tensor parallel size, rank): a generation side that expects
        # another is refused (its pool holds other heads than it thinks)
        self.tp = (tp_size, rank)
        self.sessions = SenderSessions(worker_id, self.layout, clock=clock,
                                       lease_s=self.config.default_timeout_s, tp=self.tp)
        self._store = dist.TCPStore(self.config.host, self.config.port, None, True,
                                    as_timedelta(self.config.connect_timeout_s), wait_for_workers=False)
        self.endpoint = f"{self.config.host}:{self._store.port}"
        # A restarted worker may get the same port: the incarnation tells the two apart (and
        # orders them: a later process has a larger one).
        self.incarnation = time.time_ns()
        self.locator = f"{self.endpoint}#{self.incarnation}"
        self._store.set(INCARNATION_KEY, str(self.incarnation))
        self._pairs: dict[str, _SenderPair] = {}
        self._lock = threading.Lock()
        # context request id -> its LayerProgress, from begin_stream or hold until poll hands
        # the session back
        self._progress: dict[int, LayerProgress] = {}
        self._closed = False
        # (group, seq) -> (transfer id, the op's future, forget at): a request's second copy
        self._recent: OrderedDict[tuple[str, int], tuple[int, Future, float]] = OrderedDict()
        self._recent_lock = threading.Lock()
        self.folded = 0  # second copies folded into the first (stats, tests)
        self.overlapped = 0  # layer-wise sends that began before their prefill was over
        self.link = KvLinkServer(self.config.host, self._on_link, name=worker_id)
        self._store.set(LINK_KEY, self.link.published)

    def hold(self, ctx_request_id: int, block_ids: list[int] | tuple[int, ...], *,
             lease_s: float | None = None, first_token: int | None = None) -> None:
        """Lease a finished context request's blocks until a KV request claims them. For a
        request streamed since ``begin_stream`` the lease exists: this only completes its
        progress with the first token (a layer-wise op sends it in its trailer)."""
        with self._lock:
            progress = self._progress.get(ctx_request_id)
        if progress is not None:
            if first_token is not None:
                progress.finish(first_token)
            return
        self.sessions.lease(ctx_request_id, block_ids, lease_s=lease_s)
        if first_token is not None:  # a layer-wise request that comes after the prefill
            progress = LayerProgress(self.pool.num_layers)
            progress.finish(first_token)
            with self._lock:
                self._progress[ctx_request_id] = progress

    def begin_stream(self, ctx_request_id: int, block_ids: list[int] | tuple[int, ...], *,
                     lease_s: float | None = None) -> None:
        """Lease a context request's blocks before the forward of its last prefill chunk
        writes them: a layer-wise KV request may claim them now, and its op sends each layer
        as ``layers_written`` reports it. ``hold`` (with the first token) or ``end_stream``
        follows at the end of the step."""
        self.sessions.lease(ctx_request_id, block_ids, lease_s=lease_s)
        with self._lock:
            self._progress[ctx_request_id] = LayerProgress(self.pool.num_layers)

    def layers_written(self, ctx_request_ids: list[int], layers: int,
                       event: object | None = None) -> None:
        """The forward has written the first ``layers`` layers of these requests' KV."""
        with self._lock:
            progress = [self._progress.get(rid) for rid in ctx_request_ids]
        for p in progress:
            if p is not None:
                p.advance(layers, event)

    def end_stream(self, ctx_request_id: int, reason: str) -> None:
        """A streamed context request ended without handing its KV off (a stop token first,
        an abort, a failed step): its op's trailer says CANCELLED, and its blocks come back
        through ``poll`` once the data plane is quiet."""
        self.cancel(ctx_request_id, reason)

    def progress_of(self, ctx_request_id: int) -> LayerProgress | None:
        with self._lock:
            return self._progress.get(ctx_request_id)

    def submit(self, request: KVRequest) -> Future:
        """Queue the send a KV request asks for; the future resolves to a TransferDone when the
        bytes are on the wire (or the op failed). A refused request still sends a header.
        The second copy of a request (same group, seq and transfer) gets the first's future."""
        key = (request.group, request.seq)
        now = time.monotonic()
        with self._recent_lock:  # before self._lock (which _submit takes), never after
            while self._recent and next(iter(self._recent.values()))[2] <= now:
                self._recent.popitem(last=False)
            seen = self._recent.get(key)
            if seen is not None and seen[0] == request.transfer_id:
                self.folded += 1
                return seen[1]
            future = self._submit(request)
            self._recent[key] = (request.transfer_id, future,
                                 now + request.timeout_s + DEDUP_MARGIN_S)
            return future

    def _submit(self, request: KVRequest) -> Future:
        op_deadline = Deadline(request.timeout_s)
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
            if tp_mismatch((request.ctx_tp_size, request.ctx_rank), self.tp):
                # Answered now: its pair's open was refused too, so the op may never run (its
                # header still goes if it does, keeping a lazily set-up pair in step)
                op.future.set_result(op.done(False, str(exc)))
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
        progress = self.progress_of(ctx_request_id)
        if progress is not None:
            progress.cancel(reason)  # a layer-wise op stops waiting for the forward
        return self.sessions.cancel(ctx_request_id, reason)

    def open(self, msg: PairOpen) -> Future:
        """Queue op 0 of a new pair group (``PairOpen``); the future resolves to its
        TransferDone (transfer id -1) once the group is set up and the OPEN header sent."""
        op = _SendOp(msg, None, "", Deadline(msg.timeout_s))
        try:
            group_order(msg.group)
        except ProtocolError as exc:
            self._abandon(op, str(exc))
            return op.future
        differs = tp_mismatch((msg.ctx_tp_size, msg.ctx_rank), self.tp)
        if differs:  # refused before the rendezvous: the generation side abandons it at once
            self._abandon(op, differs)
            return op.future
        self._pair(msg.gen_worker_id).enqueue(op)
        return op.future

    def handle(self, payload: bytes) -> bytes | None:
        """A control message from a generation worker: a KV request or a pair open (each
        answered with an encoded TransferDone once it is over) or a cancel (no answer)."""
        msg = decode_message(payload)
        if isinstance(msg, CancelTransfer):
            self._cancel_from(msg)
            return None
        if isinstance(msg, PairOpen):
            future = self.open(msg)
            try:
                done = future.result(timeout=msg.timeout_s + 5.0)
            except TimeoutError:
                done = TransferDone(-1, -1, False, "pair thread did not answer in time", 0, 0.0,
                                    group=msg.group, seq=0)
            return encode_message(done)
        if not isinstance(msg, KVRequest):
            raise ProtocolError(f"a context worker does not take {type(msg).__name__}")
        future = self.submit(msg)
        try:  # the pair thread's waits are bounded; this margin covers the rendezvous
            done = future.result(timeout=msg.timeout_s + self.config.connect_timeout_s + 5.0)
        except TimeoutError:
            done = TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                "pair thread did not answer in time", 0, 0.0, group=msg.group,
                                seq=msg.seq)
        return encode_message(done)

    def poll(self) -> list[TransferResult]:
        results = self.sessions.poll()
        if results:
            with self._lock:
                for r in results:
                    self._progress.pop(r.request_id, None)
        return results

    def _on_link(self, endpoint: str, payload: bytes) -> None:
        """A control message from the direct link (its reader thread). One meant for another
        incarnation is dropped: its Ray copy gets the endpoint_gone answer."""
        if endpoint not in (self.locator, self.endpoint):  # bare "host:port": tests, benches
            return
        msg = decode_message(payload)
        if isinstance(msg, KVRequest):
            self.submit(msg)  # the Ray copy waits on the same future and answers
        elif isinstance(msg, CancelTransfer):
            self._cancel_from(msg)
        else:
            raise ProtocolError(f"the KV link does not take {type(msg).__name__}")

    def _cancel_from(self, msg: CancelTransfer) -> None:
        self.cancel(msg.ctx_request_id, msg.reason, transfer_id=msg.transfer_id,
                    gen_worker_id=msg.gen_worker_id)

    def buffer_allocations(self) -> dict[str, int]:
        """Per generation worker: buffers its pair has allocated (``StagingRing``)."""
        with self._lock:
            return {w: p.staging.allocations for w, p in self._pairs.items()}

    def break_pair(self, gen_worker_id: str) -> bool:
        """Fault injection: cut the pair group's connections, as a dying peer or a broken
        network would (pending ops fail at once on both sides; the generation side rebuilds
        the group). False if there is no group or nothing to cut."""
        with self._lock:
            pair = self._pairs.get(gen_worker_id)
        group = pair.group if pair is not None else None
        return group is not None and group.cut() > 0

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            progress = list(self._progress.values())
        for p in progress:
            p.cancel("transport closed")
        self.link.close()
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

    def _abandon(self, op: _SendOp, reason: str, *, fail_session: bool = True,
                 retryable: bool = False) -> None:
        """An op that will not (or did not) send its payload: answer it. Its session fails,
        unless the op never began and was dropped with its group (``retryable``): then the
        claim goes back and the blocks stay leased for a re-issue. Either touches the
        session only while this op still holds its claim."""
        d = op.descriptor
        if fail_session and d is not None:
            if retryable:
                retryable = self.sessions.release_claim(d)
            else:
                self.sessions.fail_claim(d, reason)
        if not op.future.done():
            op.future.set_result(op.done(False, reason, retryable=retryable))


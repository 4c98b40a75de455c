"""One pair's receive side on the generation worker: ``ReceiverPair`` runs the thread that sets
the pair group up with one context worker, heals it when an op fails (poison, new epoch,
re-issue), keeps the direct control link to that worker, and receives each op in seq order:
the header, the payload chunks into the reserved blocks, the layer-wise trailer.

The receiver that owns the pairs (``KVReceiver`` in kv_receiver.py: the sessions, the gone
endpoints, what the executor calls) is reached only through ``PairOwner``, so this module does
not import that one and the two form no import cycle.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch.distributed as dist

if TYPE_CHECKING:  # transport sits below workers: the pool is only a type here
    from .kv_pool import KVPool
from .kv_groups import (
    GEN_RANK, INCARNATION_KEY, MAX_OUTSTANDING, BlockMover, Deadline, PairGroup, StagingRing,
    TransportConfig, connect_store, failure_reason, incarnation_of, probe_store, run_abandonable,
    wire_planes,
)
from .kv_link import LINK_KEY, KvLink, parse_published
from .protocol import (
    KVRequest, LayerArrivals, PairOpen, ProtocolError, TransferDescriptor, WireHeader, WireStatus,
    WireTrailer, encode_message, group_name, wire_tag,
)
from .session_sides import ReceiverSessions

OPEN_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits after 1, 2, ... failed opens (the last repeats)
LINK_CONNECT_S = 5.0  # dialling a context worker's KV link (on a helper thread)
LINK_RETRY_S = 1.0  # after a failed dial (or a link that closed), the next try at the next op
FIRST_BYTE_SAMPLES = 512  # per pair: the latest issue -> header times kept for pair_stats
# (ctx worker id, its endpoint, encoded control message, what the dashboard calls the call):
# delivers a control message from any thread; the answer comes back through
# ``KVReceiver.handle``.
ControlSink = Callable[[str, str, bytes, str], None]

log = logging.getLogger("pdserve.transport")


class PairOwner(Protocol):
    """What a pair uses of the receiver that owns it (``KVReceiver``): state shared by all its
    pairs, and the way out to the context workers."""

    worker_id: str
    incarnation: int
    pool: KVPool
    config: TransportConfig
    sessions: ReceiverSessions
    control: ControlSink | None  # a pair is eager when there is one
    first_tokens: dict[int, int]  # layer-wise: request id -> the first token of its trailer

    def is_gone(self, endpoint: str) -> bool: ...

    def mark_gone(self, endpoint: str, *, _notify_pair: bool = True) -> None: ...

    def state_changed(self) -> None: ...

    def send_control(self, ctx_worker_id: str, endpoint: str, payload: bytes, name: str) -> None: ...

    def ctx_tp_of(self, ctx_worker_id: str) -> tuple[int, int]: ...


@dataclass(slots=True)
class _RecvOp:
    gen_request_id: int
    descriptor: TransferDescriptor  # as issued; a re-issue moves it to a newer group
    deadline: Deadline
    issued_at: float = 0.0  # perf_counter when the KV request was issued



class PairState:
    """What ``KVReceiver.pair_states`` reports for a pair."""

    LAZY = "lazy"  # no control sink: the group is set up by the first transfer (tests)
    OPENING = "opening"  # setting its group up (PairOpen sent, rendezvous under way)
    READY = "ready"  # its group is set up and no op has failed on it since
    DOWN = "down"  # the last open failed; the next try is after a backoff
    GONE = "gone"  # the context endpoint is gone (the worker restarted or died)


class ReceiverPair:
    """Generation side of one pair: receives in the order ``issue`` was called (= seq order).

    Eager (the owner has a control sink, as every worker does): the pair thread sets the group
    up itself as soon as the pair exists, by sending ``PairOpen`` and receiving the OPEN header
    (op 0; transfers are ops 1, 2, ...). A failure poisons the group: epoch + 1, and the ops
    queued behind the failed one are re-issued at once on the next group (same transfer,
    new seq), which the thread sets up right away, then after each failed open with a backoff.
    Only the op that was in flight fails. Lazy (no sink): the first op sets the group up and
    a failure fails the queued ops too."""

    def __init__(self, owner: PairOwner, ctx_worker_id: str, endpoint: str) -> None:
        self.owner = owner
        self.ctx_worker_id = ctx_worker_id
        self.cond = threading.Condition()
        self.queue: deque[_RecvOp] = deque()
        self.endpoint = endpoint
        self.epoch = 0
        self.next_seq = self._first_seq()
        self.stopping = False
        self.store: dist.TCPStore | None = None  # the pair thread's; reconnected on reset
        self.store_endpoint = ""
        # The direct control link to the context worker at ``link_endpoint`` (``kv_link``):
        # set by the pair thread when it connects to that store, used by any thread.
        self.link: KvLink | None = None
        self.link_endpoint = ""
        self.link_dialing = False  # a helper thread is dialling (set on the pair thread)
        self.link_retry_at = 0.0
        self.group: PairGroup | None = None
        self.staging = StagingRing(owner.config.num_staging, owner.pool.device)
        # eager set-up (under cond): the group open and serving, when to try the next open
        self.opened: str | None = None
        self.open_failures = 0  # consecutive failed opens (the backoff's step)
        self.retry_at = 0.0
        self.attempted = False  # an open of this endpoint finished (either way)
        self.stats = {"opens": 0, "open_failures": 0, "reissued": 0, "poisoned": 0}
        # seconds from issuing a KV request to its header arriving: the control message's
        # trip plus the context side's queue (what the direct link shortens); appended and
        # read under cond (the receive thread appends while status reads)
        self.first_byte_s: deque[float] = deque(maxlen=FIRST_BYTE_SAMPLES)
        # group -> why its PairOpen failed (the context side refused it, or the control call
        # failed): its rendezvous is abandoned at once. Only the group being opened is kept.
        self.refused: dict[str, str] = {}
        self.last_error = ""
        self.thread = threading.Thread(target=self._run, name=f"pdserve-kv-recv-{ctx_worker_id}",
                                       daemon=True)
        self.thread.start()

    @property
    def eager(self) -> bool:
        return self.owner.control is not None

    def _first_seq(self) -> int:
        return 1 if self.eager else 0  # op 0 of an eager group is its PairOpen

    @property
    def group_name(self) -> str:
        return group_name(self.ctx_worker_id, self.owner.worker_id, self.owner.incarnation,
                          self.epoch)

    def state(self) -> str:
        with self.cond:
            if self.owner.is_gone(self.endpoint):
                return PairState.GONE
            if not self.eager:
                return PairState.LAZY
            if self.opened == self.group_name:
                return PairState.READY
            return PairState.DOWN if self.open_failures else PairState.OPENING

    def set_endpoint(self, endpoint: str) -> None:
        """A restarted context worker has a new store address: later ops use a new group, and
        the old address is gone for good (one store per context process). An endpoint of an
        older incarnation than the current one is the one that is gone: the pair stays."""
        with self.cond:
            if endpoint == self.endpoint:
                return
            if incarnation_of(endpoint) < incarnation_of(self.endpoint):
                stale = endpoint
                doomed = []
            else:
                stale, self.endpoint = self.endpoint, endpoint
                self._close_link()
                doomed = self._reset_locked()
                self.open_failures, self.retry_at, self.attempted = 0, 0.0, False
                self.cond.notify()
        self.owner.mark_gone(stale, _notify_pair=False)
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, "context worker moved to a new endpoint")

    def endpoint_gone(self, endpoint: str) -> None:
        """Fail every queued op: they all target ``endpoint``, which no longer exists."""
        with self.cond:
            if endpoint != self.endpoint:
                return
            self._close_link()
            doomed = self._reset_locked()
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, f"context worker endpoint {endpoint} is gone")

    def send_direct(self, endpoint: str, payload: bytes) -> bool:
        """A control message over the direct link, if one is up to ``endpoint``."""
        link = self.link
        return (link is not None and self.link_endpoint == endpoint and not link.closed
                and link.send(endpoint, payload))

    def _close_link(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.close()

    def _connect_link(self, store: dist.TCPStore | None, endpoint: str) -> None:
        """On the pair thread, connected to ``endpoint``'s store: unless a link to it is up
        (or being dialled, or failed less than LINK_RETRY_S ago), read what it publishes and
        dial on a helper thread, so a slow peer never holds a transfer. Also called before
        each op, so a link that closed comes back. A failure only means Ray carries the
        control messages alone meanwhile."""
        link = self.link
        if (not self.owner.config.direct_link or store is None or self.link_dialing
                or time.monotonic() < self.link_retry_at
                or (link is not None and not link.closed and self.link_endpoint == endpoint)):
            return
        self.link_retry_at = time.monotonic() + LINK_RETRY_S
        try:
            if not store.check([LINK_KEY]):
                return
            address, token = parse_published(store.get(LINK_KEY).decode())
        except Exception as exc:  # noqa: BLE001 - Ray carries every control message anyway
            log.info("%s: no KV link to %s (%s); control messages go by Ray",
                     self.owner.worker_id, self.ctx_worker_id, failure_reason(exc))
            return
        self.link_dialing = True
        threading.Thread(target=self._dial_link, args=(address, token, endpoint),
                         name=f"pdserve-kv-link-{self.ctx_worker_id}", daemon=True).start()

    def _dial_link(self, address: str, token: str, endpoint: str) -> None:
        try:
            new = KvLink(address, token, timeout_s=LINK_CONNECT_S)
        except Exception as exc:  # noqa: BLE001 - tried again at a later op
            log.info("%s: KV link to %s failed (%s); control messages go by Ray meanwhile",
                     self.owner.worker_id, self.ctx_worker_id, failure_reason(exc))
            self.link_dialing = False
            return
        with self.cond:
            self.link_dialing = False
            if endpoint != self.endpoint or self.stopping:
                new.close()
                return
            self._close_link()
            self.link, self.link_endpoint = new, endpoint

    def issue(self, gen_request_id: int) -> KVRequest:
        with self.cond:
            if self.stopping:
                raise RuntimeError("transport closed")
            msg = self.owner.sessions.request(gen_request_id, group=self.group_name,
                                              seq=self.next_seq)
            self.next_seq += 1
            d = self.owner.sessions.descriptor(gen_request_id)
            assert d is not None
            self.queue.append(_RecvOp(gen_request_id, d, Deadline(msg.timeout_s),
                                      time.perf_counter()))
            self.cond.notify()
            return msg

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()

    def _reset_locked(self) -> list[_RecvOp]:
        self.epoch += 1
        self.next_seq = self._first_seq()
        self.opened = None
        self.owner.state_changed()
        doomed = list(self.queue)
        self.queue.clear()
        return doomed

    # ------------------------------------------------------------ pair thread

    def _run(self) -> None:
        sessions = self.owner.sessions
        while True:
            op: _RecvOp | None = None
            with self.cond:
                while not self.stopping:
                    if self._needs_open_locked():
                        wait_s = self.retry_at - time.monotonic()
                        if wait_s <= 0:
                            break
                        self.cond.wait(wait_s)
                    elif self.queue:
                        op = self.queue.popleft()
                        break
                    else:
                        self.cond.wait()
                if self.stopping:
                    doomed = list(self.queue)
                    self.queue.clear()
                else:
                    doomed = []
                current, endpoint = self.group_name, self.endpoint
            for d_op in doomed:
                sessions.fail(d_op.gen_request_id, "transport closed")
            if self.stopping:
                self._close_link()
                self._drop_group(store_too=True)
                return
            if op is None:
                self._open(current, endpoint)
                continue
            # A session final by now (cancelled, past its deadline) still runs its op: the
            # context side sends a header for every seq, and the op streams must pair up.
            if op.descriptor.group != current:
                sessions.fail(op.gen_request_id, "pair group was reset before this transfer began")
                continue
            if self.owner.is_gone(endpoint):  # no rendezvous with a store that is gone
                sessions.fail(op.gen_request_id, f"context worker endpoint {endpoint} is gone")
                self._drop_group(store_too=True)
                continue
            self._execute(op, endpoint)

    def _needs_open_locked(self) -> bool:
        return (self.eager and self.opened != self.group_name
                and not self.owner.is_gone(self.endpoint))

    def open_answered(self, group: str, ok: bool, reason: str) -> None:
        """The answer to a PairOpen (from any thread); a failure abandons that open."""
        if not ok:
            with self.cond:
                if group == self.group_name:
                    self.refused = {group: reason or "refused"}

    def _open(self, name: str, endpoint: str) -> None:
        """Set group ``name`` up: PairOpen to the context worker, the rendezvous, and the OPEN
        header (op 0). Also where a NCCL communicator gets created: never inside a transfer."""
        with self.cond:
            self.refused = {}
        deadline = Deadline(self.owner.config.connect_timeout_s)
        open_msg = PairOpen(name, self.owner.worker_id, self.owner.config.connect_timeout_s,
                            *self.owner.ctx_tp_of(self.ctx_worker_id))
        try:
            self.owner.send_control(self.ctx_worker_id, endpoint, encode_message(open_msg),
                                    f"kv_pair_open {self.ctx_worker_id}->{self.owner.worker_id} "
                                    f"epoch={self.epoch}")
            group = self._ensure_group(name, endpoint, deadline)
            hdr = self.staging.header()
            deadline.wait(group.recv(hdr, wire_tag(0, 0)), "open header recv")
            header = WireHeader.from_ints(hdr.tolist())
            if header.seq != 0 or header.status != WireStatus.OPEN:
                raise ProtocolError(f"header {header} does not open group {name}")
        except Exception as exc:  # noqa: BLE001 - a failed open is retried after a backoff
            why = failure_reason(exc)
            with self.cond:
                self.attempted = True
                self.open_failures += 1
                self.stats["open_failures"] += 1
                self.last_error = why
                step = OPEN_BACKOFF_S[min(self.open_failures, len(OPEN_BACKOFF_S)) - 1]
                self.retry_at = time.monotonic() + step
                self.owner.state_changed()
            log.warning("%s: KV pair group %s failed to open (%s); next try in %.1f s",
                        self.owner.worker_id, name, why, step)
            self._poison(why, name)
            return
        with self.cond:
            self.attempted = True
            if name == self.group_name:
                self.opened = name
                self.open_failures = 0
                self.stats["opens"] += 1
                self.owner.state_changed()
                self.cond.notify()

    def _poison(self, reason: str, group: str) -> None:
        """The op (or open) on ``group`` failed; the group is dropped. Eager: the ops queued
        behind it never began, so they move to the next group (re-issued there). Lazy: they
        fail. Nothing changes for ops when ``group`` is no longer current (a reset came
        first)."""
        reissued: list[KVRequest] = []
        doomed: list[_RecvOp] = []
        with self.cond:
            if group == self.group_name:
                self.stats["poisoned"] += 1
                self.last_error = reason
                if self.eager:
                    self.epoch += 1
                    self.next_seq = self._first_seq()
                    self.opened = None
                    self.owner.state_changed()
                    kept: deque[_RecvOp] = deque()
                    for op in self.queue:
                        msg = self.owner.sessions.reissue(op.gen_request_id, group=self.group_name,
                                                          seq=self.next_seq)
                        if msg is None:
                            continue  # final or past its deadline: poll hands it back
                        self.next_seq += 1
                        op.descriptor = dataclasses.replace(op.descriptor, group=msg.group,
                                                            seq=msg.seq)
                        kept.append(op)
                        reissued.append(msg)
                    self.queue = kept
                    self.stats["reissued"] += len(reissued)
                    self.cond.notify()
                else:
                    doomed = self._reset_locked()
            endpoint = self.endpoint
        self._drop_group(store_too=True)
        for op in doomed:
            self.owner.sessions.fail(op.gen_request_id, f"pair group poisoned: {reason}")
        for msg in reissued:
            try:
                self.owner.send_control(self.ctx_worker_id, endpoint, encode_message(msg),
                                        f"kv_transfer req={msg.gen_request_id} "
                                        f"{self.ctx_worker_id}->{self.owner.worker_id} "
                                        f"blocks={msg.num_blocks} (re-issued)")
            except Exception as exc:  # noqa: BLE001 - the sink failed: so did this transfer
                self.owner.sessions.fail(msg.gen_request_id, f"re-issue: {failure_reason(exc)}")

    def _drop_group(self, *, store_too: bool) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        self.staging.drop()
        if store_too:
            self.store = None

    def _ensure_group(self, name: str, endpoint: str, deadline: Deadline) -> PairGroup:
        if self.group is not None and self.group.name == name:
            return self.group
        self._drop_group(store_too=endpoint != self.store_endpoint)
        left = min(self.owner.config.connect_timeout_s, deadline.left("rendezvous").total_seconds())
        if self.store is None:
            host, port = endpoint.split("#", 1)[0].rsplit(":", 1)
            probe_store(endpoint, host, int(port), left, self.owner.mark_gone)
            store = connect_store(endpoint, host, int(port), left,
                                  thread_name=f"pdserve-kv-store-{self.ctx_worker_id}",
                                  abandoned=lambda: self._abandoned(endpoint))
            if incarnation_of(endpoint) and not (store.check([INCARNATION_KEY]) and int(
                    store.get(INCARNATION_KEY)) == incarnation_of(endpoint)):
                # another process listens on the port now: the one we want is gone
                self.owner.mark_gone(endpoint)
                raise RuntimeError(f"context endpoint {endpoint} is gone (its port was reused)")
            self.store, self.store_endpoint = store, endpoint
            self._connect_link(store, endpoint)
        store = self.store
        if not self.eager:  # lazy: the rendezvous is the first op's, bounded by its deadline
            self.group = PairGroup(store, name, GEN_RANK, self.owner.pool.device, left)
            return self.group
        # The rendezvous waits for the context side, which joins when it runs the op: on a
        # helper thread, so that a refused open (or a replaced endpoint) ends it at once.
        self.group = run_abandonable(
            lambda: PairGroup(store, name, GEN_RANK, self.owner.pool.device, left), left,
            thread_name=f"pdserve-kv-rendezvous-{self.ctx_worker_id}",
            what=f"the rendezvous of {name}",
            abandoned=lambda: ("the endpoint is gone or replaced" if self._abandoned(endpoint)
                               else self.refused.get(name)))
        return self.group

    def _abandoned(self, endpoint: str) -> bool:
        """``endpoint`` is gone or replaced: a store connect to it in progress gives up."""
        with self.cond:
            replaced = self.endpoint != endpoint
        return replaced or self.owner.is_gone(endpoint)

    def _execute(self, op: _RecvOp, endpoint: str) -> None:
        d, sessions, rid = op.descriptor, self.owner.sessions, op.gen_request_id
        proceed, t0 = False, time.perf_counter()
        if self.store_endpoint == endpoint:
            self._connect_link(self.store, endpoint)  # a link that closed comes back
        try:
            group = self._ensure_group(d.group, endpoint, op.deadline)
            hdr = self.staging.header()
            op.deadline.wait(group.recv(hdr, wire_tag(d.seq, 0)), "header recv")
            header = WireHeader.from_ints(hdr.tolist())
            with self.cond:  # pair_stats reads the samples under cond from another thread
                self.first_byte_s.append(time.perf_counter() - op.issued_at)
            self._check(header, d)
            if header.status != WireStatus.OK:
                sessions.fail(rid, f"context side answered {WireStatus(header.status).name}")
                return
            # blocks are written only from here on; a session cancelled meanwhile drains the
            # payload into staging so the op stream stays paired
            proceed = sessions.begin_op(rid)
            t0 = time.perf_counter()
            mover = BlockMover(self.owner.pool, d.gen_block_ids, header.chunk_planes,
                               header.chunk_blocks, self.staging,
                               heads=(d.dst_head_offset, d.heads_moved))
            self._recv_payload(group, d, mover, op.deadline, land=proceed)
            if d.stream:  # layer-wise: the first token, or CANCELLED, follows the payload
                tr = self.staging.trailer()
                op.deadline.wait(group.recv(tr, wire_tag(d.seq, len(mover.chunks) + 1)),
                                 "trailer recv")
                trailer = WireTrailer.from_ints(tr.tolist())
                if trailer.seq != d.seq:
                    raise ProtocolError(f"trailer {trailer} does not belong to seq {d.seq}")
                if trailer.status != WireStatus.OK:
                    if proceed:
                        sessions.op_finished(rid, ok=False, nbytes=0,
                                             seconds=time.perf_counter() - t0,
                                             reason="the context request ended before its "
                                                    "first token (stream cancelled)")
                    return
                if proceed:
                    self.owner.first_tokens[rid] = trailer.first_token
        except Exception as exc:  # noqa: BLE001 - every failure poisons the pair group
            why = failure_reason(exc)
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
        planes = wire_planes(self.owner.pool)
        if h.status == WireStatus.OK and d.num_blocks > 0 and (
            h.num_blocks != d.num_blocks or h.bytes_per_block != d.bytes_per_block
            or not 1 <= h.chunk_planes <= planes or not 1 <= h.chunk_blocks <= d.num_blocks
            or (h.chunk_planes > 1 and h.chunk_blocks != d.num_blocks)
        ):
            raise ProtocolError(f"header {h} does not match the reserved blocks")

    def _recv_payload(self, group: PairGroup, d: TransferDescriptor, mover: BlockMover,
                      deadline: Deadline, *, land: bool) -> None:
        """Recvs of later chunks stay posted while a chunk is scattered (staging -> pool); a
        chunk contiguous in the pool is received into it directly. With land=False (session
        cancelled or timed out before the payload) everything is drained into staging."""
        chunks = mover.chunks
        if land and len(set(d.gen_block_ids)) != len(d.gen_block_ids):
            raise ValueError("duplicate generation block ids")
        arrivals = LayerArrivals(chunks, self.owner.pool.num_layers, self.owner.pool.num_planes)
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
            arrivals.arrive(i)
            if slot is not None:
                if land:
                    mover.scatter(chunks[i], bufs[slot])
                free.append(slot)
        if not arrivals.complete:  # the session leaves RECEIVING only with every layer here
            raise ProtocolError(f"payload incomplete: {arrivals.layers_landed} layers landed")

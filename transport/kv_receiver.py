"""Generation side of the KV data plane: ``KVReceiver`` runs one thread (``ReceiverPair``, in
kv_receiver_pair.py) and one pair group per context worker it receives from, and receives in
the order the KV requests were issued (pair protocol and failure rule: ``kv_groups``). This
module is what the executor calls (reserve, request, handle, cancel, poll) and what its status
reads; the pairs do the receiving.

Restarts: a context worker advertises a ``locator`` ("host:port#incarnation"), unique per
process. When a generation worker sees a new locator for a context worker, or is told that a
locator is gone, every op for the old one fails at once (no rendezvous with a store that no
longer exists), and requests still carrying it are refused before they touch the pair.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # transport sits below workers: the pool is only a type here
    from .kv_pool import KVPool
from .kv_groups import TransportConfig, layout_of
from .kv_receiver_pair import ControlSink, PairState, ReceiverPair
from .protocol import (
    WHOLE_POOLS, CancelTransfer, HeadSlice, KVRequest, ProtocolError, TransferDone, check_tp,
    decode_message,
)
from .session_sides import ReceiverSessions
from .sessions import TransferResult

MAX_GONE_ENDPOINTS = 1024  # context endpoints remembered as gone (restarts are rare)

log = logging.getLogger("pdserve.transport")


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
                 clock: Callable[[], float] = time.monotonic,
                 control: ControlSink | None = None) -> None:
        self.worker_id = worker_id
        # Bumped whenever a pair's PairState may have changed: a heartbeat goes out of turn on
        # a new value, without asking every pair for its state on each step.
        self._changes = itertools.count(1)
        self.state_version = 0
        # Set (before the first pair exists) by a worker that can reach context workers itself:
        # its pairs then set their groups up eagerly and heal themselves (``ReceiverPair``).
        self.control = control
        self.pool = pool
        self.config = config or TransportConfig()
        self.layout = layout_of(pool)
        self.sessions = ReceiverSessions(worker_id, self.layout, clock=clock,
                                         default_timeout_s=self.config.default_timeout_s)
        # start time: a restarted worker's groups order after (and never reuse keys of) the old
        self.incarnation = time.time_ns()
        self._pairs: dict[str, ReceiverPair] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Layer-wise receives: request id -> the first token from the op's trailer, set by the
        # pair thread before the session completes, taken by the step loop (take_first_token).
        self.first_tokens: dict[int, int] = {}
        # Context endpoints known to be gone (restarted or dead), most recent last; bounded.
        self._gone: dict[str, None] = {}
        self._gone_lock = threading.Lock()
        # ctx worker id -> the (tensor parallel size, rank) it is expected to have: its pair's
        # PairOpen states it (the context worker refuses another), as do requests without one
        self._ctx_tp: dict[str, tuple[int, int]] = {}

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
        self.state_changed()  # the pair on it reports GONE
        if _notify_pair:
            with self._lock:
                pairs = list(self._pairs.values())
            for pair in pairs:
                pair.endpoint_gone(endpoint)

    def state_changed(self) -> None:
        self.state_version = next(self._changes)  # atomic under the GIL, from any thread

    def send_control(self, ctx_worker_id: str, endpoint: str, payload: bytes, name: str) -> None:
        if self.control is None:
            raise RuntimeError("no control sink: this receiver cannot reach context workers")
        self.control(ctx_worker_id, endpoint, payload, name)

    def ctx_tp_of(self, ctx_worker_id: str) -> tuple[int, int]:
        return self._ctx_tp.get(ctx_worker_id, (1, 0))

    def expect_ctx_tp(self, ctx_worker_id: str, tp: tuple[int, int] | None) -> tuple[int, int]:
        """Record (when given) and return the (tensor parallel size, rank) expected of that
        context worker. Recorded before its pair exists, it is what the pair's opens state."""
        if tp is not None:
            check_tp(*tp, ValueError)
            self._ctx_tp[ctx_worker_id] = (int(tp[0]), int(tp[1]))
        return self.ctx_tp_of(ctx_worker_id)

    def connect_peers(self, peers: dict[str, str],
                      ctx_tp: dict[str, tuple[int, int]] | None = None) -> None:
        """The context workers (id -> KV endpoint) to set pairs up with now, before any request
        needs one. A new endpoint for a known worker (it restarted) resets that pair.
        ``ctx_tp``: id -> the (tensor parallel size, rank) each is expected to have."""
        for ctx_worker_id, tp in (ctx_tp or {}).items():
            self.expect_ctx_tp(ctx_worker_id, tp)
        for ctx_worker_id, endpoint in peers.items():
            if endpoint and not self.is_gone(endpoint):
                self._pair(ctx_worker_id, endpoint)

    def pair_states(self) -> dict[str, str]:
        """ctx worker id -> ``PairState`` of each pair."""
        with self._lock:
            pairs = dict(self._pairs)
        return {w: p.state() for w, p in sorted(pairs.items())}

    def pairs_settled(self) -> bool:
        """Every pair's first open has finished (either way): a worker reports healthy only
        then, so that no request meets a pair that is still setting up."""
        with self._lock:
            pairs = list(self._pairs.values())
        return all(not p.eager or p.attempted or p.state() == PairState.GONE for p in pairs)

    def pair_stats(self) -> dict[str, dict[str, object]]:
        """Per pair: state, epoch, opens, open_failures, poisoned, reissued, last_error,
        whether its direct control link is up, how many buffers it has allocated (none per
        transfer once warm: ``StagingRing``), and the latest issue -> header times (ms)."""
        with self._lock:
            pairs = dict(self._pairs)
        out = {}
        for w, p in sorted(pairs.items()):
            state = p.state()
            with p.cond:
                link = p.link
                out[w] = {"state": state, "epoch": p.epoch, **p.stats, "last_error": p.last_error,
                          "link": link is not None and not link.closed,
                          "buffer_allocations": p.staging.allocations,
                          "first_byte_ms": [round(1e3 * x, 4) for x in p.first_byte_s]}
        return out

    def break_pair(self, ctx_worker_id: str) -> bool:
        """Fault injection: cut the pair group's connections (see ``KVSender.break_pair``)."""
        with self._lock:
            pair = self._pairs.get(ctx_worker_id)
        group = pair.group if pair is not None else None
        return group is not None and group.cut() > 0

    def send_direct(self, ctx_worker_id: str, endpoint: str, payload: bytes) -> bool:
        """Send a control message (a KV request or a cancel) over the direct link to that
        context worker, if one is up to ``endpoint``; False otherwise (send it by Ray). The
        caller sends it by Ray as well: the context side runs whichever copy comes first."""
        with self._lock:
            pair = self._pairs.get(ctx_worker_id)
        return pair is not None and pair.send_direct(endpoint, payload)

    def pair_endpoint(self, ctx_worker_id: str) -> str | None:
        """The endpoint the pair with this context worker currently uses (None: no pair yet)."""
        with self._lock:
            pair = self._pairs.get(ctx_worker_id)
        return None if pair is None else pair.endpoint

    def reserve(self, gen_request_id: int, *, ctx_worker_id: str, ctx_endpoint: str,
                ctx_request_id: int, block_ids: list[int] | tuple[int, ...],
                num_cached_blocks: int = 0, timeout_s: float | None = None,
                stream: bool = False, heads: HeadSlice = WHOLE_POOLS,
                ctx_tp: tuple[int, int] | None = None) -> None:
        """``block_ids``: this request's blocks covering the context's blocks, in order; the
        first ``num_cached_blocks`` already hold the KV (own prefix cache) and are not sent.
        ``stream``: layer-wise, the first token comes in the op's trailer. ``heads``: the local
        KV heads that travel (tensor parallelism: one ``tp_map.KVMove``); ``ctx_tp``: the
        context worker's expected (tensor parallel size, rank), None: as recorded (1, 0)."""
        tp = self.expect_ctx_tp(ctx_worker_id, ctx_tp)
        self._pair(ctx_worker_id, ctx_endpoint)
        self.sessions.reserve(gen_request_id, ctx_worker_id=ctx_worker_id,
                              ctx_request_id=ctx_request_id, block_ids=block_ids,
                              num_cached_blocks=num_cached_blocks, timeout_s=timeout_s,
                              stream=stream, heads=heads, ctx_tp=tp)

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
              num_cached_blocks: int = 0, timeout_s: float | None = None,
              stream: bool = False, heads: HeadSlice = WHOLE_POOLS,
              ctx_tp: tuple[int, int] | None = None) -> KVRequest | None:
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
                     num_cached_blocks=num_cached_blocks, timeout_s=timeout_s, stream=stream,
                     heads=heads, ctx_tp=ctx_tp)
        return self.request(gen_request_id)

    def take_first_token(self, gen_request_id: int) -> int | None:
        """The first token a layer-wise receive brought (once, None if none)."""
        return self.first_tokens.pop(gen_request_id, None)

    def handle(self, payload: bytes) -> None:
        """The context worker's TransferDone. A refusal fails the session at once (blocks are
        not written before a payload header, so they are free)."""
        msg = decode_message(payload)
        if not isinstance(msg, TransferDone):
            raise ProtocolError(f"a generation worker does not take {type(msg).__name__}")
        self.on_done(msg)

    def on_done(self, done: TransferDone) -> None:
        if done.transfer_id < 0:  # the answer to a PairOpen
            if not done.ok:
                log.warning("%s: pair open %s failed: %s", self.worker_id, done.group, done.reason)
                with self._lock:
                    pairs = list(self._pairs.values())
                for pair in pairs:
                    pair.open_answered(done.group, done.ok, done.reason)
            return
        if done.ok:
            return
        if done.retryable:
            # The op never began and the context side kept the lease: its group was retired
            # there. This side re-issues it when it moves to a newer group (or the session runs
            # into its deadline); failing it here would race that re-issue.
            return
        rid = self.sessions.find_transfer(done.transfer_id, done.ctx_request_id)
        if rid is None:
            return
        if done.group and self.sessions.current_op(rid) != (done.group, done.seq):
            return  # the answer of an op re-issued since on a newer group
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

    def _pair(self, ctx_worker_id: str, endpoint: str) -> ReceiverPair:
        with self._lock:
            if self._closed:
                raise RuntimeError("transport closed")
            pair = self._pairs.get(ctx_worker_id)
            if pair is None:
                pair = self._pairs[ctx_worker_id] = ReceiverPair(self, ctx_worker_id, endpoint)
                self.state_changed()
        if not self.is_gone(endpoint):  # a stale endpoint never moves the pair back
            pair.set_endpoint(endpoint)
        return pair

"""The one worker host: everything a worker process runs around its core, whatever wraps
it (the Ray actors in ``ray_worker.py``, the plain OS process in ``rpc_worker.py``).

A ``WorkerHost`` owns
- the engine core's thread (the step loop): everything that touches the engine core runs there;
  the outside reaches it by queued commands (``post``, ``call``);
- the one way in for requests, ``submit(WireRequest, sink)``: the request channel, Ray's
  streaming ``generate`` and the RPC worker all use it, and every update of the request goes to
  its ``sink`` on the loop thread (one delivery mode);
- what the request channel server (``channel_server.py``) needs of a worker, its
  ``ChannelHost`` protocol (``kv_events``, ``kv_snapshot``, the hooks, ``submit``, ...). The
  host does not build the server: the process shell that builds the host does (``ray_worker.py``)
  and owns it, so host.py and channel_server.py import nothing of each other;
- the KV control path (``kv_control.py``): after each step the transceiver's outbox goes out
  through a ``ControlPlane`` (Ray calls, or RPC calls in the test workers), in outbox order;
  on a context worker ``kv_control.serve`` answers them.

An abort can overtake its submission (they may travel on different paths): the id is
remembered (bounded) and a later submission with it finishes at once as aborted, so nothing
runs unowned. If the step loop dies, every live request gets a FAILED update and ``on_fatal``
runs (the Ray actor exits so Ray restarts it).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.scheduler import LlmRequest
from pdserve.scheduler.kv_events import BlocksStored, KVEventLog
from pdserve.transport.requests import (
    ErrorKind,
    TransferTotals,
    WireRequest,
    WireUpdate,
    WorkerInfo,
    WorkerStatus,
)

from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.admission import max_request_tokens
from pdserve.workers.engine.core import EngineCore
from pdserve.workers.process.kv_control import ControlPlane, KVControl

log = logging.getLogger("pdserve.worker")

Sink = Callable[[WireUpdate], None]
MAX_TOMBSTONES = 10_000  # aborted ids that were unknown when the abort came (bounded memory)


@dataclass
class Faults:
    """Fault injection for tests, read while running (so turning a stall off releases it)."""

    stall_send_s: float = 0.0  # each KV send stalls this long after its header
    slow_steps_s: float = 0.0  # a pause after each loop turn that has running requests


class RequestStream:
    """A request's updates for a caller that blocks (Ray's ``generate``, the RPC worker):
    a sink feeding a queue; ``get`` waits with a deadline."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[WireUpdate] = queue.SimpleQueue()
        self.finished = False

    def put(self, update: WireUpdate) -> None:
        self._queue.put(update)

    def get(self, timeout: float) -> WireUpdate:
        try:
            update = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no update within {timeout:.1f} s") from None
        if update.finished:
            self.finished = True
        return update

    def collect(self, timeout: float) -> list[WireUpdate]:
        """Every update until the finishing one (each wait bounded by ``timeout``)."""
        out = []
        while not self.finished:
            out.append(self.get(timeout))
        return out


class WorkerHost:
    def __init__(self, core: EngineCore, *, worker_id: str, role: str, config: EngineConfig,
                 control: ControlPlane | None = None,
                 metrics: Any = None, faults: Faults | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 idle_wait_s: float = 0.05, incarnation: int | None = None) -> None:
        self.core = core
        self.worker_id = worker_id
        self.role = role
        self.config = config
        self.kv_control = KVControl(worker_id, core.transceiver, control)
        receiver = core.transceiver.receiver if core.transceiver is not None else None
        self.receiver = receiver
        if receiver is not None and control is not None:
            # pairs set their groups up and heal themselves, sending their own control messages
            receiver.control = self.kv_control.send_from_transport
        # A generation worker reports healthy once it was told its context peers (KvPeers)
        # and each pair's first set-up is over; other roles at once.
        self.peers_known = receiver is None
        self._joined = False
        self.metrics = metrics  # observe(core) after steps, tick(core) every turn
        self.faults = faults or Faults()
        self.on_fatal = on_fatal
        self.idle_wait_s = idle_wait_s
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        self.loop_error: BaseException | None = None
        self._tombstones: collections.OrderedDict[int, None] = collections.OrderedDict()
        # (fn, future to answer, or None for a posted command nobody waits on)
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Future | None]] = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._flush_hooks: list[Callable[[], None]] = []  # after updates were handed to sinks
        core.deliver_now = self._deliver  # a mid-step update goes out before the forward
        core.flush_control = self.kv_control.flush_outbox  # so do the step's KV requests
        self._tick_hooks: list[Callable[[], None]] = []  # every loop turn (<= idle_wait_s apart)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ lifecycle

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop and the KV control. A request channel server serving this host
        is its builder's to close, before this (so no request arrives at a stopped loop)."""
        self.stop_loop(timeout_s)

    def stop_loop(self, timeout_s: float = 10.0) -> None:
        """Stop the step loop (and the KV control with it); a channel server stays open,
        answering every request with UNAVAILABLE, as a worker whose loop died does."""
        self._stop.set()
        self._thread.join(timeout_s)
        self.kv_control.close()
        if self.core.transceiver is not None:
            self.core.transceiver.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.loop_error is None

    def add_flush_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs on the loop thread whenever updates were handed to sinks."""
        self._flush_hooks.append(hook)

    def add_tick_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs on the loop thread every turn: after each step and at least every
        ``idle_wait_s`` when idle. A stuck step stops the ticks (a heartbeat sent from here
        proves the loop is alive). Keep it cheap."""
        self._tick_hooks.append(hook)

    # ------------------------------------------------------------------ requests (thread-safe)

    def submit(self, wire: WireRequest, sink: Sink) -> bool:
        """The one way in. Never raises: a request the worker refuses gets one FAILED update
        (REJECTED when the request itself is invalid, UNAVAILABLE when the loop is dead).
        Returns False when that update was given at once, on the caller's thread."""
        rid = wire.request_id
        try:
            request = wire.to_llm_request()
            params = wire.sampling
        except (ValueError, TypeError) as exc:
            sink(WireUpdate.failed(rid, ErrorKind.REJECTED, f"{type(exc).__name__}: {exc}"))
            return False
        deadline = None if wire.deadline_s is None else time.monotonic() + wire.deadline_s

        def add() -> None:  # on the loop thread
            if rid in self._tombstones:
                del self._tombstones[rid]
                sink(WireUpdate.aborted(rid))
            else:
                try:
                    self.core.add_request(request, params, deadline=deadline,
                                              forced_tokens=wire.forced_tokens,
                                              stream_kv=wire.stream_kv,
                                              output_start=wire.output_start,
                                              choice_tokens=wire.choice_tokens)
                except ValueError as exc:
                    sink(WireUpdate.failed(rid, ErrorKind.REJECTED, str(exc)))
                except Exception as exc:  # refused for another reason: the loop goes on
                    sink(WireUpdate.failed(rid, ErrorKind.WORKER, repr(exc)))
                else:
                    self._sinks[rid] = sink
            self._run_flush_hooks()

        try:
            self.post(add)
        except RuntimeError as exc:
            sink(WireUpdate.failed(rid, ErrorKind.UNAVAILABLE, str(exc)))
            return False
        return True

    def stream(self, wire: WireRequest) -> RequestStream:
        """``submit`` for a caller that blocks on the updates."""
        stream = RequestStream(wire.request_id)
        self.submit(wire, stream.put)
        return stream

    def abort(self, request_id: int) -> None:
        """Thread-safe and fire-and-forget: the request's sink gets its ABORTED update."""
        try:
            self.post(lambda: self.abort_now(request_id))
        except RuntimeError:  # the loop is dead: nothing runs to abort
            pass

    def abort_now(self, request_id: int) -> bool:
        """On the loop thread: abort, or remember the id if it is not here yet."""
        update = self.core.abort(request_id)
        if update is None:
            self._tombstones[request_id] = None  # its submission may still be on the way
            while len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
            return False
        self._deliver([update])
        return True

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop thread without waiting; its errors are logged."""
        if not self.alive:
            raise RuntimeError(f"{self.worker_id} loop is not running: {self.loop_error!r}")
        self._commands.put((fn, None))

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0) -> object:
        """Run ``fn`` on the loop thread (it may touch the engine core) and return its result."""
        if not self.alive:
            raise RuntimeError(f"{self.worker_id} loop is not running: {self.loop_error!r}")
        future: Future = Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout_s)

    # ------------------------------------------------------------------ what the worker is

    def info(self, vocab_size: int) -> WorkerInfo:
        """Who this worker is. ``request_endpoint`` and ``request_token`` are empty: the shell
        that built a request channel server for this host fills them in from it."""
        ex = self.core
        return WorkerInfo(
            worker_id=self.worker_id, role=self.role, pid=os.getpid(),
            num_kv_blocks=ex.kv.num_blocks, tokens_per_block=self.config.tokens_per_block,
            max_batch_size=self.config.max_batch_size, max_input_len=ex.max_input_len,
            max_seq_len=ex.max_seq_len, max_num_tokens=self.config.max_num_tokens,
            max_request_tokens=max_request_tokens(ex.kv, ex.limits.pool_blocks, ex.max_seq_len),
            vocab_size=vocab_size,
            endpoint=ex.transceiver.endpoint if ex.transceiver is not None else "",
            incarnation=self.incarnation, request_endpoint="", request_token="")

    @property
    def ready(self) -> bool:
        """Alive, and (generation side) its KV pairs with the context peers it was told of
        are set up, or tried: a pair that failed to open is left to routing, which sends no
        transfer over a pair that is not ready."""
        if not self.alive:
            return False
        if not self._joined:  # only joining waits for pairs; a peer's restart later must not
            # make this worker unhealthy (the router routes around a pair that is not ready)
            self._joined = self.receiver is None or (self.peers_known and self.receiver.pairs_settled())
        return self._joined

    def pair_version(self) -> int:
        """Changes whenever a KV pair's state may have (0 without a receiver): cheap to poll."""
        return self.receiver.state_version if self.receiver is not None else 0

    def pair_states(self) -> dict[str, str]:
        """ctx worker id -> its KV pair's state (generation side; empty otherwise)."""
        return self.receiver.pair_states() if self.receiver is not None else {}

    def connect_kv_peers(self, peers: dict[str, str]) -> None:
        """The router's ``KvPeers``: set KV pairs up with these context workers now."""
        if self.receiver is None:
            return
        self.receiver.connect_peers(peers)
        self.peers_known = True

    @property
    def kv_events(self) -> KVEventLog | None:
        """The KV cache's event log (None without block reuse): what a request channel server
        batches to the router's prefix index."""
        return self.core.kv.kv_events

    def kv_snapshot(self) -> list[BlocksStored]:
        """On the loop thread: the whole prefix cache as events (a router's resync)."""
        return self.core.kv.kv_snapshot()

    def status(self, *, drain_events: bool) -> WorkerStatus:
        """On the loop thread: the worker's status as of its last step. ``drain_events``: take
        the transfer, pause and resume events since the previous drain (heartbeats do)."""
        s = worker_status(self.core, self.worker_id, self.role, self.config,
                          incarnation=self.incarnation, healthy=self.ready,
                          drain_events=drain_events)
        if self.receiver is not None:
            s = dataclasses.replace(s, kv_pairs=self.pair_states())
        return s

    def status_map(self) -> dict[str, Any]:
        """On the loop thread, for tools and tests: ``EngineCore.status()`` (transfer records
        included) plus who this worker is."""
        s = self.core.status(records=True)
        if self.receiver is not None:
            s["kv_pairs"] = self.receiver.pair_stats()
        s.update(worker_id=self.worker_id, role=self.role, healthy=self.ready, pid=os.getpid(),
                 incarnation=self.incarnation, max_batch_size=self.config.max_batch_size,
                 tokens_per_block=self.config.tokens_per_block,
                 generated_tokens=self.core.stats.generated_tokens,
                 context_tokens=self.core.stats.context_tokens,
                 paused_requests=len(self.core.paused_since),
                 capacity_policy=self.config.capacity_scheduler_policy.name)
        return s

    # ------------------------------------------------------------------ test hooks

    def test_hook(self, name: str, *args: Any) -> Any:
        """``stall_send(seconds)``, ``slow_steps(seconds)`` (0 turns either off);
        ``break_pair(peer_worker_id)``: cut that KV pair group's connections;
        ``leak_blocks(request_id, num_tokens)``: blocks held by no live request (an invariant
        violation); ``release_leak(request_id)``; ``hold_stream(layers, seconds, until_sending)``:
        the forward of a layer-wise request's last chunk stops after that many layers until
        ``release_stream`` (or, with until_sending, until the send of one of them has begun:
        the others queue behind it on the pair),
        for at most ``seconds`` (0 turns it off)."""
        if name == "hold_stream":
            self.core.layer_hook = (_StreamHold(self.core, int(args[0]), float(args[1]),
                                                    bool(args[2])) if float(args[1]) > 0 else None)
            return True
        if name == "release_stream":
            hold = self.core.layer_hook
            if isinstance(hold, _StreamHold):
                hold.release.set()
            return hold is not None
        if name == "stall_send":
            self.faults.stall_send_s = float(args[0])
            return self.faults.stall_send_s
        if name == "slow_steps":
            self.faults.slow_steps_s = float(args[0])
            return self.faults.slow_steps_s
        if name == "break_pair":  # cut the KV pair group's connections with that peer, as a
            # dying peer or a broken network would; the pair rebuilds itself. Only the side
            # whose gloo listener accepted the connection can find it: False on the other.
            t = self.core.transceiver
            side = None if t is None else (t.sender or t.receiver)
            return side is not None and side.break_pair(str(args[0]))
        kv = self.core.kv
        if name == "leak_blocks":
            rid, num_tokens = int(args[0]), int(args[1])
            return self.call(lambda: kv.add_sequence(LlmRequest(rid, [0] * num_tokens, 1)))
        if name == "release_leak":
            return self.call(lambda: kv.remove_sequence(int(args[0])))
        raise ValueError(f"unknown test hook {name!r}")

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        ex = self.core
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not ex.has_work)
                if ex.has_work:
                    updates = ex.step()
                    self._deliver(updates)
                    if self.metrics is not None:
                        self.metrics.observe(ex)
                    self.kv_control.flush_outbox()
                    if not updates and not ex.active and not ex.waiting:
                        # Only transfers are pending: poll them gently, not in a busy loop.
                        self._drain_commands(block=True, wait_s=0.002)
                if self.faults.slow_steps_s > 0 and ex.active:
                    time.sleep(self.faults.slow_steps_s)
                if self.metrics is not None:  # gauges are re-set even when idle
                    self.metrics.tick(ex)
                for hook in self._tick_hooks:
                    hook()
        except BaseException as exc:  # the worker is broken: say so to every waiter
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        self.loop_error = exc
        log.exception("%s loop died", self.worker_id)
        for rid, sink in self._sinks.items():
            # UNAVAILABLE: the worker is going down (it exits for a restart), not just this request
            sink(WireUpdate.failed(rid, ErrorKind.UNAVAILABLE, f"worker loop died: {exc!r}"))
        self._sinks.clear()
        self._run_flush_hooks()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.set_exception(RuntimeError(f"{self.worker_id} loop died: {exc!r}"))
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _drain_commands(self, block: bool, wait_s: float | None = None) -> None:
        timeout = (self.idle_wait_s if wait_s is None else wait_s) if block else 0.0
        while True:
            try:
                fn, future = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            try:
                result = fn()
            except Exception as exc:  # reported to the caller, the loop goes on
                if future is None:
                    log.exception("%s: a posted command failed", self.worker_id)
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _deliver(self, updates: list[WireUpdate]) -> None:
        sinks = self._sinks
        for update in updates:
            sink = sinks.get(update.request_id)
            if sink is None:
                continue
            sink(update)
            if update.finished:
                del sinks[update.request_id]
        if updates:
            self._run_flush_hooks()

    def _run_flush_hooks(self) -> None:
        for hook in self._flush_hooks:
            try:
                hook()
            except Exception:  # a broken writer must not take the step loop down with it
                log.exception("%s: a flush hook failed", self.worker_id)


class _StreamHold:
    """Fault injection (``hold_stream``): stop a layer-wise forward after ``layers`` layers, so
    a test can see the KV request meet a prefill that is still running, or cancel mid-stream."""

    def __init__(self, core: EngineCore, layers: int, seconds: float, until_sending: bool) -> None:
        self.core, self.layers, self.seconds = core, layers, seconds
        self.until_sending = until_sending
        self.release = threading.Event()

    def __call__(self, request_ids: list[int], layers: int) -> None:
        if layers != self.layers:
            return
        sessions = self.core.transceiver.sender.sessions
        end = time.monotonic() + self.seconds
        while time.monotonic() < end and not self.release.is_set():
            if self.until_sending and any(sessions.in_flight(rid) for rid in request_ids):
                return
            self.release.wait(0.005)


def worker_status(ex: EngineCore, worker_id: str, role: str, config: EngineConfig, *,
                  incarnation: int, healthy: bool, drain_events: bool) -> WorkerStatus:
    """The one builder of a worker's ``WorkerStatus`` (heartbeats, status answers, the events
    benchmark), on the thread that owns ``ex``."""
    s = ex.status(records=False)
    t = s["transfers"] or {}
    return WorkerStatus(
        worker_id=worker_id, role=role, healthy=healthy, pid=os.getpid(), incarnation=incarnation,
        capacity_policy=config.capacity_scheduler_policy.name,
        max_batch_size=config.max_batch_size, tokens_per_block=config.tokens_per_block,
        num_active=s["num_active"], queue_depth=s["queue_depth"],
        requests_by_state=s["requests_by_state"], free_blocks=s["free_blocks"],
        total_blocks=s["total_blocks"], quarantined_blocks=s["quarantined_blocks"],
        pauses=s["pauses"], paused_requests=len(ex.paused_since),
        queued_prefill_tokens=s["queued_prefill_tokens"],
        unexpected_recomputes=ex.stats.unexpected_recomputes,
        generated_tokens=ex.stats.generated_tokens, context_tokens=ex.stats.context_tokens,
        steps=s["steps"], transfers=TransferTotals(**{k: t[k] for k in _TRANSFER_FIELDS if k in t}),
        violations=s["violations"], events=ex.events.drain() if drain_events else [])


_TRANSFER_FIELDS = ("sent", "received", "failed", "bytes_sent", "bytes_received", "seconds",
                    "outcomes")

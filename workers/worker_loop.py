"""A worker's driver: runs the executor's step loop on its own thread and gives the outside
(Ray actor methods, or an RPC server in tests) a thread-safe API.

Everything that touches the executor runs on the loop thread: submissions and aborts are
commands queued to it. KV control messages the executor emits (its transceiver's outbox) are
delivered either by ``send_control(ctx_worker_id, payload, endpoint, task_name)`` (the Ray
actors: issued on the loop thread in outbox order, the endpoint lets a restarted context worker
refuse messages meant for its previous incarnation) or, without it, on a small thread pool
through ``deliver(ctx_worker_id, payload) -> reply`` (the RPC worker processes); replies go back
through the transceiver's thread-safe inbox. A failed delivery fails the transfer at once instead of letting
it run into its deadline.

An abort can overtake its submission (they travel on different channels): the id is remembered
(bounded) and a later submission with it finishes at once as aborted, so nothing runs unowned.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from pdserve.scheduler import LlmRequest
from pdserve.transport.protocol import KVRequest, TransferDone, decode_message, encode_message

from .executor import Executor, RequestUpdate
from .sampling import SamplingParams

log = logging.getLogger("pdserve.worker_loop")

Deliver = Callable[..., "bytes | None"]
SendControl = Callable[[str, bytes, str, str], Callable[[], "bytes | None"]]
MAX_TOMBSTONES = 10_000  # aborted ids that were unknown when the abort came (bounded memory)


class RequestStream:
    """The updates of one request, in order; ``get`` waits with a deadline."""

    def __init__(self, request_id: int) -> None:
        self.request_id = request_id
        self._queue: queue.Queue[RequestUpdate] = queue.Queue()
        self.finished = False

    def put(self, update: RequestUpdate) -> None:
        self._queue.put(update)

    def get(self, timeout: float) -> RequestUpdate:
        try:
            update = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"request {self.request_id}: no update within {timeout:.1f} s") from None
        if update.finished:
            self.finished = True
        return update

    def collect(self, timeout: float) -> list[RequestUpdate]:
        """Every update until the finishing one (each wait bounded by ``timeout``)."""
        out = []
        while not self.finished:
            out.append(self.get(timeout))
        return out


class _SinkStream:
    """A request's updates handed to a callback on the loop thread as they happen (the
    request channel writes them out at the end of the step)."""

    def __init__(self, request_id: int, sink: Callable[[RequestUpdate], None]) -> None:
        self.request_id = request_id
        self.sink = sink

    def put(self, update: RequestUpdate) -> None:
        self.sink(update)


class WorkerLoop:
    def __init__(
        self,
        executor: Executor,
        *,
        name: str = "worker",
        deliver: Deliver | None = None,
        idle_wait_s: float = 0.05,
        on_step: Callable[[list[RequestUpdate]], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        send_control: SendControl | None = None,
    ) -> None:
        self.executor = executor
        self.on_step = on_step  # e.g. metrics; runs on the loop thread after every step
        self.on_fatal = on_fatal  # the loop died: e.g. exit the process so it is restarted
        self.name = name
        self.deliver = deliver
        # Issues a control message now and returns a function that waits for its reply: called
        # on the loop thread, in outbox order, so KV requests reach a context worker in the
        # order of their seqs (its pair thread serves them in that order; out-of-order arrival
        # can fill its transfer threads with requests that all wait for an earlier one).
        self.send_control = send_control
        self.idle_wait_s = idle_wait_s
        self._tombstones: collections.OrderedDict[int, None] = collections.OrderedDict()
        # (fn, future to answer, or None for a posted command nobody waits on)
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Future | None]] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream | _SinkStream] = {}
        self._flush_hooks: list[Callable[[], None]] = []  # run after updates were dispatched
        self._tick_hooks: list[Callable[[], None]] = []  # run every loop turn (<= idle_wait_s apart)
        self._stop = threading.Event()
        self._control = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"{name}-kv-control")
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)
        self.loop_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "WorkerLoop":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._control.shutdown(wait=False, cancel_futures=True)
        if self.executor.transceiver is not None:
            self.executor.transceiver.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.loop_error is None

    # ------------------------------------------------------------------ thread-safe API

    def submit(self, request: LlmRequest, params: SamplingParams, timeout_s: float = 30.0, *,
               deadline: float | None = None, forced_tokens: Sequence[int] = ()) -> RequestStream:
        """Queue a request; raises ValueError (from validation) synchronously. ``deadline`` is
        a time.monotonic() value; see Executor.add_request."""
        stream = RequestStream(request.request_id)
        self._call(lambda: self._add(request, params, stream, deadline, forced_tokens), timeout_s)
        return stream

    def submit_nowait(self, request: LlmRequest, params: SamplingParams,
                      sink: Callable[[RequestUpdate], None],
                      rejected: Callable[[BaseException], None], *,
                      deadline: float | None = None, forced_tokens: Sequence[int] = ()) -> None:
        """Queue a request without waiting for the loop: its updates go to ``sink`` on the loop
        thread; a request the executor refuses goes to ``rejected`` (ValueError: invalid)."""
        stream = _SinkStream(request.request_id, sink)

        def add() -> None:
            try:
                self._add(request, params, stream, deadline, forced_tokens)
            except Exception as exc:  # refused: the loop goes on
                rejected(exc)
            self._run_flush_hooks()

        self.post(add)

    def _add(self, request: LlmRequest, params: SamplingParams,
             stream: "RequestStream | _SinkStream", deadline: float | None,
             forced_tokens: Sequence[int]) -> None:
        """On the loop thread: admit the request (its ValueError propagates), or finish it as
        aborted at once when its abort overtook it."""
        if request.request_id in self._tombstones:
            del self._tombstones[request.request_id]
            stream.put(RequestUpdate(request.request_id, [], True, "abort"))
            return
        self.executor.add_request(request, params, deadline=deadline, forced_tokens=forced_tokens)
        self._streams[request.request_id] = stream

    def abort(self, request_id: int, timeout_s: float = 30.0) -> bool:
        return bool(self._call(lambda: self.abort_now(request_id), timeout_s))

    def abort_now(self, request_id: int) -> bool:
        """On the loop thread (see ``post``): abort, or remember the id if it is not here yet."""
        update = self.executor.abort(request_id)
        if update is None:
            self._tombstones[request_id] = None  # its submission may still be on the way
            while len(self._tombstones) > MAX_TOMBSTONES:
                self._tombstones.popitem(last=False)
            return False
        self._dispatch([update])
        return True

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the loop thread without waiting for it; its errors are logged."""
        if not self.alive:
            raise RuntimeError(f"{self.name} loop is not running: {self.loop_error!r}")
        self._commands.put((fn, None))

    def add_flush_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs on the loop thread whenever updates were dispatched."""
        self._flush_hooks.append(hook)

    def add_tick_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs on the loop thread every turn of the loop: after each step, and at
        least every ``idle_wait_s`` when idle. A stuck step stops the ticks (that is the point:
        a heartbeat sent from here proves the loop is alive). Keep it cheap."""
        self._tick_hooks.append(hook)

    def call(self, fn: Callable[[], object], timeout_s: float = 30.0) -> object:
        """Run ``fn`` on the loop thread (it may touch the executor) and return its result."""
        return self._call(fn, timeout_s)

    def status(self, timeout_s: float = 30.0) -> dict:
        return self._call(self.executor.status, timeout_s)  # type: ignore[return-value]

    def handle_kv_control(self, payload: bytes) -> bytes | None:
        """Context side, on the caller's thread: a KV request (answered once the send is over)
        or a cancel. The transport's sessions are thread-safe."""
        transceiver = self.executor.transceiver
        if transceiver is None or transceiver.sender is None:
            raise RuntimeError(f"{self.name} has no KV sender")
        return transceiver.sender.handle(payload)

    # ------------------------------------------------------------------ loop thread

    def _call(self, fn: Callable[[], object], timeout_s: float) -> object:
        if not self.alive:
            raise RuntimeError(f"{self.name} loop is not running: {self.loop_error!r}")
        future: Future = Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.executor.has_work)
                if self.executor.has_work:
                    updates = self.executor.step()
                    self._dispatch(updates)
                    if self.on_step is not None:
                        self.on_step(updates)
                    self._flush_outbox()
                    if not updates and not self.executor.active and not self.executor.waiting:
                        # Only transfers are pending: poll them gently, not in a busy loop.
                        self._drain_commands(block=True, wait_s=0.002)
                for hook in self._tick_hooks:
                    hook()
        except BaseException as exc:  # the worker is broken: say so to every waiter
            self.loop_error = exc
            log.exception("%s loop died", self.name)
            for stream in self._streams.values():
                stream.put(RequestUpdate(stream.request_id, [], True, "error", None, f"worker loop died: {exc!r}"))
            self._streams.clear()
            try:
                self._run_flush_hooks()
            except Exception:
                log.exception("%s: flushing the last updates failed", self.name)
            while True:
                try:
                    _, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                if future is not None:
                    future.set_exception(RuntimeError(f"{self.name} loop died: {exc!r}"))
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
                    log.exception("%s: a posted command failed", self.name)
                else:
                    future.set_exception(exc)
            else:
                if future is not None:
                    future.set_result(result)

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue
            stream.put(update)
            if update.finished:
                del self._streams[update.request_id]
        if updates:
            self._run_flush_hooks()

    def _run_flush_hooks(self) -> None:
        for hook in self._flush_hooks:
            try:
                hook()
            except Exception:  # a broken writer must not take the step loop down with it
                log.exception("%s: a flush hook failed", self.name)

    def _flush_outbox(self) -> None:
        transceiver = self.executor.transceiver
        if transceiver is None:
            return
        while True:
            try:
                ctx_worker_id, payload, endpoint, task_name = transceiver.outbox.get_nowait()
            except queue.Empty:
                return
            if self.send_control is None:
                self._control.submit(self._deliver_one, ctx_worker_id, payload)
                continue
            try:
                wait = self.send_control(ctx_worker_id, payload, endpoint, task_name)
            except Exception as exc:
                self._control_failed(ctx_worker_id, payload, exc)
            else:
                self._control.submit(self._await_reply, ctx_worker_id, payload, wait)

    def _await_reply(self, ctx_worker_id: str, payload: bytes,
                     wait: Callable[[], "bytes | None"]) -> None:
        try:
            self.executor.transceiver.deliver_reply(wait())
        except Exception as exc:
            self._control_failed(ctx_worker_id, payload, exc)

    def _deliver_one(self, ctx_worker_id: str, payload: bytes) -> None:
        transceiver = self.executor.transceiver
        try:
            if self.deliver is None:
                raise RuntimeError("no control plane to reach context workers")
            transceiver.deliver_reply(self.deliver(ctx_worker_id, payload))
        except Exception as exc:
            self._control_failed(ctx_worker_id, payload, exc)

    def _control_failed(self, ctx_worker_id: str, payload: bytes, exc: BaseException) -> None:
        msg = decode_message(payload)
        log.warning("%s: KV control message to %s failed: %r", self.name, ctx_worker_id, exc)
        if isinstance(msg, KVRequest):  # fail the receive now rather than at its deadline
            done = TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                f"control plane to {ctx_worker_id}: {exc!r}", 0, 0.0)
            self.executor.transceiver.deliver_reply(encode_message(done))

"""What the context and generation Ray actors share: build the executor with its KV transceiver,
run it on a WorkerLoop, serve the router's request channel (requests in, updates out as each
step produces them; ``request_channel.py``) and, for callers holding only an actor handle, a Ray
streaming ``generate``; and serve KV control messages in a dedicated concurrency group (so each
transfer is its own task, with its duration, in the dashboard's task view).

The actor classes themselves (``context_worker.py``, ``generation_worker.py``) only pick the
role; Ray's decorator is applied there.

Faults: Ray restarts a dead worker (``max_restarts``); the new process has a new incarnation and
a new KV endpoint, which travels to generation workers inside the context-phase params. A KV
control message addressed to a previous incarnation's endpoint is refused (``endpoint_gone``),
and the generation side then fails every transfer still aimed at it instead of waiting for a
store that no longer exists. If the step loop itself dies the process exits, so Ray restarts it.
Wire requests carry ``deadline_s`` (seconds left when sent); the executor aborts a request past
it. ``test_hook`` injects faults for tests (stalled sends, leaked blocks).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

from pdserve.scheduler import LlmRequest
from pdserve.transport.protocol import KVRequest, TransferDone, decode_message, encode_message

from . import events
from .config import EngineConfig
from .engine import build_executor
from .request_channel import RequestChannelServer
from .sampling import SamplingParams
from .transceiver import KVTransceiver
from .names import NAMESPACE, actor_name
from .wire import request_from_wire, update_to_wire
from .worker_loop import WorkerLoop

log = logging.getLogger("pdserve.worker")

# Cached-prefix hashes advertised to the router's kv_cache_aware policy (most recent first).
MAX_ADVERTISED_HASHES = 50_000
# Longest wait for one update of a request without a deadline.
UPDATE_WAIT_S = 600.0
FATAL_EXIT_DELAY_S = 1.0  # lets the error updates reach the router before the process exits


class KVTransferFailed(RuntimeError):
    """Raised by ``kv_transfer`` when the send failed, so the dashboard shows the task FAILED
    with the reason; ``payload`` is the encoded ``TransferDone`` the caller still needs."""

    def __init__(self, message: str, payload: bytes = b"") -> None:
        super().__init__(message, payload)  # both in args: the exception crosses processes
        self.payload = payload

    def __str__(self) -> str:
        return str(self.args[0])


def _node_ip() -> str:
    """The address other nodes reach this worker on (127.0.0.1 on a one-machine cluster)."""
    import ray

    return ray.util.get_node_ip_address()


class WorkerActorBase:
    role: str = "context"

    def __init__(
        self,
        worker_id: str,
        model_dir: str,
        engine: dict[str, Any],
        *,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 30.0,
        torch_threads: int | None = None,
        metrics: Callable[[str, str], Any] | None = None,
        stall_send_s: float = 0.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        import torch

        from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig

        if torch_threads:
            torch.set_num_threads(torch_threads)
        events.route_to_stderr()  # transfers, pauses, resumes on the actor's log page
        self.worker_id = worker_id
        self.incarnation = time.time_ns()
        self.config = EngineConfig.from_kwargs(engine)
        self.transfer_timeout_s = transfer_timeout_s
        self._stall_send_s = stall_send_s  # test hook; changed at run time by test_hook
        self._slow_steps_s = 0.0  # test hook: a pause after each step that has running requests
        self._ctx_handles: dict[str, Any] = {}
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._hashes_lock = threading.Lock()  # advertised from several threads

        def transceiver_factory(pool) -> KVTransceiver:
            sender = receiver = None
            if self.role == "context":
                def hook(descriptor, chunk_index):  # fault injection for tests: stall each send
                    # Re-read while waiting, so turning the stall off releases a stalled send.
                    start = time.monotonic()
                    while chunk_index == 0 and time.monotonic() - start < self._stall_send_s:
                        time.sleep(0.01)

                sender = KVSender(worker_id, pool, send_hook=hook,
                                  config=TransportConfig(default_timeout_s=lease_s,
                                                         connect_timeout_s=connect_timeout_s))
            else:
                receiver = KVReceiver(worker_id, pool,
                                      config=TransportConfig(default_timeout_s=transfer_timeout_s,
                                                             connect_timeout_s=connect_timeout_s))
            return KVTransceiver(worker_id, sender=sender, receiver=receiver, lease_s=lease_s,
                                 transfer_timeout_s=transfer_timeout_s)

        self.loaded, self.executor = build_executor(model_dir, self.config,
                                                    transceiver_factory=transceiver_factory)
        # Injected (cluster.metrics.WorkerMetrics from launch): workers never import cluster/.
        # Called as metrics(role, the actor's name); None records nothing.
        self.metrics = metrics(self.role, actor_name(worker_id)) if metrics is not None else None
        self.loop = WorkerLoop(self.executor, name=worker_id, send_control=self._send_control,
                               on_step=self._on_step,
                               on_fatal=self._on_fatal)
        self.loop.add_tick_hook(self._slow_step)
        self.loop.add_tick_hook(self._metrics_tick)
        self.loop.start()
        # The router's request data path (see request_channel.py); Ray's ``generate`` stays for
        # callers that hold only an actor handle.
        self.channel = RequestChannelServer(self.loop, self._from_wire, update_to_wire,
                                            host=_node_ip(), name=worker_id,
                                            on_submit=self._on_channel_submit,
                                            heartbeat_status=self._heartbeat_status)
        log.info("%s ready: %d KV blocks of %d tokens", worker_id, self.executor.kv.num_blocks,
                 self.config.tokens_per_block)

    # ------------------------------------------------------------------ actor methods

    def info(self) -> dict[str, Any]:
        cfg = self.loaded.config
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "pid": os.getpid(),
            "num_kv_blocks": self.executor.kv.num_blocks,
            "tokens_per_block": self.config.tokens_per_block,
            "max_batch_size": self.config.max_batch_size,
            "max_input_len": self.executor.max_input_len,
            "max_seq_len": self.executor.max_seq_len,
            "vocab_size": cfg.vocab_size,
            "endpoint": self.executor.transceiver.endpoint,
            "incarnation": self.incarnation,
            "request_endpoint": self.channel.endpoint,
            "request_token": self.channel.token,
        }

    def generate(self, wire: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Streams the request's updates (a Ray streaming generator). ``wire["deadline_s"]``:
        seconds the request has left; the executor aborts it once they are up."""
        request, params, deadline, forced = self._from_wire(wire)
        stream = self.loop.submit(request, params, deadline=deadline, forced_tokens=forced)
        self._on_channel_submit(request)
        while not stream.finished:
            wait = UPDATE_WAIT_S
            if deadline is not None:  # the executor ends it at the deadline; allow a margin
                wait = min(wait, max(0.0, deadline - time.monotonic()) + 30.0)
            yield update_to_wire(stream.get(wait))

    def request_channel(self) -> dict[str, Any]:
        """The request channel's endpoint and open router connections."""
        return {"endpoint": self.channel.endpoint, "connections": self.channel.num_connections}

    def abort(self, request_id: int) -> bool:
        return self.loop.abort(request_id)

    def status(self) -> dict[str, Any]:
        """For tools and tests (the router reads heartbeats): with the last transfer records."""
        return self.loop.call(lambda: self._status(records=True))  # type: ignore[return-value]

    def _status(self, *, records: bool) -> dict[str, Any]:
        """On the loop thread: ``Executor.status()`` plus who this worker is and its cumulative
        token counts."""
        ex = self.executor
        status = ex.status(records=records)
        status.update(worker_id=self.worker_id, role=self.role, healthy=self.loop.alive,
                      max_batch_size=self.config.max_batch_size,
                      tokens_per_block=self.config.tokens_per_block, pid=os.getpid(),
                      incarnation=self.incarnation, generated_tokens=ex.stats.generated_tokens,
                      context_tokens=ex.stats.context_tokens,
                      paused_requests=len(ex.paused_since),
                      capacity_policy=self.config.capacity_scheduler_policy.name)
        return status

    def _heartbeat_status(self) -> dict[str, Any]:
        """On the loop thread, once per heartbeat or status op: the status without the transfer
        records (never built) and the events since the previous one."""
        status = self._status(records=False)
        status["events"] = self.executor.events.drain()
        return status

    def __repr__(self) -> str:
        # The dashboard's Actors page shows this as the actor's Repr.
        return f"{type(self).__name__}({self.worker_id})"

    def request_states(self) -> dict[int, str]:
        """Every live request's state (see Executor.request_states), keyed by request id."""
        return self.loop.call(self.executor.request_states)  # type: ignore[return-value]

    def test_hook(self, name: str, *args: Any) -> Any:
        """Fault injection for tests. ``stall_send(seconds)``: each KV send stalls that long
        after its header (0 turns it off). ``slow_steps(seconds)``: a slow worker, pausing that
        long after each step while requests run (0 turns it off).
        ``leak_blocks(request_id, num_tokens)``: blocks held by no live request (an invariant
        violation). ``release_leak(request_id)``."""
        if name == "stall_send":
            self._stall_send_s = float(args[0])
            return self._stall_send_s
        if name == "slow_steps":
            self._slow_steps_s = float(args[0])
            return self._slow_steps_s
        if name == "leak_blocks":
            rid, num_tokens = int(args[0]), int(args[1])
            kv = self.executor.kv
            return self.loop.call(lambda: kv.add_sequence(LlmRequest(rid, [0] * num_tokens, 1)))
        if name == "release_leak":
            rid = int(args[0])
            return self.loop.call(lambda: self.executor.kv.remove_sequence(rid))
        raise ValueError(f"unknown test hook {name!r}")

    def _slow_step(self) -> None:
        if self._slow_steps_s > 0 and self.executor.active:  # loop thread: a tick hook
            time.sleep(self._slow_steps_s)

    def cached_block_hashes(self) -> list[int]:
        with self._hashes_lock:
            return list(self._hashes)

    def kv_transfer(self, payload: bytes, endpoint: str | None = None) -> bytes | None:
        """Runs in the "transfer" concurrency group: returns when the bytes have landed.
        ``endpoint``: the KV endpoint the sender meant; another incarnation's is refused.

        Each call is one row of the dashboard's task table, named by the generation worker
        (``events.transfer_task_name``). A send that fails raises ``KVTransferFailed`` so the
        row shows FAILED with the reason; the line logged here (the row's "Log" link) gives
        the measured duration and GB/s."""
        msg = decode_message(payload)
        if not isinstance(msg, KVRequest):
            if endpoint is not None and endpoint != self.executor.transceiver.endpoint:
                return None  # a cancel for a previous incarnation: nothing of it is left here
            return self.loop.handle_kv_control(payload)
        held = self.executor.transceiver.transmitting.get(msg.ctx_request_id)  # a dict read
        client = events.label(msg.ctx_request_id, held.client_id if held is not None else None)
        if endpoint is not None and endpoint != self.executor.transceiver.endpoint:
            reply = encode_message(TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                                f"endpoint gone: {endpoint}", 0, 0.0,
                                                endpoint_gone=True))
        else:
            reply = self.loop.handle_kv_control(payload)
        done = decode_message(reply) if reply else None
        planned = msg.num_blocks * msg.bytes_per_block
        if isinstance(done, TransferDone) and done.ok:
            events.log.info("%s", events.transfer_line(
                "send", client, self.worker_id, msg.gen_worker_id, msg.num_blocks, done.nbytes,
                done.seconds, "SENT"))
            return reply
        reason = done.reason if isinstance(done, TransferDone) else "no answer from the send"
        events.log.info("%s", events.transfer_line(
            "send", client, self.worker_id, msg.gen_worker_id, msg.num_blocks, planned,
            done.seconds if isinstance(done, TransferDone) else 0.0, "FAILED", reason))
        raise KVTransferFailed(f"KV transfer of req={client} to {msg.gen_worker_id} failed: "
                               f"{reason}", reply or b"")

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        self.channel.close()
        self.loop.stop()

    # ------------------------------------------------------------------ internals

    def _send_control(self, ctx_worker_id: str, payload: bytes, endpoint: str, task_name: str):
        """On the loop thread, in outbox order: submit the control message as a ``kv_transfer``
        call named ``task_name`` (the dashboard's task table shows the name; a Ray call from
        one thread starts on the actor in submission order) and return the wait for its
        reply, which a control-pool thread runs."""
        import ray

        handle = self._ctx_handles.get(ctx_worker_id)
        if handle is None:
            handle = ray.get_actor(actor_name(ctx_worker_id), namespace=NAMESPACE)
            self._ctx_handles[ctx_worker_id] = handle
        ref = handle.kv_transfer.options(name=task_name).remote(payload, endpoint)
        return lambda: self._await_control(ctx_worker_id, ref, endpoint)

    def _await_control(self, ctx_worker_id: str, ref, endpoint: str) -> bytes | None:
        import ray
        from ray.exceptions import ActorDiedError, RayTaskError

        receiver = self.executor.transceiver.receiver
        try:
            reply = ray.get(ref, timeout=self.transfer_timeout_s + 15.0)
        except RayTaskError as err:
            if not isinstance(err.cause, KVTransferFailed):
                raise
            reply = err.cause.payload or None  # the send's own TransferDone, with its reason
        except ActorDiedError:  # dead for good (no restarts left): so is its endpoint
            self._ctx_handles.pop(ctx_worker_id, None)
            receiver.mark_gone(endpoint)
            raise
        except Exception:
            self._ctx_handles.pop(ctx_worker_id, None)  # a restarted actor gets a fresh handle
            raise
        if reply:
            done = decode_message(reply)
            if isinstance(done, TransferDone) and done.endpoint_gone:
                log.warning("%s: context worker %s restarted; endpoint %s is gone",
                            self.worker_id, ctx_worker_id, endpoint)
                receiver.mark_gone(endpoint)
        return reply

    @staticmethod
    def _from_wire(wire: dict[str, Any]):
        """(request, sampling params, deadline as a time.monotonic() value or None, forced
        tokens); raises ValueError for a malformed request."""
        request, params = request_from_wire(wire), SamplingParams(**wire["sampling"])
        deadline = None
        if wire.get("deadline_s") is not None:
            deadline = time.monotonic() + float(wire["deadline_s"])
        return request, params, deadline, tuple(wire.get("forced_tokens") or ())

    def _on_channel_submit(self, request: LlmRequest) -> None:
        if self.config.enable_block_reuse:
            # Prefilled or received, the prompt's full blocks end up in this worker's cache.
            self._advertise(request.get_prompt_tokens())

    def _advertise(self, prompt: list[int]) -> None:
        from pdserve.scheduler.block_hash import block_hashes

        with self._hashes_lock:
            for h in block_hashes(prompt, self.config.tokens_per_block):
                self._hashes[h] = None
                self._hashes.move_to_end(h)
            while len(self._hashes) > MAX_ADVERTISED_HASHES:
                self._hashes.popitem(last=False)

    def _on_step(self, updates) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.executor)

    def _metrics_tick(self) -> None:
        """Every loop turn, idle included: re-sets the gauges when due (Ray drops a gauge that
        is not re-set; see cluster/metrics.py)."""
        if self.metrics is not None:
            self.metrics.tick(self.executor)

    def _on_fatal(self, exc: BaseException) -> None:
        """The step loop died: exit, so Ray restarts this worker with a fresh state."""
        log.critical("%s: step loop died (%r); exiting for a restart", self.worker_id, exc)

        def exit_later() -> None:
            time.sleep(FATAL_EXIT_DELAY_S)
            os._exit(1)

        threading.Thread(target=exit_later, name="pdserve-fatal-exit", daemon=True).start()

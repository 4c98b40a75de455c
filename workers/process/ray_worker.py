"""What the context and generation Ray actors share: a ``WorkerHost`` (host.py) and the
request channel server serving it (``channel_server.py``; built here, not by the host, so the
two modules import nothing of each other) plus what only Ray gives, the KV control plane over
Ray calls and the actor methods. ``context_worker.py`` and
``generation_worker.py`` apply Ray's decorator and pick the role and concurrency groups.

KV control over Ray: the generation worker sends each control message as a ``kv_transfer``
call to the context worker, named ``kv_transfer req=<id> ctx-0->gen-0 blocks=N bytes=B`` so the
dashboard's task table shows one row per transfer; a Ray call from one thread starts on the
actor in submission order, which keeps the outbox order. A failed send raises
``KVTransferFailed`` on the context worker (the row shows FAILED with the reason) and the
generation side takes the ``TransferDone`` out of the exception.

Faults: Ray restarts a dead worker (``max_restarts``); the new process has a new incarnation and
a new KV endpoint, which travels to generation workers inside the context-phase params. A KV
control message addressed to a previous incarnation's endpoint is refused (``endpoint_gone``).
If the step loop itself dies the process exits, so Ray restarts it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from pdserve.transport.requests import WireRequest, WireUpdate, WorkerInfo

from pdserve.workers.engine import events
from pdserve.workers.process.channel_server import RequestChannelServer
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.build import build_worker_core
from pdserve.workers.process.host import Faults, WorkerHost
from pdserve.workers.process.kv_control import KVTransferFailed, PeerGone
from pdserve.workers.process.names import NAMESPACE, ROUTER_NAME, actor_name
from pdserve.workers.engine.transceiver import ControlMessage

log = logging.getLogger("pdserve.worker")

UPDATE_WAIT_S = 600.0  # longest wait for one update of a request without a deadline
FATAL_EXIT_DELAY_S = 1.0  # lets the error updates reach the router before the process exits
CONTROL_MARGIN_S = 15.0  # a kv_transfer call may take the transfer's timeout plus this


class ModelDirMissing(RuntimeError):
    """The model directory is not on this worker's node (a constructor error: Ray does not
    restart the actor, and `pdserve launch` reports this message)."""


class RayControlPlane:
    """KV control messages as ``kv_transfer`` calls on the context workers' actors."""

    def __init__(self, transfer_timeout_s: float) -> None:
        self.transfer_timeout_s = transfer_timeout_s
        self._handles: dict[str, Any] = {}

    def send(self, message: ControlMessage) -> Callable[[], "bytes | None"]:
        import ray

        handle = self._handles.get(message.ctx_worker_id)
        if handle is None:
            handle = ray.get_actor(actor_name(message.ctx_worker_id), namespace=NAMESPACE)
            self._handles[message.ctx_worker_id] = handle
        method = getattr(handle, message.method)  # kv_transfer, or kv_pair_open
        ref = method.options(name=message.task_name).remote(message.payload, message.endpoint)
        return lambda: self._wait(message.ctx_worker_id, ref)

    def _wait(self, ctx_worker_id: str, ref) -> bytes | None:
        import ray
        from ray.exceptions import ActorDiedError, RayTaskError

        try:
            return ray.get(ref, timeout=self.transfer_timeout_s + CONTROL_MARGIN_S)
        except RayTaskError as err:
            if not isinstance(err.cause, KVTransferFailed):
                raise
            return err.cause.payload or None  # the send's own TransferDone, with its reason
        except ActorDiedError as err:  # dead for good (no restarts left): so is its endpoint
            self._handles.pop(ctx_worker_id, None)
            raise PeerGone(f"{ctx_worker_id}: {err}") from err
        except Exception:
            self._handles.pop(ctx_worker_id, None)  # a restarted actor gets a fresh handle
            raise


class RayWorker:
    """The actor methods; the decorated subclasses only route them to concurrency groups."""

    role: str = "context"

    def __init__(self, worker_id: str, model_dir: str, engine: dict[str, Any], *,
                 lease_s: float = 30.0, transfer_timeout_s: float = 30.0,
                 torch_threads: int | str | None = None, workers_on_node: int = 1,
                 metrics: Callable[[str, str], Any] | None = None, stall_send_s: float = 0.0,
                 connect_timeout_s: float = 30.0, kv_link: bool = True,
                 builtin_model: bool = False, model_commit: str | None = None,
                 follower_env: dict[str, str] | None = None) -> None:
        import ray
        import torch

        if torch_threads == "auto":  # this node's CPUs shared by the pdserve workers on it
            from pdserve.workers.config import auto_threads

            torch_threads = auto_threads(len(os.sched_getaffinity(0)), workers_on_node)
        if torch_threads:
            torch.set_num_threads(torch_threads)
        events.route_to_stderr()  # transfers, pauses, resumes on the actor's log page
        self.worker_id = worker_id
        self.model_name = model_dir  # as launched (a Hub repo id stays one): what status shows
        # Every address this worker advertises is its node's: the request channel, the KV
        # store and the KV link (127.0.0.1 would reach only peers on the same node).
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        if builtin_model and not Path(model_dir).is_dir():
            # The launching node wrote the built-in model; another node writes the same here.
            from pdserve.workers.loading.tiny_model import write_builtin_model

            write_builtin_model(model_dir)
        if model_commit is not None and not Path(model_dir).is_dir():
            # A Hub repo id: this node's own cache (or a download), at the launch node's commit.
            from pdserve.workers.loading.hub import ModelResolveError, resolve_model

            try:
                model_dir = str(resolve_model(model_dir, commit=model_commit).path)
            except ModelResolveError as exc:
                raise ModelDirMissing(f"{worker_id} on node {self.node_id} ({self.node_ip}): "
                                      f"{exc}") from None
        if not Path(model_dir).is_dir():
            raise ModelDirMissing(
                f"{worker_id}: the model directory {model_dir} does not exist on node "
                f"{self.node_id} ({self.node_ip}); it must be at the same path on every node "
                "that runs pdserve workers (copy it there, or use a shared filesystem)")
        config = EngineConfig.from_kwargs(engine)
        faults = Faults(stall_send_s=stall_send_s)
        self.tensor_parallel_size = config.tensor_parallel_size
        start_followers = None
        if config.tensor_parallel_size > 1:  # ranks 1.. as actors in this worker's placement group
            from pdserve.workers.process.rank_worker import RayFollowers

            gpus = 1 if str(config.device or "").startswith("cuda") else 0
            start_followers = functools.partial(RayFollowers, worker_id, follower_env or {}, gpus)
        self.loaded, core = build_worker_core(
            worker_id, self.role, model_dir, config, lease_s=lease_s,
            transfer_timeout_s=transfer_timeout_s, connect_timeout_s=connect_timeout_s,
            kv_link=kv_link, host=self.node_ip,
            stall_send_s=lambda: faults.stall_send_s, start_followers=start_followers,
            rank_threads=torch.get_num_threads())
        # Injected (cluster.metrics.WorkerMetrics from launch): workers never import cluster/.
        self.host = WorkerHost(
            core, worker_id=worker_id, role=self.role, config=config,
            control=RayControlPlane(transfer_timeout_s),
            metrics=metrics(self.role, actor_name(worker_id)) if metrics is not None else None,
            faults=faults, on_fatal=self._on_fatal)
        # A worker group whose other rank is gone cannot step: the loop fails at once, idle or
        # not (its requests then fail UNAVAILABLE for the router to carry over), and the
        # process exits for Ray to restart the group.
        self.host.add_tick_hook(core.runner.check)
        # The router's requests come in here; the host is all the server sees (ChannelHost).
        self.channel = RequestChannelServer(self.host, host_address=self.node_ip)
        log.info("%s ready: %d KV blocks of %d tokens", worker_id, core.kv.num_blocks,
                 config.tokens_per_block)
        self._announce_restart()

    def _announce_restart(self) -> None:
        """If a router runs already, this process is a restart (at launch the router starts
        after the workers): tell it now, fire and forget, so it reconnects at once."""
        import ray

        try:
            router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
        except ValueError:
            return  # no router yet: the launcher hands it this worker's info
        try:
            router.worker_restarted.remote(self.info())
        except Exception as exc:  # the refresh loop finds this worker anyway
            log.warning("%s: could not announce the restart to the router: %r", self.worker_id, exc)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_id})"  # the dashboard's Actors page shows it

    def info(self) -> WorkerInfo:
        return dataclasses.replace(self.host.info(self.loaded.config.vocab_size),
                                   request_endpoint=self.channel.endpoint,
                                   request_token=self.channel.token,
                                   node_id=self.node_id, node_ip=self.node_ip,
                                   model=self.model_name,
                                   dtype=str(self.loaded.model.dtype).removeprefix("torch."),
                                   tensor_parallel_size=self.tensor_parallel_size)

    def generate(self, wire: WireRequest) -> Iterator[WireUpdate]:
        """The request's updates as a Ray streaming generator (for callers holding only an
        actor handle; the router uses the request channel)."""
        stream = self.host.stream(wire)
        deadline = None if wire.deadline_s is None else time.monotonic() + wire.deadline_s
        while not stream.finished:
            wait = UPDATE_WAIT_S
            if deadline is not None:  # the engine core ends it at the deadline; allow a margin
                wait = min(wait, max(0.0, deadline - time.monotonic()) + 30.0)
            yield stream.get(wait)

    def request_channel(self) -> dict[str, Any]:
        channel = self.channel
        return {"endpoint": channel.endpoint, "connections": channel.num_connections}

    def abort(self, request_id: int) -> bool:
        return bool(self.host.call(lambda: self.host.abort_now(request_id)))

    def status(self) -> dict[str, Any]:
        """For tools and tests (the router reads heartbeats): transfer records included."""
        return self.host.call(self.host.status_map)  # type: ignore[return-value]

    def request_states(self) -> dict[int, str]:
        return self.host.call(self.host.core.request_states)  # type: ignore[return-value]

    def kv_transfer(self, payload: bytes, endpoint: str | None = None) -> bytes | None:
        """Runs in the "transfer" concurrency group: returns when the bytes have landed."""
        return self.host.kv_control.serve(payload, endpoint)

    def test_hook(self, name: str, *args: Any) -> Any:
        return self.host.test_hook(name, *args)

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        self.channel.close()  # first: no request may arrive at a stopped loop
        self.host.stop()
        self.host.core.runner.close()  # a worker group's other ranks stop with it

    def _on_fatal(self, exc: BaseException) -> None:
        """The step loop died: exit, so Ray restarts this worker with a fresh state."""
        log.critical("%s: step loop died (%r); exiting for a restart", self.worker_id, exc)

        def exit_later() -> None:
            time.sleep(FATAL_EXIT_DELAY_S)
            os._exit(1)

        threading.Thread(target=exit_later, name="pdserve-fatal-exit", daemon=True).start()

"""A worker group: one model split over N ranks, one process per rank (tensor parallelism).

Rank 0 hosts the engine core: the schedulers and the KV manager decide each step once, there.
Its ``GroupModelRunner`` publishes every ``StepPlan`` (plain data, msgpack) to the other ranks
before running its own shard of the forward; each follower rank runs ``follow``: receive a plan,
run the same forward on its shard over its own KV pool, which holds its heads of the same block
ids. The forward's collectives (all-reduce, vocab gather) run on one torch.distributed group per
worker: gloo on CPU, NCCL on CUDA. Only rank 0 samples.

Two channels, two kinds of wait, each with a deadline:
- the plan channel (a TCP stream per follower, msgpack frames): a follower waits for the next
  frame at most ``timeout_s``; rank 0 sends a keep-alive frame when idle for a third of it, so an
  idle group stays up and a follower whose rank 0 is gone (stream closed, or silent past the
  deadline) exits instead of waiting forever;
- the collectives: the process group is built with ``timeout_s``, so a rank whose peer died
  raises in its next all-reduce (a dead process's sockets close at once: usually immediately).
A rank 0 that finds a follower gone (its stream closed) fails its next step with ``GroupBroken``:
the worker stops, as any worker whose forward fails, and the cluster migrates its requests.
"""
from __future__ import annotations

import datetime
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import torch
import torch.distributed as dist

from pdserve.workers.model.parallel import TensorParallel
from pdserve.workers.model.shm_group import ShmCollectives
from pdserve.workers.runner.model_runner import ModelRunner
from pdserve.workers.runner.plan import SamplingBatch, ScheduledSequence, StepPlan, StepResult

log = logging.getLogger("pdserve.group")

_FRAME = struct.Struct("!I")
OP_STEP, OP_COPY, OP_PING, OP_STOP = 0, 1, 2, 3


class GroupBroken(RuntimeError):
    """A rank of the group is gone (or missed a deadline): the group cannot run another step."""


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where a group's ranks meet: rank 0's TCPStore (the process group's rendezvous) and its
    plan channel, and the secret a follower proves it belongs with."""

    host: str
    store_port: int
    plan_port: int
    secret: str
    size: int
    timeout_s: float


def open_process_group(address: GroupAddress, rank: int, device: torch.device | str,
                       store: dist.Store | None = None, *, expert_parallel: bool = False) -> TensorParallel:
    """This rank's TensorParallel over a fresh process group of the group's size (gloo on
    CPU, NCCL on CUDA), never the global default group; on CPU also a shared-memory segment for
    the small collectives (shm_group.py; ``PDSERVE_TP_SHM=0``: gloo alone). Blocks until every
    rank has joined, at most the address's timeout."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if store is None:
        store = dist.TCPStore(address.host, address.store_port, address.size, False, timeout=timeout)
    prefixed = dist.PrefixStore("pdserve/tp", store)
    shm = None
    if torch.device(device).type == "cuda":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no ProcessGroupNCCL")
        opts = nccl.Options()
        opts._timeout = timeout
        pg = nccl(prefixed, rank, address.size, opts)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, address.size, timeout)
        shm = ShmCollectives.open(store, rank, address.size, address.timeout_s)
        if rank == 0:
            log.info("worker group collectives: %s", shm if shm is not None else "gloo")
    return TensorParallel(rank, address.size, pg, expert_parallel=expert_parallel, shm=shm)


# ----------------------------------------------------------------- plan frames


def encode_plan(plan: StepPlan) -> list[Any]:
    return [list(plan.input_ids), [[s.request_id, s.start, s.num_new_tokens, s.past_len, list(s.block_table),
                                    s.samples, s.prompt_logprobs, list(s.prompt_targets)]
                                   for s in plan.sequences], plan.num_context]


def decode_plan(wire: Sequence[Any]) -> StepPlan:
    ids, seqs, num_context = wire
    return StepPlan(tuple(ids), tuple(
        ScheduledSequence(rid, start, n, past, tuple(table), samples, k, tuple(targets))
        for rid, start, n, past, table, samples, k, targets in seqs), num_context)


def _send_frame(sock: socket.socket, message: Any) -> None:
    body = msgpack.packb(message)
    sock.sendall(_FRAME.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise GroupBroken("rank 0's plan channel closed")
        buf += part
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> Any:
    (n,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    return msgpack.unpackb(_recv_exact(sock, n))


class PlanPublisher:
    """Rank 0's end of the plan channel: a listening socket the followers connect to (each
    proves the group's secret), then one stream per follower."""

    def __init__(self, host: str, size: int, timeout_s: float, secret: str) -> None:
        self.size, self.timeout_s, self.secret = size, timeout_s, secret
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._followers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._broken: str | None = None
        self._closed = threading.Event()

    def accept(self, deadline_s: float) -> None:
        """Wait (at most ``deadline_s``) for every follower rank to connect."""
        end = time.monotonic() + deadline_s
        while len(self._followers) < self.size - 1:
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.size)) - set(self._followers))
                raise GroupBroken(f"ranks {missing} of the worker group did not connect within {deadline_s:g} s")
            self._listener.settimeout(left)
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            conn.settimeout(self.timeout_s)
            try:
                rank, secret = _recv_frame(conn)
            except (GroupBroken, OSError, ValueError):
                conn.close()
                continue
            if not hmac.compare_digest(str(secret), self.secret) or not 0 < int(rank) < self.size:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._followers[int(rank)] = conn
        self._listener.close()
        for rank, conn in self._followers.items():  # notice a follower's death at once
            threading.Thread(target=self._watch, args=(rank, conn), daemon=True,
                             name=f"pdserve-group-watch-{rank}").start()
        threading.Thread(target=self._keepalive, daemon=True, name="pdserve-group-keepalive").start()

    def _watch(self, rank: int, conn: socket.socket) -> None:
        conn.settimeout(None)
        try:
            while conn.recv(1):  # followers never send after their hello: this waits for EOF
                pass
        except OSError:
            pass
        if not self._closed.is_set():
            self._broken = self._broken or f"rank {rank} of the worker group is gone"
            log.error("%s", self._broken)

    def _keepalive(self) -> None:
        while not self._closed.wait(self.timeout_s / 3):
            if time.monotonic() - self._last_send >= self.timeout_s / 3:
                try:
                    self.publish([OP_PING])
                except GroupBroken:
                    return

    def check(self) -> None:
        if self._broken is not None:
            raise GroupBroken(self._broken)

    def publish(self, message: list[Any]) -> None:
        self.check()
        with self._lock:
            self._last_send = time.monotonic()
            for rank, conn in self._followers.items():
                try:
                    _send_frame(conn, message)
                except OSError as e:
                    self._broken = f"rank {rank} of the worker group is gone ({e})"
                    raise GroupBroken(self._broken) from e

    def close(self) -> None:
        """Tell the followers to stop, then close the streams."""
        if self._closed.is_set():
            return
        try:
            self.publish([OP_STOP])
        except GroupBroken:
            pass
        self._closed.set()
        for conn in self._followers.values():
            try:
                conn.close()
            except OSError:
                pass
        try:
            self._listener.close()
        except OSError:
            pass


def connect_follower(address: GroupAddress, rank: int) -> socket.socket:
    """A follower's end of the plan channel, connected and introduced (within the deadline)."""
    end = time.monotonic() + address.timeout_s
    while True:
        try:
            sock = socket.create_connection((address.host, address.plan_port), timeout=address.timeout_s)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _send_frame(sock, [rank, address.secret])
    return sock


# ----------------------------------------------------------------- runners


class GroupModelRunner(ModelRunner):
    """Rank 0's runner: every step's plan (and every block copy) goes to the followers first,
    then runs here on rank 0's shard."""

    def __init__(self, model, kv_pool, publisher: PlanPublisher, *, followers: Any = None, **kwargs: Any) -> None:
        super().__init__(model, kv_pool, **kwargs)
        self.publisher = publisher
        self.followers = followers  # what started the other ranks (closed with the runner)
        self.tp_size = publisher.size

    def execute(self, plan: StepPlan, sampling: SamplingBatch | None,
                on_layer: Callable[[int], None] | None = None) -> StepResult:
        self.publisher.publish([OP_STEP, encode_plan(plan)])
        return super().execute(plan, sampling, on_layer)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if copies:
            self.publisher.publish([OP_COPY, [list(c) for c in copies]])
        super().copy_blocks(copies)

    def check(self) -> None:
        self.publisher.check()

    def close(self) -> None:
        self.publisher.close()
        if self.followers is not None:
            self.followers.close()
        shm = getattr(getattr(self.model, "tp", None), "shm", None)
        if shm is not None:  # every rank has stopped: no collective can run any more
            shm.close()


def follow(runner: ModelRunner, sock: socket.socket, timeout_s: float) -> int:
    """A follower rank's loop: run each plan rank 0 publishes until it says stop (returns the
    steps run). Raises GroupBroken when rank 0 is gone or silent past ``timeout_s``."""
    sock.settimeout(timeout_s)
    steps = 0
    while True:
        try:
            message = _recv_frame(sock)
        except socket.timeout:
            raise GroupBroken(f"rank 0 sent nothing for {timeout_s:g} s") from None
        except OSError as e:
            raise GroupBroken(f"rank 0's plan channel failed: {e}") from e
        op = message[0]
        if op == OP_STEP:
            runner.execute(decode_plan(message[1]), None)
            steps += 1
        elif op == OP_COPY:
            ModelRunner.copy_blocks(runner, [tuple(c) for c in message[1]])
        elif op == OP_STOP:
            return steps


def new_secret() -> str:
    return secrets.token_hex(16)


def node_host() -> str:
    """The address the group's ranks meet on: loopback unless told otherwise (a group's ranks
    share one node: Ray places them with STRICT_PACK)."""
    return os.environ.get("PDSERVE_GROUP_HOST", "127.0.0.1")


# ----------------------------------------------------------------- follower ranks


def run_follower(model_dir: str, config: Any, address: GroupAddress, rank: int, pool_blocks: int,
                 dtype: torch.dtype, device: str, *, threads: int | None = None,
                 on_ready: Callable[[], None] | None = None) -> int:
    """A follower rank, start to end: join the process group, load this rank's shard of the
    weights, allocate its KV pool (the group's block count, its share of the heads), connect
    to rank 0's plan channel and follow it until told to stop. Returns the steps run."""
    from pdserve.transport.kv_pool import KVPool
    from pdserve.workers.loading.loader import load_model
    from pdserve.workers.model.parallel import rank_cache_heads

    if threads is not None and torch.device(device).type == "cpu":
        torch.set_num_threads(threads)
    tp = open_process_group(address, rank, device, expert_parallel=config.enable_expert_parallel)
    loaded = load_model(model_dir, dtype=dtype, device=device, tp=tp)
    pool = KVPool.for_model(loaded.config, pool_blocks, config.tokens_per_block, dtype=loaded.model.dtype,
                            device=device, num_kv_heads=rank_cache_heads(loaded.config, tp))
    runner = ModelRunner(loaded.model, pool)
    sock = connect_follower(address, rank)
    if on_ready is not None:
        on_ready()
    try:
        return follow(runner, sock, address.timeout_s)
    finally:
        sock.close()


def _follower_process(model_dir: str, config_dict: dict[str, Any], address: GroupAddress, rank: int,
                      pool_blocks: int, dtype_name: str, device: str, threads: int | None) -> None:
    from pdserve.workers.config import EngineConfig

    logging.basicConfig(level=logging.WARNING)
    try:
        run_follower(model_dir, EngineConfig.from_kwargs(config_dict), address, rank, pool_blocks,
                     getattr(torch, dtype_name), device, threads=threads)
    except GroupBroken as e:
        log.warning("worker group rank %d stops: %s", rank, e)


class LocalFollowers:
    """Follower ranks as child processes of rank 0 (the offline ``LLM`` and tests; a cluster
    worker's ranks are Ray actors instead, workers/process/). Each is a daemon: it dies with
    rank 0's process, and stops by itself when rank 0's plan channel closes."""

    def __init__(self, model_dir: str, config: Any, address: GroupAddress, pool_blocks: int,
                 dtype: torch.dtype, device: str, *, threads: int | None = None) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's threads' locks
        config_dict = config.to_dict()
        self.procs = [
            ctx.Process(target=_follower_process, daemon=True, name=f"pdserve-rank{rank}",
                        args=(str(model_dir), config_dict, address, rank, pool_blocks,
                              str(dtype).removeprefix("torch."), device, threads))
            for rank in range(1, address.size)]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self, timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(1.0)

"""Pair process groups of the KV data plane and the pieces both of its sides share: the
config, the deadline of an op's waits, the 2-rank group, the staging ring, the pool <-> wire
block mover, the header tensor, and the client end of a context worker's rendezvous store.
``kv_sender`` (context side) and ``kv_receiver`` (generation side) build on these.

Pair protocol, per op ``seq`` of a group (both sides run ops in seq order):
  ctx -> gen  header int64[HEADER_LEN] (tag seq/0), always, even for a refused or cancelled op
  ctx -> gen  payload chunk i (tag seq/i+1): raw bytes [planes, blocks, block bytes] of one
              rectangle of (layer, plane) planes x transfer blocks (``protocol.plan_chunks``);
              a pool has 2 planes per layer (K, V) or 1 (MLA's latent): ``wire_planes``.
              With a head slice (tensor parallelism) a block's bytes are only its slice's,
              [tokens, slice heads, head_dim] (``BlockMover``)
Chunks are pipelined: the gather (ctx) or scatter (gen) of one chunk through a ring of reused
staging buffers overlaps the send/recv of its neighbours (torch ops and gloo I/O release the
GIL). A single-plane chunk whose block ids are consecutive on a side is a contiguous slice of that
side's pool and is sent from / received into the pool without a copy.

Op 0 of a group the generation side sets up eagerly is its PairOpen: an OPEN header, no payload.

Failure rule: any exception or timeout on a pair poisons its group on that side; the group is
dropped (its sockets close, so the peer's pending ops fail at once) and the generation
side rebuilds under a new epoch (fresh store prefix) at once, re-issuing the ops queued behind
the failed one there (``kv_receiver_pair``; docs/design.md 4.6). Other pairs have their own groups
and threads, so one dead peer touches nobody else.
"""
from __future__ import annotations

import datetime
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # transport sits below workers: the pool is only a type here
    from .kv_pool import KVPool
from .protocol import HEADER_LEN, Chunk, KVLayout, plan_chunks

STORE_CONNECT_POLL_S = 0.2  # how often a store connect in progress checks its endpoint (connect_store)
MAX_OUTSTANDING = 16  # posted chunk sends/recvs per op (staged ones are also bounded by staging)
INCARNATION_KEY = "pdserve/incarnation"  # set in a context worker's store: whose store it is
CTX_RANK, GEN_RANK = 0, 1


@dataclass(frozen=True, slots=True)
class TransportConfig:
    host: str = "127.0.0.1"
    port: int = 0  # context side's TCPStore port; 0 picks a free one
    connect_timeout_s: float = 30.0  # store connect and pair-group rendezvous (a loaded host)
    default_timeout_s: float = 30.0  # lease (ctx) / transfer deadline (gen) when none is given
    chunk_bytes: int = 4 << 20  # target payload chunk when blocks are gathered
    num_staging: int = 3  # staging buffers per pair thread (pipeline depth)
    direct_link: bool = True  # generation side: KV requests over the direct link too (kv_link)


def layout_of(pool: KVPool) -> KVLayout:
    return KVLayout(str(pool.dtype).removeprefix("torch."), pool.bytes_per_block,
                    (pool.num_layers, pool.tokens_per_block, pool.num_kv_heads, pool.head_dim),
                    pool.num_planes)


def wire_planes(pool: KVPool) -> int:
    """How many (layer, plane) planes a transfer's payload has: the pool's planes per layer
    (2 for K and V, 1 for an MLA latent) times its layers."""
    return pool.num_planes * pool.num_layers


def plane_block_bytes(pool: KVPool) -> int:
    """Bytes of one block of one (layer, plane) plane: one row of the payload."""
    return pool.bytes_per_block // wire_planes(pool)


def as_timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 1e-3))


class Deadline:
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


def _socket_fds() -> dict[int, str]:
    """This process's socket file descriptors -> their inode link ("socket:[N]"); empty where
    there is no /proc."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(fd)] = link
    return out


def _accepted_connections(before: set[str]) -> dict[int, str]:
    """Sockets new since ``before`` that a listener new since then accepted: the gloo
    connections a group constructor made on the side that listened. (Sockets another thread
    opened meanwhile have other local ports, so they are never taken for ours.)"""
    listening, connected = set(), {}
    for fd, link in _socket_fds().items():
        if link in before:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            port = sock.getsockname()[1] if sock.family in (socket.AF_INET, socket.AF_INET6) else None
            try:
                sock.getpeername()
                connected[fd] = (link, port)
            except OSError:
                listening.add(port)
        except OSError:
            pass
        finally:
            sock.close()
    return {fd: link for fd, (link, port) in connected.items() if port in listening}


class PairGroup:
    """One pair process group (2 ranks) on a PrefixStore, never the global default group.

    ``destroy`` aborts it, but gloo's abort does not interrupt a wait in progress (measured:
    a posted recv still completed after ``abort()`` and ``shutdown()``); what makes the peer's
    pending ops fail at once is the group's sockets closing, when the last reference to the
    dropped group goes. ``cut`` closes them on purpose (fault injection: a cut connection)."""

    def __init__(self, store: dist.Store, name: str, rank: int, device: torch.device,
                 timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.peer = 1 - rank
        before = set(_socket_fds().values())
        prefixed = dist.PrefixStore(name, store)
        if device.type == "cuda":  # both sides hold CUDA tensors: NCCL (not on CPU builds)
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no ProcessGroupNCCL")
            opts = nccl.Options()
            opts._timeout = as_timedelta(timeout_s)
            self.pg = nccl(prefixed, rank, 2, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, as_timedelta(timeout_s))
        self._sockets = _accepted_connections(before)

    def cut(self) -> int:
        """Shut the group's TCP connections down, as a dying peer or a broken network would:
        every pending op on both sides fails. Returns how many sockets were cut: 0 on the side
        that connected out (only the accepting side can tell its gloo sockets apart)."""
        now = _socket_fds()
        cut = 0
        for fd, link in self._sockets.items():
            if now.get(fd) != link:
                continue  # closed since (and perhaps the number reused): not ours any more
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.type == socket.SOCK_STREAM:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:  # a listening socket, or not connected
                pass
            finally:
                sock.close()
        return cut

    def send(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self.pg.send([t], self.peer, tag)

    def recv(self, t: torch.Tensor, tag: int) -> dist.Work:
        return self.pg.recv([t], self.peer, tag)

    def destroy(self) -> None:
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001 - teardown of a broken group must not raise
            pass


class StagingRing:
    """Every buffer one side of a pair moves KV with, allocated once per pair and reused by
    every transfer: a ring of flat byte buffers for gathered and scattered chunks, the header
    and trailer messages, and the block ids and row index of the gather or scatter. A transfer
    larger than any before grows them; otherwise a transfer allocates no tensor storage
    (``allocations`` counts the allocations). After a failed op all of it is dropped (a pending
    gloo op of the aborted group may still reference any of it).

    Reuse is safe because a pair runs its ops one at a time and waits for each message before
    the op ends; on CUDA the index is computed on the stream that then reads it."""

    def __init__(self, depth: int, device: torch.device) -> None:
        self.depth, self.device = depth, torch.device(device)
        self.bufs: list[torch.Tensor] = []
        self.allocations = 0
        self._msgs: torch.Tensor | None = None  # int64[2, HEADER_LEN]: header, trailer
        self._host: torch.Tensor | None = None  # host int64 staging for device-side fills
        self._ids: torch.Tensor | None = None  # int64: the transfer's block ids
        self._index: torch.Tensor | None = None  # int64: one chunk's pool rows

    def get(self, nbytes: int) -> list[torch.Tensor]:
        if not self.bufs or self.bufs[0].numel() < nbytes:
            # zero-filled so the pages are touched once here, not inside the timed path
            self.bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                         for _ in range(self.depth)]
            self.allocations += self.depth
        return self.bufs

    def header(self, values: list[int] | None = None) -> torch.Tensor:
        """The header message: to receive into, or holding ``values`` to send."""
        return self._message(0, values)

    def trailer(self, values: list[int] | None = None) -> torch.Tensor:
        return self._message(1, values)

    def ids(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        """``block_ids`` as an int64 tensor on the pool's device (a view of the pair's buffer)."""
        n = len(block_ids)
        self._ids = self._fit(self._ids, n)
        self._fill(self._ids[:n], block_ids)
        return self._ids[:n]

    def index(self, n: int) -> torch.Tensor:
        """Room for one chunk's ``n`` row numbers (int64, on the pool's device)."""
        self._index = self._fit(self._index, n)
        return self._index[:n]

    def drop(self) -> None:
        self.bufs = []
        self._msgs = self._host = self._ids = self._index = None

    def _message(self, slot: int, values: list[int] | None) -> torch.Tensor:
        if self._msgs is None:
            self._msgs = torch.zeros(2, HEADER_LEN, dtype=torch.int64, device=self.device)
            self.allocations += 1
        msg = self._msgs[slot]
        if values is not None:
            self._fill(msg, values)
        return msg

    def _fit(self, buf: torch.Tensor | None, n: int) -> torch.Tensor:
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 2 * (buf.numel() if buf is not None else 0), 64),
                              dtype=torch.int64, device=self.device)
            self.allocations += 1
        return buf

    def _fill(self, dst: torch.Tensor, values) -> None:
        """Write Python ints into ``dst`` (contiguous int64) without a temporary tensor: through
        a NumPy view on the CPU, through a reused (pinned) host buffer onto a device."""
        n = len(values)
        if self.device.type == "cpu":
            dst.numpy()[:n] = values
            return
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * (self._host.numel() if self._host is not None
                                                 else 0), 64),
                                     dtype=torch.int64, pin_memory=True)
            self.allocations += 1
        self._host.numpy()[:n] = values
        dst.copy_(self._host[:n])


class BlockMover:
    """Moves one transfer's chunks between the pool and the wire. The pool is viewed as rows
    [wire_planes * num_blocks, block_numel] (row p * num_blocks + b = block b of (layer, plane)
    plane p), so a single-plane chunk over consecutive block ids is one contiguous slice: it is
    sent from (or received into) the pool itself. Other chunks go through a staging buffer.

    ``heads`` (offset, count): the local KV heads that travel (tensor parallelism). When they
    are all of the pool's heads the rows above travel whole (the paths just described);
    otherwise each row is [tokens, count, head_dim] cut out of the pool's [tokens, heads,
    head_dim], a strided view, so every chunk is gathered into (or scattered from) contiguous
    staging: only contiguous tensors go over the wire, laid out [planes, blocks, tokens, count,
    head_dim] on both sides."""

    def __init__(self, pool: KVPool, block_ids: tuple[int, ...], chunk_planes: int,
                 chunk_blocks: int, buffers: StagingRing,
                 heads: tuple[int, int] | None = None) -> None:
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= pool.num_blocks):
            raise IndexError(f"block id out of range [0, {pool.num_blocks})")
        offset, count = heads if heads is not None else (0, pool.num_kv_heads)
        if offset < 0 or count < 1 or offset + count > pool.num_kv_heads:
            raise IndexError(f"head slice [{offset}, {offset + count}) outside the pool's "
                             f"{pool.num_kv_heads} local KV heads")
        self.nb = pool.num_blocks
        self.num_planes = wire_planes(pool)  # (layer, plane) planes, not planes per layer
        self.rows = pool.kv.view(self.num_planes * self.nb, -1)  # [planes * blocks, block_numel]
        self.sliced = count != pool.num_kv_heads
        if self.sliced:
            self.rows = pool.kv.view(self.num_planes * self.nb, pool.tokens_per_block,
                                     pool.num_kv_heads, pool.head_dim)[:, :, offset:offset + count]
        self.row_shape = tuple(self.rows.shape[1:])
        self.row_bytes = plane_block_bytes(pool) // pool.num_kv_heads * count
        self.ids = block_ids
        self.buffers = buffers
        self.ids_t = buffers.ids(block_ids)
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
        if self.sliced or c.plane_stop - c.plane_start != 1 or self.run[c.block_start] < n:
            return None
        first = c.plane_start * self.nb + self.ids[c.block_start]
        return self.rows[first:first + n].view(-1).view(torch.uint8)

    def _index(self, c: Chunk) -> torch.Tensor:
        """The chunk's pool rows (plane-major), in the pair's index buffer."""
        n = c.block_stop - c.block_start
        index = self.buffers.index(c.num_rows)
        ids = self.ids_t[c.block_start:c.block_stop]
        for k, plane in enumerate(range(c.plane_start, c.plane_stop)):
            torch.add(ids, plane * self.nb, out=index[k * n:(k + 1) * n])
        return index

    def _as_rows(self, buf: torch.Tensor, c: Chunk) -> torch.Tensor:
        return buf[: self.nbytes(c)].view(self.rows.dtype).view(c.num_rows, *self.row_shape)

    def gather(self, c: Chunk, buf: torch.Tensor) -> torch.Tensor:
        torch.index_select(self.rows, 0, self._index(c), out=self._as_rows(buf, c))
        return buf[: self.nbytes(c)]

    def scatter(self, c: Chunk, buf: torch.Tensor) -> None:
        self.rows.index_copy_(0, self._index(c), self._as_rows(buf, c))


def incarnation_of(endpoint: str) -> int:
    """The incarnation in a locator "host:port#incarnation" (0 for a bare "host:port")."""
    _, _, inc = endpoint.partition("#")
    return int(inc) if inc.isdigit() else 0


def failure_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"



# ---------------------------------------------------------------------------- rendezvous store


def run_abandonable(fn: Callable[[], Any], timeout_s: float, *, thread_name: str,
                    abandoned: Callable[[], str | None], what: str) -> Any:
    """``fn()`` on a helper thread that this one watches in slices: its result, or an error at
    the deadline or as soon as ``abandoned()`` gives a reason. For blocking c10d calls that
    take no cancellation (a store connect, a group's rendezvous); an abandoned helper ends on
    its own (at its own timeout) and what it made, if anything, is dropped."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=thread_name, daemon=True).start()
    end = time.monotonic() + timeout_s
    while not done.wait(STORE_CONNECT_POLL_S):
        why = abandoned()
        if why:
            raise RuntimeError(f"{what} abandoned: {why}")
        if time.monotonic() >= end:
            raise TimeoutError(f"{what} did not finish within {timeout_s:.1f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def connect_store(endpoint: str, host: str, port: int, timeout_s: float, *, thread_name: str,
                  abandoned: Callable[[], bool]) -> dist.TCPStore:
    """The context worker's store, connected on a helper thread that this one watches.

    c10d's client bounds its connect but not its validation read: a port that another kind
    of server took over after the context process died accepts the connection and never
    answers, and the constructor blocks until that server closes it (forever for a mute
    one; measured: > 120 s with a 1 s timeout). So this thread waits for the helper in
    slices and gives up at the deadline, or as soon as ``abandoned()`` says ``endpoint`` is
    gone or replaced (the restarted worker's first request arrived): a stale op must not hold
    the pair thread while the new incarnation waits for it to join a group. An abandoned
    helper ends when the far side closes its socket; what it connected, if anything, is
    dropped."""
    return run_abandonable(
        lambda: dist.TCPStore(host, port, None, False, as_timedelta(timeout_s)), timeout_s,
        thread_name=thread_name, what=f"connecting to the store at {endpoint}",
        abandoned=lambda: "the endpoint is gone or replaced" if abandoned() else None)


def probe_store(endpoint: str, host: str, port: int, timeout_s: float,
                mark_gone: Callable[[str], None]) -> None:
    """A refused connection means no store listens there any more (its process is gone):
    fail now and remember it (``mark_gone``), instead of retrying the connect until the
    timeout."""
    try:
        socket.create_connection((host, port), timeout=min(1.0, timeout_s)).close()
    except ConnectionRefusedError:
        mark_gone(endpoint)
        raise RuntimeError(f"context endpoint {endpoint} refused the connection: gone") from None
    except OSError:  # slow or unreachable: not proof; the store connect has its own timeout
        pass

"""The router's view of its workers: who they are (``WorkerInfo``), their request channels, the
load view built from their heartbeats, what their prefix caches hold (``PrefixIndex``, fed by
their KV events), their health, restarts and events.

The prefix index is exact against each worker's events: when a channel opens the router asks
for a snapshot (``KvSnapshotQuery``) and ignores batches until it arrives; a gap in the batch
numbers (or an event that does not fit what the worker holds) drops that worker's entries and
asks again; a closed channel (a dead or restarted worker) drops them at once.

Liveness: a worker whose channel is down is reconnected in the background; one whose heartbeats
stopped is unhealthy. A dead worker (its channel closes, or a Ray actor error) is marked
unhealthy at once; Ray restarts it, the reconnect finds a new incarnation (and its new channel
endpoint) through ``info`` over Ray, and its heartbeats make it healthy again.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from pdserve.cluster import policies as P
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.worker_channel import ChannelClosed, WorkerChannel
from pdserve.scheduler.kv_events import BlocksRemoved, BlocksStored
from pdserve.transport.requests import KvEvents, KvSnapshot, WorkerEvent, WorkerInfo, WorkerStatus

from .config import RouterConfig
from .errors import WorkerFailure

log = logging.getLogger("pdserve.router")

MAX_EVENTS = 1000  # recent worker events kept for GetClusterStatus
READY_PAIR_STATES = ("ready", "lazy")  # a KV pair a transfer may be planned over


class WorkerRegistry:
    def __init__(self, config: RouterConfig, handles: dict[str, Any],
                 infos: dict[str, WorkerInfo]) -> None:
        self.config = config
        self.handles = handles  # worker id -> Ray actor handle
        self.infos = dict(infos)
        self.ctx_ids = sorted(w for w, i in infos.items() if i.role == "context")
        self.gen_ids = sorted(w for w, i in infos.items() if i.role == "generation")
        self.loads: dict[str, P.WorkerLoad] = {
            w: P.WorkerLoad(w, P.WorkerRole.CONTEXT if i.role == "context" else P.WorkerRole.GENERATION,
                            free_kv_blocks=i.num_kv_blocks, total_kv_blocks=i.num_kv_blocks,
                            max_batch_size=i.max_batch_size)
            for w, i in infos.items()
        }
        self.channels: dict[str, WorkerChannel] = {}  # worker id -> its open request channel
        self.statuses: dict[str, WorkerStatus] = {}  # worker id -> its last heartbeat status
        self.violations: dict[str, list[str]] = {}  # worker id -> its last reported violations
        self.restarts: dict[str, int] = {w: 0 for w in infos}
        # The workers' transfer, pause and resume events, from their heartbeats (oldest first).
        self.events: collections.deque[WorkerEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.index = PrefixIndex()
        self.snapshots_asked: dict[str, int] = {w: 0 for w in infos}  # (re)syncs of each index
        # Blocks each worker reported stored and removed (applied batches only).
        self.kv_event_blocks: dict[str, dict[str, int]] = {w: {"stored": 0, "removed": 0} for w in infos}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._reconnects: dict[str, asyncio.Task] = {}  # worker id -> its reconnect in progress
        # Set, then replaced, each time a worker turns healthy (requests waiting for one).
        self._turned_healthy = asyncio.Event()
        self._closing = False  # close() began: channels closing are the router's doing

    @property
    def worker_ids(self) -> list[str]:
        return list(self.handles)

    # ------------------------------------------------------------------ channels

    async def hear_all(self, timeout_s: float, ready_timeout_s: float = 0.0) -> None:
        """Open every worker's channel and wait (bounded) until each reports ready: the router
        starts with real loads, GetClusterStatus has every worker from the first call, and no
        request meets a KV pair still setting up (generation workers are ready once theirs are
        set up; ``KvPeers`` goes out as each channel opens). A worker not ready by then is left
        to the refresh loop (its heartbeats make it healthy when it is)."""
        start = time.monotonic()
        results = await asyncio.gather(*(self.open_channel(w, timeout_s) for w in self.handles),
                                       return_exceptions=True)
        for worker_id, result in zip(self.handles, results):
            if isinstance(result, BaseException):
                log.warning("request channel to %s: %r", worker_id, result)
        deadline = start + max(timeout_s, ready_timeout_s)
        while time.monotonic() < deadline:
            heard = [w for w in self.handles if w in self.statuses]
            if len(heard) == len(self.handles) and all(self.statuses[w].healthy for w in heard):
                return
            if len(heard) < len(self.handles) and time.monotonic() >= start + timeout_s:
                break  # a worker is not even heard: do not hold the others up for it
            await asyncio.sleep(0.02)
        slow = [w for w in self.handles if w not in self.statuses or not self.statuses[w].healthy]
        log.warning("router starting before %s reported ready", ", ".join(slow))

    async def open_channel(self, worker_id: str, timeout_s: float) -> WorkerChannel:
        """Connect (once, for every waiter). Its heartbeats make the worker healthy again."""
        lock = self._connecting.setdefault(worker_id, asyncio.Lock())
        async with lock:
            channel = self.channels.get(worker_id)
            if channel is not None and channel.open:
                return channel
            info = self.infos[worker_id]
            channel = WorkerChannel(worker_id, info.request_endpoint, info.request_token,
                                    on_status=self.on_status, on_kv=self._on_kv,
                                    on_closed=self._on_channel_closed)
            await channel.connect(timeout_s)
            self.channels[worker_id] = channel
            self._resync(channel)
            if info.role == "generation":
                self._send_peers(channel)
            return channel

    async def channel_for(self, worker_id: str, timeout_s: float) -> WorkerChannel:
        """The worker's open request channel, connecting if needed; WorkerFailure if not."""
        channel = self.channels.get(worker_id)
        if channel is not None and channel.open:
            return channel
        try:
            return await self.open_channel(worker_id, timeout_s)
        except (OSError, TimeoutError) as exc:
            self.mark_unhealthy(worker_id, f"request channel connect: {exc!r}")
            raise WorkerFailure(f"{worker_id}: cannot open its request channel "
                                f"({self.infos[worker_id].request_endpoint}): {exc!r}") from exc

    def abort_attempt(self, worker_id: str, attempt: int) -> None:
        """Fire and forget; the worker frees it. On the attempt's own channel the abort cannot
        overtake the request; without a channel (it closed), Ray carries it (a worker that
        lost its channel has aborted that channel's requests already)."""
        channel = self.channels.get(worker_id)
        if channel is not None and channel.open:
            channel.abort(attempt)
            return
        try:
            self.handles[worker_id].abort.remote(attempt)
        except Exception:  # the actor is gone: nothing left to free there
            pass

    async def ask_status(self, worker_id: str) -> None:
        """A status as fresh as the worker's last step, over its channel (applied there)."""
        channel = self.channels.get(worker_id)
        if channel is None or not channel.open:
            return
        try:
            await channel.fresh_status(self.config.status_timeout_s)
        except (TimeoutError, ChannelClosed) as exc:
            log.warning("status of %s: %r", worker_id, exc)

    # ------------------------------------------------------------------ KV pairs

    def kv_peers(self) -> dict[str, str]:
        """Every context worker's KV endpoint (its current incarnation's)."""
        return {c: self.infos[c].endpoint for c in self.ctx_ids if self.infos[c].endpoint}

    def _send_peers(self, channel: WorkerChannel) -> None:
        try:
            channel.send_kv_peers(self.kv_peers())
        except ChannelClosed:
            pass  # its reconnect sends them again

    def pair_ready(self, ctx_id: str, gen_id: str) -> bool:
        """The generation worker's last status says its KV pair with ``ctx_id`` is set up."""
        s = self.statuses.get(gen_id)
        return s is not None and s.kv_pairs.get(ctx_id) in READY_PAIR_STATES

    def unready_pairs(self) -> set[tuple[str, str]]:
        """(ctx, gen) pairs no KV transfer should be planned over now."""
        return {(c, g) for g in self.gen_ids for c in self.ctx_ids if not self.pair_ready(c, g)}

    # ------------------------------------------------------------------ the prefix index

    def _resync(self, channel: WorkerChannel) -> None:
        """Forget what the index holds for the worker and ask it for its whole cache."""
        worker_id = channel.worker_id
        if worker_id not in self.index.workers():
            self.index.add_worker(worker_id)
        self.index.expect_snapshot(worker_id)
        self.snapshots_asked[worker_id] = self.snapshots_asked.get(worker_id, 0) + 1
        try:
            channel.ask_kv_snapshot()
        except ChannelClosed:
            pass  # the close callback has dropped its entries

    def _on_kv(self, channel: WorkerChannel, frame: KvEvents | KvSnapshot) -> None:
        """A batch or a snapshot from the worker (on the router's loop, in arrival order). Only
        the current channel's frames count: an old connection's may still be draining."""
        worker_id = channel.worker_id
        if self.channels.get(worker_id) is not channel or not channel.open:
            return
        if type(frame) is KvSnapshot:
            if not self.index.apply_snapshot(worker_id, frame.seq - 1, frame.events):
                log.warning("KV snapshot of %s does not fit together; asking again", worker_id)
                self._resync(channel)
            return
        if self.index.needs_snapshot(worker_id):
            return  # the snapshot asked for is on its way
        if not self.index.apply(worker_id, frame.seq, frame.events):
            log.warning("KV events of %s: gap or mismatch at batch %d; asking for a snapshot",
                        worker_id, frame.seq)
            self._resync(channel)
            return
        counts = self.kv_event_blocks.setdefault(worker_id, {"stored": 0, "removed": 0})
        for event in frame.events:
            if type(event) is BlocksStored:
                counts["stored"] += len(event.keys)
            elif type(event) is BlocksRemoved:
                counts["removed"] += len(event.keys)

    def _on_channel_closed(self, channel: WorkerChannel) -> None:
        """A worker whose channel closed (dead, restarting, or just disconnected) loses its
        index entries at once; the next channel starts from a snapshot. It is unhealthy at
        once, idle or not: no request is planned onto a dead process while Ray restarts it
        (a reconnect's heartbeat makes it healthy again)."""
        current = self.channels.get(channel.worker_id)
        if (current is channel or current is None) and channel.worker_id in self.index.workers():
            self.index.remove_worker(channel.worker_id)
        if current is channel and not self._closing:
            self.mark_unhealthy(channel.worker_id, f"request channel closed: {channel.closed_reason}")

    def prefix_matches(self, prompt: P.PromptInfo) -> dict[str, int]:
        """Each worker's cached leading run of the prompt's blocks (workers with none left out)."""
        if not prompt.block_keys:
            return {}
        return self.index.match(prompt.block_keys)

    def close(self) -> None:
        self._closing = True
        for task in self._reconnects.values():
            task.cancel()
        for channel in self.channels.values():
            channel.close("router stopping")

    # ------------------------------------------------------------------ loads and health

    def on_status(self, worker_id: str, s: WorkerStatus) -> None:
        """A heartbeat's status (on the router's loop, from the channel's reader): the load
        view, the worker's violations and its events."""
        before = self.statuses.get(worker_id)
        self.statuses[worker_id] = s
        self.violations[worker_id] = list(s.violations)
        if s.events:
            self.events.extend(s.events)
        old = self.loads[worker_id]
        self.loads[worker_id] = P.WorkerLoad(
            worker_id, old.role, active_requests=s.num_active + s.queue_depth,
            queued_prompt_tokens=s.queued_prefill_tokens, free_kv_blocks=s.free_blocks, total_kv_blocks=s.total_blocks,
            max_batch_size=s.max_batch_size, healthy=s.healthy)
        ready = {c for c, state in s.kv_pairs.items() if state in READY_PAIR_STATES}
        was_ready = set() if before is None else {
            c for c, state in before.kv_pairs.items() if state in READY_PAIR_STATES}
        if (s.healthy and not old.healthy) or (s.healthy and ready - was_ready):
            self._turned_healthy.set()
            self._turned_healthy = asyncio.Event()

    async def wait_for_healthy(self, timeout_s: float) -> bool:
        """True once some worker turns healthy, or a healthy worker's KV pair becomes ready,
        within ``timeout_s`` (on the router's loop)."""
        try:
            await asyncio.wait_for(self._turned_healthy.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def note_dispatch(self, worker_id: str, prompt_tokens: int) -> None:
        """The optimistic view until the next heartbeat, so a burst spreads out."""
        load = self.loads.get(worker_id)
        if load is not None:
            self.loads[worker_id] = load.with_dispatched(prompt_tokens)

    def mark_unhealthy(self, worker_id: str, why: str = "") -> None:
        old = self.loads.get(worker_id)
        if old is not None and old.healthy:
            log.warning("worker %s marked unhealthy: %s", worker_id, why)
            self.loads[worker_id] = P.WorkerLoad(worker_id, old.role, healthy=False,
                                                 max_batch_size=old.max_batch_size)

    async def refresh(self) -> None:
        """Liveness, not load (heartbeats bring the load, KV events the caches)."""
        now = time.monotonic()
        for worker_id in self.handles:
            channel = self.channels.get(worker_id)
            if channel is None or not channel.open:
                task = self._reconnects.get(worker_id)
                if task is None or task.done():
                    self._reconnects[worker_id] = asyncio.create_task(
                        self._reconnect(worker_id), name=f"pdserve-reconnect-{worker_id}")
                continue
            heard = channel.status_at if channel.status is not None else channel.connected_at
            if now - heard > self.config.status_timeout_s:
                self.mark_unhealthy(worker_id, f"no heartbeat status for {now - heard:.1f} s")

    async def _reconnect(self, worker_id: str) -> None:
        """Open the worker's channel again. When its endpoint no longer answers, ask Ray for
        the worker's info: a new incarnation means Ray restarted it (new endpoint)."""
        timeout = self.config.status_timeout_s
        try:
            try:
                await self.open_channel(worker_id, timeout)
                return
            except (OSError, TimeoutError):
                pass  # gone or restarted: Ray knows which
            info = await asyncio.wait_for(self.handles[worker_id].info.remote(), timeout)
            if info.incarnation != self.infos[worker_id].incarnation:
                self._rejoin(worker_id, info)
            # Also when the restarted worker announced itself meanwhile (worker_restarted):
            # its channel is open then, and this returns it.
            await self.open_channel(worker_id, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.mark_unhealthy(worker_id, f"reconnect: {exc!r}")

    async def worker_restarted(self, info: WorkerInfo) -> bool:
        """The worker's new process told us it is up: take its info and open its channel now
        (its first heartbeat, sent on connect, makes it healthy). False for an unknown worker
        or an incarnation already known."""
        worker_id = info.worker_id
        if worker_id not in self.infos or info.incarnation == self.infos[worker_id].incarnation:
            return False
        self._rejoin(worker_id, info)
        try:
            await self.open_channel(worker_id, self.config.status_timeout_s)
        except (OSError, TimeoutError) as exc:
            self.mark_unhealthy(worker_id, f"connect after restart: {exc!r}")
        return True

    def _rejoin(self, worker_id: str, info: WorkerInfo) -> None:
        """A worker came back as a new process (Ray restarted it): take its new info."""
        if info.role != self.infos[worker_id].role:
            raise RuntimeError(f"{worker_id} came back with role {info.role}")
        self.infos[worker_id] = info
        old = self.channels.pop(worker_id, None)
        if old is not None:  # the previous process's channel; the next request opens a new one
            old.close(f"{worker_id} restarted")
        self.restarts[worker_id] = self.restarts.get(worker_id, 0) + 1
        log.warning("worker %s rejoined (pid %s, incarnation %s)", worker_id, info.pid,
                    info.incarnation)
        if info.role == "context":  # its new KV endpoint: generation workers pair up with it now
            for g in self.gen_ids:
                channel = self.channels.get(g)
                if channel is not None and channel.open:
                    self._send_peers(channel)

    def current_status(self, worker_id: str) -> tuple[WorkerStatus | None, float, str]:
        """(the status the worker's open channel last brought, its age in seconds, why there is
        none). A status from a channel since closed is not current."""
        channel = self.channels.get(worker_id)
        s = self.statuses.get(worker_id)
        if s is None or channel is None or channel.status is not s:
            why = (channel.closed_reason if channel is not None and channel.closed_reason
                   else "no heartbeat from its request channel yet")
            return None, 0.0, why
        return s, time.monotonic() - channel.status_at, ""

    def healthy(self, worker_id: str) -> bool:
        channel = self.channels.get(worker_id)
        return self.loads[worker_id].healthy and channel is not None and channel.open

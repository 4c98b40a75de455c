"""KV transfers, pauses and resumes as a person reads them: one log line each, and a record the
router collects.

Where they show on the Ray dashboard (docs/design.md, "Observability"):

- every line goes to the worker actor's stderr through the ``pdserve.events`` logger, so the
  actor's page (job page -> Actor Table -> pdserve-gen-0 -> Log) lists each transfer, pause
  and resume on the tab it opens with;
- a KV transfer is also its own task, ``kv_transfer req=<id> ctx-0->gen-0 blocks=N bytes=B``,
  submitted by the generation worker (``KVTransceiver.start_receive`` builds the name), which
  the context worker's task fails with the reason when the send fails; its "Log" link holds the
  context side's line with the duration and GB/s.

The records travel to the router inside the request channel's heartbeat (``drain``), which
keeps the last ones for ``GetClusterStatus.recent_events`` (``pdserve top``).

Not thread-safe by itself: the engine core's thread records and drains. The log lines may come
from any thread (logging is).
"""
from __future__ import annotations

import logging
import sys
import time
from collections import deque

from pdserve.transport.requests import WorkerEvent

log = logging.getLogger("pdserve.events")

TRANSFER, PAUSE, RESUME = "transfer", "pause", "resume"
# Records waiting for the next heartbeat; beyond this the oldest are dropped (a router that
# stopped reading loses history, the worker does not grow).
MAX_PENDING = 2048


def route_to_stderr() -> None:
    """In a worker actor: event lines go to stderr, whatever the process's logging
    configuration is. The dashboard's actor page opens its Logs on the STDERR tab, so they are
    the first thing shown there (Ray's own worker log lines are on that tab too)."""
    if any(getattr(h, "_pdserve_events", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler._pdserve_events = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def label(request_id: int, client_id: str | None) -> str:
    """How a person knows the request: the client's id when there is one."""
    return client_id if client_id else f"#{request_id}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def transfer_task_name(client: str, ctx_worker_id: str, gen_worker_id: str, blocks: int,
                       nbytes: int) -> str:
    """The Ray task name of a KV transfer: the dashboard's task table shows it as is."""
    return f"kv_transfer req={client} {ctx_worker_id}->{gen_worker_id} blocks={blocks} bytes={nbytes}"


def transfer_line(side: str, client: str, ctx_worker_id: str, gen_worker_id: str, blocks: int,
                  nbytes: int, seconds: float, outcome: str, reason: str = "") -> str:
    rate = f"{nbytes / seconds / 1e9:.2f} GB/s" if nbytes and seconds > 0 else "- GB/s"
    line = (f"KV {side} req={client} {ctx_worker_id}->{gen_worker_id}: {blocks} blocks, "
            f"{human_bytes(nbytes)} in {seconds * 1e3:.1f} ms ({rate}): {outcome}")
    return f"{line} ({reason})" if reason else line


class WorkerEvents:
    def __init__(self, worker_id: str, *, keep: int = MAX_PENDING) -> None:
        self.worker_id = worker_id
        self._pending: deque[WorkerEvent] = deque(maxlen=keep)
        self.recorded = 0  # every event ever recorded (the pending deque may have dropped some)

    def _add(self, event: WorkerEvent) -> None:
        self._pending.append(event)
        self.recorded += 1

    def transfer(self, *, client: str, ctx_worker_id: str, blocks: int, nbytes: int,
                 seconds: float, outcome: str, reason: str = "") -> None:
        """A receive on this (generation) worker ended."""
        log.info("%s", transfer_line("receive", client, ctx_worker_id, self.worker_id, blocks,
                                     nbytes, seconds, outcome, reason))
        self._add(WorkerEvent(TRANSFER, time.time(), client, self.worker_id,
                              ctx_worker_id=ctx_worker_id, gen_worker_id=self.worker_id,
                              blocks=blocks, bytes=nbytes, seconds=seconds, outcome=outcome,
                              reason=reason))

    def pause(self, *, client: str, policy: str, generated_tokens: int, blocks_freed: int,
              pause_index: int) -> None:
        log.info("PAUSE req=%s on %s: policy %s, %d tokens generated, %d KV blocks freed "
                 "(pause %d; it will be prefilled again)", client, self.worker_id, policy,
                 generated_tokens, blocks_freed, pause_index)
        self._add(WorkerEvent(PAUSE, time.time(), client, self.worker_id, policy=policy,
                              generated_tokens=generated_tokens, blocks_freed=blocks_freed,
                              pause_index=pause_index))

    def resume(self, *, client: str, paused_seconds: float, pause_index: int,
               prefill_tokens: int) -> None:
        log.info("RESUME req=%s on %s after %.3f s paused (pause %d): re-prefilling %d tokens",
                 client, self.worker_id, paused_seconds, pause_index, prefill_tokens)
        self._add(WorkerEvent(RESUME, time.time(), client, self.worker_id,
                              paused_seconds=paused_seconds, pause_index=pause_index))

    def drain(self) -> list[WorkerEvent]:
        """The records since the previous drain, oldest first."""
        out = list(self._pending)
        self._pending.clear()
        return out

"""The router's bounded admission queue and the requests it holds.

``RequestQueue`` is what admission (``Router.admit``) fills and the dispatcher drains: the
waiting list in priority order (``insert_request_in_order``), every request the router holds by
internal and external id, the count of requests in flight against ``max_inflight``, and the
reorder policy (agent tree) applied each dispatch round.

Invariants (``violations`` checks them): 0 <= in_flight <= max_inflight; at most max_queue
waiting; the two id maps in step; no waiting entry without its request.
"""
from __future__ import annotations

import collections
from collections.abc import Iterator

from pdserve.scheduler import AgentTreePolicy, LlmRequest, insert_request_in_order

from .request_state import RouterRequest

DISPATCH_LOG_LEN = 1000


class RequestQueue:
    def __init__(self, max_queue: int, max_inflight: int, reorder: AgentTreePolicy | None) -> None:
        self.max_queue = max_queue
        self.max_inflight = max_inflight
        self.reorder = reorder
        self.waiting: list[LlmRequest] = []  # queue entries (LlmRequest views), priority order
        self.requests: dict[int, RouterRequest] = {}  # internal id -> request (queued or running)
        self.by_external: dict[str, int] = {}
        self.inflight = 0
        # external ids in dispatch order (the most recent ones only)
        self.dispatch_log: collections.deque[str] = collections.deque(maxlen=DISPATCH_LOG_LEN)

    def __len__(self) -> int:
        return len(self.waiting)

    def is_full(self) -> bool:
        return len(self.waiting) >= self.max_queue

    def holds(self, external_id: str) -> bool:
        return external_id in self.by_external

    def add(self, req: RouterRequest) -> None:
        self.requests[req.internal_id] = req
        self.by_external[req.external_id] = req.internal_id
        insert_request_in_order(self.waiting, req.queue_entry)

    def find(self, external_id: str) -> RouterRequest | None:
        internal = self.by_external.get(external_id)
        return self.requests[internal] if internal is not None else None

    def unqueue(self, req: RouterRequest) -> None:
        """Take a request that has not been dispatched off the waiting list (cancelled)."""
        if req.queue_entry in self.waiting:
            self.waiting.remove(req.queue_entry)

    def forget(self, req: RouterRequest) -> None:
        self.requests.pop(req.internal_id, None)
        if self.by_external.get(req.external_id) == req.internal_id:
            del self.by_external[req.external_id]

    def take_ready(self) -> Iterator[RouterRequest]:
        """The requests to start now, in the reorder policy's order, while fewer than
        max_inflight run; each one counts in flight from here (``release`` gives it back)."""
        while self.waiting and self.inflight < self.max_inflight:
            order = self.reorder.reorder(self.waiting) if self.reorder is not None else self.waiting
            if not order:
                return
            entry = order[0]
            self.waiting.remove(entry)
            req = self.requests.get(entry.request_id)
            if req is None or req.cancelled:
                continue
            self.inflight += 1
            self.dispatch_log.append(req.external_id)
            yield req

    def release(self) -> None:
        """A dispatched request ended (however): its in-flight slot is free."""
        self.inflight -= 1

    def violations(self) -> list[str]:
        out = []
        if not 0 <= self.inflight <= self.max_inflight:
            out.append(f"router: in_flight {self.inflight} outside [0, {self.max_inflight}]")
        if len(self.waiting) > self.max_queue:
            out.append(f"router: {len(self.waiting)} queued > max_queue {self.max_queue}")
        if len(self.requests) != len(self.by_external):
            out.append(f"router: {len(self.requests)} requests but {len(self.by_external)} ids")
        stale = [e.request_id for e in self.waiting if e.request_id not in self.requests]
        if stale:
            out.append(f"router: queue entries without a request: {stale[:10]}")
        return out

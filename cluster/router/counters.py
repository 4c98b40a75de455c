"""The router's totals (``RouterTotals`` in GetClusterStatus, ``pdserve status``) and the metrics
recorded with them, in one place so that admission, the dispatcher and the responses count
through the same object."""
from __future__ import annotations

from typing import Any

from pdserve.cluster.metric_specs import KV_PATH_KINDS

from .request_state import RouterRequest

TOTALS = ("received", "completed", "failed", "aborted", "rejected", "retries", "remote_prefills",
          "local_prefills", "fallbacks", "worker_waits")


class RouterCounters:
    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics  # cluster.metrics.RouterMetrics, or None
        self.totals = {k: 0 for k in TOTALS}
        # How each finished request's KV reached its generation worker (KvPathTotals).
        self.kv_paths = {k: 0 for k in KV_PATH_KINDS}
        # The prefix index's prediction for each completed request's prefill worker against what
        # the worker reported it reused (PrefixTotals).
        self.prefix = {"requests": 0, "exact": 0, "predicted_tokens": 0, "reused_tokens": 0}

    def count(self, total: str) -> None:
        self.totals[total] += 1

    def count_completed(self, req: RouterRequest, e2e_s: float) -> None:
        self.totals["completed"] += 1
        self._count_kv_path(req.kv_path())
        self._count_prediction(req)
        if self.metrics is not None:
            self.metrics.count_request("completed")
            self.metrics.observe_e2e(e2e_s)

    def count_failed(self) -> None:
        self.totals["failed"] += 1
        self._count_kv_path("failed")
        if self.metrics is not None:
            self.metrics.count_request("failed")

    def count_fallback(self, req: RouterRequest, *, local: bool) -> None:
        req.fallbacks += 1
        self.totals["fallbacks"] += 1
        if self.metrics is not None:
            self.metrics.count_fallback(local=local)

    def count_prefill(self, *, local: bool) -> None:
        self.totals["local_prefills" if local else "remote_prefills"] += 1
        if self.metrics is not None:
            self.metrics.count_prefill(local=local)

    def count_retry(self, req: RouterRequest) -> None:
        req.retries += 1
        self.totals["retries"] += 1
        if self.metrics is not None:
            self.metrics.count_retries()

    def observe_ttft(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_ttft(seconds)

    def observe_queue_time(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_queue_time(seconds)

    def observe_queue(self, depth: int, in_flight: int) -> None:
        if self.metrics is not None:
            self.metrics.set_queue_depth(depth)
            self.metrics.set_in_flight(in_flight)

    def flush(self) -> None:
        if self.metrics is not None:
            self.metrics.flush()

    def _count_kv_path(self, path: str) -> None:
        self.kv_paths[path] += 1
        if self.metrics is not None:
            self.metrics.count_kv_path(path)

    def _count_prediction(self, req: RouterRequest) -> None:
        if req.reused_tokens is None:
            return
        p = self.prefix
        p["requests"] += 1
        p["exact"] += req.predicted_tokens == req.reused_tokens
        p["predicted_tokens"] += req.predicted_tokens
        p["reused_tokens"] += req.reused_tokens
        if self.metrics is not None:
            self.metrics.count_prefix_prediction(req.predicted_tokens, req.reused_tokens)

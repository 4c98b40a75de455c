"""Every pdserve metric, in one place (docs/design.md section 8).

Each metric is a ``ray.util.metrics`` object named ``pdserve_*``; Ray's Prometheus endpoint
exports it as ``ray_pdserve_*`` (counters with a ``_total`` suffix, histograms as
``_bucket``/``_sum``/``_count``). Every series carries the tags ``role`` and ``worker``; some add
``outcome``, ``state`` or ``kind``. ``worker`` is always the Ray actor name, as the Ray
dashboard's Actors page shows it: ``pdserve-ctx-0``, ``pdserve-gen-0``, ``pdserve-router``.
``METRICS`` lists them all; the Grafana dashboard in deploy/ is checked against it.

Exact totals come from counters, never from a histogram's ``_sum``: Ray 2.60 exports a
histogram's sum from its buckets' midpoints (seen: ``tokens_per_step_sum`` 35.5 where 48
tokens were produced), so every figure a dashboard adds up has a counter of its own (tokens by kind,
steps, scheduler / forward / KV transfer seconds, bytes, transfers, pauses). The histograms stay
for distributions (quantiles) and their ``_count`` (exact).
"""
from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------- tag keys

ROLE = "role"  # "context" | "generation" | "router"
WORKER = "worker"  # actor name, e.g. "pdserve-ctx-0"
OUTCOME = "outcome"
STATE = "state"  # LlmRequestState name
KIND = "kind"

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

_SECONDS_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0, 10.0)
_SECONDS_TRANSFER = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0, 30.0, 60.0)
_SECONDS_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0, 600.0)
_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
_TOKENS = tuple(float(2**i) for i in range(15))  # 1 .. 16384


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as recorded; Prometheus sees "ray_" + name
    kind: str  # COUNTER | GAUGE | HISTOGRAM
    description: str
    tag_keys: tuple[str, ...] = (ROLE, WORKER)
    boundaries: tuple[float, ...] = ()  # histograms only

    @property
    def prometheus_name(self) -> str:
        """The family name on Ray's /metrics endpoint."""
        return f"ray_{self.name}_total" if self.kind == COUNTER else f"ray_{self.name}"


def _spec(name: str, kind: str, description: str, *extra_tags: str,
          boundaries: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, description, (ROLE, WORKER, *extra_tags), boundaries)


# ---------------------------------------------------------------------------- the metrics

# Workers: KV transfers (one observation per finished transfer, measured around send/recv).
KV_TRANSFER_BYTES = _spec("pdserve_kv_transfer_bytes", COUNTER,
                          "KV cache bytes moved by successful transfers (sent or received)")
KV_TRANSFER_SECONDS = _spec("pdserve_kv_transfer_seconds", HISTOGRAM,
                            "Duration of successful KV transfers", boundaries=_SECONDS_TRANSFER)
KV_TRANSFER_GBPS = _spec("pdserve_kv_transfer_gbps", HISTOGRAM,
                         "Throughput of successful KV transfers that moved bytes, GB/s",
                         boundaries=_GBPS)
KV_TRANSFER_TIME = _spec("pdserve_kv_transfer_time_seconds", COUNTER,
                         "Seconds spent in successful KV transfers; the exact total of "
                         "pdserve_kv_transfer_seconds")
KV_TRANSFERS = _spec("pdserve_kv_transfers", COUNTER,
                     "Finished KV transfers by final session state (SENT, COMPLETE, EXPIRED, ...)",
                     OUTCOME)
KV_LEASES_EXPIRED = _spec("pdserve_kv_leases_expired", COUNTER,
                          "Context-side KV leases that expired before a generation worker claimed them")
# Workers: scheduling and the step loop.
UNEXPECTED_RECOMPUTES = _spec("pdserve_unexpected_recomputes", COUNTER,
                               "Generation-only requests a worker prefilled without a pause forcing it "
                               "(their KV was meant to arrive by transfer); must stay 0")
PAUSED_REQUESTS = _spec("pdserve_paused_requests", COUNTER,
                        "Requests paused (evicted, KV freed, to be re-prefilled)")
FINISHED_REQUESTS = _spec("pdserve_worker_finished_requests", COUNTER,
                          "Requests a worker finished, by outcome (finished | aborted)", OUTCOME)
REQUESTS_BY_STATE = _spec("pdserve_requests", GAUGE,
                          "Live requests on a worker by LlmRequestState", STATE)
SCHEDULER_STEP_SECONDS = _spec("pdserve_scheduler_step_seconds", HISTOGRAM,
                               "Time of one scheduler pass (capacity + micro-batch)",
                               boundaries=_SECONDS_FAST)
FORWARD_SECONDS = _spec("pdserve_forward_seconds", HISTOGRAM,
                        "Time of one model forward over the step's batch", boundaries=_SECONDS_FAST)
TOKENS_PER_STEP = _spec("pdserve_tokens_per_step", HISTOGRAM,
                        "Tokens per step: kind=context (prompt tokens prefilled) or "
                        "kind=generated (tokens sampled)", KIND, boundaries=_TOKENS)
# Workers: exact totals (a Ray histogram's _sum is made of bucket midpoints).
TOKENS = _spec("pdserve_tokens", COUNTER,
               "Tokens processed: kind=context (prompt tokens prefilled) or kind=generated "
               "(tokens sampled); the exact total of pdserve_tokens_per_step", KIND)
SCHEDULER_STEPS = _spec("pdserve_scheduler_steps", COUNTER, "Executor steps (scheduler passes)")
SCHEDULER_TIME = _spec("pdserve_scheduler_time_seconds", COUNTER,
                       "Seconds spent scheduling; the exact total of pdserve_scheduler_step_seconds")
FORWARD_TIME = _spec("pdserve_forward_time_seconds", COUNTER,
                     "Seconds spent in model forwards; the exact total of pdserve_forward_seconds")
# Workers: KV cache.
KV_BLOCKS_USED = _spec("pdserve_kv_blocks_used", GAUGE, "KV blocks held by requests")
KV_BLOCKS_FREE = _spec("pdserve_kv_blocks_free", GAUGE,
                       "KV blocks free (including reusable cached blocks)")
KV_BLOCKS_CAPACITY = _spec("pdserve_kv_blocks_capacity", GAUGE, "KV blocks in the pool (total)")
KV_BLOCKS_QUARANTINED = _spec("pdserve_kv_blocks_quarantined", GAUGE,
                              "KV blocks held back after a failed transfer until the data plane is quiet")
# Router.
ROUTER_QUEUE_DEPTH = _spec("pdserve_router_queue_depth", GAUGE, "Requests waiting in the router's queue")
ROUTER_IN_FLIGHT = _spec("pdserve_router_in_flight", GAUGE, "Requests admitted and not yet finished")
ROUTER_REQUESTS = _spec("pdserve_router_requests", COUNTER,
                        "Finished router requests by outcome (completed | failed | aborted | rejected)",
                        OUTCOME)
ROUTER_PREFILLS = _spec("pdserve_router_prefills", COUNTER,
                        "Dispatched prefills: kind=remote (context worker) or kind=local", KIND)
ROUTER_FALLBACKS = _spec("pdserve_router_fallbacks", COUNTER,
                         "Attempts after a failed KV transfer, by where they went: kind=local | pair "
                         "(not retries: they do not count against max_retries)", KIND)
ROUTER_RETRIES = _spec("pdserve_router_retries", COUNTER, "Retries on another worker pair or locally")
ROUTER_KV_PATHS = _spec("pdserve_router_kv_paths", COUNTER,
                        "How each finished request's KV reached its generation worker: "
                        "kind=transferred | local_prefill | prefix_cached | context_finished | failed",
                        KIND)
ROUTER_PREFIX_PREDICTIONS = _spec("pdserve_router_prefix_predictions", COUNTER,
                                  "Completed requests by how the prefix index's prediction for the "
                                  "prefill worker compared with what it reused: outcome=exact | over | under",
                                  OUTCOME)
ROUTER_PREFIX_PREDICTED_TOKENS = _spec("pdserve_router_prefix_predicted_tokens", COUNTER,
                                       "Prompt tokens the prefix index predicted the prefill worker caches")
ROUTER_PREFIX_REUSED_TOKENS = _spec("pdserve_router_prefix_reused_tokens", COUNTER,
                                    "Prompt tokens the prefill worker reported it reused from its cache")
ROUTER_QUEUE_SECONDS = _spec("pdserve_router_queue_seconds", HISTOGRAM,
                             "Router receipt to dispatch to the first worker", boundaries=_SECONDS_LATENCY)
ROUTER_TTFT_SECONDS = _spec("pdserve_router_ttft_seconds", HISTOGRAM,
                            "Router receipt to first token sent", boundaries=_SECONDS_LATENCY)
ROUTER_E2E_SECONDS = _spec("pdserve_router_e2e_seconds", HISTOGRAM,
                           "Router receipt to last token sent", boundaries=_SECONDS_LATENCY)

# Every spec above, in definition order: defining a spec is all it takes to list it.
METRICS: tuple[MetricSpec, ...] = tuple(v for v in list(globals().values()) if isinstance(v, MetricSpec))
METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in METRICS)

# Every LlmRequestState name: the ``state`` tag's values.
_STATE_NAMES = (
    "DISAGG_TRANS_ERROR", "UNKNOWN", "ENCODER_INIT", "DISAGG_CONTEXT_WAIT_SCHEDULER",
    "DISAGG_GENERATION_INIT", "DISAGG_GENERATION_TRANS_IN_PROGRESS", "CONTEXT_INIT",
    "DISAGG_CONTEXT_INIT_AND_TRANS", "DISAGG_GENERATION_TRANS_COMPLETE", "GENERATION_IN_PROGRESS",
    "GENERATION_TO_COMPLETE", "GENERATION_COMPLETE", "DISAGG_CONTEXT_TRANS_IN_PROGRESS",
    "DISAGG_CONTEXT_COMPLETE", "DISAGG_GENERATION_WAIT_TOKENS",
)

# Final session states of a transfer that delivered its KV (transport.sessions SendState/RecvState).
OK_OUTCOMES = frozenset({"SENT", "COMPLETE"})
# RouterMetrics.count_kv_path's kinds (RouterTotals.kv_paths in the gRPC API).
KV_PATH_KINDS = ("transferred", "local_prefill", "prefix_cached", "context_finished", "failed")

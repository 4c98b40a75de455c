"""The router core, split by concern. It knows no protocol (no grpc, no aiohttp): the front
doors in ``cluster/front/`` adapt it.

- ``core.py``: ``Router``: admission, results, aborts, cluster status, health;
- ``queue.py``: ``RequestQueue``: the bounded waiting list, the requests held, in-flight slots;
- ``dispatch.py``: ``Dispatcher``: the dispatch loop and each request's attempts (the
  context_first flow, retries) over the workers' request channels;
- ``registry.py``: ``WorkerRegistry``: worker infos, channels, loads from heartbeats, liveness,
  restarts and events;
- ``request_state.py``: ``RouterRequest``, the typed state machine of one request (``Phase``);
- ``counters.py``: ``RouterCounters``: the totals and the metrics recorded with them;
- ``outputs.py``: what the doors get: ``RouterOutput``, ``ClusterSnapshot``, ``LiveCounters``;
- ``errors.py``: ``RouterError`` and its ``RouterErrorKind``, and the attempt failures;
- ``config.py``: ``RouterConfig``.
"""
from .config import RouterConfig
from .core import Router
from .errors import RouterError, RouterErrorKind
from .outputs import ClusterSnapshot, LiveCounters, RequestTimings, RequestUsage, RouterOutput
from .request_state import Phase, RouterRequest

__all__ = ["ClusterSnapshot", "LiveCounters", "Phase", "RequestTimings", "RequestUsage", "Router",
           "RouterConfig", "RouterError", "RouterErrorKind", "RouterOutput", "RouterRequest"]

"""The gRPC router, split by concern:

- ``core.py``: ``Router``: admission, the queue, responses, cancellation, health;
- ``dispatch.py``: ``Dispatcher``: the dispatch loop and each request's attempts (the
  context_first flow, retries) over the workers' request channels;
- ``registry.py``: ``WorkerRegistry``: worker infos, channels, loads from heartbeats, liveness,
  restarts and events;
- ``request_state.py``: ``RouterRequest``, the typed state machine of one request (``Phase``);
- ``servicer.py``: the gRPC service (Generate, Abort, GetClusterStatus), health, reflection;
- ``security.py``: the API-key interceptor and TLS credentials of the gRPC door;
- ``config.py``: ``RouterConfig`` and the errors.
"""
from .config import RouterConfig, RouterError
from .core import Router
from .request_state import Phase, RouterRequest

__all__ = ["Phase", "Router", "RouterConfig", "RouterError", "RouterRequest"]

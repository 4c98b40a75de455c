"""The router's front doors, each an adapter over the router core's narrow interface
(``cluster/router/core.py``: admit / results / abort / cluster_status / live_counters /
tokenize / health):

- ``grpc/``: the ``pdserve.v1.Router`` service with health and reflection, its API-key
  interceptor and TLS, and the conversions between proto messages and the core's types;
- ``openai/``: the OpenAI-compatible HTTP API on aiohttp, the OpenAI request and response
  mapping (pure), and the chat template;
- ``doors.py``: ``FrontDoors``, which the router actor uses to open and close both, with the
  API keys and TLS they share.

Nothing is imported here, so that importing the pure modules (``openai/api.py``) loads no
server library.
"""

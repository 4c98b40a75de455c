"""pdserve: prefill/decode disaggregated LLM serving.

Public API re-exports. Heavy modules (torch, Ray, gRPC) are imported lazily so that
``import pdserve.scheduler`` stays pure and fast.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("pdserve.workers.engine.offline", "LLM"),
    "SamplingParams": ("pdserve.workers.runner.sampling", "SamplingParams"),
    "RequestOutput": ("pdserve.workers.engine.offline", "RequestOutput"),
    "Client": ("pdserve.cluster.client", "Client"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(target[0])
    return getattr(module, target[1])


__all__ = sorted(_LAZY)

"""What pdserve's Ray actors are called: one place for the launcher, the router and the workers
(the dashboard's Actors page and the ``worker`` metric tag show these names)."""
from __future__ import annotations

NAMESPACE = "pdserve"
ROUTER_NAME = "pdserve-router"


def actor_name(worker_id: str) -> str:
    """``ctx-0`` -> ``pdserve-ctx-0``."""
    return f"pdserve-{worker_id}"

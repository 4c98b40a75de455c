"""The router's Ray actor: hosts ``Router`` (gRPC, and the OpenAI HTTP front door when asked) on
an event loop of its own thread. ``launch`` starts it as ``pdserve-router``; Ray imports this
module only where the actor runs or is launched."""
from __future__ import annotations

import ray

from pdserve.workers.names import NAMESPACE, actor_name

from .router import RouterConfig

CALL_TIMEOUT_S = 60.0  # one call into the router actor


@ray.remote(max_concurrency=8)
class RouterActor:
    """Hosts the router on an event loop of its own, on its own thread.

    Not Ray's async-actor loop: measured on the 2-core dev machine, the same router served
    1-token requests about 0.6 ms slower at p50 there (Ray's task machinery shares that
    loop). The actor's methods hand their work to the router's loop and wait for it."""

    def __init__(self, description: str = "") -> None:
        import asyncio
        import threading

        self.description = description
        self.router = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pdserve-router-loop",
                                       daemon=True)
        self.thread.start()

    def _on_loop(self, fn, timeout_s: float = CALL_TIMEOUT_S):
        """``fn()`` (a coroutine function or a plain one) run on the router's loop."""
        import asyncio

        async def run():
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def start(self, router_cfg: dict, infos: dict, model_dir: str, metrics: bool) -> int:
        from pdserve.workers.loader import load_tokenizer

        from .router import Router

        cfg = RouterConfig(**{**router_cfg, "agent_types": tuple(router_cfg.get("agent_types") or ())})
        handles = {w: ray.get_actor(actor_name(w), namespace=NAMESPACE) for w in infos}
        router_metrics = None
        if metrics:
            from pdserve.cluster.metrics import RouterMetrics

            router_metrics = RouterMetrics()
        tokenizer = load_tokenizer(model_dir)

        def build():  # on the loop: the router's asyncio objects belong to it
            self.router = Router(cfg, handles, infos, tokenizer, metrics=router_metrics, model_dir=model_dir)
            return self.router.start()

        return self._on_loop(build)

    def stop(self) -> None:
        if self.router is not None:
            self._on_loop(self.router.stop)

    def worker_restarted(self, info) -> bool:
        """A worker Ray restarted announces its new process (``WorkerInfo``) as soon as it is
        up, so the router reconnects now instead of finding out on a refresh tick by calling
        the restarting actor (which Ray holds for a second of death-info wait)."""
        if self.router is None:
            return False
        return self._on_loop(lambda: self.router.registry.worker_restarted(info))

    def dispatch_log(self) -> list[str]:
        return self._on_loop(lambda: list(self.router.dispatch_log))

    def request_phases(self) -> dict:
        return self._on_loop(self.router.request_phases)

    def debug_state(self) -> dict:
        return self._on_loop(self.router.debug_state)

    def port(self) -> int:
        return self.router.port

    def http_port(self) -> int | None:
        return self.router.http_port

    def __repr__(self) -> str:  # the dashboard's Actors page shows it
        return f"RouterActor({self.description})"

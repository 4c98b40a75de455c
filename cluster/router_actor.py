"""The router's Ray actor: hosts the router core (``Router``) and opens its front doors
(``FrontDoors``: gRPC, and OpenAI HTTP when asked) on an event loop of its own thread. ``launch``
starts it as ``pdserve-router``; Ray imports this module only where the actor runs or is
launched."""
from __future__ import annotations

import ray

from pdserve.workers.process.names import NAMESPACE, ROUTER_NAME, actor_name

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
        self.doors = None
        self.announced = None  # this router's file in local_routers' folder
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
        """Start the core (every worker heard and ready, or its wait over), then open the doors.
        Returns the gRPC port."""
        from pdserve.cluster.front.doors import FrontDoors
        from pdserve.workers.loading.loader import load_tokenizer

        from .router import Router

        cfg = RouterConfig(**{**router_cfg, "agent_types": tuple(router_cfg.get("agent_types") or ())})
        handles = {w: ray.get_actor(actor_name(w), namespace=NAMESPACE) for w in infos}
        router_metrics = None
        if metrics:
            from pdserve.cluster.metrics import RouterMetrics

            router_metrics = RouterMetrics()
        tokenizer = load_tokenizer(model_dir)

        async def build():  # on the loop: the router's asyncio objects belong to it
            self.router = Router(cfg, handles, infos, tokenizer, metrics=router_metrics)
            self.doors = FrontDoors(self.router, cfg, model_dir, shutdown=self._shutdown_cluster)
            await self.router.start()
            return await self.doors.start()

        grpc_port, http_port = self._on_loop(build)
        self._announce(cfg, grpc_port, http_port)
        return grpc_port

    def _announce(self, cfg: RouterConfig, grpc_port: int, http_port: int | None) -> None:
        from pdserve.cluster import local_routers

        try:
            self.announced = local_routers.announce({
                "grpc": f"{cfg.host}:{grpc_port}",
                "http": f"{cfg.http_host}:{http_port}" if http_port is not None else None,
                "ray_address": ray.get_runtime_context().gcs_address})
        except OSError:  # a read-only home: the router serves all the same
            self.announced = None

    def stop(self) -> None:
        if self.router is not None:
            self._on_loop(self._stop)

    async def _stop(self) -> None:
        from pdserve.cluster import local_routers

        local_routers.withdraw(self.announced)
        if self.doors is not None:
            await self.doors.stop()
        await self.router.stop()

    async def _shutdown_cluster(self) -> tuple[str, list[str]]:
        """The gRPC Shutdown call (on the router's loop): kill this cluster's workers now, then,
        once the reply has gone out, close the doors and end this actor. Never the Ray cluster."""
        import asyncio

        from pdserve.cluster.actors import kill_actors, pdserve_actor_names

        loop = asyncio.get_running_loop()
        names = await loop.run_in_executor(None, pdserve_actor_names)  # GCS calls: off the loop
        workers = [n for n in names if n != ROUTER_NAME]
        await loop.run_in_executor(None, kill_actors, workers)
        loop.create_task(self._end_after_reply())
        return ray.get_runtime_context().gcs_address, workers + [ROUTER_NAME]

    async def _end_after_reply(self) -> None:
        # The doors' stop waits (its grace) for the calls in flight, the Shutdown call among
        # them, so its reply is out before this process goes.
        await self._stop()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def worker_restarted(self, info) -> bool:
        """A worker Ray restarted announces its new process (``WorkerInfo``) as soon as it is
        up, so the router reconnects now instead of finding out on a refresh tick by calling
        the restarting actor (which Ray holds for a second of death-info wait)."""
        if self.router is None:
            return False
        return self._on_loop(lambda: self.router.registry.worker_restarted(info))

    def dispatch_log(self) -> list[str]:
        return self._on_loop(lambda: list(self.router.queue.dispatch_log))

    def request_phases(self) -> dict:
        return self._on_loop(self.router.request_phases)

    def debug_state(self) -> dict:
        return self._on_loop(self.router.debug_state)

    def port(self) -> int:
        return self.doors.grpc_port

    def http_port(self) -> int | None:
        return self.doors.http_port

    def __repr__(self) -> str:  # the dashboard's Actors page shows it
        return f"RouterActor({self.description})"

"""The generation (decode) worker as a Ray actor: reserves KV for generation-only requests at
DISAGG_GENERATION_INIT, receives it from context workers, decodes and streams tokens; it also
prefills locally when the router decides a prompt is short enough (conditional disaggregation)
or falls back after a failed transfer. Actor name ``pdserve-gen-<i>``."""
from __future__ import annotations

import ray

from pdserve.workers.process.ray_worker import RayWorker

CONCURRENCY_GROUPS = {"control": 8}


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class GenerationWorker(RayWorker):
    role = "generation"

    @ray.method(concurrency_group="control")
    def abort(self, request_id: int) -> bool:
        return RayWorker.abort(self, request_id)

    @ray.method(concurrency_group="control")
    def status(self) -> dict:
        return RayWorker.status(self)

    @ray.method(concurrency_group="control")
    def request_states(self) -> dict:
        return RayWorker.request_states(self)

    @ray.method(concurrency_group="control")
    def test_hook(self, name: str, *args):
        return RayWorker.test_hook(self, name, *args)

    @ray.method(concurrency_group="control")
    def ping(self) -> str:
        return "pong"

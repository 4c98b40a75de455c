"""The context (prefill) worker as a Ray actor: runs context-only requests to the end of their
prefill and sends their KV to generation workers. Actor name ``pdserve-ctx-<i>``."""
from __future__ import annotations

import ray

from pdserve.workers.process.ray_worker import RayWorker

# Requests arrive over the request channel, not as Ray calls; a direct caller's streaming
# generate() holds a default-group thread for the request's lifetime, so that group is wide.
# KV transfers get their own group so a long send never waits behind anything else.
CONCURRENCY_GROUPS = {"transfer": 8, "control": 8}


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class ContextWorker(RayWorker):
    role = "context"

    @ray.method(concurrency_group="transfer")
    def kv_transfer(self, payload: bytes, endpoint: str | None = None) -> bytes | None:
        return RayWorker.kv_transfer(self, payload, endpoint)

    # Retried by Ray across a restart: a generation worker told of this worker's new endpoint
    # may call before Ray has marked the restarted actor alive. An open is safe to repeat (a
    # second one for the same group is refused; an old endpoint is answered endpoint_gone).
    @ray.method(concurrency_group="control", max_task_retries=-1)
    def kv_pair_open(self, payload: bytes, endpoint: str | None = None) -> bytes | None:
        """A generation worker sets its pair group up (``PairOpen``): on the control group,
        never behind the transfers that wait for it."""
        return RayWorker.kv_transfer(self, payload, endpoint)

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

"""WorkerRegistry.wait_for_healthy: what wakes a request that waits for a worker (the router's
"Waiting for a worker", design.md section 3). The registry is Ray-free; this drives it with
the heartbeats a worker's request channel would bring."""
from __future__ import annotations

import asyncio
import dataclasses

from pdserve.cluster.router.config import RouterConfig
from pdserve.cluster.router.registry import WorkerRegistry
from pdserve.transport.requests import TransferTotals, WorkerInfo, WorkerStatus


def _info(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, pid=1, num_kv_blocks=64, tokens_per_block=8,
                      max_batch_size=8, max_input_len=None, max_seq_len=None, max_num_tokens=256,
                      vocab_size=100, endpoint="127.0.0.1:1#1", incarnation=1,
                      request_endpoint="127.0.0.1:2", request_token="t")


def _status(worker_id: str, role: str, *, healthy: bool, pairs: dict[str, str] | None = None):
    return WorkerStatus(
        worker_id=worker_id, role=role, healthy=healthy, pid=1, incarnation=1,
        capacity_policy="GUARANTEED_NO_EVICT", max_batch_size=8, tokens_per_block=8,
        num_active=0, queue_depth=0, requests_by_state={}, free_blocks=64, total_blocks=64,
        quarantined_blocks=0, pauses=0, paused_requests=0, queued_prefill_tokens=0,
        unexpected_recomputes=0, generated_tokens=0, context_tokens=0, steps=0,
        transfers=TransferTotals(), violations=[], kv_pairs=pairs or {})


def _registry() -> WorkerRegistry:
    infos = {"ctx-0": _info("ctx-0", "context"), "gen-0": _info("gen-0", "generation")}
    return WorkerRegistry(RouterConfig(), {}, infos)


def test_a_worker_turning_healthy_wakes_the_waiters_and_nothing_else_does():
    async def go():
        reg = _registry()
        reg.on_status("gen-0", _status("gen-0", "generation", healthy=False))
        waiting = asyncio.ensure_future(reg.wait_for_healthy(5.0))
        await asyncio.sleep(0.01)
        # still unhealthy, and a heartbeat of a worker that was healthy all along: no wake
        reg.on_status("gen-0", _status("gen-0", "generation", healthy=False))
        reg.on_status("ctx-0", _status("ctx-0", "context", healthy=True))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        reg.on_status("gen-0", _status("gen-0", "generation", healthy=True))
        assert await asyncio.wait_for(waiting, 1.0) is True
        # a later waiter waits for the next change, not the one before it
        assert await reg.wait_for_healthy(0.05) is False

    asyncio.run(go())


def test_a_kv_pair_becoming_ready_wakes_the_waiters():
    async def go():
        reg = _registry()
        opening = _status("gen-0", "generation", healthy=True, pairs={"ctx-0": "down"})
        reg.on_status("gen-0", opening)
        waiting = asyncio.ensure_future(reg.wait_for_healthy(5.0))
        await asyncio.sleep(0.01)
        reg.on_status("gen-0", dataclasses.replace(opening, kv_pairs={"ctx-0": "opening"}))
        await asyncio.sleep(0.01)
        assert not waiting.done() and not reg.pair_ready("ctx-0", "gen-0")
        reg.on_status("gen-0", dataclasses.replace(opening, kv_pairs={"ctx-0": "ready"}))
        assert await asyncio.wait_for(waiting, 1.0) is True
        assert reg.pair_ready("ctx-0", "gen-0")

    asyncio.run(go())

"""Chaos on a live Ray cluster, over gRPC: a cold burst the moment a fresh 1P2D cluster serves,
a KV pair group broken mid-transfer, a context worker stalling past the transfer deadline, and
the router killed and restarted while the workers hold leased KV.

What holds through all of them: every request a live worker can serve completes with the same
tokens as the in-process engine; a broken pair group fails only the transfer that was on it
and is rebuilt without anyone asking; a transfer failure costs no retry (``max_retries`` is for
dead workers); and each test ends drained (cluster_util.wait_drained: all KV free, nothing
quarantined, no violation, every worker healthy and the router SERVING).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def _all_at_once(cl, prefix: str, batch: list[list[int]], max_tokens: int,
                 disaggregation: str = "ALWAYS", timeout_s: float = 240.0) -> list[U.Result]:
    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            return await asyncio.gather(*(
                U.generate(stub, f"{prefix}-{i}", p, max_tokens, disaggregation=disaggregation)
                for i, p in enumerate(batch)))

    return U.run(go(), timeout_s)


def _ok(results: list[U.Result]) -> None:
    assert [r.code for r in results] == [None] * len(results), [
        (r.request_id, r.code, r.details) for r in results if r.code is not None]


def _pairs(cl, gen_id: str) -> dict[str, dict]:
    return U.worker_statuses(cl)[gen_id]["kv_pairs"]


def _transfers(cl) -> dict[str, dict]:
    return {w: s["transfers"] for w, s in U.worker_statuses(cl).items()}


def _wait_pair_ready(cl, gen_id: str, ctx_id: str, timeout_s: float = 60.0) -> dict:
    """The pair's stats once its group is set up and the router has heard so."""
    def ready():
        unready = ray.get(cl.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)["kv_pairs_unready"]
        pair = _pairs(cl, gen_id)[ctx_id]
        return pair["state"] == "ready" and f"{ctx_id}->{gen_id}" not in unready and pair

    return U.wait_for(ready, timeout_s, f"{gen_id}'s KV pair with {ctx_id} to be ready")


def _receiving(cl, gen_id: str) -> int:
    """Generation requests whose KV request went out (a receive shows its session state)."""
    states = ray.get(cl.workers[gen_id].request_states.remote(), timeout=U.RAY_TIMEOUT_S)
    return sum(s in ("REQUESTED", "RECEIVING") for s in states.values())


def _while_transfers_held(cl, prefix: str, batch: list[list[int]], then, **kwargs) -> list[U.Result]:
    """Sends ``batch`` with every KV send of ctx-0 held after its header; once every request
    waits for its KV on gen-0 (the first transfer on the wire, the others queued behind it),
    runs ``then()`` and returns the results."""
    ray.get(cl.workers["ctx-0"].test_hook.remote("stall_send", 30.0), timeout=U.RAY_TIMEOUT_S)

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            tasks = [asyncio.ensure_future(U.generate(stub, f"{prefix}-{i}", p, 4, timeout_s=60,
                                                      **kwargs))
                     for i, p in enumerate(batch)]
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(_receiving, cl, "gen-0") < len(batch):
                assert time.monotonic() < deadline, "the transfers never queued up"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(then)
            return await asyncio.gather(*tasks)

    return U.run(go(), 240)


def test_a_cold_burst_into_a_fresh_1p2d_cluster(cluster, model_dir):
    """100 disaggregated requests the moment the cluster serves: the pair groups were set up
    before any worker said it was ready, so no transfer fails, none is retried, none falls
    back to local prefill."""
    cl = cluster(num_context_workers=1, num_generation_workers=2)
    # Ready means set up: every pair is, before a single request.
    for gen_id in ("gen-0", "gen-1"):
        pair = _pairs(cl, gen_id)["ctx-0"]
        assert (pair["state"], pair["opens"], pair["poisoned"]) == ("ready", 1, 0), pair
    batch = U.prompts(100, seed=31)
    results = _all_at_once(cl, "cold", batch, 4)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 4)
    st = U.status(cl.port)
    assert (st.totals.retries, st.totals.fallbacks, st.totals.remote_prefills) == (0, 0, 100)
    transfers = _transfers(cl)
    assert transfers["ctx-0"]["sent"] == 100 and transfers["ctx-0"]["failed"] == 0, transfers
    assert sum(transfers[g]["received"] for g in ("gen-0", "gen-1")) == 100, transfers
    assert all(transfers[g]["failed"] == 0 for g in ("gen-0", "gen-1")), transfers
    for gen_id in ("gen-0", "gen-1"):  # still the groups set up at start: none broke
        assert _pairs(cl, gen_id)["ctx-0"]["opens"] == 1
    U.wait_drained(cl)


def test_a_pair_group_broken_mid_transfer_is_rebuilt(cluster, model_dir):
    """The group is aborted while a transfer is on it and more wait behind it. That transfer
    fails (and its request falls back to local prefill); the ones queued behind it move to
    the rebuilt group and arrive. Nobody asked for the rebuild."""
    cl = cluster(num_context_workers=1, num_generation_workers=1)
    ctx, gen = cl.workers["ctx-0"], cl.workers["gen-0"]
    before = _wait_pair_ready(cl, "gen-0", "ctx-0")
    batch = U.prompts(10, seed=41)
    box: dict = {}

    def cut() -> None:  # from the side whose listener accepted the connection; then let go
        box["broken"] = (ray.get(ctx.test_hook.remote("break_pair", "gen-0"), timeout=U.RAY_TIMEOUT_S)
                         or ray.get(gen.test_hook.remote("break_pair", "ctx-0"), timeout=U.RAY_TIMEOUT_S))
        ray.get(ctx.test_hook.remote("stall_send", 0.0), timeout=U.RAY_TIMEOUT_S)

    results = _while_transfers_held(cl, "cut", batch, cut, disaggregation="AUTO")
    assert box["broken"] is True
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 4)
    after = _wait_pair_ready(cl, "gen-0", "ctx-0")
    assert after["opens"] == before["opens"] + 1 and after["poisoned"] == before["poisoned"] + 1, after
    assert after["reissued"] == len(batch) - 1, after  # all but the one on the wire moved
    st = U.status(cl.port)
    assert st.totals.retries == 0
    assert st.totals.fallbacks == 1  # only the transfer in flight on the group failed
    transfers = _transfers(cl)
    assert transfers["gen-0"]["failed"] == 1 and transfers["gen-0"]["received"] == len(batch) - 1
    # The rebuilt group carries transfers as before.
    again = U.prompts(6, seed=42)
    results = _all_at_once(cl, "healed", again, 4)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, again, 4)
    assert _transfers(cl)["gen-0"]["received"] == len(batch) - 1 + len(again)
    assert U.status(cl.port).totals.fallbacks == 1
    U.wait_drained(cl)


def test_a_context_worker_stalling_past_the_transfer_deadline(cluster, model_dir):
    """Its sends hang longer than the transfer deadline: those transfers time out, their
    requests are prefilled again on the generation worker (no retry used), and once the
    stall is over the pair heals and transfers resume."""
    cl = cluster(num_context_workers=1, num_generation_workers=1, transfer_timeout_s=3.0,
                 router=RouterConfig(max_retries=0))
    ctx = cl.workers["ctx-0"]
    before = _wait_pair_ready(cl, "gen-0", "ctx-0")
    ray.get(ctx.test_hook.remote("stall_send", 6.0), timeout=U.RAY_TIMEOUT_S)
    batch = U.prompts(4, seed=51)
    results = _all_at_once(cl, "stalled", batch, 4, disaggregation="AUTO")
    _ok(results)  # max_retries=0: a transfer failure is a fallback, never a retry
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 4)
    st = U.status(cl.port)
    assert st.totals.retries == 0 and st.totals.fallbacks >= 1, st.totals
    assert all(r.last.timings.fallbacks <= 1 for r in results)
    ray.get(ctx.test_hook.remote("stall_send", 0.0), timeout=U.RAY_TIMEOUT_S)
    after = _wait_pair_ready(cl, "gen-0", "ctx-0")
    assert after["opens"] > before["opens"], after
    received = _transfers(cl)["gen-0"]["received"]
    fallbacks = U.status(cl.port).totals.fallbacks
    again = U.prompts(4, seed=52)
    results = _all_at_once(cl, "resumed", again, 4)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, again, 4)
    assert _transfers(cl)["gen-0"]["received"] == received + len(again)
    assert U.status(cl.port).totals.fallbacks == fallbacks
    U.wait_drained(cl)


def test_the_router_killed_and_restarted_while_workers_hold_leased_kv(cluster, model_dir):
    """The router dies with requests prefilled and their KV leased on the context worker.
    Clients see their streams end with UNAVAILABLE (nothing resumes them: they send again).
    The workers lose the router's channel, abort what it owned, and every lease runs out or
    is cancelled, so all KV comes back; a new router on the same workers serves at once."""
    cl = cluster(num_context_workers=1, num_generation_workers=1, lease_s=4.0)
    ctx = cl.workers["ctx-0"]
    _wait_pair_ready(cl, "gen-0", "ctx-0")
    batch = U.prompts(6, seed=61)
    box: dict = {}

    def kill_router() -> None:
        statuses = U.worker_statuses(cl)
        box["held"] = statuses["ctx-0"]["total_blocks"] - statuses["ctx-0"]["free_blocks"]
        ray.kill(cl.router, no_restart=True)

    results = _while_transfers_held(cl, "orphan", batch, kill_router)
    assert box["held"] > 0  # the context worker held their KV when the router died
    assert {r.code for r in results} == {grpc.StatusCode.UNAVAILABLE}, [
        (r.code, r.details) for r in results]
    ray.get(ctx.test_hook.remote("stall_send", 0.0), timeout=U.RAY_TIMEOUT_S)

    def freed() -> bool:
        return all(s["free_blocks"] == s["total_blocks"] and not s["requests_by_state"]
                   and s["quarantined_blocks"] == 0 for s in U.worker_statuses(cl).values())

    U.wait_for(freed, 60, "every worker to free the KV of the dead router's requests")
    cl.restart_router()
    assert ray.get(cl.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)["serving"]
    again = U.prompts(6, seed=62)
    results = _all_at_once(cl, "after-router", again, 4)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, again, 4)
    U.wait_drained(cl)

"""The cluster end to end: a local Ray cluster on 127.0.0.1, worker actors, the gRPC router.

One Ray instance serves the module. A test that needs particular settings (or a cluster that
has served nothing: exact transfer and pause figures, a fresh router's dispatch log or KV index)
launches the pdserve actors it needs and kills only those; the tests at the end share one
default 1P1D cluster (each launch costs seconds of actor start-up), each counting only what its
own requests change. Outputs are compared token for token with the in-process engine on the same
model.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import ray  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cluster.client import Client  # noqa: E402
from pdserve.cluster.launch import LaunchConfig, launch  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402
from pdserve.cluster.rpc import router_pb2 as pb  # noqa: E402
from pdserve.cluster.rpc import router_pb2_grpc  # noqa: E402
from cluster_util import drain  # noqa: E402

# A Ray of its own (conftest): the pause test sums its figures from Ray's metrics endpoint, which
# shows every actor the Ray instance has hosted.
OWN_RAY = True
ENGINE = dict(tokens_per_block=4, max_batch_size=8, max_num_tokens=64,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=8, num_kv_blocks=256)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _launch(model_dir, **kwargs):
    kwargs.setdefault("engine", ENGINE)
    router = kwargs.pop("router", RouterConfig())
    return launch(LaunchConfig(model=str(model_dir), router=dataclasses.replace(router, port=0), **kwargs))


@pytest.fixture(scope="module")
def _held(ray_cluster):
    """The shared default cluster while one is up (one pdserve cluster per Ray at a time: actor
    names are fixed)."""
    held: dict = {}
    yield held
    if held.get("cluster") is not None:
        held.pop("cluster").shutdown()


@pytest.fixture
def cluster(_held, model_dir):
    """``launch(**kwargs)``: a fresh cluster for this test, shut down after it."""
    if _held.get("cluster") is not None:
        _held.pop("cluster").shutdown()
    started = []

    def launch_one(**kwargs):
        cl = _launch(model_dir, **kwargs)
        started.append(cl)
        return cl

    yield launch_one
    for cl in started:
        cl.shutdown()


@pytest.fixture
def default_cluster(_held, model_dir):
    """The module's default 1P1D cluster (ENGINE, the default router), launched on first use and
    shared by the tests after; each leaves it drained."""
    if _held.get("cluster") is None:
        _held["cluster"] = _launch(model_dir)
    return _held["cluster"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _reference(model_dir, prompts, max_tokens):
    llm = LLM(model_dir, **ENGINE)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY))]


async def _generate_all(port, prompts, max_tokens, **kwargs):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i, p):
            req = Client.build_request(p, max_tokens=max_tokens, request_id=f"r{i}", **GREEDY, **kwargs)
            tokens, last = [], None
            async for delta in stub.Generate(req, timeout=120):
                tokens.extend(delta.token_ids)
                last = delta
            return tokens, last

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _status(port) -> pb.ClusterStatus:
    with Client(f"127.0.0.1:{port}") as client:
        return client.status()


def _wait_drained(port, timeout_s=30.0) -> pb.ClusterStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(port)
        if all(w.free_kv_blocks == w.total_kv_blocks and not w.requests_by_state for w in status.workers):
            for w in status.workers:
                assert list(w.invariant_violations) == [], (w.worker_id, w.invariant_violations)
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"cluster did not drain: {status}")
        time.sleep(0.2)


def test_1p1d_matches_engine_and_pauses_under_a_small_generation_pool(cluster, model_dir):
    prompts = _prompts(12, seed=1)
    cl = cluster(generation_engine=dict(capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=24))
    results = asyncio.run(_generate_all(cl.port, prompts, 16))
    assert [t for t, _ in results] == _reference(model_dir, prompts, 16)
    assert all(last.finish_reason == "length" for _, last in results)

    status = _wait_drained(cl.port)
    gen = next(w for w in status.workers if w.worker_id == "gen-0")
    ctx = next(w for w in status.workers if w.worker_id == "ctx-0")
    assert gen.pauses > 0, "the generation pool was sized to force pauses"
    assert sum(last.timings.pauses for _, last in results) == gen.pauses
    # One KV transfer per disaggregated request, on both sides.
    assert all(last.timings.ctx_worker == "ctx-0" and last.timings.kv_transfer_bytes > 0 for _, last in results)
    assert dict(ctx.transfers.outcomes) == {"SENT": len(prompts)}
    assert dict(gen.transfers.outcomes) == {"COMPLETE": len(prompts)}
    # Each KV request went over the direct link, and its Ray copy (the record) folded into it.
    pair = ray.get(cl.workers["gen-0"].status.remote(), timeout=60)["kv_pairs"]["ctx-0"]
    assert pair["link"] is True and len(pair["first_byte_ms"]) >= len(prompts)
    def folded():  # the last Ray copies may still be on their way
        return ray.get(cl.workers["ctx-0"].__ray_call__.remote(
            lambda self: self.host.core.transceiver.sender.folded), timeout=60)

    end = time.monotonic() + 30
    while folded() < len(prompts) and time.monotonic() < end:
        time.sleep(0.2)
    assert folded() == len(prompts)

    # The same figures reach Ray's Prometheus endpoint.
    # (each process exports on its own cycle: wait until both sides' last figures are in)
    text = _scrape_until(lambda t: _metric_sum(t, "ray_pdserve_paused_requests") >= gen.pauses
                         and _metric_sum(t, "ray_pdserve_kv_transfers", role="generation") >= len(prompts)
                         and _metric_sum(t, "ray_pdserve_kv_transfers", role="context") >= len(prompts))
    assert _metric_sum(text, "ray_pdserve_paused_requests") == gen.pauses
    assert _metric_sum(text, "ray_pdserve_kv_transfers", role="generation") == len(prompts)
    assert _metric_sum(text, "ray_pdserve_kv_transfers", role="context") == len(prompts)


def test_2p2d_matches_engine_and_spreads_work(cluster, model_dir):
    prompts = _prompts(16, seed=2)
    cl = cluster(num_context_workers=2, num_generation_workers=2)
    results = asyncio.run(_generate_all(cl.port, prompts, 12))
    assert [t for t, _ in results] == _reference(model_dir, prompts, 12)
    assert {last.timings.ctx_worker for _, last in results} == {"ctx-0", "ctx-1"}
    assert {last.timings.gen_worker for _, last in results} == {"gen-0", "gen-1"}
    _wait_drained(cl.port)


def test_agent_tree_order_decides_dispatch_when_saturated(cluster):
    # One request in flight at a time: the queue builds, and each dispatch round the agent tree
    # (agent_percentage 1.0) puts agent requests first, ordered by their node id.
    cl = cluster(router=RouterConfig(max_inflight=1, agent_types=("AgentDeepResearch",), agent_percentage=1.0))

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cl.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(rid, hierarchy, max_tokens=4):
                req = Client.build_request([5, 6, 7, 8], max_tokens=max_tokens, request_id=rid,
                                           agent_hierarchy=hierarchy, **GREEDY)
                await drain(stub.Generate(req, timeout=120))

            async def phase_of(rid):
                return (await cl.router.request_phases.remote()).get(rid, {}).get("phase")

            # The blocker's KV send is held, so it stays in flight until every other request
            # has queued behind it, however slow this machine is.
            await cl.workers["ctx-0"].test_hook.remote("stall_send", 60.0)
            blocker = asyncio.create_task(one("blocker", [], max_tokens=8))
            others = [("chat-1", []), ("agent-n7", [("AgentDeepResearch", 7)]), ("chat-2", []),
                      ("agent-n3", [("AgentDeepResearch", 3)])]
            tasks = []
            async with asyncio.timeout(60):
                while await phase_of("blocker") in (None, "queued"):
                    await asyncio.sleep(0.02)
                for rid, h in others:  # each one queued before the next arrives
                    tasks.append(asyncio.create_task(one(rid, h)))
                    while (phase := await phase_of(rid)) is None:
                        await asyncio.sleep(0.02)
                    assert phase == "queued"
            await cl.workers["ctx-0"].test_hook.remote("stall_send", 0.0)
            await asyncio.gather(blocker, *tasks)

    asyncio.run(run())
    order = ray.get(cl.router.dispatch_log.remote(), timeout=30)
    assert order == ["blocker", "agent-n3", "agent-n7", "chat-1", "chat-2"]


def test_conditional_disaggregation_sends_short_prompts_to_the_generation_worker(cluster, model_dir):
    cl = cluster(router=RouterConfig(max_local_prefill_length=8))
    long_prompt = _prompts(1, seed=4)[0] + list(range(10, 40))
    short_tail = long_prompt + [9, 9, 9]  # the cached part is long_prompt; 3 new tokens
    (tokens1, last1), = asyncio.run(_generate_all(cl.port, [long_prompt], 6))
    assert not last1.timings.local_prefill and last1.timings.ctx_worker == "ctx-0"
    deadline = time.monotonic() + 60  # gen-0 stored the prompt's blocks: its KV events say so
    while not ray.get(cl.router.debug_state.remote(), timeout=30)["kv_index"].get("gen-0"):
        assert time.monotonic() < deadline, "the router never saw gen-0's cached blocks"
        time.sleep(0.1)
    (tokens2, last2), = asyncio.run(_generate_all(cl.port, [short_tail], 6))
    assert last2.timings.local_prefill and last2.timings.ctx_worker == ""
    assert last2.timings.kv_transfer_bytes == 0
    assert [tokens1, tokens2] == _reference(model_dir, [long_prompt, short_tail], 6)
    _wait_drained(cl.port)


def test_health_reflection_and_validation(default_cluster):
    cl = default_cluster

    async def check():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cl.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = set()
            async for response in call:
                names |= {s.name for s in response.list_services_response.service}
                break
            assert "pdserve.v1.Router" in names
            stub = router_pb2_grpc.RouterStub(channel)
            bad = Client.build_request([1, 2, 3], max_tokens=4, top_p=1.5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(stub.Generate(bad, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sampling.top_p" in err.value.details()

    asyncio.run(check())


def test_abort_mid_decode_frees_blocks_on_both_workers(default_cluster):
    cl = default_cluster

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cl.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            req = Client.build_request(_prompts(1, seed=6)[0], max_tokens=900, request_id="long", **GREEDY)
            call = stub.Generate(req, timeout=120)
            got, aborted = 0, False
            async for delta in call:
                got += len(delta.token_ids)
                if got >= 4 and not aborted:  # decoding on the generation worker now
                    aborted = True
                    reply = await stub.Abort(pb.AbortRequest(request_id="long"), timeout=10)
                    assert reply.aborted
                if delta.finish_reason:
                    assert delta.finish_reason == "abort"
                    break

    asyncio.run(run())
    status = _wait_drained(cl.port)
    assert all(w.quarantined_blocks == 0 for w in status.workers)


# ---------------------------------------------------------------------- Prometheus

def _metrics_url() -> str:
    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def _scrape_until(predicate, timeout_s: float = 40.0) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(_metrics_url(), timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        if text and predicate(text):
            return text
        time.sleep(1.0)
    raise AssertionError("metrics did not reach Ray's Prometheus endpoint in time:\n"
                         + "\n".join(line for line in text.splitlines() if "pdserve" in line)[:3000])


def _metric_sum(text: str, name: str, **tags) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:_total)?\{{([^}}]*)\}} ([0-9.e+-]+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(labels.get(k) == v for k, v in tags.items()):
            total += float(m.group(2))
    return total


def test_client_cancellation_reaches_the_workers(default_cluster):
    cl = default_cluster
    completed_before = _status(cl.port).totals.completed

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cl.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            req = Client.build_request(_prompts(1, seed=8)[0], max_tokens=900, request_id="gone", **GREEDY)
            call = stub.Generate(req, timeout=120)
            got = 0
            async for delta in call:
                got += len(delta.token_ids)
                if got >= 4:
                    call.cancel()  # the client goes away mid-decode
                    break

    asyncio.run(run())
    status = _wait_drained(cl.port)
    assert status.totals.completed == completed_before and status.totals.in_flight == 0


def test_a_sync_client_that_stops_reading_cancels_the_request(default_cluster):
    cl = default_cluster
    completed_before = _status(cl.port).totals.completed
    with Client(f"127.0.0.1:{cl.port}") as client:
        stream = client.generate_stream(_prompts(1, seed=12)[0], max_tokens=900, request_id="left",
                                        **GREEDY)
        got = 0
        for delta in stream:
            got += len(delta.token_ids)
            if got >= 4:
                break
        stream.close()  # what leaving the loop does once the generator is collected
    status = _wait_drained(cl.port)
    assert status.totals.completed == completed_before and status.totals.in_flight == 0


def test_one_token_request_finishes_on_the_context_worker(default_cluster, model_dir):
    cl = default_cluster

    def transfers(status) -> dict[str, int]:
        return {w.worker_id: w.transfers.count for w in status.workers}

    before = transfers(_wait_drained(cl.port))
    prompts = _prompts(3, seed=9)
    results = asyncio.run(_generate_all(cl.port, prompts, 1))
    assert [t for t, _ in results] == _reference(model_dir, prompts, 1)
    status = _wait_drained(cl.port)
    assert set(before) == {"ctx-0", "gen-0"}
    assert transfers(status) == before  # nothing to hand off

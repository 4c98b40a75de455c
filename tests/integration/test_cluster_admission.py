"""The router's front door on a local Ray cluster, over gRPC: malformed requests (INVALID_ARGUMENT
naming the field, a duplicate id, an oversize message), a broken invariant turning health
NOT_SERVING, a full queue answering RESOURCE_EXHAUSTED, and 2,000 requests at concurrency 64
with nothing lost and memory bounded. Every test ends with the drain check: zero leaked blocks,
zero stuck requests. Figures are printed; run with -s to see them.
"""
from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grpc  # noqa: E402
import ray  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402
from pdserve.cluster.rpc import router_pb2 as pb  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MAX_INPUT_LEN, MAX_SEQ_LEN, VOCAB = 64, 128, 259
ENGINE = dict(U.ENGINE, max_input_len=MAX_INPUT_LEN, max_seq_len=MAX_SEQ_LEN)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def shared(clusters):
    """A 1P1D cluster with the default router, shared by the tests that need nothing else."""
    return clusters(engine=ENGINE)


def _req(**fields) -> pb.GenerateRequest:
    """A valid request with ``fields`` overriding it (dotted names reach into sampling)."""
    req = U.Client.build_request([5, 6, 7, 8], max_tokens=4, **U.GREEDY)
    for name, value in fields.items():
        if name == "no_prompt":
            req.ClearField("prompt")
        elif name == "empty_token_ids":
            req.token_ids.Clear()
            req.token_ids.SetInParent()
        elif name == "text":
            req.text = value
        elif name == "token_ids":
            req.token_ids.Clear()
            req.token_ids.ids.extend(value)
        elif name == "agent_hierarchy":
            req.agent_hierarchy.extend(pb.AgentLevel(agent_type=t, node_id=n) for t, n in value)
        elif name.startswith("sampling."):
            field = name.split(".", 1)[1]
            if field == "stop_token_ids":
                req.sampling.stop_token_ids.extend(value)
            else:
                setattr(req.sampling, field, value)
        else:
            setattr(req, name, value)
    return req


DEEP = "AgentDeepResearch"
BAD_INPUT = [  # (case, request, the field its error must name)
    ("no prompt", _req(no_prompt=True), "prompt"),
    ("empty text", _req(text=""), "prompt.text"),
    ("empty token ids", _req(empty_token_ids=True), "prompt.token_ids"),
    ("token id == vocab size", _req(token_ids=[5, 6, VOCAB]), "prompt.token_ids[2]"),
    ("token id 2**32-1", _req(token_ids=[2**32 - 1]), "prompt.token_ids[0]"),
    ("prompt longer than max_input_len", _req(token_ids=[7] * (MAX_INPUT_LEN + 1)), "prompt.token_ids"),
    ("text longer than max_input_len", _req(text="hello world " * 10), "prompt.text"),
    ("max_tokens 0", _req(**{"sampling.max_tokens": 0}), "sampling.max_tokens"),
    ("max_tokens negative", _req(**{"sampling.max_tokens": -5}), "sampling.max_tokens"),
    ("max_tokens above the limit", _req(**{"sampling.max_tokens": 100_000}), "sampling.max_tokens"),
    ("prompt + max_tokens > max_seq_len", _req(**{"sampling.max_tokens": MAX_SEQ_LEN}),
     "sampling.max_tokens"),
    ("temperature negative", _req(**{"sampling.temperature": -0.5}), "sampling.temperature"),
    ("temperature NaN", _req(**{"sampling.temperature": math.nan}), "sampling.temperature"),
    ("temperature inf", _req(**{"sampling.temperature": math.inf}), "sampling.temperature"),
    ("top_p 0", _req(**{"sampling.top_p": 0.0}), "sampling.top_p"),
    ("top_p above 1", _req(**{"sampling.top_p": 1.5}), "sampling.top_p"),
    ("top_p negative", _req(**{"sampling.top_p": -0.1}), "sampling.top_p"),
    ("top_k negative", _req(**{"sampling.top_k": -1}), "sampling.top_k"),
    ("seed 2**63", _req(**{"sampling.seed": 2**63}), "sampling.seed"),
    ("stop token outside the vocabulary", _req(**{"sampling.stop_token_ids": [300]}),
     "sampling.stop_token_ids[0]"),
    ("too many stop tokens", _req(**{"sampling.stop_token_ids": list(range(3, 36))}),
     "sampling.stop_token_ids"),
    ("priority negative", _req(priority=-0.1), "priority"),
    ("priority above 1", _req(priority=1.5), "priority"),
    ("priority NaN", _req(priority=math.nan), "priority"),
    ("unknown agent type", _req(agent_hierarchy=[("AgentFoo", 1)]), "agent_hierarchy[0].agent_type"),
    ("empty agent type", _req(agent_hierarchy=[("", 1)]), "agent_hierarchy[0].agent_type"),
    ("negative agent node id", _req(agent_hierarchy=[(DEEP, -1)]), "agent_hierarchy[0].node_id"),
    ("unknown type at level 2", _req(agent_hierarchy=[(DEEP, 1), ("nope", 2)]),
     "agent_hierarchy[1].agent_type"),
    ("agent hierarchy too deep", _req(agent_hierarchy=[(DEEP, i) for i in range(9)]), "agent_hierarchy"),
    ("unknown disaggregation mode", _req(disaggregation=7), "disaggregation"),
    ("empty request id", _req(request_id=""), "request_id"),
    ("request id with a space", _req(request_id="bad id"), "request_id"),
    ("request id too long", _req(request_id="r" * 200), "request_id"),
    ("deadline_ms 0", _req(deadline_ms=0), "deadline_ms"),
    ("deadline_ms above a day", _req(deadline_ms=10**9), "deadline_ms"),
]


async def _health(ch) -> int:
    reply = await health_pb2_grpc.HealthStub(ch).Check(
        health_pb2.HealthCheckRequest(service="pdserve.v1.Router"), timeout=10)
    return reply.status


async def _expect_error(stub, req: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await U.drain(stub.Generate(req, timeout=30))
    return err.value


def test_bad_input_is_refused_naming_the_field_and_the_server_stays_healthy(shared, model_dir):
    before = U.status(shared.port).totals.rejected
    prompt = U.prompts(1, seed=51)[0]

    async def go():
        async with U.channel(shared.port) as ch:
            stub = U.stub_of(ch)
            for case, req, field in BAD_INPUT:
                err = await _expect_error(stub, req)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code(), err.details())
                assert err.details().startswith(field + ":"), (case, err.details())

            # A duplicate of a request id that is in flight (its KV send is held meanwhile).
            ctx = shared.workers["ctx-0"]
            await ctx.test_hook.remote("stall_send", 60.0)
            first = asyncio.create_task(U.generate(stub, "dup", prompt, 100))
            await _wait_in_router(shared, "dup")
            err = await _expect_error(stub, _req(request_id="dup"))
            await ctx.test_hook.remote("stall_send", 0.0)
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS and err.details().startswith("request_id:")
            original = await first
            assert original.code is None and len(original.tokens) == 100

            # More than the gRPC message limit (4 MiB) is refused before the router sees it.
            err = await _expect_error(stub, _req(text="a" * (5 << 20)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()

            # A message that is not a GenerateRequest at all (cut short, or garbage).
            raw = ch.unary_stream("/pdserve.v1.Router/Generate")  # bytes in, bytes out
            whole = _req().SerializeToString()
            for data in (whole[:len(whole) // 2], b"\xff\xff\xff\xff"):
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await U.drain(raw(data, timeout=30))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
                assert bad.value.details().startswith("request: not a valid pdserve.v1.GenerateRequest")

            # A 3 MiB text prompt (inside the message limit) while another request streams: it
            # is refused by its byte length, never tokenized, and the stream goes on.
            streaming = asyncio.create_task(U.generate(stub, "streaming", prompt, 40))
            err = await _expect_error(stub, _req(text="hello world " * (1 << 18)))  # 3 MiB
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details().startswith("prompt.text:") and "bytes cannot fit max_input_len" in err.details()
            streamed = await streaming
            assert streamed.code is None and streamed.tokens == U.reference(model_dir, [prompt], 40, ENGINE)[0]

            assert await _health(ch) == SERVING
            return await U.generate(stub, "after", prompt, 8)  # serving normally

    after = U.run(go(), 180)
    assert after.code is None and after.tokens == U.reference(model_dir, [prompt], 8, ENGINE)[0]
    st = U.wait_drained(shared)
    assert st.totals.rejected - before == len(BAD_INPUT) + 2  # + the duplicate + the 3 MiB text
    print(f"\nbad input: {len(BAD_INPUT)} INVALID_ARGUMENT cases + 1 duplicate id + 1 oversize "
          f"message refused; the server served normally afterwards")


async def _wait_in_router(cl, request_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while request_id not in await cl.router.request_phases.remote():
        assert time.monotonic() < deadline, f"{request_id} never reached the router"
        await asyncio.sleep(0.02)


def test_health_fails_while_an_invariant_is_broken(shared):
    async def health_is(status: int) -> None:
        async with U.channel(shared.port) as ch:
            deadline = time.monotonic() + 30
            while await _health(ch) != status:
                assert time.monotonic() < deadline, f"health never became {status}"
                await asyncio.sleep(0.1)

    gen = shared.workers["gen-0"]
    ray.get(gen.test_hook.remote("leak_blocks", 987_654, 20), timeout=U.RAY_TIMEOUT_S)
    U.run(health_is(NOT_SERVING), 60)
    st = U.status(shared.port)
    violations = [v for w in st.workers for v in w.invariant_violations]
    assert any("blocks held by no live request" in v for v in violations), violations
    ray.get(gen.test_hook.remote("release_leak", 987_654), timeout=U.RAY_TIMEOUT_S)
    U.run(health_is(SERVING), 60)
    U.wait_drained(shared)


def test_2000_requests_at_concurrency_64_none_lost_memory_bounded(shared, model_dir):
    n, concurrency, distinct, max_tokens = 2000, 64, 100, 4
    batch = U.prompts(distinct, seed=61, lo=6, hi=16)
    expected = U.reference(model_dir, batch, max_tokens, ENGINE)
    # Workers run with two malloc arenas: with glibc's default (8 per core), freed memory piled
    # up in per-thread arenas and a generation worker's RSS grew with every transfer.
    for handle in shared.workers.values():
        env = ray.get(handle.__ray_call__.remote(lambda self: os.environ.get("MALLOC_ARENA_MAX")),
                      timeout=U.RAY_TIMEOUT_S)
        assert env == "2"
    router_pid = ray.get(shared.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)["pid"]
    pids = {"router": router_pid, **{w: s["pid"] for w, s in U.worker_statuses(shared).items()}}
    rss: dict[str, list[int]] = {name: [] for name in pids}
    before = U.status(shared.port).totals

    async def go():
        sem = asyncio.Semaphore(concurrency)
        done = 0

        async def one(stub, i):
            nonlocal done
            async with sem:
                r = await U.generate(stub, f"load-{i}", batch[i % distinct], max_tokens)
            done += 1
            if done in (n // 2, n):  # memory after the first and the second half
                for name, pid in pids.items():
                    rss[name].append(U.rss_bytes(pid))
            return r

        async with U.channel(shared.port) as ch:
            stub = U.stub_of(ch)
            return await asyncio.gather(*(one(stub, i) for i in range(n)))

    results = U.run(go(), 480)
    lost = [r.request_id for r in results if r.code is not None or r.last is None]
    assert not lost, lost[:10]
    assert [r.tokens for r in results] == [expected[i % distinct] for i in range(n)]
    st = U.wait_drained(shared)
    assert st.totals.completed - before.completed == n and st.totals.failed == before.failed
    router = ray.get(shared.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)
    assert router["dispatch_log"] <= 1000
    for name, s in U.worker_statuses(shared).items():
        assert s["tracked"] == 0 and s["transfer_sessions"] == 0, (name, s)
    growth = {name: (v[1] - v[0]) / 2**20 for name, v in rss.items()}
    print(f"\nload: {n} requests at concurrency {concurrency}: {len(results) - len(lost)} completed, "
          f"0 lost; RSS MiB after 1000 / 2000: "
          + ", ".join(f"{k} {v[0] / 2**20:.0f}/{v[1] / 2**20:.0f}" for k, v in rss.items()))
    # The second thousand requests must not need memory the first thousand did not.
    assert all(g < 64 for g in growth.values()), growth


def test_full_queue_answers_resource_exhausted(clusters):
    max_queue, max_inflight, n = 8, 2, 60
    cl = clusters(engine=ENGINE, router=RouterConfig(max_queue=max_queue, max_inflight=max_inflight))
    batch = U.prompts(n, seed=71, lo=6, hi=16)
    peaks = {"waiting": 0, "inflight": 0, "requests": 0}

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            tasks = [asyncio.create_task(U.generate(stub, f"o{i}", p, 32))
                     for i, p in enumerate(batch)]
            while not all(t.done() for t in tasks):
                st = await cl.router.debug_state.remote()
                for k in peaks:
                    peaks[k] = max(peaks[k], st[k])
                await asyncio.sleep(0.02)
            results = [t.result() for t in tasks]
            assert await _health(ch) == SERVING
            after = await U.generate(stub, "after-overload", batch[0], 8)
            return results, after

    results, after = U.run(go(), 240)
    exhausted = [r for r in results if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    ok = [r for r in results if r.code is None]
    assert len(exhausted) + len(ok) == n, [r.details for r in results if r.code not in
                                          (None, grpc.StatusCode.RESOURCE_EXHAUSTED)]
    assert exhausted and all("queue is full" in r.details for r in exhausted)
    assert len(ok) >= max_queue + max_inflight and all(len(r.tokens) == 32 for r in ok)
    assert peaks["waiting"] <= max_queue and peaks["inflight"] <= max_inflight
    assert after.code is None and len(after.tokens) == 8
    U.wait_drained(cl)
    print(f"\noverload: {n} at once against max_queue={max_queue}, max_inflight={max_inflight}: "
          f"{len(ok)} served, {len(exhausted)} RESOURCE_EXHAUSTED; peaks {peaks}")

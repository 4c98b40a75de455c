"""Helpers for the cluster reliability tests (not a test module): launching a cluster on the
module's Ray, running many gRPC requests at once, the in-process reference, and the drain check
every reliability test ends with (zero leaked blocks, zero stuck requests)."""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster.client import Client
from pdserve.cluster.launch import Cluster, LaunchConfig, launch
from pdserve.cluster.router import RouterConfig
from pdserve.cluster.rpc import router_pb2 as pb
from pdserve.cluster.rpc import router_pb2_grpc

GREEDY = dict(temperature=0.0, ignore_eos=True)
ENGINE = dict(tokens_per_block=4, max_batch_size=64, max_num_tokens=128,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=8,
              num_kv_blocks=1024)
RAY_TIMEOUT_S = 60.0


def start_cluster(model_dir, router: RouterConfig | None = None, **kwargs) -> Cluster:
    kwargs.setdefault("engine", ENGINE)
    router = dataclasses.replace(router or RouterConfig(), port=0)
    return launch(LaunchConfig(model=str(model_dir), router=router, **kwargs))


def prompts(n: int, seed: int, lo: int = 4, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference(model_dir, batch: list[list[int]], max_tokens: int, engine=ENGINE) -> list[list[int]]:
    llm = LLM(model_dir, **engine)
    return [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=max_tokens, **GREEDY))]


@dataclass
class Result:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    last: Any = None  # the final GenerateResponse
    code: grpc.StatusCode | None = None  # set when the call ended with an error status
    details: str = ""


async def generate(stub, request_id: str, prompt, max_tokens: int, *, timeout_s: float = 120.0,
                   on_delta: Callable[[Result], None] | None = None, **kwargs) -> Result:
    """One Generate call; an error status is recorded, not raised."""
    req = Client.build_request(prompt, max_tokens=max_tokens, request_id=request_id,
                               **{**GREEDY, **kwargs})
    out = Result(request_id)
    try:
        async for delta in stub.Generate(req, timeout=timeout_s):
            out.tokens.extend(delta.token_ids)
            if delta.finish_reason:
                out.last = delta
            if on_delta is not None:
                on_delta(out)
    except grpc.aio.AioRpcError as exc:
        out.code, out.details = exc.code(), exc.details() or ""
    return out


async def drain(call) -> list:
    """Every delta of a Generate stream, read to its end: for callers that only need the call's
    outcome (its status, or what the router did meanwhile), not the tokens."""
    return [delta async for delta in call]


def channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}")


def stub_of(ch: grpc.aio.Channel):
    return router_pb2_grpc.RouterStub(ch)


def status(port: int) -> pb.ClusterStatus:
    with Client(f"127.0.0.1:{port}") as client:
        return client.status()


def wait_drained(cl: Cluster, timeout_s: float = 60.0) -> pb.ClusterStatus:
    """Waits (bounded) until every worker's free blocks equal its total, no request is in any
    state anywhere, nothing is quarantined and the router holds no request; then asserts there
    is no invariant violation and no unexpected recompute. Returns the final status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = status(cl.port)
        router = ray.get(cl.router.debug_state.remote(), timeout=RAY_TIMEOUT_S)
        drained = (
            all(w.free_kv_blocks == w.total_kv_blocks and not w.requests_by_state
                and w.quarantined_blocks == 0 and w.healthy for w in st.workers)
            and st.totals.in_flight == 0 and st.router_queue_depth == 0
            and router["requests"] == 0 and router["by_external"] == 0
        )
        if drained:
            for w in st.workers:
                assert list(w.invariant_violations) == [], (w.worker_id, w.invariant_violations)
                # No generation worker prefilled a request whose KV was meant to arrive by transfer.
                assert w.unexpected_recomputes == 0, (w.worker_id, w.unexpected_recomputes)
            assert router["violations"] == [], router["violations"]
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"cluster did not drain: {st} router={router}")
        time.sleep(0.25)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def worker_statuses(cl: Cluster) -> dict[str, dict]:
    ids = sorted(cl.workers)
    got = ray.get([cl.workers[w].status.remote() for w in ids], timeout=RAY_TIMEOUT_S)
    return dict(zip(ids, got))


def rss_bytes(pid: int) -> int:
    """Resident memory of a local process (the actors run on this machine)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def burst(cl: Cluster, prefix: str, prompts: list[list[int]], max_tokens: int,
          timeout_s: float = 180.0) -> list[Result]:
    """Every prompt at once over one gRPC channel, ids ``<prefix>-<i>``; errors recorded."""
    async def go():
        async with channel(cl.port) as ch:
            stub = stub_of(ch)
            return await asyncio.gather(*(generate(stub, f"{prefix}-{i}", p, max_tokens)
                                          for i, p in enumerate(prompts)))

    return run(go(), timeout_s)


def run(coro, timeout_s: float):
    """asyncio.run with an overall bound."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))

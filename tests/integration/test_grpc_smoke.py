"""A tiny grpc.aio server with a fake Router servicer on 127.0.0.1: Generate streams, Abort and
GetClusterStatus answer, validation errors come back as INVALID_ARGUMENT naming the field, and the
standard Health service and server reflection list pdserve.v1.Router. Every wait is bounded."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from pdserve.cluster import rpc
from pdserve.cluster.front.grpc.convert import spec_from_proto
from pdserve.cluster.validation import ValidationError, ValidationLimits, validate_generate_spec

pb, pb_grpc = rpc.router_pb2, rpc.router_pb2_grpc
pytestmark = pytest.mark.integration

RPC_TIMEOUT = 10.0
TEST_TIMEOUT = 60.0
LIMITS = ValidationLimits(vocab_size=100, max_input_len=32)


class FakeRouter(pb_grpc.RouterServicer):
    """Echoes the prompt's token ids back one per message; no workers behind it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def Generate(self, request, context) -> AsyncIterator[pb.GenerateResponse]:
        try:
            spec = spec_from_proto(request)  # the sampling record checks its ranges as it is built
            validate_generate_spec(spec, LIMITS)
        except ValidationError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        request_id = spec.request_id or f"auto-{len(self.seen)}"
        self.seen.append(request_id)
        tokens = list(spec.token_ids or (1,))[: spec.max_tokens]
        for token in tokens[:-1]:
            yield pb.GenerateResponse(request_id=request_id, token_ids=[token], text=f"<{token}>")
        yield pb.GenerateResponse(
            request_id=request_id, token_ids=[tokens[-1]], text=f"<{tokens[-1]}>", finish_reason="length",
            timings=pb.Timings(queue_ms=0.1, ttft_ms=0.2, e2e_ms=0.3, ctx_worker="ctx-0", gen_worker="gen-0"),
            usage=pb.Usage(prompt_tokens=len(spec.token_ids or ()), completion_tokens=len(tokens)),
        )

    async def Abort(self, request, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=request.request_id in self.seen)

    async def GetClusterStatus(self, request, context) -> pb.ClusterStatus:
        return pb.ClusterStatus(
            workers=[pb.WorkerStatus(worker_id="gen-0", role=pb.WORKER_ROLE_GENERATION, healthy=True,
                                     requests_by_state={"GENERATION_IN_PROGRESS": 1})],
            router_queue_depth=0, totals=pb.RouterTotals(received=len(self.seen)),
        )


async def start_server() -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_RouterServicer_to_server(FakeRouter(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(rpc.ROUTER_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [rpc.ROUTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    await server.start()
    return server, port


async def reflect(channel, **query) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**query)]), timeout=RPC_TIMEOUT)
    responses = [r async for r in call]
    assert len(responses) == 1
    return responses[0]


async def scenario() -> None:
    server, port = await start_server()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), RPC_TIMEOUT)
            stub = pb_grpc.RouterStub(channel)

            # Generate streams one message per token; the last carries finish_reason and timings.
            request = pb.GenerateRequest(request_id="smoke-1", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                         sampling=pb.SamplingParams(max_tokens=3))
            messages = [m async for m in stub.Generate(request, timeout=RPC_TIMEOUT)]
            assert [list(m.token_ids) for m in messages] == [[5], [6], [7]]
            assert "".join(m.text for m in messages) == "<5><6><7>"
            assert [m.finish_reason for m in messages] == ["", "", "length"]
            assert [m.HasField("timings") for m in messages] == [False, False, True]
            assert messages[-1].timings.gen_worker == "gen-0" and messages[-1].usage.completion_tokens == 3
            assert {m.request_id for m in messages} == {"smoke-1"}

            # A malformed request is INVALID_ARGUMENT whose details name the field.
            bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0.0))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Generate(bad, timeout=RPC_TIMEOUT)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("sampling.top_p:")

            assert (await stub.Abort(pb.AbortRequest(request_id="smoke-1"), timeout=RPC_TIMEOUT)).aborted
            assert not (await stub.Abort(pb.AbortRequest(request_id="nope"), timeout=RPC_TIMEOUT)).aborted
            status = await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=RPC_TIMEOUT)
            assert status.totals.received == 1 and status.workers[0].worker_id == "gen-0"

            # Standard health service.
            health_stub = health_pb2_grpc.HealthStub(channel)
            reply = await health_stub.Check(health_pb2.HealthCheckRequest(service=rpc.ROUTER_SERVICE_NAME),
                                            timeout=RPC_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

            # Server reflection lists the Router and serves its file under the canonical name.
            listed = await reflect(channel, list_services="")
            names = {s.name for s in listed.list_services_response.service}
            assert {rpc.ROUTER_SERVICE_NAME, health.SERVICE_NAME} <= names
            files = await reflect(channel, file_containing_symbol=rpc.ROUTER_SERVICE_NAME)
            protos = [descriptor_pb2.FileDescriptorProto.FromString(b)
                      for b in files.file_descriptor_response.file_descriptor_proto]
            router_file = next(p for p in protos if p.name == "pdserve/v1/router.proto")
            assert router_file.package == "pdserve.v1"
            assert [s.name for s in router_file.service] == ["Router"]
    finally:
        await server.stop(grace=None)


def test_router_smoke():
    asyncio.run(asyncio.wait_for(scenario(), TEST_TIMEOUT))

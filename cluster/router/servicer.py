"""The router's gRPC face (grpc.aio): the ``pdserve.v1.Router`` service (Generate, Abort,
GetClusterStatus) with the health and reflection services, and the proto messages built from
the router's typed state. The HTTP front door (``cluster/http_server.py``) shares the router's
admission path, not this module."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster.rpc import ROUTER_SERVICE_NAME, router_pb2 as pb, router_pb2_grpc, spec_from_proto
from pdserve.transport.requests import WorkerEvent, WorkerStatus

from . import security
from .config import RouterError
from .request_state import RouterRequest

if TYPE_CHECKING:
    from .core import Router

STATUS_EVENTS = 200  # the most GetClusterStatus returns


async def _parse(message_type, data: bytes, context):
    """A request message from its bytes. gRPC's own deserializer answers a malformed message
    UNKNOWN with a Python exception in the text; this answers INVALID_ARGUMENT, naming it."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid {message_type.DESCRIPTOR.full_name} message ({exc})")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: "Router") -> None:
        self.router = router

    # The handlers take the request's bytes (see _parse and handlers()).

    def handlers(self) -> dict:
        return {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate_bytes, response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._abort_bytes, response_serializer=pb.AbortResponse.SerializeToString),
            "GetClusterStatus": grpc.unary_unary_rpc_method_handler(
                self._status_bytes, response_serializer=pb.ClusterStatus.SerializeToString),
        }

    async def _generate_bytes(self, data: bytes, context):
        request = await _parse(pb.GenerateRequest, data, context)
        async for item in self.Generate(request, context):
            yield item

    async def _abort_bytes(self, data: bytes, context):
        return await self.Abort(await _parse(pb.AbortRequest, data, context), context)

    async def _status_bytes(self, data: bytes, context):
        return await self.GetClusterStatus(await _parse(pb.ClusterStatusRequest, data, context), context)

    async def Generate(self, request, context):
        router = self.router
        try:
            req = await router.admit(spec_from_proto(request), context.time_remaining())
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        async with contextlib.aclosing(router.results(req)) as stream:
            try:
                async for item in stream:
                    yield item
            except RouterError as exc:
                await context.abort(exc.code, exc.message)

    async def Abort(self, request, context):
        router = self.router
        req = router.find(request.request_id)
        if req is None:
            return pb.AbortResponse(aborted=False, detail=f"no request {request.request_id!r} in flight")
        router.cancel(req, "aborted by client")
        router.totals["aborted"] += 1
        await req.out.put(final_response(req, [], "abort", req.text.finish()))
        return pb.AbortResponse(aborted=True, detail="aborted")

    async def GetClusterStatus(self, request, context):
        """Each worker is asked over its request channel (not a Ray call, so status polls never
        reach the dashboard's task table) and answers between two steps; a worker that does
        not answer within status_timeout_s is shown from its last heartbeat."""
        router = self.router
        registry = router.registry
        await asyncio.gather(*(registry.ask_status(w) for w in registry.worker_ids))
        statuses = [worker_status_proto(router, w) for w in sorted(registry.worker_ids)]
        totals = pb.RouterTotals(in_flight=router.inflight, kv_paths=pb.KvPathTotals(**router.kv_paths),
                                 prefix=pb.PrefixTotals(**router.prefix), **router.totals)
        events = [event_proto(e) for e in itertools.islice(
            reversed(registry.events), STATUS_EVENTS)][::-1]
        return pb.ClusterStatus(workers=statuses, router_queue_depth=len(router.waiting),
                                totals=totals, context_policy=router.context_policy.name,
                                generation_policy=router.generation_policy.name,
                                recent_events=events, max_input_len=router.limits.max_input_len or 0,
                                max_seq_len=router.limits.max_seq_len or 0,
                                max_prompt_bytes=router.max_prompt_bytes,
                                security=security_proto(router))


def security_proto(router: "Router"):
    """How the front doors are protected: counts and flags, never a key."""
    cfg = router.config
    http = f"{cfg.http_host}:{router.http_port}" if router.http_port is not None else ""
    return pb.FrontDoorSecurity(api_keys=len(router.keys), tls=cfg.tls_cert is not None,
                                mutual_tls=cfg.tls_client_ca is not None,
                                max_inflight_per_key=cfg.max_inflight_per_key or 0,
                                warnings=router.security_warnings,
                                grpc_address=f"{cfg.host}:{router.port}", http_address=http)


async def start_grpc(router: "Router") -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The gRPC server with the router, health and reflection services; SERVING at once."""
    cfg = router.config
    opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes)]
    # No interceptor without keys: an open router pays nothing per call.
    interceptors = [security.ApiKeyInterceptor(router.keys)] if router.keys.enabled else []
    server = grpc.aio.server(options=opts, interceptors=interceptors)
    handlers = RouterServicer(router).handlers()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ROUTER_SERVICE_NAME, handlers),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [ROUTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    tls = cfg.tls_files()
    address = f"{cfg.host}:{cfg.port}"
    if tls is not None:
        port = server.add_secure_port(address, security.server_credentials(tls))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    await set_health(health_servicer, True)
    return server, health_servicer, port


async def set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    await servicer.set(ROUTER_SERVICE_NAME, status)
    await servicer.set("", status)


def token_response(req: RouterRequest, tokens: list[int], text: str):
    return pb.GenerateResponse(request_id=req.external_id, token_ids=tokens, text=text)


def final_response(req: RouterRequest, tokens: list[int], finish_reason: str, text: str = ""):
    now = time.monotonic()
    timings = pb.Timings(
        queue_ms=1000 * ((req.dispatched or now) - req.received),
        ttft_ms=1000 * ((req.first_token or now) - req.received),
        e2e_ms=1000 * (now - req.received), kv_transfer_bytes=req.kv_bytes,
        kv_transfer_ms=1000 * req.kv_seconds, pauses=req.pauses, ctx_worker=req.ctx_worker,
        gen_worker=req.gen_worker, retries=req.retries, fallbacks=req.fallbacks,
        local_prefill=req.local_prefill,
        prefix_predicted_tokens=req.predicted_tokens, prefix_reused_tokens=req.reused_tokens or 0)
    usage = pb.Usage(prompt_tokens=len(req.prompt), completion_tokens=len(req.streamed),
                     cached_prompt_tokens=req.cached_tokens)
    return pb.GenerateResponse(request_id=req.external_id, token_ids=tokens, text=text,
                               finish_reason=finish_reason, timings=timings, usage=usage)


def worker_status_proto(router: "Router", worker_id: str):
    registry = router.registry
    info = registry.infos[worker_id]
    role = pb.WORKER_ROLE_CONTEXT if info.role == "context" else pb.WORKER_ROLE_GENERATION
    limits = dict(max_input_len=info.max_input_len or 0, max_seq_len=info.max_seq_len or 0,
                  max_num_tokens=info.max_num_tokens, node_id=info.node_id, node_ip=info.node_ip)
    s, age, why = registry.current_status(worker_id)
    if s is None:
        return pb.WorkerStatus(worker_id=worker_id, role=role, healthy=False,
                               invariant_violations=[f"no status: {why}"],
                               total_kv_blocks=info.num_kv_blocks, max_batch_size=info.max_batch_size,
                               tokens_per_block=info.tokens_per_block, **limits)
    out = _status_proto(s, role, registry.healthy(worker_id), age)
    for name, value in limits.items():
        setattr(out, name, value)
    return out


def _status_proto(s: WorkerStatus, role, healthy: bool, age: float):
    t = s.transfers
    return pb.WorkerStatus(
        worker_id=s.worker_id, role=role, healthy=healthy,
        requests_by_state=s.requests_by_state, free_kv_blocks=s.free_blocks,
        total_kv_blocks=s.total_blocks, queue_depth=s.queue_depth, pauses=s.pauses,
        quarantined_blocks=s.quarantined_blocks,
        transfers=pb.TransferStats(count=t.sent + t.received, bytes=t.bytes_sent + t.bytes_received,
                                   seconds=t.seconds, outcomes=t.outcomes),
        invariant_violations=s.violations, active_requests=s.num_active,
        max_batch_size=s.max_batch_size, tokens_per_block=s.tokens_per_block,
        generated_tokens=s.generated_tokens, context_tokens=s.context_tokens,
        paused_requests=s.paused_requests, status_age_s=age, capacity_policy=s.capacity_policy,
        unexpected_recomputes=s.unexpected_recomputes, kv_pairs=s.kv_pairs)


_EVENT_KINDS = {"transfer": pb.ClusterEvent.TRANSFER, "pause": pb.ClusterEvent.PAUSE,
                "resume": pb.ClusterEvent.RESUME}
_EVENT_FIELDS = ("request_id", "worker_id", "ctx_worker_id", "gen_worker_id", "blocks", "bytes",
                 "seconds", "outcome", "reason", "policy", "generated_tokens", "blocks_freed",
                 "paused_seconds", "pause_index")


def event_proto(e: WorkerEvent):
    """A worker's event (workers/events.py) as a ClusterEvent."""
    fields = {k: v for k in _EVENT_FIELDS if (v := getattr(e, k)) is not None}
    return pb.ClusterEvent(kind=_EVENT_KINDS.get(e.kind, pb.ClusterEvent.KIND_UNSPECIFIED),
                           time_unix=e.t, **fields)

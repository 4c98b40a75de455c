"""The gRPC front door (grpc.aio): the ``pdserve.v1.Router`` service (Generate, Abort,
GetClusterStatus, Shutdown) with the health and reflection services, over the router core's
narrow interface (``FrontDoorApi``). The core's outputs and errors become proto messages and
status codes in ``convert.py``; API keys and TLS are ``security.py``'s."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster.auth import DoorSecurity, KeyRing, admin_call_refusal
from pdserve.cluster.router import RouterConfig, RouterError
from pdserve.cluster.router.api import FrontDoorApi
from pdserve.cluster.rpc import ROUTER_SERVICE_NAME, router_pb2 as pb

from pdserve.cluster.validation import ValidationError

from . import security
from .convert import STATUS_CODE, cluster_status_proto, response_proto, spec_from_proto

log = logging.getLogger("pdserve.grpc")

# What a Shutdown call sets off: returns (Ray address, the actor names being killed). Given by
# whoever runs the door (the router actor), which alone knows its cluster.
ShutdownHook = Callable[[], Awaitable[tuple[str, list[str]]]]


async def _parse(message_type, data: bytes, context):
    """A request message from its bytes. gRPC's own deserializer answers a malformed message
    UNKNOWN with a Python exception in the text; this answers INVALID_ARGUMENT, naming it."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: not a valid {message_type.DESCRIPTOR.full_name} message ({exc})")


def _authorization(context) -> str | None:
    """The call's ``authorization`` metadata value (gRPC lower-cases metadata keys)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class RouterServicer:
    """The handlers take the request's bytes and parse them themselves (``_parse``)."""

    def __init__(self, api: FrontDoorApi, security_now: Callable[[], DoorSecurity],
                 keys: KeyRing, shutdown: ShutdownHook | None = None) -> None:
        self.api = api
        self.security_now = security_now
        self.keys = keys
        self.shutdown = shutdown

    def handlers(self) -> dict:
        return {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate_bytes, response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self._abort_bytes, response_serializer=pb.AbortResponse.SerializeToString),
            "GetClusterStatus": grpc.unary_unary_rpc_method_handler(
                self._status_bytes, response_serializer=pb.ClusterStatus.SerializeToString),
            "Shutdown": grpc.unary_unary_rpc_method_handler(
                self._shutdown_bytes, response_serializer=pb.ShutdownResponse.SerializeToString),
        }

    async def _generate_bytes(self, data: bytes, context):
        request = await _parse(pb.GenerateRequest, data, context)
        async for item in self.Generate(request, context):
            yield item

    async def _abort_bytes(self, data: bytes, context):
        return await self.Abort(await _parse(pb.AbortRequest, data, context), context)

    async def _status_bytes(self, data: bytes, context):
        return await self.GetClusterStatus(await _parse(pb.ClusterStatusRequest, data, context), context)

    async def _shutdown_bytes(self, data: bytes, context):
        # Decided before the request is read, as the interceptor does for the other methods.
        await self._admit_admin(context, "Shutdown")
        return await self._shutdown(await _parse(pb.ShutdownRequest, data, context), context)

    async def _admit_admin(self, context, call: str) -> None:
        """Abort the call unless its caller may make admin call ``call`` (auth.admin_call_refusal:
        an admin key when admin keys are set; else a loopback peer, with an API key when keys are
        set). The interceptor lets admin calls through, so this is their whole check."""
        refusal = admin_call_refusal(self.keys, _authorization(context), context.peer(), call)
        if refusal is not None:
            log.warning("%s refused to %s: %s", call, context.peer(), refusal.code)
            await context.abort(getattr(grpc.StatusCode, refusal.code), refusal.message)

    async def Generate(self, request, context):
        api = self.api
        try:
            req = await api.admit(spec_from_proto(request), context.time_remaining())
        except ValidationError as exc:  # the sampling record's own ranges, found while converting
            api.note_rejected()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RouterError as exc:
            await context.abort(STATUS_CODE[exc.kind], exc.message)
        async with contextlib.aclosing(api.results(req)) as stream:
            try:
                async for item in stream:
                    yield response_proto(item, api.token_text)
            except RouterError as exc:
                await context.abort(STATUS_CODE[exc.kind], exc.message)

    async def Abort(self, request, context):
        if await self.api.abort(request.request_id):
            return pb.AbortResponse(aborted=True, detail="aborted")
        return pb.AbortResponse(aborted=False, detail=f"no request {request.request_id!r} in flight")

    async def GetClusterStatus(self, request, context):
        return cluster_status_proto(await self.api.cluster_status(), self.security_now())

    async def Shutdown(self, request, context):
        """Stop this router's pdserve cluster (its workers, then the router itself); never the
        Ray cluster. An admin call: with admin keys set it needs one of them (from anywhere);
        without, it is taken only from this machine (a loopback peer), with an API key when
        keys are set, so a router bound beyond loopback cannot be stopped from afar by whoever
        holds an ordinary key. Under mutual TLS a client certificate is needed first, as for
        every call."""
        await self._admit_admin(context, "Shutdown")
        return await self._shutdown(request, context)

    async def _shutdown(self, request, context):
        if self.shutdown is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router cannot shut its cluster down")
        ray_address, actors = await self.shutdown()
        log.warning("shutdown asked by %s: stopping %s", context.peer(), ", ".join(actors))
        return pb.ShutdownResponse(ray_address=ray_address, actors=actors,
                                   grpc_address=self.security_now().grpc_address)


class GrpcDoor:
    """The gRPC server: the router service, health (SERVING follows the core's health) and
    reflection, with API keys (an interceptor, only when keys are set) and TLS."""

    def __init__(self, api: FrontDoorApi, config: RouterConfig, keys: KeyRing,
                 security_now: Callable[[], DoorSecurity], shutdown: ShutdownHook | None = None) -> None:
        self.api = api
        self.config = config
        self.keys = keys
        self.servicer = RouterServicer(api, security_now, keys, shutdown)
        self.server: grpc.aio.Server | None = None
        self.health: health.aio.HealthServicer | None = None
        self.port: int | None = None

    async def start(self) -> int:
        cfg = self.config
        opts = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes)]
        # No interceptor without keys: an open router pays nothing per call.
        interceptors = [security.ApiKeyInterceptor(self.keys)] if self.keys.enabled else []
        server = grpc.aio.server(options=opts, interceptors=interceptors)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(ROUTER_SERVICE_NAME, self.servicer.handlers()),))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [ROUTER_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        tls = cfg.tls_files()
        address = f"{cfg.host}:{cfg.port}"
        if tls is not None:
            self.port = server.add_secure_port(address, security.server_credentials(tls))
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self.server = server
        await self.set_health(self.api.serving)
        self.api.add_health_listener(self.set_health)
        return self.port

    async def set_health(self, serving: bool) -> None:
        if self.health is None:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(ROUTER_SERVICE_NAME, status)
        await self.health.set("", status)

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)

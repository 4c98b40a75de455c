"""The gRPC front door's security, a thin adapter over ``cluster/auth.py``: a server
interceptor that asks every call for an API key (``authorization: Bearer <key>`` metadata) and
caps each key's Generate calls in flight, and the server's TLS credentials.

grpc.health.v1 stays open so that load balancers can probe it; everything else, reflection and
GetClusterStatus included, needs a key when keys are set (an admin key is accepted too). The
admin calls (``ADMIN_METHODS``) pass through untouched: their handlers decide with
``auth.admin_call_refusal``, which needs the caller's peer address, and a handler context has
it where the interceptor's call details do not. A refused call is answered without reading its
request: the deny handlers take raw bytes and never parse them."""
from __future__ import annotations

import grpc

from pdserve.cluster.auth import UNAUTHENTICATED_MESSAGE, KeyRing, TlsFiles
from pdserve.cluster.rpc import ROUTER_SERVICE_NAME

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
# Calls that are requests (they hold the router's capacity) and count against a key's cap.
LIMITED_METHODS = frozenset({f"/{ROUTER_SERVICE_NAME}/Generate"})
# Calls only an admin key (or, without admin keys, a loopback peer) may make; the servicer checks.
ADMIN_METHODS = frozenset({f"/{ROUTER_SERVICE_NAME}/Shutdown"})


def _metadata(details: grpc.HandlerCallDetails, name: str) -> str | None:
    for key, value in details.invocation_metadata or ():
        if key == name:  # gRPC lower-cases metadata keys
            return value if isinstance(value, str) else None
    return None


def _deny(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str):
    """A handler of the same kind as ``handler`` (unknown method: unary) that ends the call
    with ``code``; it never deserializes the request."""

    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # unreachable: makes this an async generator, as a streaming handler must be

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    serializer = handler.response_serializer if handler is not None else None
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, response_serializer=serializer)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, response_serializer=serializer)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, response_serializer=serializer)
    return grpc.unary_unary_rpc_method_handler(unary, response_serializer=serializer)


def _capped(handler: grpc.RpcMethodHandler, ring: KeyRing, index: int):
    """``handler`` (a unary-stream call) counted against key ``index``'s cap for as long as it
    runs; the count is given back however the call ends (finished, error, cancelled)."""
    inner = handler.unary_stream

    async def call(request, context):
        if not ring.try_acquire(index):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, ring.limit_message())
        try:
            async for item in inner(request, context):
                yield item
        finally:
            ring.release(index)

    return grpc.unary_stream_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                                response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if details.method.startswith(OPEN_PREFIXES) or details.method in ADMIN_METHODS:
            return handler
        index = self.ring.authenticate(_metadata(details, "authorization"))
        if index is None:
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        if (handler is not None and self.ring.max_inflight_per_key is not None
                and details.method in LIMITED_METHODS and handler.unary_stream is not None):
            return _capped(handler, self.ring, index)
        return handler


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS for the gRPC door; under mutual TLS a client without a certificate signed by the
    client CA is refused in the handshake."""
    pem = tls.read()
    return grpc.ssl_server_credentials([(pem.key, pem.cert)], root_certificates=pem.client_ca,
                                       require_client_auth=pem.client_ca is not None)

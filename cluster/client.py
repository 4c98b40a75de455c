"""A small synchronous Python client for the router's gRPC API.

    from pdserve import Client
    with Client("127.0.0.1:50051") as client:
        for delta in client.generate_stream("hello", max_tokens=16):
            print(delta.text, end="")
        print(client.generate([1, 2, 3], max_tokens=8).token_ids)

A router behind API keys and TLS: ``Client("https://router.example:50051", api_key=KEY,
tls_ca="ca.pem")`` (``api_key`` defaults to $PDSERVE_API_KEY; ``tls_client_cert`` and
``tls_client_key`` for mutual TLS). ``admin_api_key`` (default $PDSERVE_ADMIN_API_KEY) is sent
on the admin calls (``shutdown``) alone, in place of ``api_key``.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc
import grpc.experimental

from .auth import SecurityConfigError, client_admin_api_key, client_api_key, split_target
from .rpc import router_pb2 as pb
from .rpc import router_pb2_grpc


@dataclass(slots=True)
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    timings: object | None = None
    usage: object | None = None


@dataclass(frozen=True)
class Connection:
    """How to reach a router: its host:port, TLS or not, the key each call carries, and the
    admin key the admin calls carry instead (when there is one).

    ``from_target`` takes ``host:port`` or ``https://host:port`` / ``grpcs://`` (TLS) /
    ``http://`` / ``grpc://``; a CA file, a client certificate or ``tls=True`` turn TLS on for a
    bare target. With TLS and no CA file, the system's roots verify the server."""

    target: str
    tls: bool = False
    api_key: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    admin_api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_target(cls, address: str, *, api_key: str | None = None, tls: bool | None = None,
                    tls_ca: str | None = None, tls_client_cert: str | None = None,
                    tls_client_key: str | None = None,
                    admin_api_key: str | None = None) -> "Connection":
        target, scheme_tls = split_target(address)
        if tls is None:
            tls = scheme_tls if scheme_tls is not None else bool(tls_ca or tls_client_cert)
        if (tls_ca or tls_client_cert) and not tls:
            raise SecurityConfigError(f"--tls-ca/--tls-client-cert: {address} is a plaintext target")
        if bool(tls_client_cert) != bool(tls_client_key):
            raise SecurityConfigError("--tls-client-cert: needs --tls-client-key too (and the other way)")
        return cls(target, tls, client_api_key(api_key), tls_ca, tls_client_cert, tls_client_key,
                   client_admin_api_key(admin_api_key))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Per-call metadata (sent over plaintext too, where call credentials would not be)."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None

    @property
    def admin_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """For the admin calls: the admin key when there is one (the router accepts it as an API
        key too), else the API key; one bearer token per call either way. The admin key goes on
        no other call, so a client that holds one shows it to the router no more than needed."""
        if self.admin_api_key:
            return (("authorization", f"Bearer {self.admin_api_key}"),)
        return self.metadata

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None

        def read(path: str | None, flag: str) -> bytes | None:
            if path is None:
                return None
            try:
                with open(path, "rb") as f:
                    return f.read()
            except OSError as exc:
                raise SecurityConfigError(f"{flag}: cannot read {path}: {exc}") from None

        return grpc.ssl_channel_credentials(root_certificates=read(self.tls_ca, "--tls-ca"),
                                            private_key=read(self.tls_client_key, "--tls-client-key"),
                                            certificate_chain=read(self.tls_client_cert, "--tls-client-cert"))

    def channel(self, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(self.target, options=list(options))
        return grpc.secure_channel(self.target, creds, options=list(options))

    def aio_channel(self, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=list(options))
        return grpc.aio.secure_channel(self.target, creds, options=list(options))


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", *, timeout_s: float = 600.0,
                 api_key: str | None = None, tls: bool | None = None, tls_ca: str | None = None,
                 tls_client_cert: str | None = None, tls_client_key: str | None = None,
                 admin_api_key: str | None = None) -> None:
        self.connection = Connection.from_target(address, api_key=api_key, tls=tls, tls_ca=tls_ca,
                                                 tls_client_cert=tls_client_cert,
                                                 tls_client_key=tls_client_key,
                                                 admin_api_key=admin_api_key)
        self.address = self.connection.target
        self.timeout_s = timeout_s
        self.metadata = self.connection.metadata
        # Streams are read on the caller's thread instead of through gRPC's channel thread:
        # measured ~0.15 ms less per 1-token request (benchmarks/router.py conditions).
        self.channel = self.connection.channel(
            [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def build_request(
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        stop: Sequence[str] = (),
        priority: float | None = None,
        agent_hierarchy: Sequence[tuple[str, int]] = (),
        disaggregation: str = "AUTO",
        request_id: str | None = None,
        deadline_ms: int | None = None,
        add_special_tokens: bool | None = None,
        **more_sampling,
    ) -> pb.GenerateRequest:
        """``more_sampling``: any other field of the proto's SamplingParams by name (min_tokens,
        presence_penalty, logit_bias={id: bias}, logprobs, ...); ``structured`` takes a dict
        such as {"json_schema": "<schema JSON>"} or {"regex": "..."}."""
        structured = more_sampling.pop("structured", None)
        sampling = pb.SamplingParams(top_k=top_k, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                     stop=list(stop), **more_sampling)
        if structured is not None:
            choice = structured.get("choice")
            if choice is not None:
                structured = {"choice": pb.ChoiceList(choices=list(choice))}
            sampling.structured.CopyFrom(pb.StructuredOutput(**structured))
        if max_tokens is not None:
            sampling.max_tokens = max_tokens
        if temperature is not None:
            sampling.temperature = temperature
        if top_p is not None:
            sampling.top_p = top_p
        if seed is not None:
            sampling.seed = seed
        req = pb.GenerateRequest(
            sampling=sampling,
            agent_hierarchy=[pb.AgentLevel(agent_type=t, node_id=n) for t, n in agent_hierarchy],
            disaggregation=pb.Disaggregation.Value(disaggregation),
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(int(t) for t in prompt)
        if priority is not None:
            req.priority = priority
        if request_id is not None:
            req.request_id = request_id
        if deadline_ms is not None:
            req.deadline_ms = deadline_ms
        if add_special_tokens is not None:  # unset: the router's default (true)
            req.add_special_tokens = add_special_tokens
        return req

    def generate_stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yields the router's deltas; the last one has finish_reason, timings and usage."""
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        call = self.stub.Generate(self.build_request(prompt, **kwargs), timeout=timeout,
                                 metadata=self.metadata)
        try:
            yield from call
        finally:
            call.cancel()  # a caller that stops early ends the request now (no-op once done)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        out = None
        for delta in self.generate_stream(prompt, **kwargs):
            if out is None:
                out = Completion(delta.request_id)
            out.token_ids.extend(delta.token_ids)
            out.text += delta.text
            if delta.finish_reason:
                out.finish_reason = delta.finish_reason
                out.timings, out.usage = delta.timings, delta.usage
        return out

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30,
                               metadata=self.metadata).aborted

    def status(self) -> pb.ClusterStatus:
        return self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=60, metadata=self.metadata)

    def shutdown(self, timeout_s: float = 60.0) -> pb.ShutdownResponse:
        """Stop the router's pdserve cluster (its workers, then the router; never Ray). An admin
        call: it carries the admin key (``admin_api_key``) when there is one."""
        return self.stub.Shutdown(pb.ShutdownRequest(), timeout=timeout_s,
                                  metadata=self.connection.admin_metadata)


def router_accepts(host: str, port: int, attempts: int = 3) -> bool:
    """False once the router's gRPC port refuses ``attempts`` TCP connections in a row. A
    connect, not a gRPC health check: it needs neither the router's CA nor, under mutual TLS,
    a client certificate, and it is no Ray call, so the dashboard's task table stays quiet. A
    busy router is slow, not gone: each connect waits up to 10 s."""
    host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
    for _ in range(attempts):
        try:
            with socket.create_connection((host, port), timeout=10):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def add_connection_arguments(parser) -> None:
    """The flags every command that talks to a router takes (an argparse parser)."""
    g = parser.add_argument_group("connection security")
    g.add_argument("--api-key", default=None,
                   help="the router's API key (default: $PDSERVE_API_KEY); sent as "
                        "'authorization: Bearer <key>'")
    g.add_argument("--tls", action="store_true", default=None,
                   help="connect with TLS (also: --host https://NAME, or --tls-ca)")
    g.add_argument("--tls-ca", default=None, metavar="FILE",
                   help="PEM CA certificate(s) that verify the router (default: the system's roots)")
    g.add_argument("--tls-client-cert", default=None, metavar="FILE",
                   help="mutual TLS: this client's PEM certificate (with --tls-client-key)")
    g.add_argument("--tls-client-key", default=None, metavar="FILE")


def add_admin_arguments(parser) -> None:
    """The admin key flag, for the commands that make admin calls (``pdserve shutdown``)."""
    parser.add_argument("--admin-api-key", default=None, metavar="KEY",
                        help="the router's admin API key (default: $PDSERVE_ADMIN_API_KEY), sent "
                             "instead of --api-key on the admin call; needed when the router has "
                             "admin keys (without them it takes Shutdown only from its own machine)")


def connection_from_args(args, address: str) -> Connection:
    return Connection.from_target(address, api_key=args.api_key, tls=args.tls, tls_ca=args.tls_ca,
                                  tls_client_cert=args.tls_client_cert,
                                  tls_client_key=args.tls_client_key,
                                  admin_api_key=getattr(args, "admin_api_key", None))


def client_from_connection(connection: Connection, **kwargs) -> Client:
    c = connection
    return Client(c.target, api_key=c.api_key, tls=c.tls, tls_ca=c.tls_ca, tls_client_cert=c.tls_client_cert,
                  tls_client_key=c.tls_client_key, admin_api_key=c.admin_api_key, **kwargs)

"""A small synchronous Python client for the router's gRPC API.

    from pdserve import Client
    with Client("127.0.0.1:50051") as client:
        for delta in client.generate_stream("hello", max_tokens=16):
            print(delta.text, end="")
        print(client.generate([1, 2, 3], max_tokens=8).token_ids)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import grpc
import grpc.experimental

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


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", *, timeout_s: float = 600.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        # Streams are read on the caller's thread instead of through gRPC's channel thread:
        # measured ~0.15 ms less per 1-token request (bench/router.py conditions).
        self.channel = grpc.insecure_channel(
            address, options=[(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)])
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
    ) -> pb.GenerateRequest:
        sampling = pb.SamplingParams(top_k=top_k, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                     stop=list(stop))
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
        return req

    def generate_stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yields the router's deltas; the last one has finish_reason, timings and usage."""
        timeout = kwargs.pop("timeout_s", self.timeout_s)
        call = self.stub.Generate(self.build_request(prompt, **kwargs), timeout=timeout)
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
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30).aborted

    def status(self) -> pb.ClusterStatus:
        return self.stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=60)

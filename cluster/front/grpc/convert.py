"""Between proto messages (``proto/pdserve/v1/router.proto``) and the router core's types: a
``GenerateRequest`` becomes a ``GenerateSpec``; a ``RouterOutput`` a ``GenerateResponse``; a
``ClusterSnapshot`` a ``ClusterStatus``; a ``RouterErrorKind`` a gRPC status code."""
from __future__ import annotations

import json

import grpc

from pdserve.cluster.auth import DoorSecurity
from pdserve.cluster.router import ClusterSnapshot, RouterErrorKind, RouterOutput
from pdserve.cluster.router.outputs import WorkerSnapshot
from pdserve.cluster.rpc import router_pb2 as pb
from pdserve.cluster.validation import (
    DEFAULT_ADD_SPECIAL_TOKENS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRIORITY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    GenerateSpec,
    ValidationError,
    sampling_params,
)
from pdserve.transport.requests import WorkerEvent, WorkerStatus

STATUS_EVENTS = 200  # the most GetClusterStatus returns

STATUS_CODE: dict[RouterErrorKind, grpc.StatusCode] = {
    RouterErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    RouterErrorKind.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    RouterErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RouterErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    RouterErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    RouterErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def spec_from_proto(request: pb.GenerateRequest) -> GenerateSpec:  # type: ignore[name-defined]
    """Plain values with the API defaults for unset optional fields. The sampling record checks
    its own ranges here (ValidationError naming ``sampling.<field>``); validate the rest with
    validation.validate_generate_spec."""
    s = request.sampling
    prompt = request.WhichOneof("prompt")

    def opt(name: str, default):
        return getattr(s, name) if s.HasField(name) else default

    sampling = sampling_params(
        n=opt("n", 1), best_of=opt("best_of", None),
        max_tokens=opt("max_tokens", DEFAULT_MAX_TOKENS), min_tokens=s.min_tokens,
        temperature=opt("temperature", DEFAULT_TEMPERATURE), top_p=opt("top_p", DEFAULT_TOP_P),
        top_k=s.top_k, min_p=s.min_p, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=opt("repetition_penalty", 1.0),
        seed=opt("seed", None), stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output, ignore_eos=s.ignore_eos,
        logit_bias=tuple(sorted(s.logit_bias.items())), bad_words=tuple(s.bad_words),
        logprobs=opt("logprobs", None), prompt_logprobs=opt("prompt_logprobs", None),
        guided=_guided(s.structured) if s.HasField("structured") else None)
    return GenerateSpec(
        request_id=request.request_id if request.HasField("request_id") else None,
        text=request.text if prompt == "text" else None,
        token_ids=tuple(request.token_ids.ids) if prompt == "token_ids" else None,
        sampling=sampling,
        priority=request.priority if request.HasField("priority") else DEFAULT_PRIORITY,
        agent_hierarchy=tuple((level.agent_type, level.node_id) for level in request.agent_hierarchy),
        disaggregation=int(request.disaggregation),
        deadline_ms=request.deadline_ms if request.HasField("deadline_ms") else None,
        add_special_tokens=(request.add_special_tokens if request.HasField("add_special_tokens")
                            else DEFAULT_ADD_SPECIAL_TOKENS),
    )


def _guided(structured) -> tuple[str, str]:
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise ValidationError("sampling.structured", "set one of json_schema, json_object, regex, "
                              "choice, grammar")
    if kind == "json_object":
        return ("json_object", "")
    if kind == "choice":
        return ("choice", json.dumps(list(structured.choice.choices)))
    return (kind, getattr(structured, kind))


def token_logprobs_proto(entries, token_text) -> list:
    """TokenLogprobs (the worker's) as proto messages; ``token_text(id)`` names a token."""
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, rank=e.rank,
                            token=token_text(e.token_id),
                            top=[pb.TopLogprob(token_id=t, logprob=v, token=token_text(t))
                                 for t, v in e.top])
            for e in entries or ()]


def response_proto(out: RouterOutput, token_text=str):
    """``token_text(id)``: a token's text, for logprobs."""
    extra = {}
    if out.logprobs:
        extra["logprobs"] = token_logprobs_proto(out.logprobs, token_text)
    if out.prompt_logprobs:
        extra["prompt_logprobs"] = token_logprobs_proto(out.prompt_logprobs, token_text)
    if out.index:
        extra["index"] = out.index
    if out.choice_finish_reason:
        extra["choice_finish_reason"] = out.choice_finish_reason
    if out.finish_reason is None:
        return pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text,
                                   **extra)
    t, u = out.timings, out.usage
    timings = pb.Timings(
        queue_ms=t.queue_ms, ttft_ms=t.ttft_ms, e2e_ms=t.e2e_ms,
        kv_transfer_bytes=t.kv_transfer_bytes, kv_transfer_ms=t.kv_transfer_ms, pauses=t.pauses,
        ctx_worker=t.ctx_worker, gen_worker=t.gen_worker, retries=t.retries,
        fallbacks=t.fallbacks, local_prefill=t.local_prefill,
        prefix_predicted_tokens=t.prefix_predicted_tokens,
        prefix_reused_tokens=t.prefix_reused_tokens)
    usage = pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     cached_prompt_tokens=u.cached_prompt_tokens)
    return pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text,
                               finish_reason=out.finish_reason, timings=timings, usage=usage, **extra)


def cluster_status_proto(snap: ClusterSnapshot, security: DoorSecurity):
    totals = pb.RouterTotals(in_flight=snap.in_flight, kv_paths=pb.KvPathTotals(**snap.kv_paths),
                             prefix=pb.PrefixTotals(**snap.prefix), **snap.totals)
    events = [event_proto(e) for e in snap.events[-STATUS_EVENTS:]]
    return pb.ClusterStatus(workers=[worker_status_proto(w) for w in snap.workers],
                            router_queue_depth=snap.queue_depth, totals=totals,
                            context_policy=snap.context_policy,
                            generation_policy=snap.generation_policy, recent_events=events,
                            max_input_len=snap.max_input_len, max_seq_len=snap.max_seq_len,
                            max_prompt_bytes=snap.max_prompt_bytes,
                            security=security_proto(security))


def security_proto(s: DoorSecurity):
    """How the front doors are protected: counts and flags, never a key."""
    return pb.FrontDoorSecurity(api_keys=s.api_keys, admin_api_keys=s.admin_api_keys, tls=s.tls,
                                mutual_tls=s.mutual_tls,
                                max_inflight_per_key=s.max_inflight_per_key or 0,
                                warnings=list(s.warnings), grpc_address=s.grpc_address,
                                http_address=s.http_address)


def worker_status_proto(w: WorkerSnapshot):
    info = w.info
    role = pb.WORKER_ROLE_CONTEXT if info.role == "context" else pb.WORKER_ROLE_GENERATION
    limits = dict(max_input_len=info.max_input_len or 0, max_seq_len=info.max_seq_len or 0,
                  max_num_tokens=info.max_num_tokens, node_id=info.node_id, node_ip=info.node_ip,
                  model=info.model, dtype=info.dtype,
                  tensor_parallel_size=info.tensor_parallel_size)
    if w.status is None:
        return pb.WorkerStatus(worker_id=w.worker_id, role=role, healthy=False,
                               invariant_violations=[f"no status: {w.missing}"],
                               total_kv_blocks=info.num_kv_blocks, max_batch_size=info.max_batch_size,
                               tokens_per_block=info.tokens_per_block, **limits)
    out = _status_proto(w.status, role, w.healthy, w.status_age_s)
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
    """A worker's event (workers/engine/events.py) as a ClusterEvent."""
    fields = {k: v for k in _EVENT_FIELDS if (v := getattr(e, k)) is not None}
    return pb.ClusterEvent(kind=_EVENT_KINDS.get(e.kind, pb.ClusterEvent.KIND_UNSPECIFIED),
                           time_unix=e.t, **fields)

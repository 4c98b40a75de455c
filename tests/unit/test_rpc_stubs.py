"""The gRPC stubs: generation on import (locked, atomic, regenerated when stale), the package-
relative import fix, message round trips, field presence and the proto -> GenerateSpec mapping."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster import rpc
from pdserve.cluster.front.grpc.convert import spec_from_proto
from pdserve.cluster.policies import DisaggregationMode, WorkerRole
from pdserve.cluster.validation import ValidationError, ValidationLimits, validate_generate_spec

pb = rpc.router_pb2


def copy_proto(tmp_path: Path) -> Path:
    root = tmp_path / "proto"
    (root / "pdserve" / "v1").mkdir(parents=True)
    shutil.copy2(rpc.PROTO_FILE, root / rpc.PROTO_REL)
    return root


# ---- generation ---------------------------------------------------------------------------------

def test_stubs_are_generated_into_the_package_and_import():
    assert rpc.stubs_are_current()
    assert pb.__name__ == "pdserve.proto.pdserve.v1.router_pb2"
    assert rpc.router_pb2_grpc.__name__ == "pdserve.proto.pdserve.v1.router_pb2_grpc"
    for name in ("RouterStub", "RouterServicer", "add_RouterServicer_to_server"):
        assert hasattr(rpc.router_pb2_grpc, name)
    source = Path(rpc.router_pb2_grpc.__file__).read_text()
    assert "from . import router_pb2 as" in source
    assert "from pdserve.v1 import" not in source


def test_descriptor_has_canonical_names():
    assert pb.DESCRIPTOR.name == "pdserve/v1/router.proto"
    assert pb.DESCRIPTOR.package == "pdserve.v1"
    service = pb.DESCRIPTOR.services_by_name["Router"]
    assert service.full_name == rpc.ROUTER_SERVICE_NAME
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"Generate", "Abort", "GetClusterStatus", "Shutdown"}
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert not methods["Abort"].server_streaming
    assert methods["GetClusterStatus"].output_type.name == "ClusterStatus"
    assert methods["Shutdown"].output_type.name == "ShutdownResponse"


def test_concurrent_processes_generate_once(tmp_path):
    proto_root = copy_proto(tmp_path)
    out_root = tmp_path / "out"
    code = (
        "import sys; from pathlib import Path; from pdserve.cluster import rpc\n"
        "print(rpc.ensure_stubs(Path(sys.argv[1]), Path(sys.argv[2])).generated)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(proto_root), str(out_root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        results.append(out.strip())
    assert sorted(results) == ["False", "False", "False", "True"]
    folder = out_root / "pdserve" / "v1"
    assert sorted(f.name for f in folder.iterdir()) == ["router_pb2.py", "router_pb2_grpc.py"]
    for f in folder.iterdir():
        compile(f.read_text(), str(f), "exec")
    assert rpc.stubs_are_current(proto_root, out_root)


def test_stale_or_foreign_stubs_are_regenerated(tmp_path):
    proto_root = copy_proto(tmp_path)
    assert rpc.ensure_stubs(proto_root).generated
    assert not rpc.ensure_stubs(proto_root).generated
    grpc_file = proto_root / "pdserve" / "v1" / "router_pb2_grpc.py"
    # Older than the .proto -> stale.
    proto_mtime = (proto_root / rpc.PROTO_REL).stat().st_mtime_ns
    os.utime(grpc_file, ns=(proto_mtime - 10**9, proto_mtime - 10**9))
    assert not rpc.stubs_are_current(proto_root)
    assert rpc.ensure_stubs(proto_root).generated
    # Made by another grpcio-tools version -> stale.
    grpc_file.write_text(grpc_file.read_text().replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '0."))
    assert not rpc.stubs_are_current(proto_root)
    assert rpc.ensure_stubs(proto_root).generated
    # Missing -> generated; force always regenerates.
    (proto_root / "pdserve" / "v1" / "router_pb2.py").unlink()
    assert rpc.ensure_stubs(proto_root).generated
    assert rpc.ensure_stubs(proto_root, force=True).generated


def test_protoc_errors_are_reported(tmp_path):
    proto_root = copy_proto(tmp_path)
    (proto_root / rpc.PROTO_REL).write_text('syntax = "proto3";\nmessage Broken { int32 x = ; }\n')
    with pytest.raises(RuntimeError, match="protoc failed"):
        rpc.ensure_stubs(proto_root)


def test_stub_dir_override_loads_under_the_package_names(tmp_path):
    code = (
        "from pdserve.cluster import rpc\n"
        "m = rpc.router_pb2.GenerateRequest(text='x')\n"
        "print(rpc.router_pb2.__file__); print(rpc.router_pb2_grpc.__name__)\n"
        "print(rpc.router_pb2.GenerateRequest.FromString(m.SerializeToString()).text)\n"
    )
    env = dict(os.environ, **{rpc.STUB_DIR_ENV: str(tmp_path / "stubs")})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    file_line, name_line, text_line = out.stdout.split()
    assert Path(file_line) == tmp_path / "stubs" / "pdserve" / "v1" / "router_pb2.py"
    assert name_line == "pdserve.proto.pdserve.v1.router_pb2_grpc"
    assert text_line == "x"


# ---- messages -----------------------------------------------------------------------------------

def full_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="req-7",
        token_ids=pb.TokenIds(ids=[1, 2, 3, 4_000_000_000]),
        sampling=pb.SamplingParams(max_tokens=12, temperature=0.0, top_p=0.9, top_k=40, seed=2**63 - 1,
                                   stop_token_ids=[2, 3], ignore_eos=True, stop=["\n\n", "END"]),
        priority=0.0,
        agent_hierarchy=[pb.AgentLevel(agent_type="AgentDeepResearch", node_id=5),
                         pb.AgentLevel(agent_type="researcher", node_id=0)],
        disaggregation=pb.ALWAYS,
        deadline_ms=2500,
    )


def test_generate_request_round_trips():
    req = full_request()
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "token_ids"
    assert list(back.token_ids.ids) == [1, 2, 3, 4_000_000_000]
    spec = spec_from_proto(back)
    assert spec.request_id == "req-7" and spec.text is None
    assert spec.token_ids == (1, 2, 3, 4_000_000_000)
    r = spec.sampling
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k) == (12, 0.0, pytest.approx(0.9), 40)
    assert r.seed == 2**63 - 1 and r.stop_token_ids == (2, 3) and r.ignore_eos
    assert spec.stop == ("\n\n", "END")
    assert spec.priority == 0.0  # explicitly set zero is kept, not replaced by the default
    assert spec.agent_hierarchy == (("AgentDeepResearch", 5), ("researcher", 0))
    assert spec.disaggregation == DisaggregationMode.ALWAYS and spec.deadline_ms == 2500


def test_unset_optional_fields_get_the_api_defaults():
    back = pb.GenerateRequest.FromString(pb.GenerateRequest(text="hello").SerializeToString())
    for name in ("request_id", "priority", "deadline_ms"):
        assert not back.HasField(name)
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        assert not back.sampling.HasField(name)
    spec = spec_from_proto(back)
    assert (spec.request_id, spec.text, spec.token_ids) == (None, "hello", None)
    r = spec.sampling
    assert (r.max_tokens, r.temperature, r.top_p, r.seed) == (16, 1.0, 1.0, None)
    assert (r.n, r.repetition_penalty, r.logprobs, r.prompt_logprobs, r.guided) == (1, 1.0, None, None, None)
    assert (spec.priority, spec.deadline_ms, spec.disaggregation) == (0.5, None, DisaggregationMode.AUTO)
    validate_generate_spec(spec)


def test_explicit_zero_values_keep_their_presence():
    req = pb.GenerateRequest(text="x", request_id="", priority=0.0, deadline_ms=0,
                             sampling=pb.SamplingParams(temperature=0.0, seed=0, logprobs=0,
                                                        repetition_penalty=1.0))
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back.HasField("request_id") and back.HasField("priority") and back.HasField("deadline_ms")
    assert all(back.sampling.HasField(n) for n in ("temperature", "seed", "logprobs"))
    spec = spec_from_proto(back)
    assert (spec.request_id, spec.priority, spec.deadline_ms) == ("", 0.0, 0)
    r = spec.sampling
    assert (r.temperature, r.seed, r.logprobs) == (0.0, 0, 0)  # logprobs 0: the sampled token's only
    back.ClearField("priority")
    assert not back.HasField("priority") and spec_from_proto(back).priority == 0.5


def test_the_full_sampling_set_converts():
    s = pb.SamplingParams(n=1, min_tokens=2, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                          repetition_penalty=1.2, include_stop_str_in_output=True,
                          logit_bias={7: -100.0, 3: 2.5}, bad_words=["no"], logprobs=5,
                          prompt_logprobs=1, structured=pb.StructuredOutput(regex="[a-z]+"))
    r = spec_from_proto(pb.GenerateRequest(text="x", sampling=s)).sampling
    assert (r.min_tokens, r.min_p, r.presence_penalty, r.frequency_penalty) == (2, pytest.approx(0.1), 0.5, -0.5)
    assert r.repetition_penalty == pytest.approx(1.2) and r.include_stop_str_in_output
    assert r.logit_bias == ((3, 2.5), (7, -100.0)) and r.bad_words == ("no",)
    assert (r.logprobs, r.prompt_logprobs, r.guided) == (5, 1, ("regex", "[a-z]+"))
    choice = pb.SamplingParams(structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "b"])))
    assert spec_from_proto(pb.GenerateRequest(text="x", sampling=choice)).sampling.guided == (
        "choice", '["a", "b"]')


def test_prompt_is_a_oneof():
    req = pb.GenerateRequest(text="hello")
    req.token_ids.ids.append(5)
    assert req.WhichOneof("prompt") == "token_ids" and not req.HasField("text")
    assert pb.GenerateRequest().WhichOneof("prompt") is None
    with pytest.raises(ValidationError) as info:
        validate_generate_spec(spec_from_proto(pb.GenerateRequest()))
    assert info.value.field == "prompt"


@pytest.mark.parametrize(
    "request_, field",
    [
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_k=-3)), "sampling.top_k"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(seed=2**63)), "sampling.seed"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logprobs=21)), "sampling.logprobs"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(logit_bias={50: 1.0})),
         "sampling.logit_bias[50]"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(repetition_penalty=0.0)),
         "sampling.repetition_penalty"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(n=2, best_of=1)), "sampling.best_of"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(structured=pb.StructuredOutput())),
         "sampling.structured"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=list("abcde"))), "sampling.stop"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(stop=["ok", ""])), "sampling.stop[1]"),
        (pb.GenerateRequest(text="x", request_id=""), "request_id"),
        (pb.GenerateRequest(text="x", priority=2.0), "priority"),
        (pb.GenerateRequest(text="x", deadline_ms=0), "deadline_ms"),
        (pb.GenerateRequest(text="x", disaggregation=9), "disaggregation"),  # open enum: unknown value kept
        (pb.GenerateRequest(text="x", agent_hierarchy=[pb.AgentLevel(agent_type="Nope")]),
         "agent_hierarchy[0].agent_type"),
        (pb.GenerateRequest(text="x", agent_hierarchy=[pb.AgentLevel(agent_type="Chatbot", node_id=-1)]),
         "agent_hierarchy[0].node_id"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 50])), "prompt.token_ids[1]"),
    ],
)
def test_malformed_proto_requests_name_the_field(request_, field):
    with pytest.raises(ValidationError) as info:
        # The sampling record refuses its own out-of-range values as it is built.
        spec = spec_from_proto(pb.GenerateRequest.FromString(request_.SerializeToString()))
        validate_generate_spec(spec, ValidationLimits(vocab_size=50))
    assert info.value.field == field


def test_enum_numbers_match_the_policies():
    assert {m.name: m.value for m in DisaggregationMode} == {
        v.name: v.number for v in pb.Disaggregation.DESCRIPTOR.values}
    assert pb.WORKER_ROLE_CONTEXT == WorkerRole.CONTEXT and pb.WORKER_ROLE_GENERATION == WorkerRole.GENERATION
    assert pb.WORKER_ROLE_UNSPECIFIED == 0


def test_response_and_status_round_trip():
    last = pb.GenerateResponse(
        request_id="r", token_ids=[7], text="!", finish_reason="length",
        timings=pb.Timings(queue_ms=1.5, ttft_ms=3.0, e2e_ms=9.0, kv_transfer_bytes=4096, kv_transfer_ms=0.5,
                           pauses=1, ctx_worker="pdserve-ctx-0", gen_worker="pdserve-gen-1", retries=2),
        usage=pb.Usage(prompt_tokens=5, completion_tokens=1, cached_prompt_tokens=4),
    )
    assert pb.GenerateResponse.FromString(last.SerializeToString()) == last
    assert not pb.GenerateResponse(token_ids=[1]).HasField("timings")
    status = pb.ClusterStatus(
        workers=[pb.WorkerStatus(
            worker_id="pdserve-gen-0", role=pb.WORKER_ROLE_GENERATION, healthy=True,
            requests_by_state={"GENERATION_IN_PROGRESS": 3, "DISAGG_GENERATION_TRANS_IN_PROGRESS": 1},
            free_kv_blocks=10, total_kv_blocks=64, queue_depth=2, pauses=1, quarantined_blocks=3,
            transfers=pb.TransferStats(count=4, bytes=1 << 20, seconds=0.25, outcomes={"ok": 3, "timeout": 1}),
            invariant_violations=["free + used != total"])],
        router_queue_depth=5, totals=pb.RouterTotals(received=10, completed=8, retries=1),
    )
    back = pb.ClusterStatus.FromString(status.SerializeToString())
    assert back == status
    assert dict(back.workers[0].requests_by_state)["GENERATION_IN_PROGRESS"] == 3
    assert dict(back.workers[0].transfers.outcomes) == {"ok": 3, "timeout": 1}

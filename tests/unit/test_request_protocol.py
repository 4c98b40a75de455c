"""transport/requests.py, the request channel's protocol: every frame type round-trips through
the codec field for field; a stream split anywhere yields the same frames; a cut or garbled
frame, an unknown frame type and an update whose kind and fields disagree are refused with
ProtocolError; a hello of another protocol version is refused by name; and the one conversion
between a WireRequest and the scheduler's LlmRequest keeps every field."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler import ContextPhaseParams, LlmRequestType
from pdserve.scheduler.kv_events import AllCleared, BlocksRemoved, BlocksStored
from pdserve.transport import requests as R

ints = st.integers(0, 2**40)
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)
text = st.text(max_size=12)
params = st.builds(
    ContextPhaseParams, ctx_request_id=ints, first_gen_tokens=st.lists(st.integers(0, 10**6), min_size=1, max_size=2),
    opaque_state=st.none() | st.binary(max_size=40), draft_tokens=st.none() | tokens,
    prompt_token_ids=st.none() | tokens, ctx_worker_id=st.none() | text, num_blocks=st.integers(0, 100))
finite = st.floats(0, 1e6, allow_nan=False)
# The sampling record: every field, any valid value (the codec carries it as a map).
sampling = st.builds(
    R.SamplingParams, n=st.integers(1, 4), best_of=st.none() | st.integers(4, 8),
    max_tokens=st.integers(1, 4096), min_tokens=st.integers(0, 8), temperature=finite,
    top_k=st.integers(0, 100), top_p=st.floats(0.01, 1.0), min_p=st.floats(0, 1),
    presence_penalty=st.floats(-2, 2), frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.01, 5), seed=st.none() | ints,
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=4).map(tuple),
    include_stop_str_in_output=st.booleans(), ignore_eos=st.booleans(),
    logit_bias=st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    bad_words=st.lists(st.text(min_size=1, max_size=4).filter(str.strip), max_size=2).map(tuple),
    bad_words_token_ids=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=3).map(tuple),
                                 max_size=2).map(tuple),
    logprobs=st.none() | st.integers(0, 20), prompt_logprobs=st.none() | st.integers(0, 20),
    guided=st.none() | st.tuples(st.sampled_from(["json_object", "regex"]), st.text(max_size=8)))
lp_floats = st.floats(-1e4, 0, allow_nan=False)
logprob_entries = st.none() | st.lists(st.builds(
    R.TokenLogprobs, st.integers(0, 10**6), lp_floats, st.integers(1, 10**6),
    st.lists(st.tuples(st.integers(0, 10**6), lp_floats), max_size=3).map(tuple)), max_size=3).map(
    lambda v: None if v is None else tuple(v))
wire_requests = st.builds(
    R.WireRequest, request_id=ints, client_id=st.none() | text, prompt=tokens,
    max_new_tokens=st.integers(0, 4096), priority=st.floats(0, 1),
    type=st.sampled_from(list(LlmRequestType)),
    agent_hierarchy=st.none() | st.lists(st.tuples(st.sampled_from(["AgentDeepResearch", "AgentChat"]),
                                                   st.integers(0, 9)), max_size=3),
    context_phase_params=st.none() | params, sampling=sampling,
    deadline_s=st.none() | finite, forced_tokens=st.lists(st.integers(0, 1000), max_size=3).map(tuple),
    stream_kv=st.booleans(), output_start=st.none() | st.integers(0, 40),
    choice_tokens=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=2).map(tuple),
                           max_size=3).map(tuple))
infos = st.none() | st.builds(R.UpdateInfo, pauses=st.integers(0, 9), kv_transfer_bytes=ints,
                              kv_transfer_seconds=finite, kv_transfer_blocks=st.none() | st.integers(0, 99),
                              cached_tokens=st.integers(0, 999))
small = st.lists(st.integers(0, 1000), max_size=5)
updates = st.one_of(
    st.builds(R.WireUpdate.tokens, ints, small, infos, logprobs=logprob_entries,
              prompt_logprobs=logprob_entries, index=st.integers(0, 15)),
    st.builds(R.WireUpdate.choice_done, ints, st.integers(0, 15), small,
              st.sampled_from(R.FINISH_REASONS), infos, logprobs=logprob_entries),
    st.builds(R.WireUpdate.context_done, ints, small, params, infos, logprobs=logprob_entries,
              prompt_logprobs=logprob_entries),
    st.builds(R.WireUpdate.context_streaming, ints, params),
    st.builds(R.WireUpdate.finished_with, ints, small, st.sampled_from(R.FINISH_REASONS), infos,
              logprobs=logprob_entries),
    st.builds(R.WireUpdate.aborted, ints),
    st.builds(R.WireUpdate.failed, ints, st.sampled_from([e for e in R.ErrorKind if e != R.ErrorKind.NONE]), text),
)
events = st.builds(R.WorkerEvent, kind=st.sampled_from(["transfer", "pause", "resume"]), t=finite,
                   request_id=text, worker_id=text, blocks=st.none() | st.integers(0, 99),
                   outcome=st.none() | text, paused_seconds=st.none() | finite)
statuses = st.builds(
    R.WorkerStatus, worker_id=text, role=st.sampled_from(["context", "generation"]), healthy=st.booleans(),
    pid=st.integers(1, 2**22), incarnation=ints, capacity_policy=text, max_batch_size=st.integers(1, 512),
    tokens_per_block=st.integers(1, 64), num_active=st.integers(0, 99), queue_depth=st.integers(0, 99),
    requests_by_state=st.dictionaries(text, st.integers(0, 99), max_size=3),
    free_blocks=st.integers(0, 9999), total_blocks=st.integers(0, 9999), quarantined_blocks=st.integers(0, 9),
    pauses=st.integers(0, 99), paused_requests=st.integers(0, 9), queued_prefill_tokens=ints,
    unexpected_recomputes=st.integers(0, 3), generated_tokens=ints,
    context_tokens=ints, steps=ints,
    transfers=st.builds(R.TransferTotals, sent=st.integers(0, 99), bytes_sent=ints, seconds=finite,
                        outcomes=st.dictionaries(text, st.integers(0, 9), max_size=2)),
    violations=st.lists(text, max_size=2), events=st.lists(events, max_size=3),
    kv_pairs=st.dictionaries(text, st.sampled_from(["ready", "opening", "down", "gone"]), max_size=3))
keys = st.lists(st.binary(min_size=16, max_size=16), max_size=5).map(tuple)
kv_events = st.lists(st.one_of(st.builds(BlocksStored, st.none() | st.binary(min_size=16, max_size=16), keys),
                               st.builds(BlocksRemoved, keys), st.just(AllCleared())), max_size=6)
frames = st.one_of(
    st.builds(R.KvEvents, ints, kv_events), st.builds(R.KvSnapshot, ints, kv_events),
    st.just(R.KvSnapshotQuery()), st.builds(R.KvPeers, st.dictionaries(text, text, max_size=3)),
    st.builds(R.KvControl, text, st.binary(max_size=64)),
    st.builds(R.Hello, st.integers(0, 9), text), st.builds(R.HelloAck, st.integers(0, 9), text),
    st.builds(R.Refused, text), st.builds(R.Generate, wire_requests), st.builds(R.Abort, ints),
    st.builds(R.StatusQuery, st.integers(-2**40, 2**40)), st.builds(R.Update, updates),
    st.builds(R.StatusReply, ints, statuses), st.builds(R.Heartbeat, statuses))


@settings(max_examples=300)
@given(frame=frames)
def test_every_frame_round_trips(frame):
    assert R.decode_frame(R.encode_frame(frame)) == frame


@settings(max_examples=100)
@given(batch=st.lists(frames, min_size=1, max_size=6), cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_a_stream_cut_anywhere_yields_the_same_frames(batch, cuts):
    data = b"".join(R.encode_frame(f) for f in batch)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    reader, got = R.FrameReader(), []
    for a, b in zip(points, points[1:]):
        reader.feed(data[a:b])
        got.extend(reader)
    assert got == batch


@settings(max_examples=100)
@given(frame=frames, data=st.data())
def test_a_truncated_frame_is_refused_whole_and_waits_in_a_stream(frame, data):
    raw = R.encode_frame(frame)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(R.ProtocolError):
        R.decode_frame(raw[:cut])
    reader = R.FrameReader()
    reader.feed(raw[:cut])
    assert list(reader) == []  # waits for the rest
    reader.feed(raw[cut:])
    assert list(reader) == [frame]


@pytest.mark.parametrize("body, what", [
    ([], "non-empty"),
    ([99, 1], "unknown FrameType"),
    ([R.FrameType.ABORT, "7"], "abort.request_id"),
    ([R.FrameType.GENERATE, 1, 2], "generate: expected 14 fields"),
    ([R.FrameType.GENERATE, 1, None, [1], 4, 0.5, 1, None, None, {"top_p": 0}, None, [], False, None, []],
     "generate.sampling.top_p"),
    ([R.FrameType.GENERATE, 1, None, [1], 4, 0.5, 1, None, None, {"colour": 1}, None, [], False, None, []],
     "generate.sampling.colour: unknown"),
    ([R.FrameType.UPDATE, 1, R.UpdateKind.FINISHED, [], None, None, 0, None, None, None, None, 0], "finish_reason"),
    ([R.FrameType.UPDATE, 1, R.UpdateKind.TOKENS, [], "stop", None, 0, None, None, None, None, 0], "finish_reason"),
    ([R.FrameType.UPDATE, 1, R.UpdateKind.FAILED, [], None, None, 0, "x", None, None, None, 0], "update.error"),
    ([R.FrameType.UPDATE, 1, R.UpdateKind.CONTEXT_DONE, [5], None, None, 0, None, None, None, None, 0],
     "context_phase_params"),
    ([R.FrameType.UPDATE, 1, 42, [], None, None, 0, None, None, None, None, 0], "unknown UpdateKind"),
    ([R.FrameType.UPDATE, 1, R.UpdateKind.TOKENS, [5], None, None, 0, None, None, [[5, "x", 1, []]], None, 0],
     "update.logprobs"),
    ([R.FrameType.HEARTBEAT, {"worker_id": "w"}], "status"),
    ([R.FrameType.KV_EVENTS, 1, [[9]]], "unknown event"),
    ([R.FrameType.KV_EVENTS, 1, [[1, None, ["k"]]]], "stored.keys"),
    ([R.FrameType.KV_SNAPSHOT_QUERY, 1], "kv snapshot query"),
])
def test_a_frame_that_breaks_the_protocol_is_refused_by_name(body, what):
    with pytest.raises(R.ProtocolError, match=what):
        R.decode_frame(msgpack.packb(body))
    reader = R.FrameReader()
    reader.feed(msgpack.packb(body))
    with pytest.raises(R.ProtocolError):
        list(reader)


def test_a_hello_of_another_version_or_token_is_refused():
    assert R.check_hello(R.Hello(R.PROTOCOL_VERSION, "t"), "t") is None
    why = R.check_hello(R.Hello(R.PROTOCOL_VERSION + 1, "t"), "t")
    assert f"version {R.PROTOCOL_VERSION + 1}" in why and f"speaks {R.PROTOCOL_VERSION}" in why
    assert R.check_hello(R.Hello(R.PROTOCOL_VERSION, "x"), "t") == "wrong token"
    assert "hello" in R.check_hello(R.Abort(1), "t")


def test_a_frame_over_the_size_limit_is_refused(monkeypatch):
    monkeypatch.setattr(R.types, "MAX_FRAME_BYTES", 1024)
    reader = R.FrameReader()
    with pytest.raises(R.ProtocolError, match="over 1024 bytes"):
        reader.feed(R.encode_frame(R.Generate(R.WireRequest(1, None, list(range(1000)), 4))))


@settings(max_examples=200)
@given(wire=wire_requests)
def test_the_one_request_conversion_keeps_every_field(wire):
    request = wire.to_llm_request()
    back = R.WireRequest.from_llm_request(request, wire.sampling, deadline_s=wire.deadline_s,
                                          forced_tokens=wire.forced_tokens,
                                          output_start=wire.output_start,
                                          choice_tokens=wire.choice_tokens,
                                          stream_kv=wire.stream_kv)
    assert back == wire


def test_update_constructors_keep_kind_and_fields_consistent():
    assert R.WireUpdate.tokens(1, [5]).outcome is None and not R.WireUpdate.tokens(1, [5]).finished
    done = R.WireUpdate.context_done(1, [5], ContextPhaseParams(1, [5]))
    assert done.finished and done.outcome == "context_done" and done.finish_reason is None
    streaming = R.WireUpdate.context_streaming(1, ContextPhaseParams(1, []))
    assert not streaming.finished and streaming.outcome is None  # the attempt goes on
    assert R.WireUpdate.finished_with(1, [], "stop").outcome == "stop"
    assert R.WireUpdate.aborted(1).outcome == "abort"
    assert R.WireUpdate.failed(1, R.ErrorKind.DEADLINE, "late").outcome == "deadline"
    assert R.WireUpdate.failed(1, R.ErrorKind.TRANSFER, "x").outcome == "error"
    with pytest.raises(ValueError, match="finish_reason"):
        R.WireUpdate.finished_with(1, [], "abort")


def test_kv_peers_and_pair_states_are_checked():
    frame = R.encode_frame(R.KvPeers({"ctx-0": "127.0.0.1:5000#7"}))
    assert R.decode_frame(frame) == R.KvPeers({"ctx-0": "127.0.0.1:5000#7"})
    with pytest.raises(R.ProtocolError, match="kv peers.peers"):
        R.decode_frame(msgpack.packb([R.FrameType.KV_PEERS, {"ctx-0": 5}]))


def test_kv_control_frames_are_checked():
    frame = R.encode_frame(R.KvControl("127.0.0.1:5000#7", b"\x00\x01"))
    assert R.decode_frame(frame) == R.KvControl("127.0.0.1:5000#7", b"\x00\x01")
    with pytest.raises(R.ProtocolError, match="kv control.payload"):
        R.decode_frame(msgpack.packb([R.FrameType.KV_CONTROL, "e", "not bytes"]))
    with pytest.raises(R.ProtocolError, match="kv control.endpoint"):
        R.decode_frame(msgpack.packb([R.FrameType.KV_CONTROL, 5, b""]))

"""OpenAI request bodies -> GenerateSpec: every field is used, a no-op, ignored (user) or refused
with a 400 naming it; the same validator and messages as gRPC decide the values."""
from __future__ import annotations

import pytest

from pdserve.cluster.front.openai.api import (
    CHAT,
    COMPLETIONS,
    ApiError,
    chunk_json,
    completion_json,
    field_error,
    openai_param,
    parse_request,
)
from pdserve.cluster.policies import DisaggregationMode
from pdserve.cluster.validation import ValidationError, ValidationLimits, validate_generate_spec

MODEL = "tiny"


def parse(body, kind=COMPLETIONS):
    return parse_request(body, kind, MODEL)


def refused(body, kind=COMPLETIONS) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, kind)
    return info.value


def test_a_full_completion_request_maps_every_field():
    p = parse({"model": MODEL, "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
               "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
               "top_k": 20, "ignore_eos": True, "stop_token_ids": [2], "min_tokens": 0, "priority": 0.9,
               "agent_hierarchy": [{"agent_type": "AgentDeepResearch", "node_id": 4}],
               "disaggregation": "never", "deadline_ms": 5000, "n": 1, "best_of": 1, "echo": False,
               "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None})
    s, r = p.spec, p.spec.sampling
    assert (s.text, s.token_ids, r.max_tokens, r.temperature, r.top_p, r.seed) == ("hi", None, 7, 0, 0.5, 3)
    assert (r.stop, r.top_k, r.ignore_eos, r.stop_token_ids) == (("\n",), 20, True, (2,))
    assert (s.priority, s.agent_hierarchy, s.deadline_ms) == (0.9, (("AgentDeepResearch", 4),), 5000)
    assert s.disaggregation == DisaggregationMode.NEVER
    assert p.stream and p.include_usage and p.kind == COMPLETIONS
    validate_generate_spec(s)


def test_defaults_are_openais():
    p = parse({"prompt": [5, 6]})  # model may be left out: the served one
    s, r = p.spec, p.spec.sampling
    assert (s.token_ids, r.max_tokens, r.temperature, r.top_p, r.top_k) == ((5, 6), 16, 1.0, 1.0, 0)
    assert not p.stream and not p.include_usage and s.stop == () and s.request_id is None


@pytest.mark.parametrize("prompt, text, ids", [
    ("x", "x", None), (["x"], "x", None), ([1, 2], None, (1, 2)), ([[1, 2]], None, (1, 2)),
])
def test_prompt_forms(prompt, text, ids):
    s = parse({"prompt": prompt}).spec
    assert (s.text, s.token_ids) == (text, ids)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"five": 10}}, "logit_bias['five']"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias[5]"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "n": True}, "n"),  # true is not 1
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "best_of": 1, "n": 2}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "best_of"),  # the best are known at the end
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "bad_words": ["ok", 3]}, "bad_words[1]"),
    ({"prompt": "x", "tools": []}, "tools"),  # a chat field on the completions endpoint
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "no_such_field": 1}, "no_such_field"),  # unknown
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": "x", "stream": True, "stream_options": {"other": 1}}, "stream_options.other"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["a", 5]}, "stop[1]"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "disaggregation": "sometimes"}, "disaggregation"),
    ({"prompt": "x", "agent_hierarchy": [{"agent_type": "AgentDeepResearch", "depth": 1}]},
     "agent_hierarchy[0].depth"),
    ({"prompt": ["a", "b"]}, "prompt"),  # a batch
    ({"prompt": None}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
])
def test_unsupported_or_malformed_fields_are_refused_by_name(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param and err.message.startswith(param + ":")
    assert err.body() == {"error": {"message": err.message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2.5}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),  # no logprobs
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice.function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "g"}}], "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": False}, "echo"),  # completions only
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5},
     "max_completion_tokens"),
])
def test_chat_refusals_name_the_field(body, param):
    err = refused(body, CHAT)
    assert err.status == 400 and err.param == param


def test_chat_messages_and_token_limits():
    p = parse({"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}],
               "response_format": {"type": "text"}, "tool_choice": "none"}, CHAT)
    assert [m["content"] for m in p.messages] == ["be brief", "a\nb"]
    assert not p.max_tokens_given and p.spec.text is None and p.spec.token_ids is None
    q = parse({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}, CHAT)
    assert q.max_tokens_given and q.spec.max_tokens == 9


def test_an_unknown_model_is_404():
    err = refused({"model": "gpt-4o", "prompt": "x"})
    assert err.status == 404 and err.param == "model" and err.body()["error"]["code"] == "model_not_found"


# The sampling record checks its own ranges as the door builds it (the same rules and messages as
# gRPC's): the 400 names the body field.
@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
])
def test_sampling_values_are_refused_as_the_record_is_built(body, param):
    err = refused(body)
    assert err.status == 400 and err.param == param and err.message.startswith(f"{param}: ")


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 999]}, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias[300]"),  # outside the vocabulary
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),  # over max_tokens (16)
    ({"prompt": "x", "n": 17}, "n"),  # over the server's max_n (16)
    ({"prompt": "x", "n": 2, "best_of": 17}, "best_of"),
    ({"prompt": "x", "priority": 2}, "priority"),
    ({"prompt": "x", "deadline_ms": 0}, "deadline_ms"),
    ({"prompt": "x", "disaggregation": 7}, "disaggregation"),
    ({"prompt": "x", "agent_hierarchy": [{"agent_type": "Nope"}]}, "agent_hierarchy[0].agent_type"),
])
def test_values_go_through_the_grpc_validator_with_its_messages(body, param):
    spec = parse(body).spec
    with pytest.raises(ValidationError) as info:
        validate_generate_spec(spec, ValidationLimits(vocab_size=300))
    err = field_error(info.value.field, info.value.message, COMPLETIONS)
    assert err.status == 400 and err.param == param
    assert err.message == f"{param}: {info.value.message}"


def test_field_paths_map_to_body_fields():
    assert openai_param("sampling.top_p", COMPLETIONS) == "top_p"
    assert openai_param("prompt.token_ids[3]", COMPLETIONS) == "prompt"
    assert openai_param("prompt.token_ids", CHAT) == "messages"
    assert openai_param("request_id", CHAT) == "X-Request-Id"
    assert openai_param("agent_hierarchy[1].node_id", CHAT) == "agent_hierarchy[1].node_id"


class _Usage:
    prompt_tokens, completion_tokens, cached_prompt_tokens = 5, 3, 4


class _Timings:
    queue_ms, ttft_ms, e2e_ms, kv_transfer_bytes, kv_transfer_ms = 1.0, 2.0, 3.0, 4096, 0.5
    pauses, ctx_worker, gen_worker, retries, local_prefill = 1, "ctx-0", "gen-0", 0, False


def test_response_shapes():
    body = completion_json(CHAT, "chatcmpl-r", 7, MODEL, "hey", "stop", _Usage, _Timings)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                    "content": "hey"}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert body["pdserve_timings"]["kv_transfer_bytes"] == 4096 and body["pdserve_timings"]["pauses"] == 1
    first = chunk_json(CHAT, "chatcmpl-r", 7, MODEL, text="", role=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = chunk_json(CHAT, "chatcmpl-r", 7, MODEL, finish_reason="length")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    text = chunk_json(COMPLETIONS, "cmpl-r", 7, MODEL, text="a")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "a"


# ---------------------------------------------------------------------- return_tokens_as_token_ids

# Two ids of a byte-level vocabulary that are pieces of one UTF-8 character: each decodes to
# U+FFFD on its own, so named by text they are one key of top_logprobs.
PIECE_A, PIECE_B, WORD = 200, 201, 17


def test_return_tokens_as_token_ids_is_a_request_field_of_both_endpoints():
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for kind, body in ((COMPLETIONS, {"prompt": "x", "logprobs": 2}), (CHAT, chat)):
        assert parse(body, kind).tokens_as_ids is None  # the server's default decides
        for value in (True, False):
            assert parse({**body, "return_tokens_as_token_ids": value}, kind).tokens_as_ids is value
        assert refused({**body, "return_tokens_as_token_ids": "yes"}, kind).param == \
            "return_tokens_as_token_ids"


class _FakeRouter:
    """The FrontDoorApi the OpenAI door needs for one request: every request answers WORD with
    the two pieces as its top alternatives."""

    def __init__(self) -> None:
        from pdserve.cluster.validation import ValidationLimits

        self.limits = ValidationLimits(vocab_size=300, max_input_len=100, max_seq_len=200)
        self.max_prompt_bytes = 400

    def token_text(self, token_id: int) -> str:
        return "\ufffd" if token_id in (PIECE_A, PIECE_B) else f"w{token_id}"

    def detokenize(self, ids) -> str:
        return "".join(self.token_text(i) for i in ids)

    async def tokenize(self, text, field, add_special_tokens=False):
        return [WORD] * max(1, len(text.split()))

    def note_rejected(self) -> None:
        pass

    async def admit(self, spec, time_remaining_s=None):
        from types import SimpleNamespace

        return SimpleNamespace(external_id="r-1", prompt=list(spec.token_ids or [WORD]))

    async def results(self, req):
        from pdserve.cluster.router.outputs import RequestTimings, RequestUsage, RouterOutput
        from pdserve.transport.requests import TokenLogprobs

        entry = TokenLogprobs(WORD, -0.5, 3, ((PIECE_A, -0.1), (PIECE_B, -0.2)))
        timings = RequestTimings(0, 0, 0, 0, 0, 0, "ctx-0", "gen-0", 0, 0, False, 0, 0)
        yield RouterOutput("r-1", [WORD], self.token_text(WORD), finish_reason="length",
                           timings=timings, usage=RequestUsage(len(req.prompt), 1, 0),
                           logprobs=(entry,))


def _post(server_flag: bool, path: str, body: dict) -> dict:
    """One request through the real OpenAI door (on 127.0.0.1) in front of _FakeRouter."""
    import asyncio
    import json as json_
    import urllib.request

    from pdserve.cluster.auth import KeyRing
    from pdserve.cluster.front.openai.chat_template import ChatTemplate
    from pdserve.cluster.front.openai.server import OpenAIServer
    from pdserve.cluster.router.config import RouterConfig

    async def go():
        template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
        server = OpenAIServer(_FakeRouter(), RouterConfig(return_tokens_as_token_ids=server_flag),
                              KeyRing(()), MODEL, template)
        port = await server.start("127.0.0.1", 0)
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                             data=json_.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            raw = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=30).read())
            return json_.loads(raw)
        finally:
            await server.stop()

    return asyncio.run(go())


def test_completions_top_logprobs_keep_ids_apart_that_decode_to_the_same_text():
    body = {"prompt": [WORD, WORD], "max_tokens": 1, "logprobs": 2}
    by_text = _post(False, "/v1/completions", body)["choices"][0]["logprobs"]
    # Named by text the pieces collide: one key, the later (less likely) piece's logprob.
    assert by_text["top_logprobs"][0] == {"\ufffd": -0.2, f"w{WORD}": -0.5}
    by_id = _post(False, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    lp = by_id["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{WORD}"]
    assert lp["top_logprobs"][0] == {f"token_id:{PIECE_A}": -0.1, f"token_id:{PIECE_B}": -0.2,
                                     f"token_id:{WORD}": -0.5}
    assert lp["text_offset"] == [0]
    assert by_id["choices"][0]["text"] == f"w{WORD}"  # the text itself is unchanged
    # The server's flag makes it the default; a request's own false still names by text.
    assert _post(True, "/v1/completions", body)["choices"][0]["logprobs"] == lp
    off = _post(True, "/v1/completions", {**body, "return_tokens_as_token_ids": False})
    assert off["choices"][0]["logprobs"] == by_text


def test_chat_logprobs_name_tokens_by_id_with_their_bytes():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 2}
    by_text = _post(False, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"][0]
    assert [t["token"] for t in by_text["top_logprobs"]] == ["\ufffd", "\ufffd"]
    for kind, path_body in (("request", {**body, "return_tokens_as_token_ids": True}), ("server", body)):
        content = _post(True if kind == "server" else False, "/v1/chat/completions",
                        path_body)["choices"][0]["logprobs"]["content"][0]
        assert content["token"] == f"token_id:{WORD}"
        assert content["bytes"] == list(f"token_id:{WORD}".encode())
        assert [t["token"] for t in content["top_logprobs"]] == [f"token_id:{PIECE_A}",
                                                                 f"token_id:{PIECE_B}"]

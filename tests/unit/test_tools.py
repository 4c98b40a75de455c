"""OpenAI tool calling (cluster/front/openai/tools/): the request's tools and tool_choice are
validated field by field; forced calls get vLLM's schemas; Hermes/Qwen output is read the same
whether whole or streamed in any chunks; the tiny model's template renders tools and tool turns
and renders as before without them."""
from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cluster.front.openai.chat_template import ChatTemplate
from pdserve.cluster.front.openai.tools import (
    TOOL_PARSERS,
    ForcedToolParser,
    HermesToolParser,
    ToolCall,
    ToolError,
    ToolRequest,
    calls_from_forced_output,
    chat_message,
    finish_reason_for,
    forced_schema,
    get_tool_parser,
    guided_decoding,
    new_call_id,
    output_parser,
    parse_tools,
    template_messages,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def fn(name, **extra):
    return {"type": "function", "function": {"name": name, **extra}}


# ---- parse_tools ---------------------------------------------------------------------------------

def test_defaults():
    assert parse_tools({}) == ToolRequest((), "none", None, True)
    assert parse_tools({"tools": [], "tool_choice": "none"}).enabled is False
    r = parse_tools({"tools": TOOLS})
    assert (r.choice, r.function_name, r.parallel_tool_calls, r.enabled, r.forced) == ("auto", None, True, True, False)
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    assert r.tools[0].description == "The weather in a city." and r.tools[1].parameters is None
    r = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                     "parallel_tool_calls": False})
    assert (r.choice, r.function_name, r.parallel_tool_calls, r.forced) == ("function", "get_time", False, True)
    assert parse_tools({"tools": TOOLS, "tool_choice": "required"}).choice == "required"
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).enabled is False


def test_the_request_is_frozen_and_owns_its_schemas():
    body = {"tools": copy.deepcopy([WEATHER])}
    r = parse_tools(body)
    with pytest.raises(AttributeError):
        r.choice = "none"
    body["tools"][0]["function"]["parameters"]["properties"]["x"] = {}
    assert "x" not in r.tools[0].parameters["properties"]
    assert r.template_tools() == [WEATHER] and parse_tools({}).template_tools() is None


@pytest.mark.parametrize("body, param, words", [
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": ["x"]}, "tools[0]", "object"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "function"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "x", "extra": 1}}]}, "tools[1].function.extra",
     "unrecognized"),
    ({"tools": [{"type": "function", "function": {"name": "x"}, "x": 1}]}, "tools[0].x", "unrecognized"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": [WEATHER, {"type": "function", "function": {"description": "d"}}]}, "tools[1].function.name",
     "required"),
    ({"tools": [WEATHER, fn("bad name!")]}, "tools[1].function.name", "a-z"),
    ({"tools": [fn("x" * 65)]}, "tools[0].function.name", "64"),
    ({"tools": [fn(7)]}, "tools[0].function.name", "7"),
    ({"tools": [WEATHER, TIME, WEATHER]}, "tools[2].function.name",
     "duplicate tool name 'get_weather' (also tools[0])"),
    ({"tools": [fn("x", description=3)]}, "tools[0].function.description", "string"),
    ({"tools": [fn("x", parameters=[1])]}, "tools[0].function.parameters", "JSON schema object"),
    ({"tools": [fn("x", parameters={"type": "string"})]}, "tools[0].function.parameters.type", "object"),
    ({"tools": [fn("x", strict="yes")]}, "tools[0].function.strict", "boolean"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice", "string or an object"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "function": {"name": "get_time"}}}, "tool_choice.type",
     "function"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice.function.name",
     "string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name", "unknown tool 'x'; the request defines get_weather, get_time"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice.function.name",
     "defines no tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time", "a": 1}}},
     "tool_choice.function.a", "unrecognized"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "boolean"),
    ({"tools": [fn("a", parameters={"type": "object", "$defs": {"P": {"type": "string"}}}),
                fn("b", parameters={"type": "object", "$defs": {"P": {"type": "integer"}}})],
      "tool_choice": "required"}, "tools[1].function.parameters.$defs.P", "tools[0]"),
])
def test_refusals_name_the_field(body, param, words):
    with pytest.raises(ToolError) as info:
        parse_tools(body)
    assert isinstance(info.value, ValueError)
    assert info.value.param == param
    assert words in info.value.detail
    assert str(info.value) == f"{param}: {info.value.detail}"


# ---- forced calls --------------------------------------------------------------------------------

def test_forced_schema_for_a_named_function_is_its_parameters():
    r = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert forced_schema(r) == WEATHER["function"]["parameters"]
    r = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert forced_schema(r) == {"type": "object", "properties": {}}
    assert guided_decoding(r) == ("json_schema", '{"type": "object", "properties": {}}')
    assert forced_schema(parse_tools({"tools": TOOLS})) is None
    assert guided_decoding(parse_tools({"tools": TOOLS})) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_schema_for_required_is_an_array_of_calls(parallel):
    r = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel})
    expected = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"], "additionalProperties": False},
    ]}}
    if not parallel:
        expected["maxItems"] = 1
    assert forced_schema(r) == expected
    kind, source = guided_decoding(r)
    assert kind == "json_schema" and json.loads(source) == expected


def test_required_lifts_definitions_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    a = fn("a", parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
                            "$defs": {"Point": point}})
    b = fn("b", parameters={"type": "object", "properties": {"q": {"$ref": "#/$defs/Point"}},
                            "$defs": {"Point": point}})
    schema = forced_schema(parse_tools({"tools": [a, b], "tool_choice": "required"}))
    assert schema["$defs"] == {"Point": point}
    schema["$defs"]["Point"]["x"] = 1  # a copy: the request is untouched
    assert forced_schema(parse_tools({"tools": [a, b], "tool_choice": "required"}))["$defs"] == {"Point": point}


def test_forced_output_round_trips():
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    [call] = calls_from_forced_output(named, ' {"city": "Paris"}\n')
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)

    required = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    wanted = [{"name": "get_weather", "parameters": {"city": "Ünïcode"}}, {"name": "get_time", "parameters": {}}]
    for text in (json.dumps(wanted), json.dumps(wanted, indent=2, ensure_ascii=False),
                 json.dumps(wanted, separators=(",", ":"))):
        calls = calls_from_forced_output(required, text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(w["name"], w["parameters"]) for w in wanted]
        content, again = ForcedToolParser(required).parse(text)
        assert content is None and [(c.name, c.arguments) for c in again] == [(c.name, c.arguments) for c in calls]
    compact = json.dumps(wanted, separators=(",", ":"), ensure_ascii=False)
    assert calls_from_forced_output(required, compact)[0].arguments == '{"city":"Ünïcode"}'  # the model's own text
    for bad in ("", "[]", "{}", '[{"name": "get_time"', '[{"parameters": {}}]', "[1]",
                '[{"name": "get_time", "parameters": 3}]'):
        assert calls_from_forced_output(required, bad) == []
        assert ForcedToolParser(required).parse(bad) == (bad or None, [])
    assert calls_from_forced_output(parse_tools({"tools": TOOLS}), "[]") == []


# ---- Hermes: whole outputs -----------------------------------------------------------------------

def block(name, args, sep="\n"):
    return f'<tool_call>{sep}{{"name": "{name}", "arguments": {args}}}{sep}</tool_call>'


def pairs(calls):
    return [(c.name, c.arguments) for c in calls]


def test_no_calls():
    p = HermesToolParser()
    assert p.parse("Hello there.") == ("Hello there.", [])
    assert p.parse("") == (None, [])
    assert p.parse("a </tool_call> b") == ("a </tool_call> b", [])


def test_one_call_after_content():
    content, calls = HermesToolParser().parse("Let me check.\n\n" + block("get_weather", '{"city": "Paris"}'))
    assert content == "Let me check.\n\n"
    assert pairs(calls) == [("get_weather", '{"city": "Paris"}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


def test_two_calls_and_the_text_around_them():
    text = block("a", '{"x": 1}') + "\n" + block("b", '{"y":[1, {"z": "}"}]}') + "\n"
    content, calls = HermesToolParser().parse(text)
    assert content is None  # whitespace between and after blocks is not content
    assert pairs(calls) == [("a", '{"x": 1}'), ("b", '{"y":[1, {"z": "}"}]}')]  # the model's own text
    assert calls[0].id != calls[1].id
    content, calls = HermesToolParser().parse("Sure: " + block("a", "{}") + " and done.")
    assert content == "Sure:  and done." and pairs(calls) == [("a", "{}")]


@pytest.mark.parametrize("body, arguments", [
    ('{"arguments": {"x": 1}, "name": "a"}', '{"x": 1}'),  # other key order: re-serialized
    ('{"name": "a", "arguments": "{\\"x\\": 1}"}', '{"x": 1}'),  # arguments as a JSON string
    ('{"name": "a"}', "{}"),
    ('  {"name":"a","arguments":{"é":"ü"}}  ', '{"é":"ü"}'),
])
def test_call_forms(body, arguments):
    content, calls = HermesToolParser().parse(f"<tool_call>{body}</tool_call>")
    assert content is None and pairs(calls) == [("a", arguments)]


def test_an_unclosed_last_block_counts_when_complete():
    assert pairs(HermesToolParser().parse('<tool_call>\n{"name": "a", "arguments": {}}\n')[1]) == [("a", "{}")]
    text = '<tool_call>\n{"name": "a", "arguments": {"x": '
    assert HermesToolParser().parse(text) == (text, [])


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call>",
    "Hi " + block("a", '{"x": }'),
    block("a", "{}") + "\n<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
    "<tool_call></tool_call>",
    "text <tool_call>",
])
def test_malformed_calls_stay_content(text):
    assert HermesToolParser().parse(text) == (text, [])


# ---- Hermes: streamed ----------------------------------------------------------------------------

def collect(deltas):
    """Content and calls [(id, name, arguments)] from OpenAI delta fragments, checking their shape."""
    content, calls = [], {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert delta["content"]
            content.append(delta["content"])
            continue
        [part] = delta["tool_calls"]
        i = part["index"]
        if i not in calls:
            assert i == len(calls)
            assert set(part) == {"index", "id", "type", "function"} and part["type"] == "function"
            assert re.fullmatch(r"call_[0-9a-f]{24}", part["id"])
            assert isinstance(part["function"]["name"], str) and part["function"]["name"]
            calls[i] = [part["id"], part["function"]["name"], part["function"].get("arguments", "")]
        else:
            assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
            calls[i][2] += part["function"]["arguments"]
    return ("".join(content) or None), [tuple(calls[i]) for i in sorted(calls)]


def streamed(parser, chunks):
    stream = parser.stream()
    deltas = []
    for chunk in chunks:
        deltas += stream.feed(chunk)
    deltas += stream.finish()
    content, calls = collect(deltas)
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == calls
    return content, [(name, args) for _, name, args in calls], deltas


def split(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_streamed_char_by_char():
    text = "I'll look.\n" + block("get_weather", '{"city": "Paris <3"}') + "\n" + block("get_time", "{}")
    content, calls, deltas = streamed(HermesToolParser(), list(text))
    assert (content, calls) == ("I'll look.\n", [("get_weather", '{"city": "Paris <3"}'), ("get_time", "{}")])
    first = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": "{"}  # the name as soon as it is known
    assert sum("tool_calls" in d for d in deltas) > 3  # arguments come as they are written


def test_a_partial_tag_is_held_then_flushed_as_content():
    stream = HermesToolParser().stream()
    assert stream.feed("Hello <tool_") == [{"content": "Hello "}]
    assert stream.finish() == [{"content": "<tool_"}]
    stream = HermesToolParser().stream()
    assert stream.feed("a <tool") == [{"content": "a "}]
    assert stream.feed("s> b <") == [{"content": "<tools> b "}]
    assert stream.feed("tool_call>") == []
    assert stream.feed('{"name": "f", "arguments": {"a"') == [
        {"tool_calls": [{"index": 0, "id": stream.calls[0].id, "type": "function",
                         "function": {"name": "f", "arguments": '{"a"'}}]}]
    assert stream.feed(": 1}}</tool_") == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert stream.feed("call>") == []
    assert stream.finish() == []
    assert pairs(stream.calls) == [("f", '{"a": 1}')]


def test_a_malformed_first_block_streams_as_content():
    text = "Hi <tool_call>\nnot json\n</tool_call> then " + block("a", "{}")
    assert streamed(HermesToolParser(), list(text))[:2] == (text, [])
    text = "<tool_call>\n[1, 2"
    assert streamed(HermesToolParser(), [text[:5], text[5:]])[:2] == (text, [])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
arguments_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True)
ws = st.sampled_from(["", "\n", " ", "\n\n", " \n "])
content_text = st.text(alphabet=st.sampled_from(list("ab <>/_tolcé\n{}\"")) | st.characters(), max_size=20) \
    .filter(lambda s: "<tool_call>" not in s)


@st.composite
def hermes_outputs(draw):
    """(text, expected content, expected [(name, arguments)]) with arguments checked as JSON
    when the call is not written name-first."""
    parts = [draw(content_text)]
    expected_content = [parts[0]]
    calls = []
    for i in range(draw(st.integers(0, 3))):
        name, args = draw(names), draw(arguments_objects)
        style = draw(st.sampled_from(["spaced", "compact", "indented", "reversed", "string"]))
        if style == "spaced":
            raw = json.dumps(args, ensure_ascii=draw(st.booleans()))
            body = f'{{"name": {json.dumps(name)}, "arguments": {raw}}}'
        elif style == "compact":
            raw = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
            body = f'{{"name":{json.dumps(name)},"arguments":{raw}}}'
        elif style == "indented":
            raw = json.dumps(args, indent=2, ensure_ascii=False)
            body = f'{{\n  "name": {json.dumps(name)},\n  "arguments": {raw}\n}}'
        elif style == "reversed":
            raw = json.dumps(args, ensure_ascii=False)
            body = json.dumps({"arguments": args, "name": name})
        else:
            raw = json.dumps(args)
            body = json.dumps({"name": name, "arguments": raw})
        if "</tool_call>" in body:
            continue
        calls.append((name, raw))
        last = draw(st.booleans()) and draw(st.booleans())
        parts.append(f"<tool_call>{draw(ws)}{body}{draw(ws)}" + ("" if last else "</tool_call>"))
        if last:
            break
        between = draw(ws | content_text)
        parts.append(between)
        if between.strip():
            expected_content.append(between)
    return "".join(parts), ("".join(expected_content) or None), calls


@given(hermes_outputs(), st.lists(st.integers(0, 10**4), max_size=12))
def test_streaming_in_any_chunks_equals_the_whole_parse(output, cuts):
    text, content, calls = output
    whole_content, whole_calls = HermesToolParser().parse(text)
    assert whole_content == content
    assert [c.name for c in whole_calls] == [name for name, _ in calls]
    for call, (_, raw) in zip(whole_calls, calls):
        assert json.loads(call.arguments) == json.loads(raw)
    for chunks in (split(text, cuts), list(text)):
        got_content, got_calls, _ = streamed(HermesToolParser(), chunks)
        assert got_content == whole_content
        assert got_calls == pairs(whole_calls)


@given(st.lists(st.tuples(names, arguments_objects), min_size=1, max_size=3), st.booleans(),
       st.lists(st.integers(0, 10**4), max_size=10))
def test_forced_streams_equal_the_whole_parse(calls, indent, cuts):
    request = parse_tools({"tools": [fn(n) for n in dict(calls)], "tool_choice": "required"})
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], indent=2 if indent else None,
                      ensure_ascii=False)
    parser = output_parser(request, None)
    whole = parser.parse(text)
    assert whole[0] is None and [(c.name, json.loads(c.arguments)) for c in whole[1]] == calls
    for chunks in (split(text, cuts), list(text)):
        assert streamed(parser, chunks)[:2] == (None, pairs(whole[1]))

    name = calls[0][0]
    named = parse_tools({"tools": [fn(name)], "tool_choice": {"type": "function", "function": {"name": name}}})
    text = " \n" + json.dumps(calls[0][1], indent=2 if indent else None) + "\n "
    whole = output_parser(named, "hermes").parse(text)
    assert pairs(whole[1]) == [(name, text.strip())]
    for chunks in (split(text, cuts), list(text)):
        assert streamed(output_parser(named, None), chunks)[:2] == (None, pairs(whole[1]))


def test_forced_streams_of_bad_output():
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"})
    assert streamed(output_parser(required, None), ["not ", "json"])[:2] == ("not json", [])
    assert streamed(output_parser(required, None), ["[1]"])[:2] == ("[1]", [])
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert streamed(output_parser(named, None), [])[:2] == (None, [("get_time", "")])


# ---- the response --------------------------------------------------------------------------------

def test_finish_reason_and_message():
    call = ToolCall(new_call_id(), "a", "{}")
    auto = parse_tools({"tools": [fn("a")]})
    named = parse_tools({"tools": [fn("a")], "tool_choice": {"type": "function", "function": {"name": "a"}}})
    assert finish_reason_for([], "stop") == "stop"
    assert finish_reason_for([call], "stop") == "tool_calls"
    assert finish_reason_for([call], "stop", auto) == "tool_calls"
    assert finish_reason_for([call], "stop", named) == "stop"  # OpenAI's answer to a named choice
    assert finish_reason_for([call], "length") == "length"
    assert chat_message("hi") == {"role": "assistant", "content": "hi"}
    assert chat_message(None, [call]) == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "a", "arguments": "{}"}}]}


def test_which_parser_reads_the_output():
    assert output_parser(parse_tools({}), "hermes") is None
    assert output_parser(parse_tools({"tools": TOOLS, "tool_choice": "none"}), None) is None
    assert isinstance(output_parser(parse_tools({"tools": TOOLS}), "hermes"), HermesToolParser)
    assert isinstance(output_parser(parse_tools({"tools": TOOLS, "tool_choice": "required"}), None),
                      ForcedToolParser)
    with pytest.raises(ToolError) as info:
        output_parser(parse_tools({"tools": TOOLS}), None)
    assert info.value.param == "tool_choice" and "--tool-call-parser" in info.value.detail
    assert TOOL_PARSERS == {"hermes": HermesToolParser}
    assert isinstance(get_tool_parser("hermes"), HermesToolParser)
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; choose from hermes"):
        get_tool_parser("qwen")


# ---- chat templates ------------------------------------------------------------------------------

# The tiny model's template before it rendered tools: without them the new one renders the same.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    {"role": "assistant", "content": "22 °C at noon."},
    {"role": "user", "content": "Thanks"},
]


def render_chat(template, messages, tool_request, add_generation_prompt=True):
    """The prompt as the door renders it (server.OpenAIServer._render, after api._messages)."""
    tools = tool_request.template_tools() if tool_request is not None else None
    return template.render(template_messages(messages), add_generation_prompt, tools=tools)


@pytest.fixture(scope="module")
def tiny_template():
    from pdserve.workers.loading.tiny_model import CHAT_TEMPLATE

    return CHAT_TEMPLATE


def test_template_messages():
    out = template_messages(CONVERSATION)
    assert out[1]["content"] == "Weather in\nParis?"
    assert out[2]["content"] == "" and out[2]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]
    assert out[3] == {"role": "tool", "tool_call_id": "call_1", "content": "22 °C"}
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # untouched
    assert template_messages(out) == out  # normalized messages stay as they are


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "c"}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": {}}], "messages[1].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "a"}}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a", "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {"name": "a"}}]}],
     "messages[0].tool_calls[0].type"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
])
def test_template_message_refusals_name_the_field(messages, param):
    with pytest.raises(ToolError) as info:
        template_messages(messages)
    assert info.value.param == param


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_template_renders_as_before(tiny_template, add_generation_prompt):
    new, old = ChatTemplate(tiny_template, SPECIAL), ChatTemplate(PLAIN_TEMPLATE, SPECIAL)
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "S"}, {"role": "user", "content": "Ü?"},
                      {"role": "assistant", "content": ""}, {"role": "developer", "content": "d"}]):
        expected = old.render(messages, add_generation_prompt)
        assert new.render(messages, add_generation_prompt) == expected
        assert render_chat(new, messages, parse_tools({}), add_generation_prompt) == expected


def test_the_template_renders_tools_and_tool_turns(tiny_template):
    template = ChatTemplate(tiny_template, SPECIAL)
    request = parse_tools({"tools": TOOLS})
    text = render_chat(template, CONVERSATION, request)
    tools_block = ("<s><|system|>\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the "
                   "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                   "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>\n\n")
    assert text.startswith(tools_block)
    assert text.endswith(
        "</tool_call></s>\n<|user|>\nWeather in\nParis?</s>\n"
        "<|assistant|>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call></s>\n"
        "<|tool|>\n<tool_response>\n22 °C\n</tool_response></s>\n"
        "<|tool|>\n<tool_response>\nnoon\n</tool_response></s>\n"
        "<|assistant|>\n22 °C at noon.</s>\n<|user|>\nThanks</s>\n<|assistant|>\n")
    # Without a system message the tools get a system turn of their own; content before calls stays.
    text = render_chat(template, [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Checking.", "tool_calls": [
                                      {"id": "c", "type": "function", "function": {"name": "get_time"}}]}],
                       request, add_generation_prompt=False)
    assert text.startswith("<s><|system|>\n# Tools\n\n")
    turn = text[text.index("<|assistant|>\n") + len("<|assistant|>\n"):-len("</s>\n")]
    assert turn == 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    # What the template writes for a call is what the Hermes parser reads.
    assert HermesToolParser().parse(turn)[0] == "Checking.\n"
    assert pairs(HermesToolParser().parse(turn)[1]) == [("get_time", "{}")]


def test_the_template_renders_like_transformers_with_tools(tmp_path, tiny_template):
    transformers = pytest.importorskip("transformers")
    from pdserve.workers.loading.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    messages = template_messages(CONVERSATION)
    ours = ChatTemplate.from_model_dir(model)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        assert ours.render(messages, add_generation_prompt, tools=TOOLS) == expected


def test_call_ids_are_openais_form_and_unique():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)

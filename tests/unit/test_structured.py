"""Structured-output request fields -> GuidedSpec (pdserve.transport.requests.structured): every accepted
shape, canonical text and keys, and every malformed shape refused with the body field named."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from pdserve.transport.requests.structured import (
    KINDS,
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SOURCE_CHARS,
    GuidedSpec,
    StructuredOutputError,
    choice_spec,
    guided_spec_from_openai,
    json_schema_spec,
)
from pdserve.transport.requests.sampling import FieldError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
          "required": ["a"]}
# Sorted keys, except the properties map, whose order generated keys follow.
CANONICAL = '{"properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["a"],"type":"object"}'


def rf_schema(schema, **extra):
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "out", "schema": schema, **extra}}}


def refused(body) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        guided_spec_from_openai(body)
    err = info.value
    assert isinstance(err, FieldError) and isinstance(err, ValueError)
    assert str(err).startswith(f"{err.field}: ")
    return err


# ---- accepted ------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {}, {"prompt": "x"}, {"response_format": None}, {"response_format": {"type": "text"}},
    {"guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
     "structured_outputs": None},
    {"structured_outputs": {}}, {"structured_outputs": {"json_object": False}},
    {"structured_outputs": {"disable_fallback": True, "disable_any_whitespace": True}},
])
def test_no_guide(body):
    assert guided_spec_from_openai(body) is None


def test_json_object():
    spec = guided_spec_from_openai({"response_format": {"type": "json_object"}})
    assert spec == GuidedSpec("json_object", "")
    assert spec.field == "response_format" and spec.schema() == {"type": "object"}
    so = guided_spec_from_openai({"structured_outputs": {"json_object": True}})
    assert so == spec and so.field == "structured_outputs.json_object"
    assert so.cache_key == spec.cache_key


def test_json_schema_is_canonical():
    spec = guided_spec_from_openai(rf_schema(SCHEMA, strict=True, description="d"))
    assert spec.kind == "json_schema" and spec.text == CANONICAL
    assert spec.field == "response_format.json_schema.schema"
    assert spec.schema() == SCHEMA
    reordered = {"required": ["a"], "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                 "type": "object"}
    same = [guided_spec_from_openai(rf_schema(reordered)),
            guided_spec_from_openai({"guided_json": reordered}),
            guided_spec_from_openai({"guided_json": json.dumps(reordered, indent=2)}),
            guided_spec_from_openai({"structured_outputs": {"json": SCHEMA}}),
            guided_spec_from_openai({"structured_outputs": {"json": json.dumps(SCHEMA)}})]
    assert all(s == spec and s.cache_key == spec.cache_key and s.text == CANONICAL for s in same)
    assert [s.field for s in same[1:]] == ["guided_json", "guided_json", "structured_outputs.json",
                                           "structured_outputs.json"]


def test_the_order_of_properties_is_kept_everywhere():
    def person(order):
        return {"type": "object", "properties": {k: {"type": "string"} for k in order},
                "$defs": {"z": {"properties": {k: {"title": k, "type": "integer"} for k in order}}}}
    ab, ba = json_schema_spec(person("ab")), json_schema_spec(person("ba"))
    assert ab != ba and ab.cache_key != ba.cache_key
    assert list(ab.schema()["properties"]) == ["a", "b"] and list(ba.schema()["properties"]) == ["b", "a"]
    assert list(ba.schema()["$defs"]["z"]["properties"]) == ["b", "a"]
    assert ab.text.index('"$defs"') < ab.text.index('"properties"')  # other keys sorted
    assert '{"title":"a","type":"integer"}' in ab.text


def test_json_schema_keeps_unicode_and_nulls():
    spec = json_schema_spec({"enum": ["héllo", None, 1.5, True]})
    assert spec.text == '{"enum":["héllo",null,1.5,true]}'


def test_name_and_strict_are_optional():
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": None}}}
    assert guided_spec_from_openai(body).text == CANONICAL


def test_regex_choice_grammar():
    assert guided_spec_from_openai({"guided_regex": r"\d+"}) == GuidedSpec("regex", r"\d+")
    so = guided_spec_from_openai({"structured_outputs": {"regex": "a|b"}})
    assert so.field == "structured_outputs.regex"
    choice = guided_spec_from_openai({"guided_choice": ["yes", "no", "yes", "maybe \"so\""]})
    assert choice.kind == "choice" and choice.choices() == sorted({"yes", "no", 'maybe "so"'})
    assert choice == guided_spec_from_openai({"structured_outputs": {"choice": ["no", 'maybe "so"', "yes"]}})
    grammar = 'root ::= "a" | "b"'
    assert guided_spec_from_openai({"guided_grammar": grammar}) == GuidedSpec("grammar", grammar)
    assert guided_spec_from_openai({"structured_outputs": {"grammar": grammar}}).kind == "grammar"
    assert guided_spec_from_openai({"guided_regex": " "}).text == " "  # whitespace is a regex too


def test_spec_value_semantics():
    a, b = GuidedSpec("regex", "x", "guided_regex"), GuidedSpec("regex", "x", "structured_outputs.regex")
    assert a == b and hash(a) == hash(b) and a.cache_key == b.cache_key
    assert GuidedSpec("regex", "x").cache_key != GuidedSpec("grammar", "x").cache_key
    assert GuidedSpec("regex", "x").cache_key != GuidedSpec("regex", "y").cache_key
    assert a.as_pair() == ("regex", "x") and GuidedSpec.from_pair(["regex", "x"]) == a
    assert GuidedSpec("regex", "x").error_field == "guided_regex"
    copied = pickle.loads(pickle.dumps(a))  # specs travel between processes
    assert copied == a and copied.cache_key == a.cache_key and copied.field == a.field
    assert set(KINDS) == {"json_object", "json_schema", "regex", "choice", "grammar"}
    with pytest.raises(AttributeError):
        a.text = "y"  # frozen
    with pytest.raises(StructuredOutputError):
        GuidedSpec("lua", "x")
    with pytest.raises(StructuredOutputError):
        GuidedSpec("json_object", "{}")
    with pytest.raises(ValueError):
        GuidedSpec("regex", "x").choices()
    with pytest.raises(ValueError):
        GuidedSpec("regex", "x").schema()


# ---- refused, naming the field ---------------------------------------------------------------------

BAD = [
    # response_format
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": ["json_object"]}, "response_format"),
    ({"response_format": {}}, "response_format.type"),
    ({"response_format": {"type": None}}, "response_format.type"),
    ({"response_format": {"type": 1}}, "response_format.type"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": None}}},
     "response_format.json_schema.schema"),
    (rf_schema("{}"), "response_format.json_schema.schema"),
    (rf_schema([]), "response_format.json_schema.schema"),
    (rf_schema(True), "response_format.json_schema.schema"),
    (rf_schema({"enum": [float("nan")]}), "response_format.json_schema.schema"),
    (rf_schema({"enum": [float("inf")]}), "response_format.json_schema.schema"),
    (rf_schema({1: "x"}), "response_format.json_schema.schema"),
    (rf_schema({"x": {1, 2}}), "response_format.json_schema.schema"),
    (rf_schema({"x": b"raw"}), "response_format.json_schema.schema"),
    (rf_schema(SCHEMA, strict="yes"), "response_format.json_schema.strict"),
    (rf_schema(SCHEMA, description=3), "response_format.json_schema.description"),
    (rf_schema(SCHEMA, extra=1), "response_format.json_schema.extra"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 7, "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    # guided_*
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_json": "NaN"}, "guided_json"),
    ({"guided_json": '{"enum": [NaN]}'}, "guided_json"),
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_regex": "a\x00"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": {"a": 1}}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
    ({"guided_choice": ["a", None]}, "guided_choice[1]"),
    ({"guided_choice": ["", "a"]}, "guided_choice[0]"),
    ({"guided_choice": ["c"] * (MAX_CHOICES + 1)}, "guided_choice"),
    ({"guided_grammar": 1}, "guided_grammar"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_grammar": "x" * (MAX_SOURCE_CHARS + 1)}, "guided_grammar"),
    # structured_outputs
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "{"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": 3}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 2]}}, "structured_outputs.choice[1]"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"disable_fallback": "no"}}, "structured_outputs.disable_fallback"),
    # two guides: the second is named
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a"], "json_object": True}}, "structured_outputs.json_object"),
    (rf_schema(SCHEMA) | {"guided_json": SCHEMA}, "guided_json"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_refused_naming_the_field(body, field):
    assert refused(body).field == field


def test_two_guides_name_the_first_in_the_message():
    err = refused({"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}})
    assert err.field == "structured_outputs.choice" and "response_format" in err.message


def test_deep_and_long_schemas_are_refused():
    deep: dict = {}
    node = deep
    for _ in range(MAX_SCHEMA_DEPTH + 2):
        node["items"] = {}
        node = node["items"]
    assert refused(rf_schema(deep)).field == "response_format.json_schema.schema"
    big = {"enum": ["x" * 1000] * (MAX_SOURCE_CHARS // 1000 + 1)}
    assert "longer than" in refused({"guided_json": big}).message
    with pytest.raises(StructuredOutputError):
        choice_spec(("x" * (MAX_SOURCE_CHARS // 2), "y" * (MAX_SOURCE_CHARS // 2)))


def test_the_body_must_be_an_object():
    with pytest.raises(StructuredOutputError):
        guided_spec_from_openai(["response_format"])  # type: ignore[arg-type]


def test_the_module_is_pure():
    code = ("import sys, pdserve.transport.requests.structured\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch','ray','grpc','numpy','llguidance','xgrammar'})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""

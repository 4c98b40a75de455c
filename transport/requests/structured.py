"""Structured outputs: which grammar, if any, a request's text must follow. ``GuidedSpec`` is the
guide as plain values (a kind and its canonical source text) and ``guided_spec_from_openai`` reads
it from an OpenAI / vLLM request body:

* OpenAI ``response_format``: ``{"type": "text"}`` (no guide), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}``;
* vLLM's extra body fields ``guided_json`` (a schema, as an object or as JSON text),
  ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (Lark or GBNF/EBNF);
* vLLM's newer ``structured_outputs`` object with one of ``json`` / ``regex`` / ``choice`` /
  ``grammar`` / ``json_object: true``.

At most one guide per request; a second one is an error naming it. Every error is a
``StructuredOutputError`` (a ``FieldError``, so a ``ValueError``) whose ``field`` is the body
field's dotted path ("response_format.json_schema.schema"), so a door answers a 400 naming it.
Whether a schema, regex or grammar actually compiles is the grammar engine's question
(``pdserve.workers.engine.grammar``); this module only checks shapes. PURE: stdlib only."""
from __future__ import annotations

import hashlib
import json
import math
import re
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .sampling import FieldError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# The body field each kind comes from when a spec did not record one (errors name it).
DEFAULT_FIELDS = {
    "json_object": "response_format",
    "json_schema": "response_format.json_schema.schema",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}

MAX_SOURCE_CHARS = 1 << 18  # a schema, regex or grammar (canonical text) of at most 256 KiB
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64  # nesting of objects/lists in a schema (also keeps json.dumps off recursion limits)

_SCHEMA_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class StructuredOutputError(FieldError):
    """A malformed structured-output request; ``field`` is the body field's dotted path."""


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """One guide. ``text`` is canonical, so equal guides have equal text and ``cache_key``:
    json_object: "" (any JSON object); json_schema: the schema as JSON without spaces and with
    sorted keys, except that a ``properties`` map keeps its order (generated keys follow it);
    regex: the pattern; choice: a JSON list of the distinct choices, sorted; grammar: the
    grammar text (Lark, or GBNF/EBNF with ``::=`` rules). ``field`` is the body field it came from
    (errors name it); it is no part of equality or of the key."""

    kind: str
    text: str = ""
    field: str = dataclasses.field(default="", compare=False)
    cache_key: str = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(self.field or "guided",
                                        f"unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise StructuredOutputError(self.error_field, "the source must be a string")
        if self.kind == "json_object" and self.text:
            raise StructuredOutputError(self.error_field, "json_object takes no source text")
        digest = hashlib.sha256(f"{self.kind}\0{self.text}".encode("utf-8", "surrogatepass"))
        object.__setattr__(self, "cache_key", f"{self.kind}:{digest.hexdigest()[:32]}")

    @property
    def error_field(self) -> str:
        """The body field that errors about this guide name."""
        return self.field or DEFAULT_FIELDS[self.kind]

    def as_pair(self) -> tuple[str, str]:
        """(kind, text): the wire form (SamplingParams.guided)."""
        return (self.kind, self.text)

    @classmethod
    def from_pair(cls, pair: tuple[str, str] | list[str], field: str = "") -> GuidedSpec:
        kind, text = pair
        return cls(kind, text, field)

    def choices(self) -> list[str]:
        """The choices of a "choice" guide."""
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} guide has no choices")
        return list(json.loads(self.text))

    def schema(self) -> dict[str, Any]:
        """The schema of a "json_schema" guide ({"type": "object"} for "json_object")."""
        if self.kind == "json_object":
            return {"type": "object"}
        if self.kind != "json_schema":
            raise ValueError(f"a {self.kind} guide has no schema")
        return json.loads(self.text)


# ---- constructors (also usable without a request body) -------------------------------------------

def json_object_spec(field: str = "response_format") -> GuidedSpec:
    return GuidedSpec("json_object", "", field)


def json_schema_spec(schema: Any, field: str = "response_format.json_schema.schema") -> GuidedSpec:
    """``schema``: a JSON object, or JSON text of one."""
    if isinstance(schema, str):
        if len(schema) > MAX_SOURCE_CHARS:
            raise StructuredOutputError(field, f"longer than {MAX_SOURCE_CHARS} characters")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as exc:
            raise StructuredOutputError(field, f"not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise StructuredOutputError(field, f"must be a JSON Schema object, got {_type_name(schema)}")
    _check_json_value(schema, field, 0)
    try:
        text = json.dumps(_canonical(schema), separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise StructuredOutputError(field, f"not representable as JSON: {exc}") from None
    _check_length(text, field)
    return GuidedSpec("json_schema", text, field)


def regex_spec(pattern: Any, field: str = "guided_regex") -> GuidedSpec:
    _check_source_string(pattern, field, "a regular expression")
    return GuidedSpec("regex", pattern, field)


def choice_spec(choices: Any, field: str = "guided_choice") -> GuidedSpec:
    if isinstance(choices, (str, bytes)) or not isinstance(choices, (list, tuple)):
        raise StructuredOutputError(field, f"must be a list of strings, got {_type_name(choices)}")
    if not choices:
        raise StructuredOutputError(field, "must list at least one choice")
    if len(choices) > MAX_CHOICES:
        raise StructuredOutputError(field, f"{len(choices)} choices; at most {MAX_CHOICES}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise StructuredOutputError(f"{field}[{i}]", f"must be a string, got {_type_name(choice)}")
        if not choice:
            raise StructuredOutputError(f"{field}[{i}]", "must not be empty")
    text = json.dumps(sorted(set(choices)), ensure_ascii=False, separators=(",", ":"))
    _check_length(text, field)
    return GuidedSpec("choice", text, field)


def grammar_spec(grammar: Any, field: str = "guided_grammar") -> GuidedSpec:
    _check_source_string(grammar, field, "a grammar (Lark, or GBNF/EBNF)")
    return GuidedSpec("grammar", grammar, field)


# ---- the request body ----------------------------------------------------------------------------

def guided_spec_from_openai(body: Mapping[str, Any]) -> GuidedSpec | None:
    """The request's guide, or None for free text. A field that is absent or null is no guide;
    two guides are an error naming the second (in the order response_format, guided_json,
    guided_regex, guided_choice, guided_grammar, structured_outputs)."""
    if not isinstance(body, Mapping):
        raise StructuredOutputError("body", "the request body must be a JSON object")
    found: GuidedSpec | None = None

    def take(spec: GuidedSpec | None) -> None:
        nonlocal found
        if spec is None:
            return
        if found is not None:
            raise StructuredOutputError(
                spec.error_field, f"only one structured-output guide per request; "
                                  f"{found.error_field} already gives one")
        found = spec

    take(_response_format(body.get("response_format")))
    if body.get("guided_json") is not None:
        take(json_schema_spec(body["guided_json"], "guided_json"))
    if body.get("guided_regex") is not None:
        take(regex_spec(body["guided_regex"], "guided_regex"))
    if body.get("guided_choice") is not None:
        take(choice_spec(body["guided_choice"], "guided_choice"))
    if body.get("guided_grammar") is not None:
        take(grammar_spec(body["guided_grammar"], "guided_grammar"))
    for spec in _structured_outputs(body.get("structured_outputs")):
        take(spec)
    return found


_RESPONSE_FORMAT_KEYS = {"type", "json_schema"}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _response_format(value: Any) -> GuidedSpec | None:
    f = "response_format"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise StructuredOutputError(f, f"must be an object, got {_type_name(value)}")
    _reject_unknown(value, _RESPONSE_FORMAT_KEYS, f)
    kind = value.get("type")
    if kind is None:
        raise StructuredOutputError(f"{f}.type", "is required")
    if not isinstance(kind, str):
        raise StructuredOutputError(f"{f}.type", f"must be a string, got {_type_name(kind)}")
    if kind != "json_schema" and value.get("json_schema") is not None:
        raise StructuredOutputError(f"{f}.json_schema", f"only with type 'json_schema', not {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec(f)
    if kind != "json_schema":
        raise StructuredOutputError(f"{f}.type", f"{kind!r} is not supported "
                                    "(accepted: 'text', 'json_object', 'json_schema')")
    js = value.get("json_schema")
    if js is None:
        raise StructuredOutputError(f"{f}.json_schema", "is required with type 'json_schema'")
    if not isinstance(js, Mapping):
        raise StructuredOutputError(f"{f}.json_schema", f"must be an object, got {_type_name(js)}")
    _reject_unknown(js, _JSON_SCHEMA_KEYS, f"{f}.json_schema")
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or not _SCHEMA_NAME_RE.fullmatch(name)):
        raise StructuredOutputError(f"{f}.json_schema.name",
                                    "must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'")
    description = js.get("description")
    if description is not None and not isinstance(description, str):
        raise StructuredOutputError(f"{f}.json_schema.description",
                                    f"must be a string, got {_type_name(description)}")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredOutputError(f"{f}.json_schema.strict",
                                    f"must be a boolean, got {_type_name(strict)}")
    schema = js.get("schema")
    if schema is None:
        raise StructuredOutputError(f"{f}.json_schema.schema", "is required")
    if not isinstance(schema, Mapping):  # JSON text is vLLM's guided_json habit, not OpenAI's
        raise StructuredOutputError(f"{f}.json_schema.schema",
                                    f"must be a JSON Schema object, got {_type_name(schema)}")
    return json_schema_spec(schema, f"{f}.json_schema.schema")


# vLLM StructuredOutputsParams options that change no text's validity: accepted and ignored.
_SO_IGNORED = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties"}
_SO_GUIDES = ("json", "regex", "choice", "grammar", "json_object")
# Accepted only when null: a guide kind pdserve does not serve, or an option that changes the text.
_SO_UNSUPPORTED = {"structural_tag", "whitespace_pattern"}


def _structured_outputs(value: Any) -> list[GuidedSpec]:
    f = "structured_outputs"
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise StructuredOutputError(f, f"must be an object, got {_type_name(value)}")
    _reject_unknown(value, {*_SO_IGNORED, *_SO_GUIDES, *_SO_UNSUPPORTED}, f)
    for key in sorted(_SO_IGNORED):
        if value.get(key) is not None and not isinstance(value[key], bool):
            raise StructuredOutputError(f"{f}.{key}", f"must be a boolean, got {_type_name(value[key])}")
    for key in sorted(_SO_UNSUPPORTED):
        if value.get(key) is not None:
            raise StructuredOutputError(f"{f}.{key}", "is not supported")
    specs: list[GuidedSpec] = []
    if value.get("json") is not None:
        specs.append(json_schema_spec(value["json"], f"{f}.json"))
    if value.get("regex") is not None:
        specs.append(regex_spec(value["regex"], f"{f}.regex"))
    if value.get("choice") is not None:
        specs.append(choice_spec(value["choice"], f"{f}.choice"))
    if value.get("grammar") is not None:
        specs.append(grammar_spec(value["grammar"], f"{f}.grammar"))
    json_object = value.get("json_object")
    if json_object is not None:
        if not isinstance(json_object, bool):
            raise StructuredOutputError(f"{f}.json_object",
                                        f"must be a boolean, got {_type_name(json_object)}")
        if json_object:
            specs.append(json_object_spec(f"{f}.json_object"))
    return specs


# ---- helpers -------------------------------------------------------------------------------------

def _reject_unknown(value: Mapping[str, Any], known: set[str], f: str) -> None:
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise StructuredOutputError(f"{f}.{unknown[0]}", "unrecognized field")


def _check_source_string(value: Any, f: str, what: str) -> None:
    if not isinstance(value, str):
        raise StructuredOutputError(f, f"must be a string ({what}), got {_type_name(value)}")
    if not value:
        raise StructuredOutputError(f, "must not be empty")
    if "\x00" in value:
        raise StructuredOutputError(f, "must not contain NUL characters")
    _check_length(value, f)


def _check_length(text: str, f: str) -> None:
    if len(text) > MAX_SOURCE_CHARS:
        raise StructuredOutputError(f, f"longer than {MAX_SOURCE_CHARS} characters")


def _check_json_value(value: Any, f: str, depth: int) -> None:
    """A schema must be plain JSON: string keys, finite numbers, bounded nesting."""
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise StructuredOutputError(f, f"object keys must be strings, got {_type_name(key)}")
            _check_json_value(item, f, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_json_value(item, f, depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise StructuredOutputError(f, f"numbers must be finite, got {value!r}")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise StructuredOutputError(f, f"not a JSON value: {_type_name(value)}")


def _canonical(value: Any, keep_order: bool = False) -> Any:
    """Objects with sorted keys, except a ``properties`` map: its order is the order the
    generated object's keys follow (the engine emits them in schema order, as OpenAI does)."""
    if isinstance(value, Mapping):
        keys = list(value) if keep_order else sorted(value)
        return {k: _canonical(value[k], k == "properties" and isinstance(value[k], Mapping))
                for k in keys}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__

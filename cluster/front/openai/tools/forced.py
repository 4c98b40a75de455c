"""Forced calls (tool_choice "required" or a named function): the JSON schema the output is
decoded under, and the parser that reads that output back into calls.

Decoding under the schema (the sampler's ``guided`` path, as ``response_format`` uses) is what
makes the output a call, so these parsers only read it: a named function's output is its
arguments object; "required"'s is an array of ``{"name", "parameters"}``. An output that is not
a call anyway (cut by max_tokens, say) comes back as content with no calls.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from .call_text import BodyStreamer, Deltas, Span, call_from_body, skip_ws, span_end
from .calls import ToolCall, new_call_id
from .request import NAMED, ToolError, ToolRequest, shared_defs

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def forced_schema(tool_request: ToolRequest) -> dict[str, Any] | None:
    """The JSON schema that makes the output a valid call, or None when calls are not forced.

    A named function: its parameters schema (the output is the arguments object). "required":
    an array (at least one item; at most one without parallel_tool_calls) of
    ``{"name": <one tool's name>, "parameters": <that tool's schema>}``, one anyOf branch per
    tool; definitions ($defs, definitions) of the tools' schemas are lifted to the root, where
    their "#/$defs/..." references point once the schemas are nested."""
    if tool_request.choice == NAMED:
        tool = tool_request.tool(tool_request.function_name or "")
        if tool is None:
            raise ToolError("tool_choice.function.name", f"unknown tool {tool_request.function_name!r}")
        return copy.deepcopy(tool.parameters) if tool.parameters is not None else copy.deepcopy(EMPTY_PARAMETERS)
    if tool_request.choice != "required" or not tool_request.tools:
        return None
    branches = [{
        "properties": {
            "name": {"type": "string", "enum": [t.name]},
            "parameters": copy.deepcopy(t.parameters if t.parameters is not None else EMPTY_PARAMETERS),
        },
        "required": ["name", "parameters"],
        # Nothing else in a call: a model (a weak one above all) cannot wander off into keys
        # the call parser would drop.
        "additionalProperties": False,
    } for t in tool_request.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if not tool_request.parallel_tool_calls:
        schema["maxItems"] = 1
    for key, defs in shared_defs(tool_request.tools).items():
        schema[key] = defs
    return schema


def guided_decoding(tool_request: ToolRequest) -> tuple[str, str] | None:
    """The sampling ``guided`` pair for a forced call: ("json_schema", schema JSON), or None."""
    schema = forced_schema(tool_request)
    return None if schema is None else ("json_schema", json.dumps(schema, ensure_ascii=False))


def calls_from_forced_output(tool_request: ToolRequest, text: str) -> list[ToolCall]:
    """The calls in a forced output. A named function: one call whose arguments are the text
    (stripped of surrounding whitespace), as it is. "required": one call per array item, its
    arguments the item's own text of "parameters"; [] when the text is not such an array (the
    door then answers the text as content). Not forced: []."""
    if tool_request.choice == NAMED:
        return [ToolCall(new_call_id(), tool_request.function_name or "", text.strip())]
    if tool_request.choice != "required":
        return []
    found = _required_calls(text)
    return [ToolCall(new_call_id(), name, arguments) for name, arguments in found or ()]


def _required_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items or not all(isinstance(item, dict) for item in items):
        return None
    calls = []
    pos = skip_ws(text, 0) + 1  # past "["
    for _ in items:
        start = skip_ws(text, pos)
        end = span_end(text, start)
        if end is None:
            return None
        call = call_from_body(text[start:end], "parameters")
        if call is None:
            return None
        calls.append(call)
        pos = skip_ws(text, end) + 1  # past "," or "]"
    return calls


class ForcedToolParser:
    """The output of a forced call (tool_choice "required" or a named function), decoded under
    ``forced_schema``: the same parse/stream interface as the tool call parsers."""

    def __init__(self, tool_request: ToolRequest) -> None:
        if not tool_request.forced:
            raise ValueError(f"tool_choice {tool_request.choice!r} does not force a call")
        self.tool_request = tool_request

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = calls_from_forced_output(self.tool_request, text)
        return (None, calls) if calls else ((text or None), [])

    def stream(self) -> NamedCallStream | RequiredCallsStream:
        if self.tool_request.choice == NAMED:
            return NamedCallStream(self.tool_request.function_name or "")
        return RequiredCallsStream()


class NamedCallStream:
    """A named function's output is its arguments: the call is sent first, then the text as
    arguments (whitespace around it left out, as ``calls_from_forced_output`` does)."""

    def __init__(self, name: str) -> None:
        self._deltas = Deltas()
        self._name = name
        self._started = False
        self._seen_text = False
        self._spaces = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self._deltas.calls

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if not self._started:
            self._deltas.start_call(self._name)
            self._started = True
        if not self._seen_text:
            delta_text = delta_text.lstrip()
            self._seen_text = bool(delta_text)
        text = self._spaces + delta_text
        kept = text.rstrip()
        self._spaces = text[len(kept):]
        self._deltas.add_arguments(0, kept)
        return self._deltas.take()

    def finish(self) -> list[dict[str, Any]]:
        if not self._started:
            self._deltas.start_call(self._name)
            self._started = True
        return self._deltas.take()


class RequiredCallsStream:
    """tool_choice "required": the output is ``[{"name": ..., "parameters": {...}}, ...]``; each
    item becomes a call, its parameters sent as arguments as they come. An output that is not
    such an array, with no call sent, is sent as content at the end."""

    def __init__(self) -> None:
        self._deltas = Deltas()
        self._text: list[str] = []
        self._state = "open"  # open | item_or_end | item | next | done | bad
        self._item = Span()
        self._item_text: list[str] = []
        self._streamer: BodyStreamer | None = None
        self._finished = False

    @property
    def calls(self) -> list[ToolCall]:
        return self._deltas.calls

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        self._text.append(delta_text)
        self._read(delta_text)
        return self._deltas.take()

    def finish(self) -> list[dict[str, Any]]:
        if not self._finished:
            self._finished = True
            text = "".join(self._text)
            if not self._deltas.ids and _required_calls(text) is None:
                self._deltas.content(text)
        return self._deltas.take()

    def _read(self, chunk: str) -> None:
        i = 0
        while i < len(chunk) and self._state not in ("done", "bad"):
            if self._state == "item":
                stop = self._item.scan(chunk, i)
                piece = chunk[i:stop]
                self._item_text.append(piece)
                self._streamer.add(piece)
                i = stop
                if not self._item.done:
                    return
                if not self._streamer.complete("".join(self._item_text)):
                    self._state = "bad"
                    return
                self._state = "next"
                continue
            c = chunk[i]
            if c in " \t\r\n":
                i += 1
            elif self._state == "open":
                self._state = "item_or_end" if c == "[" else "bad"
                i += 1
            elif self._state == "item_or_end" and c == "{":
                self._item, self._item_text = Span(), []
                self._streamer = BodyStreamer(self._deltas, "parameters")
                self._state = "item"  # the item's scan reads this "{"
            elif self._state in ("item_or_end", "next") and c == "]":
                self._state = "done"
            elif self._state == "next" and c == ",":
                self._state = "item_or_end"
                i += 1
            else:
                self._state = "bad"

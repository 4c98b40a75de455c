"""Reading a call out of model text, whole or chunk by chunk: where a JSON value ends, the
(name, arguments) of a ``{"name": ..., "arguments": {...}}`` body, and the OpenAI ``delta``
fragments a streamed call is sent as. Shared by the Hermes parser and the forced-call parsers.

A call's arguments are the model's own text of the object (re-serialized only when the body is
not written name first), so a streamed call's argument fragments concatenate to exactly what
the whole-output parse returns.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .calls import ToolCall, new_call_id


def _call_prefix(key: str) -> re.Pattern[str]:
    """The start of a call written in the usual order, up to the "{" of its arguments."""
    ws = r"[ \t\r\n]*"  # JSON's whitespace
    return re.compile(ws + r'\{' + ws + r'"name"' + ws + ':' + ws + r'"((?:[^"\\\x00-\x1f]|\\.)+)"' + ws + ','
                      + ws + '"' + key + '"' + ws + ':' + ws + r'(?=\{)')


_PREFIX = {"arguments": _call_prefix("arguments"), "parameters": _call_prefix("parameters")}


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class Span:
    """Finds, chunk by chunk, where a JSON object or array ends (its first character is the
    first one scanned)."""

    __slots__ = ("depth", "in_string", "escaped", "done")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def scan(self, chunk: str, start: int = 0) -> int:
        """Reads chunk[start:]; returns the index just past the value's last character when it
        is there (and sets ``done``), else len(chunk)."""
        depth, in_string, escaped = self.depth, self.in_string, self.escaped
        i, n = start, len(chunk)
        while i < n:
            c = chunk[i]
            i += 1
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            elif c == "}" or c == "]":
                depth -= 1
                if depth == 0:
                    self.done = True
                    break
        self.depth, self.in_string, self.escaped = depth, in_string, escaped
        return i


def span_end(text: str, start: int) -> int | None:
    if start >= len(text) or text[start] not in "{[":
        return None
    span = Span()
    end = span.scan(text, start)
    return end if span.done else None


def _prefix_name(match: re.Match[str]) -> str | None:
    try:
        return json.loads('"' + match.group(1) + '"')
    except ValueError:
        return None


def call_from_body(body: str, key: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of ``{"name": ..., key: {...}}``, or None when it is not one.
    The arguments are the body's own text of the object when the body is written in the usual
    order (name first), else the object re-serialized; a string holding a JSON object is taken
    as it is; no arguments are "{}"."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if key not in obj:
        return name, "{}"
    args = obj[key]
    if isinstance(args, str):
        try:
            return (name, args) if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    match = _PREFIX[key].match(body)
    if match is not None and _prefix_name(match) == name:
        end = span_end(body, match.end())
        if end is not None:
            raw = body[match.end():end]
            try:
                if json.loads(raw) == args:
                    return name, raw
            except ValueError:
                pass
    return name, json.dumps(args, ensure_ascii=False)


class Deltas:
    """Collects OpenAI ``delta`` fragments, merging neighbours of one kind, and the calls made."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.names: list[str] = []
        self._arguments: list[list[str]] = []

    def content(self, text: str) -> None:
        if not text:
            return
        if self.out and "content" in self.out[-1]:
            self.out[-1]["content"] += text
        else:
            self.out.append({"content": text})

    def start_call(self, name: str, arguments: str = "") -> int:
        index = len(self.ids)
        self.ids.append(new_call_id())
        self.names.append(name)
        self._arguments.append([arguments])
        self.out.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                         "function": {"name": name, "arguments": arguments}}]})
        return index

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        self._arguments[index].append(text)
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] = last["function"].get("arguments", "") + text
        else:
            self.out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def arguments(self, index: int) -> str:
        parts = self._arguments[index]
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0]

    def take(self) -> list[dict[str, Any]]:
        out, self.out = self.out, []
        return out

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.ids[i], self.names[i], self.arguments(i)) for i in range(len(self.ids))]


# A call's name is sent once ``{"name": "...", "arguments": `` is read; a body that does not
# start so within this many characters is read whole (the result is the same, sent later).
_HEAD_LIMIT = 1024


class BodyStreamer:
    """One call's body, read chunk by chunk: once ``{"name": "...", <key>: `` is there, the call
    is started and its arguments are sent as they come."""

    def __init__(self, deltas: Deltas, key: str) -> None:
        self.deltas, self.key = deltas, key
        self.index: int | None = None  # set once the call is started
        self.head = ""  # the body until then
        self.span = Span()  # the arguments object's extent

    def add(self, chunk: str) -> None:
        """The next chunk of the body."""
        at = 0
        if self.index is None:
            if len(self.head) >= _HEAD_LIMIT:
                return
            self.head += chunk
            match = _PREFIX[self.key].match(self.head)
            name = _prefix_name(match) if match is not None else None
            if name is None:
                return
            self.index = self.deltas.start_call(name)
            chunk, at, self.head = self.head, match.end(), ""
        if not self.span.done:
            stop = self.span.scan(chunk, at)
            self.deltas.add_arguments(self.index, chunk[at:stop])

    def complete(self, body: str) -> bool:
        """The whole body (every chunk of it added): finishes the call; False when the body is
        not a call and nothing of it was sent."""
        call = call_from_body(body, self.key)
        if self.index is not None:
            sent = self.deltas.arguments(self.index)
            if call is not None and call[1].startswith(sent):
                self.deltas.add_arguments(self.index, call[1][len(sent):])
            return True  # committed once the name was sent
        if call is None:
            return False
        self.deltas.start_call(*call)
        return True

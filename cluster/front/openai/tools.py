"""OpenAI tool calling for the HTTP door (pure: the standard library only).

What the door does with it, for POST /v1/chat/completions:

1. Parse the body. ``parse_tools(body)`` reads ``tools``, ``tool_choice`` and
   ``parallel_tool_calls`` and returns a frozen ``ToolRequest``, or raises ``ToolError`` (a
   ValueError) whose ``param`` is the body field (``tools[1].function.name``) and ``detail`` the
   rule: answer it with ``api.invalid(exc.param, exc.detail)``. api.parse_request must then stop
   treating these three fields as no-ops, and accept role "tool" (with ``tool_call_id``) and
   assistant messages with ``tool_calls`` (content may then be null).

2. Pick how the output is read: ``output_parser(tool_request, tool_call_parser)``, where
   ``tool_call_parser`` is the server's ``--tool-call-parser`` name or None (validate that name at
   start-up with ``get_tool_parser(name)``). It returns None when the output is plain text (no
   tools, or ``tool_choice: "none"``); a ``ForcedToolParser`` for ``"required"`` and for a named
   function; the registered parser (``TOOL_PARSERS``, "hermes") for ``"auto"``. ``"auto"``
   without a configured parser raises ToolError("tool_choice", ...), as vLLM refuses it.

3. Constrain decoding when the call is forced: ``guided_decoding(tool_request)`` is the
   sampling ``guided`` pair ``("json_schema", <schema JSON>)`` (``forced_schema`` is the schema
   itself) or None. For a named function the model writes the arguments object; for
   ``"required"`` an array of ``{"name", "parameters"}``. Refuse a request that also sets
   ``response_format`` to a schema: one constraint per request.

4. Render the prompt: ``render_chat(chat_template, messages, tool_request)``. It normalizes the
   messages with ``template_messages`` (tool results, assistant tool calls with their arguments
   as a dict, as Hugging Face templates expect; errors are ToolErrors naming
   ``messages[i]...``) and passes ``tools`` to the template when the request has any. That needs
   ``ChatTemplate.render(messages, add_generation_prompt, tools=None)`` to forward ``tools`` to
   jinja (``self._compiled.render(..., tools=tools)``); without tools the call is today's
   ``render(messages, add_generation_prompt)``. As vLLM does by default, the tools are rendered
   even with ``tool_choice: "none"``.

5. Answer. Non-streamed: ``content, calls = parser.parse(text)``; the message is
   ``chat_message(content, calls)`` and the finish reason
   ``finish_reason_for(calls, finish_reason, tool_request)``. Streamed:
   ``s = parser.stream()``; for each text delta send one chunk per dict in ``s.feed(text)`` as
   the choice's ``delta`` (content deltas, and ``tool_calls`` deltas: the first for a call
   carries index, id, type, function.name and function.arguments, the next ones more
   arguments); at the end send ``s.finish()``'s deltas, then the finish chunk with
   ``finish_reason_for(s.calls, finish_reason, tool_request)``. A forced output that is not a
   call (cut by max_tokens, say) comes back as content with no calls, and keeps its finish
   reason.

Validation follows OpenAI: a function's name is 1 to 64 of a-z, A-Z, 0-9, "_" and "-", unique
in the request; ``parameters`` is a JSON schema object; unknown fields are refused by name.
``strict`` is accepted: only forced calls are decoded under the schema ("auto" output is read as
the model wrote it). ``parallel_tool_calls: false`` limits a "required" array to one call.

Hermes/Qwen output (``HermesToolParser``): optional content, then one or more
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks. The content is the
text before the first block, and any later text between or after blocks that is not only
whitespace. A block whose JSON is not a call leaves the whole output as content, with no calls.
A last block left unclosed (the output stopped there) still counts when its JSON is complete.
The arguments are the model's own text of the arguments object (no re-serialization), so a
streamed call's arguments fragments concatenate to exactly the non-streamed arguments.
The streamed parser sends content at once, except a tail that may be the start of
``<tool_call>`` (held until decided, flushed as content by ``finish``); a call's name as soon as
``{"name": "...", "arguments": {`` is read, then its arguments as they come (a block written in
another order is sent whole when it closes). Once a call's
name is sent it is committed: a block found malformed only later (streamed output cannot take
back what it sent) stays a call, where the non-streamed parse would have returned the text.
A block found malformed before anything of it was sent is sent as content, with everything
after it, which matches the non-streamed answer when it is the first block.
"""
from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = [
    "TOOL_PARSERS", "ForcedToolParser", "HermesToolParser", "Tool", "ToolCall", "ToolError",
    "ToolRequest", "calls_from_forced_output", "chat_message", "finish_reason_for", "forced_schema",
    "get_tool_parser", "guided_decoding", "new_call_id", "output_parser", "parse_tools",
    "render_chat", "template_messages",
]

CHOICES = ("none", "auto", "required")
NAMED = "function"  # ToolRequest.choice for {"type": "function", "function": {"name": ...}}
# OpenAI's rule for a function's name.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A request field the tool support refuses; ``param`` is the body field's path."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param, self.detail = param, detail


# ---- the request ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: bool | None = None  # accepted; only forced calls are held to the schema

    def to_json(self) -> dict[str, Any]:
        """The tool as OpenAI writes it (and as chat templates receive it); absent fields left out."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = copy.deepcopy(self.parameters)
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...] = ()
    choice: str = "none"  # "none" | "auto" | "required" | "function" (a named function)
    function_name: str | None = None  # the named function, when choice is "function"
    parallel_tool_calls: bool = True

    @property
    def enabled(self) -> bool:
        """The output may hold calls (there are tools and tool_choice is not "none")."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output must be a call: "required" or a named function."""
        return self.choice in ("required", NAMED)

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The ``tools`` variable for the chat template, or None when the request has none."""
        return [t.to_json() for t in self.tools] or None


def parse_tools(body: Mapping[str, Any]) -> ToolRequest:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat completions body.

    No tools (absent, null or []): tool_choice may only be absent or "none". With tools,
    tool_choice defaults to "auto" and parallel_tool_calls to true."""
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"must be a boolean, got {parallel!r}")
    request = ToolRequest(tools, choice, name, parallel)
    if choice == "required":
        _shared_defs(tools)  # refuses definitions that clash once the schemas are combined
    return request


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError("tools", f"must be a list of tools, got {type(value).__name__}")
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise ToolError(where, 'must be an object {"type": "function", "function": {...}}')
        for key in item:
            if key not in ("type", "function"):
                raise ToolError(f"{where}.{key}", "unrecognized field")
        kind = item.get("type", "function")
        if kind != "function":
            raise ToolError(f"{where}.type", f'only "function" tools are supported, got {kind!r}')
        tool = _function(item.get("function"), f"{where}.function")
        if tool.name in seen:
            raise ToolError(f"{where}.function.name",
                            f"duplicate tool name {tool.name!r} (also tools[{seen[tool.name]}])")
        seen[tool.name] = i
        tools.append(tool)
    return tuple(tools)


def _function(value: Any, where: str) -> Tool:
    if not isinstance(value, dict):
        raise ToolError(where, "is required: an object with name, description, parameters")
    for key in value:
        if key not in ("name", "description", "parameters", "strict"):
            raise ToolError(f"{where}.{key}", "unrecognized field")
    name = value.get("name")
    if name is None:
        raise ToolError(f"{where}.name", "is required")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ToolError(f"{where}.name", "must be 1 to 64 of a-z, A-Z, 0-9, underscores and dashes, "
                                         f"got {name!r}")
    description = value.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.description", f"must be a string, got {type(description).__name__}")
    parameters = value.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.parameters",
                            f"must be a JSON schema object, got {type(parameters).__name__}")
        kind = parameters.get("type")
        if isinstance(kind, str) and kind != "object":
            raise ToolError(f"{where}.parameters.type",
                            f'the arguments must be an object (type "object"), got {kind!r}')
        parameters = copy.deepcopy(parameters)
    strict = value.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.strict", f"must be a boolean, got {strict!r}")
    return Tool(name, description, parameters, strict)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError("tool_choice", 'must be "none", "auto", "required" or '
                                           f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}')
        if value != "none" and not tools:
            raise ToolError("tool_choice", f"{value!r} needs tools; the request defines none")
        return value, None
    if not isinstance(value, dict):
        raise ToolError("tool_choice", f"must be a string or an object, got {type(value).__name__}")
    for key in value:
        if key not in ("type", "function"):
            raise ToolError(f"tool_choice.{key}", "unrecognized field")
    if value.get("type") != "function":
        raise ToolError("tool_choice.type", f'must be "function", got {value.get("type")!r}')
    function = value.get("function")
    if not isinstance(function, dict):
        raise ToolError("tool_choice.function", 'is required: {"name": ...}')
    for key in function:
        if key != "name":
            raise ToolError(f"tool_choice.function.{key}", "unrecognized field")
    name = function.get("name")
    if not isinstance(name, str):
        raise ToolError("tool_choice.function.name", f"must be a string, got {name!r}")
    if not any(t.name == name for t in tools):
        defined = ", ".join(t.name for t in tools)
        raise ToolError("tool_choice.function.name",
                        f"unknown tool {name!r}; " + (f"the request defines {defined}" if tools
                                                      else "the request defines no tools"))
    return NAMED, name


# ---- forced calls: the schema and its output -----------------------------------------------------

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
    for key, defs in _shared_defs(tool_request.tools).items():
        schema[key] = defs
    return schema


def guided_decoding(tool_request: ToolRequest) -> tuple[str, str] | None:
    """The sampling ``guided`` pair for a forced call: ("json_schema", schema JSON), or None."""
    schema = forced_schema(tool_request)
    return None if schema is None else ("json_schema", json.dumps(schema, ensure_ascii=False))


def _shared_defs(tools: Sequence[Tool]) -> dict[str, dict[str, Any]]:
    """{"$defs": {...}, "definitions": {...}} gathered from every tool's parameters; a name
    defined twice with different schemas is refused."""
    out: dict[str, dict[str, Any]] = {}
    owner: dict[tuple[str, str], int] = {}
    for i, tool in enumerate(tools):
        for key in ("$defs", "definitions"):
            defs = (tool.parameters or {}).get(key)
            if defs is None:
                continue
            where = f"tools[{i}].function.parameters.{key}"
            if not isinstance(defs, dict):
                raise ToolError(where, "must be an object of schemas")
            for name, schema in defs.items():
                seen = out.setdefault(key, {})
                if name in seen and seen[name] != schema:
                    raise ToolError(f"{where}.{name}", f"differs from tools[{owner[key, name]}]'s "
                                    'definition of the same name; with tool_choice "required" the '
                                    "tools' definitions share one namespace")
                seen.setdefault(name, copy.deepcopy(schema))
                owner.setdefault((key, name), i)
    return out


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
    pos = _skip_ws(text, 0) + 1  # past "["
    for _ in items:
        start = _skip_ws(text, pos)
        end = _span_end(text, start)
        if end is None:
            return None
        call = _call_from_body(text[start:end], "parameters")
        if call is None:
            return None
        calls.append(call)
        pos = _skip_ws(text, end) + 1  # past "," or "]"
    return calls


# ---- calls ---------------------------------------------------------------------------------------

def new_call_id() -> str:
    """OpenAI's form: "call_" and 24 random characters."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def chat_message(content: str | None, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    """A chat completion's ``message``: content (null when there is none) and tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_json() for c in calls]
    return message


def finish_reason_for(calls: Sequence[Any], original: str, tool_request: ToolRequest | None = None) -> str:
    """"tool_calls" when the output made calls. Kept as it is: without calls, when the output was
    cut at max_tokens ("length"), and for a named tool_choice, where OpenAI (and vLLM) say
    "stop"."""
    if not calls or original == "length":
        return original
    if tool_request is not None and tool_request.choice == NAMED:
        return original
    return "tool_calls"


# ---- reading calls out of text -------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call_prefix(key: str) -> re.Pattern[str]:
    """The start of a call written in the usual order, up to the "{" of its arguments."""
    ws = r"[ \t\r\n]*"  # JSON's whitespace
    return re.compile(ws + r'\{' + ws + r'"name"' + ws + ':' + ws + r'"((?:[^"\\\x00-\x1f]|\\.)+)"' + ws + ','
                      + ws + '"' + key + '"' + ws + ':' + ws + r'(?=\{)')


_PREFIX = {"arguments": _call_prefix("arguments"), "parameters": _call_prefix("parameters")}


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class _Span:
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


def _span_end(text: str, start: int) -> int | None:
    if start >= len(text) or text[start] not in "{[":
        return None
    span = _Span()
    end = span.scan(text, start)
    return end if span.done else None


def _prefix_name(match: re.Match[str]) -> str | None:
    try:
        return json.loads('"' + match.group(1) + '"')
    except ValueError:
        return None


def _call_from_body(body: str, key: str) -> tuple[str, str] | None:
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
        end = _span_end(body, match.end())
        if end is not None:
            raw = body[match.end():end]
            try:
                if json.loads(raw) == args:
                    return name, raw
            except ValueError:
                pass
    return name, json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Deltas:
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


class _BodyStreamer:
    """One call's body, read chunk by chunk: once ``{"name": "...", <key>: `` is there, the call
    is started and its arguments are sent as they come."""

    def __init__(self, deltas: _Deltas, key: str) -> None:
        self.deltas, self.key = deltas, key
        self.index: int | None = None  # set once the call is started
        self.head = ""  # the body until then
        self.span = _Span()  # the arguments object's extent

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
        call = _call_from_body(body, self.key)
        if self.index is not None:
            sent = self.deltas.arguments(self.index)
            if call is not None and call[1].startswith(sent):
                self.deltas.add_arguments(self.index, call[1][len(sent):])
            return True  # committed once the name was sent
        if call is None:
            return False
        self.deltas.start_call(*call)
        return True


class HermesToolParser:
    """Hermes/Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls) of a whole output; malformed: (the text, [])."""
        content: list[str] = []
        found: list[tuple[str, str]] = []
        pos, segment = 0, 0
        while True:
            start = text.find(_OPEN, pos)
            piece = text[pos:] if start < 0 else text[pos:start]
            if segment == 0 or piece.strip():
                content.append(piece)
            if start < 0:
                break
            body_start = start + len(_OPEN)
            end = text.find(_CLOSE, body_start)
            call = _call_from_body(text[body_start:] if end < 0 else text[body_start:end], "arguments")
            if call is None:
                return (text or None), []
            found.append(call)
            if end < 0:
                break
            pos, segment = end + len(_CLOSE), segment + 1
        return ("".join(content) or None), [ToolCall(new_call_id(), name, args) for name, args in found]

    def stream(self) -> HermesToolStream:
        return HermesToolStream()


class HermesToolStream:
    """``feed(delta_text)`` and ``finish()`` return OpenAI delta fragments; ``calls`` are the
    calls sent so far (their arguments as sent)."""

    def __init__(self) -> None:
        self._deltas = _Deltas()
        self._pending = ""  # text not yet read: a possible start of a tag
        self._mode = "text"  # "text" | "call" | "plain" (after a malformed block: all content)
        self._segment = 0  # text pieces outside blocks: 0 before the first block
        self._piece = ""  # a later piece, held while it is only whitespace
        self._piece_live = False  # it is not: it is sent as it comes
        self._body: list[str] = []
        self._streamer: _BodyStreamer | None = None
        self._done = False

    @property
    def calls(self) -> list[ToolCall]:
        return self._deltas.calls

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if self._done:
            raise RuntimeError("feed after finish")
        self._pending += delta_text
        self._read()
        return self._deltas.take()

    def finish(self) -> list[dict[str, Any]]:
        if not self._done:
            self._done = True
            if self._mode == "text":
                self._text(self._pending, final=True)
            elif self._mode == "call":
                self._add_body(self._pending)
                self._close_call(closed=False)
            else:
                self._deltas.content(self._pending)
            self._pending = ""
        return self._deltas.take()

    def _read(self) -> None:
        while True:
            buf = self._pending
            if self._mode == "plain":
                self._deltas.content(buf)
                self._pending = ""
                return
            if self._mode == "text":
                i = buf.find(_OPEN)
                if i < 0:
                    keep = _partial_suffix(buf, _OPEN)
                    self._text(buf[:len(buf) - keep], final=False)
                    self._pending = buf[len(buf) - keep:]
                    return
                self._text(buf[:i], final=True)
                self._pending = buf[i + len(_OPEN):]
                self._mode, self._body = "call", []
                self._streamer = _BodyStreamer(self._deltas, "arguments")
                continue
            j = buf.find(_CLOSE)  # in a block
            if j < 0:
                keep = _partial_suffix(buf, _CLOSE)
                self._add_body(buf[:len(buf) - keep])
                self._pending = buf[len(buf) - keep:]
                return
            self._add_body(buf[:j])
            self._pending = buf[j + len(_CLOSE):]
            self._close_call(closed=True)

    def _add_body(self, chunk: str) -> None:
        if chunk:
            self._body.append(chunk)
            self._streamer.add(chunk)

    def _close_call(self, closed: bool) -> None:
        body = "".join(self._body)
        if self._streamer.complete(body):
            self._mode = "text"
        else:
            self._deltas.content(_OPEN + body + (_CLOSE if closed else ""))
            self._mode = "plain"
        self._body, self._streamer = [], None

    def _text(self, text: str, final: bool) -> None:
        """Text outside blocks: all of the first piece; a later piece only if it is not just
        whitespace."""
        if self._segment == 0:
            self._deltas.content(text)
        elif self._piece_live:
            self._deltas.content(text)
        else:
            self._piece += text
            if self._piece.strip():
                self._deltas.content(self._piece)
                self._piece, self._piece_live = "", True
        if final:
            self._segment += 1
            self._piece, self._piece_live = "", False


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
        self._deltas = _Deltas()
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
        self._deltas = _Deltas()
        self._text: list[str] = []
        self._state = "open"  # open | item_or_end | item | next | done | bad
        self._item = _Span()
        self._item_text: list[str] = []
        self._streamer: _BodyStreamer | None = None
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
                self._item, self._item_text = _Span(), []
                self._streamer = _BodyStreamer(self._deltas, "parameters")
                self._state = "item"  # the item's scan reads this "{"
            elif self._state in ("item_or_end", "next") and c == "]":
                self._state = "done"
            elif self._state == "next" and c == ",":
                self._state = "item_or_end"
                i += 1
            else:
                self._state = "bad"


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> HermesToolParser:
    """The ``--tool-call-parser`` named ``name``; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(sorted(TOOL_PARSERS))}") from None


def output_parser(tool_request: ToolRequest, tool_call_parser: str | None
                  ) -> HermesToolParser | ForcedToolParser | None:
    """How to read this request's output: None for plain text (no tools, tool_choice "none"),
    ForcedToolParser for a forced call, the named tool call parser for "auto"."""
    if not tool_request.enabled:
        return None
    if tool_request.forced:
        return ForcedToolParser(tool_request)
    if tool_call_parser is None:
        raise ToolError("tool_choice", '"auto" tool choice needs a tool call parser, and this server runs '
                                       'without --tool-call-parser; use "none", "required" or a named function')
    return get_tool_parser(tool_call_parser)


# ---- chat template -------------------------------------------------------------------------------

def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them: content as text (a list of text parts joined
    by newlines; an assistant's null content as ""), a tool result's ``tool_call_id`` kept, and
    an assistant's ``tool_calls`` as ``{"id", "type": "function", "function": {"name",
    "arguments": <dict>}}`` (arguments sent as a JSON string are parsed; empty ones are {})."""
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ToolError(where, "must be an object with role and content")
        role = message.get("role")
        result = dict(message)
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ToolError(f"{where}.tool_calls", "only assistant messages carry tool calls")
        if "tool_call_id" in message and role != "tool":
            raise ToolError(f"{where}.tool_call_id", 'only "tool" messages answer a tool call')
        if role == "assistant" and calls is not None:
            result["tool_calls"] = _template_calls(calls, f"{where}.tool_calls")
            if not result["tool_calls"]:
                del result["tool_calls"]
            result["content"] = _text(message.get("content"), f"{where}.content", required=False)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise ToolError(f"{where}.tool_call_id", "is required: the id of the call this answers")
            result["content"] = _text(message.get("content"), f"{where}.content", required=True)
        else:
            result["content"] = _text(message.get("content"), f"{where}.content", required=role != "assistant")
        out.append(result)
    return out


def _template_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ToolError(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, Mapping):
            raise ToolError(at, 'must be an object {"id", "type": "function", "function": {"name", "arguments"}}')
        if call.get("type", "function") != "function":
            raise ToolError(f"{at}.type", f'must be "function", got {call.get("type")!r}')
        call_id = call.get("id")
        if not isinstance(call_id, str):
            raise ToolError(f"{at}.id", "is required: a string")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ToolError(f"{at}.function", 'is required: {"name", "arguments"}')
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{at}.function.name", "is required: a string")
        arguments = function.get("arguments")
        if arguments is None or arguments == "":
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise ToolError(f"{at}.function.arguments", f"is not valid JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"{at}.function.arguments", "must be a JSON object")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _text(value: Any, where: str, required: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        if required:
            raise ToolError(where, "is required")
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ToolError(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ToolError(where, f"must be a string or a list of text parts, got {type(value).__name__}")


def render_chat(template: Any, messages: Sequence[Mapping[str, Any]], tool_request: ToolRequest | None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text: ``template`` (a ChatTemplate) renders ``template_messages(messages)``,
    with ``tools`` when the request has any (ChatTemplate.render must accept ``tools=``)."""
    normalized = template_messages(messages)
    tools = tool_request.template_tools() if tool_request is not None else None
    if tools is None:
        return template.render(normalized, add_generation_prompt)
    return template.render(normalized, add_generation_prompt, tools=tools)

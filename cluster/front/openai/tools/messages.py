"""Chat messages as Hugging Face chat templates expect them, tool turns included: text parts
joined, a tool result's ``tool_call_id`` kept, an assistant's ``tool_calls`` with their
arguments as a dict (OpenAI sends them as a JSON string; templates index into them). Refusals
are ``ToolError``s naming ``messages[i]...``."""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .request import ToolError


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

"""The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked field by field.

``parse_tools(body)`` returns a frozen ``ToolRequest`` or raises ``ToolError``, whose ``param`` is
the body field's path (``tools[1].function.name``) so the door's 400 names it, as OpenAI's does.
The rules are OpenAI's: a name is 1 to 64 of a-z, A-Z, 0-9, "_" and "-", unique in the request;
``parameters`` is a JSON schema object; an unknown field is refused by name. ``strict`` is
accepted, but only forced calls decode under the schema (forced.py).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

CHOICES = ("none", "auto", "required")
NAMED = "function"  # ToolRequest.choice for {"type": "function", "function": {"name": ...}}
# OpenAI's rule for a function's name.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolError(ValueError):
    """A request field the tool support refuses; ``param`` is the body field's path."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}: {detail}")
        self.param, self.detail = param, detail


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
        shared_defs(tools)  # refuses definitions that clash once the schemas are combined
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


def shared_defs(tools: Sequence[Tool]) -> dict[str, dict[str, Any]]:
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

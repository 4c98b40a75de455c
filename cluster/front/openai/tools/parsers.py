"""Which parser reads a request's output: the forced-call parser when the call is forced, else
the tool call parser the server's ``--tool-call-parser`` names (TOOL_PARSERS, by its ``name``).
A new model family's format is a new module here and one more entry in TOOL_PARSERS."""
from __future__ import annotations

from .forced import ForcedToolParser
from .hermes import HermesToolParser
from .request import ToolError, ToolRequest

TOOL_PARSERS: dict[str, type[HermesToolParser]] = {p.name: p for p in (HermesToolParser,)}


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

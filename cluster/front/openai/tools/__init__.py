"""OpenAI tool calling for the HTTP door (pure: the standard library only), one module per concern:
``request`` (``tools``/``tool_choice`` checked field by field), ``forced`` (the schema a forced
call decodes under, and its parser), ``hermes`` (the Hermes/Qwen parser), ``parsers`` (which
parser reads an output), ``calls`` (a call in the response), ``call_text`` (reading calls out of
text, shared by the parsers) and ``messages`` (chat messages as templates expect them).

Every parser has ``parse(text) -> (content, calls)`` and ``stream()``, whose ``feed(text)`` and
``finish()`` return OpenAI ``delta`` dicts and whose ``calls`` are the calls sent so far.
"""
from __future__ import annotations

from .calls import ToolCall, chat_message, finish_reason_for, new_call_id
from .forced import ForcedToolParser, calls_from_forced_output, forced_schema, guided_decoding
from .hermes import HermesToolParser
from .messages import template_messages
from .parsers import TOOL_PARSERS, get_tool_parser, output_parser
from .request import Tool, ToolError, ToolRequest, parse_tools

__all__ = [
    "TOOL_PARSERS", "ForcedToolParser", "HermesToolParser", "Tool", "ToolCall", "ToolError",
    "ToolRequest", "calls_from_forced_output", "chat_message", "finish_reason_for", "forced_schema",
    "get_tool_parser", "guided_decoding", "new_call_id", "output_parser", "parse_tools",
    "template_messages",
]

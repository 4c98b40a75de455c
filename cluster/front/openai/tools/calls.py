"""A tool call as the response carries it: ``ToolCall``, its id, the chat ``message`` and the
finish reason that calls give. Every parser returns ``ToolCall``s, so the response is the same
whichever parser read the output."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from .request import NAMED, ToolRequest


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

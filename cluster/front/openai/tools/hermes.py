"""The Hermes/Qwen tool call parser (``--tool-call-parser hermes``), whole and streamed.

The output is optional content, then one or more
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks. The content is the text
before the first block, and any later text between or after blocks that is not only whitespace.
A block whose JSON is not a call leaves the whole output as content, with no calls; a last block
left unclosed (the output stopped there) still counts when its JSON is complete.

Streamed, content goes out at once except a tail that may begin ``<tool_call>`` (held until
decided; ``finish`` flushes it as content); a call's name as soon as ``{"name": "...",
"arguments": `` is read, then its arguments as they come (a block written in another order goes
out whole when it closes). Streamed output cannot take back what it sent, so a call whose name
went out stays a call even if its block turns out malformed, where the whole parse would return
the text. A block found malformed before anything of it was sent goes out as content, with
everything after it: the whole parse's answer when it is the first block.
"""
from __future__ import annotations

from typing import Any

from .call_text import BodyStreamer, Deltas, call_from_body
from .calls import ToolCall, new_call_id

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


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
            call = call_from_body(text[body_start:] if end < 0 else text[body_start:end], "arguments")
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
        self._deltas = Deltas()
        self._pending = ""  # text not yet read: a possible start of a tag
        self._mode = "text"  # "text" | "call" | "plain" (after a malformed block: all content)
        self._segment = 0  # text pieces outside blocks: 0 before the first block
        self._piece = ""  # a later piece, held while it is only whitespace
        self._piece_live = False  # it is not: it is sent as it comes
        self._body: list[str] = []
        self._streamer: BodyStreamer | None = None
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
                self._streamer = BodyStreamer(self._deltas, "arguments")
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

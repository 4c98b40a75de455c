"""The text of one request as its tokens arrive (pure: the tokenizer's decode is passed in).

Two rules shape the deltas a client receives:
- A delta never ends inside a multi-byte character: while the text decodes to a trailing U+FFFD
  (an incomplete UTF-8 sequence from byte-level tokens), that tail waits for the next token.
- Stop strings, with OpenAI's semantics: generation ends at the first occurrence of any stop
  string in the generated text, and the text returned ends just before it. Text that could be
  the beginning of a stop string is held back until the next tokens show it is not, so a client
  never receives part of a stop string.

With ``include_stop`` (vLLM's include_stop_str_in_output) the text ends after the stop string
instead. Before ``min_tokens`` tokens arrived no stop string is looked for (vLLM's rule: the
text of those tokens is sent as it is).

Invariant: ``sent`` (characters handed out) only grows, and the concatenated deltas are always a
prefix of the final text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), *,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.tokens: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> str:
        """Add new tokens; returns the text that may be sent now. After a stop string is found,
        ``stopped`` is True and later pushes return nothing."""
        if self.stopped or not tokens:
            return ""
        self.tokens.extend(tokens)
        text = self.decode(self.tokens)
        matching = bool(self.stop) and len(self.tokens) >= self.min_tokens
        if matching:
            cut = self._first_stop(text)
            if cut is not None:
                self.stopped = True
                return self._take(text, cut)
        ready = len(text)
        while ready > self.sent and text[ready - 1] == REPLACEMENT:
            ready -= 1
        if matching:
            ready -= self._held_for_stop(text[:ready])
        return self._take(text, ready)

    def finish(self) -> str:
        """The rest of the text once the request has ended: nothing is held back any more."""
        if self.stopped:
            return ""
        text = self.decode(self.tokens)
        return self._take(text, len(text))

    def _take(self, text: str, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta = text[self.sent:upto]
        self.sent = upto
        return delta

    def _first_stop(self, text: str) -> int | None:
        # Text before `sent` holds no stop string and ends with no stop string's beginning
        # (both were checked when it was sent), so a match starts at `sent` or later.
        hits = [(i, len(s)) for i, s in ((text.find(s, self.sent), s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, length = min(hits)
        return at + length if self.include_stop else at

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest tail of ``text`` (after ``sent``) that begins a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

"""``pdserve bench serve --backend openai`` counts what a client sees in a streamed response
(bench/serve_replay.py ``OpenAIStreamCounter``), fed SSE lines here without a server.

A byte-level model can emit tokens that are an incomplete UTF-8 character; the server then holds
their text back, so a stream can carry no text at all before its finish chunk. Such a request
completed and had a first token: it must not be counted as failed.
"""
from __future__ import annotations

import json

import pytest

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.serve_replay import OpenAIStreamCounter


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n"


def completion_chunk(text, finish=None) -> bytes:
    return sse({"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def chat_chunk(delta, finish=None) -> bytes:
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def usage_chunk(completion_tokens: int, prompt_tokens: int = 7) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                         "total_tokens": prompt_tokens + completion_tokens}})


def count(endpoint: str, lines: list[bytes], *, max_tokens: int = 4) -> RequestRecord:
    rec = RequestRecord(index=0, arrival_s=0.0, prompt_len=7, max_tokens=max_tokens)
    counter = OpenAIStreamCounter(rec, endpoint)
    for i, line in enumerate([*lines, b"\n", b"data: [DONE]\n"]):
        counter.line(line, 0.1 * (i + 1))
    counter.close()
    return rec


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stream_with_no_text_before_its_finish_completed_with_a_first_token(endpoint):
    # pdserve's shape when every token was held back: (chat: the role chunk,) the finish chunk with
    # no text, the usage chunk.
    if endpoint == "chat":
        lines = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({}, "length"), usage_chunk(4)]
    else:
        lines = [completion_chunk("", "length"), usage_chunk(4)]
    rec = count(endpoint, lines)
    assert rec.ok, rec
    assert rec.num_tokens == 4
    finish_at = rec.finish_s
    assert rec.first_token_s == finish_at  # the output arrived with the finish chunk
    assert rec.deltas == [(finish_at, 4)]
    assert rec.tpot_ms == 0.0 and rec.itls_ms() == []


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_empty_text_chunks_are_token_arrivals(endpoint):
    # A server that sends a chunk per token, with the text of a split character held back.
    def chunk(text, finish=None):
        return chat_chunk({"content": text}, finish) if endpoint == "chat" else completion_chunk(text, finish)

    lines = [chunk(""), chunk(""), chunk("\u00e9"), chunk("x"), chunk("", "length"), usage_chunk(4)]
    if endpoint == "chat":
        lines.insert(0, chat_chunk({"role": "assistant", "content": ""}))
    rec = count(endpoint, lines)
    assert rec.ok
    first = 0.2 if endpoint == "chat" else 0.1  # after the role chunk, which is no token
    assert rec.first_token_s == pytest.approx(first)
    assert [n for _, n in rec.deltas] == [1, 1, 1, 1]
    assert rec.finish_s > rec.deltas[-1][0]


def test_text_chunks_count_as_before_and_the_last_takes_the_rest():
    # Two text chunks for four tokens (a multi-byte character held back over two tokens).
    rec = count("completions", [completion_chunk("a"), completion_chunk("\u00e9\u00e9"), completion_chunk("", "stop"),
                                usage_chunk(4)])
    assert rec.ok
    assert rec.first_token_s == pytest.approx(0.1)
    assert [n for _, n in rec.deltas] == [1, 3]
    assert rec.num_tokens == 4


def test_the_chat_role_chunk_is_not_the_first_token():
    rec = count("chat", [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "hi"}),
                         chat_chunk({}, "length"), usage_chunk(1)])
    assert rec.ok
    assert rec.first_token_s == pytest.approx(0.2)
    assert rec.deltas == [(pytest.approx(0.2), 1)]


@pytest.mark.parametrize("lines, error", [
    ([sse({"error": {"message": "boom", "type": "internal_error"}})], "stream error: boom"),
    ([completion_chunk("a"), completion_chunk("", "abort"), usage_chunk(1)], "finish_reason=abort"),
])
def test_errors_still_fail(lines, error):
    rec = count("completions", lines)
    assert not rec.ok
    assert rec.error == error


def test_a_stream_that_never_finished_failed():
    rec = count("completions", [completion_chunk(""), completion_chunk("")])
    assert rec.finish_s is None and not rec.ok

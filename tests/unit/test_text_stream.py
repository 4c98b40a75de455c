"""TextStream: streamed deltas never split a character or reveal part of a stop string, and the
text ends just before the first stop string (OpenAI's rule)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.cluster.text_stream import TextStream

PIECES = ["a", "b", "c", "ab", "ba", " ", "\n", "é"]


def piece_decode(ids):
    return "".join(PIECES[i] for i in ids)


def byte_decode(ids):
    """Byte-level tokens: token i is byte i; an unfinished UTF-8 sequence decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def run(stream: TextStream, batches):
    out = []
    for batch in batches:
        out.append(stream.push(batch))
        if stream.stopped:
            break
    out.append(stream.finish())
    return out


def test_multibyte_characters_are_never_split():
    ids = list("hé€!".encode())
    deltas = run(TextStream(byte_decode), [[i] for i in ids])
    assert "".join(deltas) == "hé€!"
    assert all("\ufffd" not in d for d in deltas)


def test_text_ends_before_the_stop_string_and_nothing_of_it_is_sent():
    stream = TextStream(piece_decode, stop=["b c"])
    deltas = run(stream, [[0], [3], [5], [2], [0], [1]])  # a, ab, " ", c -> "aab c" holds "b c"
    assert stream.stopped and "".join(deltas) == "aa"
    assert deltas[:2] == ["a", "a"]  # the "b" of "ab" waited: it might begin "b c"
    assert stream.tokens == [0, 3, 5, 2]  # tokens after the stop were never pushed


def test_held_text_is_released_when_it_is_not_a_stop_string():
    stream = TextStream(piece_decode, stop=["bc"])
    assert stream.push([1]) == ""  # "b" may begin "bc"
    assert stream.push([0]) == "ba"
    assert stream.push([1]) == ""
    assert stream.finish() == "b"  # the request ended: nothing is held any more


def test_stop_inside_one_token_and_several_stops():
    stream = TextStream(piece_decode, stop=["zz", "ab"])
    assert stream.push([2, 3, 0]) == "c" and stream.stopped


@given(st.lists(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=3), max_size=12),
       st.lists(st.text(alphabet="abc é", min_size=1, max_size=3), max_size=4))
def test_deltas_are_the_text_cut_at_the_first_stop(batches, stops):
    stream = TextStream(piece_decode, stop=stops)
    deltas = run(stream, batches)
    # Reference: the first push after which some stop string appears ends the text there.
    tokens, expected = [], None
    for batch in batches:
        tokens += batch
        text = piece_decode(tokens)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            expected = text[:min(hits)]
            break
    if expected is None:
        expected = piece_decode(tokens)
    assert "".join(deltas) == expected
    assert stream.stopped == any(s in piece_decode(tokens) for s in stops)
    sent = ""
    for d in deltas[:-1]:  # what was streamed before the end never shows the start of a stop
        sent += d
        assert not any(s in sent for s in stops)


@given(st.lists(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=3), min_size=1, max_size=12))
def test_include_stop_ends_the_text_after_the_stop_string(batches):
    """vLLM's include_stop_str_in_output: the same cut as without it, plus the stop string."""
    stop = ("ba", "\n")
    without = "".join(run(TextStream(piece_decode, stop), batches))
    stream = TextStream(piece_decode, stop, include_stop=True)
    with_stop = "".join(run(stream, batches))
    if stream.stopped:
        assert with_stop.startswith(without) and with_stop[len(without):] in stop
    else:
        assert with_stop == without


def test_no_stop_string_is_matched_before_min_tokens():
    """vLLM's rule: the text of the first min_tokens tokens is not searched for stop strings."""
    ids = [PIECES.index("a"), PIECES.index("\n"), PIECES.index("b"), PIECES.index("\n"), PIECES.index("c")]
    early = TextStream(piece_decode, ("\n",))
    assert "".join(run(early, [[t] for t in ids])) == "a"
    late = TextStream(piece_decode, ("\n",), min_tokens=3)
    assert "".join(run(late, [[t] for t in ids])) == "a\nb" and late.stopped

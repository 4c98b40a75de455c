"""The bundled traces: byte-identical to the published files, loaded by name from the package,
and any user trace file loaded by path (plain, .xz or .gz)."""
from __future__ import annotations

import gzip
import hashlib
import lzma
import re

import pytest

from pdserve.traces import bundled_trace_names, bundled_traces_dir, load_trace

ROWS = {"azure_llm_2023_code.csv": 8819, "azure_llm_2023_conv.csv": 19366,
        "mooncake_fast25_conversation.jsonl": 12031, "mooncake_fast25_synthetic.jsonl": 3993}


def test_bundled_traces_are_the_published_files():
    readme = (bundled_traces_dir() / "README.md").read_text()
    published = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    assert sorted(published) == bundled_trace_names() == sorted(ROWS)
    for name, digest in published.items():
        raw = lzma.decompress((bundled_traces_dir() / f"{name}.xz").read_bytes())
        assert hashlib.sha256(raw).hexdigest() == digest, name


@pytest.mark.parametrize("name", sorted(ROWS))
def test_bundled_traces_load_by_name(name):
    rows = load_trace(name)
    assert len(rows) == ROWS[name]
    assert rows[0].arrival_s == 0.0 and all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))
    assert all(r.input_len >= 1 and r.output_len >= 1 for r in rows)
    assert all(r.hash_ids for r in rows) == name.startswith("mooncake")
    assert load_trace(name + ".xz", limit=7) == rows[:7]


def test_a_user_trace_file_is_loaded_by_path_plain_or_compressed(tmp_path):
    csv_text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.1805900,0,3\n")
    (tmp_path / "mine.csv").write_text(csv_text)
    (tmp_path / "mine.csv.gz").write_bytes(gzip.compress(csv_text.encode()))
    jsonl = '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [4, 9]}\n\n' \
            '{"timestamp": 1500, "input_length": 10, "output_length": 1}\n'
    (tmp_path / "mine.jsonl.xz").write_bytes(lzma.compress(jsonl.encode()))
    plain, gz = load_trace(tmp_path / "mine.csv"), load_trace(str(tmp_path / "mine.csv.gz"))
    assert plain == gz and [(r.arrival_s, r.input_len, r.output_len) for r in plain] == [(0.0, 374, 44), (0.5, 1, 3)]
    mooncake = load_trace(tmp_path / "mine.jsonl.xz")
    assert [(r.arrival_s, r.input_len, r.hash_ids) for r in mooncake] == [(0.0, 600, (4, 9)), (0.5, 10, ())]


def test_unknown_traces_and_formats_are_named_in_the_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="'nope.csv' is neither a file nor a bundled trace.*azure_llm_2023_conv"):
        load_trace("nope.csv")
    (tmp_path / "trace.parquet").write_bytes(b"x")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path / "trace.parquet")

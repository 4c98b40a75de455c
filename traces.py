"""Production request traces (Azure LLM 2023 CSV, Mooncake FAST'25 JSONL) and length scaling.

Traces carry lengths and arrival times, not text. Prompts are synthesised: Azure rows get
deterministic pseudo-random token ids; Mooncake rows build each 512-token block from its hash id
so equal ids give equal blocks and a prefix cache sees the sharing the trace describes.

The four public traces ship xz-compressed inside the package (``data/traces/``, with their
provenance and licences in its README) and are loaded by name; any other trace file in one of the
two formats is loaded by path.
"""
from __future__ import annotations

import csv
import gzip
import importlib.resources
import io
import json
import lzma
import random
from dataclasses import dataclass
from datetime import datetime
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import IO

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # seconds since the first row of the trace
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


BUNDLED_SUFFIX = ".xz"


def bundled_traces_dir() -> Traversable:
    """The traces shipped inside the package (``pdserve/data/traces``), xz-compressed."""
    return importlib.resources.files("pdserve") / "data" / "traces"


def bundled_trace_names() -> list[str]:
    """Names ``load_trace`` accepts for the bundled traces (the file names without ``.xz``)."""
    return sorted(entry.name[: -len(BUNDLED_SUFFIX)] for entry in bundled_traces_dir().iterdir()
                  if entry.name.endswith(BUNDLED_SUFFIX))


def resolve_trace(name_or_path: str | Path) -> Path | Traversable:
    """A file the user names wins; otherwise a bundled trace by name (with or without ``.xz``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path)
    bundled = bundled_traces_dir() / (name if name.endswith(BUNDLED_SUFFIX) else name + BUNDLED_SUFFIX)
    if bundled.is_file():
        return bundled
    raise FileNotFoundError(f"trace {name!r} is neither a file nor a bundled trace "
                            f"(bundled: {', '.join(bundled_trace_names())})")


def _trace_format(name: str) -> tuple[str, str]:
    """(compression, format) from a file name such as ``x.csv``, ``x.jsonl.xz`` or ``x.csv.gz``."""
    compression = ""
    for suffix in (".xz", ".gz"):
        if name.endswith(suffix):
            compression, name = suffix, name[: -len(suffix)]
    for suffix, fmt in ((".csv", "azure"), (".jsonl", "mooncake"), (".json", "mooncake")):
        if name.endswith(suffix):
            return compression, fmt
    raise ValueError(f"unknown trace format for {name!r}: expected .csv (Azure) or .jsonl (Mooncake), "
                     "optionally .xz or .gz compressed")


def _open_text(source: Path | Traversable, compression: str) -> IO[str]:
    raw = source.open("rb")
    if compression == ".xz":
        return io.TextIOWrapper(lzma.open(raw), newline="")
    if compression == ".gz":
        return io.TextIOWrapper(gzip.open(raw), newline="")
    return io.TextIOWrapper(raw, newline="")


def load_trace(name_or_path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Rows of a bundled trace (by name) or of a trace file (Azure CSV or Mooncake JSONL)."""
    source = resolve_trace(name_or_path)
    compression, fmt = _trace_format(source.name)
    with _open_text(source, compression) as f:
        return _load_azure(f, limit) if fmt == "azure" else _load_mooncake(f, limit)


def _load_azure(f: IO[str], limit: int | None) -> list[TraceRequest]:
    rows: list[TraceRequest] = []
    t0: datetime | None = None
    for row in csv.DictReader(f):
        # Timestamps carry 7 fractional digits; datetime takes at most 6.
        stamp = row["TIMESTAMP"].strip()
        if "." in stamp:
            head, frac = stamp.split(".", 1)
            stamp = f"{head}.{frac[:6]}"
        t = datetime.fromisoformat(stamp)
        t0 = t0 or t
        rows.append(
            TraceRequest(
                arrival_s=(t - t0).total_seconds(),
                input_len=max(1, int(row["ContextTokens"])),
                output_len=max(1, int(row["GeneratedTokens"])),
            )
        )
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _load_mooncake(f: IO[str], limit: int | None) -> list[TraceRequest]:
    rows: list[TraceRequest] = []
    t0: float | None = None
    for line in f:
        if not line.strip():
            continue
        obj = json.loads(line)
        ts = float(obj["timestamp"]) / 1000.0
        t0 = ts if t0 is None else t0
        rows.append(
            TraceRequest(
                arrival_s=ts - t0,
                input_len=max(1, int(obj["input_length"])),
                output_len=max(1, int(obj["output_length"])),
                hash_ids=tuple(int(h) for h in obj.get("hash_ids", ())),
            )
        )
        if limit is not None and len(rows) >= limit:
            break
    return rows


@dataclass(frozen=True, slots=True)
class LengthScale:
    """Maps trace lengths into a model's limits: lengths are multiplied by ``factor`` and then
    clamped, so relative sizes survive while everything fits."""

    factor: float
    max_input_len: int
    max_output_len: int
    min_len: int = 1

    def input_len(self, n: int) -> int:
        return max(self.min_len, min(self.max_input_len, round(n * self.factor)))

    def output_len(self, n: int) -> int:
        return max(1, min(self.max_output_len, round(n * self.factor)))

    @property
    def block_tokens(self) -> int:
        """Tokens per Mooncake hash block after scaling (at least 1)."""
        return max(1, round(MOONCAKE_BLOCK_TOKENS * self.factor))


def fit_scale(
    requests: list[TraceRequest], max_input_len: int, max_output_len: int, quantile: float = 0.95
) -> LengthScale:
    """The factor that brings the given quantile of input lengths to ``max_input_len``
    (never scaling up)."""
    if not requests:
        return LengthScale(1.0, max_input_len, max_output_len)
    lens = sorted(r.input_len for r in requests)
    q = lens[min(len(lens) - 1, int(quantile * len(lens)))]
    return LengthScale(min(1.0, max_input_len / max(1, q)), max_input_len, max_output_len)


def synth_prompt(
    request: TraceRequest, index: int, scale: LengthScale, vocab: tuple[int, int], seed: int = 0
) -> list[int]:
    """Token ids for one trace row. ``vocab`` is the [low, high) id range to draw from.

    Mooncake rows: block i of the prompt is drawn from a generator seeded by hash_ids[i], so
    equal hash ids give equal blocks; the tail past the hashed blocks is unique to the row."""
    low, high = vocab
    n = scale.input_len(request.input_len)
    tokens: list[int] = []
    if request.hash_ids:
        bt = scale.block_tokens
        for h in request.hash_ids:
            if len(tokens) >= n:
                break
            rng = random.Random(f"block-{seed}-{h}")
            tokens.extend(rng.randrange(low, high) for _ in range(min(bt, n - len(tokens))))
    rng = random.Random(f"row-{seed}-{index}")
    tokens.extend(rng.randrange(low, high) for _ in range(n - len(tokens)))
    return tokens

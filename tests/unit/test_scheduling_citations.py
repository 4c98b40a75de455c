"""The code cites docs/scheduling.md by section ("scheduling.md 2.4", "scheduling.md 3.2-3.4"):
every cited section exists there, and no comment cites the behaviour reference or the design plan
that live outside the repository ("reference 2.4", "trtllm-scheduling.md", "DESIGN.md")."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("scheduler", "transport", "workers", "cluster", "bench", "benchmarks", "cli", "tests")
CITATION = re.compile(r"scheduling\.md (\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?")
STALE = re.compile(r"\breference (?:section )?\d|trtllm-scheduling|DESIGN\.md")


def _sources() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))
            if p.name != Path(__file__).name]


def _sections() -> set[str]:
    text = (ROOT / "docs" / "scheduling.md").read_text()
    return set(re.findall(r"^## (\d+(?:\.\d+)?) ", text, re.M))


def test_every_cited_section_exists():
    sections = _sections()
    assert {"1.1", "2.4", "2.9", "3.4", "4", "7.5"} <= sections
    missing, cited = [], 0
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in CITATION.finditer(line):
                for number in filter(None, match.groups()):
                    cited += 1
                    if number not in sections:
                        missing.append(f"{path.relative_to(ROOT)}:{n}: scheduling.md {number}")
    assert cited > 30
    assert not missing, "\n".join(missing)


def test_no_comment_cites_a_document_outside_the_repository():
    stale = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _sources()
             for n, line in enumerate(p.read_text().splitlines(), 1) if STALE.search(line)]
    assert not stale, "\n".join(stale)

"""The repository runs alone: no file a clone holds may point at the workspace folders that sit
beside this checkout during development (a clone does not have them)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Built from parts so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|\b" + "shared" + r"/(data|reference|DESIGN)")


def test_no_file_refers_to_the_workspace_beside_the_repository():
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True, timeout=60).stdout.split("\0")
    offenders = []
    for rel in filter(None, listed):
        path = REPO / rel
        if not path.is_file() or path.suffix in (".xz", ".png", ".svg", ".pdf"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)

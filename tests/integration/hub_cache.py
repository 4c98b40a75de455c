"""An offline Hugging Face Hub cache built by hand (not a test module): a local model directory
laid out as huggingface_hub lays out a download, so ``--model ORG/NAME`` can be tested without
a network. The layout (huggingface_hub's cache docs, and what ``file_download`` writes):

    <cache>/models--ORG--NAME/blobs/<etag>            the file's bytes, named by its etag:
                                                     sha256 for LFS files (the weights), the
                                                     git blob sha1 for the rest
    <cache>/models--ORG--NAME/refs/main               the commit hash, no newline
    <cache>/models--ORG--NAME/snapshots/<commit>/F    a relative symlink to ../../blobs/<etag>
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

LFS_SUFFIXES = (".safetensors",)


def _etag(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id


def add_to_hub_cache(model_dir: str | Path, repo_id: str, cache_dir: str | Path,
                     commit: str | None = None) -> Path:
    """Put the files of ``model_dir`` into ``cache_dir`` as snapshot ``commit`` (default: a
    hash of the files) of ``repo_id``, with refs/main naming it. Returns the snapshot folder."""
    model_dir, cache_dir = Path(model_dir), Path(cache_dir)
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    if commit is None:
        h = hashlib.sha1(repo_id.encode())
        for f in files:
            h.update(f.name.encode() + _etag(f).encode())
        commit = h.hexdigest()
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        etag = _etag(f)
        blob = repo / "blobs" / etag
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs" / "main").write_text(commit)  # huggingface_hub reads it verbatim
    return snapshot

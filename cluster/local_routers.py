"""The pdserve routers serving on this machine, so that a command can name them.

While it serves, each router actor keeps one small JSON file in a runtime folder
(``$PDSERVE_RUNTIME_DIR``, else ``$PDSERVE_CACHE/routers``, else ``~/.cache/pdserve/routers``):
its gRPC and HTTP addresses, the Ray cluster it runs on and its process id. ``pdserve shutdown
--port P`` lists them when nothing it can stop answers at P. A file whose process is gone is
stale (a router killed with its Ray cluster) and is removed when the folder is read.

Nothing here is trusted for a decision: the port itself is asked (the gRPC Shutdown call), the
files only help a person find the right one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RUNTIME_DIR_ENV = "PDSERVE_RUNTIME_DIR"


def runtime_dir() -> Path:
    if os.environ.get(RUNTIME_DIR_ENV):
        return Path(os.environ[RUNTIME_DIR_ENV])
    cache = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return cache / "routers"


def announce(entry: dict[str, Any], folder: Path | None = None) -> Path:
    """Write this router's entry (``pid`` is added); returns its file."""
    folder = folder or runtime_dir()
    folder.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    path = folder / f"router-{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**entry, "pid": pid}))
    tmp.replace(path)  # readers never see half a file
    return path


def withdraw(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def list_routers(folder: Path | None = None) -> list[dict[str, Any]]:
    """The entries of routers whose process is alive, sorted by gRPC address; stale files go."""
    folder = folder or runtime_dir()
    out = []
    for path in sorted(folder.glob("router-*.json")) if folder.is_dir() else []:
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            out.append(entry)
        else:
            withdraw(path)
    return sorted(out, key=lambda e: str(e.get("grpc", "")))


def describe(entries: list[dict[str, Any]]) -> str:
    """One line per router, for an error message."""
    if not entries:
        return f"no pdserve router is running on this machine (none is listed in {runtime_dir()})"
    lines = [f"  gRPC {e.get('grpc')}" + (f", HTTP {e['http']}" if e.get("http") else "")
             + f", Ray cluster {e.get('ray_address')} (pid {e.get('pid')})" for e in entries]
    return "the pdserve routers on this machine:\n" + "\n".join(lines)

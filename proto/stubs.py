"""Generating the Python gRPC stubs of proto/pdserve/v1/router.proto (stdlib only).

Two callers use this module:
- setup.py's build step generates the stubs into the wheel, so an installed pdserve imports them
  and never writes beside its own files. setup.py loads this file by path, before pdserve is
  installed, which is why it imports nothing from pdserve.
- pdserve.cluster.rpc generates them on first import in a source checkout (next to the .proto,
  git-ignored), or into a per-user cache folder when an installed package's stubs are missing or
  do not import with the installed grpcio/protobuf.

protoc runs with ``-I <proto root>`` so the descriptor keeps its canonical name
"pdserve/v1/router.proto" (what reflection serves). The ``_grpc`` module's absolute import of
``pdserve.v1.router_pb2`` is rewritten to a relative one, since the package lives at
``pdserve.proto.pdserve.v1``.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root
PROTO_REL = "pdserve/v1/router.proto"
PROTO_FILE = PROTO_ROOT / PROTO_REL
STUB_NAMES = ("router_pb2", "router_pb2_grpc")

_ABS_IMPORT = re.compile(r"^from pdserve\.v1 import (\w+_pb2) as ", re.MULTILINE)


def stub_paths(out_root: Path) -> list[Path]:
    folder = out_root / Path(PROTO_REL).parent
    return [folder / f"{name}.py" for name in STUB_NAMES]


def tools_version() -> str | None:
    """The installed grpcio-tools version, or None when it is not installed."""
    try:
        from grpc_tools.grpc_version import VERSION  # a constant; loads no protoc
    except ImportError:
        return None
    return VERSION


def stubs_are_current(proto_root: Path = PROTO_ROOT, out_root: Path | None = None) -> bool:
    """Both stubs exist, are no older than the .proto and were made by the installed
    grpcio-tools (stubs from another version may not match the installed runtime)."""
    proto_mtime = (proto_root / PROTO_REL).stat().st_mtime_ns
    paths = stub_paths(out_root or proto_root)
    try:
        if any(p.stat().st_mtime_ns < proto_mtime for p in paths):
            return False
        grpc_source = paths[1].read_text()
    except FileNotFoundError:
        return False
    version = tools_version()
    return version is None or f"GRPC_GENERATED_VERSION = '{version}'" in grpc_source


def generate(proto_root: Path, out_root: Path) -> None:
    """Run protoc on proto_root/PROTO_REL and place both stubs under out_root/pdserve/v1 by
    atomic rename (_pb2 first: a reader that sees the new _grpc module also sees its _pb2)."""
    folder = out_root / Path(PROTO_REL).parent
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".protoc-", dir=folder) as tmp:
        # A subprocess keeps grpc_tools' import hooks and protoc's output out of this process.
        result = subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_root}", f"--python_out={tmp}",
             f"--grpc_python_out={tmp}", PROTO_REL],
            capture_output=True, text=True, timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed on {proto_root / PROTO_REL}:\n{result.stderr}")
        generated = Path(tmp) / Path(PROTO_REL).parent
        grpc_module = generated / "router_pb2_grpc.py"
        grpc_module.write_text(_ABS_IMPORT.sub(r"from . import \1 as ", grpc_module.read_text()))
        for name in STUB_NAMES:
            os.replace(generated / f"{name}.py", folder / f"{name}.py")


def _lock_path(out_root: Path) -> Path:
    if out_root.resolve() != PROTO_ROOT:
        out_root.mkdir(parents=True, exist_ok=True)
        return out_root / ".pdserve-protoc.lock"
    # The package's own folder: lock outside it, so no untracked file appears in the repository.
    key = hashlib.sha1(str(PROTO_ROOT).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"pdserve-protoc-{os.getuid()}-{key}.lock"


class StubFolder(NamedTuple):
    folder: Path
    generated: bool  # False when current stubs were already there


def ensure_stubs(proto_root: Path = PROTO_ROOT, out_root: Path | None = None, *,
                 force: bool = False) -> StubFolder:
    """Generate the stubs under out_root (default: next to the .proto) unless current. An
    exclusive file lock makes concurrent processes (test workers, Ray actors) generate once."""
    out_root = out_root or proto_root
    folder = out_root / Path(PROTO_REL).parent
    if not force and stubs_are_current(proto_root, out_root):
        return StubFolder(folder, False)
    with open(_lock_path(out_root), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # Checked again under the lock: the process that held it may have just generated them.
            generated = force or not stubs_are_current(proto_root, out_root)
            if generated:
                generate(proto_root, out_root)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return StubFolder(folder, generated)


def cache_root() -> Path:
    """Per-user folder for the stubs of an installed package whose own stubs cannot be used,
    keyed by the .proto's content and the grpcio-tools version that will generate them."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha1(PROTO_FILE.read_bytes() + (tools_version() or "").encode()).hexdigest()[:16]
    return base / "pdserve" / f"proto-{digest}"


def is_source_checkout() -> bool:
    """True when this package is the repository itself (an editable install or PYTHONPATH): its
    root holds pyproject.toml. An installed wheel has no pyproject.toml inside the package."""
    return (PROTO_ROOT.parent / "pyproject.toml").is_file()

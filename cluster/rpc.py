"""The generated gRPC stubs for proto/pdserve/v1/router.proto, built on import.

router_pb2.py and router_pb2_grpc.py are build outputs (git-ignored). Importing this module runs
grpc_tools.protoc (from grpcio-tools) when they are missing or older than the .proto, then exposes
``router_pb2`` and ``router_pb2_grpc``. Generation is guarded by an exclusive file lock and lands by
atomic rename, so concurrent processes (parallel test workers, several Ray actors) never see a
half-written stub. protoc runs with ``-I proto`` so the descriptor keeps its canonical name
"pdserve/v1/router.proto" (what reflection serves); the ``_grpc`` module's absolute import of
``pdserve.v1.router_pb2`` is then rewritten to a relative one, since the package lives at
``pdserve.proto.pdserve.v1``. With $PDSERVE_STUB_DIR set, or when the package folder is read-only
(a non-editable install), the stubs go to that folder (default: a per-user cache folder) and are
loaded from there under the same module names.

Also here: the proto <-> policies conversions the router needs (``spec_from_proto``).
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from .policies import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRIORITY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    GenerateSpec,
)

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"  # the -I root
PROTO_REL = "pdserve/v1/router.proto"
PROTO_FILE = PROTO_ROOT / PROTO_REL
STUB_PACKAGE = "pdserve.proto.pdserve.v1"
STUB_NAMES = ("router_pb2", "router_pb2_grpc")
ROUTER_SERVICE_NAME = "pdserve.v1.Router"
STUB_DIR_ENV = "PDSERVE_STUB_DIR"  # optional: generate and load the stubs there instead

_ABS_IMPORT = re.compile(r"^from pdserve\.v1 import (\w+_pb2) as ", re.MULTILINE)


def _stub_paths(out_root: Path) -> list[Path]:
    folder = out_root / Path(PROTO_REL).parent
    return [folder / f"{name}.py" for name in STUB_NAMES]


def _tools_version() -> str | None:
    try:
        from grpc_tools.grpc_version import VERSION  # a constant; loads no protoc
    except ImportError:
        return None
    return VERSION


def stubs_are_current(proto_root: Path = PROTO_ROOT, out_root: Path | None = None) -> bool:
    """Both stubs exist, are no older than the .proto and were made by the installed
    grpcio-tools (stubs from another version may not match the installed runtime)."""
    proto_mtime = (proto_root / PROTO_REL).stat().st_mtime_ns
    paths = _stub_paths(out_root or proto_root)
    try:
        if any(p.stat().st_mtime_ns < proto_mtime for p in paths):
            return False
        grpc_source = paths[1].read_text()
    except FileNotFoundError:
        return False
    version = _tools_version()
    return version is None or f"GRPC_GENERATED_VERSION = '{version}'" in grpc_source


def _lock_path(out_root: Path) -> Path:
    if out_root.resolve() != PROTO_ROOT:
        out_root.mkdir(parents=True, exist_ok=True)
        return out_root / ".pdserve-protoc.lock"
    # The package's own folder: lock outside it, so no untracked file appears in the repository.
    key = hashlib.sha1(str(PROTO_ROOT).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"pdserve-protoc-{os.getuid()}-{key}.lock"


def _generate(proto_root: Path, out_root: Path) -> None:
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
        # _pb2 first: a reader that sees the new _grpc module also sees its _pb2.
        for name in STUB_NAMES:
            os.replace(generated / f"{name}.py", folder / f"{name}.py")


class StubFolder(NamedTuple):
    folder: Path
    generated: bool  # False when current stubs were already there


def ensure_stubs(proto_root: Path = PROTO_ROOT, out_root: Path | None = None, *,
                 force: bool = False) -> StubFolder:
    """Generate the stubs under out_root (default: next to the .proto) unless current."""
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
                _generate(proto_root, out_root)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return StubFolder(folder, generated)


def _external_out_root() -> Path | None:
    """$PDSERVE_STUB_DIR if set; else None when the package folder is writable; else a per-user
    cache folder keyed by the .proto's content."""
    if os.environ.get(STUB_DIR_ENV):
        return Path(os.environ[STUB_DIR_ENV])
    if os.access(PROTO_FILE.parent, os.W_OK) or stubs_are_current():
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha1(PROTO_FILE.read_bytes()).hexdigest()[:16]
    return base / "pdserve" / f"proto-{digest}"


def _load_from(folder: Path, name: str) -> ModuleType:
    full = f"{STUB_PACKAGE}.{name}"
    if full in sys.modules:
        return sys.modules[full]
    spec = importlib.util.spec_from_file_location(full, folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        raise
    return module


def _load_stubs() -> tuple[ModuleType, ModuleType]:
    out_root = _external_out_root()
    if out_root is None:
        ensure_stubs()
        modules = [importlib.import_module(f"{STUB_PACKAGE}.{name}") for name in STUB_NAMES]
        return modules[0], modules[1]
    folder = ensure_stubs(PROTO_ROOT, out_root).folder
    importlib.import_module(STUB_PACKAGE)  # the parent package, for the relative import
    modules = [_load_from(folder, name) for name in STUB_NAMES]
    return modules[0], modules[1]


router_pb2, router_pb2_grpc = _load_stubs()


# ---- conversions --------------------------------------------------------------------------------

def spec_from_proto(request: router_pb2.GenerateRequest) -> GenerateSpec:  # type: ignore[name-defined]
    """Plain values with the API defaults for unset optional fields; validate the result with
    policies.validate_generate_spec."""
    sampling = request.sampling
    prompt = request.WhichOneof("prompt")
    return GenerateSpec(
        request_id=request.request_id if request.HasField("request_id") else None,
        text=request.text if prompt == "text" else None,
        token_ids=tuple(request.token_ids.ids) if prompt == "token_ids" else None,
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=sampling.temperature if sampling.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=sampling.top_p if sampling.HasField("top_p") else DEFAULT_TOP_P,
        top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        priority=request.priority if request.HasField("priority") else DEFAULT_PRIORITY,
        agent_hierarchy=tuple((level.agent_type, level.node_id) for level in request.agent_hierarchy),
        disaggregation=int(request.disaggregation),
        deadline_ms=request.deadline_ms if request.HasField("deadline_ms") else None,
    )


__all__ = [
    "PROTO_FILE",
    "ROUTER_SERVICE_NAME",
    "STUB_DIR_ENV",
    "StubFolder",
    "ensure_stubs",
    "router_pb2",
    "router_pb2_grpc",
    "spec_from_proto",
    "stubs_are_current",
]

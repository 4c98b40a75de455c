"""The generated gRPC stubs for proto/pdserve/v1/router.proto (``router_pb2``,
``router_pb2_grpc``), shared by the gRPC front door (``cluster/front/grpc``) and the clients
(``cluster/client.py``, ``pdserve top``, ``bench serve``).

Where the stubs come from (generation itself is pdserve.proto.stubs):
- $PDSERVE_STUB_DIR set: generated into that folder and loaded from there.
- A source checkout (editable install): generated on first import next to the .proto when missing
  or stale (git-ignored), then imported as ``pdserve.proto.pdserve.v1.router_pb2[_grpc]``.
- An installed package: the stubs built into the wheel. When they are missing or do not import
  with the installed grpcio/protobuf (a wheel built against newer ones), they are generated with
  the installed grpcio-tools into a per-user cache folder; never next to the installed files.
Stubs loaded from a folder other than the package's get the same module names.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from pdserve.proto.stubs import (
    PROTO_FILE,
    PROTO_REL,
    STUB_NAMES,
    StubFolder,
    cache_root,
    ensure_stubs,
    is_source_checkout,
    stubs_are_current,
)

STUB_PACKAGE = "pdserve.proto.pdserve.v1"
ROUTER_SERVICE_NAME = "pdserve.v1.Router"
STUB_DIR_ENV = "PDSERVE_STUB_DIR"  # optional: generate and load the stubs there instead


def _forget_stubs() -> None:
    for name in STUB_NAMES:
        sys.modules.pop(f"{STUB_PACKAGE}.{name}", None)


def _import_packaged() -> tuple[ModuleType, ModuleType]:
    try:
        pb2, grpc_mod = (importlib.import_module(f"{STUB_PACKAGE}.{name}") for name in STUB_NAMES)
    except BaseException:
        _forget_stubs()  # a _pb2 that imported must not pair with stubs loaded later
        raise
    return pb2, grpc_mod


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


def _load_generated(out_root: Path) -> tuple[ModuleType, ModuleType]:
    folder = ensure_stubs(out_root=out_root).folder
    importlib.import_module(STUB_PACKAGE)  # the parent package, for the _grpc module's relative import
    pb2, grpc_mod = (_load_from(folder, name) for name in STUB_NAMES)
    return pb2, grpc_mod


def _load_stubs() -> tuple[ModuleType, ModuleType]:
    if os.environ.get(STUB_DIR_ENV):
        return _load_generated(Path(os.environ[STUB_DIR_ENV]))
    if is_source_checkout():
        ensure_stubs()
        return _import_packaged()
    try:
        return _import_packaged()
    except Exception as exc:  # missing, or built for another grpcio/protobuf than the installed one
        try:
            return _load_generated(cache_root())
        except Exception as again:
            raise RuntimeError(f"pdserve's gRPC stubs did not import ({exc!r}) and could not be "
                               f"generated into {cache_root()}") from again


router_pb2, router_pb2_grpc = _load_stubs()


__all__ = [
    "PROTO_FILE",
    "PROTO_REL",
    "ROUTER_SERVICE_NAME",
    "STUB_DIR_ENV",
    "StubFolder",
    "ensure_stubs",
    "router_pb2",
    "router_pb2_grpc",
    "stubs_are_current",
]

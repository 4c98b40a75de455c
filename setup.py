"""Build hook: generate the gRPC stubs into the wheel, so an installed pdserve imports them and
never writes beside its own files. Everything else about the build is in pyproject.toml.

An editable install skips this: in a source checkout pdserve.cluster.rpc generates the stubs on
first import, next to the .proto (git-ignored)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _stubs_module():
    # Loaded by path: pdserve is not importable while it is being built.
    spec = importlib.util.spec_from_file_location("_pdserve_build_stubs", HERE / "proto" / "stubs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def find_package_modules(self, package, package_dir):
        # The package root is the repository root (package-dir "pdserve" = "."): this file lives
        # there but is not part of pdserve.
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("pdserve", "setup")]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        stubs = _stubs_module()
        # Always regenerated: a stub copied from the source tree may come from other grpcio-tools.
        stubs.generate(stubs.PROTO_ROOT, Path(self.build_lib) / "pdserve" / "proto")


setup(cmdclass={"build_py": BuildPyWithStubs})

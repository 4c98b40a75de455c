"""pdserve as a user gets it, not as this checkout runs it:

- the wheel holds the package, the .proto, its generated stubs and the bundled traces, and no tests;
- it holds every product module of bench/ and no experiment script of benchmarks/ (the split
  docs/design.md describes; tests/unit/test_benchmarks_folder.py checks the sources);
- installed from that wheel into a fresh virtualenv (non-editable) and run from another directory,
  the CLI works: make-tiny-model, demo-scheduler, launch + generate + status + shutdown, demo;
  `pdserve bench` (serve --help, and plot of a recorded run) and `pdserve simulate` (a 40-request
  run); and the installed package never writes beside its own files;
- a copy of the repository with nothing beside it (no workspace folders around a clone) runs the
  trace-dependent parts.

The fresh virtualenv gets its dependencies (torch, Ray, grpcio, ...) from this test run's own
site-packages through a .pth line, so nothing is downloaded; pdserve itself comes only from the
wheel (a .pth line adds a folder to sys.path without running that folder's own .pth files, so the
development install's import hook is not loaded).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import launch_generate_status_shutdown  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUNDLED_TRACES = ("azure_llm_2023_code.csv", "azure_llm_2023_conv.csv",
                  "mooncake_fast25_conversation.jsonl", "mooncake_fast25_synthetic.jsonl")
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1",
       "PYTHONDONTWRITEBYTECODE": "1"}
ENV.pop("PYTHONPATH", None)


def repository_files(root: Path) -> list[str]:
    """What a clone of the repository holds (tracked files, plus new files not ignored, so the
    test also sees work not yet committed)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True, check=True, timeout=60)
    return sorted(f for f in out.stdout.split("\0") if f and (root / f).is_file())


def copy_repository(dest: Path) -> Path:
    for rel in repository_files(REPO):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    return dest


def run(argv: list[str], *, cwd: Path, env: dict[str, str] = ENV, timeout: float = 300):
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = copy_repository(tmp_path_factory.mktemp("src") / "pdserve")
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: setuptools and grpcio-tools come from this environment, not PyPI.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(src)], cwd=src)
    (built,) = out.glob("pdserve-*.whl")
    return built


def test_wheel_holds_the_proto_stubs_and_traces_and_no_tests(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("pdserve/__init__.py", "pdserve/__main__.py", "pdserve/cli/main.py",
                 "pdserve/proto/stubs.py", "pdserve/proto/pdserve/v1/router.proto",
                 "pdserve/proto/pdserve/v1/router_pb2.py", "pdserve/proto/pdserve/v1/router_pb2_grpc.py",
                 "pdserve/data/traces/README.md"):
        assert name in names, name
    for trace in BUNDLED_TRACES:
        assert f"pdserve/data/traces/{trace}.xz" in names
    assert not [n for n in names if n.startswith("pdserve/data/traces/") and n.endswith((".csv", ".jsonl"))]
    assert not [n for n in names if "tests/" in n or "/test_" in n or n.startswith("tests")]
    assert "pdserve/setup.py" not in names
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".lock"))]
    grpc_stub = zipfile.ZipFile(wheel).read("pdserve/proto/pdserve/v1/router_pb2_grpc.py").decode()
    assert "from . import router_pb2 as" in grpc_stub
    entry_points = zipfile.ZipFile(wheel).read("pdserve-0.1.0.dist-info/entry_points.txt").decode()
    assert "pdserve = pdserve.cli.main:main" in entry_points


def test_wheel_holds_the_bench_tools_and_no_experiment_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    product = sorted(p.name for p in (REPO / "bench").glob("*.py"))
    scripts = sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))
    assert "sizing.py" in product and "vs_vllm.py" in scripts
    assert [f"pdserve/bench/{n}" for n in product if f"pdserve/bench/{n}" not in names] == []
    # Neither the folder (under any name) nor a moved script slipped back into pdserve/bench/.
    assert not [n for n in names if "benchmarks/" in n]
    assert not [n for n in names if n.startswith("pdserve/bench/") and n.rsplit("/", 1)[1] in scripts]
    assert set(scripts).isdisjoint(product)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed (non-editable); returns its bin folder."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv)
    purelib = run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  cwd=venv).stdout.strip()
    Path(purelib, "_pdserve_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        cwd=venv)
    return venv / "bin"


def test_installed_wheel_runs_the_cli_from_another_directory(installed, tmp_path):
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PDSERVE_CACHE": str(tmp_path / "cache" / "pdserve")}
    python, pdserve = str(installed / "python"), str(installed / "pdserve")

    where = run([python, "-c", "import pdserve, pdserve.cluster.rpc as r, pdserve.traces as t; "
                 "print(pdserve.__file__); print(r.router_pb2_grpc.__file__); print(','.join(t.bundled_trace_names()))"],
                cwd=workdir, env=env).stdout.split()
    package = Path(where[0]).parent
    assert package.parent == Path(installed.parent, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}",
                                  "site-packages")
    assert Path(where[1]) == package / "proto" / "pdserve" / "v1" / "router_pb2_grpc.py"  # the wheel's own stubs
    assert where[2].split(",") == sorted(BUNDLED_TRACES)
    files_before = sorted(p for p in package.rglob("*"))

    assert "demo-scheduler" in run([python, "-m", "pdserve", "--help"], cwd=workdir, env=env).stdout
    run([pdserve, "make-tiny-model", str(workdir / "tiny")], cwd=workdir, env=env)
    assert (workdir / "tiny" / "model.safetensors").is_file() and (workdir / "tiny" / "tokenizer.json").is_file()
    replay = run([pdserve, "demo-scheduler", "--num-requests", "40", "--table-rows", "1"], cwd=workdir, env=env)
    for policy in ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"):
        assert policy in replay.stdout

    launch_generate_status_shutdown([pdserve], env, workdir)

    demo = run([pdserve, "demo", "--num-requests", "8", "--concurrency", "4"], cwd=workdir, env=env, timeout=480)
    assert "8 / 8 / 0" in demo.stdout, demo.stdout[-3000:]  # sent / completed / failed
    # It says where KV transfers and pauses are on the Ray dashboard, and how to log in.
    assert "ray get-auth-token" in demo.stdout and "Task Table" in demo.stdout, demo.stdout[-3000:]
    assert "pdserve-gen-0 -> Log" in demo.stdout, demo.stdout[-3000:]

    # An installed package writes nothing beside its own files, and its own stubs served every
    # process (no fallback generation into the per-user cache).
    assert sorted(p for p in package.rglob("*")) == files_before
    assert not list((tmp_path / "cache").glob("pdserve/proto-*"))


def test_installed_wheel_runs_bench_and_simulate(installed, tmp_path):
    """What stayed in the package after the experiments moved out runs from the wheel alone:
    every module `pdserve bench` and `pdserve simulate` import is in it."""
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PDSERVE_CACHE": str(tmp_path / "cache" / "pdserve"),
           "MPLCONFIGDIR": str(tmp_path / "mpl")}
    pdserve = str(installed / "pdserve")

    assert "--backend" in run([pdserve, "bench", "serve", "--help"], cwd=workdir, env=env).stdout
    assert "search" in run([pdserve, "simulate", "--help"], cwd=workdir, env=env).stdout
    # bench's report and figures, without a cluster: the PNGs again from a recorded serve run.
    run([pdserve, "bench", "plot", str(REPO / "docs" / "results" / "bench_serve_1p1d.json"),
         "--out-dir", str(workdir / "figs")], cwd=workdir, env=env)
    assert sorted(p.name for p in (workdir / "figs").glob("*.png")), "bench plot drew nothing"
    # The simulator end to end on a bundled trace (well under a second of work).
    run([pdserve, "simulate", "run", "--model", "llama-3-8b", "--gpu", "H100", "--layouts", "1P1D",
         "--num-requests", "40", "--json", str(workdir / "sim.json")], cwd=workdir, env=env)
    summary = json.loads((workdir / "sim.json").read_text())["summaries"]["1P1D"]
    assert summary["requests"] == summary["completed"] == 40 and summary["failed"] == 0


def test_a_copy_of_the_repository_alone_runs_the_trace_dependent_parts(tmp_path):
    """A clone with no workspace folders beside it: the traces come from the repository."""
    root = copy_repository(tmp_path / "alone" / "pdserve")
    assert sorted(p.name for p in root.parent.iterdir()) == ["pdserve"]
    env = {**ENV, "PYTHONPATH": str(root.parent)}
    loaded = run([sys.executable, "-c",
                  "import pdserve; from pdserve.traces import bundled_trace_names, load_trace; "
                  "print(pdserve.__file__); print({n: len(load_trace(n)) for n in bundled_trace_names()})"],
                 cwd=root, env=env).stdout.splitlines()
    assert Path(loaded[0]) == root / "__init__.py"  # the copy, not this checkout
    assert loaded[1] == str({"azure_llm_2023_code.csv": 8819, "azure_llm_2023_conv.csv": 19366,
                             "mooncake_fast25_conversation.jsonl": 12031, "mooncake_fast25_synthetic.jsonl": 3993})
    replay = run([sys.executable, "-m", "pdserve", "demo-scheduler", "--num-requests", "60", "--table-rows", "1"],
                 cwd=root, env=env)
    assert "Summary" in replay.stdout and "MAX_UTILIZATION" in replay.stdout

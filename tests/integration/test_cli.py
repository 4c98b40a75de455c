"""The command line as users type it: `pdserve launch` in the foreground, then `generate`,
`status` and `shutdown` from other processes."""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys

PDSERVE = [sys.executable, "-m", "pdserve.cluster.cli"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_launch_generate_status_shutdown(tmp_path):
    port = _free_port()
    log = open(tmp_path / "launch.log", "w")
    launch = subprocess.Popen(
        [*PDSERVE, "launch", "--port", str(port), "--tokens-per-block", "8", "--num-kv-blocks", "128",
         "--capacity-scheduler-policy", "MAX_UTILIZATION"],
        stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    try:
        ready, _, _ = select.select([launch.stdout], [], [], 240)
        assert ready, (tmp_path / "launch.log").read_text()[-3000:]
        info = json.loads(launch.stdout.readline())
        assert info["grpc"] == f"127.0.0.1:{port}" and info["workers"] == ["ctx-0", "gen-0"]

        out = _run("generate", "--port", str(port), "--prompt", "hello there", "--max-tokens", "6",
                   "--temperature", "0", "--ignore-eos")
        assert out.returncode == 0, out.stderr
        assert "finish=length tokens=6" in out.stdout and "ctx=ctx-0 gen=gen-0" in out.stdout

        bad = _run("generate", "--port", str(port), "--token-ids", "1,2,3", "--top-p", "1.5")
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "sampling.top_p" in bad.stderr

        status = _run("status", "--port", str(port), "--json")
        assert status.returncode == 0, status.stderr
        workers = {w["workerId"]: w for w in json.loads(status.stdout)["workers"]}
        assert set(workers) == {"ctx-0", "gen-0"}

        down = _run("shutdown", "--address", info["ray_address"])
        assert down.returncode == 0, down.stderr
        assert "pdserve-router" in down.stdout and "pdserve-gen-0" in down.stdout
        assert launch.wait(timeout=120) == 0  # launch notices its router is gone and exits
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)

"""Several pdserve clusters on one host: `pdserve shutdown --port P` stops the cluster whose router
serves P, and nothing of the other.

Two `pdserve launch` processes at a time, each with its own embedded Ray cluster (one router on a
random port, as the demo takes it, the other on a fixed one behind an API key). Each kind is
stopped by its port alone, in both orders, while the other one serves a steady stream of requests;
the other's requests all complete and it stays healthy. One test, three launches: the keyed
cluster serves while the first random-port one stops, then is itself stopped while a second
random-port one serves. A port where no router answers gets an error that lists the routers on
this host with their ports and Ray addresses; a wrong key gets the same error as `pdserve status`
gives."""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import free_port  # noqa: E402

from pdserve import Client  # noqa: E402

PDSERVE = [sys.executable, "-m", "pdserve"]
KEY = "pdk-shutdown-by-port-7Hq2Lm"
START_TIMEOUT_S = 300


def _env(runtime: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEY", "RAY_ADDRESS")}
    # Both clusters list themselves in the same folder (and only this test's clusters are there).
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1",
            "PDSERVE_RUNTIME_DIR": str(runtime)}


class Launched:
    def __init__(self, name: str, args: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*PDSERVE, "launch", *args], stdout=subprocess.PIPE, stderr=log,
                                         text=True, env=env, cwd=workdir)
        self.info: dict = {}

    def ready(self) -> None:
        readable, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        assert readable, f"{self.name} did not start:\n{self.log.read_text()[-3000:]}"
        line = self.proc.stdout.readline()
        assert line, f"{self.name} exited:\n{self.log.read_text()[-3000:]}"
        self.info = json.loads(line)

    @property
    def port(self) -> int:
        return int(self.info["grpc"].rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def _run(args: list[str], env: dict[str, str], workdir: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, *args], capture_output=True, text=True, env=env, cwd=workdir,
                          timeout=timeout)


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


class SteadyLoad:
    """Requests one after another on a cluster until stopped; each one's start, end and result."""

    def __init__(self, port: int, api_key: str | None) -> None:
        self.client = Client(f"127.0.0.1:{port}", api_key=api_key, timeout_s=120)
        self.done: list[tuple[float, float, int, str]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                out = self.client.generate([5, 6, 7, 8, 9, 10, 11, 12], max_tokens=24, temperature=0,
                                           ignore_eos=True)
                self.done.append((start, time.monotonic(), len(out.token_ids), out.finish_reason))
            except Exception as exc:  # recorded: the test fails on any
                self.errors.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=180)
        self.client.close()


def _check_listing_and_keys(pair: list[Launched], fixed: int, env: dict[str, str], workdir: Path) -> None:
    """Two clusters up, one of them the keyed one on ``fixed``: a port where no router answers and
    a wrong key stop nothing."""
    assert pair[0].info["ray_address"] != pair[1].info["ray_address"]
    # A port where no router answers: nothing is stopped, and the routers here are listed.
    nobody = _run(["shutdown", "--port", str(free_port())], env, workdir)
    assert nobody.returncode == 2, nobody.stderr
    assert "no pdserve router answers" in nobody.stderr
    for c in pair:
        assert c.info["grpc"] in nobody.stderr and c.info["ray_address"] in nobody.stderr

    # A wrong key: the same error as every other command gives.
    wrong = _run(["shutdown", "--port", str(fixed), "--api-key", "pdk-wrong-key"], env, workdir)
    status = _run(["status", "--port", str(fixed), "--api-key", "pdk-wrong-key"], env, workdir)
    assert wrong.returncode == status.returncode == 1
    assert wrong.stderr.startswith("error: UNAUTHENTICATED:") and wrong.stderr == status.stderr
    assert all(c.proc.poll() is None for c in pair)  # nothing was stopped


def _stop_one_while_the_other_serves(victim: Launched, survivor: Launched, keys: dict[str, str | None],
                                     env: dict[str, str], workdir: Path) -> None:
    """`pdserve shutdown --port` of ``victim`` while ``survivor`` serves a steady stream: the
    survivor's requests all complete, it stays healthy, and only it is listed afterwards."""
    load = SteadyLoad(survivor.port, keys[survivor.name])
    try:
        while not load.done and not load.errors:
            time.sleep(0.05)
        asked = time.monotonic()
        args = ["shutdown", "--port", str(victim.port)]
        if keys[victim.name]:
            args += ["--api-key", keys[victim.name]]
        out = _run(args, env, workdir)
        stopped = time.monotonic()
        assert out.returncode == 0, out.stderr
        assert victim.info["ray_address"] in out.stdout
        assert "pdserve-ctx-0, pdserve-gen-0, pdserve-router" in out.stdout
        assert "has stopped" in out.stdout
        # The victim's launch leaves with its router and stops the Ray cluster it started.
        assert victim.proc.wait(timeout=120) == 0, victim.log.read_text()[-3000:]
        deadline = time.monotonic() + 60
        while _accepts(victim.info["ray_address"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _accepts(victim.info["ray_address"]), "the victim's Ray GCS still listens"
        time.sleep(1.0)  # the survivor keeps serving after the victim is gone
    finally:
        load.finish()
    assert not load.errors, load.errors
    assert all(n == 24 and reason == "length" for _, _, n, reason in load.done)
    assert any(start < stopped and end > asked for start, end, _, _ in load.done), \
        "no request was in flight while the other cluster was stopped"
    assert any(start > stopped for start, _, _, _ in load.done)
    assert survivor.proc.poll() is None

    health = _run(["status", "--port", str(survivor.port), "--json"]
                  + (["--api-key", keys[survivor.name]] if keys[survivor.name] else []), env, workdir)
    assert health.returncode == 0, health.stderr
    assert all(w["healthy"] for w in json.loads(health.stdout)["workers"])

    # Only the survivor is listed now.
    nobody = _run(["shutdown", "--port", str(victim.port)], env, workdir)
    assert nobody.returncode == 2 and survivor.info["grpc"] in nobody.stderr
    assert victim.info["grpc"] not in nobody.stderr.split("the pdserve routers on this machine:")[-1]


def test_each_cluster_is_stopped_by_its_port_alone(tmp_path):
    """Both orders with three launches (each a cold start of Ray and its workers), two up at a
    time: the random-port cluster is stopped while the keyed one serves, then a second random-port
    cluster comes up, the keyed one is stopped while it serves, and it goes last."""
    runtime = tmp_path / "runtime"
    env = _env(runtime)
    key_file = tmp_path / "keys"
    key_file.write_text(KEY + "\n")
    engine = ["--tokens-per-block", "16", "--num-kv-blocks", "64"]
    fixed = free_port()
    keys = {"random-port": None, "keyed": KEY, "random-port-2": None}
    first = Launched("random-port", ["--port", "0", *engine], env, tmp_path)
    keyed = Launched("keyed", ["--port", str(fixed), "--api-key-file", str(key_file), *engine], env, tmp_path)
    launched = [first, keyed]
    try:
        for c in launched:
            c.ready()
        assert keyed.port == fixed
        _check_listing_and_keys([first, keyed], fixed, env, tmp_path)
        # The random-port cluster first, while the keyed one serves.
        _stop_one_while_the_other_serves(first, keyed, keys, env, tmp_path)

        second = Launched("random-port-2", ["--port", "0", *engine], env, tmp_path)
        launched.append(second)
        second.ready()
        _check_listing_and_keys([keyed, second], fixed, env, tmp_path)
        # Then the keyed one (stopped with its key), while a random-port one serves.
        _stop_one_while_the_other_serves(keyed, second, keys, env, tmp_path)

        # The last one goes the same way (no key).
        out = _run(["shutdown", "--port", str(second.port)], env, tmp_path)
        assert out.returncode == 0, out.stderr
        assert second.proc.wait(timeout=120) == 0, second.log.read_text()[-3000:]
    finally:
        for c in launched:
            c.kill()

"""The command line as users type it (not a test module): `pdserve launch` in the foreground,
then `generate`, `status` and `shutdown` from other processes. Used with the development
install (test_cli.py) and with a wheel installed into a fresh virtualenv (test_packaging.py)."""
from __future__ import annotations

import json
import random
import select
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the cluster's own listeners (stores,
    channels, KV links) bind port 0 and get ephemeral ports, so they can never take it between
    this check and the router binding it (an ephemeral free port could be, and once was)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


API_KEY = "pdk-cli-session-5Gm8Nc2Vb"  # must appear in no output and no log


def launch_generate_status_shutdown(pdserve: list[str], env: dict[str, str], workdir: Path,
                                    model: str | None = None, model_dir: Path | None = None) -> None:
    """Runs the whole session with the ``pdserve`` command line ``pdserve`` (an argv prefix),
    every process started in ``workdir``; asserts what a user would check by eye. The router
    requires an API key (from a key file); clients pass it by flag or by PDSERVE_API_KEY.

    ``model``: launched with ``--model model`` (else the built-in model); the launch must report
    it, resolved to ``model_dir``, and the OpenAI door must list it and serve requests naming it."""
    env = {k: v for k, v in env.items() if k != "PDSERVE_API_KEY"}
    outputs: list[str] = []

    def run(*args: str, timeout: float = 120, key_env: bool = False) -> subprocess.CompletedProcess:
        out = subprocess.run([*pdserve, *args], capture_output=True, text=True, timeout=timeout,
                             env={**env, "PDSERVE_API_KEY": API_KEY} if key_env else env, cwd=workdir)
        outputs.append(out.stdout + out.stderr)
        return out

    port, http_port = free_port(), free_port()
    log_path = workdir / "launch.log"
    key_file = workdir / "api-keys"
    key_file.write_text(f"# the CLI session's key\n{API_KEY}\n")
    with open(log_path, "w") as log:
        launch = subprocess.Popen(
            [*pdserve, "launch", "--port", str(port), "--http-port", str(http_port), "--tokens-per-block", "8",
             "--num-kv-blocks", "128", "--capacity-scheduler-policy", "MAX_UTILIZATION",
             "--api-key-file", str(key_file), *(["--model", model] if model else [])],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=workdir)
    try:
        ready, _, _ = select.select([launch.stdout], [], [], 240)
        assert ready, log_path.read_text()[-3000:]
        line = launch.stdout.readline()
        assert line, log_path.read_text()[-3000:]
        info = json.loads(line)
        assert info["grpc"] == f"127.0.0.1:{port}" and info["workers"] == ["ctx-0", "gen-0"]
        assert info["http"] == f"127.0.0.1:{http_port}"
        assert info["security"] == {"api_keys": 1, "admin_api_keys": 0, "tls": False, "mutual_tls": False,
                                    "max_inflight_per_key": None, "warnings": []}
        outputs.append(line)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        if model:
            assert info["model"] == model and info["model_dir"] == str(model_dir)
            models = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/models", headers=auth)
            with urllib.request.urlopen(models, timeout=60) as resp:
                assert [m["id"] for m in json.loads(resp.read())["data"]] == [model]  # as vLLM
        # The OpenAI-compatible door, as the README's curl line uses it.
        body = json.dumps({"prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                           **({"model": model} if model else {})})
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=120)
            raise AssertionError("a request without the API key was served")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401 and json.loads(exc.read())["error"]["code"] == "invalid_api_key"
        request.add_header("Authorization", auth["Authorization"])
        with urllib.request.urlopen(request, timeout=120) as resp:
            completion = json.loads(resp.read())
        assert completion["usage"]["completion_tokens"] == 4 and completion["choices"][0]["finish_reason"] == "length"
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=30) as resp:
            assert resp.status == 200

        out = run("generate", "--port", str(port), "--prompt", "hello there", "--max-tokens", "6",
                  "--temperature", "0", "--ignore-eos", "--api-key", API_KEY)
        assert out.returncode == 0, out.stderr
        assert "finish=length tokens=6" in out.stdout and "ctx=ctx-0 gen=gen-0" in out.stdout

        bad = run("generate", "--port", str(port), "--token-ids", "1,2,3", "--top-p", "1.5", key_env=True)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "sampling.top_p" in bad.stderr
        keyless = run("generate", "--port", str(port), "--token-ids", "1,2,3")
        assert keyless.returncode == 1 and "UNAUTHENTICATED" in keyless.stderr

        status = run("status", "--port", str(port), "--json", key_env=True)
        assert status.returncode == 0, status.stderr
        workers = {w["workerId"]: w for w in json.loads(status.stdout)["workers"]}
        assert set(workers) == {"ctx-0", "gen-0"}

        status_doc = json.loads(status.stdout)
        assert status_doc["maxInputLen"] > 0 and status_doc["maxPromptBytes"] > 0  # limits shown
        assert all(w["maxSeqLen"] > 0 and w["maxNumTokens"] > 0 for w in workers.values())
        # The model as launched (a Hub name stays one, not its snapshot folder), at the dtype
        # its float32 checkpoint runs at on CPU.
        assert {(w["model"], w["dtype"]) for w in workers.values()} == {
            (model or info["model_dir"], "float32")}
        assert status_doc["security"]["apiKeys"] == 1 and status_doc["security"]["warnings"] == []

        wrong = run("shutdown", "--address", info["ray_address"], "--port", str(port + 1))
        assert wrong.returncode == 2 and f"serves port {port}" in wrong.stderr  # nothing killed
        down = run("shutdown", "--address", info["ray_address"], "--port", str(port))
        assert down.returncode == 0, down.stderr
        assert "pdserve-router" in down.stdout and "pdserve-gen-0" in down.stdout
        assert launch.wait(timeout=120) == 0  # launch notices its router is gone and exits
        for text in [log_path.read_text(), *outputs]:
            assert API_KEY not in text
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)

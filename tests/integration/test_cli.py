"""The command line as users type it, through ``python -m pdserve``: `pdserve launch` in the
foreground, then `generate`, `status` and `shutdown` from other processes.

The launch serves a model by its Hub name, `--model org/tiny`, from an offline Hugging Face cache
built here (HF_HUB_OFFLINE=1, HF_HOME and HF_HUB_CACHE pointed at it, and no org/tiny folder in
the working directory): the launch resolves the name for the router, each Ray worker resolves it
from its own cache, and the HTTP door serves it as "org/tiny". One launch covers both (each is a
cold start of Ray and its workers); the built-in model's launch is test_packaging's session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import launch_generate_status_shutdown  # noqa: E402
from hub_cache import add_to_hub_cache  # noqa: E402

from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

PDSERVE = [sys.executable, "-m", "pdserve"]
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}


def test_python_dash_m_pdserve_is_the_pdserve_script():
    script = Path(sys.executable).with_name("pdserve")
    by_module = subprocess.run([*PDSERVE, "--help"], capture_output=True, text=True, timeout=60)
    by_script = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert by_module.returncode == by_script.returncode == 0, by_module.stderr + by_script.stderr
    assert by_module.stdout == by_script.stdout and "launch" in by_module.stdout
    unknown = subprocess.run([*PDSERVE, "no-such-command"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'no-such-command'" in unknown.stderr


def test_launch_generate_status_shutdown_of_a_model_by_hub_name(tmp_path):
    tiny = make_tiny_model(tmp_path / "src" / "tiny", seed=11)
    hf_home = tmp_path / "hf"
    snapshot = add_to_hub_cache(tiny, "org/tiny", hf_home / "hub")
    work = tmp_path / "work"  # no org/tiny directory here: the name must go through the cache
    work.mkdir()
    env = {k: v for k, v in ENV.items() if k not in ("RAY_ADDRESS", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"),
               PDSERVE_RUNTIME_DIR=str(tmp_path / "runtime"))
    launch_generate_status_shutdown(PDSERVE, env, work, model="org/tiny", model_dir=snapshot)


def test_bad_security_flags_are_refused_before_anything_starts(tmp_path):
    """Each error names its flag; nothing is started (no Ray: these return at once)."""
    cert = tmp_path / "cert.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot really\n-----END CERTIFICATE-----\n")
    cases = [
        (["launch", "--tls-cert", str(cert)], "--tls-cert: given without --tls-key"),
        (["launch", "--tls-client-ca", str(cert)], "--tls-client-ca: mutual TLS needs"),
        (["launch", "--tls-cert", str(cert), "--tls-key", str(tmp_path / "none.key")], "--tls-key: cannot read"),
        (["launch", "--api-key-file", str(tmp_path / "missing")], "--api-key-file: cannot read"),
        (["launch", "--api-key", "two words"], "--api-key: a key must be visible ASCII"),
        (["launch", "--max-inflight-per-key", "2"], "max_inflight_per_key: needs API keys"),
        (["launch", "--admin-api-key-file", str(tmp_path / "missing")], "--admin-api-key-file: cannot read"),
        (["launch", "--admin-api-key", "two words"], "--admin-api-key: a key must be visible ASCII"),
        (["launch", "--api-key", "pdk-same", "--admin-api-key", "pdk-same"],
         "admin_api_keys: 1 key(s) also given as API keys"),
        (["shutdown", "--port", "1", "--admin-api-key", "two words"], "--admin-api-key: a key must be visible"),
        (["generate", "--host", "http://127.0.0.1", "--tls-ca", str(cert), "--prompt", "x"], "plaintext target"),
    ]
    for args, message in cases:
        out = subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=60, env=ENV, cwd=tmp_path)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert "two words" not in out.stderr

"""The command line as users type it, through ``python -m pdserve``: `pdserve launch` in the
foreground, then `generate`, `status` and `shutdown` from other processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import launch_generate_status_shutdown  # noqa: E402

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


def test_launch_generate_status_shutdown(tmp_path):
    launch_generate_status_shutdown(PDSERVE, ENV, tmp_path)

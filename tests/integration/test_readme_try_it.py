"""The README's "Try it" section, run as a newcomer runs it: the `sh` block line by line (launch
in the background, then generate, the curl to the OpenAI door and shutdown), the inline
`pdserve status` and `pdserve.Client` lines while the cluster is up, and the offline `LLM`
example. Only what cannot be literal changes: `.venv/bin/pdserve` is this interpreter's
`python -m pdserve`, the ports are free ones, and the model path is the built-in tiny model."""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def _sh_lines(text: str) -> list[str]:
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def test_the_readme_try_it_section_runs_as_written(tmp_path):
    section = _section("Try it")
    lines = _sh_lines(section)
    assert lines[0].startswith(".venv/bin/pdserve launch ") and "--port 50051" in lines[0]
    assert any(line.startswith("curl ") for line in lines)
    assert lines[-1].startswith(".venv/bin/pdserve shutdown --port 50051")
    port, http_port = free_port(), free_port()

    def local(line: str) -> str:
        line = line.replace(".venv/bin/pdserve", f"{sys.executable} -m pdserve")
        return line.replace("50051", str(port)).replace("8000", str(http_port))

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1",
           "PDSERVE_RUNTIME_DIR": str(tmp_path / "runtime")}
    env.pop("PDSERVE_API_KEY", None)
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        launch = subprocess.Popen(local(lines[0]), shell=True, stdout=subprocess.PIPE, stderr=log,
                                  text=True, env=env, cwd=tmp_path)
    try:
        ready, _, _ = select.select([launch.stdout], [], [], 300)
        assert ready, log_path.read_text()[-3000:]
        info = json.loads(launch.stdout.readline())
        assert info["grpc"] == f"127.0.0.1:{port}" and info["http"] == f"127.0.0.1:{http_port}"

        outputs = {}
        for line in lines[1:-1]:
            out = subprocess.run(local(line), shell=True, capture_output=True, text=True, env=env,
                                 cwd=tmp_path, timeout=180)
            assert out.returncode == 0, (line, out.stdout, out.stderr)
            outputs[line.split()[0] if not line.startswith(".venv") else line.split()[1]] = out.stdout
        assert "[finish=" in outputs["generate"] and "gen=gen-0" in outputs["generate"]
        completion = json.loads(outputs["curl"])
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] > 0

        # The inline lines of the same section, while the cluster is up.
        status = re.search(r"`(pdserve status --port 50051)`", section).group(1)
        out = subprocess.run(local(status).replace("pdserve status", f"{sys.executable} -m pdserve status"),
                             shell=True, capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0 and "gen-0" in out.stdout, out.stderr
        client_line = re.search(r"`(pdserve\.Client\([^`]*\))`", section).group(1)
        code = f"import pdserve\nout = {local(client_line)}\nprint(out.finish_reason, len(out.token_ids))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        reason, n = out.stdout.split()
        assert reason in ("length", "stop") and 0 < int(n) <= 16

        down = subprocess.run(local(lines[-1]), shell=True, capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=180)
        assert down.returncode == 0, down.stderr
        assert "has stopped" in down.stdout
        assert launch.wait(timeout=120) == 0, log_path.read_text()[-3000:]  # "launch then exits"
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)


def test_the_readme_offline_example_runs_on_the_builtin_model(tmp_path):
    from pdserve.cluster.launch import builtin_model_dir

    example = re.search(r"```python\n(from pdserve import LLM.*?)```", README, re.S).group(1)
    assert '"path/to/hf-model"' in example
    code = example.replace('"path/to/hf-model"', repr(str(builtin_model_dir())))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()  # the generated text

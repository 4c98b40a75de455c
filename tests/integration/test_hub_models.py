"""Models by Hub name and stored dtypes, end to end.

- `pdserve launch --model org/tiny` from an offline Hugging Face cache built here (HF_HUB_OFFLINE=1,
  HF_HOME and HF_HUB_CACHE pointed at it): the launch resolves the name for the router, each Ray
  worker resolves it from its own cache, the HTTP door serves it as "org/tiny", and `pdserve
  generate` streams tokens. One launch.
- A bfloat16 checkpoint loads as bfloat16 (auto dtype), its tensors copied as stored, and
  generates what the float32 checkpoint cast to bfloat16 generates.
- A checkpoint split into two shards (model.safetensors.index.json) loads, one file open at a
  time, exactly as the single file does.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_session import free_port  # noqa: E402
from hub_cache import add_to_hub_cache  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.workers import loader  # noqa: E402
from pdserve.workers.loader import checkpoint_bytes, load_model  # noqa: E402
from pdserve.workers.tiny_model import make_tiny_model  # noqa: E402

PDSERVE = [sys.executable, "-m", "pdserve"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["hello there", "a paged KV cache"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=11)


def _generate(model, **engine) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=32, tokens_per_block=8, **engine)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_launch_serves_a_model_by_hub_name_from_an_offline_cache(tiny, tmp_path):
    hf_home = tmp_path / "hf"
    snapshot = add_to_hub_cache(tiny, "org/tiny", hf_home / "hub")
    work = tmp_path / "work"  # no org/tiny directory here: the name must go through the cache
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_API_KEY", "RAY_ADDRESS", "HUGGINGFACE_HUB_CACHE")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"),
               PDSERVE_RUNTIME_DIR=str(tmp_path / "runtime"))
    port, http_port = free_port(), free_port()
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        launch = subprocess.Popen(
            [*PDSERVE, "launch", "--model", "org/tiny", "--port", str(port), "--http-port",
             str(http_port), "--tokens-per-block", "8", "--num-kv-blocks", "64"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=work)
    try:
        ready, _, _ = select.select([launch.stdout], [], [], 240)
        assert ready, log_path.read_text()[-3000:]
        line = launch.stdout.readline()
        assert line, log_path.read_text()[-3000:]
        info = json.loads(line)
        assert info["model"] == "org/tiny" and info["model_dir"] == str(snapshot)
        assert info["workers"] == ["ctx-0", "gen-0"]

        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=60) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["org/tiny"]  # as vLLM
        body = json.dumps({"model": "org/tiny", "prompt": "hello there", "max_tokens": 4,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4

        out = subprocess.run([*PDSERVE, "generate", "--port", str(port), "--prompt", "hello there",
                              "--max-tokens", "6", "--temperature", "0", "--ignore-eos"],
                             capture_output=True, text=True, timeout=120, env=env, cwd=work)
        assert out.returncode == 0, out.stderr
        assert "finish=length tokens=6" in out.stdout and "ctx=ctx-0 gen=gen-0" in out.stdout

        down = subprocess.run([*PDSERVE, "shutdown", "--port", str(port)], capture_output=True,
                              text=True, timeout=120, env=env, cwd=work)
        assert down.returncode == 0, down.stderr
        assert launch.wait(timeout=120) == 0
    finally:
        if launch.poll() is None:
            launch.terminate()  # launch stops its cluster and its Ray on SIGTERM
            try:
                launch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait(timeout=30)


def test_a_bfloat16_checkpoint_loads_as_stored_and_generates(tiny, tmp_path, monkeypatch):
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in tiny.iterdir():
        (bf16 / f.name).write_bytes(f.read_bytes())
    stored = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny / "model.safetensors")).items()}
    save_file(stored, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))

    seen: list[torch.dtype] = []
    iter_tensors = loader._iter_tensors

    def spy(files):  # what reaches the parameters' copy_: the stored tensors, never upcast
        for name, tensor in iter_tensors(files):
            seen.append(tensor.dtype)
            yield name, tensor

    monkeypatch.setattr(loader, "_iter_tensors", spy)
    lm = load_model(bf16)  # auto, on CPU
    assert set(seen) == {torch.bfloat16}
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    targets = lm.model.weight_targets()
    assert all(torch.equal(targets[name], t) for name, t in stored.items())
    assert checkpoint_bytes(bf16, torch.bfloat16) == checkpoint_bytes(tiny, torch.float32) // 2

    tokens = _generate(str(bf16))
    assert all(len(t) == GREEDY.max_tokens for t in tokens)
    # the float32 checkpoint asked for as bfloat16 has the same weights, so the same tokens
    assert tokens == _generate(str(tiny), dtype="bfloat16")


def test_a_sharded_checkpoint_loads_like_the_single_file(tiny, tmp_path, monkeypatch):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            (sharded / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in members})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    assert checkpoint_bytes(sharded, torch.float32) == checkpoint_bytes(tiny, torch.float32) == total

    open_now, most_open = [0], [0]
    real_safe_open = loader.safe_open

    class CountingSafeOpen:  # one shard open at a time
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            open_now[0] += 1
            most_open[0] = max(most_open[0], open_now[0])
            return self.inner.__enter__()

        def __exit__(self, *exc):
            open_now[0] -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(loader, "safe_open", CountingSafeOpen)
    a, b = load_model(tiny), load_model(sharded)
    assert most_open[0] == 1 and open_now[0] == 0
    ta, tb = a.model.weight_targets(), b.model.weight_targets()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert _generate(b) == _generate(a)

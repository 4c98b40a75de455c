"""Models by Hub name and stored dtypes.

- `pdserve launch --model org/tiny` from an offline Hugging Face cache, end to end: that launch is
  test_cli.py's session (one cold start of Ray and its workers serves both).
- A bfloat16 checkpoint loads as bfloat16 (auto dtype), its tensors copied as stored, and
  generates what the float32 checkpoint cast to bfloat16 generates.
- A checkpoint split into two shards (model.safetensors.index.json) loads, one file open at a
  time, exactly as the single file does.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.workers.loading import loader
from pdserve.workers.loading.loader import checkpoint_bytes, load_model
from pdserve.workers.loading.tiny_model import make_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = ["hello there", "a paged KV cache"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=11)


def _generate(model, **engine) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=32, tokens_per_block=8, **engine)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


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

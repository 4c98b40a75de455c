"""MoE blocks under tensor parallelism on this machine: gloo, float32, random weights.

Two layouts (workers/model/moe.py): expert-tensor-parallel (the default: every rank holds every
expert, each expert's width split) and expert-parallel (``enable_expert_parallel``: whole experts
split over the ranks). Checked here:

- Qwen3-MoE (hub per-expert checkpoint) and Mixtral (a transformers-5 fused checkpoint) through
  ``LLM(tensor_parallel_size=2)``: greedy tokens equal to one rank's and logprobs within 1e-4,
  in both layouts;
- gpt-oss's and DeepSeek-V3's MoE blocks (and DeepSeek's dense MLP) alone, in two gloo ranks
  against one: their attention is not split here, so the full models are not compared;
- a rank's layout (meta device, no group): E / size experts under expert parallelism, half
  the width otherwise; a size that does not divide the experts is refused, naming the numbers;
- a rank reads only its share of every expert tensor, fused or not (counted at the reads);
  gpt-oss's MXFP4 experts, dequantised whole, leave the rank its slice.
"""
from __future__ import annotations

import collections
import datetime
import json
import multiprocessing as mp
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from test_tensor_parallel import assert_same, run

from pdserve.workers.loading import loader
from pdserve.workers.loading.loader import load_config, load_model
from pdserve.workers.loading.tiny_model import make_tiny_model
from pdserve.workers.model import build_model
from pdserve.workers.model.moe import SparseMoE, softmax_topk
from pdserve.workers.model.parallel import Shard, TensorParallel, TPShapeError
from pdserve.workers.model.weights import LazyTensor

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MP = mp.get_context("spawn")
_EXPERT = re.compile(r"^(?P<layer>.*\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<w>\w+)\.weight$")
FUSED_NAMES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def fuse_experts(model_dir: Path) -> Path:
    """Rewrite the checkpoint as transformers 5 saves it: each layer's experts fused into
    ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], and
    Mixtral's block named ``mlp``."""
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = collections.defaultdict(dict)
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m:
            experts[m["layer"]][int(m["e"]), FUSED_NAMES[m["w"]]] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer, w in experts.items():
        E = 1 + max(e for e, _ in w)
        out[layer + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[e, "gate"], w[e, "up"]]) for e in range(E)])
        out[layer + "mlp.experts.down_proj"] = torch.stack([w[e, "down"] for e in range(E)])
    save_file(out, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tp_moe")
    common = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=301, seed=5)
    return {
        "qwen3_moe": make_tiny_model(tmp / "qwen3_moe", arch="qwen3_moe", **common),
        "mixtral": fuse_experts(make_tiny_model(tmp / "mixtral", arch="mixtral", **common)),
        "gpt_oss": make_tiny_model(tmp / "gpt_oss", arch="gpt_oss", **common),
        "deepseek_v3": fuse_experts(make_tiny_model(tmp / "deepseek_v3", arch="deepseek_v3",
                                                    **{**common, "num_kv_heads": 4})),
    }


# ----------------------------------------------------------------- full models

_TP1: dict[str, list] = {}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tp2_matches_tp1(models, arch: str, expert_parallel: bool) -> None:
    d = models[arch]
    if arch not in _TP1:
        _TP1[arch] = run(d)
    assert_same(_TP1[arch], run(d, tensor_parallel_size=2, enable_expert_parallel=expert_parallel))


# ----------------------------------------------------------------- layouts


def _meta(model_dir: Path, tp: TensorParallel):
    with torch.device("meta"):
        return build_model(load_config(model_dir), dtype=torch.float32, device="meta", tp=tp)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_rank_layout(models, arch: str) -> None:
    one = _meta(models[arch], TensorParallel())
    ep = _meta(models[arch], TensorParallel(rank=1, size=2, expert_parallel=True))
    etp = _meta(models[arch], TensorParallel(rank=1, size=2))
    moe = [i for i, layer in enumerate(one.layers) if isinstance(layer.mlp, SparseMoE)]
    assert moe
    for i in moe:
        full, e, w = one.layers[i].mlp, ep.layers[i].mlp, etp.layers[i].mlp
        E, I, H = full.num_experts, full.intermediate, full.hidden_size
        assert e.expert_range == (E // 2, E)  # rank 1: the second half of the experts, whole
        assert e.gate_up_weight.shape == (E // 2, 2 * I, H) and e.down_weight.shape == (E // 2, H, I)
        assert w.gate_up_weight.shape == (E, I, H) and w.down_weight.shape == (E, H, I // 2)
        for m in (e, w):  # the router whole on every rank
            assert m.router_weight.shape == full.router_weight.shape
        if full.shared_experts is not None:  # split by width in both layouts
            for m in (e, w):
                assert m.shared_experts.gate_up_weight.shape[0] == full.shared_experts.gate_up_weight.shape[0] // 2
                assert m.shared_experts.reduce is False
        # Every checkpoint name is still a target (other ranks' experts read nothing), with
        # the checkpoint's shapes.
        t1, te, tw = (m.weight_targets("p.") for m in (full, e, w))
        assert set(t1) == set(te) == set(tw)
        for name, target in te.items():
            shape = target.checkpoint_shape() if isinstance(target, Shard) else tuple(target.shape)
            assert shape == tuple(t1[name].shape), name
        if arch != "gpt_oss":  # per-expert names (gpt-oss's are fused: one Shard of dim 0)
            names = full.names
            assert te[f"p.experts.0.{names.gate}.weight"].stop == 0
            assert te[f"p.experts.{E - 1}.{names.gate}.weight"].stop == I
    if arch == "deepseek_v3":  # the dense layer is split too
        assert etp.layers[0].mlp.down_weight.shape[1] == one.layers[0].mlp.down_weight.shape[1] // 2


def test_expert_parallel_refuses_a_size_that_does_not_divide_the_experts(tmp_path) -> None:
    route = lambda logits: softmax_topk(logits, 2, renormalize=True)  # noqa: E731
    with pytest.raises(TPShapeError, match=r"tensor parallel size 3 does not divide 8 experts "
                                           r"\(--enable-expert-parallel\)"):
        SparseMoE(16, 12, 8, route=route, dtype=torch.float32, device="meta",
                  tp=TensorParallel(rank=0, size=3, expert_parallel=True))
    # Split by width, the experts' intermediate size must divide instead.
    with pytest.raises(TPShapeError, match="tensor parallel size 3 does not divide 8 MoE expert intermediate"):
        SparseMoE(16, 8, 6, route=route, dtype=torch.float32, device="meta", tp=TensorParallel(rank=0, size=3))
    # A whole model that splits over 3 ranks by width (6 heads, 3 KV heads, width 96) but
    # not by experts (4).
    d = make_tiny_model(tmp_path, arch="mixtral", hidden_size=48, num_heads=6, num_kv_heads=3)
    _meta(d, TensorParallel(rank=2, size=3))
    with pytest.raises(TPShapeError, match=r"tensor parallel size 3 does not divide 4 experts \(--enable"):
        _meta(d, TensorParallel(rank=2, size=3, expert_parallel=True))


# ----------------------------------------------------------------- what a rank reads


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_rank_reads_only_its_share(models, monkeypatch, arch: str, expert_parallel: bool) -> None:
    """Rank 1 of 2 reads half of every expert tensor (per-expert, fused, gpt-oss's), the router
    whole, and holds exactly the matching slices of the unsharded model."""
    names: dict[int, str] = {}
    reads: collections.Counter = collections.Counter()
    iterate, load = loader._iter_tensors, LazyTensor.load

    def recording_iter(files):
        for name, t in iterate(files):
            names[id(t._handle)] = name
            yield name, t

    def recording_load(self):
        out = load(self)
        reads[names[id(self._handle)]] += out.numel()
        return out

    monkeypatch.setattr(loader, "_iter_tensors", recording_iter)
    monkeypatch.setattr(LazyTensor, "load", recording_load)
    d = models[arch]
    full = load_model(d).model
    stored = {name: t.numel() for name, t in load_file(str(d / "model.safetensors")).items()}
    assert reads == stored  # one rank reads everything, once
    reads.clear()
    rank = load_model(d, tp=TensorParallel(1, 2, expert_parallel=expert_parallel)).model
    expert_names = [n for n in stored if ".experts." in n]
    assert expert_names
    for n in expert_names:
        m = re.search(r"\.experts\.(\d+)\.", n)
        if m and expert_parallel:  # one expert's tensor: all of it on its rank, none elsewhere
            E = next(layer.mlp.num_experts for layer in full.layers if isinstance(layer.mlp, SparseMoE))
            assert reads[n] == (stored[n] if int(m[1]) >= E // 2 else 0), n
        elif arch == "gpt_oss" and n.endswith("down_proj_bias") and not expert_parallel:
            assert reads[n] == 0  # rank 0 adds the down biases
        else:  # half the width, or half the experts of a fused tensor
            assert reads[n] == stored[n] // 2, n
    for n in stored:
        if n.endswith(("mlp.gate.weight", "router.weight", "router.bias", "e_score_correction_bias")):
            assert reads[n] == stored[n], n
    for i, layer in enumerate(full.layers):
        a, b = layer.mlp, rank.layers[i].mlp
        if not isinstance(a, SparseMoE):
            continue
        assert torch.equal(a.router_weight, b.router_weight)
        E, I = a.num_experts, a.intermediate
        if expert_parallel:
            assert torch.equal(b.gate_up_weight, a.gate_up_weight[E // 2:])
            assert torch.equal(b.down_weight, a.down_weight[E // 2:])
        elif arch == "gpt_oss":  # interleaved gate/up: rank 1's units are rows [I, 2I)
            assert torch.equal(b.gate_up_weight, a.gate_up_weight[:, I:])
            assert torch.equal(b.gate_up_bias, a.gate_up_bias[:, I:])
            assert torch.equal(b.down_weight, a.down_weight[:, :, I // 2:])
            assert not b.down_bias.any()
        else:
            h = I // 2
            assert torch.equal(b.gate_up_weight[:, :h], a.gate_up_weight[:, h:I])  # gate
            assert torch.equal(b.gate_up_weight[:, h:], a.gate_up_weight[:, I + h:])  # up
            assert torch.equal(b.down_weight, a.down_weight[:, :, h:])


# ----------------------------------------------------------------- gpt-oss and DeepSeek blocks

BLOCK_CASES = [(arch, ep) for arch in ("gpt_oss", "deepseek_v3") for ep in (False, True)]
BLOCK_TOKENS = 23


def block_input(hidden: int) -> torch.Tensor:
    # Large enough that the experts' outputs are O(0.1-1) and gpt-oss's clamp is reached.
    return torch.randn(BLOCK_TOKENS, hidden, generator=torch.Generator().manual_seed(11)) * 4


def _block_rank(rank: int, store_path: str, cases: list[tuple[str, str, bool]], out: str) -> None:
    """One rank of two: each case's model (this rank's shard, its attention replicated) and
    every layer's MLP block on the same input."""
    torch.set_num_threads(1)
    pg = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, datetime.timedelta(seconds=60))
    results: dict[str, list[torch.Tensor]] = {}
    for name, model_dir, ep in cases:
        lm = load_model(model_dir, tp=TensorParallel(rank, 2, pg, expert_parallel=ep)).model
        x = block_input(lm.config.hidden_size)
        with torch.inference_mode():
            results[name] = [layer.mlp(x.clone()) for layer in lm.layers]
    torch.save(results, out)


@pytest.fixture(scope="module")
def block_outputs(models, tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp_blocks")
    cases = [(f"{arch}-ep{int(ep)}", str(models[arch]), ep) for arch, ep in BLOCK_CASES]
    procs = [MP.Process(target=_block_rank, args=(r, str(tmp / "store"), cases, str(tmp / f"rank{r}.pt")))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {r: torch.load(tmp / f"rank{r}.pt") for r in range(2)}


@pytest.mark.parametrize("arch,expert_parallel", BLOCK_CASES,
                         ids=[f"{a}-ep-{'on' if ep else 'off'}" for a, ep in BLOCK_CASES])
def test_moe_block_tp2_matches_tp1(models, block_outputs, arch: str, expert_parallel: bool) -> None:
    lm = load_model(models[arch]).model
    x = block_input(lm.config.hidden_size)
    name = f"{arch}-ep{int(expert_parallel)}"
    with torch.inference_mode():
        want = [layer.mlp(x.clone()) for layer in lm.layers]
    assert any(isinstance(layer.mlp, SparseMoE) for layer in lm.layers)
    for rank in range(2):
        for got, ref in zip(block_outputs[rank][name], want, strict=True):
            assert ref.abs().max() > 0.05  # a real signal, not one near zero
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["ep-off", "ep-on"])
def test_gpt_oss_mxfp4_experts_are_sliced_per_rank(models, tmp_path, expert_parallel: bool) -> None:
    """MXFP4 expert tensors are dequantised whole (a 32-value block spans the split), then the
    rank keeps its slice: the same values as the unsharded model's."""
    src = models["gpt_oss"]
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(2)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, k, n = tensors.pop(name).shape  # [E, in, out]: blocks quantise along `in`
        tensors[name + "_blocks"] = torch.randint(0, 256, (E, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(118, 128, (E, n, k // 32), generator=gen, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    full = load_model(tmp_path).model
    rank = load_model(tmp_path, tp=TensorParallel(1, 2, expert_parallel=expert_parallel)).model
    for a, b in ((x.mlp, y.mlp) for x, y in zip(full.layers, rank.layers)):
        E, I = a.num_experts, a.intermediate
        if expert_parallel:
            assert torch.equal(b.gate_up_weight, a.gate_up_weight[E // 2:])
            assert torch.equal(b.down_weight, a.down_weight[E // 2:])
        else:
            assert torch.equal(b.gate_up_weight, a.gate_up_weight[:, I:])
            assert torch.equal(b.down_weight, a.down_weight[:, :, I // 2:])

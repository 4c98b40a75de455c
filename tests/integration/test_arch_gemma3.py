"""Gemma 3 (text) against transformers' Gemma3ForCausalLM, in fp32 on small random models.

Local (sliding window 5, shorter than the prompts) and global layers interleave, each kind with
its own RoPE base; (1 + w) norms, sandwich norms, q/k norms, the scaled embedding, the
query_pre_attn_scalar softmax scale and final logit soft-capping all matter. Checked through the
paged forward (prefill, chunks, mixed batches), the in-process engine (chunked prefill, prefix
reuse, pauses), a 1P1D split across processes, and a ``make_tiny_model`` Gemma loaded both ways.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402
import test_model_parity as MP  # noqa: E402  (its paged-forward helpers: Cache, _step, ...)

from pdserve.workers.loading.loader import LoadedModel, load_model  # noqa: E402
from pdserve.workers.model import ModelConfigError, parse_config  # noqa: E402
from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

ARCH = "Gemma3ForCausalLM"
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention"]
# Three layers (local, global, local), window 5, distinct local/global RoPE (global linearly
# scaled), a softmax scale from query_pre_attn_scalar unlike head_dim ** -0.5.
GEMMA = dict(
    head_dim=16, num_hidden_layers=3, sliding_window=5, layer_types=LOCAL_GLOBAL,
    query_pre_attn_scalar=24, final_logit_softcapping=30.0,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                     "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}},
)

# name -> (config overrides, how config.json is rewritten before loading, or None)
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    # As transformers 5 writes it: layer_types, nested rope_parameters, tied head, soft-capping
    # tight enough to bend the logits.
    "t5_tied_softcap": ({**GEMMA, "final_logit_softcapping": 3.0}, None),
    # The transformers-4 spelling (Hub configs): sliding_window_pattern, rope_theta +
    # rope_local_base_freq + rope_scaling; untied head, attention biases, no soft-capping.
    "t4_pattern_untied": (
        {**GEMMA, "tie_word_embeddings": False, "attention_bias": True, "final_logit_softcapping": None,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        {"drop": ["layer_types", "rope_parameters"], "set": {
            "sliding_window_pattern": 2, "rope_theta": 5000.0, "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}},
    ),
}


def _build_forward_pair(tmp: Path, name: str) -> tuple[Any, LoadedModel]:
    overrides, rewrite = VARIANTS[name]
    hf, path = P.build_hf_model(tmp, "Gemma3TextConfig", overrides, architecture=ARCH, spread=1.0, name=name)
    if rewrite is not None:
        cfg = json.loads((path / "config.json").read_text())
        for key in rewrite["drop"]:
            del cfg[key]
        cfg.update(rewrite["set"])
        (path / "config.json").write_text(json.dumps(cfg))
        # transformers must read the rewritten file as the model it was built from.
        reread = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        assert reread.config.layer_types == hf.config.layer_types
        assert reread.config.rope_parameters == hf.config.rope_parameters
        hf = reread
    return hf, load_model(path)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LoadedModel]:
    return _build_forward_pair(tmp_path_factory.mktemp("gemma3_fwd"), request.param)


def test_config_parsed_as_transformers_reads_it(pair: tuple[Any, LoadedModel]) -> None:
    hf, lm = pair
    cfg = lm.config
    assert cfg.layer_windows == (5, None, 5)
    assert cfg.layer_rope_index == (1, 0, 1)
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (5000.0, "linear", 2.0)
    assert [r.theta for r in cfg.extra_ropes] == [100.0]
    assert cfg.attn_scale == 24**-0.5
    assert cfg.final_logit_softcap == hf.config.final_logit_softcapping
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings


def test_forward_matches_prefill_chunks_and_mixed_batches(pair: tuple[Any, LoadedModel]) -> None:
    """Every flat row's logits == transformers' at that position: one 41-token prefill, the same
    prompt in chunks (edges on and off block boundaries, a one-token decode chunk), and one step
    mixing decode tokens, a continued chunk and fresh prompts."""
    hf, lm = pair
    prompt = MP._tokens(41, seed=1)
    ref = MP._hf_logits(hf, prompt)
    got = MP._step(lm, MP.Cache(lm), [("a", prompt)], all_logits=True)
    torch.testing.assert_close(got, ref, atol=MP.ATOL, rtol=0)

    cache = MP.Cache(lm)
    edges = [0, 3, 8, 16, 29, 30, 41]
    got = torch.cat([MP._step(lm, cache, [("a", prompt[a:b])], all_logits=True) for a, b in zip(edges, edges[1:])])
    torch.testing.assert_close(got, ref, atol=MP.ATOL, rtol=0)

    full = {n: MP._tokens(k, seed=10 + i) for i, (n, k) in enumerate([("a", 21), ("b", 34), ("c", 22), ("d", 9)])}
    cache = MP.Cache(lm)
    MP._step(lm, cache, [("a", full["a"][:20]), ("b", full["b"][:33])])
    MP._step(lm, cache, [("c", full["c"][:12])])
    parts = [("a", full["a"][20:]), ("c", full["c"][12:]), ("b", full["b"][33:]), ("d", full["d"])]
    got = MP._step(lm, cache, parts, all_logits=True)
    row = 0
    for name, new in parts:
        torch.testing.assert_close(got[row : row + len(new)], MP._hf_logits(hf, full[name])[-len(new):],
                                   atol=MP.ATOL, rtol=0)
        row += len(new)


# ------------------------------------------------------------------ engine and 1P1D


# A local and a global layer; the head untied, since the harness spreads the logits by scaling
# the LM head and a tied one would scale the embedding too (greedy then repeats one token).
ENGINE_GEMMA = {**GEMMA, "num_hidden_layers": 2, "layer_types": LOCAL_GLOBAL[:2], "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return P.build_hf_model(tmp_path_factory.mktemp("gemma3"), "Gemma3TextConfig", ENGINE_GEMMA, architecture=ARCH)


def test_gemma3_engine_matches_transformers(gemma3):
    hf, path = gemma3
    figures = P.check_engine_parity(hf, path)
    assert figures["reused_blocks"] > 0 and figures["pauses"] > 0


def test_gemma3_over_1p1d_matches_transformers(gemma3, tmp_path):
    hf, path = gemma3
    figures = P.check_disagg_parity(hf, path, tmp_path)
    # K and V of 2 KV heads x 16 dims per layer (2) per token, fp32; whole blocks of 4 tokens
    # (every block, local layers' included: windows free nothing).
    per_token = 2 * 2 * 2 * 16 * 4
    assert figures["bytes"] % (4 * per_token) == 0


# ------------------------------------------------------------------ make-tiny-model


def test_tiny_gemma3_loads_in_pdserve_and_transformers_alike(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "tiny", arch="gemma3_text", num_layers=2, vocab_size=300, seed=3)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH] and cfg["model_type"] == "gemma3_text"
    lm = load_model(path)
    assert lm.config.layer_windows == (32, None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ARCH
    prompt = MP._tokens(45, seed=7)  # past the 32-token window
    torch.testing.assert_close(MP._step(lm, MP.Cache(lm), [("a", prompt)], all_logits=True),
                               MP._hf_logits(hf, prompt), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ config refusals and defaults


def _base(**kw: Any) -> dict[str, Any]:
    return {"architectures": [ARCH], "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 300, **kw}


def test_defaults_follow_gemma3_text_config() -> None:
    """Absent keys take Gemma3TextConfig's defaults (pattern 6, window 4096, 1e6/1e4 bases,
    query_pre_attn_scalar 256, tied head), as transformers resolves the same dict."""
    cfg = parse_config(_base())
    ref = transformers.Gemma3TextConfig.from_dict(_base())
    assert cfg.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in ref.layer_types)
    assert cfg.layer_windows[5] is None and cfg.layer_windows[11] is None and cfg.layer_windows[0] == 4096
    assert cfg.rope.theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.extra_ropes[0].theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.attn_scale == 256**-0.5 and cfg.tie_word_embeddings and cfg.final_logit_softcap is None
    every_global = parse_config(_base(sliding_window_pattern=1))
    assert every_global.layer_windows == (None,) * 12 and every_global.extra_ropes == ()


@pytest.mark.parametrize("extra, key", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"sliding_window": None}, "sliding_window"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention"] * 11}, "layer_types"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "dynamic", "factor": 2.0}}}, "sliding_attention"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
])
def test_unsupported_or_bad_configs_are_refused_by_key(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ModelConfigError, match=key):
        parse_config(_base(**extra))

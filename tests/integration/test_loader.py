"""Loading HF-format directories: tiny models, sharded weights, EOS ids, config spellings, and
the errors for everything that is missing or unsupported."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers", reason="checks loading against transformers")

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.loading.loader import ModelLoadError, load_config, load_model, load_tokenizer
from pdserve.workers.model import ModelConfigError, SeqBatchInfo, parse_config
from pdserve.workers.loading.tiny_model import ARCHITECTURES as TINY_ARCHITECTURES
from pdserve.workers.loading.tiny_model import SPECIAL_TOKENS, build_byte_tokenizer, main, make_tiny_model


def _prefill_logits(lm, tokens: list[int]) -> torch.Tensor:  # [len(tokens), V]
    pool = KVPool.for_model(lm.config, 16, 8, dtype=lm.model.dtype)
    seq = SeqBatchInfo(0, len(tokens), 0, tuple(range(16)))
    return lm.model(torch.tensor(tokens), None, [seq], pool, all_logits=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", seed=7)


# ---------------------------------------------------------------- tiny model


@pytest.mark.parametrize("arch,tied", [*((a, False) for a in sorted(TINY_ARCHITECTURES)), ("qwen2", True)])
def test_tiny_model_loads_in_pdserve_and_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    # Every family the registry lists: make-tiny-model's output is a model transformers loads
    # (no missing or unexpected tensor) and computes the same logits from.
    d = make_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=tied, seed=1)
    lm = load_model(d)
    assert lm.config.model_type == arch and lm.config.tie_word_embeddings == tied
    assert (lm.config.hidden_size, lm.config.num_hidden_layers, lm.config.vocab_size) == (64, 2, 384)
    assert lm.eos_token_ids == (SPECIAL_TOKENS.index("</s>"),)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    hf.eval()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = lm.tokenizer.encode("tiny models still compute real logits").ids
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(lm, tokens), ref, atol=1e-4, rtol=0)


def test_tiny_model_is_deterministic_from_seed(tmp_path: Path) -> None:
    a = load_file(make_tiny_model(tmp_path / "a", seed=3) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=3) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=4) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    w = a["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(w, c["model.layers.0.mlp.up_proj.weight"])
    assert w.dtype == torch.float32 and 0.015 < float(w.std()) < 0.025


def test_cli_entry_writes_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main([str(out), "--arch", "qwen2", "--hidden-size", "32", "--num-layers", "3", "--seed", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = load_config(out)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.qkv_bias) == ("qwen2", 32, 3, True)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "bad"), "--vocab-size", "100"])  # no room for the 259 base tokens


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_tokenizer_round_trips_text(text: str) -> None:
    tok = _TOKENIZER
    if any(s in text for s in SPECIAL_TOKENS):  # literal special tokens map to their ids
        return
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no BOS
    assert tok.decode(ids) == text


_TOKENIZER = build_byte_tokenizer()


def test_tokenizer_file_round_trips_and_knows_specials(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    text = "naïve café — 東京 🚀\n\ttabs and  spaces"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.encode("A").ids == [3 + ord("A")]


# ---------------------------------------------------------------- weights and metadata


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    lm = load_model(tmp_path)
    tokens = [5, 80, 7, 200, 13]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(lm, tokens), ref, atol=1e-4, rtol=0)

    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(tmp_path)


def test_eos_ids_from_generation_config_then_config(tiny_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert load_model(d).eos_token_ids == (2, 5)
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = 9
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_model(d).eos_token_ids == (9,)


def test_bf16_load_runs_close_to_fp32(tiny_dir: Path) -> None:
    lm32, lm16 = load_model(tiny_dir), load_model(tiny_dir, dtype="bf16")
    assert lm16.model.embed_weight.dtype == torch.bfloat16
    tokens = list(range(3, 40))
    a, b = _prefill_logits(lm32, tokens), _prefill_logits(lm16, tokens)
    assert b.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99


# ---------------------------------------------------------------- errors


def _copy(tiny_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "m"))


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(tiny_dir: Path, tmp_path: Path, missing: str) -> None:
    d = _copy(tiny_dir, tmp_path)
    (d / missing).unlink()
    with pytest.raises(ModelLoadError, match=missing.replace(".", r"\.")):
        load_model(d)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "falcon"}, "falcon"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
    ],
)
def test_unsupported_configs_are_rejected(tiny_dir: Path, tmp_path: Path, changes: dict, needle: str) -> None:
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(ModelLoadError, match=needle) as info:
        load_model(d)
    assert "config.json" in str(info.value)


def test_missing_or_misshapen_tensor_is_named(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = _copy(tiny_dir, tmp_path)
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(d)
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(d)


# ---------------------------------------------------------------- config spellings


def test_old_and_new_rope_spellings_agree() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300, "max_position_embeddings": 512,
    }
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = parse_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
    new = parse_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    assert old.rope == new.rope and old.rope.rope_type == "llama3" and old.rope.theta == 5e5
    lin = parse_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (lin.rope.rope_type, lin.rope.factor, lin.rope.theta) == ("linear", 2.0, 10000.0)
    assert parse_config(base).num_key_value_heads == 4  # defaults to MHA
    with pytest.raises(ModelConfigError):
        parse_config({**base, "rope_scaling": {"type": "linear"}})  # no factor


def test_old_rope_spelling_on_disk_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "linear", "factor": 2.5}
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, rope_scaling=scaling, rope_theta=20000.0,
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    # Rewrite config.json the transformers-4 way: top-level rope_theta, rope_scaling with "type".
    _edit_config(tmp_path, rope_parameters=None, rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.5})
    lm = load_model(tmp_path)
    assert (lm.config.rope.rope_type, lm.config.rope.factor, lm.config.rope.theta) == ("linear", 2.5, 20000.0)
    tokens = list(range(10, 50))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(lm, tokens), ref, atol=1e-4, rtol=0)


def test_sliding_window_per_layer_rules() -> None:
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 300}
    mistral = parse_config({**base, "model_type": "mistral", "sliding_window": 16})
    assert mistral.layer_windows == (16,) * 4
    qwen_off = parse_config({**base, "model_type": "qwen2", "sliding_window": 16, "max_window_layers": 1})
    assert qwen_off.layer_windows == (None,) * 4  # use_sliding_window defaults to false
    qwen_on = parse_config(
        {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    )
    assert qwen_on.layer_windows == (None, None, 16, 16)
    llama = parse_config({**base, "model_type": "llama", "sliding_window": 16})
    assert llama.layer_windows == (None,) * 4

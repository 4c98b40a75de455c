"""The model registry loads families lazily: its table names each parser and class as a
"module:attr" string, so importing the model package (or config.py, or the registry) imports no
family module, and parsing one family's config imports only that family. Every entry resolves,
and agrees with its module (model_type, class)."""
from __future__ import annotations

import subprocess
import sys

import pytest

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gemma3", "gpt_oss")


def test_importing_the_model_package_loads_no_family_and_parsing_loads_one():
    code = (
        "import sys\n"
        "import pdserve.workers.model, pdserve.workers.model.registry as R\n"
        f"families = {FAMILIES!r}\n"
        "def loaded():\n"
        "    return sorted(f for f in families if f'pdserve.workers.model.{f}' in sys.modules)\n"
        "print(loaded())\n"
        "cfg = R.parse_config({'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',\n"
        "    'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,\n"
        "    'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 100})\n"
        "print(type(cfg).__name__, loaded())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # qwen3.py borrows two helpers from llama.py: a family's own imports load with it.
    assert out.stdout.split("\n")[:2] == ["[]", "ModelConfig ['llama', 'qwen3']"]


def test_every_entry_resolves_and_matches_its_module():
    pytest.importorskip("torch")
    import importlib

    from pdserve.workers.model import registry
    from pdserve.workers.model.decoder import DecoderLM

    assert list(registry.SUPPORTED_ARCHITECTURES.values()) == list(registry.BY_MODEL_TYPE)
    for model_type, arch in registry.BY_MODEL_TYPE.items():
        assert callable(arch.parse), model_type
        assert issubclass(arch.model_cls, DecoderLM) and arch.model_cls.__name__ in (arch.name, "LlamaForCausalLM")
        module = importlib.import_module(arch.model_cls.__module__)
        assert getattr(module, "MODEL_TYPE", model_type) == model_type  # a family naming its type agrees
        # (what the tiny configs write is tested by test_loader.py, which makes one of each)
        assert callable(registry.resolve(arch.tiny) if isinstance(arch.tiny, str) else arch.tiny)


def test_an_unknown_architecture_is_refused():
    from pdserve.workers.model import ModelConfigError, parse_config

    with pytest.raises(ModelConfigError, match="unsupported architecture"):
        parse_config({"architectures": ["NoSuchForCausalLM"]})

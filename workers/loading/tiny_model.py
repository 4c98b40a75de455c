"""Write a small random model of any supported family in Hugging Face format
(``pdserve make-tiny-model --arch``).

The directory holds config.json, model.safetensors (fp32, N(0, 0.02) init, norms at 1,
deterministic from the seed), generation_config.json and a byte-level tokenizer.json. It loads
through ``pdserve.workers.loading.loader`` and through transformers' AutoModelForCausalLM alike. Each
family's extra config keys come from its entry in ``workers/model/registry.py``; the tensors are
the ones its pdserve model loads (``weight_targets``), so writer and loader cannot disagree.

Tokenizer: ids 0-2 are <unk>, <s>, </s>; ids 3-258 are the 256 bytes (GPT-2 byte-to-unicode
alphabet, no merges; byte b is id 3 + b), so any UTF-8 text round-trips. Encoding adds no BOS.
tokenizer_config.json carries a small chat template (``<|role|>`` headers, each turn closed by
</s>), so the model can serve /v1/chat/completions.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
NUM_BYTE_TOKENS = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS  # 259

# BOS, then "<|role|>\ncontent</s>\n" per message; the generation prompt opens an assistant turn.
# With tools (Hermes style, as Qwen's templates write them): a system turn listing them as JSON in
# <tools></tools> (a first system message's content leads it), an assistant's calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks after its content, and a tool
# result as a <|tool|> turn in <tool_response></tool_response>. Without tools or tool turns it
# renders what the first template (plain turns only) rendered.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call>' + eos_token + '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|tool|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' + eos_token + '\\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

def _architectures() -> dict[str, Any]:
    from pdserve.workers.model.registry import BY_MODEL_TYPE

    return dict(BY_MODEL_TYPE)


ARCHITECTURES = _architectures()  # model_type -> registry.Architecture
# Family names people type for a model_type that says more: Gemma 3's text model is
# "gemma3_text" in config.json ("gemma3" there is the multimodal wrapper), so --arch gemma3
# writes a gemma3_text model.
ARCH_ALIASES = {"gemma3": "gemma3_text"}


def byte_to_unicode() -> list[str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    take code points 256, 257, ... in byte order (the GPT-2 convention tokenizers' ByteLevel uses)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_byte_tokenizer() -> Tokenizer:
    """Byte b encodes to id len(SPECIAL_TOKENS) + b."""
    byte_chars = byte_to_unicode()
    if set(byte_chars) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("tokenizers' ByteLevel alphabet differs from the expected mapping")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *byte_chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS[UNK_ID]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _config_json(
    arch: str, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
    intermediate_size: int, vocab_size: int, max_position_embeddings: int,
    tie_word_embeddings: bool, rope_theta: float,
) -> dict[str, Any]:
    spec = ARCHITECTURES[arch]
    cfg: dict[str, Any] = {
        "architectures": [spec.name],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    cfg.update(spec.tiny_config(cfg))
    return cfg


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Every tensor the family's pdserve model loads, in checkpoint names: norms at 1 (0 for
    the 1 + w norms of Gemma), everything else N(0, 0.02), drawn from the seed in the model's
    own order with the LM head last (for Llama the order the first writer used, so the
    built-in model keeps its weights)."""
    from pdserve.workers.model import build_model, parse_config

    config = parse_config(cfg)
    with torch.device("meta"):
        model = build_model(config, dtype=torch.float32, device="meta")
    shapes = {name: tuple(t.shape) for name, t in model.weight_targets().items()}
    if "lm_head.weight" in shapes:
        shapes["lm_head.weight"] = shapes.pop("lm_head.weight")
    gen = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for name in shapes:
        shape = shapes[name]
        if "norm" in name.rsplit(".", 2)[-2] and len(shape) == 1:
            w[name] = torch.zeros(shape) if model.norm_unit_offset else torch.ones(shape)
        else:
            w[name] = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
    return w


# The built-in model (`pdserve launch` without --model). The name changes whenever what
# write_builtin_model writes changes (-chat: the chat template; -tools: it renders tools).
BUILTIN_MODEL_NAME = "tiny-llama-h128-l4-v259-chat-tools"


def write_builtin_model(path: str | Path) -> Path:
    """The built-in tiny model at ``path``, written unless it is there. Deterministic, so each
    node of a cluster can write its own copy (a worker does, when the launching node's copy is
    not on its node) and every copy is the same model."""
    import os

    path = Path(path)
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        vocab_size=259, max_position_embeddings=2048, seed=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; theirs is identical
            pass
    return path


def make_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 384,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    seed: int = 0,
) -> Path:
    """Write the model directory and return its path. intermediate_size defaults to 2x hidden."""
    arch = ARCH_ALIASES.get(arch, arch)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r} (choose from {', '.join(ARCHITECTURES)})")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (3 special + 256 byte tokens)")
    if hidden_size % num_heads or num_heads % num_kv_heads or (hidden_size // num_heads) % 2:
        raise ValueError("need hidden_size % num_heads == 0, num_heads % num_kv_heads == 0, even head_dim")
    cfg = _config_json(
        arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size or 2 * hidden_size,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_file(_random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": SPECIAL_TOKENS[UNK_ID],
        "model_max_length": max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve make-tiny-model", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", metavar="DIR")
    ap.add_argument("--arch", choices=sorted({*ARCHITECTURES, *ARCH_ALIASES}), default="llama")
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=None, help="default: 2 x hidden size")
    ap.add_argument("--vocab-size", type=int, default=384)
    ap.add_argument("--max-position-embeddings", type=int, default=4096)
    ap.add_argument("--tie-word-embeddings", action="store_true")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(list(argv) if argv is not None else None)
    try:
        path = make_tiny_model(
            a.out_dir, arch=a.arch, hidden_size=a.hidden_size, num_layers=a.num_layers,
            num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, intermediate_size=a.intermediate_size,
            vocab_size=a.vocab_size, max_position_embeddings=a.max_position_embeddings,
            tie_word_embeddings=a.tie_word_embeddings, rope_theta=a.rope_theta, seed=a.seed,
        )
    except ValueError as e:
        ap.error(str(e))
    print(path)
    return 0

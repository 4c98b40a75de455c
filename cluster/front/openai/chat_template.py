"""A model's chat template (tokenizer_config.json), rendered the way Hugging Face transformers
renders it, so a conversation becomes the same prompt text as with ``apply_chat_template``:

- jinja2's immutable sandbox, with ``trim_blocks`` and ``lstrip_blocks`` and the loop controls
  (``break``/``continue``) extension;
- the helpers templates call: the ``tojson`` filter (non-ASCII kept, optional indent), and the
  globals ``raise_exception`` and ``strftime_now``;
- the variables: ``messages``, ``add_generation_prompt``, and the tokenizer's special tokens
  (``bos_token``, ``eos_token``, ... as plain strings).

The rendered text is tokenized without adding special tokens: the template writes them itself.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                      "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render it."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, Any]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template in tokenizer_config.json (or chat_template.jinja beside it), or None
        when the model has none."""
        model_dir = Path(model_dir)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = model_dir / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        if not isinstance(source, str) or not source:
            return None
        special: dict[str, Any] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text
        extra = [t for t in (_token_text(v) for v in config.get("additional_special_tokens") or ()) if t]
        if extra:
            special["additional_special_tokens"] = extra
        return cls(source, special)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        object.__setattr__(self, "_compiled", env.from_string(self.source))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``tools``: the request's tool definitions (OpenAI's shape), for templates that list
        them (Hugging Face's convention: the ``tools`` variable, unset when there are none)."""
        extra = {"tools": tools} if tools else {}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **extra, **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc

"""The chat template renders exactly what Hugging Face transformers' apply_chat_template renders:
the tiny model's own template, and a ChatML-style template that uses the sandbox's helpers."""
from __future__ import annotations

import json

import pytest

from pdserve.cluster.front.openai.chat_template import ChatTemplate, ChatTemplateError
from pdserve.workers.loading.tiny_model import make_tiny_model

# A template in the style many models ship: a default system prompt, loop controls, tojson,
# raise_exception for a bad role, and whitespace that only trim_blocks/lstrip_blocks tidy up.
CHATML_STYLE = """{%- if messages[0]['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message.get('skip') %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}{% if message.get('meta') %} {{ message['meta'] | tojson }}{% endif %}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Ünïcode → ok?"}],
    [{"role": "user", "content": "a", "meta": {"k": ["é", 1]}}, {"role": "user", "content": "b", "skip": True},
     {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    chatml = make_tiny_model(tmp_path_factory.mktemp("chatml"))
    cfg = json.loads((chatml / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML_STYLE
    cfg["eos_token"] = {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}  # the AddedToken form
    (chatml / "tokenizer_config.json").write_text(json.dumps(cfg))
    return {"tiny": tiny, "chatml": chatml}


@pytest.mark.parametrize("which", ["tiny", "chatml"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(model_dirs, which, conversation, add_generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dirs[which]))
    messages = CONVERSATIONS[conversation]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = ChatTemplate.from_model_dir(model_dirs[which])
    assert ours is not None
    assert ours.render(messages, add_generation_prompt) == expected
    expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if not isinstance(expected_ids, list):  # transformers 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert hf.encode(ours.render(messages, add_generation_prompt), add_special_tokens=False) == list(expected_ids)


def test_the_tiny_models_template_opens_an_assistant_turn(model_dirs):
    text = ChatTemplate.from_model_dir(model_dirs["tiny"]).render([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"


def test_a_template_refusal_is_a_chat_template_error(model_dirs):
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate.from_model_dir(model_dirs["chatml"]).render([{"role": "tool", "content": "x"}])


def test_a_model_without_a_template_has_none(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.from_model_dir(model) is None

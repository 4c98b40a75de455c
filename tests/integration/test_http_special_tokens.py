"""Special tokens on a real 1P1D cluster serving a model whose tokenizer adds a BOS (as Llama 3's
and Gemma's do), with the official ``openai`` client and gRPC: a text prompt gets the BOS by
default and not with ``add_special_tokens: false``, and answers what the offline engine answers
for the same ids; chat keeps the template's one BOS; ``/tokenize`` and ``echo`` follow vLLM."""
from __future__ import annotations

import http.client
import json
import os
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
from tokenizers import processors  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cluster.front.openai.chat_template import ChatTemplate  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402
from pdserve.workers.loading.tiny_model import BOS_ID, SPECIAL_TOKENS, build_byte_tokenizer, make_tiny_model  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ENGINE = dict(U.ENGINE, max_input_len=96, max_seq_len=160)
TEXT = "The quick brown fox"
TEXT_IDS = [len(SPECIAL_TOKENS) + b for b in TEXT.encode()]  # byte b is id 3 + b
BOS = SPECIAL_TOKENS[BOS_ID]


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A random tiny Llama whose tokenizer.json has a post-processor adding <s>."""
    out = make_tiny_model(tmp_path_factory.mktemp("bos") / "tiny-bos", vocab_size=259, seed=11)
    tok = build_byte_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, BOS_ID)])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def bos_cluster(ray_cluster, bos_model):
    cl = U.start_cluster(bos_model, engine=ENGINE, router=RouterConfig(http_port=0))
    yield cl
    cl.shutdown()


def _post(cl, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        conn.close()


def test_text_prompts_get_the_bos_as_in_vllm_and_chat_keeps_one(bos_cluster, bos_model):
    cl = bos_cluster
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{cl.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=120)
    model = oa.models.list().data[0].id
    engine = LLM(bos_model, **ENGINE)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with_bos, without_bos = engine.generate([[BOS_ID, *TEXT_IDS], TEXT_IDS], greedy)
    assert engine.generate([TEXT], greedy)[0].prompt_token_ids == [BOS_ID, *TEXT_IDS]  # offline too

    # Completions: the BOS by default; echo gives the text as sent and the logprobs the BOS first.
    out = oa.completions.create(model=model, prompt=TEXT, max_tokens=12, temperature=0, echo=True, logprobs=0,
                                extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(TEXT_IDS) + 1
    assert choice.text == TEXT + with_bos.text
    assert choice.logprobs.tokens[0] == BOS and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(TEXT_IDS) + 1 + 12
    off = oa.completions.create(model=model, prompt=TEXT, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert off.usage.prompt_tokens == len(TEXT_IDS) and off.choices[0].text == without_bos.text
    # Token ids are taken as given, whatever add_special_tokens says.
    ids = oa.completions.create(model=model, prompt=TEXT_IDS, max_tokens=1, temperature=0,
                                extra_body={"ignore_eos": True, "add_special_tokens": True})
    assert ids.usage.prompt_tokens == len(TEXT_IDS)

    # Chat: the template writes <s>; the tokenizer's is not added on top.
    messages = [{"role": "user", "content": "hi"}]
    rendered = ChatTemplate.from_model_dir(bos_model).render(messages)
    assert rendered.startswith(BOS)
    rendered_ids = engine.engine.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert rendered_ids.count(BOS_ID) == 1
    chat = oa.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(rendered_ids)
    chat2 = oa.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0,
                                       extra_body={"ignore_eos": True, "add_special_tokens": True})
    assert chat2.usage.prompt_tokens == len(rendered_ids) + 1  # asked for: vLLM's double BOS

    # /tokenize previews each: a prompt as completions, messages as chat.
    assert _post(cl, "/tokenize", {"prompt": TEXT})["tokens"] == [BOS_ID, *TEXT_IDS]
    assert _post(cl, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"] == TEXT_IDS
    assert _post(cl, "/tokenize", {"messages": messages})["tokens"] == rendered_ids

    # gRPC: the same default, and the proto's optional field turns it off.
    with U.Client(f"127.0.0.1:{cl.port}") as c:
        on = c.generate(TEXT, max_tokens=12, temperature=0.0, ignore_eos=True)
        no = c.generate(TEXT, max_tokens=12, temperature=0.0, ignore_eos=True, add_special_tokens=False)
    assert (on.usage.prompt_tokens, on.token_ids) == (len(TEXT_IDS) + 1, with_bos.token_ids)
    assert (no.usage.prompt_tokens, no.token_ids) == (len(TEXT_IDS), without_bos.token_ids)
    U.wait_drained(cl)

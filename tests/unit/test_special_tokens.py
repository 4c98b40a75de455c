"""Special tokens as vLLM adds them, with a tokenizer whose post-processor adds a BOS (Llama 3's
and Gemma's do; the tiny model's byte tokenizer does not, so it alone could not tell):
completions, the gRPC door and the offline ``LLM`` add them to a text prompt unless
``add_special_tokens`` is false; chat does not (its template writes the BOS) unless asked;
``/tokenize`` follows the request it previews; token-id prompts are never changed. Each door is
driven through the real router core (no workers: a request is admitted, its prompt read, then
cancelled before it is dispatched)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from tokenizers import Tokenizer, processors

from pdserve.cluster.auth import KeyRing
from pdserve.cluster.front.grpc.convert import spec_from_proto
from pdserve.cluster.front.openai.api import CHAT, COMPLETIONS, ApiError, parse_request, parse_tokenize
from pdserve.cluster.front.openai.chat_template import ChatTemplate
from pdserve.cluster.front.openai.server import OpenAIServer
from pdserve.cluster.router import RouterConfig
from pdserve.cluster.router.core import Router
from pdserve.cluster.rpc import router_pb2 as pb
from pdserve.transport.requests import WorkerInfo
from pdserve.workers.loading.tiny_model import BOS_ID, CHAT_TEMPLATE, SPECIAL_TOKENS, build_byte_tokenizer

MODEL = "bos-model"
TEXT = "The quick fox"
TEXT_IDS = [len(SPECIAL_TOKENS) + b for b in TEXT.encode()]  # the byte tokenizer: byte b is id 3 + b


def bos_tokenizer() -> Tokenizer:
    """The tiny byte tokenizer with a Llama-style post-processor: ``<s>`` before every sequence."""
    tok = build_byte_tokenizer()
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)])
    assert tok.encode(TEXT).ids == [BOS_ID, *TEXT_IDS]  # the premise of every test here
    assert tok.encode(TEXT, add_special_tokens=False).ids == TEXT_IDS
    return tok


def _info(worker_id: str, role: str) -> WorkerInfo:
    # No worker listens at request_endpoint: requests are cancelled before they are dispatched.
    return WorkerInfo(worker_id=worker_id, role=role, pid=1, num_kv_blocks=64, tokens_per_block=8,
                      max_batch_size=8, max_input_len=100, max_seq_len=200, max_num_tokens=256,
                      vocab_size=259, endpoint="127.0.0.1:1#1", incarnation=1,
                      request_endpoint="127.0.0.1:1", request_token="t")


def _router() -> Router:
    return Router(RouterConfig(), {}, {"gen-0": _info("gen-0", "generation")}, bos_tokenizer())


def _template() -> ChatTemplate:
    return ChatTemplate(CHAT_TEMPLATE, {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": "</s>"})


async def _admitted_prompt(router: Router, spec) -> list[int]:
    """The prompt ids the router admits for ``spec``: what it hashes for prefix routing and the
    workers prefill. Cancelled at once: admit() returns before its dispatch task first runs."""
    req = await router.admit(spec)
    router.cancel(req, "test")
    # One list for the queue entry and for the dispatcher's prefix hashing (PromptInfo is
    # built from req.prompt): the BOS is in both or in neither.
    assert list(req.queue_entry.get_tokens(0)) == list(req.prompt)
    return list(req.prompt)


def _openai_prompt(body: dict, kind: str) -> list[int]:
    """The HTTP door's path for a completions or chat body: parse, render and tokenize chat,
    admit."""
    async def go():
        router = _router()
        server = OpenAIServer(router, RouterConfig(), KeyRing(), MODEL, _template())
        parsed = parse_request(body, kind, MODEL)
        spec = await server._spec(parsed, None)
        try:
            return await _admitted_prompt(router, spec)
        finally:
            await router.stop()

    return asyncio.run(go())


# ---- completions ------------------------------------------------------------------------------

def test_a_completions_text_prompt_gets_the_bos_by_default_and_not_when_told():
    assert _openai_prompt({"prompt": TEXT}, COMPLETIONS) == [BOS_ID, *TEXT_IDS]
    assert _openai_prompt({"prompt": TEXT, "add_special_tokens": True}, COMPLETIONS) == [BOS_ID, *TEXT_IDS]
    assert _openai_prompt({"prompt": TEXT, "add_special_tokens": False}, COMPLETIONS) == TEXT_IDS
    assert _openai_prompt({"prompt": [TEXT]}, COMPLETIONS) == [BOS_ID, *TEXT_IDS]  # the one-element batch


def test_a_token_id_prompt_is_never_changed():
    ids = [5, 6, 7]
    assert _openai_prompt({"prompt": ids}, COMPLETIONS) == ids
    assert _openai_prompt({"prompt": ids, "add_special_tokens": True}, COMPLETIONS) == ids
    assert _openai_prompt({"prompt": ids, "add_special_tokens": False}, COMPLETIONS) == ids


def test_add_special_tokens_must_be_a_boolean():
    for kind, body in ((COMPLETIONS, {"prompt": TEXT}), (CHAT, {"messages": [{"role": "user", "content": "x"}]})):
        with pytest.raises(ApiError) as info:
            parse_request({**body, "add_special_tokens": 1}, kind, MODEL)
        assert info.value.status == 400 and info.value.param == "add_special_tokens"


# ---- chat -------------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


def test_chat_keeps_the_templates_one_bos_and_adds_another_only_when_asked():
    rendered = _template().render(MESSAGES)
    assert rendered.startswith(SPECIAL_TOKENS[BOS_ID])  # the template writes the BOS itself
    body = {"messages": MESSAGES}
    ids = _openai_prompt(body, CHAT)
    assert ids == bos_tokenizer().encode(rendered, add_special_tokens=False).ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    # vLLM adds the tokenizer's BOS on top of the template's when the client asks: two.
    twice = _openai_prompt({**body, "add_special_tokens": True}, CHAT)
    assert twice == [BOS_ID, *ids]
    assert _openai_prompt({**body, "add_special_tokens": False}, CHAT) == ids


# ---- /tokenize --------------------------------------------------------------------------------

def _tokenize_over_http(bodies: list[dict]) -> list[dict]:
    async def go():
        router = _router()
        server = OpenAIServer(router, RouterConfig(), KeyRing(), MODEL, _template())
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                out = []
                for body in bodies:
                    async with session.post(f"http://127.0.0.1:{port}/tokenize", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        out.append(json.loads(await resp.text()))
                return out
        finally:
            await server.stop()
            await router.stop()

    return asyncio.run(go())


def test_tokenize_follows_the_request_it_previews():
    rendered = _template().render(MESSAGES)
    chat_ids = bos_tokenizer().encode(rendered, add_special_tokens=False).ids
    prompt, no_special, chat, chat_special = _tokenize_over_http([
        {"prompt": TEXT}, {"prompt": TEXT, "add_special_tokens": False},
        {"messages": MESSAGES}, {"messages": MESSAGES, "add_special_tokens": True}])
    assert prompt["tokens"] == [BOS_ID, *TEXT_IDS] == _openai_prompt({"prompt": TEXT}, COMPLETIONS)
    assert no_special["tokens"] == TEXT_IDS
    assert chat["tokens"] == chat_ids == _openai_prompt({"messages": MESSAGES}, CHAT)
    assert chat_special["tokens"] == [BOS_ID, *chat_ids]
    assert parse_tokenize({"prompt": TEXT}, MODEL).add_special_tokens is True
    assert parse_tokenize({"messages": MESSAGES}, MODEL).add_special_tokens is False


# ---- gRPC -------------------------------------------------------------------------------------

def _grpc_prompt(request) -> list[int]:
    async def go():
        router = _router()
        try:
            return await _admitted_prompt(router, spec_from_proto(request))
        finally:
            await router.stop()

    return asyncio.run(go())


def test_the_grpc_door_adds_special_tokens_unless_the_field_says_not():
    assert _grpc_prompt(pb.GenerateRequest(text=TEXT)) == [BOS_ID, *TEXT_IDS]
    assert _grpc_prompt(pb.GenerateRequest(text=TEXT, add_special_tokens=True)) == [BOS_ID, *TEXT_IDS]
    assert _grpc_prompt(pb.GenerateRequest(text=TEXT, add_special_tokens=False)) == TEXT_IDS
    ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]), add_special_tokens=True)
    assert _grpc_prompt(ids) == [5, 6]
    # The client's keyword sets the field; left out, the field stays unset (the router's default).
    from pdserve.cluster.client import Client

    assert not Client.build_request(TEXT).HasField("add_special_tokens")
    assert Client.build_request(TEXT, add_special_tokens=False).add_special_tokens is False


# ---- offline LLM ------------------------------------------------------------------------------

def test_the_offline_llm_adds_special_tokens_to_a_text_prompt(tmp_path):
    """vLLM's LLM.generate: a string prompt gets the tokenizer's BOS; token ids are taken as given."""
    from pdserve import LLM, SamplingParams
    from pdserve.workers.loading.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "bos", hidden_size=32, num_layers=1, vocab_size=259, seed=3)
    bos_tokenizer().save(str(model / "tokenizer.json"))
    llm = LLM(model, device="cpu", max_batch_size=2, num_kv_blocks=32, tokens_per_block=4)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    text_out, ids_out = llm.generate([TEXT, [BOS_ID, *TEXT_IDS]], greedy)
    assert text_out.prompt_token_ids == [BOS_ID, *TEXT_IDS]
    assert text_out.token_ids == ids_out.token_ids
    assert llm.generate([TEXT_IDS], greedy)[0].prompt_token_ids == TEXT_IDS

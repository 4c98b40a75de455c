"""vLLM's sampling set through the OpenAI door of a real 1P1D cluster, with the official
``openai`` client: every answer equals the in-process engine's for the same request (which
test_sampling_parity holds to transformers), so penalties, logprobs and prompt logprobs survive
the split (first token and prompt logprobs on the context worker, the rest on the generation
worker); structured outputs validate on random weights, streamed and not; bad values are a 400
naming the field and the server stays up."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ENGINE = dict(U.ENGINE, max_input_len=96, max_seq_len=160)  # test_http_api's: the cluster is shared
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}


@pytest.fixture
def cluster(clusters):
    return clusters(engine=ENGINE, router=RouterConfig(http_port=0))


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLM(model_dir, **ENGINE)


def client(cl) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cl.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _valid(doc) -> bool:
    return (set(doc) == {"name", "age", "tags"} and isinstance(doc["name"], str) and len(doc["name"]) <= 6
            and isinstance(doc["age"], int) and 0 <= doc["age"] <= 99
            and all(t in ("x", "y") for t in doc["tags"]) and len(doc["tags"]) <= 2)


def test_penalties_and_logprobs_across_the_split_equal_the_engine(cluster, engine, model_dir):
    oa = client(cluster)
    model = oa.models.list().data[0].id
    ids = U.prompts(1, seed=77, lo=14, hi=20)[0]
    # Greedy: min_p would change nothing here, so it has a sampled test of its own (below).
    sampling = dict(temperature=0, max_tokens=20, presence_penalty=0.8, frequency_penalty=0.6,
                    ignore_eos=True, repetition_penalty=1.4, logit_bias={ids[0]: -5.0})
    want = engine.generate([ids], SamplingParams(logprobs=3, prompt_logprobs=3, **sampling))[0]
    body = {k: sampling[k] for k in ("presence_penalty", "frequency_penalty")}
    extra = {"ignore_eos": True, "repetition_penalty": 1.4}
    full = oa.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, logprobs=3, echo=True,
                                 logit_bias={str(ids[0]): -5}, extra_body=extra, **body)
    choice = full.choices[0]
    assert full.model_extra["pdserve_timings"]["ctx_worker"] == "ctx-0"  # it was split
    prompt_text = engine.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice.text == prompt_text + want.text
    lp = choice.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 20 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    # OpenAI's top_logprobs is keyed by text (byte tokens may share one), and holds the chosen token.
    assert all(tok in top for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # Chat, streamed: the same tokens and logprobs as a non-streamed request, chunk by chunk.
    messages = [{"role": "user", "content": "Say something."}]
    kwargs = dict(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5,
                  frequency_penalty=1.0, extra_body={"ignore_eos": True})
    whole = oa.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    streamed = [c for c in oa.chat.completions.create(stream=True, **kwargs) if c.choices]
    pieces = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [p.token for p in pieces] == [c.token for c in content]
    assert [p.logprob for p in pieces] == pytest.approx([c.logprob for c in content], abs=1e-6)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content

    # vLLM's continuous_usage_stats (GuideLLM sends it): every chunk carries the usage so far.
    chunks = list(oa.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, stream=True,
                                        stream_options={"include_usage": True, "continuous_usage_stats": True},
                                        extra_body={"ignore_eos": True}))
    done = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(ids) for c in chunks) and done == sorted(done) and done[-1] == 8

    # vLLM's prompt_logprobs extension: the prompt's own token and the top k, by token id.
    raw = oa.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0,
                                extra_body={"prompt_logprobs": 2}).model_dump()
    plps = raw["choices"][0]["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    for i, entry in enumerate(plps[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(want.prompt_logprobs[i].logprob, abs=1e-4)
        assert own["rank"] == want.prompt_logprobs[i].rank
    U.wait_drained(cluster)


def test_json_schema_and_regex_outputs_validate_streamed_or_not(cluster):
    oa = client(cluster)
    model = oa.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(3):
        out = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Person {seed}"}],
                                         max_tokens=100, temperature=1.0, seed=seed, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        assert _valid(json.loads(out.choices[0].message.content))
        chunks = oa.chat.completions.create(model=model, messages=[{"role": "user", "content": f"P{seed}"}],
                                            max_tokens=100, temperature=1.0, seed=seed, response_format=fmt,
                                            stream=True)
        assert _valid(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)))
    obj = oa.completions.create(model=model, prompt="JSON:", max_tokens=100, temperature=0.7, seed=4,
                                extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.choices[0].text), dict)
    regex = oa.completions.create(model=model, prompt="id:", max_tokens=30, temperature=1.0, seed=1,
                                  extra_body={"guided_regex": "[a-z]{2,5}-[0-9]{3}"})
    import re
    assert re.fullmatch("[a-z]{2,5}-[0-9]{3}", regex.choices[0].text)
    choice = oa.completions.create(model=model, prompt="pick:", max_tokens=10, temperature=1.0, seed=2,
                                   extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    U.wait_drained(cluster)


def test_min_p_across_the_split_keeps_every_draw_in_its_set(cluster, engine):
    """min_p where it cuts: the built-in model's logits are nearly flat (the top 20 within
    about 0.3 of each other), so at temperature 0.05 min_p 0.2 keeps the tokens whose raw
    logprob is within 0.05 x ln 5 (0.08) of the best: a few of the vocabulary at every step. Each
    draw of the split request (first token on the context worker, the rest on the generation
    worker) lies in that set, and the same seed without min_p draws outside it."""
    oa = client(cluster)
    temperature, min_p, seed = 0.05, 0.2, 1
    ids = U.prompts(1, seed=78, lo=14, hi=20)[0]
    params = SamplingParams(max_tokens=16, temperature=temperature, min_p=min_p, seed=seed, logprobs=20,
                            ignore_eos=True)

    def gap(entry, token_logprob: float) -> float:
        """log(p_T(token) / p_T(best)) at the temperature: raw logprob differences over T."""
        return (token_logprob - entry.top[0][1]) / temperature

    want = engine.generate([ids], params)[0]
    assert all(gap(e, e.logprob) >= math.log(min_p) - 1e-4 for e in want.logprobs)
    # The set is strictly smaller than the vocabulary at every step: the 20th best is outside it.
    assert all(gap(e, e.top[-1][1]) < math.log(min_p) for e in want.logprobs)
    plain = engine.generate([ids], params.replace(min_p=0.0))[0]
    assert any(gap(e, e.logprob) < math.log(min_p) for e in plain.logprobs)  # min_p decided some draws
    assert plain.token_ids != want.token_ids

    out = oa.completions.create(model=oa.models.list().data[0].id, prompt=ids, max_tokens=16,
                                temperature=temperature, seed=seed, logprobs=20,
                                extra_body={"min_p": min_p, "ignore_eos": True})
    choice = out.choices[0]
    assert out.model_extra["pdserve_timings"]["ctx_worker"] == "ctx-0"  # it was split
    assert choice.text == want.text
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    # The response's own figures: each drawn token within min_p of the step's best.
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert (lp - max(top.values())) / temperature >= math.log(min_p) - 1e-3
    U.wait_drained(cluster)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 2, "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 2, "logit_bias": {"999999": 1}}, "logit_bias[999999]"),
    ({"prompt": "x", "max_tokens": 2, "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "s", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
])
def test_bad_sampling_values_are_a_400_naming_the_field(cluster, body, param):
    oa = client(cluster)
    with pytest.raises(openai.BadRequestError) as info:
        extra = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens")}
        oa.completions.create(model=oa.models.list().data[0].id, prompt=body["prompt"],
                              max_tokens=body["max_tokens"], extra_body=extra)
    assert param in info.value.message
    ok = oa.completions.create(model=oa.models.list().data[0].id, prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_tokenize_detokenize_and_version_as_vllm_serves_them(cluster, engine):
    import http.client

    def call(method: str, path: str, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
        try:
            conn.request(method, path, json.dumps(body).encode() if body is not None else None,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    tok = engine.engine.tokenizer
    status, out = call("POST", "/tokenize", {"prompt": "héllo wörld", "return_token_strs": True})
    want = tok.encode("héllo wörld", add_special_tokens=True).ids
    assert status == 200 and out["tokens"] == want and out["count"] == len(want)
    assert out["max_model_len"] == ENGINE["max_seq_len"] and len(out["token_strs"]) == len(want)
    status, back = call("POST", "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": "héllo wörld"}
    # Chat messages: the template's text, as a chat request would be tokenized.
    messages = [{"role": "user", "content": "hi"}]
    status, chat = call("POST", "/tokenize", {"messages": messages})
    oa = client(cluster)
    usage = oa.chat.completions.create(model=oa.models.list().data[0].id, messages=messages, max_tokens=1).usage
    assert status == 200 and chat["count"] == usage.prompt_tokens
    status, version = call("GET", "/version")
    assert status == 200 and version["version"]
    status, err = call("POST", "/detokenize", {"tokens": [1, 10**7]})
    assert status == 400 and err["error"]["param"] == "tokens[1]"
    status, err = call("POST", "/tokenize", {"prompt": 5})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_n_and_best_of_share_one_prefill_and_one_transfer(cluster, engine):
    """n choices: one prefill on the context worker, one KV transfer, the candidates forked on
    the generation worker (shared prompt blocks, the partial one copied); choice i is what a
    single request with seed + i gives (vLLM's rule), so n=4 with a seed is reproducible."""
    oa = client(cluster)
    model = oa.models.list().data[0].id
    ids = U.prompts(1, seed=91, lo=13, hi=19)[0]  # not a multiple of tokens_per_block: a partial block
    single = [engine.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, seed=50 + i,
                                                    ignore_eos=True))[0] for i in range(4)]
    kwargs = dict(model=model, prompt=ids, max_tokens=10, temperature=1.0, seed=50, n=4,
                  extra_body={"ignore_eos": True})
    out = oa.completions.create(**kwargs)
    again = oa.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [s.text for s in single]
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # reproducible
    assert out.usage.completion_tokens == 40
    # One transfer: as many KV bytes as a single request of a fresh prompt of the same length.
    fresh_one, fresh_four = ([7 + (i * 31 + k) % 250 for i in range(len(ids))] for k in (1, 2))
    one = oa.completions.create(model=model, prompt=fresh_one, max_tokens=4, extra_body={"ignore_eos": True})
    four = oa.completions.create(model=model, prompt=fresh_four, max_tokens=4, n=4, seed=1,
                                 extra_body={"ignore_eos": True})
    t4, t1 = four.model_extra["pdserve_timings"], one.model_extra["pdserve_timings"]
    assert t4["ctx_worker"] == "ctx-0" and t4["kv_transfer_bytes"] == t1["kv_transfer_bytes"] > 0
    # Colocated (no split): the same four.
    local = oa.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "disaggregation": "never"}})
    assert [c.text for c in local.choices] == [s.text for s in single]

    # Chat, streamed: chunks carry their choice's index; each choice's text is the non-streamed one.
    chat = dict(model=model, messages=[{"role": "user", "content": "Go."}], max_tokens=8, temperature=1.0,
                seed=5, n=3, extra_body={"ignore_eos": True})
    whole = oa.chat.completions.create(**chat)
    texts = {i: "" for i in range(3)}
    reasons = {}
    for chunk in oa.chat.completions.create(stream=True, **chat):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert reasons == {0: "length", 1: "length", 2: "length"}

    # best_of: the n candidates with the highest cumulative logprob, best first.
    ranked = sorted(
        (engine.generate([ids], SamplingParams(max_tokens=6, temperature=1.0, seed=70 + i, ignore_eos=True,
                                               logprobs=0))[0] for i in range(4)),
        key=lambda o: -sum(e.logprob for e in o.logprobs))
    best = oa.completions.create(model=model, prompt=ids, max_tokens=6, temperature=1.0, seed=70, n=2,
                                 best_of=4, extra_body={"ignore_eos": True})
    assert [c.text for c in best.choices] == [o.text for o in ranked[:2]]
    assert best.choices[0].logprobs is None  # ranked by logprobs the client did not ask for
    U.wait_drained(cluster)


# Tool definitions make long prompts for a byte-level tokenizer: this cluster takes them, and reads
# "auto" output with the Hermes parser. Its test comes last: the module's other tests share one
# cluster, and each change of settings is a new launch.
TOOLS_ENGINE = dict(U.ENGINE, max_input_len=1536, max_seq_len=1800, max_num_tokens=2048)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"],
                                       "properties": {"tz": {"enum": ["UTC", "CET"]}}}}}


def _weather_args(args: dict) -> bool:
    return (set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 8
            and isinstance(args["days"], int) and 1 <= args["days"] <= 7)


@pytest.fixture
def tools_cluster(clusters):
    return clusters(engine=TOOLS_ENGINE, router=RouterConfig(http_port=0, tool_call_parser="hermes"))


def test_forced_tool_calls_validate_streamed_or_not_and_tool_turns_render(tools_cluster):
    cluster = tools_cluster
    oa = client(cluster)
    model = oa.models.list().data[0].id
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        out = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK],
                                         tool_choice=named, max_tokens=80, temperature=1.0, seed=seed)
        call = out.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert _weather_args(json.loads(call.function.arguments))
        assert out.choices[0].finish_reason == "stop"  # OpenAI's for a named tool_choice
        required = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER, CLOCK],
                                              tool_choice="required", parallel_tool_calls=False,
                                              max_tokens=300, temperature=1.0, seed=seed)
        calls = required.choices[0].message.tool_calls
        assert calls is not None, required.choices[0]
        assert len(calls) == 1 and required.choices[0].finish_reason == "tool_calls"
        args = json.loads(calls[0].function.arguments)
        assert _weather_args(args) if calls[0].function.name == "get_weather" else args["tz"] in ("UTC", "CET")
        # Streamed: tool_calls deltas (name first, then argument fragments) add up to one call.
        chunks = [c for c in oa.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=80,
            temperature=1.0, seed=seed, stream=True) if c.choices]
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
        assert _weather_args(json.loads("".join(d.function.arguments or "" for d in deltas)))
    # The conversation goes on with the call and its result: the template renders the tool turns.
    followup = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    after = oa.chat.completions.create(model=model, messages=followup, tools=[WEATHER], max_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert after.choices[0].message.content is not None and after.usage.prompt_tokens > 30
    # "auto": the model may answer or call, and the Hermes parser reads whichever it wrote. A random
    # model writes neither on its own, so a guided regex makes it write each (auto forces no
    # grammar of its own, so the client's applies), and the test checks what was parsed.
    call_regex = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 3\}\}'
                  r'\n</tool_call>')
    auto = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="auto",
                                      max_tokens=120, temperature=0, extra_body={"guided_regex": call_regex})
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls" and message.content is None, auto.choices[0]
    assert len(message.tool_calls) == 1 and message.tool_calls[0].id.startswith("call_")
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 3}
    # Streamed: the deltas add up to the same call.
    chunks = [c for c in oa.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=120, temperature=0,
        stream=True, extra_body={"guided_regex": call_regex}) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Oslo", "days": 3}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    # Plain text under "auto" stays content, with no call.
    answer = oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="auto",
                                        max_tokens=40, temperature=0,
                                        extra_body={"guided_choice": ["It is sunny in Oslo."]})
    assert answer.choices[0].message.content == "It is sunny in Oslo."
    assert answer.choices[0].message.tool_calls in (None, []) and answer.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=4,
                                   tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "tool_choice.function.name" in info.value.message and "nope" in info.value.message
    U.wait_drained(cluster)

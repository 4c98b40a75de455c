"""The OpenAI-compatible HTTP front door on a real cluster, with real clients: the official
``openai`` package for completions and chat (streamed and not), compared token for token with
gRPC and the in-process engine; raw HTTP for every error status, the SSE framing byte for
byte, a client that disconnects mid-stream (all KV blocks free afterwards) and 64 concurrent
streams. Every test ends with the drain check (no leaked block, no stuck request)."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import openai  # noqa: E402
import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve.cluster.front.openai.chat_template import ChatTemplate  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402
from pdserve.workers.loading.loader import load_tokenizer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ENGINE = dict(U.ENGINE, max_input_len=96, max_seq_len=160)
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture
def cluster(clusters):
    """1P1D with HTTP on an ephemeral port."""
    return clusters(engine=ENGINE, router=RouterConfig(http_port=0))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def client(cl) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cl.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def post(cl, path: str, body, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """A raw POST; returns (status, headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=120)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def get(cl, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cl.http_port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def grpc_text(cl, prompt, max_tokens: int, **kwargs) -> tuple[list[int], str, object]:
    with U.Client(f"127.0.0.1:{cl.port}") as c:
        out = c.generate(prompt, max_tokens=max_tokens, temperature=0.0, **kwargs)
    return out.token_ids, out.text, out.usage


def test_openai_client_completions_and_chat_match_grpc_and_the_engine(cluster, model_dir, tokenizer):
    oa = client(cluster)
    model = oa.models.list().data[0].id
    assert model == Path(model_dir).name

    ids = U.prompts(1, seed=301, lo=12, hi=20)[0]
    expected_ids = U.reference(model_dir, [ids], 24, ENGINE)[0]
    expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
    full = oa.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (len(ids), 24,
                                                                                               len(ids) + 24)
    assert full.model_extra["pdserve_timings"]["ctx_worker"] == "ctx-0"
    assert full.model_extra["pdserve_timings"]["kv_transfer_bytes"] > 0
    chunks = list(oa.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # One chunk per step that made a token, text or not (the byte-level vocabulary has ids with no
    # text and bytes that end no character): usage so far grows by one token a chunk, as in vLLM.
    counted = list(oa.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body=IGNORE_EOS))
    steps = [c.usage.completion_tokens for c in counted if c.choices and c.choices[0].finish_reason is None]
    assert steps[:23] == list(range(1, 24)), steps
    assert any(c.choices[0].text == "" for c in counted if c.choices and c.choices[0].finish_reason is None)
    assert "".join(c.choices[0].text for c in counted if c.choices) == expected

    # A text prompt: the same tokens as gRPC gives for the same text.
    _, grpc_out, grpc_usage = grpc_text(cluster, "The quick brown fox", 20, ignore_eos=True)
    text = oa.completions.create(model=model, prompt="The quick brown fox", max_tokens=20, temperature=0,
                                 extra_body=IGNORE_EOS)
    assert text.choices[0].text == grpc_out and text.usage.prompt_tokens == grpc_usage.prompt_tokens

    # Chat: the messages through the model's template, then the same tokens as gRPC for that text.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    rendered = ChatTemplate.from_model_dir(model_dir).render(messages)
    _, grpc_chat, grpc_chat_usage = grpc_text(cluster, rendered, 16, ignore_eos=True)
    chat = oa.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                      extra_body=IGNORE_EOS)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == grpc_chat
    assert chat.usage.prompt_tokens == grpc_chat_usage.prompt_tokens == len(
        tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert chat.usage.completion_tokens == 16 and chat.choices[0].finish_reason == "length"
    stream = list(oa.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                             stream=True, extra_body=IGNORE_EOS))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == grpc_chat
    assert stream[-1].choices[0].finish_reason == "length" and stream[-1].choices[0].delta.content is None
    U.wait_drained(cluster)


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(cluster, model_dir, tokenizer):
    oa = client(cluster)
    ids = U.prompts(1, seed=302, lo=12, hi=20)[0]
    full = tokenizer.decode(U.reference(model_dir, [ids], 40, ENGINE)[0], skip_special_tokens=True)
    # A stop string from the middle of the greedy text, free of replacement characters.
    start = next(i for i in range(len(full) // 3, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    expected = full[:full.find(stop)]
    for stream in (False, True):
        out = oa.completions.create(model=Path(model_dir).name, prompt=ids, max_tokens=40, temperature=0,
                                    stop=[stop, "\x00never"], stream=stream, extra_body=IGNORE_EOS)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == expected, stream
        assert chunks[-1].choices[0].finish_reason == "stop"
    # gRPC takes the same stop strings (one path in the router).
    _, text, usage = grpc_text(cluster, ids, 40, ignore_eos=True, stop=[stop])
    assert text == expected and usage.completion_tokens < 40
    U.wait_drained(cluster)  # the generation attempts cut short by the stop freed their blocks


def test_bad_requests_get_openai_error_objects_and_the_server_stays_up(cluster):
    cases = [  # (body or raw bytes, path, status, param)
        (b"{not json", "/v1/completions", 400, None),
        (b"[1, 2]", "/v1/completions", 400, None),
        ({"prompt": "x", "max_tokens": "many"}, "/v1/completions", 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "/v1/completions", 400, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "/v1/completions", 400, "top_p"),
        ({"prompt": [1] * 200}, "/v1/completions", 400, "prompt"),
        ({"prompt": "x", "max_tokens": 160}, "/v1/completions", 400, "max_tokens"),  # 1 + 160 > max_seq_len
        ({"prompt": "x", "n": 20}, "/v1/completions", 400, "n"),
        ({"prompt": "x", "logprobs": 30}, "/v1/completions", 400, "logprobs"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "/v1/completions", 400, "best_of"),
        ({"prompt": "x", "logit_bias": {"3000": 5}}, "/v1/completions", 400, "logit_bias[3000]"),
        ({"prompt": "x", "frobnicate": 1}, "/v1/completions", 400, "frobnicate"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "/v1/completions", 400, "stop"),
        ({"prompt": "x", "priority": 7}, "/v1/completions", 400, "priority"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "/v1/chat/completions", 400, "tools[0].function"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
         "/v1/chat/completions", 400, "response_format.type"),
        ({"messages": [{"role": "user", "content": "x" * 300}]}, "/v1/chat/completions", 400, "messages"),
        ({"messages": []}, "/v1/chat/completions", 400, "messages"),
        ({"model": "gpt-4o", "prompt": "x"}, "/v1/completions", 404, "model"),
        ({"prompt": "x"}, "/v1/nothing-here", 404, None),
    ]
    for body, path, status, param in cases:
        got, headers, raw = post(cluster, path, body)
        assert got == status, (body, got, raw[:300])
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["param"] == param, (body, error)
        if param:
            assert param in error["message"], error  # the message names the field too
    got, headers, raw = post(cluster, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "bad id"})
    assert got == 400 and json.loads(raw)["error"]["param"] == "X-Request-Id"
    # Still serving, and the request id header is taken and echoed.
    got, headers, raw = post(cluster, "/v1/completions", {"prompt": "hello", "max_tokens": 3},
                             {"X-Request-Id": "http-req-1"})
    assert got == 200 and headers["X-Request-Id"] == "http-req-1"
    assert json.loads(raw)["id"] == "cmpl-http-req-1"
    assert get(cluster, "/health") == (200, b'{"status":"ok"}')
    U.wait_drained(cluster)


def test_health_and_metrics_follow_the_router(cluster):
    gen = cluster.workers["gen-0"]
    ray.get(gen.test_hook.remote("leak_blocks", 987_001, 20), timeout=U.RAY_TIMEOUT_S)
    U.wait_for(lambda: get(cluster, "/health")[0] == 503, 30, "HTTP health 503")
    ray.get(gen.test_hook.remote("release_leak", 987_001), timeout=U.RAY_TIMEOUT_S)
    U.wait_for(lambda: get(cluster, "/health")[0] == 200, 30, "HTTP health 200 again")
    status, text = get(cluster, "/metrics")
    metrics = dict(re.findall(r'^(pdserve_router_requests_total\{outcome="\w+"\}) (\S+)$', text.decode(), re.M))
    grpc_totals = U.status(cluster.port).totals
    assert status == 200 and float(metrics['pdserve_router_requests_total{outcome="received"}']) == grpc_totals.received
    assert 'pdserve_worker_healthy{worker="gen-0"} 1.0' in text.decode()
    U.wait_drained(cluster)


def test_sse_framing_byte_for_byte(cluster):
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True,
                                            "stream_options": {"include_usage": True}, "ignore_eos": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                                 "stream": True, "ignore_eos": True})):
        status, headers, raw = post(cluster, path, body, {"X-Request-Id": f"sse-{len(path)}"})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), headers
        assert headers["X-Request-Id"] == f"sse-{len(path)}"
        text = raw.decode()
        # Every event is exactly "data: <payload>\n\n"; the stream ends with the [DONE] event.
        events = re.findall(r"data: ([^\n]*)\n\n", text)
        assert "".join(f"data: {e}\n\n" for e in events) == text
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
        objects = [json.loads(e) for e in events[:-1]]
        assert all(o["id"] == objects[0]["id"] for o in objects)
        finishes = [o["choices"][0]["finish_reason"] for o in objects if o["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        if "chat" in path:
            assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(o["object"] == "chat.completion.chunk" for o in objects)
        else:
            assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == 5
    U.wait_drained(cluster)


def test_a_client_that_disconnects_mid_stream_frees_every_block(cluster):
    gen = cluster.workers["gen-0"]
    before = U.status(cluster.port).totals
    ray.get(gen.test_hook.remote("slow_steps", 0.05), timeout=U.RAY_TIMEOUT_S)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 140,
                                                            "stream": True, "ignore_eos": True}),
                     {"Content-Type": "application/json", "X-Request-Id": "leaver"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the first token arrived: it is decoding
        phases = ray.get(cluster.router.request_phases.remote(), timeout=U.RAY_TIMEOUT_S)
        assert "leaver" in phases
        conn.sock.shutdown(2)  # the client goes away mid-stream
        conn.close()
        U.wait_for(lambda: "leaver" not in ray.get(cluster.router.request_phases.remote(), timeout=30), 30,
                   "the router to drop the request")
    finally:
        ray.get(gen.test_hook.remote("slow_steps", 0.0), timeout=U.RAY_TIMEOUT_S)
    st = U.wait_drained(cluster)  # every worker's blocks free, nothing left anywhere
    assert st.totals.completed == before.completed  # cancelled, not finished


def test_64_concurrent_streams(cluster, model_dir, tokenizer):
    n = 64
    batch = U.prompts(n, seed=303, lo=6, hi=24)
    expected = [tokenizer.decode(ids, skip_special_tokens=True) for ids in U.reference(model_dir, batch, 12, ENGINE)]

    async def one(session, i):
        body = {"prompt": batch[i], "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
        text, finish = "", None
        async with session.post(f"http://127.0.0.1:{cluster.http_port}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        return text, finish

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(n)))

    results = U.run(go(), 400)
    assert [t for t, _ in results] == expected and all(f == "length" for _, f in results)
    U.wait_drained(cluster)


def test_queue_full_no_worker_and_deadline_statuses(clusters):
    """No context worker, one generation worker, max_inflight 1 and max_queue 2: a fourth request
    is 429, `disaggregation: always` is 503 (no context worker), an expired deadline is 504."""
    cl = clusters(engine=ENGINE, num_context_workers=0,
                  router=RouterConfig(http_port=0, max_queue=2, max_inflight=1))
    gen = cl.workers["gen-0"]
    ray.get(gen.test_hook.remote("slow_steps", 0.05), timeout=U.RAY_TIMEOUT_S)
    try:
        status, _, raw = post(cl, "/v1/completions", {"prompt": "x", "max_tokens": 4, "disaggregation": "always"})
        assert status == 503 and json.loads(raw)["error"]["type"] == "service_unavailable", raw

        status, _, raw = post(cl, "/v1/completions", {"prompt": [5, 6], "max_tokens": 100, "ignore_eos": True,
                                                      "deadline_ms": 300})
        assert status == 504 and json.loads(raw)["error"]["code"] == "deadline_exceeded", raw

        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                url = f"http://127.0.0.1:{cl.http_port}/v1/completions"

                async def send(i):
                    async with session.post(url, json={"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True},
                                            headers={"X-Request-Id": f"q{i}"}) as resp:
                        return resp.status, await resp.json()

                running = [asyncio.create_task(send(i)) for i in range(3)]  # 1 in flight + 2 queued
                deadline = time.monotonic() + 30
                while (await cl.router.debug_state.remote())["waiting"] < 2:
                    assert time.monotonic() < deadline, "the queue never filled"
                    await asyncio.sleep(0.02)
                refused = await send(3)
                return refused, await asyncio.gather(*running)

        (status, body), served = U.run(go(), 180)
        assert status == 429 and body["error"]["type"] == "rate_limit_error", body
        assert [s for s, _ in served] == [200, 200, 200]
        assert all(b["usage"]["completion_tokens"] == 30 for _, b in served)
    finally:
        ray.get(gen.test_hook.remote("slow_steps", 0.0), timeout=U.RAY_TIMEOUT_S)
    U.wait_drained(cl)

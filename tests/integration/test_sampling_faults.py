"""The sampling record's state follows a request through a pause (eviction and recompute) and
through a generation worker killed mid-stream (the retry continues on a restarted worker after
the tokens the client has): penalties still count the same output, so greedy answers equal an
undisturbed engine's token for token, and a structured output's grammar (a JSON schema, a
forced tool call) is replayed from the output so far, so the JSON and the call still
validate."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.cluster.front.openai.tools import (  # noqa: E402
    calls_from_forced_output,
    guided_decoding,
    parse_tools,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
          "properties": {"word": {"type": "string", "maxLength": 10},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
PENALTIES = dict(presence_penalty=0.9, frequency_penalty=0.7, repetition_penalty=1.3)
# A forced tool call decodes under the schema the door derives from the tools (tools.py).
TOOLS = parse_tools({"tool_choice": "required", "parallel_tool_calls": False, "tools": [
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["key", "limit"],
        "properties": {"key": {"type": "string", "maxLength": 6},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 9}}}}}]})


def _valid_call(text: str) -> bool:
    calls = calls_from_forced_output(TOOLS, text)
    if len(calls) != 1 or calls[0].name != "lookup":
        return False
    args = json.loads(calls[0].arguments)
    return set(args) == {"key", "limit"} and len(args["key"]) <= 6 and 1 <= args["limit"] <= 9


def _valid(text: str) -> bool:
    doc = json.loads(text)
    return set(doc) == {"word", "n"} and len(doc["word"]) <= 10 and 0 <= doc["n"] <= 999


def test_pauses_keep_penalties_and_grammars(model_dir):
    """A pool too small for the batch under MAX_UTILIZATION: requests are paused and
    recomputed, and their outputs are the same as with room for all."""
    prompts = U.prompts(10, seed=41, lo=10, hi=24)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **PENALTIES) for _ in prompts]
    guided = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, guided=("json_schema", json.dumps(SCHEMA)))
              for i in range(6)]
    roomy = LLM(model_dir, tokens_per_block=4, num_kv_blocks=1024, max_batch_size=16)
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    want_json = [o.text for o in roomy.generate(prompts[:6], guided)]
    tight = LLM(model_dir, tokens_per_block=4, num_kv_blocks=60, max_batch_size=16,
                capacity_scheduler_policy="MAX_UTILIZATION")
    got = tight.generate(prompts, params)
    got_json = tight.generate(prompts[:6], guided)
    assert tight.stats.pauses > 0
    assert [o.token_ids for o in got] == want
    assert [o.text for o in got_json] == want_json  # the seed, the position and the grammar decide
    assert all(_valid(t) for t in want_json)
    # Forced tool calls: their grammar state too follows a pause.
    calls = [SamplingParams(max_tokens=80, temperature=1.0, seed=30 + i, guided=guided_decoding(TOOLS))
             for i in range(4)]
    want_calls = [o.text for o in roomy.generate(prompts[:4], calls)]
    assert [o.text for o in tight.generate(prompts[:4], calls)] == want_calls
    assert all(_valid_call(t) for t in want_calls)
    # n candidates forked from one prefill: paused and recomputed like any request.
    several = [SamplingParams(n=3, max_tokens=40, temperature=0.9, seed=20 + i, ignore_eos=True, **PENALTIES)
               for i in range(4)]
    want_n = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts[:4], several)]
    paused_before = tight.stats.pauses
    got_n = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts[:4], several)]
    assert tight.stats.pauses > paused_before and got_n == want_n
    kv = tight.engine.core.kv
    assert kv.get_num_free_blocks() == kv.num_blocks


def test_a_killed_generation_worker_keeps_penalties_and_grammars(cluster, model_dir):
    """1P1D; the generation worker is killed while penalized and structured requests stream on
    it; their retries continue after what the client has (the prompt folds the streamed tokens
    in), and the answers are the undisturbed engine's."""
    prompts = U.prompts(6, seed=43, lo=8, hi=18)
    engine = LLM(model_dir, **U.ENGINE)
    want = [o.token_ids for o in engine.generate(
        prompts[:3], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, **PENALTIES))]
    guided = [SamplingParams(max_tokens=60, temperature=1.0, seed=10 + i,
                             guided=("json_schema", json.dumps(SCHEMA))) for i in range(3)]
    want_json = [o.token_ids for o in engine.generate(prompts[3:], guided)]
    call = SamplingParams(max_tokens=80, temperature=1.0, seed=40, guided=guided_decoding(TOOLS))
    want_call = engine.generate([prompts[0]], call)[0].token_ids
    cl = cluster(num_context_workers=1, num_generation_workers=1)
    streamed: dict[str, int] = {}

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            await cl.workers["gen-0"].test_hook.remote("slow_steps", 0.08)
            track = lambda r: streamed.__setitem__(r.request_id, len(r.tokens))  # noqa: E731
            tasks = [asyncio.create_task(U.generate(stub, f"pen{i}", p, 30, on_delta=track, ignore_eos=True,
                                                    **PENALTIES))
                     for i, p in enumerate(prompts[:3])]
            tasks += [asyncio.create_task(U.generate(
                stub, f"json{i}", p, 60, on_delta=track, temperature=1.0, seed=10 + i,
                structured={"json_schema": json.dumps(SCHEMA)})) for i, p in enumerate(prompts[3:])]
            tasks.append(asyncio.create_task(U.generate(
                stub, "call", prompts[0], 80, on_delta=track, temperature=1.0, seed=40,
                structured={"json_schema": guided_decoding(TOOLS)[1]})))
            while sum(1 for k in streamed.values() if k >= 3) < 7:
                assert not any(t.done() for t in tasks), "a request finished before the fault"
                await asyncio.sleep(0.02)
            ray.kill(cl.workers["gen-0"], no_restart=False)  # Ray restarts it
            return await asyncio.gather(*tasks)

    results = U.run(go(), 240)
    assert [r.code for r in results] == [None] * 7, [(r.request_id, r.details) for r in results if r.code]
    assert sum(r.last.timings.retries for r in results) >= 3
    assert [r.tokens for r in results[:3]] == want
    assert [r.tokens for r in results[3:6]] == want_json
    assert results[6].tokens == want_call
    tok = engine.engine.tokenizer
    assert all(_valid(tok.decode(r.tokens, skip_special_tokens=True)) for r in results[3:6])
    assert _valid_call(tok.decode(results[6].tokens, skip_special_tokens=True))
    U.wait_drained(cl)

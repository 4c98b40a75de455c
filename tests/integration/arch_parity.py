"""Per-architecture parity with transformers, shared by the architecture tests.

``build_hf_model`` makes a small random transformers model of a family (float32, eager
attention, norms and biases randomised so they matter, the LM head scaled so greedy choices are
not decided by float noise) and saves it with the byte tokenizer. Then:

- ``check_engine_parity``: pdserve's in-process engine, greedy, against ``hf.generate``: once
  with chunked prefill and prefix reuse (prompts sharing a prefix, the prefix cached by an
  earlier request), once with a KV pool small enough that MAX_UTILIZATION pauses requests and
  recomputes them (a model whose every layer is windowed: short prompts that grow to their
  window). Tokens must be equal.
- ``check_disagg_parity``: a context worker and a generation worker in their own processes, the
  KV cache moved over torch.distributed (gloo); the tokens must be transformers'. Returns the
  transfer figures both sides report.
"""
from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers

from pdserve import LLM, SamplingParams
from pdserve.scheduler import LlmRequestType
from pdserve.transport.requests import UpdateKind, WireRequest
from pdserve.workers.loading.memory import sliding_window_of
from pdserve.workers.loading.loader import load_config
from pdserve.workers.process.rpc_worker import RpcWorkerClient
from pdserve.workers.loading.tiny_model import build_byte_tokenizer

VOCAB = 300
MAX_NEW = 10
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# Engine shapes: chunked prefill with block reuse; a pool so small MAX_UTILIZATION must pause.
CHUNKED_REUSE = dict(tokens_per_block=4, num_kv_blocks=160, max_batch_size=8, enable_block_reuse=True,
                     context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4, max_num_tokens=16)
PAUSING = dict(tokens_per_block=4, num_kv_blocks=20, max_batch_size=8, enable_block_reuse=False,
               capacity_scheduler_policy="MAX_UTILIZATION", max_num_tokens=128)
DISAGG_ENGINE = dict(tokens_per_block=4, num_kv_blocks=128, max_batch_size=8, max_num_tokens=16,
                     context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
                     enable_block_reuse=True)


def build_hf_model(tmp: Path, config_cls: str, overrides: dict[str, Any] | None = None, *,
                   seed: int = 0, architecture: str | None = None, spread: float = 20.0,
                   name: str | None = None) -> tuple[Any, Path]:
    """A random ``config_cls`` model (SMALL sizes, overridden by ``overrides``) saved under tmp.
    ``architecture``: config.json's entry, default the config class name with ForCausalLM."""
    cfg = getattr(transformers, config_cls)(**{**SMALL, **(overrides or {})})
    cfg.architectures = [architecture or config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        # Random init leaves the logits nearly flat: spread them, and move norms and biases off
        # their initial values so a missing one shows.
        hf.get_output_embeddings().weight.mul_(spread)
        for pname, p in hf.named_parameters():
            if "norm" in pname or pname.endswith("bias") or pname.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.1)
    out = Path(tmp) / (name or config_cls)
    hf.save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save(str(out / "tokenizer.json"))
    return hf, out


def prompts(seed: int = 1, shared_prefix: bool = True) -> list[list[int]]:
    """Six prompts of 3-47 new tokens; with shared_prefix they start with parts of one prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(24)]
    out = []
    for n in (3, 9, 17, 30, 47, 6):
        tail = [rng.randrange(3, VOCAB) for _ in range(n)]
        out.append(prefix[: 8 + n % 16] + tail if shared_prefix else tail)
    return out


_REFERENCE: dict[tuple, list[list[int]]] = {}


def reference(hf: Any, batch: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy continuations (memoised per model and prompts: the engine and the
    1P1D checks of one model share them)."""
    key = (id(hf), max_new, tuple(map(tuple, batch)))
    if key not in _REFERENCE:
        _REFERENCE[key] = _generate(hf, batch, max_new)
    return _REFERENCE[key]


def _generate(hf: Any, batch: list[list[int]], max_new: int) -> list[list[int]]:
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=None,
                                        pad_token_id=0)
    out = []
    # generate() merges the model's own EOS into ``gen``: the engine runs with ignore_eos.
    model_eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            for p in batch:
                ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                  generation_config=gen)
                out.append(ids[0, len(p):].tolist())
    finally:
        hf.generation_config.eos_token_id = model_eos
    return out


def check_engine_parity(hf: Any, model_dir: Path, batch: list[list[int]] | None = None,
                        **engine: Any) -> dict[str, int]:
    """Greedy tokens equal transformers' with chunked prefill + prefix reuse, and under pauses.
    Returns {"reused_blocks", "pauses", "chunk_steps"}."""
    batch = batch or prompts()
    expected = reference(hf, batch)

    llm = LLM(model_dir, **{**CHUNKED_REUSE, **engine})
    first = llm.generate([batch[4]], GREEDY)  # caches the shared prefix (and its own tail)
    assert [o.token_ids for o in first] == [expected[4]]
    outs = llm.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == expected, "chunked prefill with prefix reuse"
    kv = llm.engine.core.kv
    reused = kv.num_reused_blocks
    assert reused > 0, "the shared prefix was meant to be reused"
    assert kv.get_num_free_blocks() == kv.num_blocks
    steps = llm.stats.steps

    pause_batch, pausing = batch, PAUSING
    if sliding_window_of(load_config(model_dir)) is not None:
        # Every layer windowed: blocks leave the pool as the window passes, so long prompts
        # need no pause. Short ones, admitted small and growing to their window, do.
        pause_batch, pausing = [p[-5:] for p in batch], {**PAUSING, "num_kv_blocks": 8}
    paused = LLM(model_dir, **{**pausing, **engine})
    outs = paused.generate(pause_batch, GREEDY)
    assert [o.token_ids for o in outs] == reference(hf, pause_batch), "after pause and recompute"
    assert paused.stats.pauses > 0, "the pool was meant to be small enough to force pauses"
    kv = paused.engine.core.kv
    assert kv.get_num_free_blocks() == kv.num_blocks
    return {"reused_blocks": reused, "pauses": paused.stats.pauses, "chunk_steps": steps}


class _Worker:
    def __init__(self, proc: subprocess.Popen, client: RpcWorkerClient, worker_id: str) -> None:
        self.proc, self.client, self.worker_id = proc, client, worker_id

    def call(self, method: str, *args: Any, timeout_s: float = 60.0) -> Any:
        return self.client.call(method, *args, timeout_s=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout_s=10)
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=30)


@contextmanager
def disagg_pair(model_dir: Path, log_dir: Path, engine: dict[str, Any] | None = None,
                gen_engine: dict[str, Any] | None = None) -> Iterator[tuple[_Worker, _Worker]]:
    """A context worker and a generation worker (``python -m pdserve.workers.process.rpc_worker``);
    ``gen_engine``: the generation worker's settings that differ from ``engine``."""
    started: list[_Worker] = []
    engines = {"context": {**DISAGG_ENGINE, **(engine or {})}}
    engines["generation"] = {**engines["context"], **(gen_engine or {})}

    def spawn(role: str, worker_id: str, peers: dict[str, str]) -> _Worker:
        cmd = [sys.executable, "-m", "pdserve.workers.process.rpc_worker", "--role", role, "--worker-id", worker_id,
               "--model", str(model_dir), "--engine", json.dumps(engines[role]), "--peers", json.dumps(peers)]
        log = open(Path(log_dir) / f"{worker_id}.log", "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            raise RuntimeError(f"{worker_id} did not start: {(Path(log_dir) / log.name).read_text()[-3000:]}")
        worker = _Worker(proc, RpcWorkerClient(json.loads(line)["address"]), worker_id)
        started.append(worker)
        return worker

    try:
        ctx = spawn("context", "ctx-0", {})
        gen = spawn("generation", "gen-0", {"ctx-0": "%s:%d" % ctx.client.address})
        yield ctx, gen
    finally:
        for w in started:
            w.stop()


def wait_drained(worker: Any, timeout_s: float = 30.0) -> dict:
    """Until the worker holds no request and every block is free; its status then."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = worker.call("status")
        if status["free_blocks"] == status["total_blocks"] and not status["requests_by_state"]:
            assert status["violations"] == [], status["violations"]
            return status
        assert time.monotonic() < deadline, f"{worker.worker_id} did not drain: {status}"
        time.sleep(0.1)


def check_disagg_parity(hf: Any, model_dir: Path, log_dir: Path, batch: list[list[int]] | None = None,
                        engine: dict[str, Any] | None = None,
                        gen_engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every prompt prefilled on the context worker, its KV moved, decoded on the generation
    worker; tokens == transformers'. Returns {"bytes", "blocks", "records", "prompt_tokens"}
    from the two workers' status (bytes sent == bytes received)."""
    batch = batch or prompts()
    expected = reference(hf, batch)
    with disagg_pair(model_dir, log_dir, engine, gen_engine) as (ctx, gen):
        done = {}
        for rid, p in enumerate(batch):  # every prompt in flight at once
            ctx.call("submit", WireRequest(rid, None, p, 1, type=LlmRequestType.CONTEXT_ONLY,
                                           sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        for rid in range(len(batch)):
            last = ctx.call("collect", rid, 60.0)[-1]
            assert last.kind == UpdateKind.CONTEXT_DONE and last.context_phase_params is not None, last
            done[rid] = last
        for rid, p in enumerate(batch):
            gen.call("submit", WireRequest(rid, None, p, MAX_NEW, type=LlmRequestType.GENERATION_ONLY,
                                           context_phase_params=done[rid].context_phase_params,
                                           sampling=SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                   ignore_eos=True)))
        got = []
        for rid in range(len(batch)):
            tokens = list(done[rid].new_token_ids)
            for u in gen.call("collect", rid, 90.0):
                tokens.extend(u.new_token_ids)
            got.append(tokens)
        assert got == expected, "1P1D tokens differ from transformers"
        gstatus, cstatus = wait_drained(gen), wait_drained(ctx)
    sent, received = cstatus["transfers"], gstatus["transfers"]
    assert received["received"] == sent["sent"] == len(batch)
    assert received["bytes_received"] == sent["bytes_sent"] > 0
    return {"bytes": sent["bytes_sent"], "records": received.get("records", []),
            "prompt_tokens": sum(len(p) for p in batch), "generation_status": gstatus}

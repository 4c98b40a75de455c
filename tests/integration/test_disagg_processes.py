"""Disaggregated serving with real OS processes: a context worker and a generation worker, KV
blocks moving over torch.distributed (gloo) between them, control messages over RPC.

Covers token parity with the in-process engine, a peer killed mid-transfer (in both directions),
lease expiry, generation-side prefix reuse cutting the bytes sent, and a full generation KV
pool holding DISAGG_GENERATION_INIT requests until blocks free up. Every test ends with the
survivors drained: free blocks == total and no invariant violation.

The first tests share one pair with the default settings (``pair``: each process start costs
seconds of imports), each counting only the transfers its own requests make and using request ids
of its own; the tests that stall, kill or resize a worker spawn their own.
"""
from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler import LlmRequestType
from pdserve.transport.requests import UpdateKind, WireRequest, WireUpdate
from pdserve.workers.process.rpc_worker import RpcWorkerClient
from pdserve.workers.loading.tiny_model import make_tiny_model

import arch_parity as P  # noqa: E402

ENGINE = dict(tokens_per_block=4, num_kv_blocks=96, max_batch_size=8, max_num_tokens=16,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
              enable_block_reuse=True)
GREEDY = dict(temperature=0.0, ignore_eos=True)
MAX_NEW = 8


class Worker:
    def __init__(self, proc: subprocess.Popen, client: RpcWorkerClient, worker_id: str) -> None:
        self.proc, self.client, self.worker_id = proc, client, worker_id

    def call(self, method, *args, timeout_s=60.0):
        return self.client.call(method, *args, timeout_s=timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown", timeout_s=10)
                self.proc.wait(timeout=20)
            except Exception:
                self.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("disagg") / "tiny", hidden_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, vocab_size=384, seed=3)


def _spawner(model_dir: Path, tmp_path: Path, started: list[Worker]):
    def _spawn(role: str, worker_id: str, *, engine=None, peers=None, **opts) -> Worker:
        cmd = [sys.executable, "-m", "pdserve.workers.process.rpc_worker", "--role", role,
               "--worker-id", worker_id, "--model", str(model_dir),
               "--engine", json.dumps({**ENGINE, **(engine or {})}),
               "--peers", json.dumps(peers or {})]
        for key, value in opts.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        log = open(tmp_path / f"{worker_id}-{len(started)}.log", "w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        if not ready:
            proc.kill()
            raise TimeoutError(f"{worker_id} did not start; see {log.name}")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{worker_id} exited: {(tmp_path / log.name).read_text()[-2000:]}")
        worker = Worker(proc, RpcWorkerClient(json.loads(line)["address"]), worker_id)
        started.append(worker)
        return worker

    return _spawn


@pytest.fixture
def spawn(model_dir, tmp_path):
    started: list[Worker] = []
    yield _spawner(model_dir, tmp_path, started)
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """A context and a generation worker with the default settings, for the tests that neither
    stall, kill nor resize a worker (each leaves both drained)."""
    started: list[Worker] = []
    spawn = _spawner(model_dir, tmp_path_factory.mktemp("pair"), started)
    try:
        ctx = spawn("context", "ctx-0")
        gen = spawn("generation", "gen-0", peers={"ctx-0": "%s:%d" % ctx.client.address})
        yield ctx, gen
    finally:
        for worker in started:
            worker.stop()


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _submit_context(ctx: Worker, rid: int, prompt: list[int], sampling=GREEDY) -> None:
    ctx.call("submit", WireRequest(rid, None, prompt, 1, type=LlmRequestType.CONTEXT_ONLY,
                                   sampling=SamplingParams(**{"max_tokens": 1, **sampling})))


def _context_result(ctx: Worker, rid: int) -> WireUpdate:
    updates = ctx.call("collect", rid, 60.0)
    last = updates[-1]
    assert last.kind == UpdateKind.CONTEXT_DONE and last.context_phase_params is not None, last
    return last


def _submit_generation(gen: Worker, rid: int, prompt: list[int], ctx_done: WireUpdate,
                       max_new: int = MAX_NEW, sampling=GREEDY) -> None:
    gen.call("submit", WireRequest(rid, None, prompt, max_new, type=LlmRequestType.GENERATION_ONLY,
                                   context_phase_params=ctx_done.context_phase_params,
                                   sampling=SamplingParams(**{"max_tokens": max_new, **sampling})))


def _generation_result(gen: Worker, rid: int, ctx_done: WireUpdate) -> tuple[list[int], WireUpdate]:
    updates = gen.call("collect", rid, 90.0)
    tokens = list(ctx_done.new_token_ids)
    for u in updates:
        tokens.extend(u.new_token_ids)
    return tokens, updates[-1]


def _wait_receiving(gen: Worker, request_id: int, timeout_s: float = 30.0) -> None:
    """Until the generation side's receive is RECEIVING: the header arrived and the payload,
    held by the context worker's stalled send, is due."""
    deadline = time.monotonic() + timeout_s
    while gen.call("request_states").get(request_id) != "RECEIVING":
        assert time.monotonic() < deadline, gen.call("request_states")
        time.sleep(0.02)


_wait_drained = P.wait_drained


def test_disaggregated_output_matches_the_in_process_engine(pair, model_dir):
    ctx, gen = pair
    gbefore, cbefore = gen.call("status")["transfers"], ctx.call("status")["transfers"]
    prompts = _prompts(8, seed=11)
    prompts.append(prompts[0][:] + [5, 6, 7])  # shares a prefix: reuse on both sides
    expected = [o.token_ids for o in LLM(model_dir, **ENGINE).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, **GREEDY))]

    for rid, p in enumerate(prompts):  # a mixed batch: every prompt in flight at once
        _submit_context(ctx, rid, p)
    ctx_done = {rid: _context_result(ctx, rid) for rid in range(len(prompts))}
    for rid, p in enumerate(prompts):
        _submit_generation(gen, rid, p, ctx_done[rid])
    got = [_generation_result(gen, rid, ctx_done[rid])[0] for rid in range(len(prompts))]

    assert got == expected
    gstatus, cstatus = _wait_drained(gen), _wait_drained(ctx)
    assert gstatus["transfers"]["received"] - gbefore["received"] == len(prompts)
    assert cstatus["transfers"]["sent"] - cbefore["sent"] == len(prompts)
    assert gstatus["transfers"]["bytes_received"] == cstatus["transfers"]["bytes_sent"]
    assert (gstatus["transfers"]["bytes_received"] - gbefore["bytes_received"]
            == cstatus["transfers"]["bytes_sent"] - cbefore["bytes_sent"] > 0)


def test_seeded_sampling_draws_the_same_tokens_across_the_hand_off(pair, model_dir):
    # The first token is drawn on the context worker, the rest on the generation worker; draws
    # are keyed by (seed, position), so the tokens are the colocated engine's.
    ctx, gen = pair
    sampled = dict(temperature=0.9, top_k=50, top_p=0.95, seed=77, ignore_eos=True)
    prompts = _prompts(4, seed=12)
    expected = [o.token_ids for o in LLM(model_dir, **ENGINE).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, **sampled))]
    got = []
    for rid, p in enumerate(prompts, start=100):  # ids the pair has not seen
        _submit_context(ctx, rid, p, sampled)
        done = _context_result(ctx, rid)
        _submit_generation(gen, rid, p, done, sampling=sampled)
        got.append(_generation_result(gen, rid, done)[0])
    assert got == expected
    greedy = [o.token_ids for o in LLM(model_dir, **ENGINE).generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, **GREEDY))]
    assert got != greedy  # it did sample
    _wait_drained(gen), _wait_drained(ctx)


def test_generation_side_prefix_reuse_cuts_the_bytes_sent(pair):
    ctx, gen = pair
    prompt = _prompts(1, seed=5, lo=21, hi=21)[0]  # 5 full blocks + 1 token with B = 4
    sizes = []
    for rid in (201, 202):  # ids the pair has not seen
        _submit_context(ctx, rid, prompt)
        done = _context_result(ctx, rid)
        _submit_generation(gen, rid, prompt, done)
        _generation_result(gen, rid, done)
        records = [r for r in gen.call("status")["transfers"]["records"] if r["request_id"] == rid]
        sizes.append(records[-1]["nbytes"])
    # The second time the generation worker's own cache holds the 5 full blocks: only the
    # last (partial) block travels.
    assert sizes[1] * 6 == sizes[0]
    _wait_drained(gen), _wait_drained(ctx)


def test_full_generation_pool_keeps_generation_init_requests_waiting(spawn):
    # Each send stalls a while, so the first request still holds the generation pool when the
    # others arrive however slowly the submissions go (a loaded machine finished it first).
    ctx = spawn("context", "ctx-0", stall_send_s=3.0)
    # 9 blocks: one 24-token request needs ceil((24 + 8) / 4) = 8 to completion under GNE.
    gen = spawn("generation", "gen-0", engine={"num_kv_blocks": 9},
                peers={"ctx-0": "%s:%d" % ctx.client.address})
    prompts = _prompts(3, seed=7, lo=24, hi=24)
    done = {}
    for rid, p in enumerate(prompts):
        _submit_context(ctx, rid, p)
        done[rid] = _context_result(ctx, rid)
    for rid, p in enumerate(prompts):
        _submit_generation(gen, rid, p, done[rid])
    deadline = time.monotonic() + 30
    while True:  # the first receive holds the pool: a later request waits, reserved nothing
        states = gen.call("status")["requests_by_state"]
        if states.get("DISAGG_GENERATION_INIT", 0) >= 1:
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.02)
    for rid in range(3):
        tokens, last = _generation_result(gen, rid, done[rid])
        assert last.outcome == "length" and len(tokens) == MAX_NEW
    assert gen.call("status")["transfers"]["failed"] == 0
    _wait_drained(gen), _wait_drained(ctx)


def test_unclaimed_context_lease_expires_and_frees_blocks(spawn):
    ctx = spawn("context", "ctx-0", lease_s=3.0)
    _submit_context(ctx, 1, _prompts(1, seed=3, lo=20, hi=20)[0])
    _context_result(ctx, 1)
    held = ctx.call("status")
    assert held["free_blocks"] < held["total_blocks"]  # leased, waiting for a claim
    status = _wait_drained(ctx, timeout_s=15)
    assert status["transfers"]["leases_expired"] == 1


def test_context_worker_killed_mid_transfer(spawn):
    ctx = spawn("context", "ctx-0", stall_send_s=4.0)
    gen = spawn("generation", "gen-0", transfer_timeout_s=20.0,
                peers={"ctx-0": "%s:%d" % ctx.client.address})
    prompt = _prompts(1, seed=9, lo=20, hi=20)[0]
    _submit_context(ctx, 1, prompt)
    done = _context_result(ctx, 1)
    _submit_generation(gen, 1, prompt, done)
    _wait_receiving(gen, 1)  # the send is stalled after its header: the receive is in flight
    ctx.kill()
    t0 = time.monotonic()
    _, last = _generation_result(gen, 1, done)
    assert last.outcome == "error" and "transfer" in last.message
    assert time.monotonic() - t0 < 20.0  # within the transfer deadline
    _wait_drained(gen)

    # A restarted context worker: the pair's group is rebuilt and serving goes on.
    ctx2 = spawn("context", "ctx-0")
    gen.call("set_peer", "ctx-0", "%s:%d" % ctx2.client.address)
    _submit_context(ctx2, 2, prompt)
    done2 = _context_result(ctx2, 2)
    _submit_generation(gen, 2, prompt, done2)
    tokens, last = _generation_result(gen, 2, done2)
    assert last.outcome == "length" and len(tokens) == MAX_NEW
    _wait_drained(gen), _wait_drained(ctx2)


def test_generation_worker_killed_mid_transfer(spawn):
    ctx = spawn("context", "ctx-0", stall_send_s=3.0, lease_s=20.0)
    address = {"ctx-0": "%s:%d" % ctx.client.address}
    gen = spawn("generation", "gen-0", peers=address)
    prompt = _prompts(1, seed=10, lo=20, hi=20)[0]
    _submit_context(ctx, 1, prompt)
    done = _context_result(ctx, 1)
    _submit_generation(gen, 1, prompt, done)
    _wait_receiving(gen, 1)
    gen.kill()
    status = _wait_drained(ctx, timeout_s=30)  # the failed send frees the leased blocks
    assert status["transfers"]["failed"] >= 1

    gen2 = spawn("generation", "gen-1", peers=address)
    _submit_context(ctx, 2, prompt)
    done2 = _context_result(ctx, 2)
    _submit_generation(gen2, 2, prompt, done2)
    tokens, last = _generation_result(gen2, 2, done2)
    assert last.outcome == "length" and len(tokens) == MAX_NEW
    _wait_drained(gen2), _wait_drained(ctx)

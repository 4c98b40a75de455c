"""Layer-wise KV streaming (``RouterConfig.kv_transfer_mode="layerwise"``) on a real cluster:
the context worker announces each request's last prefill chunk, the generation worker asks for
the KV at once, and the send goes layer by layer while the forward writes it. Outputs are
token-exact against the in-process engine, chunked prefills included (prompts longer than
max_num_tokens); a cancel while a stream is on the wire leaves nothing held. The two 1P1D tests
share one cluster (each counts only the transfers its own requests make); the 2P2D test comes
last, on its own."""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve.cluster.client import Client  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402

LAYERWISE = RouterConfig(kv_transfer_mode="layerwise")


def _batch(n: int, seed: int) -> list[list[int]]:
    # short prompts (one chunk) and long ones (chunked: ENGINE's max_num_tokens is 128)
    return U.prompts(n // 2, seed) + U.prompts(n - n // 2, seed + 1, lo=130, hi=300)


def _sender(cl, ctx_id: str, attr: str) -> int:
    return ray.get(cl.workers[ctx_id].__ray_call__.remote(
        lambda self: getattr(self.host.core.transceiver.sender, attr)), timeout=U.RAY_TIMEOUT_S)


def _ok(results: list[U.Result]) -> None:
    bad = [(r.request_id, r.code, r.details) for r in results if r.code is not None]
    assert not bad, bad


def _added(after: dict, before: dict) -> dict:
    """The counts ``after`` has over ``before`` (the outcomes of the requests made in between)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_layerwise_1p1d_is_token_exact_and_streams_during_prefill(clusters, model_dir):
    cl = clusters(num_context_workers=1, num_generation_workers=1, router=LAYERWISE)
    # Each last-chunk forward waits after its first layers until the generation side's KV
    # request has claimed the stream (this model's forward takes ~1 ms: without the hold the
    # request would usually come after it), so every send overlaps its prefill.
    ray.get(cl.workers["ctx-0"].test_hook.remote("hold_stream", 2, 30.0, True),
            timeout=U.RAY_TIMEOUT_S)
    batch = _batch(10, seed=71)
    results = U.burst(cl, "lw", batch, 8)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 8)
    assert all(r.last.timings.ctx_worker == "ctx-0" and r.last.timings.kv_transfer_bytes > 0
               for r in results)
    st = U.wait_drained(cl)
    ctx = next(w for w in st.workers if w.worker_id == "ctx-0")
    gen = next(w for w in st.workers if w.worker_id == "gen-0")
    assert dict(ctx.transfers.outcomes) == {"SENT": len(batch)}
    assert dict(gen.transfers.outcomes) == {"COMPLETE": len(batch)}
    # Sends began while their prefill was still running. On one pair the ops of a step go in
    # turn, so in a burst at least the first of each step's streams overlaps its forward ...
    overlapped = _sender(cl, "ctx-0", "overlapped")
    assert overlapped >= 1
    # ... and a request alone in its step always does.
    for i, p in enumerate(U.prompts(3, seed=75, lo=130, hi=200)):
        one = U.burst(cl, f"alone-{i}", [p], 4)
        _ok(one)
        assert one[0].tokens == U.reference(model_dir, [p], 4)[0]
    assert _sender(cl, "ctx-0", "overlapped") == overlapped + 3
    U.wait_drained(cl)


def test_a_cancel_mid_stream_leaves_nothing_held(clusters, model_dir):
    """The last chunk's forward stops after 2 of 4 layers while its stream is on the wire (the
    generation side is receiving; layers 0-1 may have gone). The client cancels: the generation
    side cancels its receive and tells the context side, whose send stops waiting for the
    forward and ends the op at once (the rest as filler, then a CANCELLED trailer), so the
    generation side's blocks are freed. The context side's blocks stay held while its forward
    may still write them, and are freed after. The pair stays usable."""
    cl = clusters(num_context_workers=1, num_generation_workers=1, router=LAYERWISE)
    ctx = cl.workers["ctx-0"]
    ray.get(ctx.test_hook.remote("hold_stream", 2, 60.0, False), timeout=U.RAY_TIMEOUT_S)
    prompt = U.prompts(1, seed=73, lo=200, hi=200)[0]

    def gen_status() -> dict:
        return ray.get(cl.workers["gen-0"].status.remote(), timeout=U.RAY_TIMEOUT_S)

    def outcomes(st) -> dict[str, dict]:
        return {w.worker_id: dict(w.transfers.outcomes) for w in st.workers}

    before = outcomes(U.wait_drained(cl))  # the transfers of what this cluster served before

    def receiving() -> bool:
        states = ray.get(cl.workers["gen-0"].request_states.remote(), timeout=U.RAY_TIMEOUT_S)
        return "RECEIVING" in states.values()

    def gen_cancelled() -> bool:
        s = gen_status()
        return (_added(s["transfers"]["outcomes"], before["gen-0"]) == {"CANCELLED": 1}
                and not s["requests_by_state"]
                and s["free_blocks"] == s["total_blocks"] and s["quarantined_blocks"] == 0)

    def ctx_side() -> tuple:  # read off the step loop, which the hold keeps busy
        return ray.get(ctx.__ray_call__.remote(lambda self: (
            self.host.core.transceiver.sender.sessions.num_active,
            self.host.core.kv.get_num_free_blocks(), self.host.core.kv.num_blocks)),
            timeout=U.RAY_TIMEOUT_S)

    async def go():
        async with U.channel(cl.port) as ch:
            call = U.stub_of(ch).Generate(Client.build_request(
                prompt, max_tokens=8, request_id="cut", **U.GREEDY), timeout=120)
            reader = asyncio.ensure_future(call.read())
            await asyncio.to_thread(U.wait_for, receiving, 60, "the stream to be on the wire")
            call.cancel()
            reader.cancel()

    U.run(go(), 120)
    U.wait_for(gen_cancelled, 30, "the generation side to cancel its receive and free its blocks")
    # the send is over (its session final and quiet, waiting for the step loop to hand it
    # back), but the blocks stay allocated while the held forward may still write them
    U.wait_for(lambda: ctx_side()[0] == 0, 30, "the context side's send to end")
    _, free, total = ctx_side()
    assert free < total
    ray.get(ctx.test_hook.remote("release_stream"), timeout=U.RAY_TIMEOUT_S)
    st = U.wait_drained(cl)
    after = outcomes(st)
    assert set(after) == set(before) == {"ctx-0", "gen-0"}
    assert {w: _added(after[w], before[w]) for w in after} == {
        "ctx-0": {"CANCELLED": 1}, "gen-0": {"CANCELLED": 1}}
    ray.get(ctx.test_hook.remote("hold_stream", 0, 0.0, False), timeout=U.RAY_TIMEOUT_S)
    again = U.prompts(3, seed=74)
    results = U.burst(cl, "after", again, 4)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, again, 4)
    U.wait_drained(cl)


def test_layerwise_2p2d_is_token_exact(clusters, model_dir):
    cl = clusters(num_context_workers=2, num_generation_workers=2, router=LAYERWISE)
    batch = _batch(12, seed=72)
    results = U.burst(cl, "lw2", batch, 6)
    _ok(results)
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 6)
    assert {r.last.timings.ctx_worker for r in results} == {"ctx-0", "ctx-1"}
    assert {r.last.timings.gen_worker for r in results} == {"gen-0", "gen-1"}
    U.wait_drained(cl)

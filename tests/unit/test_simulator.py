"""The sizing simulator and its inputs: trace slices (arrivals, time scale, rate override, length
scaling, Mooncake hash ids -> equal token blocks), the per-request figures, and the
discrete-event simulation over the real schedulers (determinism, hand-off accounting, pauses,
batch limits, the router's in-flight cap, the goodput search, ``simulate run --routing``).
Routing on the workers' caches: test_sim_routing.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from pdserve.bench.cost_model import GPU_PRESETS, MODELS, CostModel, HardwareSpec, LinkSpec, ModelShape, SeqWork
from pdserve.bench.metrics import RequestRecord, Slo, percentile, summarize
from pdserve.bench.simulator import ClusterSimulator, simulate
from pdserve.bench.simulator_spec import ClusterSpec, Latency, WorkerSpec
from pdserve.bench.sizing import at_rate, gpu_worker_spec, gpu_workload, max_rate_under_slo, parse_layout
from pdserve.traces import MOONCAKE_BLOCK_TOKENS, load_trace
from pdserve.bench.workload import WorkItem, WorkloadSpec, build_workload, mean_rate, rescaled

TINY = ModelShape("tiny", 4, 128, 4, 2, 32, 256, 259, dtype_bytes=4, max_seq_len=2048)
CPU = HardwareSpec("cpu", 20e9, 4e9, 0.0, step_overhead_s=1e-3, seq_overhead_s=2e-5, overlap=False)
COST = CostModel(TINY, CPU)
WORKER = WorkerSpec(max_batch_size=16, max_num_tokens=512, tokens_per_block=16, num_kv_blocks=256)


def _work(n: int = 40, **kw) -> list[WorkItem]:
    return build_workload(WorkloadSpec(num_requests=n, **kw))[0]


def _fingerprint(result) -> list[tuple]:
    return [(r.index, r.first_token_s, r.finish_s, r.num_tokens, tuple(r.deltas), r.kv_bytes, r.pauses)
            for r in result.records]


# ---------------------------------------------------------------------------- traces -> work

def test_slice_arrivals_follow_the_trace_times_the_time_scale():
    rows = load_trace("azure_llm_2023_conv.csv", 60)[10:]
    items = _work(50, start=10, time_scale=0.5)
    assert [w.arrival_s for w in items] == pytest.approx([(r.arrival_s - rows[0].arrival_s) * 0.5 for r in rows])
    assert items[0].arrival_s == 0.0
    assert mean_rate(rescaled(items, 0.5)) == pytest.approx(2 * mean_rate(items))


def test_lengths_are_scaled_by_one_factor_and_clamped():
    rows = load_trace("azure_llm_2023_conv.csv", 100)
    items, scale = build_workload(WorkloadSpec(num_requests=100, max_input_len=256, max_output_len=32))
    assert 0 < scale.factor < 1
    for row, item in zip(rows, items):
        assert len(item.prompt) == max(1, min(256, round(row.input_len * scale.factor)))
        assert item.max_tokens == max(1, min(32, round(row.output_len * scale.factor)))
        assert all(3 <= t < 259 for t in item.prompt)
    # Unclamped prompts keep their order.
    short = [(r.input_len, len(w.prompt)) for r, w in zip(rows, items) if len(w.prompt) < 256]
    assert sorted(short) == sorted(short, key=lambda p: (p[1], p[0]))


def test_rate_override_gives_seeded_poisson_arrivals():
    a = _work(400, rate=5.0, seed=1)
    b = _work(400, rate=5.0, seed=1)
    c = _work(400, rate=5.0, seed=2)
    assert [w.arrival_s for w in a] == [w.arrival_s for w in b] != [w.arrival_s for w in c]
    assert mean_rate(a) == pytest.approx(5.0, rel=0.15)
    assert all(w.arrival_s == 0.0 for w in _work(10, rate=math.inf))


def test_mooncake_hash_ids_map_to_equal_token_blocks():
    spec = WorkloadSpec(trace="mooncake_fast25_conversation.jsonl", num_requests=40,
                        max_input_len=1024, max_output_len=32)
    rows = load_trace(spec.trace, 40)
    items, scale = build_workload(spec)
    bt = scale.block_tokens
    assert bt == max(1, round(MOONCAKE_BLOCK_TOKENS * scale.factor)) and bt < MOONCAKE_BLOCK_TOKENS
    pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            shared = 0
            for x, y in zip(rows[i].hash_ids, rows[j].hash_ids):
                if x != y:
                    break
                shared += 1
            n = min(shared * bt, len(items[i].prompt), len(items[j].prompt))
            assert items[i].prompt[:n] == items[j].prompt[:n]
            if shared and shared * bt < min(len(items[i].prompt), len(items[j].prompt)):
                pairs += 1  # the block after the shared prefix differs
                k = shared * bt
                assert items[i].prompt[k:k + bt] != items[j].prompt[k:k + bt]
    assert pairs > 0


def test_the_prefix_cache_sees_the_trace_sharing():
    spec = WorkloadSpec(trace="mooncake_fast25_conversation.jsonl", num_requests=40,
                        max_input_len=1024, max_output_len=16, time_scale=0.01)
    work, scale = build_workload(spec)
    # The scaled hash block (~11 tokens here) spans whole KV blocks only if they are smaller.
    worker = WorkerSpec(max_batch_size=16, max_num_tokens=1024, tokens_per_block=4, num_kv_blocks=8192)
    assert scale.block_tokens >= 2 * worker.tokens_per_block
    on = simulate(ClusterSpec(0, 1, worker, worker), COST, work)
    off_worker = dataclasses.replace(worker, enable_block_reuse=False)
    off = simulate(ClusterSpec(0, 1, off_worker, off_worker), COST, work)
    assert on.workers["gen-0"]["reused_blocks"] > 0
    assert sum(r.cached_tokens for r in on.records) > 0
    assert off.workers["gen-0"]["reused_blocks"] == 0
    assert on.workers["gen-0"]["context_tokens"] < off.workers["gen-0"]["context_tokens"]


# ---------------------------------------------------------------------------- figures

def test_summary_figures_on_hand_made_records():
    def rec(i, ttft, finish, n):
        r = RequestRecord(i, 0.0, 10, n, first_token_s=ttft, finish_s=finish, num_tokens=n)
        r.deltas = [(ttft, 1)] + [(ttft + (finish - ttft) * k / (n - 1), 1) for k in range(1, n)]
        return r

    records = [rec(0, 0.1, 1.0, 10), rec(1, 0.5, 1.4, 10), rec(2, 2.0, 2.9, 10)]
    s = summarize(records, Slo(ttft_ms=600, tpot_ms=100))
    assert s["ttft_ms"]["p50"] == pytest.approx(500)
    assert s["tpot_ms"]["p50"] == pytest.approx(100)
    assert s["itl_ms"]["p50"] == pytest.approx(100)
    assert s["duration_s"] == pytest.approx(2.9)
    assert s["goodput_rps"] == pytest.approx(2 / 2.9)  # the third misses the TTFT SLO
    assert s["slo_attainment"] == pytest.approx(2 / 3)
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and math.isnan(percentile([], 0.5))


# ---------------------------------------------------------------------------- the simulation

def test_simulator_is_deterministic_with_a_seed():
    work = _work(40, time_scale=0.2)
    spec = ClusterSpec(1, 1, WORKER, WORKER, latency=Latency(1e-3, 1e-3), link=LinkSpec(1e9, 1e-4))
    a = ClusterSimulator(spec, COST, seed=7, step_jitter=0.3).run(work)
    b = ClusterSimulator(spec, COST, seed=7, step_jitter=0.3).run(work)
    c = ClusterSimulator(spec, COST, seed=8, step_jitter=0.3).run(work)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)
    # Without jitter the seed changes nothing.
    assert _fingerprint(simulate(spec, COST, work, seed=1)) == _fingerprint(simulate(spec, COST, work, seed=2))


def test_disaggregated_requests_hand_off_and_move_their_kv():
    work = _work(30, time_scale=0.2)
    spec = ClusterSpec(1, 1, WORKER, WORKER, latency=Latency(1e-3, 2e-3), link=LinkSpec(1e9, 1e-4))
    result = simulate(spec, COST, work)
    block = COST.kv_block_bytes(16)
    for w, r in zip(work, result.records):
        assert r.ok and r.num_tokens == w.max_tokens and not r.local_prefill
        assert r.worker == "ctx-0"
        if w.max_tokens > 1:  # random prompts: nothing cached on the generation side
            assert r.kv_bytes == -(-len(w.prompt) // 16) * block
        else:
            assert r.kv_bytes == 0  # a 1-token request ends on the context worker
    assert result.workers["ctx-0"]["generated_tokens"] == len(work)  # one first token each
    colocated = simulate(ClusterSpec(0, 1, WORKER, WORKER), COST, work)
    assert all(r.local_prefill and r.kv_bytes == 0 for r in colocated.records)


def test_one_request_timeline_is_hops_steps_and_transfer():
    prompt = list(range(3, 103))  # 100 tokens
    work = [WorkItem(0, 0.0, prompt, 5)]
    hop, control = 2e-3, 3e-3
    link = LinkSpec(1e9, 1e-4)
    r = simulate(ClusterSpec(1, 1, WORKER, WORKER, link=link, latency=Latency(hop, control)), COST, work).records[0]
    prefill = COST.step_time([SeqWork(100, 0, True)])
    assert r.ttft_ms == pytest.approx(1000 * (2 * hop + prefill))
    xfer = link.transfer_time(-(-100 // 16) * COST.kv_block_bytes(16))
    decode = sum(COST.step_time([SeqWork(1, 100 + k, True)]) for k in range(4))
    # hand-off hop, reservation, control round trip + transfer, 4 decode steps, hop back
    assert r.e2e_ms - r.ttft_ms == pytest.approx(1000 * (hop + control + xfer + decode + hop))
    assert r.kv_ms == pytest.approx(1000 * xfer)


def test_layerwise_hides_the_transfer_behind_the_last_prefill_step():
    prompt = list(range(3, 403))  # 400 tokens: one chunk, a step long enough to overlap
    work = [WorkItem(0, 0.0, prompt, 5)]
    hop, control = 2e-3, 3e-3
    prefill = COST.step_time([SeqWork(400, 0, True)])
    # the hand-off leaves at the step's start and the KV request arrives before its end
    assert 2 * hop + control / 2 < prefill
    decode = sum(COST.step_time([SeqWork(1, 400 + k, True)]) for k in range(4))

    def run(mode: str, link: LinkSpec):
        spec = ClusterSpec(1, 1, WORKER, WORKER, link=link, latency=Latency(hop, control),
                           kv_transfer_mode=mode)
        return simulate(spec, COST, work).records[0]

    fast = LinkSpec(1e15, 0.0)
    lw, ap = run("layerwise", fast), run("after_prefill", fast)
    assert lw.ttft_ms == pytest.approx(ap.ttft_ms) == pytest.approx(1000 * (2 * hop + prefill))
    assert lw.num_tokens == ap.num_tokens == 5 and lw.kv_bytes == ap.kv_bytes > 0
    # all of the transfer hid behind the forward: the KV (and first token) land at the step's
    # end; then half a control round trip, the decode steps
    assert lw.e2e_ms - lw.ttft_ms == pytest.approx(1000 * (control / 2 + decode))
    assert ap.e2e_ms - ap.ttft_ms == pytest.approx(1000 * (hop + control + decode + hop))
    # a link slower than the forward: the last layer's bytes land after the step, still sooner
    # than the whole transfer after it
    slow = LinkSpec(2e7, 1e-4)
    lw, ap = run("layerwise", slow), run("after_prefill", slow)
    nbytes = -(-400 // 16) * COST.kv_block_bytes(16)
    per_layer = (slow.transfer_time(nbytes) - slow.latency_s) / TINY.num_layers
    assert per_layer * TINY.num_layers > prefill
    assert lw.ttft_ms == pytest.approx(ap.ttft_ms)
    assert ap.e2e_ms - lw.e2e_ms > 0
    with pytest.raises(ValueError, match="kv_transfer_mode"):
        ClusterSpec(1, 1, kv_transfer_mode="eager")


def test_max_utilization_pauses_under_kv_pressure_and_still_streams_each_token_once():
    # 30 requests of 20 + 100 tokens at once: 8 blocks each at the end, 40 blocks in the pool.
    work = [WorkItem(i, 0.0, [3 + (7 * i + k) % 250 for k in range(20)], 100) for i in range(30)]
    small = WorkerSpec(max_batch_size=16, max_num_tokens=512, tokens_per_block=16, num_kv_blocks=40,
                       capacity_scheduler_policy="MAX_UTILIZATION")
    result = simulate(ClusterSpec(1, 1, WORKER, small, link=LinkSpec(1e9)), COST, work)
    assert result.workers["gen-0"]["pauses"] > 0
    assert sum(r.pauses for r in result.records) == result.workers["gen-0"]["pauses"]
    assert all(r.ok and r.num_tokens == r.max_tokens for r in result.records)


def test_every_step_respects_the_batch_limits():
    work = _work(60, time_scale=0.05)
    spec = ClusterSpec(0, 1, WORKER, WORKER)
    result = ClusterSimulator(spec, COST, record_decisions=True).run(work)
    decisions = result.decisions["gen-0"]
    assert decisions and any(d.context and d.generation for d in decisions)  # mixed batches happen
    for d in decisions:
        assert len(d.context) + len(d.generation) <= WORKER.max_batch_size
        assert sum(n for _, n in d.context) + len(d.generation) <= WORKER.max_num_tokens


def test_the_router_caps_requests_in_flight():
    work = _work(30, rate=math.inf)
    result = simulate(ClusterSpec(0, 1, WORKER, WORKER, max_inflight=3), COST, work)
    assert max(f for _, _, f in result.queue_series) == 3
    assert max(q for _, q, _ in result.queue_series) >= 25  # the burst waits in the router queue
    assert all(r.ok for r in result.records)


def test_two_colocated_workers_share_the_load():
    result = simulate(ClusterSpec(0, 2, WORKER, WORKER), COST, _work(40, time_scale=0.05))
    assert {r.worker for r in result.records} == {"gen-0", "gen-1"}
    assert result.gpus == 2


# ---------------------------------------------------------------------------- sizing

def test_parse_layout():
    assert parse_layout("1P2D") == (1, 2)
    assert parse_layout("3:1") == (3, 1)
    assert parse_layout("colocated") == (0, 1)
    assert parse_layout("colocated-x2") == (0, 2)
    assert parse_layout("colocated x2") == (0, 2)  # a ClusterSpec label parses back
    with pytest.raises(ValueError):
        parse_layout("two")


def test_a_rate_is_offered_as_the_trace_pattern_or_as_poisson():
    work = _work(200)
    scaled = at_rate(work, 4 * mean_rate(work), "trace")
    assert [w.arrival_s for w in scaled] == pytest.approx([w.arrival_s / 4 for w in work])
    poisson = at_rate(work, 10.0, "poisson")
    assert [w.prompt for w in poisson] == [w.prompt for w in work]
    assert mean_rate(poisson) == pytest.approx(10.0, rel=0.2)
    assert poisson == at_rate(work, 10.0, "poisson")
    with pytest.raises(ValueError):
        at_rate(work, 1.0, "uniform")


def test_goodput_search_finds_a_rate_that_meets_the_slo():
    model = MODELS["llama-3-8b"]
    cost = CostModel(model, GPU_PRESETS["H100"])
    work = gpu_workload("conv", model, 60)
    spec = ClusterSpec(1, 1, gpu_worker_spec(cost), gpu_worker_spec(cost))
    slo = Slo(ttft_ms=500, tpot_ms=50)
    rate, summary, sims = max_rate_under_slo(spec, cost, work, slo, iterations=4)
    assert rate > mean_rate(work) and summary["slo_attainment"] >= 0.9 and sims > 2
    too_fast = simulate(spec, cost, rescaled(work, mean_rate(work) / (rate * 2))).summary(slo)
    assert too_fast["slo_attainment"] < 0.9


def test_simulate_run_takes_the_routers_routing_modes(tmp_path, capsys):
    from pdserve.bench.sizing import main

    out = tmp_path / "run.json"
    assert main(["run", "--trace", "mooncake", "--layouts", "1P1D,colocated-x2", "--num-requests", "30",
                 "--routing", "kv-aware", "--kv-overlap-weight", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["routing"] == "kv-aware"
    for summary in data["summaries"].values():
        assert summary["routing"]["mode"] == "kv-aware" and summary["routing"]["requests"] == 30
        assert summary["routing"]["index_resyncs"] == 0
    assert "routing kv-aware" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["run", "--routing", "kv_cache_aware"])

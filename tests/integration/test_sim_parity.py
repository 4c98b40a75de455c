"""The simulator and the live core make identical scheduling decisions on a small trace.

The simulator replays a slice of the Azure trace on one colocated worker (chunked prefill, a KV
pool small enough that MAX_UTILIZATION pauses) and records, for every step, which requests
arrived before it and what the scheduler decided. The real core (the built-in tiny model,
same engine settings) is then driven with the same requests arriving before the same steps; its
scheduler, wrapped in the same recorder, must decide the same thing at every step: context
chunks (request, size), generation batch, pauses and disaggregated reservations.
"""
from __future__ import annotations

import pytest

from pdserve.bench.cost_model import CostModel, HardwareSpec, ModelShape
from pdserve.bench.simulator import ClusterSimulator
from pdserve.bench.simulator_spec import ClusterSpec, WorkerSpec
from pdserve.bench.simulator_workers import DecisionRecorder
from pdserve.bench.workload import WorkloadSpec, build_workload
from pdserve.scheduler import LlmRequest

ENGINE = dict(tokens_per_block=16, max_batch_size=8, max_num_tokens=128,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=32,
              capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=40)


@pytest.mark.parametrize("policy", ["MAX_UTILIZATION", "GUARANTEED_NO_EVICT"])
def test_simulated_worker_decides_like_the_executor(policy):
    from pdserve.cluster.launch import builtin_model_dir
    from pdserve.workers.engine.offline import LLMEngine
    from pdserve.workers.runner.sampling import SamplingParams

    engine = dict(ENGINE, capacity_scheduler_policy=policy)
    model_dir = builtin_model_dir()
    shape = ModelShape.from_hf_config(model_dir)
    cost = CostModel(shape, HardwareSpec("cpu", 20e9, 4e9, 0.0, step_overhead_s=1e-3, overlap=False))
    work = build_workload(WorkloadSpec(num_requests=30, time_scale=0.01, max_input_len=200,
                                       max_output_len=64, min_output_len=40))[0]
    worker = WorkerSpec.from_engine(engine, max_seq_len=shape.max_seq_len, num_kv_blocks=40)
    sim = ClusterSimulator(ClusterSpec(0, 1, worker, worker), cost, record_decisions=True).run(work)
    simulated = sim.decisions["gen-0"]
    arrivals = sim.arrival_logs["gen-0"]
    assert len(simulated) == len(arrivals) > 30
    if policy == "MAX_UTILIZATION":
        assert any(d.paused for d in simulated), "the pool should be small enough to pause"
    assert any(len(d.context) > 1 or (d.context and d.generation) for d in simulated)

    llm = LLMEngine(model_dir, **engine)
    core = llm.core
    recorder = DecisionRecorder(core.scheduler)
    core.scheduler = recorder
    for before_step in arrivals:
        for rid, prompt, max_new, kind in before_step:
            core.add_request(LlmRequest(rid, prompt, max_new, llm_request_type=kind),
                                 SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
        core.step()
    assert not core.has_work  # the same number of steps finished everything
    assert len(recorder.log) == len(simulated)
    for step, (live, simu) in enumerate(zip(recorder.log, simulated)):
        assert live == simu, f"step {step}: core {live} != simulator {simu}"

"""Time one full scheduler step (capacity pass + micro-batch pass) at scale.

Setup per size N and shape D: N active requests, D of them decoding (their KV allocated and
grown), the rest waiting for prefill, every other one of which shares a prefix with a decoding
request (so reuse analysis has real matches); decoding and new requests interleave evenly. 16
tokens per block, 65,536 blocks, block reuse on, chunked prefill (FIRST_COME_FIRST_SERVED, unit
256). max_batch_size = N and max_num_tokens = 16,384 so the schedulers look at every request.
Each step is timed twice over, and both medians are reported per policy:

- static: the step repeated on the same state (schedule() only decides; it allocates nothing),
  with the medians of the capacity pass and the micro-batch pass timed alone. Every repeat after
  the first finds each waiting request's prefix summary cached (it stays current while the radix
  tree's version is unchanged), so this is the step's floor, not what serving pays.
- live: between timed steps, untimed, the state advances as the engine advances it, through the
  scheduler's own lifecycle functions (scheduler/lifecycle.py), on the step's own output: paused
  requests are freed, context chunks allocated and advanced (a finished prefill stores its blocks
  in the radix tree), decodes grown by one token, requests at their max_new_tokens finished, and
  decoding requests beyond the shape's count finished too (as though they sampled an end token:
  it holds the shape, else prefills would turn it all-decoding); then new requests arrive until
  N are active again, half of them sharing a block-aligned half of a recent prompt (cached, or
  still running). The tree's version so changes between steps, as it does in serving, and only
  schedule() is timed. (STATIC_BATCH admits nothing while its batch decodes, so under it the
  tree changes only as that batch finishes: as in serving.) The goals below are judged on the
  live medians.

Shapes (``--decoding``): 1/2 (the original set-up: 512 decoding and 512 new at N = 1,024) and
3/4 (768 decoding and 256 new), both by default. Goals at N = 1,024, on the live worst-policy
median: <= 2 ms per full step in the 1/2 shape; <= 0.6 ms in the 3/4 shape. For scale, TensorRT-LLM's own
Python port measured 17.4 ms per iteration (10.5 ms fused, 2.9 ms compiled with mypyc).

The scheduler is imported as ``pdserve.scheduler``, so ``PYTHONPATH`` can point this script at
another checkout (a worktree of older code) to time it on the same shapes; the first line printed
names the package timed.

``--vllm-venv PATH`` also times vLLM's own v1 scheduler (``vllm.v1.core.sched.scheduler.Scheduler``)
on each shape, in a subprocess running that virtualenv's python (vLLM never enters pdserve's):
this script with ``--vllm-child``, which imports no pdserve. Its state: the decoding requests
prefilled and decoded a few steps through the scheduler itself (fake model outputs, one token per
request), their KV allocated, and the new requests waiting, half of them sharing a block-aligned
half of a decoding request's prompt; the same block size, block count, token budget (chunked
prefill) and max_num_seqs = N, prefix caching on, stats logging off (the scheduler's least work).
Each timed step is ``schedule()``, then its bookkeeping ``update_from_output()`` with a fake
output (one token per request past its prompt); between steps, untimed, the requests that were
waiting are aborted and as many fresh ones queued, so every step starts from the same shape. It
prints the medians (wall and thread CPU time) beside pdserve's worst-policy median on that shape,
and their ratios (against pdserve's live median: vLLM's steps, too, run on a changing state).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

# Run by vLLM's python (--vllm-child), this script must not import pdserve: it is not installed there.
if "--vllm-child" not in sys.argv:
    import pdserve.scheduler
    from pdserve.scheduler import (
        CapacityScheduler,
        CapacitySchedulerPolicy,
        ContextChunkingConfig,
        ContextChunkingPolicy,
        KVCacheManager,
        LlmRequest,
        LlmRequestState,
        MicroBatchScheduler,
        SimpleScheduler,
    )
    from pdserve.scheduler import lifecycle

SIZES = (64, 256, 1024, 4096)
NUM_BLOCKS = 65_536
TOKENS_PER_BLOCK = 16
MAX_NUM_TOKENS = 16_384


def parse_shape(text: str, n: int) -> int:
    """Decoding requests among ``n`` active: a fraction ("3/4") or a count ("768", at most n)."""
    if "/" in text:
        num, den = (int(x) for x in text.split("/"))
        return n * num // den
    return min(n, int(text))


def _is_decoding(i: int, n: int, decoding: int) -> bool:
    # Spread evenly: request i decodes when ceil((i + 1) D / N) > ceil(i D / N). D = N / 2 gives
    # the even indices (the original set-up), D = 3N / 4 the pattern decode, decode, decode, new.
    return -(-(i + 1) * decoding // n) > -(-i * decoding // n)


def build(n: int, policy: CapacitySchedulerPolicy, seed: int = 0, decoding: int | None = None):
    rng = random.Random(seed)
    decoding = n // 2 if decoding is None else decoding
    kv = KVCacheManager(NUM_BLOCKS, TOKENS_PER_BLOCK, enable_block_reuse=True)
    active: list[LlmRequest] = []
    prefixes: list[list[int]] = []
    new = 0
    for i in range(n):
        prompt_len = rng.randint(64, 512)
        if _is_decoding(i, n, decoding):
            prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
            req = LlmRequest(i, prompt, rng.randint(32, 512))
            kv.add_sequence(req)
            req.context_current_position = req.prompt_len
            kv.store_context_blocks(req)
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
            for _ in range(rng.randint(1, 24)):
                req.add_new_token(rng.randrange(3, 32000))
                kv.add_token(i)
            prefixes.append(prompt)
        else:
            new += 1
            if new % 2 == 1 and prefixes:
                shared = rng.choice(prefixes)
                cut = (len(shared) // 2) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
                prompt = shared[:cut] + [rng.randrange(3, 32000) for _ in range(prompt_len - cut)]
            else:
                prompt = [rng.randrange(3, 32000) for _ in range(prompt_len)]
            req = LlmRequest(i, prompt, rng.randint(32, 512))
        active.append(req)
    capacity = CapacityScheduler(n, policy)
    micro = MicroBatchScheduler(
        ContextChunkingConfig(ContextChunkingPolicy.FIRST_COME_FIRST_SERVED, 256), MAX_NUM_TOKENS
    )
    scheduler = SimpleScheduler(
        capacity, micro, kv_cache_manager=kv, max_batch_size=n, max_num_tokens=MAX_NUM_TOKENS
    )
    return scheduler, active


def profile_step(n: int, policy: CapacitySchedulerPolicy, repeats: int, top: int = 15,
                 decoding: int | None = None, live: bool = False) -> None:
    """cProfile over ``repeats`` steps on the benchmark's state (static, or live: advanced between
    steps with the profiler off); prints the top functions by own time (profiling inflates
    call-heavy code, so read it for shares, not for timings)."""
    import cProfile
    import pstats

    decoding = n // 2 if decoding is None else decoding
    scheduler, active = build(n, policy, decoding=decoding)
    state = LiveState(scheduler, active, n, decoding) if live else None
    out = scheduler.schedule(active, set())
    profiler = cProfile.Profile()
    for _ in range(repeats):
        if state is not None:
            state.advance(out)
        profiler.enable()
        out = scheduler.schedule(active, set())
        profiler.disable()
    print(f"\n--- profile ({'live' if live else 'static'}): {n} active, {decoding} decoding, "
          f"{policy.name}, {repeats} steps ---")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def time_step(n: int, policy: CapacitySchedulerPolicy, repeats: int,
              decoding: int | None = None) -> dict:
    scheduler, active = build(n, policy, decoding=decoding)
    out = scheduler.schedule(active, set())  # warm caches (per-request block keys)
    samples, cpu_samples = [], []
    cpu = time.thread_time_ns  # CPU time: what other processes on the machine do not inflate
    for _ in range(repeats):
        c0, t0 = cpu(), time.perf_counter_ns()
        out = scheduler.schedule(active, set())
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
        cpu_samples.append((cpu() - c0) / 1000.0)
    # The two passes alone, as SimpleScheduler.schedule runs them.
    capacity, micro = scheduler.capacity_scheduler, scheduler.micro_batch_scheduler
    kv, empty = scheduler.kv_cache_manager, frozenset()
    capacity_samples, micro_samples = [], []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fitting = capacity.schedule(active, kv).fitting
        t1 = time.perf_counter_ns()
        micro.schedule(fitting, empty, scheduler.max_batch_size, scheduler.max_num_tokens)
        t2 = time.perf_counter_ns()
        capacity_samples.append((t1 - t0) / 1000.0)
        micro_samples.append((t2 - t1) / 1000.0)
    return {
        "active": n,
        "decoding": n // 2 if decoding is None else decoding,
        "policy": policy.name,
        "median_us": statistics.median(samples),
        "median_cpu_us": statistics.median(cpu_samples),
        "p90_us": sorted(samples)[int(0.9 * (len(samples) - 1))],
        "capacity_us": statistics.median(capacity_samples),
        "micro_batch_us": statistics.median(micro_samples),
        "context": len(out.context_requests),
        "generation": len(out.generation_requests),
        "paused": len(out.paused_requests),
    }


# ---- the live state: advanced between steps as the engine advances it -----------------------------
MAX_INPUT_LEN = 4096  # a paused request's prompt grows by its generated tokens; none comes near


class LiveState:
    """The benchmark's state, advanced between timed steps as the worker's step loop advances it
    (scheduler/sim_worker.py runs the same lifecycle calls), so that every step finds the radix
    tree changed and the population turned over, as in serving.

    Invariants after each ``advance``: ``len(active) == n`` (arrivals refill what finished) and at
    most ``decoding`` requests generate (the excess finishes), so the shape the static figure is
    taken on holds; the counters say what happened (``version_changes`` counts the advances after
    which the radix tree's version differed from before)."""

    def __init__(self, scheduler, active: list, n: int, decoding: int, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache_manager
        self.active = active
        self.n = n
        self.decoding = decoding
        self.rng = random.Random(seed + 1)  # not build()'s stream: arrivals differ from the set-up
        self.next_id = max((r.request_id for r in active), default=-1) + 1
        # Prompts arrivals may share a prefix of: those prefilled (their full blocks are in the
        # tree, in use or cached free), the newest last; bounded, like a cache's reach.
        self.prompts: list[list[int]] = [
            r.get_prompt_tokens() for r in active if r.state == LlmRequestState.GENERATION_IN_PROGRESS
        ]
        self.arrivals = 0
        self.finished = 0
        self.paused = 0
        self.version_changes = 0
        self.steps = 0

    def _tree_version(self) -> int:
        # The stock manager's radix tree (private: read here only to report that it changed).
        return self.kv._tree.version

    def _token(self) -> int:
        return self.rng.randrange(3, 32000)

    def _arrival(self) -> LlmRequest:
        prompt_len = self.rng.randint(64, 512)
        self.arrivals += 1
        if self.arrivals % 2 == 1 and self.prompts:
            shared = self.rng.choice(self.prompts)
            cut = (len(shared) // 2) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK
            prompt = shared[:cut] + [self._token() for _ in range(prompt_len - cut)]
        else:
            prompt = [self._token() for _ in range(prompt_len)]
        request = LlmRequest(self.next_id, prompt, self.rng.randint(32, 512))
        self.next_id += 1
        return request

    def advance(self, out) -> None:
        """Carry out ``out`` (the step just timed) as the engine core would, then finish and admit."""
        kv, before = self.kv, self._tree_version()
        lifecycle.pause_requests(out.paused_requests, kv, MAX_INPUT_LEN)
        self.paused += len(out.paused_requests)
        lifecycle.prepare_context_chunks(out.context_requests, kv)
        for request in out.generation_requests:
            lifecycle.prepare_generation_step(request, kv)
        done: set[int] = set()
        for request in out.context_requests:
            last = request.context_current_position + request.context_chunk_size >= request.prompt_len
            if lifecycle.complete_context_chunk(request, kv, self._token() if last else None):
                self.prompts.append(request.get_prompt_tokens())
                if lifecycle.reached_max_tokens(request):
                    done.add(request.request_id)
        for request in out.generation_requests:
            lifecycle.complete_generation_step(request, self._token())
            if lifecycle.reached_max_tokens(request):
                done.add(request.request_id)
        # Hold the shape: decoding requests beyond its count finish, picked at random (an end
        # token comes at no particular length).
        generating = [r for r in self.active if r.request_id not in done
                      and r.state == LlmRequestState.GENERATION_IN_PROGRESS]
        excess = len(generating) - self.decoding
        if excess > 0:
            done.update(r.request_id for r in self.rng.sample(generating, excess))
        for request in self.active:
            if request.request_id in done:
                lifecycle.finish_request(request, kv)
        self.finished += len(done)
        self.active[:] = [r for r in self.active if r.request_id not in done]
        # Arrivals join at the end of the active list, as the worker activates them.
        self.active.extend(self._arrival() for _ in range(self.n - len(self.active)))
        del self.prompts[:-4 * self.n]
        self.steps += 1
        self.version_changes += self._tree_version() != before


def time_live_step(n: int, policy: CapacitySchedulerPolicy, repeats: int,
                   decoding: int | None = None, warmup: int = 3) -> dict:
    """The step on the live state (LiveState): ``warmup`` advanced steps untimed, then
    ``repeats`` timed schedule() calls, each followed by an untimed advance."""
    decoding = n // 2 if decoding is None else decoding
    scheduler, active = build(n, policy, decoding=decoding)
    live = LiveState(scheduler, active, n, decoding)
    for _ in range(warmup):
        live.advance(scheduler.schedule(active, set()))
    samples, cpu_samples, counts = [], [], None
    cpu = time.thread_time_ns
    for _ in range(repeats):
        c0, t0 = cpu(), time.perf_counter_ns()
        out = scheduler.schedule(active, set())
        samples.append((time.perf_counter_ns() - t0) / 1000.0)
        cpu_samples.append((cpu() - c0) / 1000.0)
        if counts is None:
            counts = (len(out.context_requests), len(out.generation_requests), len(out.paused_requests))
        live.advance(out)
    return {
        "live_median_us": statistics.median(samples),
        "live_median_cpu_us": statistics.median(cpu_samples),
        "live_p90_us": sorted(samples)[int(0.9 * (len(samples) - 1))],
        "live_context": counts[0],
        "live_generation": counts[1],
        "live_paused": live.paused,
        "live_steps": live.steps,
        "live_version_changes": live.version_changes,
        "live_arrivals": live.arrivals,
        "live_finished": live.finished,
    }


# ---- vLLM's scheduler on the same shapes (--vllm-venv) --------------------------------------------
_VLLM_MARKER = "VLLM_SCHEDULER_RESULT "


def vllm_child(spec: dict) -> dict:
    """Under vLLM's python: time its v1 scheduler on each shape in ``spec`` (see the docstring).
    Imports vLLM only; returns {"vllm": version, "rows": [...]}."""
    import gc
    import tempfile

    import torch
    import vllm
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    b, num_blocks, budget = spec["tokens_per_block"], spec["num_blocks"], spec["max_num_tokens"]
    max_model_len = 4096
    # A model folder with only a config: the scheduler never loads weights or a tokenizer.
    folder = tempfile.mkdtemp(prefix="vllm-sched-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "max_position_embeddings": max_model_len, "vocab_size": 32000,
                   "rms_norm_eps": 1e-6, "torch_dtype": "float32"}, f)
    rows = []
    for n, decoding in spec["shapes"]:
        cache_config = CacheConfig(block_size=b, enable_prefix_caching=True)
        config = VllmConfig(
            model_config=ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float32",
                                     seed=0, max_model_len=max_model_len),
            scheduler_config=SchedulerConfig(
                max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=max_model_len,
                enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=cache_config,
        )
        cache_config.num_gpu_blocks = num_blocks
        kv_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
                block_size=b, num_kv_heads=1, head_size=1, dtype=torch.float32))],
        )
        sched = Scheduler(vllm_config=config, kv_cache_config=kv_config,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=b, log_stats=False)
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(b, hash_fn)
        rng = random.Random(spec["seed"])
        serial = iter(range(1 << 62))
        # Decoding requests never finish during the run; new ones are aborted after one step.
        long_params = SamplingParams(max_tokens=max_model_len - 600, ignore_eos=True)
        new_params = SamplingParams(max_tokens=512, ignore_eos=True)

        def request(prompt: list[int], params: SamplingParams) -> Request:
            return Request(str(next(serial)), prompt, params, None, block_hasher=hasher)

        def fake_output(out) -> ModelRunnerOutput:
            # One token for each request past its prompt; a partial prefill samples nothing.
            ids = list(out.num_scheduled_tokens)
            live = sched.requests
            tokens = [[rng.randrange(3, 32000)] if live[i].num_computed_tokens >= live[i].num_tokens
                      else [] for i in ids]
            return ModelRunnerOutput(req_ids=ids, req_id_to_index={i: k for k, i in enumerate(ids)},
                                     sampled_token_ids=tokens)

        prompts = []
        for _ in range(decoding):
            prompts.append([rng.randrange(3, 32000) for _ in range(rng.randint(64, 512))])
            sched.add_request(request(prompts[-1], long_params))
        prefill_steps = 0
        while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
            out = sched.schedule()
            sched.update_from_output(out, fake_output(out))
            prefill_steps += 1
        for _ in range(8):  # a few decode steps: generated tokens, as pdserve's set-up has
            out = sched.schedule()
            sched.update_from_output(out, fake_output(out))

        def queue_new() -> list[str]:
            ids = []
            for k in range(n - decoding):
                length = rng.randint(64, 512)
                if k % 2 == 0 and prompts:  # half share a block-aligned half of a prompt
                    shared = rng.choice(prompts)
                    cut = (len(shared) // 2) // b * b
                    prompt = shared[:cut] + [rng.randrange(3, 32000) for _ in range(length - cut)]
                else:
                    prompt = [rng.randrange(3, 32000) for _ in range(length)]
                req = request(prompt, new_params)
                sched.add_request(req)
                ids.append(req.request_id)
            return ids

        waiting = queue_new()
        gc.collect()
        gc.freeze()  # as vLLM's engine core does after start-up
        times, updates, cpu_times, cpu_updates, first = [], [], [], [], None
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        for step in range(spec["warmup"] + spec["repeats"]):
            assert len(sched.running) == decoding and len(sched.waiting) == n - decoding
            c0, t0 = cpu(), clock()
            out = sched.schedule()
            c1, t1 = cpu(), clock()
            model_output = fake_output(out)
            c2, t2 = cpu(), clock()
            sched.update_from_output(out, model_output)
            c3, t3 = cpu(), clock()
            if step >= spec["warmup"]:
                times.append((t1 - t0) / 1000.0)
                updates.append((t3 - t2) / 1000.0)
                cpu_times.append((c1 - c0) / 1000.0)
                cpu_updates.append((c3 - c2) / 1000.0)
                if first is None:
                    first = (len(out.num_scheduled_tokens), out.total_num_scheduled_tokens)
            # Untimed: the step's new requests out, as many fresh ones in (the same shape).
            sched.finish_requests(waiting, RequestStatus.FINISHED_ABORTED)
            waiting = queue_new()
        gc.unfreeze()
        rows.append({
            "active": n, "decoding": decoding, "prefill_steps": prefill_steps,
            "schedule_us": statistics.median(times),
            "schedule_p90_us": sorted(times)[int(0.9 * (len(times) - 1))],
            "update_us": statistics.median(updates),
            "step_us": statistics.median(a + u for a, u in zip(times, updates)),
            "schedule_cpu_us": statistics.median(cpu_times),
            "step_cpu_us": statistics.median(a + u for a, u in zip(cpu_times, cpu_updates)),
            "scheduled_requests": first[0], "scheduled_tokens": first[1],
        })
    return {"vllm": vllm.__version__, "rows": rows}


def time_vllm(venv: str, shapes: list[tuple[int, int]], repeats: int) -> dict:
    """Run ``vllm_child`` under ``venv``'s python; its result, or SystemExit with its stderr."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"--vllm-venv {venv}: no {python}")
    spec = {"shapes": shapes, "repeats": repeats, "warmup": 3, "seed": 0,
            "tokens_per_block": TOKENS_PER_BLOCK, "num_blocks": NUM_BLOCKS,
            "max_num_tokens": MAX_NUM_TOKENS}
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("PYTHONPATH", None)  # pdserve's path means nothing to vLLM's venv
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--vllm-child", json.dumps(spec)],
        capture_output=True, text=True, env=env,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(_VLLM_MARKER):
            return json.loads(line[len(_VLLM_MARKER):])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-20:])
    raise SystemExit(f"vLLM's scheduler run failed (exit {proc.returncode}) under {python}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/scheduler.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument(
        "--decoding", default="1/2,3/4",
        help="shapes: decoding requests per size, each a fraction (3/4) or a count (768)",
    )
    parser.add_argument("--repeats", type=int, default=0, help="0 = chosen per size")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--profile", action="store_true",
        help="after the table, print a cProfile top list per size, shape and policy, static "
        "and live",
    )
    parser.add_argument(
        "--vllm-venv", metavar="PATH",
        help="also time vLLM's v1 scheduler on the same shapes, in a subprocess of this "
        "virtualenv's python, and print the ratio",
    )
    parser.add_argument("--vllm-repeats", type=int, default=30, help="timed vLLM steps per shape")
    parser.add_argument("--vllm-child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vllm_child:
        print(_VLLM_MARKER + json.dumps(vllm_child(json.loads(args.vllm_child))), flush=True)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = args.decoding.split(",")
    rows = []
    print(f"scheduler: {pdserve.scheduler.__file__}")
    print("medians per step, us: static = the same state repeated; live = the state advanced "
          "between steps (see the docstring); capacity, micro = the passes alone, static; "
          "ctx, gen, paused = the static step's; new/step = live arrivals per step (as many finish)")
    print(f"{'active':>7} {'decode':>6} {'policy':<20} {'static':>7} {'p90':>6} {'live':>7} "
          f"{'p90':>6} {'capacity':>9} {'micro':>7} {'ctx':>5} {'gen':>5} {'paused':>6} {'new/step':>8}")
    for n in sizes:
        repeats = args.repeats or max(5, min(200, 20_000 // n))
        for shape in shapes:
            decoding = parse_shape(shape, n)
            for policy in CapacitySchedulerPolicy:
                row = time_step(n, policy, repeats, decoding)
                row.update(time_live_step(n, policy, repeats, decoding))
                row["shape"] = shape
                rows.append(row)
                print(
                    f"{n:>7} {decoding:>6} {policy.name:<20} {row['median_us']:>7.0f} "
                    f"{row['p90_us']:>6.0f} {row['live_median_us']:>7.0f} "
                    f"{row['live_p90_us']:>6.0f} {row['capacity_us']:>9.0f} "
                    f"{row['micro_batch_us']:>7.0f} {row['context']:>5} {row['generation']:>5} "
                    f"{row['paused']:>6} {row['live_arrivals'] / row['live_steps']:>8.1f}",
                    flush=True,
                )
    for decoding, goal in ((512, 2000), (768, 600)):
        at_goal = [r for r in rows if r["active"] == 1024 and r["decoding"] == decoding]
        if at_goal:
            live = max(r["live_median_us"] for r in at_goal)
            # Thread CPU time too: on a busy machine a step of milliseconds is often preempted,
            # which inflates its wall time (and a static step's far less often).
            live_cpu = max(r["live_median_cpu_us"] for r in at_goal)
            static = max(r["median_us"] for r in at_goal)
            print(f"goal: <= {goal} us per full step at 1,024 active, {decoding} decoding; "
                  f"worst policy median live {live:.0f} us, CPU {live_cpu:.0f} us "
                  f"({'met' if live <= goal else 'NOT met'}); static {static:.0f} us")
    if any(r["active"] == 1024 for r in rows):
        worst = max(r["live_median_us"] for r in rows if r["active"] == 1024)
        print(f"TensorRT-LLM's Python port: 17,400 us per iteration ({17400 / worst:.1f}x the "
              f"worst live median here)")
    vllm_rows = []
    if args.vllm_venv:
        # Named apart from ``shapes``, which --profile still reads below.
        vllm_shapes = list(dict.fromkeys((r["active"], r["decoding"]) for r in rows))
        result = time_vllm(args.vllm_venv, vllm_shapes, args.vllm_repeats)
        print(f"\nvLLM {result['vllm']} v1 Scheduler ({args.vllm_venv}), same shapes, "
              f"{args.vllm_repeats} steps each: medians, wall / thread CPU time; "
              f"ratio = vLLM / pdserve's worst policy, live")
        print(f"{'active':>7} {'decode':>6} {'pdserve us':>12} {'vLLM schedule() us':>19} "
              f"{'ratio':>11} {'+ update_from_output()':>23} {'ratio':>11}")
        for v in result["rows"]:
            mine = [r for r in rows if (r["active"], r["decoding"]) == (v["active"], v["decoding"])]
            worst = max(mine, key=lambda r: r["live_median_us"])
            wall, cpu = worst["live_median_us"], worst["live_median_cpu_us"]
            v["pdserve_worst_live_us"], v["pdserve_worst_live_cpu_us"] = wall, cpu
            static = max(mine, key=lambda r: r["median_us"])
            v["pdserve_worst_us"], v["pdserve_worst_cpu_us"] = static["median_us"], static["median_cpu_us"]
            vllm_rows.append(v)
            print(f"{v['active']:>7} {v['decoding']:>6} {wall:>5.0f} / {cpu:<4.0f} "
                  f"{v['schedule_us']:>8.0f} / {v['schedule_cpu_us']:<8.0f} "
                  f"{v['schedule_us'] / wall:>4.1f}x/{v['schedule_cpu_us'] / cpu:<4.1f}x "
                  f"{v['step_us']:>10.0f} / {v['step_cpu_us']:<10.0f} "
                  f"{v['step_us'] / wall:>4.1f}x/{v['step_cpu_us'] / cpu:<4.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "scheduler_step", "rows": rows, "vllm": vllm_rows}, f, indent=2)
    if args.profile:
        for n in sizes:
            for shape in shapes:
                for policy in CapacitySchedulerPolicy:
                    for live in (False, True):
                        profile_step(n, policy, args.repeats or max(5, min(200, 20_000 // n)),
                                     decoding=parse_shape(shape, n), live=live)
    return 0


if __name__ == "__main__":
    sys.exit(main())

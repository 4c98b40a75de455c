"""The measurements ``pdserve simulate validate`` calibrates from (steps 1-3 of
``bench/calibrate.py``): timed steps of the in-process engine over a sweep of batch shapes
(``measure_steps``), the probe requests sent to the cluster (``probe_work``) and the gauge of
this machine's CPU contention (``CpuGauge``).
"""
from __future__ import annotations

import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from pdserve.bench.cost_model import SeqWork
from pdserve.bench.workload import WorkItem


# ---------------------------------------------------------------------------- step timing

class _ShapeCapture:
    """Wraps the engine core's scheduler and keeps the batch of the latest step (reuse is off in
    the calibration engine, so positions at scheduling time are the computed ones)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.last: list[SeqWork] = []

    def schedule(self, active_requests, inflight_request_ids=None):
        out = self.scheduler.schedule(active_requests, inflight_request_ids)
        self.last = [SeqWork(r.context_chunk_size, r.context_current_position,
                             r.context_current_position + r.context_chunk_size >= r.prompt_len)
                     for r in out.context_requests if r.context_chunk_size > 0]
        self.last += [SeqWork(1, r.get_num_tokens(0) - 1, True) for r in out.generation_requests]
        return out

    def __getattr__(self, name: str):
        return getattr(self.scheduler, name)


def measure_steps(model_dir: str | Path, engine: dict[str, Any], *, repeats: int = 2,
                  seed: int = 0) -> list[tuple[list[SeqWork], float]]:
    """Timed steps of the in-process engine over a sweep of batch shapes."""
    import torch

    from pdserve.workers.engine.offline import LLMEngine
    from pdserve.workers.runner.sampling import SamplingParams

    torch.set_num_threads(1)  # the worker actors run one torch thread each (LaunchConfig)
    llm = LLMEngine(model_dir, **{**engine, "enable_block_reuse": False})
    capture = _ShapeCapture(llm.core.scheduler)
    llm.core.scheduler = capture
    rng = random.Random(seed)
    vocab = llm.loaded.config.vocab_size
    max_prompt = min(512, engine.get("max_num_tokens", 512))
    samples: list[tuple[list[SeqWork], float]] = []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def drain(record: bool = True) -> None:
        while llm.has_unfinished:
            t0 = time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t0
            if record and capture.last:
                samples.append((list(capture.last), dt))

    def add(n: int, out: int) -> None:
        llm.add_request(prompt(n), SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))

    for _ in range(3):  # warm-up
        add(64, 4)
    drain(record=False)
    for _ in range(repeats):
        for n in (8, 16, 32, 64, 128, 192, 256, 384, max_prompt):
            add(n, 1)
            drain()
        for b in (1, 2, 4, 8, 12, 16):
            for ctx in (32, 160, 400):
                for _ in range(b):
                    add(ctx, 8)
                drain()
        # A mixed stream: arrivals while others decode give context + generation batches.
        for i in range(40):
            add(rng.randint(8, 300), rng.randint(2, 24))
            t0 = time.perf_counter()
            llm.step()
            dt = time.perf_counter() - t0
            if capture.last:
                samples.append((list(capture.last), dt))
        drain()
    return samples


# ---------------------------------------------------------------------------- cluster probes

PROBE_GAP_S = 0.3  # probes are spaced so each runs alone on the cluster


def probe_work(vocab: int, n: int, *, disaggregated: bool, seed: int) -> list[WorkItem]:
    """Requests sent one at a time: n each of (32-token prompt, 1 token), (64, 4), (64, 20) and
    (448, 2): short prefills for the hop, two decode lengths for the decode step, a long prefill
    for the prefill cost (and, disaggregated, a second transfer size)."""
    rng = random.Random(seed)
    kinds = [(32, 1), (64, 4), (64, 20), (448, 2)]
    items = []
    for i in range(n * len(kinds)):
        length, out = kinds[i % len(kinds)]
        items.append(WorkItem(i, i * PROBE_GAP_S, [rng.randrange(3, vocab) for _ in range(length)], out))
    return items


# ---------------------------------------------------------------------------- machine load

class CpuGauge:
    """How contended this machine's CPUs are: a thread samples the kernel's count of runnable
    tasks (``procs_running`` in /proc/stat) every ``interval_s``. With R runnable tasks on C
    cores a CPU-bound step runs about max(1, R / C) times slower than alone; the ratio of that
    slowdown's mean over two windows says how much slower steps ran in one than in the other
    (other jobs on the machine, and the cluster's own processes competing for the cores)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        import threading

        self.cores = os.cpu_count() or 1
        self.samples: list[tuple[float, int]] = []  # (wall time, runnable tasks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                with open("/proc/stat") as f:
                    for line in f:
                        if line.startswith("procs_running"):
                            # this sampling thread is one of them
                            self.samples.append((time.time(), max(0, int(line.split()[1]) - 1)))
                            break
            except OSError:
                return

    def slowdown(self, windows: Sequence[tuple[float, float]]) -> float:
        xs = [max(1.0, (r + 1) / self.cores) for t, r in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(xs) if xs else math.nan

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

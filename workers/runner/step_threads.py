"""How many torch (OpenMP) threads each CPU engine step runs on.

A decode step of a few sequences reads every weight once and does little arithmetic per byte,
so on a CPU it is bound by memory bandwidth; a second thread then gains little, and on a machine
whose other cores also serve the router and the HTTP clients it can lose: a parallel region
waits for its slowest thread, and a thread that shares its core with them straggles. Prefill
chunks are bound by arithmetic and want every thread. Where the line falls depends on the model
(whether its weights fit the cache), the machine and the load, so ``StepThreads`` measures it:
for steps of fewer than ``max_tokens`` tokens it times each candidate count per step-size bucket
(1, 2, 3-4, 5-8, ... tokens) and then runs the fastest, re-timing the others now and then.

Pure logic (no torch): the engine core asks ``threads_for(tokens)`` before a step's forward and
reports ``observe(tokens, threads, seconds)`` after it. Results do not depend on the count:
pdserve's CPU kernels give each row or sequence to one thread, and oneDNN's GEMMs at these
shapes were bit-identical on 1 and 2 threads (tests/unit/test_step_threads.py checks a model).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

WINDOW = 9  # timings kept per (bucket, candidate); the decision is their median
REPROBE_EVERY = 512  # steps of a bucket between re-timings of the candidates not chosen


def candidates(full: int) -> list[int]:
    """1, the powers of two below ``full``, and ``full``."""
    out, n = [], 1
    while n < full:
        out.append(n)
        n *= 2
    return out + [full]


def bucket(tokens: int) -> int:
    """0 for 1 token, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return max(0, tokens - 1).bit_length()


@dataclass
class _Bucket:
    timings: dict[int, deque] = field(default_factory=dict)
    steps: int = 0
    best: int | None = None


class StepThreads:
    """Threads per step: ``full`` for steps of ``max_tokens`` tokens or more; for smaller ones
    ``fixed`` when given, else the measured fastest of ``candidates(full)``."""

    def __init__(self, full: int, max_tokens: int, fixed: int | None = None, *,
                 window: int = WINDOW, reprobe_every: int = REPROBE_EVERY) -> None:
        if full < 1 or max_tokens < 1 or (fixed is not None and fixed < 1):
            raise ValueError("thread counts and max_tokens must be positive")
        self.full, self.max_tokens, self.fixed = full, max_tokens, fixed
        self.candidates = candidates(full)
        self.window, self.reprobe_every = window, reprobe_every
        self._buckets: dict[int, _Bucket] = {}

    @property
    def tuning(self) -> bool:
        return self.fixed is None and len(self.candidates) > 1

    def threads_for(self, tokens: int) -> int:
        if tokens >= self.max_tokens:
            return self.full
        if not self.tuning:
            return self.fixed if self.fixed is not None else self.full
        b = self._buckets.setdefault(bucket(tokens), _Bucket())
        b.steps += 1
        timed = {c: len(b.timings.get(c, ())) for c in self.candidates}
        short = [c for c in self.candidates if timed[c] < self.window]
        if short:  # still measuring: the candidate with the fewest timings
            return min(short, key=lambda c: (timed[c], c))
        others = [c for c in self.candidates if c != b.best]
        turn = b.steps % self.reprobe_every
        if turn < len(others):  # one step on each other candidate, every reprobe_every steps
            return others[turn]
        return b.best if b.best is not None else self.full

    def observe(self, tokens: int, threads: int, seconds: float) -> None:
        if not self.tuning or tokens >= self.max_tokens or threads not in self.candidates:
            return
        b = self._buckets.setdefault(bucket(tokens), _Bucket())
        b.timings.setdefault(threads, deque(maxlen=self.window)).append(seconds)
        if all(len(b.timings.get(c, ())) >= self.window for c in self.candidates):
            b.best = min(self.candidates, key=lambda c: (median(b.timings[c]), c))

    def choices(self) -> dict[int, int]:
        """The count chosen so far per bucket's largest step size (for logs and tests)."""
        return {1 << k: b.best for k, b in sorted(self._buckets.items()) if b.best is not None}

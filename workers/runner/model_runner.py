"""The model runner: the model, its KV pool and one step's forward and sampling.

It carries out a ``StepPlan`` (step_plan.py) and returns a ``StepResult``. It knows nothing of
requests' lifecycles, the schedulers or the KV manager: the plan names the tokens, positions and
block tables, and which rows produce a token. The engine core (engine_core.py) decides all of
that.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from pdserve.transport.kv_pool import KVPool
from pdserve.workers.model.batch import SeqBatchInfo
from pdserve.workers.runner.sampling import sample, token_logprobs
from pdserve.workers.runner.plan import SampledToken, SamplingBatch, StepPlan, StepResult
from pdserve.workers.runner.step_threads import StepThreads


class ModelRunner:
    """``small_step_threads``: EngineConfig's intra-op thread policy for CPU steps
    (step_threads.py), None to run every step on all of torch's threads (counted when the
    runner is built: the worker sets the count first)."""

    def __init__(self, model, kv_pool: KVPool, *, small_step_threads: int | str | None = None,
                 small_step_tokens: int = 0) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self._step_threads = (
            None if small_step_threads is None or self.device.type != "cpu"
            else StepThreads(torch.get_num_threads(), small_step_tokens,
                             None if small_step_threads == "auto" else small_step_threads))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Each (src, dst): block dst becomes a copy of block src (a fork's partial block)."""
        for src, dst in copies:
            self.kv_pool.copy_block(src, dst)

    def close(self) -> None:
        """Release what the runner started (a group runner's other ranks); nothing here."""

    def check(self) -> None:
        """Raise if the runner cannot run another step (a group runner whose rank is gone)."""

    def execute(self, plan: StepPlan, sampling: SamplingBatch | None,
                on_layer: Callable[[int], None] | None = None) -> StepResult:
        """One forward over the plan's flat batch, then the sampling rows' draws. ``sampling``
        None: forward only (a rank that does not sample). ``on_layer(n)``: called once the
        forward has written layers 0 .. n - 1 (the layer-wise KV send follows it)."""
        seqs = [SeqBatchInfo(s.start, s.num_new_tokens, s.past_len, s.block_table)
                for s in plan.sequences]
        scored = [s for s in plan.sequences[:plan.num_context] if s.prompt_logprobs is not None]
        t0 = time.perf_counter()
        threads = None
        if self._step_threads is not None:
            threads = self._step_threads.threads_for(plan.num_tokens)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)  # the calling thread's count, which the step uses
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        logits = self.model.forward(ids, None, seqs, self.kv_pool, all_logits=bool(scored),
                                    on_layer=on_layer)  # [len(seqs), V], or [T, V]
        seconds = time.perf_counter() - t0
        if threads is not None:
            self._step_threads.observe(plan.num_tokens, threads, seconds)
        result = StepResult(forward_seconds=seconds)
        if scored:
            full = logits
            last = torch.tensor([s.start + s.num_new_tokens - 1 for s in seqs], dtype=torch.long,
                                device=full.device)
            logits = full.index_select(0, last)
            for s in scored:
                result.prompt_logprobs[s.request_id] = _prompt_logprobs(
                    full[s.start:s.start + len(s.prompt_targets)], s.prompt_targets,
                    s.prompt_logprobs)
        rows = [i for i, s in enumerate(plan.sequences) if s.samples]
        if sampling is None or not rows:
            return result
        picked = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        tokens, logprobs = sample(picked, sampling.samplers, sampling.sequences)
        result.tokens = [SampledToken(t, lp) for t, lp in zip(tokens, logprobs)]
        for i, samplers in sampling.extra.items():
            row = picked[i:i + 1]
            firsts = []
            for sampler in samplers:  # each candidate draws from the one prefill's logits
                tok, lp = sample(row, [sampler], [sampling.sequences[i]])
                firsts.append(SampledToken(tok[0], lp[0]))
            result.extra[plan.sequences[rows[i]].request_id] = firsts
        return result


def _prompt_logprobs(rows: torch.Tensor, targets: Sequence[int], k: int) -> list:
    """Row j predicted ``targets[j]``: its logprob, rank and top k."""
    if not targets:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)
    return [token_logprobs(lp[j], targets[j], k) for j in range(len(targets))]

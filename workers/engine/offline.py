"""The offline API (vLLM-style ``LLM.generate``) over an in-process engine.

``LLMEngine`` owns the engine core (with its model runner and KV pool) and turns prompts into
requests; ``LLM`` drives it to completion (batch) or yields deltas as they are produced
(streaming).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from pdserve.scheduler import LlmRequest
from pdserve.transport.requests import UpdateKind, WireUpdate
from pdserve.transport.requests.sampling import bad_words_to_token_ids

from pdserve.workers.engine.build import build_engine_core
from pdserve.workers.config import EngineConfig
from pdserve.workers.loading.hub import check_supported_options
from pdserve.workers.loading.loader import LoadedModel
from pdserve.workers.runner.sampling import SamplingLimits, SamplingParams

Prompt = str | Sequence[int]


@dataclass(slots=True)
class CompletionOutput:
    """One returned candidate of a request (vLLM's CompletionOutput)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list | None = None
    cumulative_logprob: float | None = None  # with logprobs (and always with best_of)


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all generated so far (or a delta)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    # With SamplingParams.logprobs: TokenLogprobs per token of token_ids; with prompt_logprobs:
    # one per prompt token after the first.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # Every returned candidate (n of them; with best_of, the n best by cumulative logprob, best
    # first); the fields above are the first one's.
    outputs: list[CompletionOutput] = field(default_factory=list)



class LLMEngine:
    def __init__(self, model: str | Path | LoadedModel, **engine_config) -> None:
        # vLLM's model options pdserve does not implement: refused (ValueError), not ignored.
        check_supported_options(model if not isinstance(model, LoadedModel) else None,
                                revision=engine_config.pop("revision", None),
                                tokenizer=engine_config.pop("tokenizer", None),
                                trust_remote_code=engine_config.pop("trust_remote_code", False))
        self.config = EngineConfig.from_kwargs(engine_config)
        self.loaded, self.core = build_engine_core(model, self.config)
        self.kv_pool = self.core.kv_pool
        self.tokenizer = self.loaded.tokenizer
        self._ids = itertools.count()
        self._outputs: dict[int, RequestOutput] = {}
        self._candidates: dict[int, tuple[list[CompletionOutput], SamplingParams]] = {}

    def close(self) -> None:
        """Stop what the engine started (a worker group's other ranks); idempotent."""
        self.core.runner.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            # vLLM's LLM.generate: a text prompt gets the tokenizer's special tokens (its BOS).
            return self.tokenizer.encode(prompt, add_special_tokens=True).ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt token ids must not be empty")
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: int | None = None,
        priority: float = 0.5,
    ) -> int:
        params = params or SamplingParams()
        params.validate(SamplingLimits(vocab_size=self.loaded.config.vocab_size))
        if params.bad_words:
            params = params.replace(bad_words_token_ids=bad_words_to_token_ids(
                params.bad_words, lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids))
        wanted = params
        if params.best_of is not None and params.best_of > params.n and params.logprobs is None:
            params = params.replace(logprobs=0)  # ranking needs each token's logprob
        ids = self.encode(prompt)
        rid = next(self._ids) if request_id is None else int(request_id)
        request = LlmRequest(rid, ids, params.max_tokens, priority=priority)
        self.core.add_request(request, params)
        self._outputs[rid] = RequestOutput(rid, ids, logprobs=[] if params.logprobs is not None else None)
        self._candidates[rid] = ([CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                                  for i in range(params.candidates)], wanted)
        return rid

    def abort(self, request_id: int) -> bool:
        update = self.core.abort(request_id)
        if update is None:
            return False
        self._apply(update)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_work

    def step(self) -> list[tuple[RequestOutput, WireUpdate]]:
        return [(self._apply(u), u) for u in self.core.step()]

    def _apply(self, update: WireUpdate) -> RequestOutput:
        out = self._outputs[update.request_id]
        candidates, wanted = self._candidates[update.request_id]
        if update.prompt_logprobs is not None:
            out.prompt_logprobs = list(update.prompt_logprobs)
        cand = candidates[update.index]
        cand.token_ids.extend(update.new_token_ids)
        if update.logprobs and cand.logprobs is not None:
            cand.logprobs.extend(update.logprobs)
        if update.index == 0:
            out.token_ids.extend(update.new_token_ids)
            if update.logprobs and out.logprobs is not None:
                out.logprobs.extend(update.logprobs)
        if update.kind == UpdateKind.CHOICE_DONE or update.finished:
            cand.finish_reason = update.outcome
        if update.finished:
            for other in candidates:  # the request ended them (an abort, a deadline)
                if other.finish_reason is None:
                    other.finish_reason = update.outcome
            self._finish(out, candidates, wanted)
            del self._outputs[update.request_id], self._candidates[update.request_id]
        return out

    def _finish(self, out: RequestOutput, candidates: list[CompletionOutput],
                wanted: SamplingParams) -> None:
        for cand in candidates:
            cand.text = self.decode(cand.token_ids)
            if cand.logprobs is not None:
                cand.cumulative_logprob = sum(e.logprob for e in cand.logprobs)
        if wanted.best_of is not None and wanted.best_of > wanted.n:
            ranked = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:wanted.n]
        else:
            ranked = candidates
        if wanted.logprobs is None:
            for cand in ranked:
                cand.logprobs = None
        out.outputs = ranked
        best = ranked[0]
        out.finished = True
        out.token_ids, out.text, out.finish_reason = list(best.token_ids), best.text, best.finish_reason
        out.logprobs = best.logprobs


class LLM:
    """Offline API: ``LLM(model_dir, **engine_config).generate(prompts, SamplingParams(...))``."""

    def __init__(self, model: str | Path | LoadedModel, **engine_config) -> None:
        self.engine = LLMEngine(model, **engine_config)

    def close(self) -> None:
        """Stop the worker group's other ranks (``tensor_parallel_size`` > 1); they also stop
        by themselves when this process exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self):
        return self.engine.core.stats

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        outputs: dict[int, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out, update in self.engine.step():
                if update.finished:
                    outputs[out.request_id] = out
        return [outputs[r] for r in rids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields one delta per request per step that produced tokens: ``token_ids`` and ``text``
        hold only what is new; the last delta of a request has ``finished`` set. Closing the
        iterator early aborts whatever is still running."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if any(p.candidates > 1 for p in params):
            raise ValueError("n/best_of: several candidates per prompt are returned by generate()")
        rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        pending = set(rids)
        sent_text: dict[int, str] = {r: "" for r in rids}
        try:
            while pending and self.engine.has_unfinished:
                for out, update in self.engine.step():
                    if out.request_id not in pending:
                        continue
                    text = self.engine.decode(out.token_ids)
                    delta_text = text[len(sent_text[out.request_id]):]
                    sent_text[out.request_id] = text
                    if update.finished:
                        pending.discard(out.request_id)
                    yield RequestOutput(
                        out.request_id, out.prompt_token_ids, list(update.new_token_ids),
                        delta_text, update.finished, update.outcome,
                    )
        finally:
            for rid in pending:
                self.engine.abort(rid)

    def abort(self, request_id: int) -> bool:
        return self.engine.abort(request_id)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params

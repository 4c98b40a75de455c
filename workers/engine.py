"""The in-process engine and the offline API (vLLM-style ``LLM.generate``).

``LLMEngine`` owns the model, the KV pool and the executor and turns prompts into requests;
``LLM`` drives it to completion (batch) or yields deltas as they are produced (streaming).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from pdserve.scheduler import LlmRequest
from pdserve.transport.requests import UpdateKind, WireUpdate

from .config import EngineConfig

from .engine_core import EngineCore
from .model_runner import ModelRunner
from .hub import check_supported_options
from .kv_pool import KVPool
from .loader import (LoadedModel, check_memory, checkpoint_bytes, load_config, load_model,
                     resolve_dtype, resolve_model_dir, stored_dtype)
from .model import ModelConfig
from .sampling import SamplingLimits, SamplingParams
from pdserve.transport.requests.sampling import bad_words_to_token_ids
from .transceiver import KVTransceiver

Prompt = str | Sequence[int]
log = logging.getLogger("pdserve.engine")

# Default pool when neither num_kv_blocks nor kv_cache_memory_bytes is given: room for a full
# batch of sequences of up to this many tokens, within the memory cap below.
_DEFAULT_TOKENS_PER_SEQ = 2048
_DEFAULT_KV_MEMORY_CAP = 2 << 30


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


def kv_pool_size(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(KV blocks, bytes per block) of a worker's pool: num_kv_blocks, else as many blocks as
    kv_cache_memory_bytes holds, else a full batch of sequences within the default cap."""
    B = config.tokens_per_block
    per_block = KVPool.bytes_per_block_for(
        mcfg.num_hidden_layers, B, mcfg.cache_heads, mcfg.cache_head_dim, dtype, mcfg.kv_planes,
    )
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, per_block
    budget = config.kv_cache_memory_bytes
    if budget is None:
        max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
        want = config.max_batch_size * -(-min(max_seq_len, _DEFAULT_TOKENS_PER_SEQ) // B)
        budget = min(_DEFAULT_KV_MEMORY_CAP, want * per_block)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {per_block} bytes")
    return num_blocks, per_block


# Largest decode batch replayed as a CUDA graph (vLLM's default capture limit is 512 too);
# bigger decode batches run eagerly.
MAX_GRAPH_BATCH = 512


def build_executor(
    model: str | Path | LoadedModel,
    config: EngineConfig,
    *,
    transceiver_factory: Callable[[KVPool], KVTransceiver] | None = None,
) -> tuple[LoadedModel, EngineCore]:
    """Load the model (a directory or a Hub repo id), size and allocate the KV pool and build
    the executor (with a KV transceiver for disaggregated workers). Before any weight is read,
    the weights and the pool are checked to fit the device's memory (``check_memory``)."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(model, LoadedModel):
        loaded = model
    else:
        model_dir = resolve_model_dir(model)
        mcfg = load_config(model_dir)
        dtype = resolve_dtype(config.dtype, device, stored_dtype(model_dir))
        blocks, per_block = kv_pool_size(config, mcfg, dtype)
        blocks += 1 if sliding_window_of(mcfg) is not None else 0  # the scratch block
        check_memory(checkpoint_bytes(model_dir, dtype, mcfg), blocks * per_block, dtype, device)
        loaded = load_model(model_dir, dtype=dtype, device=device)
    mcfg = loaded.config
    max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
    if max_seq_len > mcfg.max_position_embeddings:
        # Positions past the trained range give no error, only wrong text: refuse, as vLLM does.
        raise ValueError(
            f"max_seq_len ({max_seq_len}) is greater than the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings}, config.json)"
        )
    B = config.tokens_per_block
    num_blocks, _ = kv_pool_size(config, mcfg, loaded.model.dtype)
    window = sliding_window_of(mcfg)
    if window is not None:
        log.info("sliding window of %d tokens on every layer: KV blocks leave the pool as the "
                 "window passes them", window)
    elif any(w is not None for w in mcfg.layer_windows):
        log.info("layers differ in their attention windows (windowed and full layers): every "
                 "KV block is kept, as one pool holds the longest history; blocks are freed as "
                 "the window passes only when every layer shares one window")
    # With a window the executor keeps the pool's last block as its scratch block.
    kv_pool = KVPool.for_model(mcfg, num_blocks + (1 if window is not None else 0), B,
                               dtype=loaded.model.dtype, device=device)
    if kv_pool.device.type == "cuda" and not config.enforce_eager:
        # Decode steps as CUDA graphs, one per (batch, table width) bucket, captured on first use.
        loaded.model.enable_decode_graphs(kv_pool, max_batch=min(config.max_batch_size, MAX_GRAPH_BATCH),
                                          max_blocks=-(-max_seq_len // B) + (1 if window is not None else 0))
    runner = ModelRunner(loaded.model, kv_pool, small_step_threads=config.small_step_threads,
                         small_step_tokens=config.small_step_tokens)
    executor = EngineCore(
        runner,
        config,
        eos_token_ids=loaded.eos_token_ids,
        vocab_size=mcfg.vocab_size,
        max_seq_len=max_seq_len,
        transceiver=transceiver_factory(kv_pool) if transceiver_factory is not None else None,
        grammar=_LazyGrammar(loaded, mcfg.vocab_size) if loaded.tokenizer is not None else None,
        attention_window=window,
    )
    return loaded, executor


def sliding_window_of(mcfg: ModelConfig) -> int | None:
    """The window W when every layer attends to the last W keys only (Mistral, Mixtral, Qwen2/3
    with every layer sliding): then a sequence's KV blocks can leave the pool as the window
    passes them. None when any layer attends to the whole history (it needs every block)."""
    windows = set(mcfg.layer_windows)
    return windows.pop() if len(windows) == 1 and None not in windows else None


def build_worker_executor(worker_id: str, role: str, model: str | Path | LoadedModel,
                          config: EngineConfig, *, lease_s: float = 30.0,
                          transfer_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                          stall_send_s: Callable[[], float] | None = None,
                          kv_link: bool = True, host: str = "127.0.0.1") -> tuple[LoadedModel, EngineCore]:
    """A disaggregated worker's executor: a KV sender for role "context", a receiver for
    "generation", both for "both" (the RPC test workers). ``stall_send_s`` is read before
    each send's first chunk (fault injection: the send stalls while it is above 0). ``host``
    is this node's address: a context worker's KV store and KV link bind and advertise it, so
    generation workers on other nodes can reach them (a Ray worker passes its node's IP)."""
    from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig

    def hook(descriptor, chunk_index):
        # Re-read while waiting, so turning the stall off releases a stalled send.
        start = time.monotonic()
        while chunk_index == 0 and time.monotonic() - start < stall_send_s():
            time.sleep(0.01)

    def transceiver_factory(pool: KVPool) -> KVTransceiver:
        sender = receiver = None
        if role in ("context", "both"):
            sender = KVSender(worker_id, pool, send_hook=hook if stall_send_s else None,
                              config=TransportConfig(host=host, default_timeout_s=lease_s,
                                                     connect_timeout_s=connect_timeout_s))
        if role in ("generation", "both"):
            receiver = KVReceiver(worker_id, pool,
                                  config=TransportConfig(host=host,
                                                         default_timeout_s=transfer_timeout_s,
                                                         connect_timeout_s=connect_timeout_s,
                                                         direct_link=kv_link))
        return KVTransceiver(worker_id, sender=sender, receiver=receiver, lease_s=lease_s,
                             transfer_timeout_s=transfer_timeout_s)

    return build_executor(model, config, transceiver_factory=transceiver_factory)


class _LazyGrammar:
    """The worker's GrammarCompiler, built on the first structured-output request (building one
    reads the whole vocabulary: about a second for a 32k-token tokenizer)."""

    def __init__(self, loaded: LoadedModel, vocab_size: int) -> None:
        self._loaded, self._vocab_size, self._compiler = loaded, vocab_size, None

    def matcher(self, spec):
        return self._get().matcher(spec)

    def matcher_after(self, guided, output):
        return self._get().matcher_after(guided, output)

    def _get(self):
        if self._compiler is None:
            from .grammar import GrammarCompiler

            # Compact JSON: flexible whitespace lets a weak (or random-weight) model wander in
            # blanks until max_tokens; the values and keys are the model's either way.
            self._compiler = GrammarCompiler(self._loaded.tokenizer, self._vocab_size,
                                             self._loaded.eos_token_ids,
                                             json_whitespace_flexible=False)
        return self._compiler


class LLMEngine:
    def __init__(self, model: str | Path | LoadedModel, **engine_config) -> None:
        # vLLM's model options pdserve does not implement: refused (ValueError), not ignored.
        check_supported_options(model if not isinstance(model, LoadedModel) else None,
                                revision=engine_config.pop("revision", None),
                                tokenizer=engine_config.pop("tokenizer", None),
                                trust_remote_code=engine_config.pop("trust_remote_code", False))
        self.config = EngineConfig.from_kwargs(engine_config)
        self.loaded, self.executor = build_executor(model, self.config)
        self.kv_pool = self.executor.kv_pool
        self.tokenizer = self.loaded.tokenizer
        self._ids = itertools.count()
        self._outputs: dict[int, RequestOutput] = {}
        self._candidates: dict[int, tuple[list[CompletionOutput], SamplingParams]] = {}

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
        self.executor.add_request(request, params)
        self._outputs[rid] = RequestOutput(rid, ids, logprobs=[] if params.logprobs is not None else None)
        self._candidates[rid] = ([CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                                  for i in range(params.candidates)], wanted)
        return rid

    def abort(self, request_id: int) -> bool:
        update = self.executor.abort(request_id)
        if update is None:
            return False
        self._apply(update)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.executor.has_work

    def step(self) -> list[tuple[RequestOutput, WireUpdate]]:
        return [(self._apply(u), u) for u in self.executor.step()]

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

    @property
    def stats(self):
        return self.engine.executor.stats

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

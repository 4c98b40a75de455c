"""Building a worker's engine: load the model, plan memory, allocate the KV pool, and put the
model runner, the engine core and (for a disaggregated worker) its KV transceiver together."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from pdserve.transport.kv_pool import KVPool

from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.core import EngineCore
from pdserve.workers.loading.loader import LoadedModel, load_model, resolve_model_dir
from pdserve.workers.loading.memory import (plan_memory, plan_model_dir, scratch_blocks,
                                            sliding_window_of)
from pdserve.workers.runner.model_runner import ModelRunner
from pdserve.workers.engine.transceiver import KVTransceiver

log = logging.getLogger("pdserve.engine")


# Largest decode batch replayed as a CUDA graph (vLLM's default capture limit is 512 too);
# bigger decode batches run eagerly.
MAX_GRAPH_BATCH = 512


def build_engine_core(
    model: str | Path | LoadedModel,
    config: EngineConfig,
    *,
    transceiver_factory: Callable[[KVPool], KVTransceiver] | None = None,
) -> tuple[LoadedModel, EngineCore]:
    """Load the model (a directory or a Hub repo id), size and allocate the KV pool and build
    the engine core (with a KV transceiver for disaggregated workers). Before any weight is read,
    the weights and the pool are checked to fit the device's memory (``check_memory``)."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(model, LoadedModel):
        loaded = model
        plan = plan_memory(config, loaded.config, loaded.model.dtype, device,
                           scratch_blocks=scratch_blocks(loaded.config))
    else:
        model_dir = resolve_model_dir(model)
        plan = plan_model_dir(model_dir, config, device)  # raises before a weight is read
        loaded = load_model(model_dir, dtype=plan.dtype, device=device)
    mcfg = loaded.config
    max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
    if max_seq_len > mcfg.max_position_embeddings:
        # Positions past the trained range give no error, only wrong text: refuse, as vLLM does.
        raise ValueError(
            f"max_seq_len ({max_seq_len}) is greater than the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings}, config.json)"
        )
    B = config.tokens_per_block
    window = sliding_window_of(mcfg)
    if window is not None:
        log.info("sliding window of %d tokens on every layer: KV blocks leave the pool as the "
                 "window passes them", window)
    elif any(w is not None for w in mcfg.layer_windows):
        log.info("layers differ in their attention windows (windowed and full layers): every "
                 "KV block is kept, as one pool holds the longest history; blocks are freed as "
                 "the window passes only when every layer shares one window")
    # With a window the KV manager keeps the pool's last block as its scratch block.
    kv_pool = KVPool.for_model(mcfg, plan.pool_blocks, B,
                               dtype=loaded.model.dtype, device=device)
    if kv_pool.device.type == "cuda" and not config.enforce_eager:
        # Decode steps as CUDA graphs, one per (batch, table width) bucket, captured on first use.
        loaded.model.enable_decode_graphs(kv_pool, max_batch=min(config.max_batch_size, MAX_GRAPH_BATCH),
                                          max_blocks=-(-max_seq_len // B) + (1 if window is not None else 0))
    runner = ModelRunner(loaded.model, kv_pool, small_step_threads=config.small_step_threads,
                         small_step_tokens=config.small_step_tokens)
    core = EngineCore(
        runner,
        config,
        eos_token_ids=loaded.eos_token_ids,
        vocab_size=mcfg.vocab_size,
        max_seq_len=max_seq_len,
        transceiver=transceiver_factory(kv_pool) if transceiver_factory is not None else None,
        grammar=_LazyGrammar(loaded, mcfg.vocab_size) if loaded.tokenizer is not None else None,
        attention_window=window,
    )
    return loaded, core


def build_worker_core(worker_id: str, role: str, model: str | Path | LoadedModel,
                          config: EngineConfig, *, lease_s: float = 30.0,
                          transfer_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                          stall_send_s: Callable[[], float] | None = None,
                          kv_link: bool = True, host: str = "127.0.0.1") -> tuple[LoadedModel, EngineCore]:
    """A disaggregated worker's core: a KV sender for role "context", a receiver for
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

    return build_engine_core(model, config, transceiver_factory=transceiver_factory)


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
            from pdserve.workers.engine.grammar import GrammarCompiler

            # Compact JSON: flexible whitespace lets a weak (or random-weight) model wander in
            # blanks until max_tokens; the values and keys are the model's either way.
            self._compiler = GrammarCompiler(self._loaded.tokenizer, self._vocab_size,
                                             self._loaded.eos_token_ids,
                                             json_whitespace_flexible=False)
        return self._compiler

"""Building a worker's engine: load the model, plan memory, allocate the KV pool, and put the
model runner, the engine core and (for a disaggregated worker) its KV transceiver together."""
from __future__ import annotations

import datetime
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from pdserve.transport.kv_pool import KVPool

from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.core import EngineCore
from pdserve.workers.loading.loader import LoadedModel, load_model, resolve_model_dir
from pdserve.workers.loading.memory import (plan_memory, plan_model_dir, scratch_blocks,
                                            sliding_window_of)
from pdserve.workers.model.parallel import rank_cache_heads
from pdserve.workers.runner.group import (GroupAddress, GroupModelRunner, LocalFollowers, PlanPublisher,
                                          new_secret, node_host, open_process_group)
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
    start_followers: StartFollowers | None = None,
    rank_threads: int | None = None,
) -> tuple[LoadedModel, EngineCore]:
    """Load the model (a directory or a Hub repo id), size and allocate the KV pool and build
    the engine core (with a KV transceiver for disaggregated workers). Before any weight is read,
    the weights and the pool are checked to fit the device's memory (``check_memory``).

    With ``tensor_parallel_size`` N > 1 this process is rank 0 of a worker group: it starts the
    other N - 1 ranks (``start_followers``; default: local child processes), and every rank
    loads its own shard (runner/group.py). ``rank_threads``: CPU threads per rank (default:
    this machine's cores shared by the N ranks)."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if config.tensor_parallel_size > 1:
        if isinstance(model, LoadedModel):
            raise ValueError("tensor_parallel_size > 1 loads each rank's shard itself: pass the model "
                             "directory or repo id, not a loaded model")
        loaded, runner = _group_runner(resolve_model_dir(model), config, device, start_followers, rank_threads)
        return loaded, _core(loaded, runner, config, transceiver_factory)
    if isinstance(model, LoadedModel):
        loaded = model
        plan = plan_memory(config, loaded.config, loaded.model.dtype, device,
                           scratch_blocks=scratch_blocks(loaded.config))
    else:
        model_dir = resolve_model_dir(model)
        plan = plan_model_dir(model_dir, config, device)  # raises before a weight is read
        loaded = load_model(model_dir, dtype=plan.dtype, device=device)
    max_seq_len = _max_seq_len(loaded, config)
    B = config.tokens_per_block
    window = sliding_window_of(loaded.config)
    # With a window the KV manager keeps the pool's last block as its scratch block.
    kv_pool = KVPool.for_model(loaded.config, plan.pool_blocks, B,
                               dtype=loaded.model.dtype, device=device)
    if kv_pool.device.type == "cuda" and not config.enforce_eager:
        # Decode steps as CUDA graphs, one per (batch, table width) bucket, captured on first use.
        loaded.model.enable_decode_graphs(kv_pool, max_batch=min(config.max_batch_size, MAX_GRAPH_BATCH),
                                          max_blocks=-(-max_seq_len // B) + (1 if window is not None else 0))
    runner = ModelRunner(loaded.model, kv_pool, small_step_threads=config.small_step_threads,
                         small_step_tokens=config.small_step_tokens)
    return loaded, _core(loaded, runner, config, transceiver_factory)


def _max_seq_len(loaded: LoadedModel, config: EngineConfig) -> int:
    mcfg = loaded.config
    max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
    if max_seq_len > mcfg.max_position_embeddings:
        # Positions past the trained range give no error, only wrong text: refuse, as vLLM does.
        raise ValueError(
            f"max_seq_len ({max_seq_len}) is greater than the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings}, config.json)"
        )
    return max_seq_len


def _core(loaded: LoadedModel, runner: ModelRunner, config: EngineConfig,
          transceiver_factory: Callable[[KVPool], KVTransceiver] | None) -> EngineCore:
    mcfg = loaded.config
    window = sliding_window_of(mcfg)
    if window is not None:
        log.info("sliding window of %d tokens on every layer: KV blocks leave the pool as the "
                 "window passes them", window)
    elif any(w is not None for w in mcfg.layer_windows):
        log.info("layers differ in their attention windows (windowed and full layers): every "
                 "KV block is kept, as one pool holds the longest history; blocks are freed as "
                 "the window passes only when every layer shares one window")
    return EngineCore(
        runner,
        config,
        eos_token_ids=loaded.eos_token_ids,
        vocab_size=mcfg.vocab_size,
        max_seq_len=_max_seq_len(loaded, config),
        transceiver=transceiver_factory(runner.kv_pool) if transceiver_factory is not None else None,
        grammar=_LazyGrammar(loaded, mcfg.vocab_size) if loaded.tokenizer is not None else None,
        attention_window=window,
    )


# Starts a group's follower ranks: (model_dir, config, address, pool_blocks, dtype, device) ->
# a handle with close(); LocalFollowers by default, Ray actors in a cluster worker.
StartFollowers = Callable[..., Any]


def _group_runner(model_dir: Path, config: EngineConfig, device: str, start_followers: StartFollowers | None,
                  rank_threads: int | None) -> tuple[LoadedModel, GroupModelRunner]:
    """Rank 0 of a worker group: plan rank 0's memory (every rank's is alike), open the
    rendezvous store and the plan channel, start the followers, join the process group, load
    rank 0's shard and wait for every follower's plan stream. Whatever was started is stopped
    again when any of it fails."""
    size = config.tensor_parallel_size
    plan = plan_model_dir(model_dir, config, device)  # raises before a weight is read
    host, timeout = node_host(), datetime.timedelta(seconds=config.group_timeout_s)
    store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
    publisher = PlanPublisher(host, size, config.group_timeout_s, new_secret())
    address = GroupAddress(host, store.port, publisher.port, publisher.secret, size, config.group_timeout_s)
    threads = None
    if torch.device(device).type == "cpu":
        threads = rank_threads or max(1, len(os.sched_getaffinity(0)) // size)
    followers = None
    try:
        start = start_followers or LocalFollowers
        followers = start(str(model_dir), config, address, plan.pool_blocks, plan.dtype, device,
                          threads=threads)
        if threads is not None:
            torch.set_num_threads(threads)  # one rank's share of the cores, as each follower's
        tp = open_process_group(address, 0, device, store, expert_parallel=config.enable_expert_parallel)
        loaded = load_model(model_dir, dtype=plan.dtype, device=device, tp=tp)
        publisher.accept(config.group_timeout_s)
        pool = KVPool.for_model(loaded.config, plan.pool_blocks, config.tokens_per_block,
                                dtype=loaded.model.dtype, device=device,
                                num_kv_heads=rank_cache_heads(loaded.config, tp))
        runner = GroupModelRunner(loaded.model, pool, publisher, followers=followers,
                                  small_step_threads=config.small_step_threads,
                                  small_step_tokens=config.small_step_tokens)
    except BaseException:
        publisher.close()
        if followers is not None:
            followers.close(timeout_s=2.0)
        raise
    runner.store = store  # the rendezvous store lives as long as the group
    log.info("worker group of %d ranks: %s", size, tp)
    return loaded, runner


def build_worker_core(worker_id: str, role: str, model: str | Path | LoadedModel,
                          config: EngineConfig, *, lease_s: float = 30.0,
                          transfer_timeout_s: float = 30.0, connect_timeout_s: float = 30.0,
                          stall_send_s: Callable[[], float] | None = None,
                          kv_link: bool = True, host: str = "127.0.0.1",
                          start_followers: StartFollowers | None = None,
                          rank_threads: int | None = None) -> tuple[LoadedModel, EngineCore]:
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

    return build_engine_core(model, config, transceiver_factory=transceiver_factory,
                             start_followers=start_followers, rank_threads=rank_threads)


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

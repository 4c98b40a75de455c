"""What the context and generation Ray actors share: build the executor with its KV transceiver,
run it on a WorkerLoop, stream request updates back as a generator, and serve KV control
messages in a dedicated concurrency group (so each transfer is its own task, with its duration,
in the dashboard's task view).

The actor classes themselves (``context_worker.py``, ``generation_worker.py``) only pick the
role; Ray's decorator is applied there.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any, Iterator

from pdserve.scheduler import ContextPhaseParams, LlmRequest, LlmRequestType

from .config import EngineConfig
from .engine import build_executor
from .sampling import SamplingParams
from .transceiver import KVTransceiver
from .worker_loop import WorkerLoop

log = logging.getLogger("pdserve.worker")

NAMESPACE = "pdserve"
# Cached-prefix hashes advertised to the router's kv_cache_aware policy (most recent first).
MAX_ADVERTISED_HASHES = 50_000


def actor_name(worker_id: str) -> str:
    return f"pdserve-{worker_id}"


def request_from_wire(d: dict[str, Any]) -> tuple[LlmRequest, SamplingParams]:
    cpp = d.get("context_phase_params")
    request = LlmRequest(
        d["request_id"],
        d["prompt"],
        d["max_new_tokens"],
        priority=d.get("priority", 0.5),
        agent_hierarchy=d.get("agent_hierarchy"),
        llm_request_type=LlmRequestType[d.get("type", "CONTEXT_AND_GENERATION")],
        context_phase_params=ContextPhaseParams(**cpp) if cpp else None,
    )
    return request, SamplingParams(**d["sampling"])


def update_to_wire(update) -> dict[str, Any]:
    d = update._asdict()
    cpp = update.context_phase_params
    if cpp is not None:
        d["context_phase_params"] = {
            "ctx_request_id": cpp.ctx_request_id,
            "first_gen_tokens": list(cpp.first_gen_tokens),
            "opaque_state": cpp.opaque_state,
            "prompt_token_ids": cpp.prompt_token_ids,
            "ctx_worker_id": cpp.ctx_worker_id,
            "num_blocks": cpp.num_blocks,
        }
    return d


class WorkerActorBase:
    role: str = "context"

    def __init__(
        self,
        worker_id: str,
        model_dir: str,
        engine: dict[str, Any],
        *,
        lease_s: float = 30.0,
        transfer_timeout_s: float = 30.0,
        torch_threads: int | None = None,
        metrics: bool = True,
        stall_send_s: float = 0.0,
    ) -> None:
        import torch

        from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.worker_id = worker_id
        self.config = EngineConfig.from_kwargs(engine)
        self.transfer_timeout_s = transfer_timeout_s
        self._ctx_handles: dict[str, Any] = {}
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

        def transceiver_factory(pool) -> KVTransceiver:
            sender = receiver = None
            if self.role == "context":
                hook = None
                if stall_send_s > 0:  # fault injection for tests: stall each send
                    def hook(descriptor, chunk_index, _s=stall_send_s):
                        if chunk_index == 0:
                            time.sleep(_s)
                sender = KVSender(worker_id, pool, send_hook=hook,
                                  config=TransportConfig(default_timeout_s=lease_s))
            else:
                receiver = KVReceiver(worker_id, pool,
                                      config=TransportConfig(default_timeout_s=transfer_timeout_s))
            return KVTransceiver(worker_id, sender=sender, receiver=receiver, lease_s=lease_s,
                                 transfer_timeout_s=transfer_timeout_s)

        self.loaded, self.executor = build_executor(model_dir, self.config,
                                                    transceiver_factory=transceiver_factory)
        self.metrics = None
        if metrics:
            from pdserve.cluster.metrics import WorkerMetrics

            self.metrics = WorkerMetrics(self.role, worker_id)
        self.loop = WorkerLoop(self.executor, name=worker_id, deliver=self._deliver,
                               on_step=self._on_step).start()
        log.info("%s ready: %d KV blocks of %d tokens", worker_id, self.executor.kv.num_blocks,
                 self.config.tokens_per_block)

    # ------------------------------------------------------------------ actor methods

    def info(self) -> dict[str, Any]:
        cfg = self.loaded.config
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "pid": os.getpid(),
            "num_kv_blocks": self.executor.kv.num_blocks,
            "tokens_per_block": self.config.tokens_per_block,
            "max_batch_size": self.config.max_batch_size,
            "max_input_len": self.executor.max_input_len,
            "max_seq_len": self.executor.max_seq_len,
            "vocab_size": cfg.vocab_size,
            "endpoint": self.executor.transceiver.endpoint,
        }

    def generate(self, wire: dict[str, Any], timeout_s: float = 600.0) -> Iterator[dict[str, Any]]:
        """Streams the request's updates (a Ray streaming generator)."""
        request, params = request_from_wire(wire)
        stream = self.loop.submit(request, params)
        if self.config.enable_block_reuse:
            # Prefilled or received, the prompt's full blocks end up in this worker's cache.
            self._advertise(request.get_prompt_tokens())
        while not stream.finished:
            yield update_to_wire(stream.get(timeout_s))

    def abort(self, request_id: int) -> bool:
        return self.loop.abort(request_id)

    def status(self) -> dict[str, Any]:
        status = self.loop.status()
        status.update(worker_id=self.worker_id, role=self.role, healthy=self.loop.alive,
                      max_batch_size=self.config.max_batch_size,
                      tokens_per_block=self.config.tokens_per_block)
        return status

    def cached_block_hashes(self) -> list[int]:
        return list(self._hashes)

    def kv_transfer(self, payload: bytes) -> bytes | None:
        """Runs in the "transfer" concurrency group: returns when the bytes have landed."""
        return self.loop.handle_kv_control(payload)

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        self.loop.stop()

    # ------------------------------------------------------------------ internals

    def _deliver(self, ctx_worker_id: str, payload: bytes) -> bytes | None:
        import ray

        handle = self._ctx_handles.get(ctx_worker_id)
        if handle is None:
            handle = ray.get_actor(actor_name(ctx_worker_id), namespace=NAMESPACE)
            self._ctx_handles[ctx_worker_id] = handle
        try:
            return ray.get(handle.kv_transfer.remote(payload), timeout=self.transfer_timeout_s + 15.0)
        except Exception:
            self._ctx_handles.pop(ctx_worker_id, None)  # a restarted actor gets a fresh handle
            raise

    def _advertise(self, prompt: list[int]) -> None:
        from pdserve.cluster.policies import block_hashes

        for h in block_hashes(prompt, self.config.tokens_per_block):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > MAX_ADVERTISED_HASHES:
            self._hashes.popitem(last=False)

    def _on_step(self, updates) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.executor)

"""The simulated cluster's configuration: one worker's engine settings (``WorkerSpec``, which
also builds its real scheduler and KV cache manager), the message latencies (``Latency``) and
the layout and routing (``ClusterSpec``). See ``bench/simulator.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pdserve.bench.cost_model import LinkSpec
from pdserve.cluster.policies import ROUTING_MODES, KvAwareWeights, routing_mode
from pdserve.scheduler import (
    CapacityScheduler,
    CapacitySchedulerPolicy,
    ContextChunkingConfig,
    ContextChunkingPolicy,
    KVCacheManager,
    MicroBatchScheduler,
    SimpleScheduler,
)


# ---------------------------------------------------------------------------- configuration

# How the simulated router picks workers: the router's modes (``policies.ROUTING_MODES``, the
# same policy classes) plus "oracle": kv-aware on the workers' exact caches at decision time
# instead of the prefix index fed by their KV events (an upper bound for kv-aware).
ORACLE = "oracle"
SIM_ROUTING_MODES: tuple[str, ...] = (*ROUTING_MODES, ORACLE)
CACHE_ROUTING = ("kv-aware", ORACLE)  # the modes that route on the workers' caches


def sim_routing_mode(name: str) -> str:
    """A simulator routing mode, normalised ("round_robin" is "round-robin"); ValueError if
    unknown."""
    if name.replace("_", "-") == ORACLE:
        return ORACLE
    try:
        return routing_mode(name)
    except ValueError:
        raise ValueError(f"unknown routing mode {name!r}; expected one of "
                         f"{', '.join(SIM_ROUTING_MODES)}") from None


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker's engine settings (the names of pdserve's engine keyword arguments)."""

    max_batch_size: int = 64
    max_num_tokens: int = 2048
    tokens_per_block: int = 16
    num_kv_blocks: int = 256
    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"
    context_chunking_policy: str | None = "FIRST_COME_FIRST_SERVED"
    chunk_unit_size: int = 64
    enable_block_reuse: bool = True
    enable_prefix_aware_scheduling: bool = True
    max_input_len: int = 2047

    @classmethod
    def from_engine(cls, engine: Mapping[str, Any], *, max_seq_len: int, num_kv_blocks: int) -> WorkerSpec:
        """The spec of a worker built from engine kwargs, with the engine core's defaults
        (``max_seq_len``: the model's, unless the engine sets one)."""
        base = cls()
        chunking = engine.get("context_chunking_policy", None)
        if isinstance(chunking, str) and chunking.upper() in ("", "NONE", "OFF"):
            chunking = None
        if chunking is not None and not isinstance(chunking, str):
            chunking = chunking.name
        policy = engine.get("capacity_scheduler_policy", base.capacity_scheduler_policy)
        policy = policy if isinstance(policy, str) else policy.name
        max_num_tokens = engine.get("max_num_tokens", 2048)
        max_seq_len = engine.get("max_seq_len") or max_seq_len
        default_input = max_seq_len - 1 if chunking else min(max_seq_len - 1, max_num_tokens)
        return cls(
            max_batch_size=engine.get("max_batch_size", 64),
            max_num_tokens=max_num_tokens,
            tokens_per_block=engine.get("tokens_per_block", 16),
            num_kv_blocks=engine.get("num_kv_blocks") or num_kv_blocks,
            capacity_scheduler_policy=policy.upper(),
            context_chunking_policy=chunking.upper() if chunking else None,
            chunk_unit_size=engine.get("chunk_unit_size", 64),
            enable_block_reuse=engine.get("enable_block_reuse", True),
            enable_prefix_aware_scheduling=engine.get("enable_prefix_aware_scheduling", True),
            max_input_len=engine.get("max_input_len") or default_input,
        )

    def build(self) -> tuple[SimpleScheduler, KVCacheManager]:
        kv = KVCacheManager(self.num_kv_blocks, self.tokens_per_block,
                            enable_block_reuse=self.enable_block_reuse)
        capacity = CapacityScheduler(
            self.max_batch_size, CapacitySchedulerPolicy[self.capacity_scheduler_policy],
            enable_prefix_aware_scheduling=self.enable_prefix_aware_scheduling)
        chunking = (ContextChunkingConfig(ContextChunkingPolicy[self.context_chunking_policy],
                                          self.chunk_unit_size)
                    if self.context_chunking_policy else None)
        micro = MicroBatchScheduler(chunking, self.max_num_tokens)
        scheduler = SimpleScheduler(capacity, micro, kv_cache_manager=kv,
                                    max_batch_size=self.max_batch_size,
                                    max_num_tokens=self.max_num_tokens)
        return scheduler, kv


@dataclass(frozen=True, slots=True)
class Latency:
    hop_s: float = 0.0  # one message between the client (through the router) and a worker
    kv_control_s: float = 0.0  # a transfer's control round trip (KV request out, completion back)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    num_context_workers: int = 1
    num_generation_workers: int = 1
    context: WorkerSpec = WorkerSpec()
    generation: WorkerSpec = WorkerSpec()
    routing: str = "round-robin"  # SIM_ROUTING_MODES
    kv_overlap_weight: float = KvAwareWeights().overlap  # kv-aware / oracle: policies.KvAwareWeights
    kv_decode_weight: float = KvAwareWeights().decode
    max_inflight: int | None = None  # default: the generation workers' batch sizes summed
    link: LinkSpec = LinkSpec()
    latency: Latency = Latency()
    # The router's kv_transfer_mode: "after_prefill" or "layerwise" (the generation side is
    # started when the last prefill chunk starts, and the KV follows the forward layer by layer).
    kv_transfer_mode: str = "after_prefill"

    def __post_init__(self) -> None:
        if self.num_generation_workers < 1 or self.num_context_workers < 0:
            raise ValueError("a cluster needs >= 1 generation worker and >= 0 context workers")
        if self.kv_transfer_mode not in ("after_prefill", "layerwise"):
            raise ValueError(f"kv_transfer_mode: after_prefill or layerwise, got {self.kv_transfer_mode!r}")
        object.__setattr__(self, "routing", sim_routing_mode(self.routing))
        for name in ("kv_overlap_weight", "kv_decode_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.routing in CACHE_ROUTING:
            sides = [self.generation] + ([self.context] if self.num_context_workers else [])
            if not all(w.enable_block_reuse for w in sides):
                raise ValueError(f"routing {self.routing} needs enable_block_reuse on every worker")
            if len({w.tokens_per_block for w in sides}) != 1:
                raise ValueError(f"routing {self.routing}: context and generation workers must "
                                 "share tokens_per_block (the block keys the index matches)")

    @property
    def label(self) -> str:
        if self.num_context_workers == 0:
            return f"colocated x{self.num_generation_workers}"
        return f"{self.num_context_workers}P{self.num_generation_workers}D"

    @property
    def num_workers(self) -> int:
        return self.num_context_workers + self.num_generation_workers

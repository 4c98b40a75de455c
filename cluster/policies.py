"""Router decisions: worker selection, conditional disaggregation, retries (request validation:
``validation.py``).

TensorRT-LLM disaggregated-server semantics (scheduling.md 7.5) where the
reference is exact. PURE: stdlib only (no torch, ray, grpc, numpy), so every routing decision is
unit-tested in milliseconds; cluster/router/ feeds in load snapshots and carries the choices out.

Determinism: every policy breaks ties by ``worker_id`` (string order), never by dict or set order,
so the same snapshots always give the same choice. Only RoundRobinPolicy keeps state (its position).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Collection, Iterable, Mapping, NamedTuple, Protocol, Sequence

from pdserve.scheduler.radix_tree import prompt_block_keys

DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM kv_cache_aware router default
DEFAULT_MAX_BATCH_SIZE = 64  # a WorkerLoad default until the first heartbeat (TensorRT-LLM router default)
# --routing: how the router picks workers (and the simulator, with the same classes).
ROUTING_MODES: tuple[str, ...] = ("round-robin", "least-loaded", "kv-aware")


class WorkerRole(enum.IntEnum):
    """Values match the proto's WorkerRole (0 is the proto's UNSPECIFIED)."""

    CONTEXT = 1
    GENERATION = 2


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker as the router last saw it. The router keeps these current (e.g. with
    ``with_dispatched`` on dispatch and a fresh snapshot on each status poll)."""

    worker_id: str
    role: WorkerRole
    active_requests: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens admitted but not yet prefilled
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    healthy: bool = True

    def with_dispatched(self, prompt_tokens: int) -> WorkerLoad:
        """The optimistic view right after sending one more request to this worker."""
        return replace(self, active_requests=self.active_requests + 1,
                       queued_prompt_tokens=self.queued_prompt_tokens + prompt_tokens)


# ---- the prompt and what each worker caches of it ----------------------------------------------

@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What the policies need to know about a prompt: its length, its block keys (hashed once per
    request, ``radix_tree.prompt_block_keys``: the keys the workers' caches use) and, from the
    router's prefix index, how many leading blocks each worker caches."""

    prompt_len: int
    tokens_per_block: int
    block_keys: tuple[bytes, ...] = ()
    matched_blocks: Mapping[str, int] = field(default_factory=dict)  # worker id -> leading blocks

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int], tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
                    ) -> PromptInfo:
        return cls(len(token_ids), tokens_per_block,
                   tuple(prompt_block_keys(token_ids, tokens_per_block)))

    def with_matches(self, matched_blocks: Mapping[str, int]) -> PromptInfo:
        return replace(self, matched_blocks=matched_blocks)


def matched_tokens(worker: WorkerLoad, prompt: PromptInfo) -> int:
    """Leading prompt tokens the worker caches (whole blocks), as the prefix index says."""
    return prompt.matched_blocks.get(worker.worker_id, 0) * prompt.tokens_per_block


def blocks_needed_for_prompt(prompt_len: int, tokens_per_block: int) -> int:
    """Blocks for the prompt plus the first generated token, which the generation side appends
    when the transfer completes (so a prompt filling its last block exactly needs one more)."""
    return (prompt_len + tokens_per_block) // tokens_per_block


# ---- worker selection ---------------------------------------------------------------------------

class Selection(NamedTuple):
    worker_id: str
    matched_tokens: int  # leading prompt tokens the worker already caches
    score: float  # policy-specific; higher is better


class WorkerPolicy(Protocol):
    name: str
    role: WorkerRole

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        """Eligible workers (healthy, this role, not excluded), best first. No side effects."""
        ...

    def select(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
               exclude: Collection[str] = ()) -> Selection | None:
        """The best eligible worker (None when there is none); commits any policy state."""
        ...


def _eligible(workers: Iterable[WorkerLoad], role: WorkerRole, exclude: Collection[str]
              ) -> list[WorkerLoad]:
    return [w for w in workers if w.healthy and w.role == role and w.worker_id not in exclude]


class _StatelessPolicy:
    name = ""
    role = WorkerRole.CONTEXT

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        raise NotImplementedError

    def select(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
               exclude: Collection[str] = ()) -> Selection | None:
        ranked = self.rank(workers, prompt, exclude)
        return ranked[0] if ranked else None


class RoundRobinPolicy:
    """Cyclic position over the worker list as given (TensorRT-LLM round_robin). Unhealthy or
    excluded workers are skipped without losing the cycle; removing a worker resets it to 0."""

    name = "round-robin"

    def __init__(self, role: WorkerRole = WorkerRole.CONTEXT) -> None:
        self.role = role
        self._position = 0
        self._known: frozenset[str] = frozenset()

    def _sync(self, workers: Sequence[WorkerLoad]) -> None:
        ids = frozenset(w.worker_id for w in workers)
        if not self._known <= ids:  # a worker went away: indices shifted, start over
            self._position = 0
        self._known = ids

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        n = len(workers)
        start = self._position % n if n else 0
        eligible = {w.worker_id for w in _eligible(workers, self.role, exclude)}
        rotated = [workers[(start + i) % n] for i in range(n)]
        return [Selection(w.worker_id, matched_tokens(w, prompt), 0.0)
                for w in rotated if w.worker_id in eligible]

    def select(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
               exclude: Collection[str] = ()) -> Selection | None:
        self._sync(workers)
        ranked = self.rank(workers, prompt, exclude)
        if not ranked:
            return None
        index = next(i for i, w in enumerate(workers) if w.worker_id == ranked[0].worker_id)
        self._position = (index + 1) % len(workers)
        return ranked[0]


class LeastLoadedPolicy(_StatelessPolicy):
    """Context side: fewest queued prompt tokens (TensorRT-LLM load_balancing with use_tokens),
    then fewest active requests, then worker_id."""

    name = "least-loaded"

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        ordered = sorted(_eligible(workers, self.role, exclude),
                         key=lambda w: (w.queued_prompt_tokens, w.active_requests, w.worker_id))
        return [Selection(w.worker_id, matched_tokens(w, prompt), -float(w.queued_prompt_tokens))
                for w in ordered]


@dataclass(frozen=True, slots=True)
class KvAwareWeights:
    """The kv-aware cost of sending a prompt to a worker, in KV blocks of work (lower wins):

        overlap x (prompt blocks the worker does not cache: to prefill, or to receive)
        + queued prefill blocks on the worker + decode x KV blocks in use on it

    ``overlap`` prices the cache hit against the load; ``decode`` prices running requests (on a
    context worker, blocks leased to transfers). Defaults chosen by a sweep on the simulated
    Mooncake conversation trace at 4P4D (docs/benchmarks.md, section 11): overlap 4 beat 0.5-2
    on TTFT p90 at every decode weight, and decode 0.25 was best or within a few ms of it."""

    overlap: float = 4.0
    decode: float = 0.25


class KvAwarePolicy(_StatelessPolicy):
    """Routes on the workers' real caches (the router's prefix index, fed by KV events) against
    their load: the lowest ``KvAwareWeights`` cost wins. A generation worker that lacks free
    blocks for the part of the prompt it does not cache ranks last, as with least-loaded. Ties:
    more matched blocks, then worker_id."""

    name = "kv-aware"

    def __init__(self, role: WorkerRole = WorkerRole.CONTEXT,
                 weights: KvAwareWeights = KvAwareWeights()) -> None:
        self.role = role
        self.weights = weights

    def cost(self, worker: WorkerLoad, prompt: PromptInfo) -> float:
        tpb = prompt.tokens_per_block
        matched = prompt.matched_blocks.get(worker.worker_id, 0)
        new_blocks = blocks_needed_for_prompt(prompt.prompt_len, tpb) - matched
        queued = -(-worker.queued_prompt_tokens // tpb)
        used = worker.total_kv_blocks - worker.free_kv_blocks
        return self.weights.overlap * new_blocks + queued + self.weights.decode * used

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        tpb = prompt.tokens_per_block
        needed = blocks_needed_for_prompt(prompt.prompt_len, tpb)
        scored = []
        for w in _eligible(workers, self.role, exclude):
            matched = prompt.matched_blocks.get(w.worker_id, 0)
            short = self.role == WorkerRole.GENERATION and w.free_kv_blocks < needed - matched
            cost = self.cost(w, prompt)
            scored.append((short, cost, -matched, w.worker_id, matched * tpb))
        scored.sort()
        return [Selection(wid, matched, -cost) for _, cost, _, wid, matched in scored]


class GenerationLoadPolicy(_StatelessPolicy):
    """Generation side: workers without free blocks for the prompt rank last; then fewest active
    requests, most free KV blocks, worker_id. Reports the chosen worker's matched prefix so the
    conditional-disaggregation check can use it."""

    name = "least-loaded"
    role = WorkerRole.GENERATION

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        needed = blocks_needed_for_prompt(prompt.prompt_len, prompt.tokens_per_block)
        ordered = sorted(
            _eligible(workers, self.role, exclude),
            key=lambda w: (w.free_kv_blocks < needed, w.active_requests, -w.free_kv_blocks,
                           w.worker_id),
        )
        return [Selection(w.worker_id, matched_tokens(w, prompt), float(w.free_kv_blocks - needed))
                for w in ordered]


def routing_mode(name: str) -> str:
    """A --routing value, normalised ("round_robin" is "round-robin"); ValueError if unknown."""
    mode = name.replace("_", "-")
    if mode not in ROUTING_MODES:
        raise ValueError(f"unknown routing mode {name!r}; expected one of {', '.join(ROUTING_MODES)}")
    return mode


def make_policy(name: str, role: WorkerRole = WorkerRole.CONTEXT,
                weights: KvAwareWeights = KvAwareWeights()) -> WorkerPolicy:
    """The policy of a routing mode for one role. round-robin and least-loaded pick generation
    workers by load (GenerationLoadPolicy: free KV blocks and active requests); kv-aware uses
    the workers' caches for both roles."""
    mode = routing_mode(name)
    if mode == "kv-aware":
        return KvAwarePolicy(role, weights)
    if role == WorkerRole.GENERATION:
        return GenerationLoadPolicy()
    return RoundRobinPolicy(role) if mode == "round-robin" else LeastLoadedPolicy()


# ---- conditional disaggregation -----------------------------------------------------------------

class DisaggregationMode(enum.IntEnum):
    """Values match the proto's Disaggregation enum."""

    AUTO = 0  # conditional: remote prefill unless the uncached part is short
    ALWAYS = 1  # always prefill on a context worker
    NEVER = 2  # always prefill locally on the generation worker


class PrefillRoute(enum.IntEnum):
    REMOTE = 0  # context_only on a context worker, then generation_only on a generation worker
    LOCAL = 1  # context_and_generation on the generation worker


class PrefillDecision(NamedTuple):
    route: PrefillRoute
    reason: str


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can take the request in the requested mode."""


def needs_remote_prefill(prompt_len: int, matched_tokens: int,
                         max_local_prefill_length: int | None) -> bool:
    """TensorRT-LLM conditional disaggregation: a context worker is needed iff nothing is cached
    (matched == 0) or the uncached part is longer than max_local_prefill_length. None means the
    feature is off (always remote); 0 is equivalent, since matched covers at most all but the last
    prompt token, so the uncached part is always >= 1."""
    if max_local_prefill_length is None:
        return True
    if max_local_prefill_length < 0:
        raise ValueError(f"max_local_prefill_length must be >= 0, got {max_local_prefill_length}")
    return matched_tokens == 0 or prompt_len - matched_tokens > max_local_prefill_length


def decide_prefill(mode: DisaggregationMode, prompt_len: int, matched_tokens: int,
                   max_local_prefill_length: int | None, *, context_available: bool = True
                   ) -> PrefillDecision:
    """Combine the request's mode with the conditional check. AUTO without a healthy context
    worker prefills locally; ALWAYS without one raises NoWorkerAvailable."""
    mode = DisaggregationMode(mode)
    if mode == DisaggregationMode.NEVER:
        return PrefillDecision(PrefillRoute.LOCAL, "disaggregation=NEVER")
    if mode == DisaggregationMode.ALWAYS:
        if not context_available:
            raise NoWorkerAvailable("disaggregation=ALWAYS but no healthy context worker")
        return PrefillDecision(PrefillRoute.REMOTE, "disaggregation=ALWAYS")
    if not context_available:
        return PrefillDecision(PrefillRoute.LOCAL, "no healthy context worker")
    if needs_remote_prefill(prompt_len, matched_tokens, max_local_prefill_length):
        return PrefillDecision(PrefillRoute.REMOTE, "uncached part above the local prefill limit")
    return PrefillDecision(PrefillRoute.LOCAL, "uncached part within the local prefill limit")


# ---- retries ------------------------------------------------------------------------------------

class RetryAction(enum.IntEnum):
    PAIR = 0  # prefill on ctx_worker, decode on gen_worker
    LOCAL_PREFILL = 1  # whole request on gen_worker
    GIVE_UP = 2


class RetryPlan(NamedTuple):
    action: RetryAction
    ctx_worker: str | None
    gen_worker: str | None
    reason: str
    # GIVE_UP only: no worker can take the request now, but one that is down may come back (Ray
    # restarts it), so the router may wait for one (RouterConfig.worker_wait_s) and plan again.
    # False when waiting cannot help: retries used up, every way after failed transfers tried.
    worker_may_return: bool = False


def plan_retry(
    failed: Collection[tuple[str | None, str]],
    workers: Sequence[WorkerLoad],
    prompt: PromptInfo,
    *,
    retries_used: int,
    max_retries: int,
    context_policy: WorkerPolicy,
    generation_policy: WorkerPolicy,
    mode: DisaggregationMode = DisaggregationMode.AUTO,
    unready: Collection[tuple[str, str]] = (),
) -> RetryPlan:
    """The next attempt after failures (docs/design.md section 3, "Retries"). ``failed`` holds the
    (ctx, gen) pairs that failed; ctx None marks a failed local prefill on gen. Order: an untried
    pair, preferring workers not seen in any failure, then by the policies' ranks; then (unless
    mode is ALWAYS) local prefill on an untried generation worker; then an untried pair in
    ``unready`` (its KV pair group is being set up: the transfer waits for it); else give up.
    An unready pair is no failure of its workers. Uses ``rank`` only, so policy state
    (round-robin position) is not advanced. A GIVE_UP while some worker is unhealthy says
    ``worker_may_return``."""
    if retries_used >= max_retries:
        return RetryPlan(RetryAction.GIVE_UP, None, None, f"max_retries={max_retries} reached")
    failed_set = set(failed)
    failed_ctx = {c for c, _ in failed_set if c is not None}
    failed_gen = {g for _, g in failed_set}
    gens = [s.worker_id for s in generation_policy.rank(workers, prompt)]
    pairs = []
    if mode != DisaggregationMode.NEVER:
        ctxs = [s.worker_id for s in context_policy.rank(workers, prompt)]
        pairs = [
            ((c, g) in unready, (c in failed_ctx) + (g in failed_gen), gi, ci, c, g)
            for gi, g in enumerate(gens) for ci, c in enumerate(ctxs) if (c, g) not in failed_set
        ]
        if pairs and not min(pairs)[0]:
            *_, c, g = min(pairs)
            return RetryPlan(RetryAction.PAIR, c, g, "untried context/generation pair")
    if mode != DisaggregationMode.ALWAYS:
        local = [g for g in gens if (None, g) not in failed_set]
        if local:
            best = min(local, key=lambda g: (g in failed_gen, gens.index(g)))
            return RetryPlan(RetryAction.LOCAL_PREFILL, None, best, "local prefill fallback")
    if pairs:
        *_, c, g = min(pairs)
        return RetryPlan(RetryAction.PAIR, c, g, "untried pair whose KV group is being set up")
    # Waiting helps only while some worker is down: one Ray restarts comes back as a new
    # process, whose failures the caller no longer counts (a failure is of one incarnation).
    return RetryPlan(RetryAction.GIVE_UP, None, None, "no untried healthy worker",
                     worker_may_return=any(not w.healthy for w in workers))


def plan_transfer_fallback(
    failed: Collection[tuple[str | None, str]],
    gen_worker: str,
    workers: Sequence[WorkerLoad],
    prompt: PromptInfo,
    *,
    context_policy: WorkerPolicy,
    mode: DisaggregationMode = DisaggregationMode.AUTO,
    unready: Collection[tuple[str, str]] = (),
) -> RetryPlan:
    """The next attempt after a KV transfer to ``gen_worker`` failed while both workers lived
    (``failed``: the pairs whose transfer failed so far). A failed transfer is not a dead worker,
    so this never uses up ``max_retries``: prefill on the generation worker itself (no transfer
    left to fail), unless disaggregation is required; then another context worker for the same
    generation worker; else give up. Uses ``rank`` only (no policy state advanced)."""
    gen = next((w for w in workers if w.worker_id == gen_worker), None)
    if gen is None or not gen.healthy:
        return RetryPlan(RetryAction.GIVE_UP, None, None, f"{gen_worker} is not healthy",
                         worker_may_return=True)
    if mode != DisaggregationMode.ALWAYS and (None, gen_worker) not in failed:
        return RetryPlan(RetryAction.LOCAL_PREFILL, None, gen_worker,
                         "local prefill after a failed KV transfer")
    if mode != DisaggregationMode.NEVER:
        tried = {c for c, g in failed if g == gen_worker and c is not None}
        ranked = [s.worker_id for s in context_policy.rank(workers, prompt, exclude=tried)]
        # a pair whose group is set up first; one being set up only if there is no other
        for c in sorted(ranked, key=lambda c: (c, gen_worker) in unready):
            return RetryPlan(RetryAction.PAIR, c, gen_worker,
                             "another context worker after a failed KV transfer")
    return RetryPlan(RetryAction.GIVE_UP, None, None,
                     f"no other way to {gen_worker} after a failed KV transfer")

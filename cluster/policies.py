"""Router decisions: worker selection, conditional disaggregation, retries, request validation.

TensorRT-LLM disaggregated-server semantics (reference trtllm-scheduling.md section 7.5) where the
reference is exact. PURE: stdlib only (no torch, ray, grpc, numpy), so every routing decision is
unit-tested in milliseconds; cluster/router.py feeds in load snapshots and carries the choices out.

Determinism: every policy breaks ties by ``worker_id`` (string order), never by dict or set order,
so the same snapshots always give the same choice. Only RoundRobinPolicy keeps state (its position).
"""
from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field, replace
from typing import Collection, Iterable, NamedTuple, Protocol, Sequence

from pdserve.scheduler.block_hash import block_hashes, chain_block_hash  # noqa: F401 (re-exported)
from pdserve.scheduler.reorder import ACCEPTED_AGENT_TYPE_NAMES

DEFAULT_TOKENS_PER_BLOCK = 32  # TensorRT-LLM kv_cache_aware router default
DEFAULT_MAX_BATCH_SIZE = 64  # TensorRT-LLM kv_cache_aware router default (load penalty divisor)
DEFAULT_PRIORITY = 0.5
DEFAULT_MAX_TOKENS = 16  # same default as pdserve.SamplingParams
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
CONTEXT_POLICY_NAMES: tuple[str, ...] = ("round_robin", "least_loaded", "kv_cache_aware")


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
    # block_hashes() values of the blocks in the worker's prefix cache (kv_cache_aware routing).
    cached_block_hashes: frozenset[int] = field(default_factory=frozenset)

    def with_dispatched(self, prompt_tokens: int) -> WorkerLoad:
        """The optimistic view right after sending one more request to this worker."""
        return replace(self, active_requests=self.active_requests + 1,
                       queued_prompt_tokens=self.queued_prompt_tokens + prompt_tokens)


# ---- block hashing: scheduler/block_hash.py (the workers hash what they advertise with it too)

@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What the policies need to know about a prompt; hashed once per request."""

    prompt_len: int
    tokens_per_block: int
    block_hashes: tuple[int, ...] = ()

    @classmethod
    def from_tokens(cls, token_ids: Sequence[int], tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
                    ) -> PromptInfo:
        return cls(len(token_ids), tokens_per_block, block_hashes(token_ids, tokens_per_block))


def matched_tokens(worker: WorkerLoad, prompt: PromptInfo) -> int:
    """tokens_per_block x the leading run of prompt block hashes the worker caches."""
    run = 0
    for h in prompt.block_hashes:
        if h not in worker.cached_block_hashes:
            break
        run += 1
    return run * prompt.tokens_per_block


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

    name = "round_robin"

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

    name = "least_loaded"

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        ordered = sorted(_eligible(workers, self.role, exclude),
                         key=lambda w: (w.queued_prompt_tokens, w.active_requests, w.worker_id))
        return [Selection(w.worker_id, matched_tokens(w, prompt), -float(w.queued_prompt_tokens))
                for w in ordered]


class KvCacheAwarePolicy(_StatelessPolicy):
    """score = matched / (blocks x tokens_per_block) - active / max_batch_size; argmax wins
    (TensorRT-LLM kv_cache_aware). A prompt without a full block scores 0 for the first term.
    Ties: fewer active requests, then worker_id."""

    name = "kv_cache_aware"

    def __init__(self, role: WorkerRole = WorkerRole.CONTEXT) -> None:
        self.role = role

    def rank(self, workers: Sequence[WorkerLoad], prompt: PromptInfo,
             exclude: Collection[str] = ()) -> list[Selection]:
        denominator = len(prompt.block_hashes) * prompt.tokens_per_block
        scored = []
        for w in _eligible(workers, self.role, exclude):
            matched = matched_tokens(w, prompt)
            score = (matched / denominator if denominator else 0.0) - (
                w.active_requests / max(1, w.max_batch_size))
            scored.append((-score, w.active_requests, w.worker_id, matched, score))
        scored.sort()
        return [Selection(wid, matched, score) for _, _, wid, matched, score in scored]


class GenerationLoadPolicy(_StatelessPolicy):
    """Generation side: workers without free blocks for the prompt rank last; then fewest active
    requests, most free KV blocks, worker_id. Reports the chosen worker's matched prefix so the
    conditional-disaggregation check can use it."""

    name = "least_loaded"
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


def make_policy(name: str, role: WorkerRole = WorkerRole.CONTEXT) -> WorkerPolicy:
    """A policy by name: "round_robin" | "least_loaded" | "kv_cache_aware". For the generation
    role, least_loaded is GenerationLoadPolicy (active requests and free KV blocks)."""
    if name == "round_robin":
        return RoundRobinPolicy(role)
    if name == "least_loaded":
        return GenerationLoadPolicy() if role == WorkerRole.GENERATION else LeastLoadedPolicy()
    if name == "kv_cache_aware":
        return KvCacheAwarePolicy(role)
    raise ValueError(
        f"unknown router policy {name!r}; expected one of {', '.join(CONTEXT_POLICY_NAMES)}")


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
) -> RetryPlan:
    """The next attempt after failures (DESIGN.md lifecycle step 6). ``failed`` holds the
    (ctx, gen) pairs that failed; ctx None marks a failed local prefill on gen. Order: an untried
    pair, preferring workers not seen in any failure, then by the policies' ranks; then (unless
    mode is ALWAYS) local prefill on an untried generation worker; else give up. Uses ``rank``
    only, so policy state (round-robin position) is not advanced."""
    if retries_used >= max_retries:
        return RetryPlan(RetryAction.GIVE_UP, None, None, f"max_retries={max_retries} reached")
    failed_set = set(failed)
    failed_ctx = {c for c, _ in failed_set if c is not None}
    failed_gen = {g for _, g in failed_set}
    gens = [s.worker_id for s in generation_policy.rank(workers, prompt)]
    if mode != DisaggregationMode.NEVER:
        ctxs = [s.worker_id for s in context_policy.rank(workers, prompt)]
        pairs = [
            ((c in failed_ctx) + (g in failed_gen), gi, ci, c, g)
            for gi, g in enumerate(gens) for ci, c in enumerate(ctxs) if (c, g) not in failed_set
        ]
        if pairs:
            *_, c, g = min(pairs)
            return RetryPlan(RetryAction.PAIR, c, g, "untried context/generation pair")
    if mode != DisaggregationMode.ALWAYS:
        local = [g for g in gens if (None, g) not in failed_set]
        if local:
            best = min(local, key=lambda g: (g in failed_gen, gens.index(g)))
            return RetryPlan(RetryAction.LOCAL_PREFILL, None, best, "local prefill fallback")
    return RetryPlan(RetryAction.GIVE_UP, None, None, "no untried healthy worker")


# ---- request validation -------------------------------------------------------------------------

class ValidationError(ValueError):
    """A malformed request; ``field`` is the dotted path of the offending field (the router maps
    this to gRPC INVALID_ARGUMENT with str(error) as the details)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    vocab_size: int | None = None  # None skips the vocabulary checks
    max_input_len: int | None = None  # prompt tokens
    max_seq_len: int | None = None  # prompt + max_tokens
    max_tokens_limit: int = 1 << 16
    max_stop_token_ids: int = 32
    max_stop_strings: int = 4  # OpenAI's limit
    max_stop_string_chars: int = 256
    max_agent_depth: int = 8
    max_request_id_len: int = 128
    max_text_chars: int = 1 << 22  # before tokenization; the token limit is checked after it
    max_deadline_ms: int = 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A Generate request as plain values with the API defaults applied (rpc.spec_from_proto
    builds one from the proto message)."""

    request_id: str | None = None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one (OpenAI's rule)
    priority: float = DEFAULT_PRIORITY
    agent_hierarchy: tuple[tuple[str, int], ...] = ()
    disaggregation: int = DisaggregationMode.AUTO
    deadline_ms: int | None = None


_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_SEED_LIMIT = 1 << 63  # same range as pdserve.SamplingParams


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_request_id(request_id: str | None, limits: ValidationLimits = ValidationLimits()
                        ) -> None:
    """None means unset (the router assigns one); a set id is 1..max_request_id_len characters of
    [A-Za-z0-9._:-], starting with a letter or digit."""
    if request_id is None:
        return
    if not isinstance(request_id, str) or not request_id:
        raise ValidationError("request_id", "must be a non-empty string when set")
    if len(request_id) > limits.max_request_id_len:
        raise ValidationError("request_id", f"longer than {limits.max_request_id_len} characters")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise ValidationError("request_id", "may only hold [A-Za-z0-9._:-] and must start with a "
                              "letter or digit")


def validate_token_ids(token_ids: Sequence[int], limits: ValidationLimits,
                       field: str = "prompt.token_ids") -> None:
    """Non-empty, ids in [0, vocab_size), at most max_input_len. The router calls this again on
    the tokens of a text prompt."""
    if len(token_ids) == 0:
        raise ValidationError(field, "must not be empty")
    if limits.max_input_len is not None and len(token_ids) > limits.max_input_len:
        raise ValidationError(field, f"{len(token_ids)} tokens exceed max_input_len="
                              f"{limits.max_input_len}")
    upper = limits.vocab_size
    for i, t in enumerate(token_ids):
        if not _is_int(t) or t < 0 or (upper is not None and t >= upper):
            raise ValidationError(f"{field}[{i}]", f"token id {t!r} is outside [0, {upper})")


def validate_prompt(text: str | None, token_ids: Sequence[int] | None,
                    limits: ValidationLimits = ValidationLimits()) -> None:
    """Exactly one of text and token_ids."""
    if (text is None) == (token_ids is None):
        raise ValidationError("prompt", "give exactly one of text and token_ids")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise ValidationError("prompt.text", "must be a non-empty string")
        if len(text) > limits.max_text_chars:
            raise ValidationError("prompt.text", f"longer than {limits.max_text_chars} characters")
    else:
        validate_token_ids(token_ids, limits)  # type: ignore[arg-type]


def validate_sampling(
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    top_k: int = 0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    limits: ValidationLimits = ValidationLimits(),
    prompt_len: int | None = None,
) -> None:
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValidationError("sampling.max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    if max_tokens > limits.max_tokens_limit:
        raise ValidationError("sampling.max_tokens", f"{max_tokens} exceeds the limit "
                              f"{limits.max_tokens_limit}")
    if (prompt_len is not None and limits.max_seq_len is not None
            and prompt_len + max_tokens > limits.max_seq_len):
        raise ValidationError("sampling.max_tokens", f"prompt ({prompt_len}) + max_tokens "
                              f"({max_tokens}) exceeds max_seq_len={limits.max_seq_len}")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValidationError("sampling.temperature", f"must be finite and >= 0, got {temperature!r}")
    if not _is_real(top_p) or not 0.0 < top_p <= 1.0:  # NaN fails the comparison
        raise ValidationError("sampling.top_p", f"must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValidationError("sampling.top_k", f"must be an integer >= 0 (0 disables), got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < _SEED_LIMIT):
        raise ValidationError("sampling.seed", f"must be in [0, 2**63), got {seed!r}")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise ValidationError("sampling.stop_token_ids", f"more than {limits.max_stop_token_ids} ids")
    upper = limits.vocab_size
    for i, t in enumerate(stop_token_ids):
        if not _is_int(t) or t < 0 or (upper is not None and t >= upper):
            raise ValidationError(f"sampling.stop_token_ids[{i}]", f"token id {t!r} is outside "
                                  f"[0, {upper})")


def validate_stop_strings(stop: Sequence[str], limits: ValidationLimits = ValidationLimits()) -> None:
    if len(stop) > limits.max_stop_strings:
        raise ValidationError("sampling.stop", f"{len(stop)} stop strings; at most {limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValidationError(f"sampling.stop[{i}]", "must be a non-empty string")
        if len(s) > limits.max_stop_string_chars:
            raise ValidationError(f"sampling.stop[{i}]", f"longer than {limits.max_stop_string_chars} characters")


def validate_priority(priority: float) -> None:
    if not _is_real(priority) or not 0.0 <= priority <= 1.0:  # NaN and inf fail the comparison
        raise ValidationError("priority", f"must be a finite number in [0, 1], got {priority!r}")


def validate_agent_hierarchy(levels: Sequence[tuple[str, int]],
                             limits: ValidationLimits = ValidationLimits()) -> None:
    """Each level names a known agent type (UpperCamelCase or snake_case) and a node id >= 0."""
    if len(levels) > limits.max_agent_depth:
        raise ValidationError("agent_hierarchy", f"{len(levels)} levels exceed the depth limit "
                              f"{limits.max_agent_depth}")
    for i, level in enumerate(levels):
        if not isinstance(level, (tuple, list)) or len(level) != 2:
            raise ValidationError(f"agent_hierarchy[{i}]", "must be an (agent_type, node_id) pair")
        agent_type, node_id = level
        if not isinstance(agent_type, str) or not agent_type:
            raise ValidationError(f"agent_hierarchy[{i}].agent_type", "must be a non-empty string")
        if agent_type not in ACCEPTED_AGENT_TYPE_NAMES:
            raise ValidationError(f"agent_hierarchy[{i}].agent_type", f"unknown agent type "
                                  f"{agent_type!r}")
        if not _is_int(node_id) or not 0 <= node_id < _SEED_LIMIT:
            raise ValidationError(f"agent_hierarchy[{i}].node_id", f"must be an integer in "
                                  f"[0, 2**63), got {node_id!r}")


def validate_disaggregation(mode: int) -> DisaggregationMode:
    if not _is_int(mode) or mode not in {m.value for m in DisaggregationMode}:
        raise ValidationError("disaggregation", f"must be AUTO (0), ALWAYS (1) or NEVER (2), "
                              f"got {mode!r}")
    return DisaggregationMode(mode)


def validate_deadline_ms(deadline_ms: int | None, limits: ValidationLimits = ValidationLimits()
                         ) -> None:
    """None means no deadline beyond the gRPC call's own."""
    if deadline_ms is None:
        return
    if not _is_int(deadline_ms) or not 0 < deadline_ms <= limits.max_deadline_ms:
        raise ValidationError("deadline_ms", f"must be an integer in [1, {limits.max_deadline_ms}], "
                              f"got {deadline_ms!r}")


def validate_generate_spec(spec: GenerateSpec, limits: ValidationLimits = ValidationLimits()
                           ) -> None:
    """Every rule above, in field order; raises the first ValidationError."""
    validate_request_id(spec.request_id, limits)
    validate_prompt(spec.text, spec.token_ids, limits)
    validate_sampling(max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
                      top_k=spec.top_k, seed=spec.seed, stop_token_ids=spec.stop_token_ids,
                      limits=limits,
                      prompt_len=len(spec.token_ids) if spec.token_ids is not None else None)
    validate_stop_strings(spec.stop, limits)
    validate_priority(spec.priority)
    validate_agent_hierarchy(spec.agent_hierarchy, limits)
    validate_disaggregation(spec.disaggregation)
    validate_deadline_ms(spec.deadline_ms, limits)

"""Micro-batch scheduler: picks this step's forward batch from the capacity-fitting requests.

TensorRT-LLM microBatchScheduler.cpp / PyMicroBatchScheduler semantics with the reuse-adjusted
compute cost model (scheduling.md section 3). Pure Python, stdlib only.

Budgets are in *compute* tokens: a cached prefix is free only on the chunk that reaches the end of
the prompt, because the executor shifts a chunk past the cached prefix instead of shrinking it
(``LlmRequest.set_prepopulated_prompt_len``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Sequence

from .request import LlmRequest, LlmRequestState

S = LlmRequestState
# Plain ints for the hot loop. The newest numbering makes context-init (10, 11) and
# generation-in-progress (12, 13, 14) contiguous ranges.
_ENCODER_INIT = int(S.ENCODER_INIT)
_CTX_FIRST = int(S.CONTEXT_INIT)
_CTX_LAST = int(S.DISAGG_CONTEXT_INIT_AND_TRANS)
_GEN_FIRST = int(S.DISAGG_GENERATION_TRANS_COMPLETE)
_GEN_LAST = int(S.GENERATION_TO_COMPLETE)
assert _CTX_LAST == _CTX_FIRST + 1 and _GEN_FIRST == _CTX_LAST + 1 and _GEN_LAST == _GEN_FIRST + 2

# What a state means to the first pass, per band: one dict lookup per request instead of a chain
# of comparisons (which are slow on IntEnum members).
_PASS = 0  # outside the band, or a state no micro-batch takes
_ENCODER = 1
_CONTEXT = 2
_GENERATION = 3


_NO_LIMIT = 1 << 62  # a token budget no batch reaches (max_num_tokens None)


class _Kinds(dict):
    """State -> kind; anything that is not a state member passes, as the comparisons would."""

    def __missing__(self, state: object) -> int:
        return _PASS


def _state_kinds(until: int, after: int) -> _Kinds:
    kinds = _Kinds()
    for state in S:
        if not until <= state < after:
            kinds[state] = _PASS
        elif state == _ENCODER_INIT:
            kinds[state] = _ENCODER
        elif _CTX_FIRST <= state <= _CTX_LAST:
            kinds[state] = _CONTEXT
        elif _GEN_FIRST <= state <= _GEN_LAST:
            kinds[state] = _GENERATION
        else:
            kinds[state] = _PASS
    return kinds


class ContextChunkingPolicy(enum.IntEnum):
    FIRST_COME_FIRST_SERVED = 0
    EQUAL_PROGRESS = 1
    FORCE_CHUNK = 2

    @classmethod
    def parse(cls, value: ContextChunkingPolicy | str) -> ContextChunkingPolicy:
        """A member, or its name in any case ("equal_progress")."""
        if isinstance(value, cls):
            return value
        try:
            return cls[str(value).upper()]
        except KeyError:
            names = ", ".join(m.name for m in cls)
            raise ValueError(
                f"unknown context chunking policy {value!r}; expected one of {names}"
            ) from None


@dataclass(frozen=True, slots=True)
class ContextChunkingConfig:
    policy: ContextChunkingPolicy
    # Chunks other than a prompt's last one are multiples of this (a KV block size multiple, so
    # chunked prefill never leaves a half-filled block behind).
    chunk_unit_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", ContextChunkingPolicy.parse(self.policy))
        if self.chunk_unit_size <= 0:
            raise ValueError(f"chunk_unit_size must be > 0, got {self.chunk_unit_size}")


def reuse_adjusted_compute(chunk: int, reusable: int, remaining: int) -> int:
    """Forward-pass tokens of a context chunk when ``reusable`` prompt tokens are cached.

    A non-last chunk is shifted right past the cached prefix, so it still costs its full size;
    only a chunk reaching the end of the prompt saves the cached part."""
    if reusable <= 0 or reusable + chunk < remaining:
        return chunk
    return max(0, remaining - reusable)


def _lora_key(req: LlmRequest) -> tuple[int, int]:
    task = req.lora_task_id
    return (0, 0) if task is None else (1, task)


def _sort_by_lora(requests: list[LlmRequest]) -> list[LlmRequest]:
    """Stable sort by LoRA task id, requests without LoRA first."""
    for req in requests:
        if req.lora_task_id is not None:
            return sorted(requests, key=_lora_key)
    return requests


class MicroBatchScheduler:
    """``schedule`` returns (context_requests, generation_requests); encoder-init requests lead
    the context list. Chunk sizes of scheduled context requests are set on the requests."""

    def __init__(
        self,
        ctx_chunk_config: ContextChunkingConfig | None = None,
        max_context_length: int | None = None,
        *,
        no_schedule_until_state: LlmRequestState = S.CONTEXT_INIT,
        no_schedule_after_state: LlmRequestState = S.GENERATION_TO_COMPLETE,
    ) -> None:
        self.ctx_chunk_config = ctx_chunk_config
        self.max_context_length = max_context_length
        self.no_schedule_until_state = LlmRequestState(no_schedule_until_state)
        self.no_schedule_after_state = LlmRequestState(no_schedule_after_state)
        self._kinds_band: tuple[int, int] | None = None
        self._kinds = _Kinds()
        self._generation_states: frozenset = frozenset()
        self._context_states: frozenset = frozenset()

    def schedule(
        self,
        active_requests: Iterable[LlmRequest],
        inflight_request_ids: AbstractSet[int] | None,
        max_batch_size: int,
        max_num_tokens: int | None,
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        inflight = inflight_request_ids or ()
        band = (int(self.no_schedule_until_state), int(self.no_schedule_after_state))
        if self._kinds_band != band:  # the band attributes are public: rebuilt if reassigned
            self._kinds = _state_kinds(*band)
            self._kinds_band = band
            # The states of the two common kinds: a set test costs less than lookup and compare.
            self._generation_states = frozenset(
                st for st, k in self._kinds.items() if k == _GENERATION
            )
            self._context_states = frozenset(st for st, k in self._kinds.items() if k == _CONTEXT)
        kinds = self._kinds
        generation_states, context_states = self._generation_states, self._context_states
        max_ctx = self.max_context_length
        chunk_config = self.ctx_chunk_config

        encoder_requests: list[LlmRequest] = []
        context_requests: list[LlmRequest] = []
        generation_requests: list[LlmRequest] = []
        # Contexts to chunk: (request, remaining length, first-chunk reuse credit).
        to_chunk: list[tuple[LlmRequest, int, int]] = []
        batch_tokens = 0
        chunked_tokens = 0
        count = 0
        scheduled_beam = 0
        num_drafts = 0  # draft tokens among the contexts to chunk
        long_context = False  # one has more left than max_context_length
        all_fit = True

        token_limit = max_num_tokens if max_num_tokens is not None else _NO_LIMIT
        ctx_limit = max_ctx if max_ctx is not None else _NO_LIMIT
        # The batch-size cap binds only when more requests than it allows come in (reaching it
        # on the last one stops nothing), so then the loop need not count.
        counting = not (
            isinstance(active_requests, (list, tuple)) and len(active_requests) <= max_batch_size
        )
        take_generation = generation_requests.append
        beam_limit = token_limit  # set with scheduled_beam (no request has beam width 0)
        take_context = to_chunk.append
        for req in active_requests:
            if inflight and req.request_id in inflight:
                continue
            state = req.state
            if state in generation_states:  # the most common kind first; _PASS last
                # get_beam_width_by_iter(): one width for every iteration.
                if req.beam_width == scheduled_beam and not req.draft_tokens:
                    # The common case: it costs the batch's beam width.
                    if batch_tokens > beam_limit:
                        break
                    take_generation(req)
                    batch_tokens += scheduled_beam
                else:
                    beam = req.beam_width
                    drafts = req.draft_tokens
                    cost = beam + len(drafts) if drafts else beam
                    if batch_tokens + cost > token_limit:
                        break
                    if scheduled_beam == 0:
                        scheduled_beam = beam
                        beam_limit = token_limit - beam  # batch_tokens + beam > token_limit
                    elif beam != scheduled_beam:
                        # One beam width per batch; a mismatch is skipped and not counted.
                        continue
                    take_generation(req)
                    batch_tokens += cost
            elif state in context_states:
                # Request fields read directly (context_remaining_length, is_first_context_chunk,
                # num_draft_tokens): this loop runs for every fitting request on every step.
                position = req.context_current_position
                remaining = req.prompt_len - position
                if position == req.prepopulated_prompt_len:
                    reusable = req.estimated_reusable_tokens
                    if reusable > remaining:
                        reusable = remaining
                else:
                    reusable = 0
                drafts = req.draft_tokens
                if not drafts and chunk_config is not None:
                    # The common case: the last branch below without drafts.
                    cost = remaining - reusable if reusable > 0 else remaining
                    if cost > ctx_limit:
                        cost = ctx_limit
                        all_fit = False
                    if remaining > ctx_limit:
                        long_context = True
                    take_context((req, remaining, reusable))
                    chunked_tokens += cost
                elif chunk_config is None:
                    num_draft = len(drafts) if drafts else 0
                    num_tokens = req.get_num_tokens(0)
                    cost = max(1, reuse_adjusted_compute(num_tokens, reusable, remaining) + num_draft)
                    if max_ctx is not None and cost > max_ctx:
                        raise ValueError(
                            f"request {req.request_id}: context cost {cost} exceeds the maximum "
                            f"context length {max_ctx} and context chunking is off"
                        )
                    if batch_tokens + cost > token_limit:
                        break
                    context_requests.append(req)
                    batch_tokens += cost
                else:
                    # Tentatively the whole rest of the prompt: the last chunk, so drafts ride
                    # along. reuse_adjusted_compute(remaining, reusable, remaining), where
                    # reusable <= remaining.
                    num_draft = len(drafts)
                    cost = (remaining - reusable if reusable > 0 else remaining) + num_draft
                    if cost > ctx_limit:
                        cost = ctx_limit
                        all_fit = False
                    if remaining > ctx_limit:
                        long_context = True
                    take_context((req, remaining, reusable))
                    chunked_tokens += cost
                    num_drafts += num_draft
            elif kinds[state] == _ENCODER:
                cost = req.encoder_output_len
                if max_ctx is not None and cost > max_ctx:
                    raise ValueError(
                        f"request {req.request_id}: {cost} encoder tokens exceed the maximum "
                        f"context length {max_ctx}"
                    )
                if batch_tokens + cost > token_limit:
                    break
                encoder_requests.append(req)
                batch_tokens += cost
            else:  # _PASS: outside the band, or a state no micro-batch takes
                continue
            if counting:
                count += 1
                if count >= max_batch_size:
                    break

        if max_num_tokens is not None and chunked_tokens > max_num_tokens - batch_tokens:
            all_fit = False
        if chunk_config is not None and chunk_config.policy == ContextChunkingPolicy.FORCE_CHUNK:
            # Snapshot-boundary selection runs every step, whether or not everything fits.
            all_fit = False

        if all_fit:
            for req, remaining, _ in to_chunk:
                if remaining >= 0:  # the context_chunk_size setter without its state check
                    req._context_chunk_size = remaining
                else:
                    req.context_chunk_size = remaining  # rejected there
                context_requests.append(req)
            context_requests = _sort_by_lora(context_requests)
        else:
            if chunk_config is None:
                raise ValueError("context requests do not fit and context chunking is off")
            capacity = max_num_tokens - batch_tokens if max_num_tokens is not None else None
            # Contexts finishing this step go last, so the executor can move them to the front
            # of the generation list.
            not_last: list[LlmRequest] = []
            last: list[LlmRequest] = []
            if (
                chunk_config.policy == ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
                and capacity is not None
                and not num_drafts
                and not long_context
            ):
                # The common configuration, in one pass (no draft to fit, no chunk capped).
                _first_come_first_served_in_place(
                    to_chunk, capacity, chunk_config.chunk_unit_size, not_last, last
                )
            else:
                chunked, remainings, reusables = zip(*to_chunk) if to_chunk else ((), (), ())
                chunks = _size_chunks(
                    chunked, remainings, reusables, chunk_config.policy, capacity,
                    chunk_config.chunk_unit_size, max_ctx, fit_drafts=num_drafts > 0,
                )
                for req, chunk, remaining in zip(chunked, chunks, remainings):
                    _place_chunk(req, chunk, remaining, not_last, last)
            context_requests = _sort_by_lora(not_last) + _sort_by_lora(last)
        if encoder_requests:
            context_requests = _sort_by_lora(encoder_requests) + context_requests
        return context_requests, _sort_by_lora(generation_requests)

    # ---- chunk sizing ---------------------------------------------------------------------------
    @staticmethod
    def set_ctx_requests_chunk_size(
        requests: Sequence[LlmRequest],
        policy: ContextChunkingPolicy,
        capacity: int | None,
        chunk_unit_size: int,
        max_context_length: int | None,
    ) -> None:
        """Assign chunk sizes to context requests under a compute-token ``capacity`` (None: no
        limit), then trim draft tokens that would need a KV block of their own."""
        remainings = [r.context_remaining_length for r in requests]
        reusables = [
            min(r.estimated_reusable_tokens, rem)
            if r.context_current_position == r.prepopulated_prompt_len
            else 0
            for r, rem in zip(requests, remainings)
        ]
        chunks = _size_chunks(
            requests, remainings, reusables, policy, capacity, chunk_unit_size, max_context_length
        )
        for req, chunk in zip(requests, chunks):
            req.context_chunk_size = chunk


def _size_chunks(
    requests: Sequence[LlmRequest],
    remainings: Sequence[int],
    reusables: Sequence[int],
    policy: ContextChunkingPolicy,
    capacity: int | None,
    unit: int,
    max_ctx: int | None,
    *,
    fit_drafts: bool = True,
) -> list[int]:
    """Chunk size per request (every request gets one, so no reset pass is needed); discards
    the draft tokens that do not fit. ``reusables`` are first-chunk credits, already clamped to
    the remaining length. ``fit_drafts=False``: the caller knows no request has draft tokens,
    so there is nothing to discard."""
    policy = ContextChunkingPolicy.parse(policy)
    if policy == ContextChunkingPolicy.EQUAL_PROGRESS:
        chunks = _chunk_equal_progress(remainings, reusables, capacity, unit, max_ctx)
    elif policy == ContextChunkingPolicy.FIRST_COME_FIRST_SERVED:
        chunks = _chunk_first_come_first_served(remainings, reusables, capacity, unit, max_ctx)
    else:
        chunks = _chunk_forced(requests, remainings, capacity, unit, max_ctx)
    if fit_drafts:
        _fit_draft_tokens(requests, chunks, remainings, reusables, capacity, unit, max_ctx)
    return chunks


def _chunk_equal_progress(
    remainings: Sequence[int],
    reusables: Sequence[int],
    capacity: int | None,
    unit: int,
    max_ctx: int | None,
) -> list[int]:
    """Lock-step rounds: every request gets one more unit per round while the budget lasts;
    earlier requests get the extra unit when it runs out mid-round."""
    chunks = [0] * len(remainings)
    used = 0
    progress = 1
    while (capacity is None or used < capacity) and progress > 0:
        progress = 0
        for i, remaining in enumerate(remainings):
            past = chunks[i]
            actual = min(past + unit, remaining)
            if actual == past:
                continue
            reusable = reusables[i]
            inc = reuse_adjusted_compute(actual, reusable, remaining) - reuse_adjusted_compute(
                past, reusable, remaining
            )
            if (capacity is not None and used + inc > capacity) or (
                max_ctx is not None and actual > max_ctx
            ):
                continue
            chunks[i] = actual
            used += inc
            # Raw increment, not the compute one: a fully cached chunk still counts as progress.
            progress += actual - past
    return chunks


def _place_chunk(
    req: LlmRequest, chunk: int, remaining: int, not_last: list[LlmRequest], last: list[LlmRequest]
) -> None:
    """Set a scheduled context's chunk and list it (last chunks apart)."""
    # The context_chunk_size setter's clamp without its checks: the state is a context-init one
    # by construction; a negative size goes to the setter, which rejects it.
    if chunk >= 0:
        req._context_chunk_size = chunk if chunk < remaining else remaining
    else:
        req.context_chunk_size = chunk
    if chunk > 0:
        (last if chunk == remaining else not_last).append(req)


def _first_come_first_served_in_place(
    to_chunk: Sequence[tuple[LlmRequest, int, int]],
    capacity: int,
    unit: int,
    not_last: list[LlmRequest],
    last: list[LlmRequest],
) -> None:
    """``_chunk_first_come_first_served`` then ``_place_chunk`` for each (request, remaining,
    credit), in one pass, where no max_context_length caps a chunk: the chunk is the whole rest
    when its cost fits the budget left, else the budget on the unit grid."""
    for req, suggested, reusable in to_chunk:
        if reusable <= 0:
            if suggested <= capacity:
                chunk = suggested
            else:  # a trimmed chunk is not the last one: on the unit grid
                chunk = (capacity if capacity > 0 else 0) // unit * unit
            capacity -= chunk
        else:
            # With credit, the whole rest costs ``tail`` (reuse_adjusted_compute).
            tail = suggested - reusable if suggested > reusable else 0
            if tail <= capacity:
                chunk = suggested
                capacity -= tail
            else:
                chunk = (capacity if capacity > 0 else 0) // unit * unit
                capacity -= chunk if reusable + chunk < suggested else tail
        if chunk > 0:
            req._context_chunk_size = chunk if chunk < suggested else suggested
            (last if chunk >= suggested else not_last).append(req)
        elif chunk == 0:
            req._context_chunk_size = 0
        else:
            req.context_chunk_size = chunk  # rejected there


def _chunk_first_come_first_served(
    remainings: Sequence[int],
    reusables: Sequence[int],
    capacity: int | None,
    unit: int,
    max_ctx: int | None,
) -> list[int]:
    """In order, each request takes as much of the remaining budget as it can use."""
    chunks: list[int] = []
    for suggested, reusable in zip(remainings, reusables):
        if reusable <= 0:
            # No credit: reuse_adjusted_compute(x, reusable, suggested) == x for every x.
            actual = suggested
            if capacity is not None and capacity < suggested:
                actual = capacity if capacity > 0 else 0
            if max_ctx is not None and actual > max_ctx:
                actual = max_ctx if max_ctx < suggested else suggested
            if actual != suggested:
                actual = actual // unit * unit
            chunks.append(actual)
            if capacity is not None:
                capacity -= actual
            continue
        # With credit, reuse_adjusted_compute(x, reusable, suggested) is x for a chunk that ends
        # before the prompt does (reusable + x < suggested), else ``tail``; the whole remaining
        # context therefore costs ``tail``.
        tail = suggested - reusable if suggested > reusable else 0
        actual = suggested
        if capacity is not None and capacity < tail:
            actual = capacity if capacity > 0 else 0
        if max_ctx is not None and (actual if reusable + actual < suggested else tail) > max_ctx:
            actual = max_ctx if max_ctx < suggested else suggested
        if actual != suggested:
            # A trimmed chunk is not the last one: keep it on the unit grid.
            actual = actual // unit * unit
        chunks.append(actual)
        if capacity is not None:
            capacity -= actual if reusable + actual < suggested else tail
    return chunks


def _chunk_forced(
    requests: Sequence[LlmRequest],
    remainings: Sequence[int],
    capacity: int | None,
    unit: int,
    max_ctx: int | None,
) -> list[int]:
    """Requests with snapshot points advance to their next one (linear-attention state caching);
    the others advance one unit. No reuse credit: recurrent state cannot be partially reused."""
    if max_ctx is not None and max_ctx < unit:
        raise ValueError(f"the forced chunk size {unit} exceeds the max context length {max_ctx}")
    chunks: list[int] = []
    total = 0
    for req, remaining in zip(requests, remainings):
        points = req.expected_snapshot_points
        if points:
            position = req.context_current_position
            upcoming = [p for p in points if p > position]
            if upcoming:
                chunk = max(0, min(min(upcoming), req.prompt_len) - position)
            else:
                chunk = remaining
            if max_ctx is not None and chunk > max_ctx:
                chunk = max_ctx // unit * unit
            if capacity is not None and total + chunk > capacity:
                chunk = min(chunk, max(0, capacity - total)) // unit * unit
        else:
            chunk = min(remaining, unit)
            if capacity is not None and total + chunk > capacity:
                chunk = 0  # a later, shorter request may still fit
        chunks.append(chunk)
        total += chunk
    return chunks


def _fit_draft_tokens(
    requests: Sequence[LlmRequest],
    chunks: Sequence[int],
    remainings: Sequence[int],
    reusables: Sequence[int],
    capacity: int | None,
    unit: int,
    max_ctx: int | None,
) -> None:
    """Drafts ride on a last chunk only within the unit it already opens: a last chunk that is an
    exact unit multiple loses all of them rather than take a new KV block."""
    used = 0
    if capacity is not None:
        for chunk, remaining, reusable in zip(chunks, remainings, reusables):
            used += reuse_adjusted_compute(chunk, reusable, remaining)
    for req, chunk, remaining in zip(requests, chunks, remainings):
        num_draft = req.num_draft_tokens
        if num_draft == 0 or chunk != remaining:  # only a last chunk carries drafts
            continue
        rem = chunk % unit
        space = 0 if rem == 0 else unit - rem
        if max_ctx is not None:
            space = min(space, max_ctx - chunk)
        if capacity is not None:
            space = max(0, min(space, capacity - used))
            used += space
        if num_draft > space:
            req.discard_draft_tokens(num_draft - max(0, space))

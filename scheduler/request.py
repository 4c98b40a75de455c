"""Request states and the scheduler's view of a request (TensorRT-LLM llmRequest.h semantics).

Rules: scheduling.md 1 and 4. Pure Python, stdlib only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


class LlmRequestState(enum.IntEnum):
    """Newest numbering. Values are chronological, so ``has_reached_state`` is an integer compare
    and one numeric window [CONTEXT_INIT, GENERATION_COMPLETE) selects the schedulable states:
    disaggregated generation pre-states sit below CONTEXT_INIT, context post-states above
    GENERATION_COMPLETE."""

    DISAGG_TRANS_ERROR = -1
    UNKNOWN = 0
    ENCODER_INIT = 1
    DISAGG_CONTEXT_WAIT_SCHEDULER = 7
    DISAGG_GENERATION_INIT = 8
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 9
    CONTEXT_INIT = 10
    DISAGG_CONTEXT_INIT_AND_TRANS = 11
    DISAGG_GENERATION_TRANS_COMPLETE = 12
    GENERATION_IN_PROGRESS = 13
    GENERATION_TO_COMPLETE = 14
    GENERATION_COMPLETE = 20
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 21
    DISAGG_CONTEXT_COMPLETE = 22
    DISAGG_GENERATION_WAIT_TOKENS = 23


class LlmRequestType(enum.IntEnum):
    CONTEXT_AND_GENERATION = 0
    CONTEXT_ONLY = 1
    GENERATION_ONLY = 2


class RequestStage(enum.Enum):
    ENCODER = "encoder"
    CONTEXT = "context"
    GENERATION = "generation"
    NONE = "none"


S = LlmRequestState
_GENERATION_IN_PROGRESS_STATES = frozenset(
    {S.GENERATION_IN_PROGRESS, S.GENERATION_TO_COMPLETE, S.DISAGG_GENERATION_TRANS_COMPLETE}
)
_CONTEXT_INIT_STATES = frozenset({S.CONTEXT_INIT, S.DISAGG_CONTEXT_INIT_AND_TRANS})
_CHUNK_SETTABLE_STATES = _CONTEXT_INIT_STATES | {
    S.DISAGG_GENERATION_INIT,
    S.DISAGG_GENERATION_TRANS_COMPLETE,
}
_GENERATION_STAGE_STATES = frozenset(
    {
        S.GENERATION_IN_PROGRESS,
        S.GENERATION_TO_COMPLETE,
        S.DISAGG_GENERATION_TRANS_COMPLETE,
        S.DISAGG_GENERATION_INIT,
        S.DISAGG_GENERATION_TRANS_IN_PROGRESS,
    }
)


@dataclass(slots=True)
class ContextPhaseParams:
    """What a context-only request hands to the generation side (scheduling.md 7.2).

    ``first_gen_tokens`` holds one token per beam; ``opaque_state`` carries the context worker's
    transport endpoint and cache layout, serialized by the transport layer."""

    ctx_request_id: int
    first_gen_tokens: list[int]
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    ctx_worker_id: str | None = None
    num_blocks: int = 0


class LlmRequest:
    """One request as the schedulers and the executor see it.

    Invariants: ``prompt_len <= get_num_tokens(b)`` for every beam; ``context_current_position``
    lies in [0, prompt_len]; ``context_chunk_size`` never exceeds the remaining context.

    ``prompt_len`` and ``tokens`` are plain attributes, not properties, because the schedulers'
    hot loops read them for every request on every step. ``tokens`` is beam 0's token list (the
    prompt, then what was generated), the list ``get_tokens(0)`` returns: never rebound, changed
    only by ``add_new_token(s)`` and ``pause()``; only ``pause()`` changes ``prompt_len``.
    """

    __slots__ = (
        "request_id",
        "_beams",
        "tokens",
        "prompt_len",
        "orig_prompt_len",
        "max_new_tokens",
        "orig_max_new_tokens",
        "lora_task_id",
        "priority",
        "beam_width",
        "draft_tokens",
        "encoder_tokens",
        "agent_hierarchy",
        "llm_request_type",
        "context_phase_params",
        "state",
        "context_current_position",
        "_context_chunk_size",
        "prepopulated_prompt_len",
        "estimated_reusable_tokens",
        "seq_slot",
        "decoding_iter",
        "num_pauses",
        "expected_snapshot_points",
        "arrival_seq",
        "block_key_cache",
        "client_id",
        "cache_salt",
        "pending_forks",
    )

    def __init__(
        self,
        request_id: int,
        input_tokens: Sequence[int],
        max_new_tokens: int,
        *,
        lora_task_id: int | None = None,
        priority: float = 0.5,
        beam_width: int = 1,
        draft_tokens: list[int] | None = None,
        encoder_tokens: Sequence[int] | None = None,
        agent_hierarchy: Sequence[tuple[str, int]] | None = None,
        llm_request_type: LlmRequestType = LlmRequestType.CONTEXT_AND_GENERATION,
        context_phase_params: ContextPhaseParams | None = None,
        expected_snapshot_points: Sequence[int] | None = None,
        client_id: str | None = None,
    ) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(input_tokens) == 0:
            raise ValueError("input_tokens must not be empty")
        self.request_id = request_id
        self._beams = [list(input_tokens) for _ in range(beam_width)]  # tokens per beam
        self.tokens = self._beams[0]
        self.prompt_len = len(input_tokens)
        self.orig_prompt_len = self.prompt_len
        self.max_new_tokens = max_new_tokens
        self.orig_max_new_tokens = max_new_tokens
        self.lora_task_id = lora_task_id
        # Separates this request's cached prompt blocks from everyone's (vLLM's cache_salt): a
        # salted prompt neither reuses nor is reused. None: the shared cache.
        self.cache_salt: str | None = None
        self.priority = priority
        self.beam_width = beam_width
        self.draft_tokens = list(draft_tokens) if draft_tokens is not None else None
        self.encoder_tokens = list(encoder_tokens) if encoder_tokens is not None else None
        self.agent_hierarchy = (
            [(str(t), int(n)) for t, n in agent_hierarchy] if agent_hierarchy is not None else None
        )
        self.llm_request_type = LlmRequestType(llm_request_type)
        self.context_phase_params = context_phase_params
        if self.llm_request_type == LlmRequestType.GENERATION_ONLY:
            self.state = S.DISAGG_GENERATION_INIT
        elif self.encoder_tokens:
            self.state = S.ENCODER_INIT
        else:
            self.state = S.CONTEXT_INIT
        self.context_current_position = 0
        self._context_chunk_size = self.prompt_len
        self.prepopulated_prompt_len = 0
        self.estimated_reusable_tokens = 0
        self.seq_slot: int | None = None
        self.decoding_iter = 0
        self.num_pauses = 0
        self.expected_snapshot_points = (
            sorted(expected_snapshot_points) if expected_snapshot_points else None
        )
        self.arrival_seq = request_id
        # Owned by KVCacheManager: chained prefix block keys per (tokens_per_block, pool kind).
        self.block_key_cache: dict | None = None
        # The id the client knows the request by (TensorRT-LLM's clientId): only for what a
        # person reads (logs, dashboard entries); scheduling never looks at it.
        self.client_id = client_id
        # n/best_of: the sequences this request becomes once its prefill ends (itself and the
        # candidates that fork off it, TensorRT-LLM's child requests); 1 once forked, or never.
        # A windowed KV manager charges each of them before the fork.
        self.pending_forks = 1

    def __repr__(self) -> str:
        return (
            f"LlmRequest(id={self.request_id}, state={self.state.name}, P={self.prompt_len}, "
            f"N={self.max_new_tokens}, pos={self.context_current_position}, "
            f"chunk={self._context_chunk_size}, tokens={self.get_num_tokens(0)})"
        )

    # ---- lengths and tokens -------------------------------------------------------------------
    @property
    def encoder_output_len(self) -> int:
        return len(self.encoder_tokens) if self.encoder_tokens else 0

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self._beams[beam])

    def get_tokens(self, beam: int = 0) -> list[int]:
        return self._beams[beam]

    def get_prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    def add_new_token(self, token: int, beam: int = 0) -> None:
        self._beams[beam].append(int(token))

    def add_new_tokens(self, tokens: Sequence[int]) -> None:
        """One token per beam."""
        if len(tokens) != self.beam_width:
            raise ValueError(f"expected {self.beam_width} tokens (one per beam), got {len(tokens)}")
        for beam, token in enumerate(tokens):
            self._beams[beam].append(int(token))

    def get_max_num_generated_tokens(self) -> int:
        return max(len(tokens) for tokens in self._beams) - self.prompt_len

    def get_beam_width_by_iter(self) -> int:
        return self.beam_width

    # ---- draft tokens ------------------------------------------------------------------------
    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_tokens) if self.draft_tokens else 0

    @property
    def has_draft_tokens(self) -> bool:
        return self.num_draft_tokens > 0

    def discard_draft_tokens(self, num_to_discard: int) -> None:
        if num_to_discard < 0:
            raise ValueError("num_to_discard must be >= 0")
        if num_to_discard == 0 or not self.draft_tokens:
            return
        if num_to_discard > len(self.draft_tokens):
            raise ValueError(
                f"cannot discard {num_to_discard} of {len(self.draft_tokens)} draft tokens"
            )
        del self.draft_tokens[len(self.draft_tokens) - num_to_discard :]

    # ---- chunked context ---------------------------------------------------------------------
    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def context_chunk_size(self) -> int:
        return self._context_chunk_size

    @context_chunk_size.setter
    def context_chunk_size(self, size: int) -> None:
        if self.state not in _CHUNK_SETTABLE_STATES:
            raise ValueError(
                f"context_chunk_size can only be set in context-init, generation-init or "
                f"trans-complete states, not {self.state.name}"
            )
        if size < 0:
            raise ValueError(f"context_chunk_size must be >= 0, got {size}")
        # Silently clamped to what is left of the context (scheduling.md 1.2).
        self._context_chunk_size = min(size, self.context_remaining_length)

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == self.prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        if self.state in (S.DISAGG_GENERATION_INIT, S.DISAGG_GENERATION_TRANS_COMPLETE):
            return True
        return self.context_current_position + self._context_chunk_size == self.prompt_len

    @property
    def is_full_context_request(self) -> bool:
        return (
            self.is_context_init_state
            and self.is_first_context_chunk
            and self.is_last_context_chunk
        )

    def move_to_next_context_chunk(self) -> None:
        if not self.is_context_init_state:
            raise ValueError(f"request {self.request_id} is not in a context-init state")
        self.context_current_position += self._context_chunk_size
        self._context_chunk_size = 0

    def set_prepopulated_prompt_len(self, prepopulated: int, tokens_per_block: int) -> None:
        """Skip a cached prefix: the position jumps past it and, for a non-last chunk, the chunk
        shrinks so that it still ends on a block boundary, unless that would leave nothing (the
        chunk is shifted, not shrunk by the credit; scheduling.md 3.5)."""
        if not 0 <= prepopulated < self.prompt_len:
            raise ValueError(
                f"prepopulated length {prepopulated} must lie in [0, {self.prompt_len})"
            )
        self.prepopulated_prompt_len = prepopulated
        if prepopulated == 0:
            return
        chunk = self._context_chunk_size
        if prepopulated + chunk < self.prompt_len:
            floored_end = (prepopulated + chunk) // tokens_per_block * tokens_per_block
            # pdserve (scheduling.md 3.5): a chunk shorter than a block is kept, not shrunk to
            # nothing. Shrunk, the request would hold its prompt's blocks while still on its
            # first chunk, which MAX_UTILIZATION neither pauses (not started) nor admits (it
            # charges the prompt's blocks again): with no block free it would never run. Only a
            # chunk unit that is no block multiple gets here, which TensorRT-LLM refuses.
            if floored_end > prepopulated:
                chunk = floored_end - prepopulated
        self.context_current_position = prepopulated
        self._context_chunk_size = min(chunk, self.context_remaining_length)

    # ---- states ------------------------------------------------------------------------------
    def has_reached_state(self, state: LlmRequestState) -> bool:
        return self.state >= state

    @property
    def is_encoder_init_state(self) -> bool:
        return self.state == S.ENCODER_INIT

    @property
    def is_context_init_state(self) -> bool:
        return self.state in _CONTEXT_INIT_STATES

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state in _GENERATION_IN_PROGRESS_STATES

    @property
    def is_context_finished(self) -> bool:
        return self.is_generation_in_progress_state or self.state == S.DISAGG_CONTEXT_INIT_AND_TRANS

    @property
    def is_finished(self) -> bool:
        return self.state in (S.GENERATION_COMPLETE, S.DISAGG_CONTEXT_TRANS_IN_PROGRESS)

    @property
    def is_generation_complete_state(self) -> bool:
        return self.state == S.GENERATION_COMPLETE

    @property
    def is_disagg_context_transmission_state(self) -> bool:
        return self.state in (S.DISAGG_CONTEXT_TRANS_IN_PROGRESS, S.DISAGG_CONTEXT_INIT_AND_TRANS)

    @property
    def is_disagg_context_complete_state(self) -> bool:
        return self.state == S.DISAGG_CONTEXT_COMPLETE

    @property
    def is_disagg_generation_init_state(self) -> bool:
        return self.state == S.DISAGG_GENERATION_INIT

    @property
    def is_disagg_generation_transmission_in_progress(self) -> bool:
        return self.state == S.DISAGG_GENERATION_TRANS_IN_PROGRESS

    @property
    def is_disagg_generation_transmission_complete(self) -> bool:
        return self.state == S.DISAGG_GENERATION_TRANS_COMPLETE

    @property
    def is_disagg_trans_error(self) -> bool:
        return self.state == S.DISAGG_TRANS_ERROR

    @property
    def is_context_only_request(self) -> bool:
        return self.llm_request_type == LlmRequestType.CONTEXT_ONLY

    @property
    def is_generation_only_request(self) -> bool:
        return self.llm_request_type == LlmRequestType.GENERATION_ONLY

    @property
    def request_stage(self) -> RequestStage:
        if self.state == S.ENCODER_INIT:
            return RequestStage.ENCODER
        if self.state == S.CONTEXT_INIT:
            return RequestStage.CONTEXT
        if self.state in _GENERATION_STAGE_STATES:
            return RequestStage.GENERATION
        return RequestStage.NONE

    # ---- disaggregated generation -----------------------------------------------------------
    def convert_disagg_generation_trans_complete(self) -> None:
        """DISAGG_GENERATION_TRANS_COMPLETE -> GENERATION_IN_PROGRESS before the first decode step
        (scheduling.md 1.4 step 6): the whole prompt counts as context and the first token(s) sampled
        by the context worker are appended, one per beam."""
        if self.state != S.DISAGG_GENERATION_TRANS_COMPLETE:
            raise ValueError(f"request {self.request_id} is in {self.state.name}, not TRANS_COMPLETE")
        if self.context_phase_params is None:
            raise ValueError(f"request {self.request_id} has no context phase params")
        first = self.context_phase_params.first_gen_tokens
        if len(first) != self.beam_width:
            raise ValueError(
                f"context phase params carry {len(first)} first tokens for beam width {self.beam_width}"
            )
        self.state = S.GENERATION_IN_PROGRESS
        self.context_current_position = self.prompt_len
        self._context_chunk_size = 0
        self.decoding_iter = 1
        self.add_new_tokens(first)
        if self.context_phase_params.draft_tokens:
            self.draft_tokens = list(self.context_phase_params.draft_tokens)

    # ---- pause -------------------------------------------------------------------------------
    def pause(self, max_input_len: int) -> None:
        """Evict and recompute later (scheduling.md 4).

        Beam 1: generated tokens become prompt, clamped at ``max_input_len`` (tokens beyond it are
        dropped and will be generated again), and ``max_new_tokens`` shrinks by what was absorbed.
        Beam > 1: every beam restarts from the prompt."""
        if self.beam_width > 1:
            for tokens in self._beams:
                del tokens[self.prompt_len :]
        else:
            new_prompt_len = min(max_input_len, self.prompt_len + self.get_max_num_generated_tokens())
            # Admission rejects prompts over max_input_len, so this clamp only guards misuse: a
            # pause never shrinks the prompt.
            new_prompt_len = max(new_prompt_len, self.prompt_len)
            del self.tokens[new_prompt_len:]
            self.max_new_tokens -= new_prompt_len - self.prompt_len
            self.prompt_len = new_prompt_len
        self.state = S.ENCODER_INIT if self.encoder_tokens else S.CONTEXT_INIT
        self.context_current_position = 0
        self.prepopulated_prompt_len = 0
        self._context_chunk_size = self.prompt_len
        self.estimated_reusable_tokens = 0
        self.seq_slot = None
        self.decoding_iter = 0
        self.num_pauses += 1

"""Per-step request bookkeeping shared by the real executor and the simulated worker.

The schedulers decide *who* runs; these functions carry out what the step means for a request's
state and its KV blocks, in the order TensorRT-LLM's PyExecutor does it (scheduling.md 6):
pause what the capacity pass evicted, reserve KV for generation-init requests, allocate the
whole prompt's blocks on a context request's first chunk (prefix reuse shifts the chunk past the
cached part), grow decode sequences by one token, then after the forward pass advance chunks and
states, store the context's full blocks at the end of prefill and free finished requests.

Token accounting invariant: the KV sequence holds the tokens whose K/V has been computed, so
after a prefill of P tokens it holds P tokens while the request holds P + 1 (the sampled first
token); every decode step adds one to both.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol, Sequence

from .request import LlmRequest, LlmRequestState


class KVBookkeeping(Protocol):
    tokens_per_block: int
    enable_block_reuse: bool

    def has_sequence(self, request_id: int) -> bool: ...
    def add_sequence(self, request: LlmRequest) -> None: ...
    def add_sequences(self, requests: Sequence[LlmRequest]) -> None: ...
    def add_token(self, request_id: int) -> None: ...
    def store_context_blocks(self, request: LlmRequest) -> None: ...
    def remove_sequence(self, request_id: int) -> None: ...


def pause_requests(
    paused: Iterable[LlmRequest], kv: KVBookkeeping, max_input_len: int
) -> list[LlmRequest]:
    """Free the KV of every paused request, then fold its generated tokens into the prompt.
    The request stays active and is prefilled again later (pause-and-recompute)."""
    done = []
    for request in paused:
        if kv.has_sequence(request.request_id):
            kv.remove_sequence(request.request_id)
        request.pause(max_input_len)
        done.append(request)
    return done


def reserve_generation_init(request: LlmRequest, kv: KVBookkeeping) -> None:
    """DISAGG_GENERATION_INIT -> DISAGG_GENERATION_TRANS_IN_PROGRESS: the KV blocks for the whole
    prompt are allocated here; this allocation is the reservation the transfer lands in."""
    if request.state != LlmRequestState.DISAGG_GENERATION_INIT:
        raise ValueError(f"request {request.request_id} is not in DISAGG_GENERATION_INIT")
    kv.add_sequence(request)
    request.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS


def prepare_context_chunks(requests: Sequence[LlmRequest], kv: KVBookkeeping) -> list[int]:
    """Before the forward pass. Returns the number of tokens each chunk actually computes.

    On the first chunk the whole prompt's blocks are allocated; with reuse on, the KV manager
    sets the prepopulated length, which moves the position past the cached prefix and keeps a
    non-last chunk ending on a block boundary. All first chunks are allocated together so that
    one request's new blocks cannot evict the cached prefix another was credited with (the
    credit is what kept the step within max_num_tokens)."""
    kv.add_sequences([r for r in requests if not kv.has_sequence(r.request_id)])
    return [r.context_chunk_size for r in requests]


def prepare_generation_step(request: LlmRequest, kv: KVBookkeeping) -> None:
    """Before the forward pass of a generation request: a freshly received disaggregated request
    is converted (first token appended), then the sequence grows by the token being decoded."""
    if request.state == LlmRequestState.DISAGG_GENERATION_TRANS_COMPLETE:
        request.convert_disagg_generation_trans_complete()
    kv.add_token(request.request_id)


def complete_context_chunk(
    request: LlmRequest, kv: KVBookkeeping, sampled_token: int | None
) -> bool:
    """After the forward pass. Advances the chunk; at the end of the prompt the full context
    blocks are stored for reuse and the request either starts generating (with its first sampled
    token appended) or, if context-only, waits for its KV to be sent. Returns True when the
    prefill finished this step."""
    request.move_to_next_context_chunk()
    if request.context_current_position < request.prompt_len:
        return False
    if kv.enable_block_reuse:
        kv.store_context_blocks(request)
    if sampled_token is None:
        raise ValueError(f"request {request.request_id} finished prefill without a sampled token")
    request.add_new_token(sampled_token)
    request.decoding_iter = 1
    if request.is_context_only_request:
        request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
    else:
        request.state = LlmRequestState.GENERATION_IN_PROGRESS
    return True


def complete_generation_step(request: LlmRequest, sampled_token: int) -> None:
    request.add_new_token(sampled_token)
    request.decoding_iter += 1


def reached_max_tokens(request: LlmRequest) -> bool:
    return request.get_num_tokens(0) >= request.prompt_len + request.max_new_tokens


def finish_request(
    request: LlmRequest,
    kv: KVBookkeeping,
    state: LlmRequestState = LlmRequestState.GENERATION_COMPLETE,
) -> None:
    """Terminal transition: every block the request holds goes back to the pool (cached full
    blocks stay in the reuse tree as free cached blocks)."""
    if kv.has_sequence(request.request_id):
        kv.remove_sequence(request.request_id)
    request.state = state


def live_requests(
    active: Iterable[LlmRequest], waiting: Iterable[LlmRequest],
    *handed_over: Mapping[int, LlmRequest],
) -> dict[int, LlmRequest]:
    """Every request a worker still holds, once each, by id: the active list, the waiting queue,
    and what the transport holds for it (a context worker's leased hand-offs, a generation
    worker's aborted receives still draining). The one definition behind a worker's status,
    its per-request states and its metrics."""
    live = {r.request_id: r for r in active}
    live.update((r.request_id, r) for r in waiting)
    for group in handed_over:
        live.update(group)
    return live


def count_by_state(requests: Iterable[LlmRequest]) -> dict[str, int]:
    """LlmRequestState name -> number of requests in it."""
    out: dict[str, int] = {}
    for r in requests:
        out[r.state.name] = out.get(r.state.name, 0) + 1
    return out

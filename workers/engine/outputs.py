"""Outputs: what a sampled token means for its request, and the update the router gets.

``stop_reason`` is the pure stop check. ``OutputProcessor.on_token`` applies a token that the
request's token list already holds: it reconciles what the client has seen, feeds the grammar,
checks the stop conditions and either reports the token or ends the request here: finished
(its KV freed), handed off to a generation worker (context-only: its KV leased), or one of
several n/best_of candidates done.
"""
from __future__ import annotations

from typing import Collection

from pdserve.scheduler import LlmRequest, LlmRequestState, lifecycle
from pdserve.transport.requests import TokenLogprobs, UpdateInfo, WireUpdate

from pdserve.workers.engine.state import EngineStats, RequestTable, TrackedRequest
from pdserve.workers.engine.kv_connector import KVConnector


def stop_reason(token: int, *, eos_token_ids: Collection[int], ignore_eos: bool,
                grammar_done: bool, stop_token_ids: Collection[int],
                reached_max_tokens: bool) -> str | None:
    """vLLM's order: EOS (unless ignored), a complete grammar (nothing but EOS could follow),
    a stop token id, then the length limit. None: the request goes on."""
    if token in eos_token_ids and not ignore_eos:
        return "stop"
    if grammar_done or token in stop_token_ids:
        return "stop"
    if reached_max_tokens:
        return "length"
    return None


def reconcile_emitted(generated: list[int], emitted: list[int]) -> list[int]:
    """The tokens of ``generated`` the client has not seen, appended to ``emitted``. A pause
    clamped at max_input_len may regenerate a position the client already has: that position
    keeps what was streamed (``generated`` is corrected in place), so there is no duplicate or
    gap."""
    if len(generated) <= len(emitted):
        generated[-1] = emitted[len(generated) - 1]
    new = generated[len(emitted):]
    emitted.extend(new)
    return new


class OutputProcessor:
    """``open_choices``: wire id -> candidates of an n/best_of request still running (shared
    with ``Candidates``, which opens them)."""

    def __init__(self, table: RequestTable, kv, connector: KVConnector, stats: EngineStats,
                 eos_token_ids: frozenset[int], open_choices: dict[int, int]) -> None:
        self.table = table
        self.kv = kv
        self.connector = connector
        self.stats = stats
        self.eos_token_ids = eos_token_ids
        self.open_choices = open_choices

    def on_token(self, request: LlmRequest, token: int, logprobs: TokenLogprobs | None = None,
                 choice_firsts: list | None = None) -> WireUpdate:
        """``choice_firsts``: a context-only first candidate's siblings' first tokens (token,
        logprobs), which go to the generation side along with its own."""
        tracked = self.table.tracked[request.request_id]
        self.stats.generated_tokens += 1
        tokens = request.get_tokens(0)
        generated = tokens[request.orig_prompt_len:]
        new = reconcile_emitted(generated, tracked.emitted)
        token = tokens[-1] = generated[-1]
        matcher = tracked.sampler.matcher
        if matcher is not None:
            matcher.accept(token)
        # Logprobs go with a token the client has not seen (a forced one was reported before).
        lps = (logprobs,) if logprobs is not None and new else None
        plps = None
        if tracked.prompt_logprobs is not None:  # sent once, with the first token
            plps, tracked.prompt_logprobs = tuple(tracked.prompt_logprobs), None
        params = tracked.params
        reason = stop_reason(token, eos_token_ids=self.eos_token_ids, ignore_eos=params.ignore_eos,
                             grammar_done=matcher is not None and matcher.is_terminated(),
                             stop_token_ids=params.stop_token_ids,
                             reached_max_tokens=lifecycle.reached_max_tokens(request))
        rid, index = tracked.wire_id, tracked.index
        if request.state == LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS and (
                reason in (None, "length") or choice_firsts is not None):
            # Context-only: the slot is freed now, the blocks stay leased for the generation side
            # (never past the request's deadline). With several candidates, every candidate's
            # first token goes along (new_token_ids[i] is candidate i's): the generation side
            # decides which of them ended.
            if choice_firsts is not None:
                new = list(new) + [t for t, _ in choice_firsts]
                if lps is not None:
                    lps = lps + tuple(lp for _, lp in choice_firsts)
            lease_s = self.table.time_left(request.request_id)
            self.table.retire(request)
            info = self.request_info(request)
            handed = self.connector.hand_off(request, self.kv, token, lease_s=lease_s)
            return WireUpdate.context_done(rid, new, handed, info, logprobs=lps,
                                           prompt_logprobs=plps)
        if self.connector.is_streaming(request.request_id):
            # A layer-wise context request that ended at its first token: its send may be in
            # flight, so its blocks are freed only once the data plane is quiet.
            self._end(tracked, reason)
            info = self.request_info(request)
            self.connector.end_stream(request, f"the request finished ({reason})")
            self.stats.finished += 1
            return WireUpdate.finished_with(rid, new, reason, info, logprobs=lps,
                                            prompt_logprobs=plps)
        if reason is None:
            if self.connector.has_received(request.request_id):
                # The first decode after a receive tells the router how the KV arrived; the
                # finishing update then reports 0 bytes more (the router adds them up).
                return WireUpdate.tokens(rid, new, self.transfer_info(request),
                                         logprobs=lps, prompt_logprobs=plps, index=index)
            return WireUpdate.tokens(rid, new, logprobs=lps, prompt_logprobs=plps, index=index)
        self._end(tracked, reason)
        info = self.request_info(request)
        lifecycle.finish_request(request, self.kv, LlmRequestState.GENERATION_COMPLETE)
        self.stats.finished += 1
        open_choices = self.open_choices.get(rid)
        if open_choices is not None:
            if open_choices > 1:  # other candidates go on: this one's end is not the request's
                self.open_choices[rid] = open_choices - 1
                return WireUpdate.choice_done(rid, index, new, reason, info, logprobs=lps,
                                              prompt_logprobs=plps)
            del self.open_choices[rid]
        return WireUpdate.finished_with(rid, new, reason, info, logprobs=lps,
                                        prompt_logprobs=plps, index=index)

    def _end(self, tracked: TrackedRequest, reason: str | None) -> None:
        tracked.finish_reason = reason
        self.table.retire(tracked.request)

    def request_info(self, request: LlmRequest) -> UpdateInfo:
        moved = self.transfer_info(request)
        return UpdateInfo(request.num_pauses, moved.kv_transfer_bytes, moved.kv_transfer_seconds,
                          moved.kv_transfer_blocks, request.prepopulated_prompt_len)

    def transfer_info(self, request: LlmRequest) -> UpdateInfo:
        """What this request's receive moved, reported once. ``kv_transfer_blocks`` is set only
        for a generation-only request whose receive completed: 0 blocks means its generation
        worker's cache already held the whole prompt."""
        got = self.connector.take_received(request.request_id)
        if got is None:
            return UpdateInfo()
        nbytes, seconds, blocks = got
        return UpdateInfo(kv_transfer_bytes=nbytes, kv_transfer_seconds=seconds,
                          kv_transfer_blocks=blocks)


def note_prompt_logprobs(tracked: TrackedRequest, past: int, entries_here: list) -> None:
    """``entries_here[j]`` scored the prompt token at position past + j + 1: append each
    position once (a recompute after a pause scores them again)."""
    entries = tracked.prompt_logprobs
    for j, entry in enumerate(entries_here):
        if past + j == len(entries):
            entries.append(entry)


"""n / best_of: the candidates of one request as sequences of their own.

The first candidate is the request itself. When its prefill ends, every other candidate draws
its first token from the same logits and forks off as a child request (an id of its own,
negative so it never meets the router's ids) that shares the prompt's full blocks and copies
the partial last one. A generation-only request gets the other candidates' first tokens from
the context worker and forks them once its KV has arrived.
"""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from pdserve.scheduler import LlmRequest, LlmRequestState, lifecycle
from pdserve.scheduler.kv_cache import KVCacheOutOfBlocksError
from pdserve.transport.requests import UpdateKind, WireUpdate

from pdserve.workers.engine.state import RequestTable, TrackedRequest
from pdserve.workers.engine.outputs import OutputProcessor
from pdserve.workers.runner.sampling import RequestSampler
from pdserve.workers.runner.plan import SampledToken


class Candidates:
    def __init__(self, table: RequestTable, kv, outputs: OutputProcessor, copy_blocks,
                 make_sampler, max_input_len: int) -> None:
        """``copy_blocks(pairs)``: the model runner's block copy; ``make_sampler(params, index,
        output_start)``: candidate ``index``'s sampler."""
        self.table = table
        self.kv = kv
        self.outputs = outputs
        self.copy_blocks = copy_blocks
        self.make_sampler = make_sampler
        self.max_input_len = max_input_len
        self._child_ids = itertools.count(-1, -1)
        # wire id -> candidates still running (OutputProcessor counts them down).
        self.open = outputs.open_choices

    def admit(self, tracked: TrackedRequest, choice_tokens: Sequence[Sequence[int]]) -> None:
        """A request of several candidates: its siblings' first tokens (generation-only) or
        samplers (they draw at the end of its prefill)."""
        request, params = tracked.request, tracked.params
        rid = request.request_id
        self.table.awaiting_fork.add(rid)
        request.pending_forks = params.candidates
        if request.is_generation_only_request:
            tracked.choice_tokens = tuple(tuple(int(t) for t in c) for c in choice_tokens)
        else:
            tracked.choice_samplers = [self.make_sampler(params, i, tracked.sampler.output_start)
                                       for i in range(1, params.candidates)]

    def samplers_at_prefill_end(self, request: LlmRequest) -> list[RequestSampler] | None:
        """The siblings' samplers when ``request``'s prefill ends this step, else None."""
        rid = request.request_id
        if rid not in self.table.awaiting_fork:
            return None
        return self.table.tracked[rid].choice_samplers

    def fork_after_prefill(self, request: LlmRequest, first: SampledToken,
                           firsts: list[SampledToken]) -> list[WireUpdate]:
        """``request``'s prefill produced ``first``; ``firsts`` are its siblings'. Context-only:
        they travel with the hand-off. Otherwise the siblings fork off here."""
        tracked = self.table.tracked[request.request_id]
        if request.is_context_only_request:
            return [self.outputs.on_token(request, first.token, first.logprobs,
                                          choice_firsts=firsts)]
        self.table.awaiting_fork.discard(request.request_id)
        request.pending_forks = 1
        samplers, tracked.choice_samplers = tracked.choice_samplers, None
        children = self._fork(request, [t for t, _ in firsts], samplers, reported=False)
        updates = [self.outputs.on_token(request, first.token, first.logprobs)]
        for child, sibling in zip(children, firsts):
            updates.append(self.outputs.on_token(child, sibling.token, sibling.logprobs))
        return updates

    def fork_received(self, request: LlmRequest) -> list[WireUpdate]:
        """A generation-only request of several candidates whose KV has arrived: the other
        candidates (their first tokens came from the context worker, through the router) fork
        off before its first decode. A candidate whose first token already ends it finishes
        here."""
        tracked = self.table.tracked[request.request_id]
        firsts = [c[0] for c in tracked.choice_tokens]
        tracked.choice_tokens = ()
        self.table.awaiting_fork.discard(request.request_id)
        request.pending_forks = 1
        out = []
        for child, first in zip(self._fork(request, firsts, None, reported=True), firsts):
            update = self.outputs.on_token(child, first, None)
            if update.finished or update.kind != UpdateKind.TOKENS:
                out.append(update)
        return out

    def _fork(self, parent: LlmRequest, firsts: list[int],
              samplers: list[RequestSampler] | None, *, reported: bool) -> list[LlmRequest]:
        """Candidates 1.. of ``parent`` as child requests right after its prefill (its KV holds
        the prompt, nothing more): each shares the prompt's full blocks and gets a copy of the
        partial last one, and starts generating after its own first token. A child that finds
        no free block for its copy is paused: it recomputes its prompt when there is room."""
        pt = self.table.tracked[parent.request_id]
        prompt = parent.get_tokens(0)[:parent.prompt_len]
        children = []
        for i, token in enumerate(firsts, start=1):
            child = LlmRequest(next(self._child_ids), prompt, parent.max_new_tokens,
                               priority=parent.priority, client_id=parent.client_id)
            child.arrival_seq = parent.arrival_seq
            # (Its grammar state takes the first token in on_token, as the first candidate's.)
            sampler = (samplers[i - 1] if samplers is not None else
                       self.make_sampler(pt.params, i, pt.sampler.output_start))
            # ``reported``: the router has the first tokens already (the context worker's).
            self.table.track(TrackedRequest(child, sampler, sampler.params,
                                            [token] if reported else [], deadline=pt.deadline,
                                            wire_id=pt.wire_id, index=i))
            child.add_new_token(token)
            child.decoding_iter = 1
            child.context_current_position = child.prompt_len
            child.state = LlmRequestState.GENERATION_IN_PROGRESS
            try:
                copy = self.kv.fork_sequence(parent.request_id, child)
            except KVCacheOutOfBlocksError:
                lifecycle.pause_requests([child], self.kv, self.max_input_len)
                self.table.paused_since[child.request_id] = time.monotonic()
            else:
                if copy is not None:
                    self.copy_blocks([copy])
            self.table.active.append(child)
            children.append(child)
        self.open[pt.wire_id] = len(firsts) + 1
        return children

    def children_of(self, wire_id: int) -> list[int]:
        return [cid for cid, t in self.table.tracked.items()
                if t.wire_id == wire_id and cid != wire_id]


"""Pause-and-recompute (scheduling.md 5): what the engine core does with the requests the
capacity pass evicted, and how it notices that one resumed.

A paused request frees its KV blocks and folds its generated tokens into its prompt
(``lifecycle.pause_requests``, TensorRT-LLM's ``pause(max_input_len)``); it resumes when the
first chunk of its recompute is scheduled. Each pause and resume is an event a person sees (a
log line on the worker actor's page, a record in ``pdserve top``).
"""
from __future__ import annotations

import time

from pdserve.scheduler import LlmRequest, lifecycle
from pdserve.workers.engine.events import WorkerEvents, label
from pdserve.workers.engine.state import EngineStats, RequestTable


class Pauses:
    def __init__(self, table: RequestTable, kv, events: WorkerEvents, stats: EngineStats,
                 policy_name: str, max_input_len: int) -> None:
        self.table = table
        self.kv = kv
        self.events = events
        self.stats = stats
        self.policy_name = policy_name
        self.max_input_len = max_input_len

    def pause(self, paused: list[LlmRequest]) -> None:
        if not paused:
            return
        for request in paused:
            rid = request.request_id
            blocks = len(self.kv.get_block_ids(rid)) if self.kv.has_sequence(rid) else 0
            self.events.pause(client=label(rid, request.client_id), policy=self.policy_name,
                              generated_tokens=request.get_num_tokens(0) - request.orig_prompt_len,
                              blocks_freed=blocks, pause_index=request.num_pauses + 1)
            self.table.note_pause(rid)
        lifecycle.pause_requests(paused, self.kv, self.max_input_len)
        self.stats.pauses += len(paused)
        self.stats.paused_request_ids.extend(r.request_id for r in paused)

    def note_resumed(self, scheduled_contexts: list[LlmRequest]) -> None:
        """A paused request resumes when its recompute's first chunk is scheduled."""
        now = time.monotonic()
        for request in scheduled_contexts:
            since = self.table.paused_since.pop(request.request_id, None)
            if since is not None:
                self.events.resume(client=label(request.request_id, request.client_id),
                                   paused_seconds=now - since, pause_index=request.num_pauses,
                                   prefill_tokens=request.prompt_len)

"""Scheduled-blocks managers used by the capacity scheduler (reference 2.3 and 2.6).

Both read a KV manager only through ``get_num_free_blocks``,
``get_remaining_blocks_to_completion``, ``get_needed_blocks_one_step`` and
``scheduling_has_free_blocks``, so a test double with those names can stand in for
``KVCacheManager``. One attention-window size per KV manager; the names stay generic (no window
argument) because ``is_variable_window`` is always False here.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any

from .kv_prefix_reuse import PrefixReuseSummary
from .request import LlmRequest


class NoEvictScheduledBlocksManager:
    """GUARANTEED_NO_EVICT / STATIC_BATCH budget: blocks still available once every admitted
    request has reserved what it needs until completion.

    ``available`` starts at the free block count at construction and may go negative through
    ``decrement_unchecked`` (pass-1 generation requests are admitted whatever they need)."""

    __slots__ = ("_kv", "available", "_pending_need")

    def __init__(self, kv_cache_manager: Any) -> None:
        self._kv = kv_cache_manager
        self.available: int = kv_cache_manager.get_num_free_blocks()
        self._pending_need = 0

    def _remaining(self, request: LlmRequest, summary: PrefixReuseSummary | None) -> int:
        if summary is None:
            return self._kv.get_remaining_blocks_to_completion(request)
        return self._kv.get_remaining_blocks_to_completion(request, summary)

    def decrement_unchecked(self, request: LlmRequest) -> None:
        """Reserve the request's remaining blocks without checking availability."""
        self.available -= self._remaining(request, None)

    def check(self, request: LlmRequest, summary: PrefixReuseSummary | None = None) -> bool:
        """Does the request's remaining need fit? The need is kept for ``commit``."""
        need = self._remaining(request, summary)
        self._pending_need = need
        return need <= self.available

    def commit(self) -> None:
        """Reserve the need computed by the last ``check``."""
        self.available -= self._pending_need
        self._pending_need = 0


class MaxUtilizationScheduledBlocksManager:
    """MAX_UTILIZATION budget: blocks the requests scheduled so far need for their next step,
    tested against the KV manager's scheduling free counter (which pauses raise)."""

    __slots__ = ("_kv", "two_steps_look_ahead", "scheduled")

    def __init__(self, kv_cache_manager: Any, two_steps_look_ahead: bool) -> None:
        self._kv = kv_cache_manager
        self.two_steps_look_ahead = two_steps_look_ahead
        self.scheduled: int = 0

    def prepare_blocks_if_schedulable(
        self, request: LlmRequest, summary: PrefixReuseSummary | None = None
    ) -> int | None:
        """The new scheduled total if the request's next step fits, else None. Nothing changes
        until ``update_scheduled_blocks`` is called with the returned total."""
        kv = self._kv
        if summary is None:
            needed = kv.get_needed_blocks_one_step(request, self.two_steps_look_ahead)
        else:
            needed = kv.get_needed_blocks_one_step(request, self.two_steps_look_ahead, summary)
        total = self.scheduled + needed
        if not kv.scheduling_has_free_blocks(total):
            return None
        return total

    def update_scheduled_blocks(self, total: int) -> None:
        self.scheduled = total

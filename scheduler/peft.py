"""LoRA (PEFT) page accounting for the capacity scheduler (scheduling.md 2.8).

The scheduler keeps the set of task ids seen in one pass and charges
``determine_num_pages(request)`` only for a task's first request; this class only answers how
many device pages a task needs and how many exist.

Pure Python, stdlib only.
"""
from __future__ import annotations

from typing import Any, Mapping


class PeftCacheManager:
    """``pages_per_task``: one page count for every task, or a mapping task id -> pages.
    A task missing from the mapping is an error (its adapter size is unknown)."""

    __slots__ = ("max_device_pages", "_pages")

    def __init__(self, max_device_pages: int, pages_per_task: int | Mapping[int, int]) -> None:
        if max_device_pages < 0:
            raise ValueError(f"max_device_pages must be >= 0, got {max_device_pages}")
        if isinstance(pages_per_task, int):
            if pages_per_task < 0:
                raise ValueError(f"pages_per_task must be >= 0, got {pages_per_task}")
        elif any(p < 0 for p in pages_per_task.values()):
            raise ValueError("pages per task must be >= 0")
        self.max_device_pages = max_device_pages
        self._pages: int | dict[int, int] = (
            pages_per_task if isinstance(pages_per_task, int) else dict(pages_per_task)
        )

    def determine_num_pages(self, request: Any) -> int:
        """Device pages the request's LoRA task occupies; 0 without a LoRA task."""
        task = request.lora_task_id
        if task is None:
            return 0
        if isinstance(self._pages, int):
            return self._pages
        try:
            return self._pages[task]
        except KeyError:
            raise KeyError(f"unknown LoRA task {task}: no page count configured") from None

"""LoRA page accounting (scheduling.md 2.8)."""
from __future__ import annotations

import pytest

from pdserve.scheduler.peft import PeftCacheManager
from pdserve.scheduler.request import LlmRequest


def req(lora: int | None) -> LlmRequest:
    return LlmRequest(1, [1, 2, 3], 4, lora_task_id=lora)


def test_int_pages_per_task():
    peft = PeftCacheManager(64, 8)
    assert peft.max_device_pages == 64
    assert peft.determine_num_pages(req(3)) == 8
    assert peft.determine_num_pages(req(0)) == 8  # task id 0 is a real task
    assert peft.determine_num_pages(req(None)) == 0


def test_mapping_pages_per_task():
    peft = PeftCacheManager(64, {1: 4, 2: 16})
    assert peft.determine_num_pages(req(1)) == 4
    assert peft.determine_num_pages(req(2)) == 16
    assert peft.determine_num_pages(req(None)) == 0
    with pytest.raises(KeyError):
        peft.determine_num_pages(req(9))


def test_rejects_negative_sizes():
    with pytest.raises(ValueError):
        PeftCacheManager(-1, 4)
    with pytest.raises(ValueError):
        PeftCacheManager(4, -1)
    with pytest.raises(ValueError):
        PeftCacheManager(4, {1: -2})

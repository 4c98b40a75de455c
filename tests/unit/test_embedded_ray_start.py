"""start_embedded: a failed embedded-cluster start is torn down and retried once. The init passed
in stands for ray.init: it starts a child process and then fails, as a head start whose
dashboard aborted does."""
from __future__ import annotations

import subprocess

import pytest

from pdserve.cluster.launch import start_embedded


class FlakyInit:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[dict] = []
        self.children: list[subprocess.Popen] = []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            # a half-started head: a process is up when the start fails
            self.children.append(subprocess.Popen(["sleep", "60"]))
            raise Exception("Failed to read dashboard.err file: [Errno 2] No such file")


def test_a_failed_start_is_torn_down_and_retried_once() -> None:
    bystander = subprocess.Popen(["sleep", "60"])  # started before: not the start's to kill
    try:
        init = FlakyInit(failures=1)
        start_embedded(init, num_cpus=2, include_dashboard=True)
        assert init.calls == [{"num_cpus": 2, "include_dashboard": True}] * 2
        (child,) = init.children
        assert child.wait(timeout=10) == -9  # the half-started process was killed, not left
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_a_second_failure_is_raised() -> None:
    init = FlakyInit(failures=2)
    with pytest.raises(Exception, match="dashboard.err"):
        start_embedded(init, num_cpus=2)
    assert len(init.calls) == 2
    assert [c.wait(timeout=10) for c in init.children] == [-9, -9]


def test_a_first_success_starts_once() -> None:
    init = FlakyInit(failures=0)
    start_embedded(init, num_cpus=2)
    assert len(init.calls) == 1 and init.children == []

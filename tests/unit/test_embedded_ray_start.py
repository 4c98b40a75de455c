"""ensure_ray: a failed embedded-cluster start is torn down and retried once (no real Ray here:
ray.init is replaced by one that starts a child process and then fails, as a head start whose
dashboard aborted does)."""
from __future__ import annotations

import subprocess

import pytest
import ray

from pdserve.cluster import launch


class FlakyInit:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.children: list[subprocess.Popen] = []

    def __call__(self, **kwargs) -> None:
        self.calls += 1
        assert kwargs["include_dashboard"] and kwargs["dashboard_host"] == "127.0.0.1"
        if self.calls <= self.failures:
            # a half-started head: a process is up when the start fails
            self.children.append(subprocess.Popen(["sleep", "60"]))
            raise Exception("Failed to read dashboard.err file: [Errno 2] No such file")


@pytest.fixture
def fake_ray(monkeypatch):
    def install(failures: int) -> FlakyInit:
        init = FlakyInit(failures)
        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        return init
    return install


def test_a_failed_start_is_torn_down_and_retried_once(fake_ray):
    init = fake_ray(failures=1)
    assert launch.ensure_ray(num_cpus=2) is True
    assert init.calls == 2
    (child,) = init.children
    assert child.wait(timeout=10) == -9  # the half-started process was killed, not left behind


def test_a_second_failure_is_raised(fake_ray):
    init = fake_ray(failures=2)
    with pytest.raises(Exception, match="dashboard.err"):
        launch.ensure_ray(num_cpus=2)
    assert init.calls == 2
    assert [c.wait(timeout=10) for c in init.children] == [-9, -9]

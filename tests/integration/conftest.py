"""Fixtures shared by the cluster tests: a Ray instance per test module (started here, stopped
here, never anyone else's), the built-in model, and ``clusters``, one pdserve cluster at a time
relaunched when a test asks for other settings."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from pdserve.cluster.launch import ensure_ray

    owns = ensure_ray(num_cpus=8)
    yield
    if owns:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir():
    from pdserve.cluster.launch import builtin_model_dir

    return builtin_model_dir()


@pytest.fixture
def cluster(ray_cluster, model_dir):
    """``launch(**launch kwargs)``: a fresh cluster for this test (fault and chaos tests need
    one that has served nothing and that they may break); all are shut down after it."""
    import cluster_util as U

    started = []

    def launch(**kwargs):
        cl = U.start_cluster(model_dir, **kwargs)
        started.append(cl)
        return cl

    yield launch
    for cl in started:
        cl.shutdown()


@pytest.fixture(scope="module")
def clusters(ray_cluster, model_dir):
    """``get(**launch kwargs)``: the running cluster if it was launched with the same settings,
    else a new one (one pdserve cluster per Ray at a time: actor names are fixed)."""
    import cluster_util as U

    held: dict = {}

    def get(**kwargs):
        key = repr(sorted(kwargs.items()))
        if held.get("key") != key:
            if held.get("cluster") is not None:
                held.pop("cluster").shutdown()
            held["cluster"] = U.start_cluster(model_dir, **kwargs)
            held["key"] = key
        return held["cluster"]

    yield get
    if held.get("cluster") is not None:
        held["cluster"].shutdown()

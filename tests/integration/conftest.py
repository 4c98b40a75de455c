"""Fixtures shared by the cluster tests: a Ray instance (started here, stopped here, never anyone
else's), the built-in model, and ``clusters``, one pdserve cluster at a time relaunched when a
test asks for other settings.

Consecutive modules share one Ray instance (starting one costs seconds): the modules that use
``ray_cluster`` run one after another (their order among themselves kept), and the instance is
stopped after the last of them, or as soon as a module leaves anything in it (a named actor, a
CPU not given back), so every module starts on a Ray holding nothing of another's. A module
that reads Ray-wide figures (Ray's metrics endpoint, the dashboard's task list) or sets Ray's
settings before it starts declares ``OWN_RAY = True`` and gets a Ray of its own."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

NUM_CPUS = 8
_HERE = Path(__file__).resolve().parent
# The Ray this session started for the modules that share one, and the modules' order.
_shared: dict = {"up": False, "order": [], "sharing": set()}


def _own_ray(module) -> bool:
    return bool(getattr(module, "OWN_RAY", False))


def _sharing_modules(items) -> set:
    """The modules (under this folder) of which a test uses ``ray_cluster`` and that do not ask
    for a Ray of their own."""
    return {item.module for item in items
            if _HERE in Path(str(item.path)).parents and item.module is not None
            and "ray_cluster" in item.fixturenames and not _own_ray(item.module)}


def pytest_collection_modifyitems(session, config, items):
    """The modules that share Ray, one after another where the first of them was (each module's
    tests stay together and in their order)."""
    sharing = _sharing_modules(items)
    if not sharing:
        return
    moved = [item for item in items if item.module in sharing]
    first = items.index(moved[0])
    rest = [item for item in items if item.module not in sharing]
    items[:] = rest[:first] + moved + rest[first:]


def pytest_collection_finish(session):
    order: list = []  # the modules, in the order they run
    for item in session.items:
        if item.module is not None and (not order or order[-1] is not item.module):
            order.append(item.module)
    _shared["order"] = order
    _shared["sharing"] = _sharing_modules(session.items)


def _holds_nothing(timeout_s: float = 30.0) -> bool:
    """No named actor left and every CPU free again (a killed actor's CPU comes back a moment
    later)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        named = ray.util.list_named_actors(all_namespaces=True)
        free = ray.available_resources().get("CPU", 0.0)
        if not named and free >= ray.cluster_resources().get("CPU", 0.0) == NUM_CPUS:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def _stop_shared() -> None:
    import ray

    if _shared["up"]:
        _shared["up"] = False
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request):
    import ray

    from pdserve.cluster.launch import ensure_ray

    module = request.module
    shares = module in _shared["sharing"]
    if _shared["up"] and not shares:
        _stop_shared()
    owns = ensure_ray(num_cpus=NUM_CPUS)
    if shares and owns:
        _shared["up"] = True
    yield
    if _shared["up"]:
        order = _shared["order"]
        at = order.index(module) if module in order else len(order)
        next_shares = at + 1 < len(order) and order[at + 1] in _shared["sharing"]
        if not (next_shares and _holds_nothing()):
            _stop_shared()
    elif owns:
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

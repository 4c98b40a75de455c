"""Start or join a Ray cluster and bring pdserve up on it: a placement group for the workers
(pack or spread), named worker actors (``pdserve-ctx-<i>``, ``pdserve-gen-<i>``) on GPUs where
there are GPUs, and the router actor (``pdserve-router``) serving gRPC.

Ray binds to 127.0.0.1 when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set (the embedded default
sets it). Shutting down kills only pdserve's own actors, never the Ray cluster it joined.

Workers restart: a worker that dies is restarted by Ray (``max_restarts``) in its placement
bundle; calls in flight on it fail (no task retries: the router decides what to retry), and the
router's status refresh sees the new incarnation and takes it back.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pdserve.workers.names import NAMESPACE, ROUTER_NAME, actor_name

from .router import RouterConfig

log = logging.getLogger("pdserve.launch")

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = None  # local HF-format directory; None: the built-in tiny model
    num_context_workers: int = 1
    num_generation_workers: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # engine kwargs for every worker
    context_engine: dict[str, Any] = field(default_factory=dict)  # overrides per role
    generation_engine: dict[str, Any] = field(default_factory=dict)
    router: RouterConfig = field(default_factory=RouterConfig)
    placement: str = "pack"  # or "spread"
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    torch_threads: int = 1
    metrics: bool = True
    stall_send_s: float = 0.0  # test hook for fault injection on the context workers
    max_restarts: int = 3  # per worker actor; -1: without limit
    # KV store connect and pair-group set-up. Pairs are set up before a worker reports healthy
    # and rebuilt in the background, so a generous bound costs no request any latency.
    connect_timeout_s: float = 30.0
    # KV requests over the direct worker-to-worker link as well as Ray (transport/kv_link.py);
    # off: Ray alone carries them (one actor call on every transfer's critical path)
    kv_link: bool = True

    def __post_init__(self) -> None:
        if self.num_generation_workers < 1:
            raise ValueError("num_generation_workers must be >= 1")
        if self.num_context_workers < 0:
            raise ValueError("num_context_workers must be >= 0")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"placement must be pack or spread, got {self.placement!r}")


def builtin_model_dir() -> Path:
    """The built-in tiny model: written once (deterministically) into a cache folder."""
    from pdserve.workers.tiny_model import make_tiny_model

    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    # The name changes whenever what make_tiny_model writes changes (-chat: the chat template).
    path = root / "tiny-llama-h128-l4-v259-chat"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        vocab_size=259, max_position_embeddings=2048, seed=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; theirs is identical
            pass
    return path


def client_auth_env() -> None:
    """Ray 2.60 turns token auth on for local clusters it starts, but a driver joining an
    existing cluster only sends the token in token mode: enable it when a token is at hand."""
    if os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").exists():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Connect to ``address`` or start an embedded local cluster. Returns True when this call
    started Ray (the caller then owns it and may ``ray.shutdown()``)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray runs worker processes at nice 15 by default: a restarting worker then imports torch
    # at the back of the queue behind any busy process (measured on 2 busy cores: 25-44 s
    # from kill to healthy, 4-6 s at nice 0; bench/recovery.py).
    os.environ.setdefault("RAY_worker_niceness", "0")
    if address:
        client_auth_env()
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    # address="local": always a new cluster of our own, even while another one started by
    # `ray start` (or ray.cluster_utils) runs on this host, which ray.init would join instead.
    start_embedded(ray.init, address="local", namespace=NAMESPACE, num_cpus=num_cpus,
                   include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
    return True


def start_embedded(init: Callable[..., Any], **kwargs: Any) -> None:
    """``init(**kwargs)`` (``ray.init`` for a local cluster), retried once after a failure.

    Starting the head processes can fail transiently: Ray forks them with a ``preexec_fn``, and
    from a driver with many threads the child can abort before exec (seen: "Failed to start the
    dashboard, return code -6", about once in 15 starts in a test process that had run several
    clusters). A failed start is torn down, its processes (this process's new descendants)
    killed, so it neither leaks a half-started cluster nor fails the caller for nothing."""
    for attempt in (1, 2):
        before = _descendants()
        try:
            init(**kwargs)
            return
        except Exception as exc:
            _kill(_descendants() - before)
            if attempt == 2:
                raise
            log.warning("starting the embedded Ray cluster failed (%s); retrying once",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _descendants() -> set[int]:
    """PIDs of this process's descendants (from /proc; empty where there is no /proc)."""
    parent_of: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command name (field 2) is in parentheses and may hold spaces
                parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Cluster:
    router: Any
    workers: dict[str, Any]
    port: int
    model_dir: Path
    placement_group: Any
    http_port: int | None = None  # the OpenAI-compatible front door, when launched with one
    router_config: Any = None  # the RouterConfig it was launched with (restart_router reuses it)
    metrics: bool = True

    def restart_router(self, *, kill: bool = True) -> int:
        """Replace the router: kill it (as a crash would, when ``kill``) and start a new one on
        the same workers, which are left running. Their request channels to the old router
        closed with it, so every request it held was aborted there and its leased KV goes back
        when the lease runs out. Returns the new gRPC port (the configured one, if fixed)."""
        import ray

        if kill:
            ray.kill(self.router, no_restart=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # the name is free once Ray has the old actor dead
            try:
                ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the old router actor {ROUTER_NAME} did not go away")
            time.sleep(0.1)
        self.router, self.port, self.http_port = _start_router(
            self.router_config, self.workers, self.model_dir, self.metrics)
        return self.port

    def shutdown(self) -> None:
        import ray

        try:
            ray.get(self.router.stop.remote(), timeout=30)
        except Exception:
            pass
        for handle in [self.router, *self.workers.values()]:
            try:
                ray.kill(handle)
            except Exception:
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)


def launch(cfg: LaunchConfig) -> Cluster:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.cluster.metrics import WorkerMetrics
    from pdserve.workers.context_worker import ContextWorker
    from pdserve.workers.generation_worker import GenerationWorker

    model_dir = Path(cfg.model) if cfg.model else builtin_model_dir()
    use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    roles = [("ctx", i, ContextWorker, cfg.context_engine) for i in range(cfg.num_context_workers)]
    roles += [("gen", i, GenerationWorker, cfg.generation_engine) for i in range(cfg.num_generation_workers)]
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in roles],
                         strategy="PACK" if cfg.placement == "pack" else "SPREAD",
                         name="pdserve-workers")
    ray.get(pg.ready(), timeout=READY_TIMEOUT_S)

    workers: dict[str, Any] = {}
    for index, (prefix, i, cls, overrides) in enumerate(roles):
        worker_id = f"{prefix}-{i}"
        engine = {**cfg.engine, **overrides}
        if use_gpu:
            engine.setdefault("device", "cuda")
        options = dict(
            name=actor_name(worker_id), namespace=NAMESPACE, max_restarts=cfg.max_restarts,
            max_task_retries=0,
            # Ray records which log lines each actor task wrote, so a kv_transfer row in the
            # dashboard's task table links to its own line (duration, GB/s, outcome).
            runtime_env={"env_vars": {"RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING": "1"}},
            max_concurrency=256, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        )
        kwargs = dict(lease_s=cfg.lease_s, transfer_timeout_s=cfg.transfer_timeout_s,
                      torch_threads=cfg.torch_threads,
                      metrics=WorkerMetrics if cfg.metrics else None,
                      connect_timeout_s=cfg.connect_timeout_s, kv_link=cfg.kv_link)
        if prefix == "ctx":
            kwargs["stall_send_s"] = cfg.stall_send_s
        workers[worker_id] = cls.options(**options).remote(worker_id, str(model_dir), engine, **kwargs)
    router, port, http_port = _start_router(cfg.router, workers, model_dir, cfg.metrics)
    log.info("pdserve up: %d context, %d generation workers, gRPC on %s:%d%s",
             cfg.num_context_workers, cfg.num_generation_workers, cfg.router.host, port,
             f", HTTP on {cfg.router.http_host}:{http_port}" if http_port is not None else "")
    return Cluster(router, workers, port, model_dir, pg, http_port, cfg.router, cfg.metrics)


def _start_router(router_cfg: Any, workers: dict[str, Any], model_dir: Path,
                  metrics: bool) -> tuple[Any, int, int | None]:
    """The router actor, started on ``workers`` (their current infos). Returns (handle, gRPC
    port, HTTP port or None) once it serves: every worker heard and ready, or its wait over."""
    import ray

    from pdserve.cluster.router_actor import RouterActor

    infos = dict(zip(workers, ray.get([w.info.remote() for w in workers.values()],
                                      timeout=READY_TIMEOUT_S)))
    http = (f", HTTP {router_cfg.http_host}:{router_cfg.http_port or 'any'}"
            if router_cfg.http_port is not None else "")
    router = RouterActor.options(name=ROUTER_NAME, namespace=NAMESPACE, num_cpus=0).remote(
        f"gRPC {router_cfg.host}:{router_cfg.port or 'any'}{http}")
    port = ray.get(router.start.remote(dataclasses.asdict(router_cfg), infos, str(model_dir),
                                       metrics), timeout=READY_TIMEOUT_S)
    http_port = ray.get(router.http_port.remote(), timeout=READY_TIMEOUT_S)
    return router, port, http_port


def shutdown_all(namespace: str = NAMESPACE) -> list[str]:
    """Kill every pdserve actor in ``namespace`` (and nothing else). Returns their names.
    Uses the GCS's named-actor list, so it needs no dashboard."""
    import ray

    killed = []
    names = sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                   if e["namespace"] == namespace and e["name"].startswith("pdserve-"))
    # The router last: a `pdserve launch` in the foreground leaves (and stops the Ray cluster it
    # started) once its router is gone, so everything else must be done by then.
    names.sort(key=lambda n: n == ROUTER_NAME)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
            killed.append(name)
        except ValueError:  # gone meanwhile
            pass
    return killed

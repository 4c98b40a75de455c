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

from pdserve.workers.process.names import NAMESPACE, ROUTER_NAME, actor_name

from .actors import kill_actors, pdserve_actor_names

from .placement import (LaunchError, check_worker_groups, node_memory_shortfalls, place_workers,
                        workers_per_node)
from .router import RouterConfig

log = logging.getLogger("pdserve.launch")

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = None  # local HF-format directory or Hub repo id; None: the built-in tiny model
    num_context_workers: int = 1
    num_generation_workers: int = 1
    engine: dict[str, Any] = field(default_factory=dict)  # engine kwargs for every worker
    context_engine: dict[str, Any] = field(default_factory=dict)  # overrides per role
    generation_engine: dict[str, Any] = field(default_factory=dict)
    router: RouterConfig = field(default_factory=RouterConfig)
    placement: str = "pack"  # or "spread"
    lease_s: float = 30.0
    transfer_timeout_s: float = 30.0
    # torch (OpenMP) threads per worker: a count, or "auto": the node's CPUs shared evenly by
    # the pdserve workers placed on it (a colocated worker on the 2-core VM: 2; 1P1D: 1 each).
    torch_threads: int | str = "auto"
    metrics: bool = True
    stall_send_s: float = 0.0  # test hook for fault injection on the context workers
    max_restarts: int = 3  # per worker actor; -1: without limit
    # KV store connect and pair-group set-up. Pairs are set up before a worker reports healthy
    # and rebuilt in the background, so a generous bound costs no request any latency.
    connect_timeout_s: float = 30.0
    # KV requests over the direct worker-to-worker link as well as Ray (transport/kv_link.py);
    # off: Ray alone carries them (one actor call on every transfer's critical path)
    kv_link: bool = True
    # Extra Ray resources each worker's placement bundle asks for, per role: pins a role to the
    # nodes that offer them (``ray start --resources '{"prefill_node": 8}'``), so context and
    # generation workers can live on different node types.
    context_resources: dict[str, float] = field(default_factory=dict)
    generation_resources: dict[str, float] = field(default_factory=dict)
    # How long the workers' placement group may take to be placed (an autoscaler adding nodes
    # included) before the launch fails.
    placement_timeout_s: float = READY_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.num_generation_workers < 1:
            raise ValueError("num_generation_workers must be >= 1")
        if self.num_context_workers < 0:
            raise ValueError("num_context_workers must be >= 0")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"placement must be pack or spread, got {self.placement!r}")
        if self.torch_threads != "auto" and (not isinstance(self.torch_threads, int)
                                             or isinstance(self.torch_threads, bool) or self.torch_threads < 1):
            raise ValueError(f"torch_threads must be an integer >= 1 or 'auto', got {self.torch_threads!r}")
        for name in ("context_resources", "generation_resources"):
            check_resources(name, getattr(self, name))


def check_resources(name: str, value: Any) -> None:
    """A per-role resource request: a mapping of resource names to non-negative numbers. CPU
    and GPU are pdserve's own (one of each per worker, GPU where the cluster has GPUs)."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping of Ray resource names to amounts, got {value!r}")
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{name}: resource names must be non-empty strings, got {key!r}")
        if key in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{name}: {key!r} is set by pdserve (one CPU, and one GPU where "
                             "there are GPUs, per worker); name a custom resource instead")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
            raise ValueError(f"{name}: {key!r} must be a number >= 0, got {amount!r}")


def builtin_model_dir() -> Path:
    """The built-in tiny model: written once (deterministically) into a cache folder."""
    from pdserve.workers.loading.tiny_model import BUILTIN_MODEL_NAME, write_builtin_model

    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return write_builtin_model(root / BUILTIN_MODEL_NAME)


def launch_model(model: str | None) -> tuple[Path, str, str | None]:
    """(the model directory on this node, what each worker is given, the commit it pins).
    A local directory, or a path that looks like none of the Hub's names, goes to the workers as
    it is (each checks it on its node). A Hub repo id (``ORG/NAME``) is resolved here, through
    this node's Hugging Face cache (downloading unless HF_HUB_OFFLINE=1), for the router; the
    workers get the name and the commit found here, and resolve it from their own node's cache,
    so every worker loads the same snapshot. Raises ``hub.ModelResolveError``."""
    from pdserve.workers.loading.hub import is_repo_id, resolve_model

    if model is None:
        path = builtin_model_dir()
        return path, str(path), None
    if Path(model).expanduser().is_dir() or not is_repo_id(model.partition("@")[0]):
        return Path(model), model, None
    resolved = resolve_model(model)
    return resolved.path, model, resolved.commit


class RayJoinError(RuntimeError):
    """Joining a Ray cluster failed for a reason the user fixes; the message says how."""


AUTH_DOCS = "https://docs.ray.io/en/latest/ray-security/token-auth.html"
# A cheap GCS method every client calls first; with token auth on, the GCS answers it (like
# every method) UNAUTHENTICATED unless the call carries the cluster's token.
_PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"


def probe_gcs(gcs_address: str, token: str | None = None, timeout_s: float = 10.0) -> str:
    """What the cluster's GCS at ``gcs_address`` (host:port) says to one call carrying
    ``token`` (or none): "ok", or "unauthenticated" (token auth is on and the token is missing
    or not the cluster's). Raises ``RayJoinError`` when nothing answers there."""
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(gcs_address) as channel:
        call = channel.unary_unary(_PROBE_METHOD, request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        try:
            call(b"", timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return "unauthenticated"
            raise RayJoinError(f"no Ray cluster answers at {gcs_address} ({exc.code().name}: "
                               f"{exc.details()}); is `ray start` running there?") from None
    return "ok"


def _ray_token() -> tuple[str | None, str]:
    """The token Ray itself would send from this process, and where it comes from. Ray's own
    loader reads RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token."""
    where = ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else
             f"the file {os.environ['RAY_AUTH_TOKEN_PATH']} (RAY_AUTH_TOKEN_PATH)"
             if os.environ.get("RAY_AUTH_TOKEN_PATH") else "~/.ray/auth_token")
    try:
        from ray._raylet import AuthenticationTokenLoader

        loader = AuthenticationTokenLoader.instance()
        loader.reset_cache()  # the environment may have changed since it last looked
        if not loader.has_token(ignore_auth_mode=True):
            return None, where
        token = loader.get_raw_token(ignore_auth_mode=True)
        return (token.strip() or None) if isinstance(token, str) else None, where
    except (ImportError, AttributeError):  # a Ray without token auth
        return None, where


def use_token_auth() -> None:
    """Token mode for this process and what it starts, as Ray's own ``ray.init`` does for a
    local cluster: the variable, then the cached config re-read so this process sees it."""
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):
        pass


def prepare_ray_auth(address: str) -> None:
    """Detect the auth mode of the Ray cluster at ``address`` (host:port, or "auto") and set
    this process up to join it. Ray 2.60 sends its token only in token mode, and turns that on
    by itself only for a cluster it finds with "auto"; a driver that joins a token cluster
    without it fails later and obscurely ("Actor creation cancelled"). So: ask the GCS, and
    either turn token mode on with the token Ray finds here, or fail now saying what to set."""
    if address.startswith("ray://"):
        return  # Ray Client: its own connection, nothing to detect here
    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die

        gcs_address = canonicalize_bootstrap_address_or_die(address)
    except (ImportError, ValueError, ConnectionError) as exc:
        raise RayJoinError(f"no Ray cluster found at --address {address}: {exc}") from None
    if probe_gcs(gcs_address) == "ok":
        return  # token auth off there: join as is
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        raise RayJoinError(
            f"the Ray cluster at {gcs_address} has token authentication on, but RAY_AUTH_MODE="
            f"{mode} is set here: unset it or set RAY_AUTH_MODE=token ({AUTH_DOCS})")
    token, where = _ray_token()
    if token is None:
        raise RayJoinError(
            f"the Ray cluster at {gcs_address} has token authentication on and this machine has "
            "no token: set RAY_AUTH_TOKEN to the cluster's token (print it on the head node with "
            "`ray get-auth-token`), or write it to ~/.ray/auth_token, or name the file in "
            f"RAY_AUTH_TOKEN_PATH ({AUTH_DOCS})")
    if probe_gcs(gcs_address, token) != "ok":
        raise RayJoinError(
            f"the Ray cluster at {gcs_address} refuses the token from {where}: it is not that "
            "cluster's token (print the right one on the head node with `ray get-auth-token`)")
    use_token_auth()


def join_ray(address: str) -> None:
    """``ray.init`` on the existing cluster at ``address``, its auth mode detected first
    (``prepare_ray_auth``). Every command that joins a cluster goes through here."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    prepare_ray_auth(address)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Connect to ``address`` or start an embedded local cluster. Returns True when this call
    started Ray (the caller then owns it and may ``ray.shutdown()``)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray runs worker processes at nice 15 by default: a restarting worker then imports torch
    # at the back of the queue behind any busy process (measured on 2 busy cores: 25-44 s
    # from kill to healthy, 4-6 s at nice 0; benchmarks/recovery.py).
    os.environ.setdefault("RAY_worker_niceness", "0")
    if address:
        join_ray(address)
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
    placement_groups: list[Any]  # the shared one, and one per worker group (TP > 1)
    http_port: int | None = None  # the OpenAI-compatible front door, when launched with one
    router_config: Any = None  # the RouterConfig it was launched with (restart_router reuses it)
    metrics: bool = True
    model_name: str | None = None  # the model as given (a Hub repo id, or the directory)

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
        from ray.util.placement_group import remove_placement_group

        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception:
                pass


# The worker actors' environment.
WORKER_ENV = {
    # Ray records which log lines each actor task wrote, so a kv_transfer row in the dashboard's
    # task table links to its own line (duration, GB/s, outcome).
    "RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING": "1",
    # glibc gives each thread that mallocs an arena of its own (up to 8 per core), and freed
    # memory stays in them: every KV transfer touches a Ray call thread, a pair thread and
    # Ray's own, so a generation worker's RSS grew with every transfer (measured: 986 MiB after
    # 24,000 transfers, still growing; malloc_trim gave most of it back and no Python object
    # grew). With two arenas: 453 MiB after the same 24,000 (benchmarks/worker_memory.py).
    "MALLOC_ARENA_MAX": "2",
    # OpenMP threads sleep as soon as a parallel region ends instead of spinning for it (GNU
    # OpenMP's default spins): between a worker's regions its idle threads would otherwise hold
    # the cores the router, the HTTP clients and the worker's own channel threads need. On the
    # 2-core VM a colocated worker on 2 threads, vs vLLM at 4 streams: output 0.84x and TPOT
    # p50 0.77x spinning, 1.02x and 0.90x passive (docs/benchmarks.md section 20). A policy set
    # in the launching environment wins.
    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
}
# Where a worker finds a model named by Hub repo id: this process's settings travel to the
# workers (on a joined cluster they would otherwise have those `ray start` had). Tokens do not:
# a runtime env is shown on the dashboard; each node logs in (or sets HF_TOKEN) itself.
HUB_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE",
                "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT")


def worker_env() -> dict[str, str]:
    """The worker actors' environment: WORKER_ENV plus the Hub settings set here."""
    return {**WORKER_ENV, **{k: os.environ[k] for k in HUB_ENV_VARS if os.environ.get(k)}}


def launch(cfg: LaunchConfig) -> Cluster:
    """Place the workers, start them and the router. A launch that fails midway removes the
    actors and the placement group it created before it raises ``LaunchError``."""
    created: dict[str, Any] = {}  # name -> actor handle, in creation order
    pg_box: list[Any] = []
    try:
        return _launch(cfg, created, pg_box)
    except BaseException as exc:
        removed = _remove_created(created, pg_box)
        if not isinstance(exc, Exception):  # Ctrl-C: cleaned up, and still an interrupt
            raise
        why = _failure_reason(exc)
        raise LaunchError(f"pdserve launch failed: {why} (removed what it had created: "
                          f"{', '.join(removed) or 'nothing'})") from exc


def _failure_reason(exc: BaseException) -> str:
    """One readable reason. A worker's constructor error travels inside Ray's actor-death
    message, after a traceback: the line naming the worker's own error is the reason."""
    if isinstance(exc, LaunchError):
        return str(exc)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    marked = [ln for ln in lines if "ModelDirMissing" in ln]
    return (marked[-1] if marked else lines[-1] if lines else type(exc).__name__)[:2000]


def _remove_created(created: dict[str, Any], pg_box: list[Any]) -> list[str]:
    import ray

    removed = []
    for name, handle in reversed(list(created.items())):
        try:
            ray.kill(handle, no_restart=True)
            removed.append(name)
        except Exception:
            pass
    from ray.util.placement_group import remove_placement_group

    for pg, name in pg_box:
        try:
            remove_placement_group(pg)
            removed.append(f"placement group {name}")
        except Exception:
            pass
    return removed


def _launch(cfg: LaunchConfig, created: dict[str, Any], pg_box: list[Any]) -> Cluster:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pdserve.cluster.metrics import WorkerMetrics
    from pdserve.workers.process.context_worker import ContextWorker
    from pdserve.workers.process.generation_worker import GenerationWorker

    model_dir, worker_model, model_commit = launch_model(cfg.model)
    router_cfg = cfg.router
    if model_commit is not None and router_cfg.served_model_name is None:
        # vLLM serves a Hub model under the name it was given, not its snapshot folder's
        router_cfg = dataclasses.replace(router_cfg, served_model_name=cfg.model)
    use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    roles = [("ctx", i, ContextWorker, cfg.context_engine, cfg.context_resources)
             for i in range(cfg.num_context_workers)]
    roles += [("gen", i, GenerationWorker, cfg.generation_engine, cfg.generation_resources)
              for i in range(cfg.num_generation_workers)]
    base = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    tp_sizes = [int({**cfg.engine, **overrides}.get("tensor_parallel_size") or 1)
                for _, _, _, overrides, _ in roles]
    check_worker_groups(cfg, roles, tp_sizes, model_dir, use_gpu)
    placed = place_workers(cfg, roles, tp_sizes, base, pg_box)

    # Workers that load together on one node must fit its memory together: refused here, before
    # any of them loads (each worker's own check sees only what the node has when it starts).
    short = node_memory_shortfalls(cfg, roles, tp_sizes, placed, model_dir, use_gpu)
    if short:
        raise LaunchError("; ".join(short))
    sharing = workers_per_node(placed, tp_sizes) if cfg.torch_threads == "auto" else [1] * len(roles)
    workers: dict[str, Any] = {}
    for index, (prefix, i, cls, overrides, _) in enumerate(roles):
        worker_id = f"{prefix}-{i}"
        engine = {**cfg.engine, **overrides}
        if cfg.torch_threads == "auto":  # and decode-sized steps on the measured best count
            engine.setdefault("small_step_threads", "auto")
        if use_gpu:
            engine.setdefault("device", "cuda")
        options = dict(
            name=actor_name(worker_id), namespace=NAMESPACE, max_restarts=cfg.max_restarts,
            max_task_retries=0,
            runtime_env={"env_vars": worker_env()},
            max_concurrency=256, num_cpus=base["CPU"], num_gpus=base.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placed[index][0], placement_group_bundle_index=placed[index][1],
                # the group's ranks (actors rank 0 creates) go to this worker's own bundles
                placement_group_capture_child_tasks=False),
        )
        kwargs = dict(lease_s=cfg.lease_s, transfer_timeout_s=cfg.transfer_timeout_s,
                      torch_threads=cfg.torch_threads, workers_on_node=sharing[index],
                      metrics=WorkerMetrics if cfg.metrics else None,
                      connect_timeout_s=cfg.connect_timeout_s, kv_link=cfg.kv_link,
                      builtin_model=cfg.model is None, model_commit=model_commit,
                      follower_env=worker_env())
        if prefix == "ctx":
            kwargs["stall_send_s"] = cfg.stall_send_s
        workers[worker_id] = cls.options(**options).remote(worker_id, worker_model, engine, **kwargs)
        created[actor_name(worker_id)] = workers[worker_id]
    router, port, http_port = _start_router(router_cfg, workers, model_dir, cfg.metrics,
                                            created=created)
    log.info("pdserve up: %d context, %d generation workers, gRPC on %s:%d%s",
             cfg.num_context_workers, cfg.num_generation_workers, cfg.router.host, port,
             f", HTTP on {cfg.router.http_host}:{http_port}" if http_port is not None else "")
    return Cluster(router, workers, port, model_dir, [pg for pg, _ in pg_box], http_port, router_cfg, cfg.metrics,
                   model_name=cfg.model or str(model_dir))


def _start_router(router_cfg: Any, workers: dict[str, Any], model_dir: Path,
                  metrics: bool, created: dict[str, Any] | None = None) -> tuple[Any, int, int | None]:
    """The router actor, started on ``workers`` (their current infos). Returns (handle, gRPC
    port, HTTP port or None) once it serves: every worker heard and ready, or its wait over.

    The router runs on this driver's node: its gRPC and HTTP ports are where `pdserve launch`
    says they are, it reads the model directory (tokenizer, chat template) this process has,
    and a lost worker node never takes it down."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pdserve.cluster.router_actor import RouterActor

    refs = {w: h.info.remote() for w, h in workers.items()}
    infos = {}
    for worker_id, ref in refs.items():  # one at a time, so a failure names its worker
        try:
            infos[worker_id] = ray.get(ref, timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"worker {worker_id} did not start within "
                              f"{READY_TIMEOUT_S:.0f} s") from None
        except ray.exceptions.RayError as exc:
            raise LaunchError(f"worker {worker_id} failed to start: {_failure_reason(exc)}") from exc
    http = (f", HTTP {router_cfg.http_host}:{router_cfg.http_port or 'any'}"
            if router_cfg.http_port is not None else "")
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    router = RouterActor.options(name=ROUTER_NAME, namespace=NAMESPACE, num_cpus=0,
                                 scheduling_strategy=here).remote(
        f"gRPC {router_cfg.host}:{router_cfg.port or 'any'}{http}")
    if created is not None:
        created[ROUTER_NAME] = router
    port = ray.get(router.start.remote(dataclasses.asdict(router_cfg), infos, str(model_dir),
                                       metrics), timeout=READY_TIMEOUT_S)
    http_port = ray.get(router.http_port.remote(), timeout=READY_TIMEOUT_S)
    return router, port, http_port


def shutdown_all(namespace: str = NAMESPACE) -> list[str]:
    """Kill every pdserve actor in ``namespace`` (and nothing else), the router last. Returns
    their names."""
    return kill_actors(pdserve_actor_names(namespace), namespace)

"""Where the time goes between a worker process dying and the restarted worker serving again.

Starts a local Ray cluster (this process owns it and shuts only it down), launches 1 context +
1 generation worker and the router as the integration tests do (``cluster_util.start_cluster``
settings: the test engine, ``RouterConfig(port=0)``; ``max_restarts``
is -1 here so that any number of repetitions can kill the same worker), warms up, then per
repetition SIGKILLs one worker's process and timestamps, relative to the kill (wall clock):

  raylet_noticed   the raylet's first log line about the dead worker (raylet.out)
  gcs_failed       the GCS marks the actor failed and starts the restart (gcs_server.out)
  gcs_restarting   the driver's first poll of the GCS actor table that shows it not ALIVE
  proc_spawned     the raylet forks the new worker process (raylet.out "Started worker
                   process with pid N"; /proc start time as a fallback)
  core_worker_up   the new process has imported ray and built its core worker (its
                   python-core-worker log: "Constructing CoreWorkerProcess")
  leased           the GCS got the worker lease and submits the actor creation task
  init_started     the new process starts the actor creation task ("Creating actor")
  init_done        the creation task (unpickling the class and args, __init__) finished
                   ("Actor creation task finished" in the new process's core-worker log)
  gcs_alive        the GCS marks the actor ALIVE (gcs_server.out)
  poll_alive       the driver's first poll of the actor table that shows ALIVE with a new pid
  first_ping       the first successful ``ping`` on the actor handle from this driver (each
                   call sent as soon as the previous one failed: as the router's info() is)
  ping_retrying    the answer to one ``ping`` sent once at gcs_restarting with
                   ``max_task_retries=-1`` (Ray retries it after the restart; measured: no
                   faster than first_ping)
  router_unhealthy the router's debug_state first shows the worker unhealthy (informational)
  router_rejoined  the router's debug_state counts the restart (``_reconnect`` saw a new
                   incarnation through ``info()`` over Ray and took the new endpoint)
  router_healthy   the router's debug_state shows it healthy again (a heartbeat on the new
                   channel)
  first_served     the first probe request that the restarted worker served completed

Probe requests (4 tokens, greedy) are started every ``--probe-interval`` seconds all along (at
most 8 in flight), so "served" means what a client would see; for a context worker "served by
it" means the response names it as ``ctx_worker`` (its prefill), for a generation worker as
``gen_worker``.

Then ``--init-reps`` throwaway actors per role (the workers' runtime_env, outside the placement
group), each a fresh process, time what a worker's ``__init__`` consists of: imports (torch,
pdserve's worker modules, torch.distributed), model load, KV pool, transport setup (TCPStore /
receiver), core, metrics, host and request channel. A real ``ContextWorker`` actor is also
cold-started with and without that runtime_env (submission to ``info()`` answering).

Run: ``.venv/bin/python benchmarks/recovery.py [--reps 3] [--json out.json]``. Conditions to compare:
``--load N`` (N longer requests in flight all along), ``--hog N`` (N busy-loop processes at nice 0,
a loaded machine), ``--status-refresh S`` (the router's refresh period); Ray settings through the
environment, e.g. ``RAY_worker_niceness=0`` (Ray's default 15 puts workers below everything
else) or ``RAY_timeout_ms_task_wait_for_death_info=0`` (calls to a restarting actor fail at once).
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

# The same engine and launch settings as tests/integration/cluster_util.py (not imported: this
# is not a test).
ENGINE = dict(tokens_per_block=4, max_batch_size=64, max_num_tokens=128,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=8,
              num_kv_blocks=1024)
CONNECT_TIMEOUT_S = 30.0  # launch default
RAY_TIMEOUT_S = 60.0
RECOVERY_TIMEOUT_S = 120.0  # one repetition gives up after this long without first_served

MILESTONES = [
    "raylet_noticed", "gcs_failed", "gcs_restarting", "proc_spawned", "core_worker_up", "leased",
    "init_started", "init_done", "gcs_alive", "poll_alive", "first_ping", "ping_retrying",
    "router_unhealthy",
    "router_rejoined", "router_healthy", "first_served",
]
# The chain the phase table adds up (each phase: this milestone minus the previous one).
CHAIN = [
    ("gcs_failed", "kill -> GCS marks the actor failed"),
    ("proc_spawned", "-> raylet forks the new worker process"),
    ("core_worker_up", "-> python + `import ray` + core worker up"),
    ("init_started", "-> lease granted, creation task starts"),
    ("init_done", "-> actor __init__ (imports, model, KV, transport)"),
    ("gcs_alive", "-> GCS marks the actor ALIVE"),
    ("router_rejoined", "-> router sees the new incarnation (info())"),
    ("router_healthy", "-> first heartbeat on the new channel"),
    ("first_served", "-> first request served by that worker"),
]


# ----------------------------------------------------------------------------- log parsing

_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def _log_time(line: str) -> float | None:
    """Ray's C++ log lines start with a local-time stamp: '[2026-12-01 19:22:37,776 I ...'."""
    m = _TS.match(line)
    if not m:
        return None
    t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    return time.mktime(t.timetuple()) + int(m.group(2)) / 1000.0


def _first_after(path: Path, t0: float, *needles: str, slack_s: float = 0.05) -> float | None:
    """Time of the first line at or after ``t0`` (minus a little slack for the millisecond
    stamps) that contains every needle."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if all(n in line for n in needles):
                    t = _log_time(line)
                    if t is not None and t >= t0 - slack_s:
                        return t
    except OSError:
        return None
    return None


def _core_worker_log(logs: Path, pid: int) -> Path | None:
    found = glob.glob(str(logs / f"python-core-worker-*_{pid}.log"))
    return Path(found[0]) if found else None


def _worker_id_of(logs: Path, pid: int) -> str | None:
    path = _core_worker_log(logs, pid)
    if path is None:
        return None
    m = re.match(r"python-core-worker-([0-9a-f]+)_\d+\.log", path.name)
    return m.group(1) if m else None


def _proc_start_wall(pid: int) -> float | None:
    """Wall-clock start of a local process from /proc (10 ms resolution)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    boot = time.time() - uptime
    return boot + ticks / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- probes


class Prober:
    """Starts a small request every ``interval_s`` (at most ``max_inflight`` at a time) on an
    asyncio loop of its own thread, and records each outcome with wall-clock times."""

    def __init__(self, port: int, interval_s: float, max_inflight: int = 8,
                 max_tokens: int = 4, label: str = "probe") -> None:
        self.port = port
        self.interval_s = interval_s
        self.max_inflight = max_inflight
        self.max_tokens = max_tokens
        self.label = label
        self.results: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="bench-prober", daemon=True)
        self._rng = random.Random(7)
        self._ids = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        import grpc

        from pdserve.cluster.client import Client
        from pdserve.cluster.rpc import router_pb2_grpc

        inflight: set[asyncio.Task] = set()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)

            async def one(rid: str, prompt: list[int]) -> None:
                t0 = time.time()
                out = {"id": rid, "t0": t0, "ok": False, "ctx": "", "gen": "", "code": ""}
                req = Client.build_request(prompt, max_tokens=self.max_tokens, request_id=rid,
                                           temperature=0.0, ignore_eos=True)
                try:
                    async for delta in stub.Generate(req, timeout=30.0):
                        if delta.finish_reason:
                            out["ok"] = True
                            out["ctx"] = delta.timings.ctx_worker
                            out["gen"] = delta.timings.gen_worker
                except grpc.aio.AioRpcError as exc:
                    out["code"] = exc.code().name
                    out["details"] = (exc.details() or "")[:200]
                out["t1"] = time.time()
                self.results.append(out)

            while not self._stop.is_set():
                if len(inflight) < self.max_inflight:
                    self._ids += 1
                    prompt = [self._rng.randrange(3, 259) for _ in range(self._rng.randint(8, 24))]
                    task = asyncio.create_task(one(f"{self.label}-{self._ids}", prompt))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                await asyncio.sleep(self.interval_s)
            if inflight:
                await asyncio.wait(inflight, timeout=40)


# ----------------------------------------------------------------------------- one kill


def _actor_row(actor_id: str) -> dict:
    import ray._private.state as state

    return state.state.actor_table(actor_id) or {}


def kill_and_watch(cl, victim: str, prober: Prober, logs: Path, poll_s: float) -> dict:
    """SIGKILL ``victim``'s process and record every milestone (seconds after the kill)."""
    import ray

    handle = cl.workers[victim]
    actor_id = handle._actor_id.hex()
    old_pid = int(ray.get(handle.status.remote(), timeout=RAY_TIMEOUT_S)["pid"])
    old_worker_id = _worker_id_of(logs, old_pid)
    before = ray.get(cl.router.debug_state.remote(), timeout=RAY_TIMEOUT_S)
    restarts_before = before["restarts"].get(victim, 0)
    assert before["healthy"][victim], f"{victim} is not healthy before the kill"
    n_probes_before = len(prober.results)

    t_kill = time.time()
    os.kill(old_pid, signal.SIGKILL)
    seen: dict[str, float] = {}
    new_pid = None
    ping_ref = retry_ref = None
    out_notes: list[str] = []
    router_samples = 0

    def mark(name: str, t: float | None = None) -> None:
        if name not in seen:
            seen[name] = (t if t is not None else time.time()) - t_kill

    deadline = t_kill + RECOVERY_TIMEOUT_S
    while time.time() < deadline:
        # The GCS's actor table (direct GCS call; cheap).
        row = _actor_row(actor_id)
        st = row.get("State")
        if st and st != "ALIVE":
            mark("gcs_restarting")
        if st == "ALIVE" and row.get("Pid") and int(row["Pid"]) != old_pid:
            mark("poll_alive")
            new_pid = int(row["Pid"])
        # The driver's own call on the handle, never waited on here (a call to a restarting
        # actor may wait for it): a failed one is sent again.
        if "gcs_restarting" in seen and "first_ping" not in seen:
            if ping_ref is None:
                ping_ref = handle.ping.remote()
            elif ray.wait([ping_ref], timeout=0)[0]:
                try:
                    if ray.get(ping_ref) == "pong":
                        mark("first_ping")
                except Exception:
                    pass
                ping_ref = None
        if "gcs_restarting" in seen and "ping_retrying" not in seen:
            if retry_ref is None:
                retry_ref = handle.ping.options(max_task_retries=-1).remote()
            elif ray.wait([retry_ref], timeout=0)[0]:
                try:
                    ray.get(retry_ref)
                    mark("ping_retrying")
                except Exception as exc:
                    out_notes.append(f"retrying ping failed: {exc!r:.200}")
                    retry_ref = None
        # The router's view.
        try:
            ds = ray.get(cl.router.debug_state.remote(), timeout=5.0)
            router_samples += 1
            if not ds["healthy"].get(victim, True):
                mark("router_unhealthy")
            if ds["restarts"].get(victim, 0) > restarts_before:
                mark("router_rejoined")
                if ds["healthy"].get(victim):
                    mark("router_healthy")
        except Exception:
            pass
        # Probes served by the restarted worker.
        key = "ctx" if victim.startswith("ctx") else "gen"
        for r in prober.results[n_probes_before:]:
            if r["ok"] and r[key] == victim and r["t0"] > t_kill:
                # started after the kill and served by the worker: only the new process can
                # have served it; take the earliest completion.
                t = r["t1"] - t_kill
                if seen.get("first_served") is None or t < seen["first_served"]:
                    seen["first_served"] = t
        if all(k in seen for k in ("first_served", "router_healthy", "poll_alive",
                                   "first_ping", "ping_retrying")):
            break
        time.sleep(poll_s)

    probes = [r for r in prober.results[n_probes_before:] if r["t1"] > t_kill]
    ok_any = [r["t1"] - t_kill for r in probes if r["ok"]]
    out = {"victim": victim, "t_kill": t_kill, "old_pid": old_pid, "new_pid": new_pid,
           "router_samples": router_samples,
           "probes_failed": sum(1 for r in probes if not r["ok"] and r["t0"] < t_kill + seen.get("first_served", 1e9)),
           "probes_ok_elsewhere": sum(1 for r in probes if r["ok"] and r[("ctx" if victim.startswith("ctx") else "gen")] != victim),
           "first_ok_any": min(ok_any) if ok_any else None,
           "failure_codes": sorted({r["code"] for r in probes if not r["ok"]}),
           "notes": out_notes}
    # Ray's logs (flushed by now, or soon: give them a moment).
    time.sleep(1.0)
    raylet, gcs = logs / "raylet.out", logs / "gcs_server.out"
    if old_worker_id:
        t = _first_after(raylet, t_kill, old_worker_id[:16])
        if t is not None:
            mark("raylet_noticed", t)
    t = _first_after(gcs, t_kill, "Actor is failed on worker", actor_id)
    if t is not None:
        mark("gcs_failed", t)
    t = _first_after(gcs, t_kill, "Finished leasing worker", actor_id)
    if t is not None:
        mark("leased", t)
    t = _first_after(gcs, t_kill, "Actor created successfully", actor_id) or \
        _first_after(gcs, t_kill, "Actor creation task succeeded", actor_id)
    if t is not None:
        mark("gcs_alive", t)
    if new_pid is not None:
        t = _first_after(raylet, t_kill, f"Started worker process with pid {new_pid}")
        if t is None:
            t = _proc_start_wall(new_pid)
        if t is not None:
            mark("proc_spawned", t)
        cw = _core_worker_log(logs, new_pid)
        if cw is not None:
            for name, needle in (("core_worker_up", "Constructing CoreWorkerProcess"),
                                 ("init_started", "Creating actor"),
                                 ("init_done", "Actor creation task finished")):
                t = _first_after(cw, t_kill, needle)
                if t is not None:
                    mark(name, t)
    if new_pid is not None:
        try:
            out["new_nice"] = os.getpriority(os.PRIO_PROCESS, new_pid)
        except OSError:
            pass
    out["milestones"] = {k: seen.get(k) for k in MILESTONES}
    out["down_probes"] = len(probes)
    return out


def wait_quiet(cl, victim: str, idle: bool, timeout_s: float = 60.0) -> None:
    """Until the router sees every worker healthy (between repetitions) and, with ``idle``,
    holds no request other than the probes'."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ds = ray.get(cl.router.debug_state.remote(), timeout=RAY_TIMEOUT_S)
        if all(ds["healthy"].values()) and (not idle or ds["requests"] <= 8):
            return
        time.sleep(0.2)
    raise RuntimeError(f"cluster not quiet after restarting {victim}: {ds}")


# ----------------------------------------------------------------------------- __init__ parts


def _init_probe_class():
    import ray

    @ray.remote(num_cpus=1)
    class InitProbe:
        """A fresh worker process that does what a worker actor's __init__ does, timed."""

        def __init__(self) -> None:
            self.t_init = time.time()

        def started_at(self) -> float:
            return self.t_init

        def measure(self, role: str, model_dir: str, engine: dict) -> list[tuple[str, float]]:
            parts: list[tuple[str, float]] = []
            t = time.perf_counter()

            def lap(name: str) -> None:
                nonlocal t
                now = time.perf_counter()
                parts.append((name, now - t))
                t = now

            import torch
            lap("import torch")
            import importlib

            # What unpickling the actor class does in a restarted worker.
            importlib.import_module("pdserve.workers.process.context_worker")
            importlib.import_module("pdserve.workers.process.generation_worker")
            lap("import pdserve.workers (+ray_worker, engine, core)")
            from pdserve.cluster.metrics import WorkerMetrics
            lap("import pdserve.cluster.metrics (the metrics arg)")
            from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig
            lap("import transport (torch.distributed)")
            from pdserve.workers.engine import events
            from pdserve.workers.process.channel_server import RequestChannelServer
            from pdserve.workers.config import EngineConfig
            from pdserve.workers.engine.core import EngineCore
            from pdserve.workers.runner.model_runner import ModelRunner
            from pdserve.workers.process.host import Faults, WorkerHost
            from pdserve.transport.kv_pool import KVPool
            from pdserve.workers.loading.loader import load_model, resolve_dtype
            from pdserve.workers.process.names import actor_name
            from pdserve.workers.process.ray_worker import RayControlPlane
            from pdserve.workers.engine.transceiver import KVTransceiver
            torch.set_num_threads(1)
            events.route_to_stderr()
            config = EngineConfig.from_kwargs(engine)
            lap("config")
            device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
            dtype = resolve_dtype(config.dtype, device)
            loaded = load_model(model_dir, dtype=dtype, device=device)
            lap("load_model (weights + tokenizer)")
            mcfg = loaded.config
            pool = KVPool.for_model(mcfg, config.num_kv_blocks, config.tokens_per_block,
                                    dtype=loaded.model.dtype, device=device)
            lap("KV pool")
            worker_id = f"bench-{role}"
            if role == "context":
                sender = KVSender(worker_id, pool, config=TransportConfig(
                    default_timeout_s=30.0, connect_timeout_s=CONNECT_TIMEOUT_S))
                receiver = None
            else:
                sender = None
                receiver = KVReceiver(worker_id, pool, config=TransportConfig(
                    default_timeout_s=30.0, connect_timeout_s=CONNECT_TIMEOUT_S))
            transceiver = KVTransceiver(worker_id, sender=sender, receiver=receiver,
                                        lease_s=30.0, transfer_timeout_s=30.0)
            lap("transport (TCPStore / receiver) + transceiver")
            core = EngineCore(ModelRunner(loaded.model, pool), config,
                                  eos_token_ids=loaded.eos_token_ids, vocab_size=mcfg.vocab_size,
                                  max_seq_len=config.max_seq_len or mcfg.max_position_embeddings,
                                  transceiver=transceiver)
            lap("core")
            metrics = WorkerMetrics(role, actor_name(worker_id))
            lap("WorkerMetrics")
            host = WorkerHost(core, worker_id=worker_id, role=role, config=config,
                              control=RayControlPlane(30.0),
                              metrics=metrics, faults=Faults())
            channel = RequestChannelServer(host, host_address=ray.util.get_node_ip_address())
            lap("WorkerHost (loop thread, request channel)")
            host.info(mcfg.vocab_size)
            lap("info()")
            try:
                channel.close()
                host.stop(5.0)
            except Exception:
                pass
            return parts

    return InitProbe


def init_breakdown(model_dir: str, reps: int) -> dict:
    import ray

    InitProbe = _init_probe_class()
    runtime_env = {"env_vars": {"RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING": "1"}}
    out: dict[str, list] = {"context": [], "generation": [], "spawn_to_init_s": []}
    for i in range(reps):
        for role in ("context", "generation"):
            t_submit = time.time()
            probe = InitProbe.options(runtime_env=runtime_env).remote()
            t_init = ray.get(probe.started_at.remote(), timeout=RAY_TIMEOUT_S)
            out["spawn_to_init_s"].append(t_init - t_submit)
            out[role].append(ray.get(probe.measure.remote(role, model_dir, ENGINE),
                                     timeout=RAY_TIMEOUT_S))
            ray.kill(probe)
            time.sleep(0.5)
    return out


def cold_starts(model_dir: str, reps: int) -> dict:
    """A real ContextWorker actor started fresh (outside the placement group), submission to
    info(), with and without the workers' runtime_env."""
    import ray

    from pdserve.cluster.metrics import WorkerMetrics
    from pdserve.workers.process.context_worker import ContextWorker
    from pdserve.workers.process.names import NAMESPACE

    out: dict[str, list[float]] = {"with_runtime_env": [], "without_runtime_env": []}
    for i in range(reps):
        for label in out:
            opts = dict(name=f"pdserve-bench-cold-{label}-{i}", namespace=NAMESPACE,
                        max_restarts=0, max_task_retries=0, max_concurrency=256, num_cpus=1)
            if label == "with_runtime_env":
                opts["runtime_env"] = {"env_vars": {"RAY_ENABLE_RECORD_ACTOR_TASK_LOGGING": "1"}}
            t0 = time.time()
            actor = ContextWorker.options(**opts).remote(
                f"bench-cold-{i}", model_dir, ENGINE, lease_s=30.0, transfer_timeout_s=30.0,
                torch_threads=1, metrics=WorkerMetrics, connect_timeout_s=CONNECT_TIMEOUT_S)
            ray.get(actor.info.remote(), timeout=RAY_TIMEOUT_S)
            out[label].append(time.time() - t0)
            ray.kill(actor)
            time.sleep(0.5)
    return out


# ----------------------------------------------------------------------------- report


def _fmt(v) -> str:
    return "    -" if v is None else f"{v:5.2f}"


def _stats(values: list) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.median(vals), max(vals)


def report(runs: list[dict]) -> None:
    for victim in sorted({r["victim"] for r in runs}):
        rs = [r for r in runs if r["victim"] == victim]
        print(f"\n=== kill {victim}: {len(rs)} repetitions; seconds after the SIGKILL ===")
        print(f"{'milestone':<18} {'median':>6} {'max':>6}   per rep")
        for m in MILESTONES:
            vals = [r["milestones"].get(m) for r in rs]
            med, mx = _stats(vals)
            print(f"{m:<18} {_fmt(med):>6} {_fmt(mx):>6}   " + " ".join(_fmt(v) for v in vals))
        print(f"\n{'phase':<52} {'median':>6} {'max':>6}")
        prev = None
        for name, label in CHAIN:
            deltas = []
            for r in rs:
                ms = r["milestones"]
                a = 0.0 if prev is None else ms.get(prev)
                b = ms.get(name)
                deltas.append(None if a is None or b is None else b - a)
            med, mx = _stats(deltas)
            print(f"{label:<52} {_fmt(med):>6} {_fmt(mx):>6}")
            prev = name
        med, mx = _stats([r["milestones"].get("first_served") for r in rs])
        print(f"{'TOTAL kill -> first request served by it':<52} {_fmt(med):>6} {_fmt(mx):>6}")
        med, mx = _stats([r["milestones"].get("router_healthy") for r in rs])
        print(f"{'TOTAL kill -> healthy in the router':<52} {_fmt(med):>6} {_fmt(mx):>6}")
        med, mx = _stats([r["first_ok_any"] for r in rs])
        print(f"{'(first probe OK on any worker after the kill)':<52} {_fmt(med):>6} {_fmt(mx):>6}")
        print("probes failed per rep:", [r["probes_failed"] for r in rs],
              "codes:", sorted({c for r in rs for c in r["failure_codes"]}))


def report_init(parts: dict, cold: dict | None) -> None:
    print("\n=== a worker's __init__ in a fresh actor process (seconds; median / max) ===")
    med, mx = _stats(parts["spawn_to_init_s"])
    print(f"{'actor submit -> __init__ entered (process start)':<58} {_fmt(med)} {_fmt(mx)}")
    for role in ("context", "generation"):
        runs = parts[role]
        if not runs:
            continue
        print(f"-- {role}")
        names = [n for n, _ in runs[0]]
        total = []
        for k, name in enumerate(names):
            vals = [run[k][1] for run in runs]
            med, mx = _stats(vals)
            print(f"  {name:<56} {_fmt(med)} {_fmt(mx)}")
        total = [sum(v for _, v in run) for run in runs]
        med, mx = _stats(total)
        print(f"  {'total':<56} {_fmt(med)} {_fmt(mx)}")
    if cold:
        print("-- a real ContextWorker actor, submission -> info() answered")
        for label, vals in cold.items():
            med, mx = _stats(vals)
            print(f"  {label:<56} {_fmt(med)} {_fmt(mx)}")


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="kills per worker (default 3)")
    ap.add_argument("--victims", default="ctx-0,gen-0")
    ap.add_argument("--probe-interval", type=float, default=0.2)
    ap.add_argument("--poll", type=float, default=0.05, help="driver poll period, seconds")
    ap.add_argument("--init-reps", type=int, default=2,
                    help="fresh-process __init__ breakdowns per role (0: skip)")
    ap.add_argument("--cold-reps", type=int, default=1,
                    help="cold starts of a real actor with/without runtime_env (0: skip)")
    ap.add_argument("--num-cpus", type=int, default=8)
    ap.add_argument("--load", type=int, default=0,
                    help="also keep this many longer requests in flight all along (0: none)")
    ap.add_argument("--load-tokens", type=int, default=48)
    ap.add_argument("--status-refresh", type=float, default=None,
                    help="RouterConfig.status_refresh_s (default: the router's own, 0.5 s)")
    ap.add_argument("--hog", type=int, default=0,
                    help="busy-loop processes at nice 0 during the kills (a loaded machine)")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)

    import ray

    from pdserve.cluster.launch import LaunchConfig, builtin_model_dir, ensure_ray, launch
    from pdserve.cluster.router import RouterConfig

    model_dir = builtin_model_dir()  # the integration tests' model_dir fixture
    owns = ensure_ray(num_cpus=args.num_cpus)  # the ray_cluster fixture
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    print(f"Ray logs: {logs}", flush=True)
    import pdserve

    print(f"pdserve from {list(pdserve.__path__)} (driver); "
          f"RAY_worker_niceness={os.environ.get('RAY_worker_niceness', '(Ray default)')}", flush=True)
    cl = None
    prober = loader = None
    hogs: list = []
    runs: list[dict] = []
    parts = cold = None
    try:
        t0 = time.time()
        router = dataclasses.replace(RouterConfig(), port=0)
        if args.status_refresh is not None:
            router = dataclasses.replace(router, status_refresh_s=args.status_refresh)
        print(f"router status_refresh_s={router.status_refresh_s}, "
              f"status_timeout_s={router.status_timeout_s}", flush=True)
        cl = launch(LaunchConfig(model=str(model_dir), engine=ENGINE, router=router,
                                 connect_timeout_s=CONNECT_TIMEOUT_S, max_restarts=-1))
        print(f"cluster up in {time.time() - t0:.1f} s, gRPC port {cl.port}", flush=True)
        where = ray.get(cl.workers["gen-0"].__ray_call__.remote(
            lambda self: __import__("pdserve.workers.engine.offline", fromlist=["x"]).__file__),
            timeout=RAY_TIMEOUT_S)
        print(f"workers import pdserve from {where}", flush=True)
        prober = Prober(cl.port, args.probe_interval)
        prober.start()
        if args.load > 0:
            loader = Prober(cl.port, 0.02, max_inflight=args.load, max_tokens=args.load_tokens,
                            label="load")
            loader.start()
        time.sleep(3.0)  # warm-up: probes through both workers
        warm = [r for r in prober.results if r["ok"]]
        print(f"warm-up: {len(warm)}/{len(prober.results)} probes OK", flush=True)
        victims = [v.strip() for v in args.victims.split(",") if v.strip()]
        for _ in range(args.hog):
            hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        if hogs:
            print(f"{len(hogs)} CPU hog(s) at nice {os.getpriority(os.PRIO_PROCESS, 0)}: "
                  f"pids {[h.pid for h in hogs]}", flush=True)
        for rep in range(args.reps):
            for victim in victims:
                wait_quiet(cl, victim, idle=args.load == 0)
                time.sleep(1.0)
                r = kill_and_watch(cl, victim, prober, logs, args.poll)
                r["rep"] = rep
                runs.append(r)
                ms = r["milestones"]
                print(f"rep {rep} kill {victim}: alive {_fmt(ms['poll_alive'])} s, "
                      f"rejoined {_fmt(ms['router_rejoined'])} s, healthy {_fmt(ms['router_healthy'])} s, "
                      f"served {_fmt(ms['first_served'])} s (pid {r['old_pid']} -> {r['new_pid']}, "
                      f"nice {r.get('new_nice')})",
                      flush=True)
        for h in hogs:
            h.kill()
            h.wait()
        hogs = []
        prober.stop()
        prober = None
        if loader is not None:
            loader.stop()
            done = [r for r in loader.results if r["ok"]]
            print(f"background load: {len(done)}/{len(loader.results)} requests OK", flush=True)
            loader = None
        report(runs)
        if args.init_reps > 0:
            parts = init_breakdown(str(model_dir), args.init_reps)
        if args.cold_reps > 0:
            cold = cold_starts(str(model_dir), args.cold_reps)
        if parts is not None:
            report_init(parts, cold)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": runs, "init": parts, "cold": cold},
                                                  indent=1))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for p in (prober, loader):
            if p is not None:
                p.stop()
        if cl is not None:
            cl.shutdown()
        if owns:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

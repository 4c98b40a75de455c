"""The ``pdserve`` command line. Each subcommand imports its heavy modules lazily so that
``pdserve --help`` starts fast."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time

USAGE = """usage: pdserve COMMAND [ARGS]

commands:
  launch             start (or join) a Ray cluster and serve gRPC: context + generation workers, router
  generate           send one request to a running router and stream the answer
  status             print the cluster status (per worker: requests, KV blocks, transfers, pauses)
  top                live view of a running cluster: KV, requests, tokens/s, transfers, pauses, events
  shutdown           stop a pdserve cluster by its router's port (never the Ray cluster itself)
  demo               the main job on an embedded cluster: a trace burst over gRPC, then a summary
  demo-scheduler     replay the Azure trace through the schedulers on a simulated worker
  make-tiny-model    write a small random model of any supported family (HF format, --arch)
  bench-scheduler    time one full scheduler step (see bench/scheduler.py)
  bench              bench serve | bench compare: replay a trace over gRPC (latency, goodput, figures)
  simulate           simulate run | search | validate: discrete-event sizing on a roofline cost model

Run `pdserve COMMAND --help` for a command's options.
"""
HOST_HELP = "the router's host (default 127.0.0.1); https://NAME for TLS"
SHUTDOWN_GRACE_S = 3.0  # `launch` waits this long after its router is killed before stopping Ray


# ---------------------------------------------------------------------- launch

def _engine_fields():
    from pdserve.workers.config import EngineConfig

    return dataclasses.fields(EngineConfig)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local HF-format model directory, or a Hugging Face Hub "
                                         "repo id ORG/NAME (from the Hub cache, downloaded unless "
                                         "HF_HUB_OFFLINE=1; default: the built-in tiny model)")
    # vLLM's model options pdserve does not implement: accepted only to be refused with a reason.
    parser.add_argument("--revision", default=None, help="refused: pdserve serves the Hub "
                        "cache's main revision; download another into a directory instead")
    parser.add_argument("--tokenizer", default=None, help="refused unless it is the model "
                        "itself: pdserve uses the model's own tokenizer.json")
    parser.add_argument("--trust-remote-code", action="store_true", default=False,
                        help="refused: pdserve runs no code from model repos")
    parser.add_argument("--address", help="join this Ray cluster (e.g. auto); default: embedded local cluster")
    parser.add_argument("--num-context-workers", type=int, default=None)
    parser.add_argument("--num-generation-workers", type=int, default=None)
    parser.add_argument("--context-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="tensor-parallel ranks of each context worker (default: "
                             "--tensor-parallel-size)")
    parser.add_argument("--generation-tensor-parallel-size", type=int, default=None, metavar="N",
                        help="tensor-parallel ranks of each generation worker (default: "
                             "--tensor-parallel-size)")
    parser.add_argument("--host", default=None,
                        help="gRPC bind address (default 127.0.0.1, this machine only); also the "
                             "HTTP one unless --http-host says otherwise")
    parser.add_argument("--port", type=int, default=None, help="gRPC port (default 50051)")
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible HTTP API on this port (default: off)")
    parser.add_argument("--http-host", default=None, help="HTTP bind address (default: --host)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id HTTP clients use (default: the model directory's name)")
    parser.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                        help="how tool calls are read from the model's output for tool_choice "
                             "auto (hermes: Hermes/Qwen <tool_call> JSON); forced calls need none")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true", default=None,
                        help="HTTP logprobs name tokens 'token_id:{id}' rather than by text (vLLM's "
                             "flag; a request's return_tokens_as_token_ids overrides it)")
    parser.add_argument("--config", help="YAML file with any of these options (flags override it)")
    parser.add_argument("--routing", choices=["round-robin", "least-loaded", "kv-aware"],
                        help="how workers are picked (default round-robin); kv-aware routes on the "
                             "workers' prefix caches, known from their KV events")
    parser.add_argument("--kv-overlap-weight", type=float,
                        help="kv-aware: the weight of prompt blocks a worker does not cache (default 4)")
    parser.add_argument("--kv-decode-weight", type=float,
                        help="kv-aware: the weight of KV blocks in use on a worker (default 0.25)")
    parser.add_argument("--max-local-prefill-length", type=int)
    parser.add_argument("--placement", choices=["pack", "spread"],
                        help="pack the workers onto few nodes (default) or spread them over many")
    for role in ("context", "generation"):
        parser.add_argument(f"--{role}-resources", type=_resources_flag(f"--{role}-resources"),
                            metavar="JSON",
                            help=f"extra Ray resources each {role} worker needs, as JSON (e.g. "
                                 f"'{{\"{'prefill' if role == 'context' else 'decode'}_node\": 1}}'): "
                                 "pins the role to nodes started with them (`ray start --resources`)")
    parser.add_argument("--max-queue", type=int)
    parser.add_argument("--max-retries", type=int)
    parser.add_argument("--worker-wait", type=float, dest="worker_wait_s", metavar="S",
                        help="seconds a request may wait for a worker Ray is restarting when no "
                             "other can take it (default 30; 0: fail it at once, UNAVAILABLE)")
    parser.add_argument("--agent-types", help="comma-separated agent types for the agent-tree order")
    parser.add_argument("--agent-percentage", type=float)
    parser.add_argument("--kv-connect-timeout", type=float, dest="connect_timeout_s", metavar="S",
                        help="seconds a KV pair group may take to set up: the store connect and "
                             "the rendezvous (default 30; raise it on a loaded machine)")
    parser.add_argument("--kv-transfer-timeout", type=float, dest="transfer_timeout_s", metavar="S",
                        help="seconds one KV transfer may take (default 30)")
    parser.add_argument("--kv-transfer-mode", choices=["after_prefill", "layerwise"],
                        help="when a remote prefill's KV moves: after_prefill (the default: once "
                             "the prefill is over) or layerwise (each layer as the context "
                             "worker's forward writes it)")
    parser.add_argument("--torch-threads", type=_threads, metavar="N|auto",
                        help="torch (OpenMP) threads per worker process (default auto: the node's CPUs "
                             "shared by the pdserve workers on it; 1 is the most robust on a machine "
                             "busy with other work)")
    parser.add_argument("--no-kv-link", action="store_const", const=False, dest="kv_link",
                        help="send KV requests by Ray alone, not also over the direct "
                             "worker-to-worker link")
    sec = parser.add_argument_group("front-door security (both gRPC and HTTP)")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require this API key ('Bearer KEY'); repeat for several keys "
                          "(default: $PDSERVE_API_KEY if set; health checks stay open)")
    sec.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="require one of the keys in FILE (one per line, # comments)")
    sec.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                     help="an admin key: only admin keys may stop the cluster (gRPC Shutdown, "
                          "`pdserve shutdown`), and they are accepted as API keys too; repeat for "
                          "several (default: $PDSERVE_ADMIN_API_KEY if set). Without admin keys, "
                          "Shutdown is taken only from this machine (loopback)")
    sec.add_argument("--admin-api-key-file", default=None, metavar="FILE",
                     help="admin keys from FILE (one per line, # comments)")
    sec.add_argument("--max-inflight-per-key", type=int, default=None, metavar="N",
                     help="at most N requests in flight per API key; more get 429 / RESOURCE_EXHAUSTED")
    sec.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS: PEM certificate chain")
    sec.add_argument("--tls-key", default=None, metavar="FILE", help="serve TLS: PEM private key")
    sec.add_argument("--tls-client-ca", default=None, metavar="FILE",
                     help="mutual TLS: clients must present a certificate signed by this CA")
    group = parser.add_argument_group("engine options (every worker)")
    for f in _engine_fields():
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):  # a bare flag is true, as vLLM's --enable-expert-parallel
            group.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes", "on"), metavar="BOOL",
                               nargs="?", const=True, help=ENGINE_FLAG_HELP.get(f.name))
        elif f.type in ("int", "int | None"):
            group.add_argument(flag, type=int, help=ENGINE_FLAG_HELP.get(f.name))
        elif f.type == "float":
            group.add_argument(flag, type=float, help=ENGINE_FLAG_HELP.get(f.name))
        else:
            group.add_argument(flag, help=ENGINE_FLAG_HELP.get(f.name))


ENGINE_FLAG_HELP = {
    "tensor_parallel_size": "ranks each worker's model is split over (tensor parallelism: one "
                            "process and one CPU, or GPU, per rank, all on one node); "
                            "--context-/--generation-tensor-parallel-size override it per role",
    "enable_expert_parallel": "MoE: split whole experts over the ranks instead of each "
                              "expert's width",
    "small_step_threads": "torch threads for steps of fewer than --small-step-tokens tokens "
                          "(decode batches) on CPU: N, auto (measured per step size: the "
                          "default with --torch-threads auto) or off (every step on all)",
    "dtype": "auto (the default: the checkpoint's bfloat16 or float16 as stored; float32 "
             "checkpoints run as float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16",
}


def _threads(value: str) -> int | str:
    """--torch-threads: a positive integer or auto."""
    if value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {value!r}")
    return n


def _resources_flag(flag: str):
    """argparse type for a resources flag: a JSON object of resource names to amounts; a bad
    value is an argparse error naming the flag."""
    def parse(text: str) -> dict:
        from pdserve.cluster.launch import check_resources

        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
        try:
            check_resources(flag, value)
        except ValueError as exc:  # argparse names the flag already
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None
        return value

    parse.__name__ = "resources JSON"  # argparse names the type in its message
    return parse


def launch_config_from_args(args: argparse.Namespace):
    import yaml

    from pdserve.cluster.auth import TlsFiles, load_admin_api_keys, load_api_keys
    from pdserve.cluster.launch import LaunchConfig
    from pdserve.cluster.router import RouterConfig

    data: dict = {}
    if args.config:
        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
    engine = dict(data.get("engine") or {})
    for f in _engine_fields():
        value = getattr(args, f.name, None)
        if value is not None:
            engine[f.name] = value
    router = dict(data.get("router") or {})
    for key in ("routing", "kv_overlap_weight", "kv_decode_weight", "max_local_prefill_length", "max_queue", "max_retries", "worker_wait_s", "agent_percentage",
                "http_port", "http_host", "served_model_name", "kv_transfer_mode", "host",
                "tool_call_parser", "return_tokens_as_token_ids",
                "max_inflight_per_key", "tls_cert", "tls_key", "tls_client_ca"):
        value = getattr(args, key, None)
        if value is not None:
            router[key] = value
    if getattr(args, "host", None) is not None and getattr(args, "http_host", None) is None:
        router["http_host"] = args.host
    # Keys from the flags or the key file replace any in the YAML file; the environment
    # variable counts only when neither the flags nor the YAML file give keys.
    keys = load_api_keys(getattr(args, "api_key", None) or (), getattr(args, "api_key_file", None),
                         environ={} if router.get("api_keys") else os.environ)
    if keys:
        router["api_keys"] = keys
    admin = load_admin_api_keys(getattr(args, "admin_api_key", None) or (),
                                getattr(args, "admin_api_key_file", None),
                                environ={} if router.get("admin_api_keys") else os.environ)
    if admin:
        router["admin_api_keys"] = admin
    tls = TlsFiles.from_options(router.get("tls_cert"), router.get("tls_key"), router.get("tls_client_ca"))
    if tls is not None:
        tls.check()  # an unreadable or mismatched file is an error now, before anything starts
    if args.agent_types:
        router["agent_types"] = tuple(t.strip() for t in args.agent_types.split(",") if t.strip())
    if "agent_types" in router:
        router["agent_types"] = tuple(router["agent_types"])
        router.setdefault("agent_percentage", 0.5)
    if args.port is not None:
        router["port"] = args.port
    top = {k: v for k, v in data.items() if k not in ("engine", "router")}
    for role in ("context", "generation"):  # per-role engine overrides
        size = getattr(args, f"{role}_tensor_parallel_size", None)
        if size is not None:
            top[f"{role}_engine"] = {**(top.get(f"{role}_engine") or {}), "tensor_parallel_size": size}
    for key in ("model", "num_context_workers", "num_generation_workers", "placement",
                "connect_timeout_s", "transfer_timeout_s", "kv_link", "torch_threads", "context_resources",
                "generation_resources"):
        value = getattr(args, key, None)
        if value is not None:
            top[key] = value
    return LaunchConfig(engine=engine, router=RouterConfig(**router), **top)


def _launch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve launch", description="Serve a model with P/D disaggregation on Ray.")
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    from pdserve.workers.loading.hub import UnsupportedOption, check_supported_options

    try:
        check_supported_options(args.model, revision=args.revision, tokenizer=args.tokenizer,
                                trust_remote_code=args.trust_remote_code)
    except UnsupportedOption as exc:
        parser.error(exc.flag_message)
    try:
        cfg = launch_config_from_args(args)
    except ValueError as exc:  # SecurityConfigError and the configs' own checks name the field
        print(f"pdserve launch: {exc}", file=sys.stderr)
        return 2
    try:  # a Hub model is found (or downloaded) before anything starts
        from pdserve.cluster.launch import launch_model

        launch_model(cfg.model)
    except ValueError as exc:  # hub.ModelResolveError: the id and the cache it looked in
        print(f"pdserve launch: {exc}", file=sys.stderr)
        return 2
    for warning in _security_warnings(cfg.router):
        print(f"WARNING: {warning}", file=sys.stderr, flush=True)

    import ray

    from pdserve.cluster.launch import LaunchError, RayJoinError, ensure_ray, launch

    try:
        owns_ray = ensure_ray(args.address, num_cpus=max(
            os.cpu_count() or 1, cfg.num_context_workers + cfg.num_generation_workers + 1))
    except RayJoinError as exc:
        print(f"pdserve launch: {exc}", file=sys.stderr)
        return 2
    try:
        cluster = launch(cfg)
    except LaunchError as exc:  # what it created is removed already
        print(str(exc), file=sys.stderr)
        if owns_ray:
            ray.shutdown()
        return 1
    dashboard = ray.get_runtime_context().dashboard_url if hasattr(ray.get_runtime_context(), "dashboard_url") else None
    http = f"{cfg.router.http_host}:{cluster.http_port}" if cluster.http_port is not None else None
    print(json.dumps({"grpc": f"{cfg.router.host}:{cluster.port}", "http": http, "workers": sorted(cluster.workers),
                      "dashboard": dashboard or _dashboard_url(),
                      "model": cluster.model_name or str(cluster.model_dir),
                      "model_dir": str(cluster.model_dir),
                      "ray_address": ray.get_runtime_context().gcs_address,
                      "security": _security_summary(cfg.router)}), flush=True)
    url = dashboard or _dashboard_url()
    if url:
        from pdserve.cli.demo import dashboard_guide

        print(dashboard_guide(url if url.startswith("http") else f"http://{url}"), file=sys.stderr,
              flush=True)
    from pdserve.cluster.client import router_accepts

    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"]:
            time.sleep(1.0)
            # `pdserve shutdown` from elsewhere stops the router: leave with it. Asked with a
            # TCP connect, not a Ray call, so the dashboard's task table stays quiet.
            if not router_accepts(cfg.router.host, cluster.port):
                # ... after a moment, so the driver that killed it disconnects before this
                # process stops the Ray cluster it started under that driver's feet.
                time.sleep(SHUTDOWN_GRACE_S)
                break
    except KeyboardInterrupt:
        pass
    cluster.shutdown()
    if owns_ray:
        ray.shutdown()
    return 0


def _security_warnings(router_cfg) -> list[str]:
    from pdserve.cluster.auth import exposure_warnings

    doors = [("gRPC", router_cfg.host)]
    if router_cfg.http_port is not None:
        doors.append(("HTTP", router_cfg.http_host))
    return exposure_warnings(doors, api_keys=bool(router_cfg.api_keys), tls=router_cfg.tls_cert is not None)


def _security_summary(router_cfg) -> dict:
    """What `launch` prints about the front doors' protection: counts and flags, never a key."""
    return {"api_keys": len(router_cfg.api_keys), "admin_api_keys": len(router_cfg.admin_api_keys),
            "tls": router_cfg.tls_cert is not None,
            "mutual_tls": router_cfg.tls_client_ca is not None,
            "max_inflight_per_key": router_cfg.max_inflight_per_key,
            "warnings": _security_warnings(router_cfg)}


def _dashboard_url() -> str | None:
    try:
        import ray

        return ray._private.worker.global_worker.node.address_info.get("webui_url")
    except Exception:
        return None


# ---------------------------------------------------------------------- client commands

def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve generate")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--token-ids", help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--priority", type=float, default=None)
    parser.add_argument("--disaggregation", default="AUTO", choices=["AUTO", "ALWAYS", "NEVER"])
    parser.add_argument("--ignore-eos", action="store_true")
    _add_connection_arguments(parser)
    args = parser.parse_args(argv)

    import grpc

    prompt = args.prompt if args.prompt is not None else [int(t) for t in args.token_ids.split(",") if t]
    client = _client(parser, args)
    with client:
        try:
            for delta in client.generate_stream(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                                priority=args.priority, disaggregation=args.disaggregation,
                                                ignore_eos=args.ignore_eos):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                if delta.finish_reason:
                    t = delta.timings
                    print(f"\n[finish={delta.finish_reason} tokens={delta.usage.completion_tokens} "
                          f"ttft={t.ttft_ms:.1f}ms e2e={t.e2e_ms:.1f}ms kv={t.kv_transfer_bytes}B "
                          f"ctx={t.ctx_worker or '-'} gen={t.gen_worker} pauses={t.pauses}]")
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0


def _status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve status",
        description="Print the cluster status: per worker (role, health, KV blocks, requests, pauses, "
                    "KV transfers, quarantined blocks, invariant violations) and the router's totals "
                    "with the KV paths. Fits 80 columns. `pdserve top` is the live view.")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    parser.add_argument("--json", action="store_true",
                        help="write the ClusterStatus as JSON instead: MessageToDict's field names (the "
                             "proto's JSON names, camelCase: workerId, freeKvBlocks, totals.kvPaths, "
                             "recentEvents), enums by name, every field present even when zero, and "
                             "every number (64-bit counters included) a JSON number")
    _add_connection_arguments(parser)
    args = parser.parse_args(argv)

    import grpc
    from rich.console import Console

    from pdserve.cli.views import render_status, status_to_dict

    with _client(parser, args) as client:
        try:
            status = client.status()
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(status_to_dict(status), indent=2))
        return 0
    Console().print(render_status(status, address=f"{args.host}:{args.port}"))
    return 0


def _add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.cluster.client import add_connection_arguments

    add_connection_arguments(parser)


def _client(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """A Client for --host/--port and the connection flags; a bad flag is a usage error."""
    from pdserve.cluster.auth import SecurityConfigError
    from pdserve.cluster.client import client_from_connection, connection_from_args

    try:
        return client_from_connection(connection_from_args(args, f"{args.host}:{args.port}"))
    except SecurityConfigError as exc:
        parser.error(str(exc))


def _top(argv: list[str]) -> int:
    from pdserve.cli.top import main

    return main(argv)


def _shutdown(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve shutdown",
        description="Stop a pdserve cluster's actors (never the Ray cluster). With --port (and "
                    "--host) alone, the router serving that port is asked to stop its own cluster, "
                    "whichever Ray cluster it runs on; with --address, pdserve's actors on that Ray "
                    "cluster are killed (only if its router serves --port, when given). Asking the "
                    "router is an admin call: it needs --admin-api-key when the router has admin "
                    "keys, and is taken only from the router's own machine when it has none.")
    parser.add_argument("--port", type=int, default=None, help="the router's gRPC port")
    parser.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    parser.add_argument("--address", default=None,
                        help="the Ray cluster (an address, or auto); default: ask the router at "
                             "--port, or auto without --port")
    parser.add_argument("--wait", type=float, default=60.0,
                        help="seconds to wait for the router's port to close (default 60)")
    _add_connection_arguments(parser)
    from pdserve.cluster.client import add_admin_arguments

    add_admin_arguments(parser.add_argument_group("admin"))
    args = parser.parse_args(argv)
    if args.address is None and args.port is not None:
        return _shutdown_by_port(parser, args)
    return _shutdown_on_ray(args.address or "auto", args.port)


def _shutdown_by_port(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Ask the router at host:port to stop its cluster (gRPC Shutdown), then wait until its port
    closes, so that a script can go on once this returns."""
    import grpc

    from pdserve.cluster import local_routers
    from pdserve.cluster.client import router_accepts

    where = f"{args.host}:{args.port}"
    with _client(parser, args) as client:
        try:
            reply = client.shutdown()
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
                              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                print(f"pdserve shutdown: --port {args.port}: no pdserve router answers at {where} "
                      f"({exc.code().name}: {exc.details()}); nothing stopped.\n"
                      f"{local_routers.describe(local_routers.list_routers())}", file=sys.stderr)
                return 2
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    actors = list(reply.actors)
    print(f"stopping {len(actors)} pdserve actor(s) of the cluster at {reply.ray_address}: "
          f"{', '.join(actors)}", flush=True)
    deadline = time.monotonic() + args.wait
    while router_accepts(args.host, args.port, attempts=1):
        if time.monotonic() > deadline:
            print(f"pdserve shutdown: the router at {where} still accepts connections after "
                  f"{args.wait:.0f} s", file=sys.stderr)
            return 1
        time.sleep(0.2)
    print(f"the router at {where} has stopped")
    return 0


def _shutdown_on_ray(address: str, port: int | None) -> int:
    """Join the Ray cluster at ``address`` and kill pdserve's actors there; with ``port``, only
    if its router serves that port."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from pdserve.cluster import local_routers
    from pdserve.cluster.launch import NAMESPACE, ROUTER_NAME, RayJoinError, join_ray, shutdown_all

    import ray

    try:
        join_ray(address)
    except RayJoinError as exc:
        print(f"pdserve shutdown: {exc}", file=sys.stderr)
        return 2
    if port is not None:
        try:
            serves = ray.get(ray.get_actor(ROUTER_NAME, namespace=NAMESPACE).port.remote(), timeout=30)
        except (ValueError, ray.exceptions.RayError) as exc:
            serves = None
            why = f"no pdserve router on the Ray cluster at {address} ({exc})"
        else:
            why = f"the pdserve router on the Ray cluster at {address} serves port {serves}"
        if serves != port:
            print(f"pdserve shutdown: --port {port}: {why}; nothing killed. Without --address, "
                  f"`pdserve shutdown --port {port}` asks the router at that port itself.\n"
                  f"{local_routers.describe(local_routers.list_routers())}", file=sys.stderr)
            ray.shutdown()
            return 2
    killed = shutdown_all()
    print(f"killed {len(killed)} pdserve actor(s): {', '.join(sorted(killed)) or '-'}")
    ray.shutdown()  # disconnects this driver; the cluster keeps running
    return 0


# ---------------------------------------------------------------------- the rest

def _demo(argv: list[str]) -> int:
    from pdserve.cli.demo import main

    return main(argv)


def _demo_scheduler(argv: list[str]) -> int:
    from pdserve.bench.sched_replay import main

    return main(argv)


def _make_tiny_model(argv: list[str]) -> int:
    from pdserve.workers.loading.tiny_model import main

    return main(argv)


def _bench_scheduler(argv: list[str]) -> int:
    from pdserve.bench.scheduler import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from pdserve.bench.serve import main

    return main(argv)


def _simulate(argv: list[str]) -> int:
    from pdserve.bench.sizing import main

    return main(argv)


COMMANDS = {
    "launch": _launch,
    "generate": _generate,
    "status": _status,
    "top": _top,
    "shutdown": _shutdown,
    "demo": _demo,
    "demo-scheduler": _demo_scheduler,
    "make-tiny-model": _make_tiny_model,
    "bench-scheduler": _bench_scheduler,
    "bench": _bench,
    "simulate": _simulate,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"pdserve: unknown command {argv[0]!r}\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    return int(command(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

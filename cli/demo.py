"""`make demo`: the main job on an embedded default.

An embedded Ray cluster bound to 127.0.0.1, the built-in tiny model, one context and one
generation worker and the gRPC router; a burst of requests from the Azure conversation trace
(a share of them agent requests) sent over gRPC; a small generation KV pool under
MAX_UTILIZATION so pauses happen. Prints what happened and the dashboard address.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

DEMO_ENGINE = dict(tokens_per_block=16, max_batch_size=16, max_num_tokens=512,
                   context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=64)
# A generation pool this small cannot hold every decode at once: MAX_UTILIZATION pauses.
DEMO_GEN_ENGINE = dict(capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=40)
DEMO_CTX_ENGINE = dict(capacity_scheduler_policy="GUARANTEED_NO_EVICT", num_kv_blocks=256)


def dashboard_guide(url: str) -> str:
    """Where a person finds KV transfers and pauses on the Ray dashboard (clicked through in
    Ray 2.60's dashboard with headless Chromium; docs/design.md, "Observability")."""
    return "\n".join([
        f"Ray dashboard: {url}",
        "  Log in: paste the token that `ray get-auth-token` prints.",
        "  KV transfers: Jobs -> the job -> Task Table (open the section). One row per",
        "    transfer, `kv_transfer req=<id> ctx-0->gen-0 blocks=N bytes=B`, with state",
        "    (a FAILED row carries the reason) and duration; the row's Log link shows",
        "    the measured time and GB/s. A KV pair's set-up (and each rebuild) is a",
        "    `kv_pair_open ctx-0->gen-0 epoch=N` row.",
        "  Pauses: Jobs -> the job -> Actor Table -> pdserve-gen-0 -> Log: a `PAUSE",
        "    req=<id>` line per pause (policy, tokens generated, blocks freed) and a",
        "    `RESUME` line when it runs again (Keyword filter: PAUSE); each transfer's",
        "    `KV receive` line is there too.",
        "  In a terminal: pdserve top (live), pdserve status",
    ])


def tiny_model_dir(arch: str):
    """A tiny random model of ``arch`` the size of the built-in one (byte vocabulary, so the
    demo's trace prompts fit), written once into pdserve's cache folder."""
    from pathlib import Path

    from pdserve.workers.loading.tiny_model import make_tiny_model

    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    path = root / f"demo-tiny-{arch}-h128-l4-v259"
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny_model(tmp, arch=arch, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        vocab_size=259, max_position_embeddings=2048, seed=0)
        try:
            os.replace(tmp, path)
        except OSError:  # another process wrote it first; theirs is identical
            pass
    return path


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _send_all(port: int, work, concurrency: int, deadline_s: float):
    import grpc

    from pdserve.cluster.client import Client
    from pdserve.cluster.rpc import router_pb2_grpc

    results = []
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(i, prompt, max_tokens, hierarchy):
            req = Client.build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                       agent_hierarchy=hierarchy, request_id=f"demo-{i}")
            async with sem:
                start = time.monotonic()
                n, last = 0, None
                try:
                    async for delta in stub.Generate(req, timeout=deadline_s):
                        n += len(delta.token_ids)
                        last = delta
                except grpc.aio.AioRpcError as exc:
                    results.append({"id": i, "error": f"{exc.code().name}: {exc.details()}"})
                    return
                results.append({"id": i, "tokens": n, "wall_s": time.monotonic() - start,
                                "timings": last.timings, "agent": bool(hierarchy)})

        await asyncio.gather(*(one(*w) for w in work))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve demo", description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-prompt", type=int, default=192)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--keep-alive", action="store_true", help="leave the cluster up (Ctrl-C ends it)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--arch", default=None, metavar="ARCH",
                       help="run a built-in tiny random model of this family instead (one of "
                            "`pdserve make-tiny-model --arch`'s choices, e.g. qwen3_moe, deepseek_v3)")
    which.add_argument("--model", default=None, help="run this model (a local directory or ORG/NAME)")
    args = parser.parse_args(argv)
    model = args.model
    if args.arch is not None:
        from pdserve.workers.loading.tiny_model import ARCH_ALIASES, ARCHITECTURES

        args.arch = ARCH_ALIASES.get(args.arch, args.arch)
        if args.arch not in ARCHITECTURES:
            parser.error(f"--arch must be one of {', '.join(sorted(ARCHITECTURES))}, got {args.arch!r}")
        model = str(tiny_model_dir(args.arch))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

    import ray
    from rich.console import Console
    from rich.table import Table

    from pdserve.traces import fit_scale, load_trace, synth_prompt
    from pdserve.cluster.client import Client
    from pdserve.cluster.launch import LaunchConfig, ensure_ray, launch
    from pdserve.cluster.router import RouterConfig

    console = Console()
    t0 = time.monotonic()
    owns = ensure_ray(num_cpus=max(4, os.cpu_count() or 1))
    cfg = LaunchConfig(model=model, engine=DEMO_ENGINE, context_engine=DEMO_CTX_ENGINE, generation_engine=DEMO_GEN_ENGINE,
                       router=RouterConfig(port=0, http_port=0, agent_types=("AgentDeepResearch",),
                                           agent_percentage=0.5))
    cluster = launch(cfg)
    dashboard = ray._private.worker.global_worker.node.address_info.get("webui_url")
    console.print(f"[bold]pdserve up[/bold] in {time.monotonic() - t0:.1f} s: gRPC 127.0.0.1:{cluster.port}, "
                  f"OpenAI HTTP http://127.0.0.1:{cluster.http_port}/v1, "
                  f"workers {', '.join(sorted(cluster.workers))}, model {cluster.model_dir.name}")
    try:
        rows = load_trace("azure_llm_2023_conv.csv", args.num_requests)
        scale = fit_scale(rows, args.max_prompt, args.max_output)
        work = []
        for i, row in enumerate(rows):
            hierarchy = [("AgentDeepResearch", i % 3)] if i % 4 == 3 else []
            work.append((i, synth_prompt(row, i, scale, vocab=(3, 259)),
                         min(args.max_output, max(2, row.output_len)), hierarchy))
        console.print(f"sending {len(work)} requests from the Azure conversation trace "
                      f"({sum(1 for w in work if w[3])} agent requests), concurrency {args.concurrency}")
        start = time.monotonic()
        results = asyncio.run(_send_all(cluster.port, work, args.concurrency, deadline_s=600))
        wall = time.monotonic() - start
        with Client(f"127.0.0.1:{cluster.port}") as client:
            status = client.status()
    except BaseException:
        cluster.shutdown()
        if owns:
            ray.shutdown()
        raise

    ok = [r for r in results if "error" not in r]
    ttft = [r["timings"].ttft_ms for r in ok]
    tpot = [(r["timings"].e2e_ms - r["timings"].ttft_ms) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    kv_bytes = sum(r["timings"].kv_transfer_bytes for r in ok)
    kv_ms = sum(r["timings"].kv_transfer_ms for r in ok)
    table = Table(title=f"pdserve demo: 1 context + 1 generation worker, {cluster.model_dir.name}, gRPC router")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("requests sent / completed / failed", f"{len(results)} / {len(ok)} / {len(results) - len(ok)}")
    table.add_row("output tokens", str(sum(r["tokens"] for r in ok)))
    table.add_row("wall time", f"{wall:.2f} s ({sum(r['tokens'] for r in ok) / wall:.0f} tok/s)")
    table.add_row("TTFT p50 / p90 / p99", " / ".join(f"{_pct(ttft, q):.0f}" for q in (0.5, 0.9, 0.99)) + " ms")
    table.add_row("TPOT p50 / p90 / p99", " / ".join(f"{_pct(tpot, q):.1f}" for q in (0.5, 0.9, 0.99)) + " ms")
    table.add_row("KV transfers (remote prefills)",
                  str(sum(1 for r in ok if r["timings"].ctx_worker)))
    table.add_row("KV moved (sum of transfer times)", f"{kv_bytes / 1e6:.2f} MB in {kv_ms:.0f} ms "
                  f"({(kv_bytes / 1e9) / (kv_ms / 1e3) if kv_ms else 0:.2f} GB/s)")
    table.add_row("pauses (gen pool, MAX_UTILIZATION)", str(sum(r["timings"].pauses for r in ok)))
    paths = status.totals.kv_paths
    # How each request's KV reached its generation worker (RouterTotals.kv_paths).
    table.add_row("KV xfer / local / cached / ctx / failed",
                  f"{paths.transferred} / {paths.local_prefill} / {paths.prefix_cached} / "
                  f"{paths.context_finished} / {paths.failed}")
    agent_ttft = [r["timings"].ttft_ms for r in ok if r["agent"]]
    chat_ttft = [r["timings"].ttft_ms for r in ok if not r["agent"]]
    if agent_ttft and chat_ttft:
        table.add_row("TTFT p50 agent / chatbot", f"{statistics.median(agent_ttft):.0f} / "
                      f"{statistics.median(chat_ttft):.0f} ms")
    for w in status.workers:
        table.add_row(f"{w.worker_id}: KV free, pauses, xfers",
                      f"{w.free_kv_blocks}/{w.total_kv_blocks}, {w.pauses}, {w.transfers.count} "
                      f"({dict(w.transfers.outcomes)})")
    console.print(table)
    for r in results:
        if "error" in r:
            console.print(f"[red]request {r['id']}: {r['error']}[/red]")
    if dashboard:
        print(dashboard_guide(f"http://{dashboard}"), flush=True)
    try:
        if args.keep_alive:
            console.print("--keep-alive: the cluster stays up; Ctrl-C ends it. Try:\n"
                          f"  curl -s http://127.0.0.1:{cluster.http_port}/v1/completions "
                          "-H 'Content-Type: application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 16}'")
            from pdserve.cluster.client import router_accepts

            # `pdserve shutdown --port` stops this cluster's router: leave with it (and stop
            # the Ray cluster this demo started), as `pdserve launch` does.
            while router_accepts("127.0.0.1", cluster.port):
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.shutdown()
        if owns:
            ray.shutdown()
    return 0 if len(ok) == len(results) else 1

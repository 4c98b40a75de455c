"""pdserve on a Ray cluster of three nodes (``ray.cluster_utils.Cluster``: a head and two worker
nodes, all on this host) with Ray's token auth on: `pdserve launch --address` joining it from the
command line, 1P2D spread over the three nodes with token-exact output and node-IP endpoints, a
worker node removed while requests stream on its generation worker and another added back, and
a worker that lacks the model directory.

Node resources pin the roles: the head offers ``ctx_node`` (context workers, the router and the
driver live there), each worker node one ``gen_node``, so the two generation workers cannot
share a node, and a generation worker whose node is gone waits for a new one.

What one host cannot show: every node has the IP 127.0.0.1 and one filesystem, so a wrong
address or a missing model directory on one node only is simulated (the endpoints are checked
to carry each worker's own node IP; the model path exists nowhere)."""
from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from cli_session import free_port  # noqa: E402
from pdserve.cluster.launch import LaunchError, use_token_auth, probe_gcs, join_ray  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PINNED = dict(placement="spread", context_resources={"ctx_node": 1},
              generation_resources={"gen_node": 1})
GEN_NODE = dict(num_cpus=1, resources={"gen_node": 1}, include_dashboard=False)


@pytest.fixture(scope="module")
def nodes():
    """The 3-node cluster with token auth on, this process joined to it through ``join_ray``
    (the auth mode detected, not preset). Yields (cluster, {"head"|"a"|"b": Node})."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # a previous module's Ray in this process: its fixtures are done
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_worker_niceness")}
    os.environ["RAY_worker_niceness"] = "0"  # restarts import torch at normal priority
    # Token mode here (the nodes' GCS and raylets inherit it, and this process's own clients,
    # which start and watch the nodes, must send the token too).
    use_token_auth()
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=3, resources={"ctx_node": 1}, include_dashboard=False))
    try:
        named = {"head": cluster.head_node, "a": cluster.add_node(**GEN_NODE),
                 "b": cluster.add_node(**GEN_NODE)}
        cluster.wait_for_nodes()
        assert probe_gcs(cluster.address) == "unauthenticated"  # token auth really is on
        del os.environ["RAY_AUTH_MODE"]
        join_ray(cluster.address)  # the command-line test below joins from a clean environment
        assert os.environ["RAY_AUTH_MODE"] == "token"
        yield cluster, named
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _pdserve_env(**extra: str) -> dict[str, str]:
    """A user's shell: no RAY_AUTH_MODE (pdserve must find the auth mode itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", **extra}


def _run(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cli_joins_the_token_cluster_and_shows_where_workers_run(nodes, tmp_path):
    cluster, named = nodes
    env = _pdserve_env()
    # Without any token here: refused at once, saying what to set (nothing is started).
    bare = _run("shutdown", "--address", cluster.address,
                env=_pdserve_env(HOME=str(tmp_path)), timeout=60)
    assert bare.returncode == 2, bare.stderr
    assert "token authentication on" in bare.stderr and "RAY_AUTH_TOKEN" in bare.stderr

    port = free_port()
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log:
        launch = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "launch", "--address", cluster.address,
             "--port", str(port), "--num-context-workers", "1", "--num-generation-workers", "1",
             "--placement", "spread", "--context-resources", '{"ctx_node": 1}',
             "--generation-resources", '{"gen_node": 1}', "--tokens-per-block", "8",
             "--num-kv-blocks", "128"],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        ready, _, _ = select.select([launch.stdout], [], [], 240)
        assert ready, log_path.read_text()[-3000:]
        line = launch.stdout.readline()
        assert line, log_path.read_text()[-3000:]
        assert json.loads(line)["workers"] == ["ctx-0", "gen-0"]

        out = _run("generate", "--port", str(port), "--prompt", "hello there", "--max-tokens",
                   "4", "--temperature", "0", "--ignore-eos", env=env)
        assert out.returncode == 0 and "ctx=ctx-0 gen=gen-0" in out.stdout, out.stderr

        status = _run("status", "--port", str(port), "--json", env=env)
        assert status.returncode == 0, status.stderr
        workers = {w["workerId"]: w for w in json.loads(status.stdout)["workers"]}
        head, gen_nodes = named["head"].node_id, {named["a"].node_id, named["b"].node_id}
        assert workers["ctx-0"]["nodeId"] == head and workers["gen-0"]["nodeId"] in gen_nodes
        assert all(w["nodeIp"] == named["head"].node_ip_address for w in workers.values())
        assert workers["gen-0"]["kvPairs"] == {"ctx-0": "ready"} and not workers["ctx-0"]["kvPairs"]
        text = _run("status", "--port", str(port), env=env)
        assert "Ray node id" in text.stdout and head[:8] in text.stdout, text.stderr
        assert "KV pairs gen-0: ctx-0 ready" in text.stdout

        down = _run("shutdown", "--address", cluster.address, "--port", str(port), env=env)
        assert down.returncode == 0, down.stderr
        assert "pdserve-router" in down.stdout and "pdserve-gen-0" in down.stdout
        assert launch.wait(timeout=120) == 0, log_path.read_text()[-3000:]
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait(timeout=30)


def _pdserve_leftovers() -> tuple[list[str], list[str]]:
    actors = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
              if e["name"].startswith("pdserve-")]
    groups = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
              if pg.get("name") == "pdserve-workers" and pg.get("state") != "REMOVED"]
    return actors, groups


def test_a_worker_without_the_model_directory_fails_the_launch_clearly(nodes, tmp_path):
    cluster, named = nodes
    missing = tmp_path / "not-copied-to-this-node"
    with pytest.raises(LaunchError) as err:
        U.start_cluster(missing, num_context_workers=1, num_generation_workers=1, **PINNED)
    message = str(err.value)
    print("\nlaunch without the model directory:", message)
    assert f"the model directory {missing} does not exist on node" in message, message
    assert named["head"].node_ip_address in message
    assert any(n.node_id in message for n in named.values()), message
    assert "removed what it had created" in message and "placement group" in message
    U.wait_for(lambda: _pdserve_leftovers() == ([], []), 60, "the failed launch's actors to go")


def test_workers_no_node_can_hold_fail_the_launch_and_leave_nothing(nodes):
    with pytest.raises(LaunchError) as err:
        U.start_cluster("/unused", num_context_workers=1, num_generation_workers=1,
                        placement_timeout_s=3.0, context_resources={"ctx_node": 1},
                        generation_resources={"prefill_node": 1})
    message = str(err.value)
    assert "not placed within 3 s" in message and "gen-0 asks for" in message, message
    assert "'prefill_node': 1.0" in message and "ctx_node" in message  # what the nodes offer
    assert "placement group" in message.split("removed what it had created")[1]
    U.wait_for(lambda: _pdserve_leftovers() == ([], []), 60, "the failed launch's group to go")


@pytest.fixture(scope="module")
def spread(nodes, model_dir):
    """1P2D spread over the three nodes; shut down at the module's end."""
    cl = U.start_cluster(model_dir, num_context_workers=1, num_generation_workers=2,
                         router=RouterConfig(max_inflight=128), transfer_timeout_s=60.0,
                         max_restarts=-1, **PINNED)
    yield cl
    cl.shutdown()


def _infos(cl) -> dict:
    ids = sorted(cl.workers)
    return dict(zip(ids, ray.get([cl.workers[w].info.remote() for w in ids], timeout=U.RAY_TIMEOUT_S)))


def test_1p2d_spread_over_three_nodes_is_token_exact_and_crosses_nodes(nodes, spread, model_dir):
    cluster, named = nodes
    infos = _infos(spread)
    where = {w: i.node_id for w, i in infos.items()}
    assert len(set(where.values())) == 3, where  # ctx and both gens on different nodes
    assert where["ctx-0"] == named["head"].node_id
    # The router runs on the driver's node (the head here), where its ports were announced.
    router = ray._private.state.actors(spread.router._actor_id.hex())
    assert router["Address"]["NodeID"] == named["head"].node_id, router

    # Every address a worker advertises carries its own node's IP: the request channel, the
    # KV store (rendezvous) and the KV link published in that store.
    from datetime import timedelta

    import torch.distributed as dist

    from pdserve.transport.kv_link import LINK_KEY

    for w, info in infos.items():
        assert info.node_ip and info.request_endpoint.startswith(f"{info.node_ip}:"), info
    ctx = infos["ctx-0"]
    assert ctx.endpoint.startswith(f"{ctx.node_ip}:"), ctx.endpoint
    host, port = ctx.endpoint.split("#")[0].rsplit(":", 1)  # "host:port#incarnation"
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
    assert store.get(LINK_KEY).decode().startswith(f"{ctx.node_ip}:")

    batch = U.prompts(16, seed=31, lo=8, hi=30)
    results = U.burst(spread, "spread", batch, 12)
    assert [r.code for r in results] == [None] * len(batch), [r.details for r in results]
    assert [r.tokens for r in results] == U.reference(model_dir, batch, 12)
    timings = [r.last.timings for r in results]
    assert {t.gen_worker for t in timings} == {"gen-0", "gen-1"}
    # Every request's KV crossed from the head node to a worker node.
    assert all(t.ctx_worker == "ctx-0" and not t.local_prefill and t.kv_transfer_bytes > 0
               and where[t.gen_worker] != where["ctx-0"] for t in timings), timings
    U.wait_drained(spread)


def test_a_node_lost_while_its_generation_worker_streams_costs_no_request(nodes, spread, model_dir):
    cluster, named = nodes
    cl = spread
    infos = _infos(cl)
    victim = next(w for w in ("gen-0", "gen-1") if infos[w].node_id == named["b"].node_id)
    survivor = "gen-1" if victim == "gen-0" else "gen-0"
    n, max_tokens = 40, 32
    batch = U.prompts(n, seed=41, lo=8, hi=24)
    expected = U.reference(model_dir, batch, max_tokens)
    streamed: dict[str, int] = {}

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            # Both generation workers step slowly until the node goes, so no request can finish
            # before it however slowly this test's polls run.
            for w in ("gen-0", "gen-1"):
                await cl.workers[w].test_hook.remote("slow_steps", 0.05)
            tasks = [asyncio.create_task(U.generate(
                stub, f"n{i}", p, max_tokens,
                on_delta=lambda r: streamed.__setitem__(r.request_id, len(r.tokens))))
                for i, p in enumerate(batch)]
            while True:  # streaming on the victim: some of its requests past their first tokens
                phases = await cl.router.request_phases.remote()
                on_victim = [rid for rid, p in phases.items() if p["phase"] == "decode"
                             and any(w == victim for w, _ in p["attempts"])
                             and streamed.get(rid, 0) >= 2]
                if len(on_victim) >= 5:
                    break
                assert not any(t.done() for t in tasks), "a request finished before the fault"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(cluster.remove_node, named["b"])
            await cl.workers[survivor].test_hook.remote("slow_steps", 0.0)
            return on_victim, await asyncio.gather(*tasks)

    on_victim, results = U.run(go(), 300)
    assert [r.code for r in results] == [None] * n, [(r.request_id, r.details) for r in results if r.code]
    assert [r.tokens for r in results] == expected  # no duplicate, no gap, same tokens
    moved = {r.request_id: r.last.timings for r in results if r.request_id in on_victim}
    assert all(t.gen_worker == survivor and t.retries >= 1 for t in moved.values()), moved

    # A new node with the resource: the lost worker's bundle and the worker restart there,
    # rejoin the pair groups and take requests again.
    named["c"] = cluster.add_node(**GEN_NODE)
    added = time.monotonic()

    def back():
        st = ray.get(cl.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)
        return (st["restarts"].get(victim, 0) >= 1 and st["healthy"][victim]
                and not any(victim in pair.split("->") for pair in st["kv_pairs_unready"]))

    U.wait_for(back, 180, f"{victim} to restart on the new node and rejoin")
    print(f"\nnode lost: {len(on_victim)} requests streaming on {victim} moved to {survivor}; "
          f"{victim} back on the new node {time.monotonic() - added:.1f} s after it joined")
    assert _infos(cl)[victim].node_id == named["c"].node_id
    status = {w.worker_id: w for w in U.status(cl.port).workers}
    assert status[victim].node_id == named["c"].node_id  # what `pdserve status` shows
    again = U.prompts(8, seed=42)
    results = U.burst(cl, "again", again, 6)
    assert [r.code for r in results] == [None] * len(again), [r.details for r in results]
    assert [r.tokens for r in results] == U.reference(model_dir, again, 6)
    assert victim in {r.last.timings.gen_worker for r in results}
    final = U.wait_drained(cl)  # all KV free, nothing quarantined, no violation anywhere
    assert all(w.quarantined_blocks == 0 and w.free_kv_blocks == w.total_kv_blocks
               for w in final.workers)

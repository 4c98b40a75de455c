"""Worker groups on a local Ray cluster (issue 43): a generation worker whose model is split
over 2 ranks, each rank a Ray actor in the worker's own STRICT_PACK placement group.

- Served end to end (gRPC and the OpenAI door with the official client), token-exact against
  one unsplit engine; the dashboard's actor list names the ranks; status shows the TP size.
- One rank killed under load: the group goes down, Ray restarts it, the router carries every
  request over, token-exact, and nothing is orphaned (one actor per rank, one placement group).
- Bad sizes are refused at launch with the flag and the numbers, leaving nothing running.
"""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
import ray  # noqa: E402

import cluster_util as U  # noqa: E402
from pdserve.cluster.launch import LaunchError  # noqa: E402
from pdserve.cluster.router import RouterConfig  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
TP2 = dict(num_context_workers=0, num_generation_workers=1, engine={**U.ENGINE, "tensor_parallel_size": 2})


def pdserve_names() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("pdserve-"))


def placement_groups() -> dict[str, dict]:
    return {pg["name"]: pg for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED" and pg["name"].startswith("pdserve-")}


def test_a_tp2_worker_serves_token_exact_over_grpc_and_http(cluster, model_dir):
    cl = cluster(**TP2, router=RouterConfig(http_port=0))
    assert pdserve_names() == ["pdserve-gen-0", "pdserve-gen-0.rank1", "pdserve-router"]
    group = placement_groups()["pdserve-gen-0"]
    assert group["strategy"] == "STRICT_PACK" and len(group["bundles"]) == 2
    assert len(set(group["bundles_to_node_id"].values())) == 1
    status = U.status(cl.port)
    assert [(w.worker_id, w.tensor_parallel_size) for w in status.workers] == [("gen-0", 2)]

    batch = U.prompts(6, seed=5)
    expected = U.reference(model_dir, batch, 8)

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            return await asyncio.gather(*(U.generate(stub, f"tp{i}", p, 8) for i, p in enumerate(batch)))

    results = U.run(go(), 120)
    assert [r.code for r in results] == [None] * len(batch), [r.details for r in results]
    assert [r.tokens for r in results] == expected
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cl.http_port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    done = client.completions.create(model=client.models.list().data[0].id, prompt=batch[0],
                                     max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8
    U.wait_drained(cl)
    ranks_on_the_dashboard()


def ranks_on_the_dashboard() -> None:
    """What a person sees: the Ray state API (the dashboard's own) and, in headless Chromium,
    the dashboard's Actors page list each rank as an actor named after its worker."""
    from dashboard_util import _browser, _dashboard_url, _token
    from ray.util.state import list_actors
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    alive = {a.name: a for a in list_actors(detail=True) if a.state == "ALIVE"}
    rank = alive["pdserve-gen-0.rank1"]
    assert (rank.class_name, rank.repr_name) == ("RankWorker", "RankWorker(gen-0.rank1)")
    browser = _browser()
    try:
        wait = WebDriverWait(browser, 30)
        browser.get(f"{_dashboard_url()}/#/actors")
        login = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, ".MuiDialog-root input")))
        login.send_keys(_token())
        browser.find_element(By.XPATH, "//button[normalize-space()='Submit' or normalize-space()='SUBMIT']").click()
        row = wait.until(EC.visibility_of_element_located(
            (By.XPATH, "//tr[.//*[normalize-space(text())='pdserve-gen-0.rank1']]")))
        assert "RankWorker" in row.text and "ALIVE" in row.text, row.text
    except Exception:
        browser.save_screenshot("/tmp/pdserve-worker-groups-dashboard.png")
        raise
    finally:
        browser.quit()


def test_killing_one_rank_under_load_loses_no_request(cluster, model_dir):
    """Rank 1 of the only generation worker killed while requests decode: rank 0's next step
    fails (the rank's plan stream closed), the worker exits, Ray restarts it with a new rank 1,
    and the router carries each request over after the tokens it streamed."""
    n, max_tokens = 10, 24
    batch = U.prompts(n, seed=31, lo=8, hi=20)
    expected = U.reference(model_dir, batch, max_tokens)
    cl = cluster(**TP2)
    streamed: dict[str, int] = {}

    async def go():
        async with U.channel(cl.port) as ch:
            stub = U.stub_of(ch)
            await cl.workers["gen-0"].test_hook.remote("slow_steps", 0.05)
            tasks = [asyncio.create_task(U.generate(
                stub, f"k{i}", p, max_tokens, on_delta=lambda r: streamed.__setitem__(r.request_id, len(r.tokens))))
                for i, p in enumerate(batch)]
            while sum(1 for k in streamed.values() if k >= 2) < n // 2:
                assert not any(t.done() for t in tasks), "a request finished before the fault"
                await asyncio.sleep(0.02)
            ray.kill(ray.get_actor("pdserve-gen-0.rank1", namespace="pdserve"), no_restart=True)
            return await asyncio.gather(*tasks)

    results = U.run(go(), 240)
    assert [r.code for r in results] == [None] * n, [(r.request_id, r.details) for r in results if r.code]
    assert [r.tokens for r in results] == expected  # no duplicate, no gap, same tokens
    assert sum(r.last.timings.retries > 0 for r in results) >= 1
    U.wait_for(lambda: ray.get(cl.router.debug_state.remote(), timeout=U.RAY_TIMEOUT_S)["restarts"]
               .get("gen-0", 0) >= 1, 120, "gen-0 to restart")
    U.wait_drained(cl)
    # nothing orphaned: the restarted group has exactly its two ranks and its one placement group
    assert pdserve_names() == ["pdserve-gen-0", "pdserve-gen-0.rank1", "pdserve-router"]
    assert sorted(placement_groups()) == ["pdserve-gen-0"]


@pytest.mark.parametrize("kwargs,says", [
    (dict(engine={**U.ENGINE, "tensor_parallel_size": 3}),
     ["--tensor-parallel-size 3", "does not divide 4 attention heads"]),
    (dict(generation_engine={"tensor_parallel_size": 16}),
     ["--generation-tensor-parallel-size 16", "16 CPUs on one node", "offers 8"]),
    (dict(num_generation_workers=5, engine={**U.ENGINE, "tensor_parallel_size": 2}, placement_timeout_s=3.0),
     ["was not placed within 3 s", "STRICT_PACK"]),
    (dict(num_context_workers=1, engine={**U.ENGINE, "tensor_parallel_size": 2}),
     ["--num-context-workers 0", "not available yet"]),
])
def test_bad_sizes_are_refused_at_launch_leaving_nothing(ray_cluster, model_dir, kwargs, says):
    kwargs = {"num_context_workers": 0, **kwargs}
    with pytest.raises(LaunchError) as err:
        U.start_cluster(model_dir, **kwargs)
    for words in says:
        assert words in str(err.value), str(err.value)
    assert pdserve_names() == []
    U.wait_for(lambda: not placement_groups(), 30, "the placement groups to go")

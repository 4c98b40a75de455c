"""Every KV transfer and every pause pdserve records is on the Ray dashboard.

A 1 context + 1 generation cluster runs a burst of requests with a generation pool small enough
that MAX_UTILIZATION pauses requests. Then the test reads what the dashboard shows, through
Ray's state API (the dashboard's own HTTP API, authenticated with the cluster's token):

- the task table: one ``kv_transfer req=<id> ctx-0->gen-0 blocks=N bytes=B`` task per transfer
  the generation worker recorded, FINISHED, and the "Log" of each task holds the context
  side's line with the duration and GB/s;
- a failed transfer (a send stalled past the transfer timeout) is a FAILED task whose error
  message gives the reason;
- the generation worker's actor log: one ``PAUSE req=<id>`` line per pause and one
  ``RESUME req=<id>`` line per resume, with the figures the worker recorded.

And in headless Chromium, as a person following the README: log in with the token, open the
job's Task Table and a transfer's Log, then the Actor Table -> pdserve-gen-0 -> Log.

What pdserve recorded comes from GetClusterStatus.recent_events (the workers' events, carried
by their heartbeats) and the workers' pause counters.
"""
from __future__ import annotations

import re

import pytest
from cluster_util import wait_for
from dashboard_util import _browser, _dashboard_url, _token, _xpath_literal

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
# A Ray of its own (conftest): the dashboard's task and actor lists show all its Ray has run.
OWN_RAY = True

GEN_ENGINE = dict(capacity_scheduler_policy="MAX_UTILIZATION", num_kv_blocks=24)
NUM_REQUESTS = 12
MAX_TOKENS = 16
TASK_FUNC = "ContextWorker.kv_transfer"
NAME = re.compile(r"kv_transfer req=(\S+) (\S+)->(\S+) blocks=(\d+) bytes=(\d+)$")


def _status(cl):
    from pdserve.cluster.client import Client

    with Client(f"127.0.0.1:{cl.port}") as client:
        return client.status()


def _address() -> str:
    """This test's Ray: other Ray instances may run on the host, so never auto-detect."""
    import ray

    return ray.get_runtime_context().gcs_address


def _transfer_tasks() -> list:
    """The dashboard's task table rows of kv_transfer calls (excluding cancels), each once."""
    from ray.util.state import list_tasks

    rows = list_tasks(address=_address(), filters=[("func_or_class_name", "=", TASK_FUNC)],
                      detail=True, limit=10_000, raise_on_missing_output=False)
    return [t for t in rows if NAME.match(t.name or "")]


def _actor_log(actor_name: str) -> str:
    from ray.util.state import get_log, list_actors

    actor = next(a for a in list_actors(address=_address(), filters=[("name", "=", actor_name)],
                                        detail=True) if a.state == "ALIVE")
    return "".join(get_log(address=_address(), actor_id=actor.actor_id, suffix="err",
                           tail=100_000, timeout=30))


@pytest.fixture(scope="module")
def loaded(clusters):
    """The cluster after the burst, drained: (cluster, status)."""
    import cluster_util as U

    cl = clusters(engine=U.ENGINE, generation_engine=GEN_ENGINE)
    results = U.burst(cl, "dash", U.prompts(NUM_REQUESTS, seed=11), MAX_TOKENS)
    assert all(r.code is None for r in results), [(r.request_id, r.details) for r in results]
    status = U.wait_drained(cl)
    gen = next(w for w in status.workers if w.worker_id == "gen-0")
    assert gen.pauses > 0, "the generation pool was sized to force pauses"
    # The last heartbeats carry the last events: wait until every transfer is recorded.
    def all_transfers():
        s = _status(cl)
        return s if _count(s, "TRANSFER") >= NUM_REQUESTS else None

    return cl, wait_for(all_transfers, 60.0, "every transfer event")


def _count(status, kind: str) -> int:
    return sum(e.kind == getattr(e, kind) for e in status.recent_events)


def test_every_transfer_is_a_task_with_its_request_bytes_and_outcome(loaded):
    cl, status = loaded
    transfers = [e for e in status.recent_events if e.kind == e.TRANSFER]
    assert len(transfers) == NUM_REQUESTS
    assert all(e.outcome == "COMPLETE" and e.bytes > 0 for e in transfers)
    # Each request's KV reached the generation worker by a transfer, and the router says so.
    assert status.totals.kv_paths.transferred == NUM_REQUESTS

    # Task events reach the dashboard within a second or so; wait until all have finished.
    def all_tasks_finished():
        t = _transfer_tasks()
        return t if len(t) >= NUM_REQUESTS and all(x.state == "FINISHED" for x in t) else None

    tasks = wait_for(all_tasks_finished, 60.0, "kv_transfer tasks on the dashboard")
    by_request = {}
    for task in tasks:
        req, ctx, gen, blocks, nbytes = NAME.match(task.name).groups()
        by_request[req] = (ctx, gen, int(blocks), int(nbytes), task)
    assert len(by_request) == len(tasks) == NUM_REQUESTS
    for e in transfers:
        ctx, gen, blocks, nbytes, task = by_request[e.request_id]
        assert (ctx, gen, blocks, nbytes) == (e.ctx_worker_id, e.gen_worker_id, e.blocks, e.bytes)
        assert task.state == "FINISHED"

    # The row's "Log" link: the context side's line with what the send measured.
    from ray.util.state import get_log

    for e in transfers[:3]:
        task = by_request[e.request_id][4]
        text = "".join(get_log(address=_address(), task_id=task.task_id, suffix="err", timeout=30))
        assert f"KV send req={e.request_id} ctx-0->gen-0: {e.blocks} blocks" in text, text
        assert "GB/s" in text and text.rstrip().endswith("SENT"), text


def test_every_pause_and_resume_is_on_the_generation_workers_log(loaded):
    cl, status = loaded
    gen = next(w for w in status.workers if w.worker_id == "gen-0")
    pauses = [e for e in status.recent_events if e.kind == e.PAUSE]
    resumes = [e for e in status.recent_events if e.kind == e.RESUME]
    assert len(pauses) == gen.pauses
    assert len(resumes) == gen.pauses  # every paused request ran to the end
    assert {(e.request_id, e.pause_index) for e in resumes} == {(e.request_id, e.pause_index) for e in pauses}

    def full_log():
        t = _actor_log("pdserve-gen-0")
        return t if t.count("RESUME req=") >= len(resumes) else None

    log_text = wait_for(full_log, 60.0, "the pauses on the actor log")
    assert log_text.count("PAUSE req=") == len(pauses)
    for e in pauses:
        line = (f"PAUSE req={e.request_id} on gen-0: policy MAX_UTILIZATION, "
                f"{e.generated_tokens} tokens generated, {e.blocks_freed} KV blocks freed "
                f"(pause {e.pause_index};")
        assert line in log_text, line
        assert e.policy == "MAX_UTILIZATION" and e.blocks_freed > 0
    for e in resumes:
        assert re.search(rf"RESUME req={re.escape(e.request_id)} on gen-0 after [\d.]+ s paused "
                         rf"\(pause {e.pause_index}\)", log_text), e.request_id
    # The transfers are on the generation worker's log too.
    assert log_text.count("KV receive req=") == NUM_REQUESTS


def test_actors_have_their_class_names_and_reprs(loaded):
    from ray.util.state import list_actors

    actors = {a.name: a for a in list_actors(address=_address(), detail=True) if a.state == "ALIVE"}
    router, ctx, gen = actors["pdserve-router"], actors["pdserve-ctx-0"], actors["pdserve-gen-0"]
    assert (router.class_name, ctx.class_name, gen.class_name) == (
        "RouterActor", "ContextWorker", "GenerationWorker")
    assert router.repr_name.startswith("RouterActor(gRPC 127.0.0.1:"), router.repr_name
    assert (ctx.repr_name, gen.repr_name) == ("ContextWorker(ctx-0)", "GenerationWorker(gen-0)")


# ---------------------------------------------------------------------- in a real browser


def test_a_person_finds_transfers_and_pauses_in_the_dashboard(loaded):
    """What the README and the demo tell a person to do, in Chromium: log in with the token,
    open the job, the Task Table (a transfer's row, its Log with GB/s), then the Actor Table ->
    pdserve-gen-0 -> Log (a pause's line)."""
    import ray
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    cl, status = loaded
    pause = next(e for e in status.recent_events if e.kind == e.PAUSE)
    job_id = ray.get_runtime_context().get_job_id()
    browser = _browser()
    try:
        wait = WebDriverWait(browser, 30)

        def text(s: str):
            return wait.until(EC.element_to_be_clickable(
                (By.XPATH, f"//*[normalize-space(text())={_xpath_literal(s)}]")))

        def body_has(s: str) -> bool:
            return wait.until(lambda b: s in b.find_element(By.TAG_NAME, "body").text)

        browser.get(f"{_dashboard_url()}/#/jobs/{job_id}")
        login = wait.until(EC.visibility_of_element_located((By.CSS_SELECTOR, ".MuiDialog-root input")))
        login.send_keys(_token())
        browser.find_element(By.XPATH, "//button[normalize-space()='Submit' or normalize-space()='SUBMIT']").click()

        def click(element) -> None:  # as a person would: scrolled into view first
            browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
            wait.until(EC.element_to_be_clickable(element)).click()

        # Transfers: the job page's Task Table. A kv_transfer row names the request, the
        # workers, blocks and bytes of one recorded transfer, and says FINISHED.
        recorded = {(e.request_id, e.blocks, e.bytes) for e in status.recent_events
                    if e.kind == e.TRANSFER}
        click(text("Task Table"))
        row = wait.until(EC.visibility_of_element_located(
            (By.XPATH, "//tr[.//*[starts-with(normalize-space(text()), 'kv_transfer req=')]]")))
        cell = row.find_element(By.XPATH, ".//*[starts-with(normalize-space(text()), 'kv_transfer req=')]")
        req, ctx, gen, blocks, nbytes = NAME.match(" ".join(cell.text.split())).groups()
        assert (ctx, gen) == ("ctx-0", "gen-0") and (req, int(blocks), int(nbytes)) in recorded, cell.text
        assert "FINISHED" in row.text, row.text
        click(row.find_element(By.XPATH, ".//*[normalize-space(text())='Log']"))
        assert body_has(f"KV send req={req} ctx-0->gen-0: {blocks} blocks")
        assert "GB/s" in browser.find_element(By.TAG_NAME, "body").text

        # Pauses: back to the job, Actor Table -> pdserve-gen-0 -> Log (the STDERR tab).
        browser.get(f"{_dashboard_url()}/#/jobs/{job_id}")
        click(text("Actor Table"))
        actor = wait.until(EC.visibility_of_element_located(
            (By.XPATH, "//tr[.//*[normalize-space(text())='pdserve-gen-0']]")))
        click(actor.find_element(By.XPATH, ".//*[normalize-space(text())='Log']"))
        assert body_has(f"PAUSE req={pause.request_id} on gen-0: policy MAX_UTILIZATION, "
                        f"{pause.generated_tokens} tokens generated, {pause.blocks_freed} KV blocks freed")
    except Exception:
        browser.save_screenshot("/tmp/pdserve-dashboard-test.png")
        raise
    finally:
        browser.quit()


# Last: it launches a cluster with other settings, which replaces the loaded one.
def test_a_failed_transfer_is_a_failed_task_with_its_reason(clusters):
    """A send stalled past the transfer timeout: the generation side times out and cancels; the
    context worker's kv_transfer task fails with the reason, and the router's retry still
    completes the request."""
    import ray

    import cluster_util as U

    cl = clusters(engine=U.ENGINE, transfer_timeout_s=2.0)
    ctx = cl.workers["ctx-0"]
    ray.get(ctx.test_hook.remote("stall_send", 4.0), timeout=30)
    try:
        async def one():
            async with U.channel(cl.port) as ch:
                return await U.generate(U.stub_of(ch), "stalled", U.prompts(1, seed=5)[0], 4)

        result = U.run(one(), timeout_s=120)
    finally:
        ray.get(ctx.test_hook.remote("stall_send", 0.0), timeout=30)
    assert result.code is None, result.details
    def with_failure():
        s = _status(cl)
        return s if any(e.kind == e.TRANSFER and e.outcome != "COMPLETE" for e in s.recent_events) else None

    status = wait_for(with_failure, 60.0, "the failed transfer event")
    failed = [e for e in status.recent_events
              if e.kind == e.TRANSFER and e.request_id == "stalled" and e.outcome != "COMPLETE"]
    assert failed and failed[0].reason

    from ray.util.state import list_tasks

    def failed_tasks():
        rows = list_tasks(address=_address(), filters=[("func_or_class_name", "=", TASK_FUNC)],
                          detail=True, limit=10_000, raise_on_missing_output=False)
        return [t for t in rows if (t.name or "").startswith("kv_transfer req=stalled ")
                and t.state == "FAILED"]

    task = wait_for(failed_tasks, 60.0, "the FAILED kv_transfer task")[0]
    assert "KV transfer of req=stalled to gen-0 failed" in (task.error_message or ""), task.error_message

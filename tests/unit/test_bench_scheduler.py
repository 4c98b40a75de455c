"""bench/scheduler.py's live mode: the state it times the step on changes between repeats as
serving changes it (the radix tree's version moves, requests finish and arrive), while the
population and the shape stay what was asked. No timing is asserted."""
from __future__ import annotations

import json

from pdserve.bench import scheduler as bench
from pdserve.scheduler import CapacitySchedulerPolicy, LlmRequestState


def _generating(active) -> int:
    return sum(r.state == LlmRequestState.GENERATION_IN_PROGRESS for r in active)


def test_live_state_changes_the_tree_between_steps_and_keeps_the_shape():
    n, decoding = 64, 48
    scheduler, active = bench.build(n, CapacitySchedulerPolicy.MAX_UTILIZATION, decoding=decoding)
    kv = scheduler.kv_cache_manager
    live = bench.LiveState(scheduler, active, n, decoding)
    versions, ids_seen, reused = [], {r.request_id for r in active}, 0
    for _ in range(12):
        versions.append(kv._tree.version)
        out = scheduler.schedule(active, set())
        # The step only decides: the tree is as it was until the state is advanced.
        assert kv._tree.version == versions[-1]
        live.advance(out)
        assert len(active) == n
        assert len({r.request_id for r in active}) == n
        assert _generating(active) <= decoding
        reused += sum(r.prepopulated_prompt_len > 0 for r in out.context_requests)
        ids_seen.update(r.request_id for r in active)
        kv.check_invariants()
    versions.append(kv._tree.version)
    # Every repeat saw a tree the previous step's bookkeeping changed.
    assert all(a != b for a, b in zip(versions, versions[1:]))
    assert live.version_changes == live.steps == 12
    # Requests left and others arrived (as many), and some arrivals reused a cached prefix.
    assert live.finished > 0 and live.arrivals == live.finished
    assert len(ids_seen) == n + live.arrivals
    assert reused > 0
    # The shape holds: once the set-up's prefills are through, as many generate as asked.
    assert _generating(active) == decoding


def test_the_table_and_json_carry_static_and_live_figures(tmp_path, capsys):
    path = tmp_path / "scheduler.json"
    assert bench.main(["--sizes", "64", "--decoding", "3/4", "--repeats", "3", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["policy"] for r in rows} == {p.name for p in CapacitySchedulerPolicy}
    for row in rows:
        assert row["median_us"] > 0 and row["live_median_us"] > 0
        assert row["live_steps"] == 3 + 3  # warm-up and timed steps
        if row["policy"] != "STATIC_BATCH":
            # Each step's stored prefills and finished requests changed the tree. (STATIC_BATCH
            # admits nothing while its batch decodes, so its tree changes only as that batch
            # finishes, as it does in serving.)
            assert row["live_version_changes"] == row["live_steps"]
    header = capsys.readouterr().out
    assert " static " in header and " live " in header

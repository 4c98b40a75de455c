"""workers/engine/events.py: the line a person reads and the record the router gets for each KV
transfer, pause and resume."""
from __future__ import annotations

import logging

from pdserve.workers.engine import events as E


def test_transfer_task_name_and_lines_carry_what_the_dashboard_shows():
    assert (E.transfer_task_name("r-1", "ctx-0", "gen-1", 12, 1572864)
            == "kv_transfer req=r-1 ctx-0->gen-1 blocks=12 bytes=1572864")
    ok = E.transfer_line("send", "r-1", "ctx-0", "gen-1", 12, 1_500_000, 0.003, "SENT")
    assert ok == "KV send req=r-1 ctx-0->gen-1: 12 blocks, 1.50 MB in 3.0 ms (0.50 GB/s): SENT"
    failed = E.transfer_line("receive", "r-2", "ctx-0", "gen-1", 3, 0, 2.0, "TIMED_OUT", "no data")
    assert failed.endswith("in 2000.0 ms (- GB/s): TIMED_OUT (no data)")
    assert E.label(7, None) == "#7" and E.label(7, "abc") == "abc"
    assert [E.human_bytes(n) for n in (512, 65536, 3_200_000, 5e12)] == [
        "512 B", "65.54 KB", "3.20 MB", "5000.00 GB"]


def test_records_are_drained_once_in_order_and_logged(caplog):
    ev = E.WorkerEvents("gen-0", keep=3)
    propagate = E.log.propagate
    with caplog.at_level(logging.INFO, logger="pdserve.events"):
        E.log.propagate = True  # caplog listens on the root logger
        try:
            ev.pause(client="a", policy="MAX_UTILIZATION", generated_tokens=5, blocks_freed=2,
                     pause_index=1)
            ev.resume(client="a", paused_seconds=0.25, pause_index=1, prefill_tokens=20)
            ev.transfer(client="b", ctx_worker_id="ctx-0", blocks=4, nbytes=4096, seconds=0.001,
                        outcome="COMPLETE")
        finally:
            E.log.propagate = propagate
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("PAUSE req=a on gen-0: policy MAX_UTILIZATION, 5 tokens generated, "
                        "2 KV blocks freed (pause 1; it will be prefilled again)")
    assert lines[1] == "RESUME req=a on gen-0 after 0.250 s paused (pause 1): re-prefilling 20 tokens"
    assert lines[2].startswith("KV receive req=b ctx-0->gen-0: 4 blocks")
    got = ev.drain()
    assert [e.kind for e in got] == ["pause", "resume", "transfer"]
    assert (got[2].request_id, got[2].gen_worker_id, got[2].bytes, got[2].outcome,
            got[2].reason) == ("b", "gen-0", 4096, "COMPLETE", "")
    assert ev.drain() == []
    # Bounded: a router that stops reading loses the oldest records, the worker does not grow.
    for i in range(5):
        ev.resume(client=str(i), paused_seconds=0.0, pause_index=1, prefill_tokens=1)
    assert [e.request_id for e in ev.drain()] == ["2", "3", "4"]
    assert ev.recorded == 8

"""`pdserve top` and `pdserve status` renderings, from ClusterStatus protos built by hand (no
cluster): 80 columns without a shortened or wrapped column header, rates from two snapshots,
the live loop surviving an unreachable router, and --json numbers as JSON numbers."""
from __future__ import annotations

import io
import json
import socket

import grpc
import pytest
from rich.console import Console

from pdserve.cli import main as cli, top, views
from pdserve.cluster.rpc import router_pb2 as pb

E = pb.ClusterEvent
LONG_WORKER = "generation-worker-with-a-rather-long-identifier-0"
LONG_REQUEST = "chatcmpl-" + "0123456789abcdef" * 4
T0 = 1_700_000_000.0

TOP_HEADERS = [
    ["worker", "role", "ok", "TP", "KV used/total", "run", "wait", "paused", "tok/s"],
    ["time", "request", "ctx -> gen", "blk", "bytes", "ms", "GB/s", "outcome"],
    ["time", "request", "worker", "policy", "tokens", "freed"],
    ["time", "request", "worker", "paused s", "pause #"],
]
STATUS_HEADERS = [["worker", "role", "ok", "KV free", "act", "queue", "paused", "pauses", "xfers",
                   "bytes", "quar"],
                  ["worker", "TP", "max prompt", "max seq", "batch", "step tok", "KV blocks", "blk tok"]]


def _worker(worker_id, role, *, generated=0, xfers=0, xfer_bytes=0, pauses=0, free=100, total=128,
            **kw) -> pb.WorkerStatus:
    return pb.WorkerStatus(
        worker_id=worker_id, role=role, healthy=kw.pop("healthy", True), free_kv_blocks=free,
        total_kv_blocks=total, generated_tokens=generated, pauses=pauses,
        transfers=pb.TransferStats(count=xfers, bytes=xfer_bytes, seconds=0.5, outcomes={"ok": xfers}),
        **kw)


def make_status(step: int = 0, *, events: bool = True) -> pb.ClusterStatus:
    """Three workers (one with a long id); ``step`` advances every counter: per step ctx-0
    generates 5 tokens, gen-0 100, the long one 50; each side records 2 transfers of 4 MB
    (sent on ctx-0, received on the generation workers); gen-0 pauses once."""
    workers = [
        _worker("ctx-0", pb.WORKER_ROLE_CONTEXT, generated=10 + 5 * step, xfers=4 + 2 * step,
                xfer_bytes=8_000_000 + 4_000_000 * step, active_requests=2,
                requests_by_state={"CONTEXT_INIT": 1, "DISAGG_CONTEXT_TRANS_IN_PROGRESS": 1}),
        _worker("gen-0", pb.WORKER_ROLE_GENERATION, generated=1000 + 100 * step, xfers=3 + step,
                xfer_bytes=6_000_000 + 2_000_000 * step, pauses=3 + step, free=3, active_requests=12,
                queue_depth=2, paused_requests=1,
                requests_by_state={"GENERATION_IN_PROGRESS": 10, "CONTEXT_INIT": 3,
                                   "DISAGG_GENERATION_INIT": 1}),
        _worker(LONG_WORKER, pb.WORKER_ROLE_GENERATION, generated=2**40 + 50 * step, xfers=1 + step,
                xfer_bytes=2_000_000 + 2_000_000 * step, total=100_000, free=20_000, quarantined_blocks=4,
                invariant_violations=["free 3 + used 4 != total 8"]),
    ]
    recent = []
    if events:
        recent = [
            E(kind=E.TRANSFER, time_unix=T0, request_id=LONG_REQUEST, worker_id="gen-0",
              ctx_worker_id="ctx-0", gen_worker_id="gen-0", blocks=12, bytes=96 * 1024, seconds=0.004,
              outcome="COMPLETE"),
            E(kind=E.PAUSE, time_unix=T0 + 1, request_id="req-7", worker_id="gen-0",
              policy="MAX_UTILIZATION", generated_tokens=17, blocks_freed=3),
            E(kind=E.TRANSFER, time_unix=T0 + 2, request_id="req-8", worker_id=LONG_WORKER,
              ctx_worker_id="ctx-0", gen_worker_id=LONG_WORKER, blocks=5, bytes=40_960, seconds=1.5,
              outcome="TIMED_OUT", reason="no byte landed within the lease"),
            E(kind=E.RESUME, time_unix=T0 + 3, request_id="req-7", worker_id="gen-0",
              paused_seconds=1.25, pause_index=1),
        ]
    totals = pb.RouterTotals(
        received=2**33, completed=90, failed=1, aborted=2, rejected=3, retries=1, in_flight=4,
        kv_paths=pb.KvPathTotals(transferred=80, local_prefill=5, prefix_cached=3, context_finished=2,
                                 failed=1))
    return pb.ClusterStatus(workers=workers, router_queue_depth=5, totals=totals,
                            context_policy="kv_cache_aware", generation_policy="least_loaded",
                            recent_events=recent)


def render(renderable) -> str:
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def header_lines(text: str) -> list[str]:
    """Each table's header row: the line just above its rule."""
    lines = text.splitlines()
    return [lines[i - 1] for i, line in enumerate(lines) if i > 0 and line.startswith("─")]


def column_text(text: str, headers: list[str], header: str) -> str:
    """Every cell of one column (of the table whose header row starts with ``headers``), read
    top to bottom and joined: a value folded over several lines comes back whole."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines)
             if i + 1 < len(lines) and lines[i + 1].startswith("─")
             and all(h in line for h in headers))
    start = lines[i].find(header)
    following = headers[headers.index(header) + 1:]
    end = lines[i].find(following[0], start + len(header)) if following else None
    return "".join(line[start:end].strip() for line in lines[i + 2:])


def assert_fits_80(text: str, tables: list[list[str]]) -> None:
    assert "…" not in text
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    headers = header_lines(text)
    assert len(headers) == len(tables), headers
    for line, expected in zip(headers, tables):
        at = 0
        for h in expected:  # every header whole, in order, on the one header line (not wrapped)
            found = line.find(h, at)
            assert found >= 0, (h, line)
            at = found + len(h)


# ---------------------------------------------------------------------- 80 columns

def test_top_fits_80_columns_with_every_header_whole():
    prev, cur = make_status(0), make_status(1)
    text = render(views.render_top(cur, views.compute_rates(prev, cur, 2.0), address="127.0.0.1:50051",
                                 interval_s=1.0, now=T0))
    assert_fits_80(text, TOP_HEADERS)
    for worker in ("ctx-0", "gen-0"):
        assert worker in text
    assert LONG_WORKER in column_text(text, TOP_HEADERS[0], "worker")  # folded in its cell, whole
    assert LONG_REQUEST in column_text(text, TOP_HEADERS[1], "request")
    assert "TIMED_OUT: no byte landed within the lease" in " ".join(text.split())
    assert "MAX_UTILIZATION" in text and "1.25" in text
    assert "96.0 KiB" in text and "40.0 KiB" in text
    assert "transferred 80" in text and "local 5" in text and "cached 3" in text
    assert "ctx-done 2" in text
    assert "completed 90" in text and "rejected 3" in text and "in flight 4" in text
    assert "violation" in text


def test_status_fits_80_columns_with_every_header_whole():
    status = make_status(3)
    status.max_input_len, status.max_seq_len, status.max_prompt_bytes = 2047, 2048, 10235
    status.workers[0].max_input_len, status.workers[0].max_num_tokens = 1999, 512
    text = render(views.render_status(status, address="127.0.0.1:50051"))
    assert_fits_80(text, STATUS_HEADERS)
    assert "prompt <= 2047 tokens" in text and "prompt + max_tokens <= 2048" in text
    assert "1999" in column_text(text, STATUS_HEADERS[1], "max prompt")
    assert "512" in column_text(text, STATUS_HEADERS[1], "step tok")
    assert "ctx-0" in text and "gen-0" in text
    assert LONG_WORKER in column_text(text, STATUS_HEADERS[0], "worker")
    assert "violation" in text and "free 3 + used 4 != total 8" in " ".join(text.split())
    assert "transferred 80" in text and "received 8589934592" in text
    assert "11.4 MiB" in text  # gen-0: 6 MB + 3 * 2 MB received


def test_top_without_events_and_with_a_status_not_yet_received():
    text = render(views.render_top(make_status(events=False), events=8, now=T0))
    assert_fits_80(text, TOP_HEADERS[:1])
    assert "transfers 0" in text
    text = render(views.render_top(None, error="UNAVAILABLE: failed to connect", now=T0))
    assert "router unreachable: UNAVAILABLE: failed to connect" in text


def test_extreme_counters_still_fit():
    status = make_status(1)
    for w in status.workers:
        w.pauses, w.transfers.count, w.transfers.bytes = 2**50, 2**45, 2**60
        w.active_requests, w.queue_depth, w.paused_requests = 123_456, 654_321, 99_999
        w.free_kv_blocks, w.total_kv_blocks = 1, 999_999
    assert_fits_80(render(views.render_status(status)), STATUS_HEADERS)
    assert_fits_80(render(views.render_top(status, views.compute_rates(make_status(0), status, 0.001))),
                   TOP_HEADERS)


# ---------------------------------------------------------------------- numbers

def test_rates_from_two_snapshots_over_the_elapsed_time():
    first = views.compute_rates(None, make_status(0), None)
    assert first.tokens_per_s == {"ctx-0": None, "gen-0": None, LONG_WORKER: None}
    assert first.transfers_per_s is None and first.gbytes_per_s is None and first.pauses_per_min is None

    r = views.compute_rates(make_status(0), make_status(2), 4.0)
    assert r.tokens_per_s == {"ctx-0": 2.5, "gen-0": 50.0, LONG_WORKER: 25.0}
    assert r.cluster_tokens_per_s == pytest.approx(77.5)
    # generation workers only: gen-0 +2 and the long one +2 transfers; +4 MB + 4 MB
    assert r.transfers_per_s == pytest.approx(1.0)
    assert r.gbytes_per_s == pytest.approx(8e6 / 4.0 / 1e9)
    assert r.pauses_per_min == pytest.approx(2 * 60 / 4.0)

    text = render(views.render_top(make_status(2), r, now=T0))
    row = next(line for line in text.splitlines() if line.startswith("gen-0"))
    assert row.split()[-1] == "50.0"
    assert "tok/s 77.5" in text and "transfers/s 1.0" in text and "GB/s 0.002" in text
    assert "pauses/min 30.0" in text

    first_text = render(views.render_top(make_status(0), first, now=T0))
    row = next(line for line in first_text.splitlines() if line.startswith("gen-0"))
    assert row.split()[-1] == "-"


def test_a_counter_that_went_backwards_gives_no_rate():
    r = views.compute_rates(make_status(5), make_status(1), 1.0)
    assert r.tokens_per_s["gen-0"] is None and r.cluster_tokens_per_s is None


def test_request_counts_are_disjoint():
    gen0 = make_status().workers[1]
    c = views.request_counts(gen0)
    # pre-token states: CONTEXT_INIT 3 + DISAGG_GENERATION_INIT 1 = 4, less 1 paused
    assert (c.run, c.wait, c.paused) == (10, 3, 1)
    assert c.run + c.wait + c.paused == gen0.active_requests + gen0.queue_depth


def test_human_units():
    assert views.human_bytes(512) == "512 B"
    assert views.human_bytes(96 * 1024) == "96.0 KiB"
    assert views.human_bytes(3 * 2**30) == "3.0 GiB"
    assert views.count(999_999) == "999999" and views.count(1_234_567) == "1.235M"


# ---------------------------------------------------------------------- the loop

class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses"


def test_state_keeps_the_last_status_through_errors_and_rates_use_real_time():
    state = top.TopState(address="h:1")
    state.record(_Unavailable(), at=0.0)
    assert "router unreachable: UNAVAILABLE" in render(state.render(now=T0))
    state.record(make_status(0), at=1.0)
    state.record(_Unavailable(), at=2.0)
    text = render(state.render(now=T0))
    assert "router unreachable" in text and "gen-0" in text  # the last status stays on screen
    state.record(make_status(3), at=7.0)  # 6 s after the previous good snapshot
    assert state.error is None and state.rates.tokens_per_s["gen-0"] == pytest.approx(50.0)


def test_run_top_once_polls_twice_interval_apart():
    results = [make_status(0), make_status(1)]
    clock = iter([10.0, 12.0])
    slept = []
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    rc = top.run_top(lambda: results.pop(0), top.TopState(), interval_s=2.0, once=True, console=console,
                     clock=lambda: next(clock), sleep=slept.append)
    assert rc == 0 and slept == [2.0] and not results
    text = console.export_text()
    assert "tok/s 77.5" in text  # (5 + 100 + 50) tokens over the 2 s between the two polls
    assert_fits_80(text, TOP_HEADERS)


def test_live_loop_survives_unavailable_and_ctrl_c_exits_0():
    polls = [_Unavailable(), make_status(0), _Unavailable(), make_status(1)]

    def poll():
        if not polls:
            raise KeyboardInterrupt
        return polls.pop(0)

    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    rc = top.run_top(poll, top.TopState(), interval_s=0.0, once=False, console=console,
                     sleep=lambda s: None)
    assert rc == 0 and not polls


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_top_once_against_no_router_shows_the_error(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rc = cli.main(["top", "--once", "--port", str(_closed_port()), "--interval", "0.05"])
    out = capsys.readouterr().out
    assert rc == 1 and "router unreachable: UNAVAILABLE" in out


def test_top_is_a_registered_command(capsys):
    assert "top" in cli.COMMANDS
    assert cli.main(["--help"]) == 0
    assert "\n  top " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["top", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--interval", "--events", "--once"):
        assert flag in out


# ---------------------------------------------------------------------- --json

def test_json_numbers_are_numbers():
    status = make_status(1)
    status.recent_events[1].request_id = "12345"  # a string that looks numeric stays a string
    data = json.loads(json.dumps(views.status_to_dict(status)))
    gen = {w["workerId"]: w for w in data["workers"]}["gen-0"]
    for key in ("pauses", "generatedTokens", "contextTokens", "freeKvBlocks", "activeRequests",
                "pausedRequests"):
        assert isinstance(gen[key], int), (key, gen[key])
    assert gen["pauses"] == 4 and gen["contextTokens"] == 0  # zero values are present
    assert isinstance(gen["transfers"]["count"], int) and isinstance(gen["transfers"]["bytes"], int)
    assert gen["transfers"]["outcomes"] == {"ok": 4}
    assert gen["requestsByState"]["CONTEXT_INIT"] == 3
    assert gen["role"] == "WORKER_ROLE_GENERATION"
    totals = data["totals"]
    assert totals["received"] == 2**33 and isinstance(totals["completed"], int)
    assert all(isinstance(v, int) for v in totals["kvPaths"].values())
    assert totals["kvPaths"]["transferred"] == 80
    events = data["recentEvents"]
    assert isinstance(events[0]["bytes"], int) and events[0]["bytes"] == 96 * 1024
    assert events[1]["requestId"] == "12345"
    assert events[0]["kind"] == "TRANSFER"
    assert {w["workerId"] for w in data["workers"]} == {"ctx-0", "gen-0", LONG_WORKER}


def test_status_json_help_documents_the_field_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "camelCase" in out and "JSON number" in out


def test_status_shows_each_workers_node_when_known():
    status = make_status(3)
    plain = render(views.render_status(status))
    assert "node IP" not in plain  # no node known (a status without them): no table
    for i, w in enumerate(status.workers):
        w.node_id, w.node_ip = f"{i:02x}" * 28, f"10.0.0.{i + 1}"
    text = render(views.render_status(status, address="127.0.0.1:50051"))
    nodes = ["worker", "node IP", "Ray node id"]
    assert_fits_80(text, STATUS_HEADERS + [nodes])
    ids = "".join(column_text(text, nodes, "Ray node id").split())  # folded ids, rejoined
    for i, w in enumerate(status.workers):
        assert f"10.0.0.{i + 1}" in column_text(text, nodes, "node IP")
        assert f"{i:02x}" * 28 in ids


def test_status_shows_each_generation_workers_kv_pairs():
    status = make_status(3)
    assert "KV pairs" not in render(views.render_status(status))  # none reported: no line
    status.workers[1].kv_pairs.update({"ctx-0": "ready", "ctx-1": "opening"})
    status.workers[2].kv_pairs.update({"ctx-0": "down"})
    text = render(views.render_status(status))
    assert "KV pairs gen-0: ctx-0 ready, ctx-1 opening" in text
    assert f"KV pairs {LONG_WORKER}: ctx-0 down" in " ".join(text.split())


def test_status_and_top_show_the_model_and_its_dtype():
    status = make_status(3)
    assert "dtype" not in render(views.render_status(status))  # none reported: no line
    hub = "Qwen/Qwen3-0.6B"
    for w in status.workers:
        w.model, w.dtype = hub, "bfloat16"
    for text in (render(views.render_status(status)), render(views.render_top(status, now=T0))):
        lines = [line for line in text.splitlines() if line.startswith("model")]
        assert lines == [f"model    {hub}  dtype bfloat16"]  # one line: every worker runs it
    assert_fits_80(render(views.render_status(status)), STATUS_HEADERS)
    assert_fits_80(render(views.render_top(status, now=T0)), TOP_HEADERS)
    # A mixed cluster shows each worker's model and dtype.
    status.workers[0].model, status.workers[0].dtype = "/models/llama-3-8b", "float16"
    text = " ".join(render(views.render_status(status)).split())
    assert "model ctx-0: /models/llama-3-8b dtype float16" in text
    assert f"model gen-0: {hub} dtype bfloat16" in text
    assert f"model {LONG_WORKER}: {hub} dtype bfloat16" in text


def test_the_status_proto_carries_each_workers_model_and_dtype():
    from pdserve.cluster.front.grpc.convert import worker_status_proto
    from pdserve.cluster.router.outputs import WorkerSnapshot
    from pdserve.transport.requests import WorkerInfo

    info = WorkerInfo(worker_id="gen-0", role="generation", pid=1, num_kv_blocks=64,
                      tokens_per_block=16, max_batch_size=8, max_input_len=100, max_seq_len=128,
                      max_num_tokens=256, vocab_size=1000, endpoint="", incarnation=0,
                      request_endpoint="", request_token="", model="Qwen/Qwen3-0.6B",
                      dtype="bfloat16")
    out = worker_status_proto(WorkerSnapshot(worker_id="gen-0", info=info, status=None,
                                             healthy=False, status_age_s=0.0, missing="not yet"))
    assert (out.model, out.dtype) == ("Qwen/Qwen3-0.6B", "bfloat16")

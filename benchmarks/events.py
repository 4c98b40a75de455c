"""What making transfers and pauses visible costs a worker's step loop.

A pause-heavy workload (MAX_UTILIZATION, a KV pool that holds a fraction of the batch) runs
through the real core with the built-in tiny model. The engine core's ``WorkerEvents`` is
replaced by one that times each of its calls (the log line to a file, as a worker actor writes
to its stderr, plus the record for the router), and once per 0.5 s of work the worker's
heartbeat status is built (``host.worker_status``) and encoded as the request channel does; after
each step the prefix cache's KV events are drained and encoded as a ``KvEvents`` frame, as the
channel server does, and each report of an event by the radix tree is timed. Printed:

- events per step, and microseconds per event (pause, resume);
- microseconds per heartbeat status, and that cost spread over the steps of 0.5 s;
- the added time as a share of the mean step time.

Transfer events cost the same as a pause line on the generation side; the kv_transfer task's
name is built once per transfer (a format call) and is measured with the rest of the Ray call
in benchmarks/transfer.py. Run: ``python benchmarks/events.py [--requests N] [--json FILE]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    from pdserve.traces import fit_scale, load_trace, synth_prompt
    from pdserve.cluster.launch import builtin_model_dir
    from pdserve.workers.engine import events as E
    from pdserve.workers.config import EngineConfig
    from pdserve.scheduler.kv_events import KVEventLog
    from pdserve.transport.requests import Heartbeat, KvEvents, encode_frame
    from pdserve.workers.engine.build import build_engine_core
    from pdserve.workers.process.host import worker_status
    from pdserve.workers.runner.sampling import SamplingParams
    from pdserve.scheduler import LlmRequest

    class TimedEvents(E.WorkerEvents):
        def __init__(self, worker_id: str) -> None:
            super().__init__(worker_id)
            self.seconds: dict[str, float] = {}
            self.calls: dict[str, int] = {}

        def _timed(self, kind: str, fn, **kw) -> None:
            t0 = time.perf_counter()
            fn(**kw)
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
            self.calls[kind] = self.calls.get(kind, 0) + 1

        def pause(self, **kw) -> None:
            self._timed("pause", super().pause, **kw)

        def resume(self, **kw) -> None:
            self._timed("resume", super().resume, **kw)

        def transfer(self, **kw) -> None:
            self._timed("transfer", super().transfer, **kw)

    # The log line goes to a file, as a worker actor's stderr does.
    sink = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    E.log.addHandler(handler)
    E.log.setLevel(logging.INFO)
    E.log.propagate = False

    config = EngineConfig.from_kwargs(dict(
        tokens_per_block=16, max_batch_size=32, max_num_tokens=1024, num_kv_blocks=48,
        capacity_scheduler_policy="MAX_UTILIZATION",
        context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=64))
    _, core = build_engine_core(builtin_model_dir(), config)
    core.events = TimedEvents("gen-0")

    class TimedKVEventLog(KVEventLog):
        """The prefix cache's KV events, each report timed (a tuple and a list append)."""

        def __init__(self) -> None:
            super().__init__()
            self.calls, self.seconds = 0, 0.0

        def stored(self, parent, keys) -> None:
            t0 = time.perf_counter()
            super().stored(parent, keys)
            self.seconds += time.perf_counter() - t0
            self.calls += 1

        def removed(self, keys) -> None:
            t0 = time.perf_counter()
            super().removed(keys)
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    kv_log = TimedKVEventLog()
    core.kv.use_event_log(kv_log)

    rows = load_trace("azure_llm_2023_conv.csv", args.requests)
    scale = fit_scale(rows, 160, args.max_tokens)
    for i, row in enumerate(rows):
        request = LlmRequest(i + 1, synth_prompt(row, i, scale, vocab=(3, 259)), args.max_tokens,
                             client_id=f"bench-{i}")
        core.add_request(request, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                     ignore_eos=True))

    steps, step_seconds, status_seconds, statuses = 0, 0.0, 0.0, 0
    kv_batches, kv_blocks, kv_send_seconds = 0, 0, 0.0
    next_status = time.monotonic()
    while core.has_work:
        t0 = time.perf_counter()
        core.step()
        step_seconds += time.perf_counter() - t0
        steps += 1
        t0 = time.perf_counter()  # what the channel server does after each step
        batch, _ = kv_log.drain()
        if batch:
            encode_frame(KvEvents(kv_batches, batch))
            kv_batches += 1
            kv_blocks += sum(len(getattr(e, "keys", ())) for e in batch)
        kv_send_seconds += time.perf_counter() - t0
        if time.monotonic() >= next_status:  # the heartbeat's share, every 0.5 s of work
            next_status = time.monotonic() + 0.5
            t0 = time.perf_counter()
            status = worker_status(core, "gen-0", "generation", config, incarnation=1,
                                   healthy=True, drain_events=True)
            encode_frame(Heartbeat(status))
            status_seconds += time.perf_counter() - t0
            statuses += 1
    sink.close()
    os.unlink(sink.name)

    ev: TimedEvents = core.events
    events = sum(ev.calls.values())
    event_seconds = sum(ev.seconds.values())
    mean_step = step_seconds / max(1, steps)
    figures = {
        "requests": args.requests, "steps": steps, "mean_step_ms": 1e3 * mean_step,
        "pauses": ev.calls.get("pause", 0), "resumes": ev.calls.get("resume", 0),
        "events_per_step": events / max(1, steps),
        "us_per_pause": 1e6 * ev.seconds.get("pause", 0.0) / max(1, ev.calls.get("pause", 0)),
        "us_per_resume": 1e6 * ev.seconds.get("resume", 0.0) / max(1, ev.calls.get("resume", 0)),
        "event_us_per_step": 1e6 * event_seconds / max(1, steps),
        "us_per_heartbeat_status": 1e6 * status_seconds / max(1, statuses),
        "heartbeat_us_per_step": 1e6 * status_seconds / max(1, steps),
        "kv_event_reports": kv_log.calls, "kv_event_blocks": kv_blocks, "kv_batches": kv_batches,
        "kv_report_us_per_step": 1e6 * kv_log.seconds / max(1, steps),
        "kv_send_us_per_step": 1e6 * kv_send_seconds / max(1, steps),
    }
    figures["overhead_share_of_step"] = (
        (figures["event_us_per_step"] + figures["heartbeat_us_per_step"]
         + figures["kv_report_us_per_step"] + figures["kv_send_us_per_step"]) / 1e6 / mean_step)
    print(f"pause-heavy run: {args.requests} requests, {steps} steps, mean step "
          f"{figures['mean_step_ms']:.2f} ms, {figures['pauses']} pauses, {figures['resumes']} resumes")
    print(f"events: {figures['events_per_step']:.3f} per step; {figures['us_per_pause']:.1f} us per "
          f"pause, {figures['us_per_resume']:.1f} us per resume; {figures['event_us_per_step']:.2f} "
          "us per step")
    print(f"heartbeat status (every 0.5 s): {figures['us_per_heartbeat_status']:.0f} us each, "
          f"{figures['heartbeat_us_per_step']:.2f} us per step")
    print(f"KV events: {kv_log.calls} reports ({kv_blocks} blocks) in {kv_batches} batches; reporting "
          f"{figures['kv_report_us_per_step']:.2f} us per step, draining and encoding "
          f"{figures['kv_send_us_per_step']:.2f} us per step")
    print(f"added per step: {100 * figures['overhead_share_of_step']:.3f} % of the mean step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

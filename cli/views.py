"""What ``pdserve top`` and ``pdserve status`` show, rendered from ``ClusterStatus`` protos.

Pure: it takes the protos (and, for rates, the time between two of them) and returns rich
renderables or plain values, so tests build statuses by hand and render them into a
``Console(width=80, record=True)``. ``top.py`` polls GetClusterStatus and redraws these.

Both views fit 80 columns without shortening a column header: headers are short (a legend line
explains them), numeric columns never wrap, and the free-text columns (worker and request ids,
event details) have a width cap and fold inside their cell instead of widening the table.

Definitions used by the views:

- **KV used** = total_kv_blocks - free_kv_blocks.
- **run / wait / paused** per worker (disjoint; they add up to active_requests + queue_depth):
  *wait* counts the live requests still in a pre-token state (CONTEXT_INIT,
  DISAGG_CONTEXT_INIT_AND_TRANS, DISAGG_GENERATION_INIT: queued on the worker, or admitted and
  waiting for a prefill slot, KV blocks or their KV transfer) less the paused ones (a paused
  request goes back to CONTEXT_INIT); *paused* = paused_requests; *run* = the rest of
  active_requests + queue_depth: requests past their first token (decoding, or receiving KV).
- **tok/s** = change of generated_tokens between two snapshots / the real time between them
  ('-' on the first snapshot, or when a counter went backwards: the worker restarted).
- **transfers/s, GB/s** = change of transfers.count / transfers.bytes summed over *generation*
  workers only: the router reports each worker's sends + receives, so counting the context side
  too would count every transfer twice. GB/s is 10**9 bytes per second; byte counts are shown
  in binary units (KiB, MiB, GiB).
- **pauses/min** = change of the workers' pauses counters, per minute.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from pdserve.cluster.rpc import router_pb2 as pb

DEFAULT_INTERVAL_S = 1.0
DEFAULT_EVENTS = 8
MIN_DEADLINE_S = 5.0  # every GetClusterStatus call: max(this, --interval)

ROLE_NAMES = {pb.WORKER_ROLE_CONTEXT: "ctx", pb.WORKER_ROLE_GENERATION: "gen"}
# Pre-token request states: queued or admitted but not yet through prefill / KV transfer.
WAITING_STATES = ("CONTEXT_INIT", "DISAGG_CONTEXT_INIT_AND_TRANS", "DISAGG_GENERATION_INIT")
EVENT_NAMES = {pb.ClusterEvent.TRANSFER: "transfer", pb.ClusterEvent.PAUSE: "pause",
               pb.ClusterEvent.RESUME: "resume"}
ID_WIDTH = 18  # worker / request id columns fold beyond this


# ---------------------------------------------------------------------- numbers

def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB."""
    n = float(n)
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def count(n: int) -> str:
    """A counter: exact up to 999999, then 4 significant digits with k/M/G/T (fits 7 columns)."""
    n = int(n)
    if abs(n) < 1_000_000:
        return str(n)
    for div, unit in ((1e3, "k"), (1e6, "M"), (1e9, "G"), (1e12, "T")):
        if abs(n) / div < 1000 or unit == "T":
            return f"{n / div:.4g}{unit}"
    raise AssertionError("unreachable")


def _rate(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if value >= 1_000_000:
        return count(int(value))
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def role_name(worker: Any) -> str:
    return ROLE_NAMES.get(worker.role, "?")


def kv_used(worker: Any) -> int:
    return max(int(worker.total_kv_blocks) - int(worker.free_kv_blocks), 0)


@dataclass(frozen=True)
class RequestCounts:
    run: int
    wait: int
    paused: int


def request_counts(worker: Any) -> RequestCounts:
    """run / wait / paused as the module docstring defines them."""
    pre_token = sum(int(worker.requests_by_state.get(s, 0)) for s in WAITING_STATES)
    paused = int(worker.paused_requests)
    wait = max(pre_token - paused, 0)
    run = max(int(worker.active_requests) + int(worker.queue_depth) - wait - paused, 0)
    return RequestCounts(run=run, wait=wait, paused=paused)


@dataclass
class Rates:
    """Rates between two snapshots; None where there is no previous snapshot (or no time)."""
    elapsed_s: float | None = None
    tokens_per_s: dict[str, float | None] = field(default_factory=dict)  # per worker id
    cluster_tokens_per_s: float | None = None
    transfers_per_s: float | None = None
    gbytes_per_s: float | None = None
    pauses_per_min: float | None = None


def _delta(cur: int, prev: int) -> int | None:
    d = int(cur) - int(prev)
    return d if d >= 0 else None  # a counter that went backwards: the worker restarted


def compute_rates(prev: Any | None, cur: Any, elapsed_s: float | None) -> Rates:
    """Rates from two ClusterStatus snapshots taken ``elapsed_s`` seconds apart."""
    rates = Rates(elapsed_s=elapsed_s, tokens_per_s={w.worker_id: None for w in cur.workers})
    if prev is None or elapsed_s is None or elapsed_s <= 0:
        return rates
    before = {w.worker_id: w for w in prev.workers}
    tokens = transfers = nbytes = pauses = 0
    tokens_known = transfers_known = pauses_known = False
    for w in cur.workers:
        p = before.get(w.worker_id)
        if p is None:
            continue
        d = _delta(w.generated_tokens, p.generated_tokens)
        if d is not None:
            rates.tokens_per_s[w.worker_id] = d / elapsed_s
            tokens += d
            tokens_known = True
        d = _delta(w.pauses, p.pauses)
        if d is not None:
            pauses += d
            pauses_known = True
        if w.role == pb.WORKER_ROLE_GENERATION:
            dc = _delta(w.transfers.count, p.transfers.count)
            db = _delta(w.transfers.bytes, p.transfers.bytes)
            if dc is not None and db is not None:
                transfers += dc
                nbytes += db
                transfers_known = True
    if tokens_known:
        rates.cluster_tokens_per_s = tokens / elapsed_s
    if transfers_known:
        rates.transfers_per_s = transfers / elapsed_s
        rates.gbytes_per_s = nbytes / elapsed_s / 1e9
    if pauses_known:
        rates.pauses_per_min = pauses * 60.0 / elapsed_s
    return rates


# ---------------------------------------------------------------------- tables

def _table(title: str | None = None) -> Table:
    return Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                 show_edge=False, pad_edge=False, padding=(0, 0), header_style="bold")


def _num(table: Table, header: str) -> None:
    """A numeric column: right-aligned, never wrapped, never narrower than its header."""
    table.add_column(header, justify="right", no_wrap=True, min_width=len(header))


def _text(table: Table, header: str, max_width: int | None = None, **kw: Any) -> None:
    """A text column: folds long values inside the cell (never '…'), never narrower than its
    header."""
    table.add_column(header, overflow="fold", min_width=len(header), max_width=max_width, **kw)


def _kv_bar(worker: Any, width: int = 10) -> Text:
    total, used = int(worker.total_kv_blocks), kv_used(worker)
    if total <= 0:
        return Text("-")
    frac = min(used / total, 1.0)
    filled = round(frac * width)
    style = "green" if frac < 0.7 else "yellow" if frac < 0.9 else "red"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {used}/{total}")
    return bar


def _health(worker: Any) -> Text:
    return Text("yes", style="green") if worker.healthy else Text("NO", style="bold red")


def workers_table(status: Any, rates: Rates | None) -> Table:
    table = _table()
    _text(table, "worker", ID_WIDTH)
    _text(table, "role")
    _text(table, "ok")
    _num(table, "TP")  # ranks the worker's model is split over (tensor parallelism)
    table.add_column("KV used/total", no_wrap=True, min_width=len("KV used/total"))
    for header in ("run", "wait", "paused", "tok/s"):
        _num(table, header)
    for w in status.workers:
        c = request_counts(w)
        tps = rates.tokens_per_s.get(w.worker_id) if rates is not None else None
        table.add_row(w.worker_id, role_name(w), _health(w), str(w.tensor_parallel_size or 1), _kv_bar(w),
                      count(c.run), count(c.wait), count(c.paused), _rate(tps))
    return table


def _time_of_day(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t > 0 else "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def transfer_gbps(event: Any) -> str:
    return f"{event.bytes / event.seconds / 1e9:.2f}" if event.seconds > 0 else "-"


def transfer_failed(event: Any) -> bool:
    return event.outcome not in ("", "COMPLETE") or bool(event.reason)


def transfers_table(events: list) -> Table:
    table = _table("KV transfers")
    _text(table, "time", no_wrap=True)
    _text(table, "request", ID_WIDTH)
    _text(table, "ctx -> gen", ID_WIDTH)
    for header in ("blk", "bytes", "ms", "GB/s"):
        _num(table, header)
    _text(table, "outcome")
    for e in events:
        outcome = Text(e.outcome or "?", style="red" if transfer_failed(e) else "green")
        table.add_row(_time_of_day(e.time_unix), e.request_id,
                      f"{e.ctx_worker_id or '?'} -> {e.gen_worker_id or e.worker_id or '?'}",
                      count(e.blocks), human_bytes(e.bytes), _ms(e.seconds), transfer_gbps(e), outcome)
    return table


def pauses_table(events: list) -> Table:
    table = _table("pauses")
    _text(table, "time", no_wrap=True)
    _text(table, "request", ID_WIDTH)
    _text(table, "worker", ID_WIDTH)
    _text(table, "policy", ID_WIDTH)
    _num(table, "tokens")
    _num(table, "freed")
    for e in events:
        table.add_row(_time_of_day(e.time_unix), e.request_id, e.worker_id, e.policy or "-",
                      count(e.generated_tokens), count(e.blocks_freed))
    return table


def resumes_table(events: list) -> Table:
    table = _table("resumes")
    _text(table, "time", no_wrap=True)
    _text(table, "request", ID_WIDTH)
    _text(table, "worker", ID_WIDTH)
    _num(table, "paused s")
    _num(table, "pause #")
    for e in events:
        table.add_row(_time_of_day(e.time_unix), e.request_id, e.worker_id, f"{e.paused_seconds:.2f}",
                      count(e.pause_index))
    return table


def event_parts(status: Any, n: int) -> list[RenderableType]:
    """The last ``n`` events, one small table per kind (each oldest first), and one line per
    failed transfer with its reason."""
    events = list(status.recent_events)[-n:] if n > 0 else []
    by_kind = {kind: [e for e in events if e.kind == kind] for kind in EVENT_NAMES}
    transfers = by_kind[pb.ClusterEvent.TRANSFER]
    pauses = by_kind[pb.ClusterEvent.PAUSE]
    resumes = by_kind[pb.ClusterEvent.RESUME]
    head = _line("events", f"last {len(events)} of {len(status.recent_events)}:",
                 f"transfers {len(transfers)}", f"pauses {len(pauses)}", f"resumes {len(resumes)}")
    parts: list[RenderableType] = [head]
    if transfers:
        parts.append(transfers_table(transfers))
        for e in transfers:
            if transfer_failed(e):
                reason = f": {e.reason}" if e.reason else ""
                parts.append(Text(f"failed transfer {e.request_id}: {e.outcome or '?'}{reason}",
                                  style="red"))
    if pauses:
        parts.append(pauses_table(pauses))
    if resumes:
        parts.append(resumes_table(resumes))
    return parts


def _line(label: str, *parts: str) -> Text:
    text = Text(f"{label:<9}", style="bold")
    text.append("  ".join(parts))
    return text


def router_lines(status: Any) -> list[Text]:
    t, k = status.totals, status.totals.kv_paths
    return [
        _line("router", f"queue {status.router_queue_depth}", f"in flight {t.in_flight}",
              f"received {t.received}", f"retries {t.retries}", f"fallbacks {t.fallbacks}",
              f"waits {t.worker_waits}"),
        _line("totals", f"completed {t.completed}", f"failed {t.failed}", f"aborted {t.aborted}",
              f"rejected {t.rejected}"),
        _line("KV paths", f"transferred {k.transferred}", f"local {k.local_prefill}",
              f"cached {k.prefix_cached}", f"ctx-done {k.context_finished}", f"failed {k.failed}"),
        _line("prefix", f"predicted exactly {t.prefix.exact}/{t.prefix.requests}",
              f"predicted {count(t.prefix.predicted_tokens)} tok",
              f"reused {count(t.prefix.reused_tokens)} tok"),
    ]


def model_lines(status: Any) -> list[Text]:
    """The model and dtype the workers run: one line when every worker that reports them runs
    the same pair (the usual cluster), else one per worker, so a mixed cluster shows its mix;
    none when no worker reports them (a router from before they were reported)."""
    known = [w for w in status.workers if w.model or w.dtype]
    pairs = {(w.model, w.dtype) for w in known}
    if not pairs:
        return []
    if len(pairs) == 1:
        model, dtype = pairs.pop()
        return [_line("model", model or "-", f"dtype {dtype or '-'}")]
    return [_line("model", f"{w.worker_id}: {w.model or '-'}", f"dtype {w.dtype or '-'}")
            for w in known]


def rates_line(rates: Rates | None) -> Text:
    r = rates or Rates()
    gbps = "-" if r.gbytes_per_s is None else f"{r.gbytes_per_s:.3f}"
    return _line("rates", f"tok/s {_rate(r.cluster_tokens_per_s)}",
                 f"transfers/s {_rate(r.transfers_per_s)}", f"GB/s {gbps}",
                 f"pauses/min {_rate(r.pauses_per_min)}")


TOP_LEGEND = ("run: past first token; wait: queued or before prefill/KV; paused: evicted, "
              "awaiting re-prefill; transfers counted on gen workers")


def render_top(status: Any | None, rates: Rates | None = None, *, address: str = "",
               events: int = DEFAULT_EVENTS, error: str | None = None,
               now: float | None = None, interval_s: float | None = None) -> RenderableType:
    """One frame of ``pdserve top``. ``status`` None: nothing received yet (``error`` says why);
    with ``error`` and a status, the status is the last one received (shown as stale)."""
    now = time.time() if now is None else now
    head = Text("pdserve top", style="bold")
    head.append(f"  {address}" if address else "")
    head.append(f"  {_time_of_day(now)}")
    if interval_s is not None:
        head.append(f"  every {interval_s:g}s")
    parts: list[RenderableType] = [head]
    if error:
        msg = Text(f"router unreachable: {error}", style="bold red")
        msg.append(" (retrying; below: the last status received)" if status is not None
                   else " (retrying)", style="red")
        parts.append(msg)
    if status is None:
        return Group(*parts)
    if status.context_policy or status.generation_policy:
        parts.append(_line("policies", f"context {status.context_policy or '-'}",
                           f"generation {status.generation_policy or '-'}"))
    parts.extend(model_lines(status))
    parts.append(workers_table(status, rates))
    parts.append(rates_line(rates))
    parts.extend(router_lines(status))
    violations = violation_lines(status)
    if violations:
        parts.extend(violations)
    parts.append(Text(TOP_LEGEND, style="dim"))
    if events > 0:
        parts.append(Text(""))
        parts.extend(event_parts(status, events))
    return Group(*parts)


# ---------------------------------------------------------------------- pdserve status

STATUS_LEGEND = ("act: active requests; paused: paused now; pauses: since start; xfers: KV "
                 "transfers sent + received; quar: quarantined KV blocks")


def security_lines(status: Any) -> list[Text]:
    """How the front doors are protected, and the unprotected-bind warnings (never a key)."""
    if not status.HasField("security"):
        return []  # a router from before front-door security
    s = status.security
    keys = (f"API keys {s.api_keys}" + (f" (<= {s.max_inflight_per_key} in flight each)"
                                         if s.max_inflight_per_key else "")) if s.api_keys else "no API key"
    if s.admin_api_keys:
        keys += f", admin keys {s.admin_api_keys}"
    tls = ("mutual TLS" if s.mutual_tls else "TLS") if s.tls else "no TLS"
    doors = [f"gRPC {s.grpc_address}"] + ([f"HTTP {s.http_address}"] if s.http_address else [])
    out = [_line("security", keys, tls, *doors)]
    out += [Text(f"WARNING: {w}", style="bold red") for w in s.warnings]
    return out


def violation_lines(status: Any) -> list[Text]:
    out = []
    for w in status.workers:
        for v in w.invariant_violations:
            out.append(Text(f"violation {w.worker_id}: {v}", style="bold red"))
        if w.unexpected_recomputes:
            out.append(Text(f"violation {w.worker_id}: {w.unexpected_recomputes} generation-only "
                            "request(s) prefilled without a pause", style="bold red"))
    return out


def status_table(status: Any) -> Table:
    table = _table()
    _text(table, "worker", ID_WIDTH)
    _text(table, "role")
    _text(table, "ok")
    for header in ("KV free", "act", "queue", "paused", "pauses", "xfers", "bytes", "quar"):
        _num(table, header)
    for w in status.workers:
        table.add_row(w.worker_id, role_name(w), _health(w), f"{w.free_kv_blocks}/{w.total_kv_blocks}",
                      count(w.active_requests), count(w.queue_depth), count(w.paused_requests),
                      count(w.pauses), count(w.transfers.count), human_bytes(w.transfers.bytes),
                      count(w.quarantined_blocks))
    return table


def limits_table(status: Any) -> Table:
    """Each worker's limits (pdserve status): its tensor-parallel ranks, the longest prompt,
    prompt + output, the batch, the tokens per step and the KV pool."""
    table = _table()
    _text(table, "worker", ID_WIDTH)
    for header in ("TP", "max prompt", "max seq", "batch", "step tok", "KV blocks", "blk tok"):
        _num(table, header)
    for w in status.workers:
        table.add_row(w.worker_id, str(w.tensor_parallel_size or 1), count(w.max_input_len), count(w.max_seq_len),
                      count(w.max_batch_size), count(w.max_num_tokens), count(w.total_kv_blocks),
                      count(w.tokens_per_block))
    return table


def nodes_table(status: Any) -> Table:
    """Where each worker runs (pdserve status): its Ray node's IP and id (the id folds in its
    cell; it is what the dashboard's Cluster page and `ray list nodes` show)."""
    table = _table()
    _text(table, "worker", ID_WIDTH)
    _text(table, "node IP", 15, no_wrap=False)
    _text(table, "Ray node id")
    for w in status.workers:
        table.add_row(w.worker_id, w.node_ip or "-", w.node_id or "-")
    return table


def kv_pair_lines(status: Any) -> list[Text]:
    """Each generation worker's KV pairs and their states; a pair that is not ready is shown
    in red (requests avoid it until it is set up again)."""
    lines = []
    for w in status.workers:
        if not w.kv_pairs:
            continue
        text = Text(f"KV pairs {w.worker_id}: ")
        for i, (ctx, state) in enumerate(sorted(w.kv_pairs.items())):
            text.append(", " if i else "")
            text.append(f"{ctx} {state}", style=None if state in ("ready", "lazy") else "red")
        lines.append(text)
    return lines


def render_status(status: Any, *, address: str = "") -> RenderableType:
    """What ``pdserve status`` prints."""
    head = Text("pdserve cluster", style="bold")
    head.append(f" at {address}" if address else "")
    parts: list[RenderableType] = [head]
    if status.context_policy or status.generation_policy:
        parts.append(_line("policies", f"context {status.context_policy or '-'}",
                           f"generation {status.generation_policy or '-'}"))
    parts.extend(model_lines(status))
    parts.append(status_table(status))
    parts.append(Text(STATUS_LEGEND, style="dim"))
    parts.append(limits_table(status))
    if any(w.node_id or w.node_ip for w in status.workers):
        parts.append(nodes_table(status))
    if status.max_input_len:
        parts.append(_line("accepts", f"prompt <= {count(status.max_input_len)} tokens",
                           f"prompt + max_tokens <= {count(status.max_seq_len)}",
                           f"text <= {human_bytes(status.max_prompt_bytes)}"))
    for w in status.workers:
        if w.requests_by_state:
            states = ", ".join(f"{k}={v}" for k, v in sorted(w.requests_by_state.items()))
            parts.append(Text(f"states {w.worker_id}: {states}"))
    parts.extend(kv_pair_lines(status))
    parts.extend(violation_lines(status))
    parts.extend(router_lines(status))
    parts.extend(security_lines(status))
    return Group(*parts)


# ---------------------------------------------------------------------- --json

_INT64_TYPES = None


def _int64_types() -> frozenset:
    global _INT64_TYPES
    if _INT64_TYPES is None:
        from google.protobuf.descriptor import FieldDescriptor as F

        _INT64_TYPES = frozenset({F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64,
                                  F.TYPE_SFIXED64})
    return _INT64_TYPES


def _unquote_int64(descriptor: Any, data: dict) -> dict:
    """MessageToDict writes 64-bit integers as strings (proto3 JSON); turn them back into ints,
    walking the message's descriptor (so string fields that look numeric stay strings)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for f in descriptor.fields:
        key = f.json_name if f.json_name in data else f.name
        if key not in data:
            continue
        value = data[key]
        if f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            if vf.type in _int64_types():
                data[key] = {k: int(v) for k, v in value.items()}
            elif vf.type == F.TYPE_MESSAGE:
                data[key] = {k: _unquote_int64(vf.message_type, v) for k, v in value.items()}
        elif f.type == F.TYPE_MESSAGE:
            if isinstance(value, list):
                data[key] = [_unquote_int64(f.message_type, v) for v in value]
            elif isinstance(value, dict):
                data[key] = _unquote_int64(f.message_type, value)
        elif f.type in _int64_types():
            data[key] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return data


def status_to_dict(message: Any) -> dict:
    """The status as ``pdserve status --json`` writes it: MessageToDict's field names (the
    proto's JSON names, camelCase: workerId, freeKvBlocks, kvPaths, recentEvents), enums by
    name, every field present even at its zero value, and 64-bit counters as JSON numbers."""
    from google.protobuf.json_format import MessageToDict

    try:
        data = MessageToDict(message, always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26
        data = MessageToDict(message, including_default_value_fields=True)
    return _unquote_int64(message.DESCRIPTOR, data)

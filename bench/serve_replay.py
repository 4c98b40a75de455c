"""The load generator of ``pdserve bench serve|compare``: sends a workload at its arrival times
to pdserve's router over gRPC (``replay``) or to any OpenAI-compatible server over HTTP
(``replay_openai``), streamed, and records what each client sees (``ServeRun``).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.workload import WorkItem


@dataclass(slots=True)
class ServeRun:
    label: str
    records: list[RequestRecord]
    samples: list[dict] = field(default_factory=list)  # GetClusterStatus over time
    wall_s: float = 0.0
    final_status: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- the client side

async def _replay(address: str, work: Sequence[WorkItem], *, label: str, timeout_s: float,
                  status_interval_s: float, progress: bool, warmup: int, connection=None) -> ServeRun:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.cluster.client import Client, Connection
    from pdserve.cluster.rpc import router_pb2 as pb
    from pdserve.cluster.rpc import router_pb2_grpc

    conn = connection or Connection.from_target(address)
    md = conn.metadata
    records = [RequestRecord(w.index, w.arrival_s, len(w.prompt), w.max_tokens) for w in work]
    samples: list[dict] = []
    tag = "".join(c if c.isalnum() or c in "._:-" else "-" for c in label)  # a valid request id part
    async with conn.aio_channel() as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(warmup):  # first calls pay one-time costs (threads, allocator, JIT paths)
            req = Client.build_request(list(work[i % len(work)].prompt[:32]), max_tokens=4,
                                       temperature=0.0, ignore_eos=True, request_id=f"warmup-{i}")
            async for _ in stub.Generate(req, timeout=timeout_s, metadata=md):
                pass
        bar = _progress(progress, label, len(work))
        t0 = time.monotonic()

        async def one(item: WorkItem, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
            rec.arrival_s = time.monotonic() - t0
            req = Client.build_request(item.prompt, max_tokens=item.max_tokens, temperature=0.0,
                                       ignore_eos=True, request_id=f"bench-{tag}-{item.index}")
            try:
                async for delta in stub.Generate(req, timeout=timeout_s, metadata=md):
                    now = time.monotonic() - t0
                    n = len(delta.token_ids)
                    if n:
                        rec.deltas.append((now, n))
                        rec.num_tokens += n
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                    if delta.finish_reason:
                        rec.finish_s = now
                        t = delta.timings
                        rec.queue_ms, rec.server_ttft_ms, rec.server_e2e_ms = t.queue_ms, t.ttft_ms, t.e2e_ms
                        rec.kv_bytes, rec.kv_ms, rec.pauses = t.kv_transfer_bytes, t.kv_transfer_ms, t.pauses
                        rec.local_prefill, rec.worker = t.local_prefill, t.gen_worker
                        rec.cached_tokens = delta.usage.cached_prompt_tokens
                        rec.predicted_tokens = t.prefix_predicted_tokens
                        rec.reused_tokens = t.prefix_reused_tokens
                        if delta.finish_reason not in ("length", "stop"):
                            rec.error = f"finish_reason={delta.finish_reason}"
            except grpc.aio.AioRpcError as exc:
                rec.error = f"{exc.code().name}: {exc.details()}"
            if bar is not None:
                bar[0].advance(bar[1])

        async def poll_status(stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    st = await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30, metadata=md)
                    samples.append(_sample(time.monotonic() - t0, st))
                except grpc.aio.AioRpcError:
                    pass
                try:
                    await asyncio.wait_for(stop.wait(), status_interval_s)
                except asyncio.TimeoutError:
                    pass

        stop = asyncio.Event()
        poller = asyncio.create_task(poll_status(stop))
        try:
            await asyncio.gather(*(one(w, r) for w, r in zip(work, records)))
        finally:
            stop.set()
            await poller
            if bar is not None:
                bar[0].stop()
        wall = time.monotonic() - t0
        final = MessageToDict(await stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30, metadata=md))
    return ServeRun(label, records, samples, wall, final)


# Chat prompts are text: each synthetic token id becomes one common word (most tokenizers give a
# common word with its leading space one token), so equal id prefixes stay equal text prefixes.
CHAT_WORDS = tuple("the of and to in is it that for on with as was at by be this from or have an are "
                   "not but had his they you were her she which their all there been one has more when "
                   "will would who so no if out up what about into than them can only other new some "
                   "time could these two may first then do any like my now over such our man me".split())


def words_for(token_ids: Sequence[int]) -> str:
    return " ".join(CHAT_WORDS[t % len(CHAT_WORDS)] for t in token_ids)


class OpenAIStreamCounter:
    """Counts one streamed OpenAI response (its SSE lines, as they arrive) into a RequestRecord.

    A chunk whose choice carries text is one delta; the first one is the first token. A byte-level
    model can emit tokens whose bytes are an incomplete UTF-8 character: the server holds their
    text back and sends a chunk with empty text, or none at all until the character completes or
    the stream ends. So a chunk with empty text (not chat's opening role chunk) is a token arrival
    too, and a stream whose only content is its finish chunk got its output then: the finish
    chunk is its first token, and its delta holds every token ``usage`` counts. The token count is
    ``usage.completion_tokens``; the last delta takes the tokens the chunks did not account for.
    """

    def __init__(self, rec: RequestRecord, endpoint: str) -> None:
        self.rec, self.chat = rec, endpoint == "chat"
        self.finish_chunk_s: float | None = None

    def line(self, line: bytes, now: float) -> None:
        if line.startswith(b"data: {"):
            self.chunk(json.loads(line[6:]), now)

    def chunk(self, chunk: dict[str, Any], now: float) -> None:
        rec = self.rec
        if "error" in chunk:
            rec.error = f"stream error: {(chunk['error'] or {}).get('message')}"
            return
        for choice in chunk.get("choices") or ():
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content")
                opening = "role" in delta and not text  # the role announcement: no token yet
            else:
                text, opening = choice.get("text"), False
            finish = choice.get("finish_reason")
            if text or (text is not None and not opening and not finish):
                rec.deltas.append((now, 1))
                if rec.first_token_s is None:
                    rec.first_token_s = now
            if finish:
                rec.finish_s = now
                if self.finish_chunk_s is None:
                    self.finish_chunk_s = now
                if finish not in ("length", "stop"):
                    rec.error = f"finish_reason={finish}"
        if chunk.get("usage"):
            usage = chunk["usage"]
            rec.num_tokens = usage["completion_tokens"]
            rec.prompt_len = usage["prompt_tokens"]
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        timings = chunk.get("pdserve_timings")
        if timings:
            rec.queue_ms, rec.server_ttft_ms = timings["queue_ms"], timings["ttft_ms"]
            rec.server_e2e_ms, rec.kv_bytes = timings["e2e_ms"], timings["kv_transfer_bytes"]
            rec.kv_ms, rec.pauses = timings["kv_transfer_ms"], timings["pauses"]
            rec.local_prefill, rec.worker = timings["local_prefill"], timings["gen_worker"]

    def close(self) -> None:
        """After the stream's last line."""
        rec = self.rec
        if rec.first_token_s is None and self.finish_chunk_s is not None and not rec.error:
            # every token's text was held back until the end: the output arrived with the finish
            rec.first_token_s = self.finish_chunk_s
            if rec.num_tokens > 0:
                rec.deltas.append((self.finish_chunk_s, rec.num_tokens))
        elif rec.deltas and rec.num_tokens > len(rec.deltas):
            # A chunk can carry several tokens (text held back for a multi-byte character):
            # the last delta takes the tokens the chunks did not account for.
            t, n = rec.deltas[-1]
            rec.deltas[-1] = (t, n + rec.num_tokens - len(rec.deltas))


async def _replay_openai(url: str, work: Sequence[WorkItem], *, endpoint: str, model: str | None, label: str,
                         timeout_s: float, progress: bool, warmup: int, api_key: str | None = None,
                         tls_ca: str | None = None) -> ServeRun:
    """The same replay against any OpenAI-compatible server: streamed /v1/completions (token-id
    prompts, exact lengths) or /v1/chat/completions (word prompts), ``ignore_eos`` and
    ``max_tokens`` forcing the output length, usage from ``stream_options.include_usage``. pdserve's
    own per-request figures are read from ``pdserve_timings`` when the server sends them."""
    import aiohttp

    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    records = [RequestRecord(w.index, w.arrival_s, len(w.prompt), w.max_tokens) for w in work]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    connector = None
    if tls_ca:
        import ssl

        connector = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=tls_ca))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers,
                                     connector=connector) as session:
        if model is None:
            async with session.get(f"{base}/models") as resp:
                model = (await resp.json())["data"][0]["id"]

        def body(item_prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
            out: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                                   "stream_options": {"include_usage": True}, "ignore_eos": True}
            if endpoint == "chat":
                out["messages"] = [{"role": "user", "content": words_for(item_prompt)}]
            else:
                out["prompt"] = list(item_prompt)
            return out

        path = f"{base}/{'chat/completions' if endpoint == 'chat' else 'completions'}"

        async def stream(item_prompt, max_tokens, rec: RequestRecord | None, t0: float) -> None:
            async with session.post(path, json=body(item_prompt, max_tokens)) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                counter = OpenAIStreamCounter(rec, endpoint) if rec is not None else None
                async for line in resp.content:
                    if counter is not None:
                        counter.line(line, time.monotonic() - t0)
                if counter is not None:
                    counter.close()

        for i in range(warmup):
            await stream(list(work[i % len(work)].prompt[:32]), 4, None, time.monotonic())
        bar = _progress(progress, label, len(work))
        t0 = time.monotonic()

        async def one(item: WorkItem, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, t0 + item.arrival_s - time.monotonic()))
            rec.arrival_s = time.monotonic() - t0
            try:
                await stream(item.prompt, item.max_tokens, rec, t0)
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            if bar is not None:
                bar[0].advance(bar[1])

        try:
            await asyncio.gather(*(one(w, r) for w, r in zip(work, records)))
        finally:
            if bar is not None:
                bar[0].stop()
        wall = time.monotonic() - t0
    return ServeRun(label, records, [], wall, {})


def replay_openai(url: str, work: Sequence[WorkItem], *, endpoint: str = "completions", model: str | None = None,
                  label: str = "openai", timeout_s: float = 600.0, progress: bool = True,
                  warmup: int = 2, api_key: str | None = None, tls_ca: str | None = None) -> ServeRun:
    """``api_key``: sent as a bearer token; ``tls_ca``: the CA that verifies an https server."""
    return asyncio.run(_replay_openai(url, work, endpoint=endpoint, model=model, label=label,
                                      timeout_s=timeout_s, progress=progress, warmup=warmup,
                                      api_key=api_key, tls_ca=tls_ca))


def _progress(enabled: bool, label: str, total: int):
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(f"[bold]{label}[/bold]"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=False)
    bar.start()
    return bar, bar.add_task(label, total=total)


def _sample(t: float, st) -> dict:
    return {"t": t, "router_queue": st.router_queue_depth, "in_flight": st.totals.in_flight,
            "workers": {w.worker_id: {"active": w.active_requests, "queue": w.queue_depth,
                                      "free_blocks": w.free_kv_blocks, "total_blocks": w.total_kv_blocks}
                        for w in st.workers}}


def replay(address: str, work: Sequence[WorkItem], *, label: str = "run", timeout_s: float = 600.0,
           status_interval_s: float = 0.5, progress: bool = True, warmup: int = 2,
           connection=None) -> ServeRun:
    """Send ``work`` to the router at ``address`` at its arrival times; every request's record.
    ``connection``: a ``cluster.client.Connection`` (TLS, API key) instead of plaintext."""
    return asyncio.run(_replay(address, work, label=label, timeout_s=timeout_s,
                               status_interval_s=status_interval_s, progress=progress, warmup=warmup,
                               connection=connection))


def cluster_limits(address: str, connection=None) -> tuple[int, int]:
    """(max prompt tokens, max output tokens) every worker's KV pool can hold for one request
    under GUARANTEED_NO_EVICT: the smallest pool, half to the prompt, a quarter to the output."""
    from pdserve.cluster.client import Client, client_from_connection

    with (client_from_connection(connection) if connection is not None else Client(address)) as client:
        st = client.status()
    pool = min(w.total_kv_blocks * max(1, w.tokens_per_block) for w in st.workers)
    return pool // 2, pool // 4

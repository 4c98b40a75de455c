"""The router -> worker request channel with the real pieces in one process: a WorkerHost on the
tiny model, the RequestChannelServer serving it (built beside the host, as a process shell
builds it), and the router's asyncio WorkerChannel. Outputs match the in-process engine; the
hello's token and protocol version are checked; a bad request is refused without harming the
channel; an abort frame and a closed connection both free the request's blocks."""
from __future__ import annotations

import asyncio
import socket
import time

import msgpack
import pytest

from pdserve import LLM
from pdserve import SamplingParams as ApiSamplingParams
from pdserve.cluster.worker_channel import CLOSED, ChannelRefused, WorkerChannel
from pdserve.transport.requests import (
    PROTOCOL_VERSION,
    ErrorKind,
    FrameReader,
    Generate,
    Hello,
    Refused,
    UpdateKind,
    WireRequest,
    SamplingParams,
    encode_frame,
)
from pdserve.workers.process.channel_server import RequestChannelServer
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.build import build_engine_core
from pdserve.workers.process.host import WorkerHost
from pdserve.workers.loading.tiny_model import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# Room for three 1500-token requests: the abort and close tests must act on requests that are
# still decoding, however slowly this (shared) process runs.
ENGINE = dict(tokens_per_block=4, num_kv_blocks=4096, max_batch_size=8, max_num_tokens=64)
LONG = 1500
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22], [5] * 13, [7, 8, 9, 10, 11]]
WAIT_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("channel") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=259, seed=9)


@pytest.fixture()
def host(model_dir):
    config = EngineConfig.from_kwargs(ENGINE)
    _, core = build_engine_core(str(model_dir), config)
    host = WorkerHost(core, worker_id="chan-test", role="both", config=config)
    yield host
    host.stop()


@pytest.fixture()
def server(host):
    """The host's request channel; torn down before the host (pytest ends fixtures in reverse),
    as a shell closes its server before stopping the loop."""
    server = RequestChannelServer(host, host_address="127.0.0.1")
    yield server
    server.close()


def _wire(rid: int, prompt, max_tokens: int) -> WireRequest:
    return WireRequest(rid, f"client-{rid}", list(prompt), max_tokens, deadline_s=WAIT_S,
                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _updates(q: asyncio.Queue, until_finished: bool = True) -> list:
    """The attempt's updates up to its finishing one (or only the next one)."""
    out = []
    async with asyncio.timeout(WAIT_S):
        while True:
            update = await q.get()
            out.append(update)
            if update is CLOSED or not until_finished or update.finished:
                return out


async def _connect(server: RequestChannelServer, token: str | None = None) -> WorkerChannel:
    channel = WorkerChannel("w", server.endpoint, server.token if token is None else token)
    await channel.connect(5.0)
    return channel


async def _started(q: asyncio.Queue):
    """The attempt's first update: it was accepted and is running."""
    (update,) = await _updates(q, until_finished=False)
    assert update is not CLOSED and update.kind == UpdateKind.TOKENS and update.new_token_ids, update
    return update


def _drained(host: WorkerHost) -> dict:
    """Polls until the worker holds no request and every block is free again."""
    deadline = time.monotonic() + WAIT_S
    while True:
        status = host.core.status() if not host.alive else host.call(host.status_map)
        if status["num_active"] == 0 and status["queue_depth"] == 0 \
                and status["free_blocks"] == status["total_blocks"]:
            return status
        assert time.monotonic() < deadline, f"the worker did not drain: {status}"
        time.sleep(0.02)


def _tokens(updates) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def test_streams_over_the_channel_match_the_in_process_engine(host, server, model_dir):
    expected = [o.token_ids for o in LLM(str(model_dir), **ENGINE).generate(
        PROMPTS, ApiSamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]

    async def run():
        channel = await _connect(server)
        queues = [channel.attempt(100 + i) for i in range(len(PROMPTS))]
        for i, p in enumerate(PROMPTS):  # all in flight together: they share steps
            channel.generate(_wire(100 + i, p, 8))
        got = await asyncio.gather(*(_updates(q) for q in queues))
        status = await channel.fresh_status(5.0)
        channel.close()
        return got, status

    got, status = asyncio.run(run())
    assert [_tokens(u) for u in got] == expected
    assert all(u[-1].kind == UpdateKind.FINISHED and u[-1].finish_reason == "length" for u in got)
    assert status.worker_id == "chan-test" and status.generated_tokens >= 8 * len(PROMPTS)
    _drained(host)


def test_a_wrong_token_or_another_protocol_version_is_refused(host, server):
    async def wrong_token():
        with pytest.raises(ChannelRefused, match="wrong token"):
            await _connect(server, token="not-the-token")

    asyncio.run(wrong_token())
    # A router of another protocol version hears why, in a frame it can still read.
    host_addr, port = server.endpoint.rsplit(":", 1)
    with socket.create_connection((host_addr, int(port)), timeout=5) as raw:
        raw.sendall(encode_frame(Hello(PROTOCOL_VERSION + 1, server.token)))
        reader = FrameReader()
        frames = []
        while not frames:
            data = raw.recv(1 << 16)
            assert data, "closed without an answer"
            reader.feed(data)
            frames = list(reader)
    assert isinstance(frames[0], Refused) and f"version {PROTOCOL_VERSION + 1}" in frames[0].reason
    assert server.num_connections == 0
    _drained(host)  # nothing ran


def test_an_invalid_request_is_rejected_and_the_channel_stays_up(host, server):
    async def run():
        channel = await _connect(server)
        bad_vocab, bad_params = channel.attempt(1), channel.attempt(2)
        channel.generate(_wire(1, [1, 2, 10**6], 4))  # a token outside the vocabulary
        wire = _wire(2, PROMPTS[0], 4)
        channel.generate(WireRequest(2, None, wire.prompt, 4, sampling=SamplingParams(logit_bias={10**6: 1.0})))
        first, second = await _updates(bad_vocab), await _updates(bad_params)
        good = channel.attempt(3)
        channel.generate(_wire(3, PROMPTS[1], 4))
        third = await _updates(good)
        channel.close()
        return first, second, third

    first, second, third = asyncio.run(run())
    assert first[0].error == ErrorKind.REJECTED and "vocabulary" in first[0].message
    assert second[0].error == ErrorKind.REJECTED and "logit_bias" in second[0].message
    assert len(_tokens(third)) == 4
    _drained(host)


def test_an_abort_frame_ends_the_request_and_frees_its_blocks(host, server):
    async def run():
        channel = await _connect(server)
        q = channel.attempt(7)
        channel.generate(_wire(7, PROMPTS[0], LONG))
        first = await _started(q)
        channel.abort(7)
        rest = await _updates(q)
        channel.close()
        return [first] + rest

    updates = asyncio.run(run())
    assert updates[-1].kind == UpdateKind.ABORTED
    assert 0 < len(_tokens(updates)) < LONG
    _drained(host)


def test_a_closed_connection_aborts_every_request_it_owns(host, server):
    async def run():
        channel = await _connect(server)
        queues = [channel.attempt(20 + i) for i in range(3)]
        for i in range(3):
            channel.generate(_wire(20 + i, PROMPTS[i], LONG))
        for q in queues:  # each has started decoding
            await _started(q)
        channel.close("test closes it")
        return [(await _updates(q))[-1] for q in queues]  # updates already read, then CLOSED

    ends = asyncio.run(run())
    assert ends == [CLOSED] * 3
    _drained(host)


@pytest.mark.parametrize("garbage", [b"\xc1",  # a byte msgpack never uses
                                     msgpack.packb([99, 1]),  # an unknown frame type
                                     msgpack.packb([4, 1, 2])])  # a generate frame cut short
def test_a_garbled_stream_ends_only_its_own_connection(host, server, garbage):
    async def run():
        healthy = await _connect(server)
        q = healthy.attempt(31)
        healthy.generate(_wire(31, PROMPTS[2], LONG))
        await _started(q)

        addr, port = server.endpoint.rsplit(":", 1)
        raw = socket.create_connection((addr, int(port)), timeout=5)
        raw.sendall(encode_frame(Hello(PROTOCOL_VERSION, server.token))
                    + encode_frame(Generate(_wire(32, PROMPTS[0], LONG))) + garbage)
        raw.settimeout(WAIT_S)
        while raw.recv(1 << 16):  # the worker may answer request 32 before the bad frame
            pass
        raw.close()

        healthy.abort(31)
        rest = await _updates(q)
        healthy.close()
        return rest

    rest = asyncio.run(run())
    assert rest[-1].kind == UpdateKind.ABORTED  # the healthy connection kept working
    _drained(host)  # request 32 went with its connection


def test_a_worker_whose_step_loop_is_gone_answers_unavailable(host, server):
    host.stop_loop()

    async def run():
        channel = await _connect(server)
        q = channel.attempt(41)
        channel.generate(_wire(41, PROMPTS[1], 4))
        updates = await _updates(q)
        channel.close()
        return updates

    (update,) = asyncio.run(run())
    assert update.error == ErrorKind.UNAVAILABLE and "not running" in update.message


def test_an_idle_connection_hears_the_step_loops_heartbeat_until_the_loop_stops(host, server):
    async def run():
        channel = await _connect(server)
        t0 = channel.last_heard
        await asyncio.sleep(2.5)  # HEARTBEAT_S is 0.5 s
        beating = channel.last_heard - t0
        heard = channel.status
        host.stop_loop()
        await asyncio.sleep(0.5)  # a heartbeat in flight may still land
        stopped_at = channel.last_heard
        await asyncio.sleep(2.5)
        silent = channel.last_heard == stopped_at
        channel.close()
        return beating, silent, heard

    beating, silent, heard = asyncio.run(run())
    assert beating >= 1.0 and silent
    assert heard is not None and heard.worker_id == "chan-test" and heard.violations == []

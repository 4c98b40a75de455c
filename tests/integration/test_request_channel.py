"""The router -> worker request channel with the real pieces in one process: a WorkerLoop on the
tiny model behind a RequestChannelServer, and the router's asyncio WorkerChannel. Outputs match
the in-process engine; the hello token is checked; a bad request is refused without harming the
channel; an abort frame and a closed connection both free the request's blocks."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from pdserve import LLM
from pdserve import SamplingParams as ApiSamplingParams
from pdserve.cluster.worker_channel import CLOSED, ChannelClosed, WorkerChannel
from pdserve.transport.channel_frames import pack_frame
from pdserve.workers.actor_base import WorkerActorBase, update_to_wire
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import build_executor
from pdserve.workers.request_channel import RequestChannelServer
from pdserve.workers.tiny_model import make_tiny_model
from pdserve.workers.worker_loop import WorkerLoop

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
def server(model_dir):
    _, executor = build_executor(str(model_dir), EngineConfig.from_kwargs(ENGINE))
    loop = WorkerLoop(executor, name="chan-test").start()
    srv = RequestChannelServer(loop, WorkerActorBase._from_wire, update_to_wire, name="chan-test")
    yield srv
    srv.close()
    loop.stop()


def _wire(rid: int, prompt, max_tokens: int, **extra) -> dict:
    return {"request_id": rid, "prompt": list(prompt), "max_new_tokens": max_tokens,
            "type": "CONTEXT_AND_GENERATION", "deadline_s": WAIT_S,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, **extra}


async def _frames(q: asyncio.Queue, until_finished: bool = True) -> list:
    """The attempt's frames up to its finishing update (or only the next one)."""
    out = []
    async with asyncio.timeout(WAIT_S):
        while True:
            frame = await q.get()
            out.append(frame)
            if frame is CLOSED or "u" not in frame or not until_finished or frame["u"]["finished"]:
                return out


async def _connect(srv: RequestChannelServer, token: str | None = None) -> WorkerChannel:
    channel = WorkerChannel("w", srv.endpoint, srv.token if token is None else token)
    await channel.connect(5.0)
    return channel


async def _started(q: asyncio.Queue) -> dict:
    """The attempt's first update: it was accepted and is running."""
    (frame,) = await _frames(q, until_finished=False)
    assert frame is not CLOSED and frame["u"]["new_token_ids"] and not frame["u"]["finished"], frame
    return frame


def _drained(srv: RequestChannelServer) -> dict:
    """Polls until the worker holds no request and every block is free again."""
    deadline = time.monotonic() + WAIT_S
    while True:
        status = srv.loop.status()
        if status["num_active"] == 0 and status["queue_depth"] == 0 \
                and status["free_blocks"] == status["total_blocks"]:
            return status
        assert time.monotonic() < deadline, f"the worker did not drain: {status}"
        time.sleep(0.02)


def _tokens(frames) -> list[int]:
    return [t for f in frames for t in f["u"]["new_token_ids"]]


def test_streams_over_the_channel_match_the_in_process_engine(server, model_dir):
    expected = [o.token_ids for o in LLM(str(model_dir), **ENGINE).generate(
        PROMPTS, ApiSamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]

    async def run():
        channel = await _connect(server)
        queues = [channel.attempt(100 + i) for i in range(len(PROMPTS))]
        for i, p in enumerate(PROMPTS):  # all in flight together: they share steps
            channel.generate(_wire(100 + i, p, 8))
        got = await asyncio.gather(*(_frames(q) for q in queues))
        channel.close()
        return got

    got = asyncio.run(run())
    assert [_tokens(f) for f in got] == expected
    assert all(f[-1]["u"]["finish_reason"] == "length" for f in got)
    _drained(server)


def test_a_wrong_token_is_refused(server):
    async def run():
        channel = await _connect(server, token="not-the-token")
        q = channel.attempt(1)
        channel.generate(_wire(1, PROMPTS[0], 4))
        frames = await _frames(q)
        return channel, frames

    channel, frames = asyncio.run(run())
    assert frames == [CLOSED] and not channel.open
    with pytest.raises(ChannelClosed):
        channel.attempt(2)
    assert server.num_connections == 0
    _drained(server)  # nothing ran


def test_an_invalid_request_is_rejected_and_the_channel_stays_up(server):
    async def run():
        channel = await _connect(server)
        bad_vocab, missing = channel.attempt(1), channel.attempt(2)
        channel.generate(_wire(1, [1, 2, 10**6], 4))  # a token outside the vocabulary
        channel.generate({"request_id": 2, "max_new_tokens": 4})  # no prompt
        first, second = await _frames(bad_vocab), await _frames(missing)
        good = channel.attempt(3)
        channel.generate(_wire(3, PROMPTS[1], 4))
        third = await _frames(good)
        channel.close()
        return first, second, third

    first, second, third = asyncio.run(run())
    assert "vocabulary" in first[0]["rejected"]
    assert "prompt" in second[0]["rejected"]
    assert len(_tokens(third)) == 4
    _drained(server)


def test_an_abort_frame_ends_the_request_and_frees_its_blocks(server):
    async def run():
        channel = await _connect(server)
        q = channel.attempt(7)
        channel.generate(_wire(7, PROMPTS[0], LONG))
        first = await _started(q)
        channel.abort(7)
        rest = await _frames(q)
        channel.close()
        return [first] + rest

    frames = asyncio.run(run())
    assert frames[-1]["u"]["finished"] and frames[-1]["u"]["finish_reason"] == "abort"
    assert 0 < len(_tokens(frames)) < LONG
    _drained(server)


def test_a_closed_connection_aborts_every_request_it_owns(server):
    async def run():
        channel = await _connect(server)
        queues = [channel.attempt(20 + i) for i in range(3)]
        for i in range(3):
            channel.generate(_wire(20 + i, PROMPTS[i], LONG))
        for q in queues:  # each has started decoding
            await _started(q)
        channel.close("test closes it")
        return [(await _frames(q))[-1] for q in queues]  # updates already read, then CLOSED

    ends = asyncio.run(run())
    assert ends == [CLOSED] * 3
    _drained(server)


def test_a_garbled_stream_ends_only_its_own_connection(server):
    async def run():
        healthy = await _connect(server)
        q = healthy.attempt(31)
        healthy.generate(_wire(31, PROMPTS[2], LONG))
        await _started(q)

        host, port = server.endpoint.rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=5)
        raw.sendall(pack_frame({"op": "hello", "token": server.token})
                    + pack_frame({"op": "generate", "wire": _wire(32, PROMPTS[0], LONG)})
                    + b"\xc1")  # 0xc1 is never used in msgpack
        raw.settimeout(WAIT_S)
        data = b""
        while True:  # the worker may answer request 32 before it reads the bad byte
            chunk = raw.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        raw.close()

        healthy.abort(31)
        rest = await _frames(q)
        healthy.close()
        return rest

    rest = asyncio.run(run())
    assert rest[-1]["u"]["finish_reason"] == "abort"  # the healthy connection kept working
    _drained(server)  # request 32 went with its connection


def test_a_worker_whose_step_loop_is_gone_answers_with_an_error(server):
    server.loop.stop()

    async def run():
        channel = await _connect(server)
        q = channel.attempt(41)
        channel.generate(_wire(41, PROMPTS[1], 4))
        frames = await _frames(q)
        channel.close()
        return frames

    (frame,) = asyncio.run(run())
    assert "not running" in frame["error"]


def test_an_idle_connection_hears_the_step_loops_heartbeat_until_the_loop_stops(server):
    async def run():
        channel = await _connect(server)
        t0 = channel.last_heard
        await asyncio.sleep(2.5)  # HEARTBEAT_S is 0.5 s
        beating = channel.last_heard - t0
        server.loop.stop()
        await asyncio.sleep(0.5)  # a heartbeat in flight may still land
        stopped_at = channel.last_heard
        await asyncio.sleep(2.5)
        silent = channel.last_heard == stopped_at
        channel.close()
        return beating, silent

    beating, silent = asyncio.run(run())
    assert beating >= 1.0 and silent

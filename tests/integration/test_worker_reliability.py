"""Worker-side reliability pieces in one process, with the tiny model: request deadlines in the
core (a fake clock), forced tokens (a retry that continues after tokens the client already
has), an abort that overtakes its submission in the WorkerHost, and the KV receiver refusing a
context endpoint that is gone (the context worker restarted)."""
from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM
from pdserve import SamplingParams as ApiSamplingParams
from pdserve.scheduler import LlmRequest
from pdserve.transport.protocol import TransferDone, encode_message
from pdserve.transport.sessions import RecvState
from pdserve.transport.requests import ErrorKind, UpdateKind, WireRequest
from pdserve.transport.torch_dist import KVReceiver, TransportConfig
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.core import EngineCore
from pdserve.workers.runner.model_runner import ModelRunner
from pdserve.transport.kv_pool import KVPool
from pdserve.workers.loading.loader import load_model
from pdserve.workers.runner.sampling import SamplingParams
from pdserve.workers.loading.tiny_model import make_tiny_model
from pdserve.workers.process.host import WorkerHost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ENGINE = dict(tokens_per_block=4, num_kv_blocks=64, max_batch_size=8, max_num_tokens=32,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("reliability") / "tiny", hidden_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=259, seed=5)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def _executor(loaded, clock=None) -> EngineCore:
    config = EngineConfig.from_kwargs(ENGINE)
    mcfg = loaded.config
    pool = KVPool.for_model(mcfg, config.num_kv_blocks, config.tokens_per_block,
                            dtype=loaded.model.dtype, device="cpu")
    kwargs = {} if clock is None else {"clock": clock}
    return EngineCore(ModelRunner(loaded.model, pool), config, eos_token_ids=loaded.eos_token_ids,
                      vocab_size=mcfg.vocab_size, max_seq_len=mcfg.max_position_embeddings, **kwargs)


def _run(core: EngineCore, max_steps: int = 200) -> dict[int, list]:
    """Steps until idle; returns each request's updates."""
    out: dict[int, list] = {}
    for _ in range(max_steps):
        if not core.has_work:
            return out
        for u in core.step():
            out.setdefault(u.request_id, []).append(u)
    raise AssertionError("the engine core did not go idle")


def _tokens(updates) -> list[int]:
    return [t for u in updates for t in u.new_token_ids]


def test_a_request_past_its_deadline_is_aborted_and_frees_its_blocks(loaded):
    clock = FakeClock()
    ex = _executor(loaded, clock)
    total = ex.kv.num_blocks
    ex.add_request(LlmRequest(1, PROMPT, 50), GREEDY, deadline=clock.now + 5.0)
    ex.add_request(LlmRequest(2, PROMPT, 4), GREEDY, deadline=None)
    for _ in range(3):
        ex.step()
    assert ex.num_free_blocks < total
    clock.now += 10.0  # request 1's deadline passes mid-decode
    updates = _run(ex)
    last1, last2 = updates[1][-1], updates[2][-1]
    assert last1.kind == UpdateKind.FAILED and last1.error == ErrorKind.DEADLINE
    assert last1.message == "deadline exceeded" and last1.outcome == "deadline"
    assert last2.kind == UpdateKind.FINISHED and last2.finish_reason == "length"
    assert ex.num_free_blocks == total and not ex.tracked
    status = ex.status()
    assert status["deadlines_exceeded"] == 1 and status["violations"] == [] and status["tracked"] == 0


def test_forced_tokens_continue_a_retry_without_duplicates_or_gaps(loaded, model_dir):
    reference = LLM(model_dir, **ENGINE).generate(
        [PROMPT], ApiSamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    ex = _executor(loaded)
    # The client has reference[:6]; only 2 of them fit in the retry's prompt, 4 are forced.
    prompt = PROMPT + reference[:2]
    ex.add_request(LlmRequest(7, prompt, 8), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                   forced_tokens=reference[2:6])
    updates = _run(ex)[7]
    assert _tokens(updates) == reference[6:10]  # exactly what the client does not have yet
    assert updates[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="forced_tokens"):
        ex.add_request(LlmRequest(8, PROMPT, 3), GREEDY, forced_tokens=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="forced_tokens"):
        ex.add_request(LlmRequest(9, PROMPT, 3), GREEDY, forced_tokens=[10_000])


def test_an_abort_that_overtakes_its_submission_finishes_it_at_once(loaded):
    ex = _executor(loaded)
    host = WorkerHost(ex, worker_id="w", role="both", config=EngineConfig.from_kwargs(ENGINE))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    try:
        assert host.call(lambda: host.abort_now(42)) is False  # not there yet: remembered
        stream = host.stream(WireRequest(42, None, PROMPT, 8, sampling=sampling))
        (update,) = stream.collect(10.0)
        assert update.kind == UpdateKind.ABORTED
        assert host.call(host.status_map)["tracked"] == 0
        normal = host.stream(WireRequest(43, None, PROMPT, 4, sampling=sampling))
        assert normal.collect(30.0)[-1].finish_reason == "length"
    finally:
        host.stop()


def test_the_receiver_refuses_a_context_endpoint_that_is_gone(loaded):
    mcfg = loaded.config
    pool = KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu")
    receiver = KVReceiver("gen-x", pool, config=TransportConfig(connect_timeout_s=1.0))
    try:
        old, new = "127.0.0.1:1#1", "127.0.0.1:2#2"
        first = receiver.start(1, ctx_worker_id="ctx-x", ctx_endpoint=old, ctx_request_id=5,
                               block_ids=[0, 1], timeout_s=30.0)
        assert first is not None and receiver.pair_endpoint("ctx-x") == old
        receiver.mark_gone(old)  # the context worker said so (it restarted)
        assert receiver.is_gone(old)
        # A request still carrying the old endpoint fails at once, without touching the pair.
        assert receiver.start(2, ctx_worker_id="ctx-x", ctx_endpoint=old, ctx_request_id=6,
                              block_ids=[2, 3], timeout_s=30.0) is None
        assert receiver.pair_endpoint("ctx-x") == old
        results = {r.request_id: r for r in _poll_until(receiver, {1, 2})}
        assert results[2].state == RecvState.FAILED and "gone" in results[2].reason
        assert results[1].state == RecvState.FAILED  # queued for the gone endpoint
        # The restarted worker's endpoint is used from now on; the old one never again.
        third = receiver.start(3, ctx_worker_id="ctx-x", ctx_endpoint=new, ctx_request_id=7,
                               block_ids=[4, 5], timeout_s=1.0)
        assert third is not None and receiver.pair_endpoint("ctx-x") == new
        assert receiver.start(4, ctx_worker_id="ctx-x", ctx_endpoint=old, ctx_request_id=8,
                              block_ids=[6, 7], timeout_s=30.0) is None
        assert receiver.pair_endpoint("ctx-x") == new
    finally:
        receiver.close()


def _poll_until(receiver: KVReceiver, ids: set[int], timeout_s: float = 10.0):
    import time

    got = []
    deadline = time.monotonic() + timeout_s
    # every id in ids, whatever else came back (a strict-subset test would stop early as soon
    # as an unrelated result arrived)
    while not ids <= {r.request_id for r in got}:
        assert time.monotonic() < deadline, f"no results for {ids} in time: {got}"
        got.extend(receiver.poll())
        time.sleep(0.01)
    return got


def test_a_stale_endpoint_never_moves_the_pair_back_and_a_reused_port_is_detected(loaded):
    from pdserve.transport.torch_dist import KVSender

    mcfg = loaded.config
    pool = KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu")
    receiver = KVReceiver("gen-y", pool, config=TransportConfig(connect_timeout_s=2.0))
    sender = KVSender("ctx-z", KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu"))
    try:
        newer, older = "127.0.0.1:3#50", "127.0.0.1:4#30"
        assert receiver.start(1, ctx_worker_id="ctx-y", ctx_endpoint=newer, ctx_request_id=1,
                              block_ids=[0], timeout_s=30.0) is not None
        # A request from the previous incarnation arrives late: refused, the pair stays.
        assert receiver.start(2, ctx_worker_id="ctx-y", ctx_endpoint=older, ctx_request_id=2,
                              block_ids=[1], timeout_s=30.0) is None
        assert receiver.pair_endpoint("ctx-y") == newer and receiver.is_gone(older)

        # The port of a live store, but another incarnation: that process is gone.
        impostor = f"{sender.endpoint}#{sender.incarnation - 1}"
        assert receiver.start(3, ctx_worker_id="ctx-z", ctx_endpoint=impostor, ctx_request_id=3,
                              block_ids=[2], timeout_s=30.0) is not None
        results = {r.request_id: r for r in _poll_until(receiver, {2, 3})}
        assert results[3].state == RecvState.FAILED and "gone" in results[3].reason
        assert receiver.is_gone(impostor) and not receiver.is_gone(sender.locator)
    finally:
        receiver.close()
        sender.close()


def test_a_stale_op_on_a_mute_port_does_not_hold_the_pair_from_the_restarted_worker(loaded):
    """Seen in a fault test: a context worker died and its store's port was taken by another
    kind of server, which accepts connections and never answers. A receive queued for the old
    incarnation sat in the store connect for the whole connect timeout, while the restarted
    worker waited (a shorter time) for this side to join the new group, and gave up: every
    request it served failed. The stale op now gives up as soon as the endpoint is replaced."""
    import socket
    import threading
    import time

    from pdserve.transport.protocol import encode_message
    from pdserve.transport.torch_dist import KVSender

    mcfg = loaded.config
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)  # the kernel completes connects; nothing ever answers
    # The receiver would wait 20 s for a store; the restarted sender waits 4 s for its peer.
    receiver = KVReceiver("gen-m", KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu"),
                          config=TransportConfig(connect_timeout_s=20.0))
    sender = KVSender("ctx-m", KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu"),
                      config=TransportConfig(connect_timeout_s=4.0))
    try:
        stale = f"127.0.0.1:{mute.getsockname()[1]}#5"
        assert receiver.start(1, ctx_worker_id="ctx-m", ctx_endpoint=stale, ctx_request_id=1,
                              block_ids=[0], timeout_s=60.0) is not None
        time.sleep(1.0)  # the pair thread is in the store connect now
        sender.hold(7, [3, 4])
        msg = receiver.start(2, ctx_worker_id="ctx-m", ctx_endpoint=sender.locator, ctx_request_id=7,
                             block_ids=[5, 6], timeout_s=30.0)
        assert msg is not None and receiver.pair_endpoint("ctx-m") == sender.locator
        replies = []
        send = threading.Thread(target=lambda: replies.append(sender.handle(encode_message(msg))))
        send.start()
        results = {r.request_id: r for r in _poll_until(receiver, {1, 2}, timeout_s=15.0)}
        send.join(15.0)
        assert results[1].state == RecvState.FAILED
        assert results[2].state == RecvState.COMPLETE, results[2]
        receiver.handle(replies[0])
    finally:
        mute.close()
        receiver.close()
        sender.close()


def test_a_retryable_answer_leaves_the_transfer_to_its_re_issue(loaded):
    """A context side that retired an op's group before the op began answers it retryable (its
    lease is intact). The generation side may not have moved to the newer group yet: it must
    not fail the transfer then, or it races its own re-issue (seen once under load in
    test_torch_dist's lost-request test). A refusal that is not retryable still fails it."""
    mcfg = loaded.config
    pool = KVPool.for_model(mcfg, 16, 4, dtype=loaded.model.dtype, device="cpu")
    receiver = KVReceiver("gen-r", pool, config=TransportConfig(connect_timeout_s=1.0))
    try:
        req = receiver.start(1, ctx_worker_id="ctx-r", ctx_endpoint="127.0.0.1:1#1",
                             ctx_request_id=5, block_ids=[0, 1], timeout_s=30.0)
        assert req is not None
        answer = TransferDone(req.transfer_id, req.ctx_request_id, False, "pair group retired",
                              0, 0.0, group=req.group, seq=req.seq, retryable=True)
        receiver.handle(encode_message(answer))
        assert receiver.sessions.state_of(1) == RecvState.REQUESTED
        refused = dataclasses.replace(answer, reason="unknown context request", retryable=False)
        receiver.handle(encode_message(refused))
        (result,) = _poll_until(receiver, {1})
        assert result.state == RecvState.FAILED and "unknown context request" in result.reason
    finally:
        receiver.close()


def test_a_steps_kv_requests_leave_before_its_forward(loaded):
    """A generation-only request reserved in a step has its KV request sent (flush_control,
    the host's outbox flush) before that step's forward runs, not after it: the context
    worker starts sending while this worker computes, one step earlier."""
    from pdserve.scheduler.request import ContextPhaseParams, LlmRequestType
    from pdserve.workers.engine.transceiver import KVTransceiver

    config = EngineConfig.from_kwargs(ENGINE)
    mcfg = loaded.config
    pool = KVPool.for_model(mcfg, config.num_kv_blocks, config.tokens_per_block,
                            dtype=loaded.model.dtype, device="cpu")
    receiver = KVReceiver("gen-x", pool, config=TransportConfig(connect_timeout_s=1.0))
    transceiver = KVTransceiver("gen-x", receiver=receiver, transfer_timeout_s=5.0)
    ex = EngineCore(ModelRunner(loaded.model, pool), config, transceiver=transceiver,
                    eos_token_ids=loaded.eos_token_ids, vocab_size=mcfg.vocab_size,
                    max_seq_len=mcfg.max_position_embeddings)
    order: list[str] = []
    sent = []

    def flush() -> None:
        order.append("flush")
        while not transceiver.outbox.empty():
            sent.append(transceiver.outbox.get_nowait())

    forward = loaded.model.forward

    def spy(*args, **kwargs):
        order.append("forward")
        return forward(*args, **kwargs)

    ex.flush_control = flush
    try:
        loaded.model.forward = spy
        ex.add_request(LlmRequest(1, PROMPT, 4), GREEDY)  # a local prefill: this step has a forward
        params = ContextPhaseParams(ctx_request_id=5, first_gen_tokens=[7], opaque_state=b"127.0.0.1:1#1",
                                    ctx_worker_id="ctx-x", num_blocks=3)
        ex.add_request(LlmRequest(2, PROMPT, 4, llm_request_type=LlmRequestType.GENERATION_ONLY,
                                  context_phase_params=params), GREEDY)
        ex.step()
        assert order[:2] == ["flush", "forward"], order
        assert [m.ctx_worker_id for m in sent] == ["ctx-x"] and sent[0].method == "kv_transfer"
    finally:
        loaded.model.forward = forward
        receiver.close()

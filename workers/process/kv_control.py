"""The KV control path of a worker: KV control messages (``transport/protocol.py``) between
a generation worker's transceiver and the context workers.

Generation side (``KVControl.flush_outbox``, on the step loop's thread after each step): the
transceiver's outbox is sent in outbox order, so KV requests reach a context worker in the order
of their seqs (its pair thread serves them in that order). A KV request or cancel goes first
over the pair's direct link when it is up (``transport/kv_link.py``: one socket write, so the
payload starts at once), and always also through the ``ControlPlane`` (Ray: the transfer's
record on the dashboard, and its reply); the context side folds the second copy into the first.
With the link up, the Ray call is issued from the pool rather than the loop thread (its order
no longer matters: the link already delivered in order). Each reply is awaited on a small
thread pool and handed back to the transceiver. A failed delivery
fails the transfer at once instead of letting it run into its deadline; a reply saying the
context worker's endpoint is gone (it restarted) marks that endpoint gone.

Context side (``KVControl.serve``, on the caller's thread): a KV request answered once the send
is over, or a cancel.
"""
from __future__ import annotations

import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

from pdserve.transport.protocol import (
    KVRequest, PairOpen, TransferDone, decode_message, encode_message,
)

from pdserve.workers.engine import events
from pdserve.workers.engine.transceiver import ControlMessage, KVTransceiver

log = logging.getLogger("pdserve.worker")

CONTROL_THREADS = 8


class ControlPlane(Protocol):
    def send(self, message: ControlMessage) -> Callable[[], "bytes | None"]:
        """Called on the loop thread, in outbox order: issue the message now (without blocking)
        and return the wait for its reply, which a control-pool thread runs. The wait raises
        ``PeerGone`` when the context worker is gone for good (its endpoint with it)."""
        ...


class PeerGone(ConnectionError):
    """The context worker a control message was for no longer exists."""


class KVTransferFailed(RuntimeError):
    """A context worker's send failed; ``payload`` is the encoded ``TransferDone`` the caller
    still needs. The Ray actor raises it, so the dashboard shows the transfer task FAILED."""

    def __init__(self, message: str, payload: bytes = b"") -> None:
        super().__init__(message, payload)  # both in args: the exception crosses processes
        self.payload = payload

    def __str__(self) -> str:
        return str(self.args[0])


class KVControl:
    def __init__(self, worker_id: str, transceiver: KVTransceiver | None,
                 control: ControlPlane | None) -> None:
        self.worker_id = worker_id
        self.transceiver = transceiver
        self.control = control
        self._pool = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix=f"{worker_id}-kv-control")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def serve(self, payload: bytes, endpoint: str | None = None) -> bytes | None:
        """Context side, on the caller's thread (the transport's sessions are thread-safe): a
        KV request, answered once the send is over, or a cancel. ``endpoint`` is the KV
        endpoint the sender meant; another incarnation's is refused (``endpoint_gone``). A
        failed send raises KVTransferFailed carrying its TransferDone; the line logged here
        gives the duration and GB/s (on the dashboard: the transfer task's Log)."""
        transceiver = self.transceiver
        if transceiver is None or transceiver.sender is None:
            raise RuntimeError(f"{self.worker_id} has no KV sender")
        mine = endpoint is None or endpoint == transceiver.endpoint
        msg = decode_message(payload)
        if isinstance(msg, PairOpen) and not mine:  # for a previous incarnation's store
            return encode_message(TransferDone(-1, -1, False, f"endpoint gone: {endpoint}", 0, 0.0,
                                               endpoint_gone=True, group=msg.group, seq=0))
        if isinstance(msg, PairOpen):
            return transceiver.sender.handle(payload)
        if not isinstance(msg, KVRequest):
            # a cancel for a previous incarnation: nothing of it is left here
            return transceiver.sender.handle(payload) if mine else None
        client = events.label(msg.ctx_request_id, transceiver.client_of(msg.ctx_request_id))
        if mine:
            reply = transceiver.sender.handle(payload)
        else:
            reply = encode_message(TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                                f"endpoint gone: {endpoint}", 0, 0.0,
                                                endpoint_gone=True))
        done = decode_message(reply) if reply else None
        if isinstance(done, TransferDone) and done.ok:
            events.log.info("%s", events.transfer_line(
                "send", client, self.worker_id, msg.gen_worker_id, msg.num_blocks, done.nbytes,
                done.seconds, "SENT"))
            return reply
        reason = done.reason if isinstance(done, TransferDone) else "no answer from the send"
        events.log.info("%s", events.transfer_line(
            "send", client, self.worker_id, msg.gen_worker_id, msg.num_blocks,
            msg.num_blocks * msg.bytes_per_block,
            done.seconds if isinstance(done, TransferDone) else 0.0, "FAILED", reason))
        raise KVTransferFailed(f"KV transfer of req={client} to {msg.gen_worker_id} failed: "
                               f"{reason}", reply or b"")

    def send_from_transport(self, ctx_worker_id: str, endpoint: str, payload: bytes,
                            name: str) -> None:
        """The receiver's ``ControlSink``, from its pair threads: a pair open or a transfer
        re-issued on a rebuilt group goes out now (not through the step loop's outbox, which
        only drains while the loop has work). The context side orders a group's ops by seq,
        so these may overtake the outbox."""
        opening = isinstance(decode_message(payload), PairOpen)
        message = ControlMessage(ctx_worker_id, payload, endpoint, name,
                                 "kv_pair_open" if opening else "kv_transfer")
        self._dispatch(message)

    def _dispatch(self, message: ControlMessage) -> None:
        """Issue one message: over the direct link, then its Ray copy from the pool; or, with
        no link up, through the control plane now (so in call order). Raises if the control
        plane cannot take it."""
        if self._send_direct(message):
            self._pool.submit(self._record, message)
            return
        self._pool.submit(self._await_reply, message, self._send_by_control(message))

    def _send_by_control(self, message: ControlMessage) -> Callable[[], "bytes | None"]:
        if self.control is None:
            raise RuntimeError("no control plane to reach context workers")
        return self.control.send(message)

    def _send_direct(self, message: ControlMessage) -> bool:
        receiver = self.transceiver.receiver if self.transceiver is not None else None
        return (message.method == "kv_transfer" and receiver is not None
                and receiver.send_direct(message.ctx_worker_id, message.endpoint, message.payload))

    def _record(self, message: ControlMessage) -> None:
        """On the pool: the Ray copy (the record) of a message the direct link delivered."""
        try:
            wait = self._send_by_control(message)
        except Exception as exc:
            self._control_failed(message, exc)
            return
        self._await_reply(message, wait)

    def flush_outbox(self) -> None:
        transceiver = self.transceiver
        if transceiver is None:
            return
        while True:
            try:
                message = transceiver.outbox.get_nowait()
            except queue.Empty:
                return
            try:
                self._dispatch(message)
            except Exception as exc:
                self._control_failed(message, exc)

    def _await_reply(self, message: ControlMessage, wait: Callable[[], "bytes | None"]) -> None:
        receiver = self.transceiver.receiver
        try:
            reply = wait()
        except PeerGone as exc:
            receiver.mark_gone(message.endpoint)
            self._control_failed(message, exc)
            return
        except Exception as exc:
            self._control_failed(message, exc)
            return
        if reply:
            done = decode_message(reply)
            if isinstance(done, TransferDone) and done.endpoint_gone:
                log.warning("%s: context worker %s restarted; endpoint %s is gone",
                            self.worker_id, message.ctx_worker_id, message.endpoint)
                receiver.mark_gone(message.endpoint)
            if isinstance(done, TransferDone) and done.transfer_id < 0:
                receiver.on_done(done)  # a pair open's answer: for its pair thread, now
                return
        self.transceiver.deliver_reply(reply)

    def _control_failed(self, message: ControlMessage, exc: BaseException) -> None:
        log.warning("%s: KV control message to %s failed: %r", self.worker_id,
                    message.ctx_worker_id, exc)
        msg = decode_message(message.payload)
        if isinstance(msg, PairOpen):  # its rendezvous gives up now; the pair tries again soon
            self.transceiver.receiver.on_done(TransferDone(
                -1, -1, False, f"control plane to {message.ctx_worker_id}: {exc!r}", 0, 0.0,
                group=msg.group, seq=0))
            return
        if isinstance(msg, KVRequest):  # fail the receive now rather than at its deadline
            done = TransferDone(msg.transfer_id, msg.ctx_request_id, False,
                                f"control plane to {message.ctx_worker_id}: {exc!r}", 0, 0.0)
            self.transceiver.deliver_reply(encode_message(done))

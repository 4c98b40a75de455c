"""A worker process for the KV transport integration tests and the transfer bench: it hosts
KVSender/KVReceiver instances (one per worker id) over real KV pools and obeys commands from
the parent on a multiprocessing pipe. The parent plays the control plane (Ray in production):
it carries the encoded KV request, done and cancel messages between processes.

Not a test module (no test_ prefix); imported by the tests with its folder on sys.path so that
``multiprocessing`` spawn children can import it too.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch

from pdserve.transport.protocol import encode_message
from pdserve.transport.torch_dist import KVReceiver, KVSender, TransportConfig
from pdserve.transport.kv_pool import KVPool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def fill_pattern(pool: KVPool, seed: int) -> None:
    """Random bit patterns (NaNs and all), so equality is checked on the bits."""
    g = torch.Generator().manual_seed(seed)
    bits = _BITS[pool.dtype]
    info = torch.iinfo(bits)
    pool.kv.view(bits).copy_(torch.randint(info.min, info.max, pool.kv.shape, generator=g,
                                           dtype=torch.int64).to(bits))


def block_bits(pool: KVPool, block_ids: list[int]) -> torch.Tensor:
    return pool.gather_blocks(block_ids).view(_BITS[pool.dtype]).clone()


class _Stall:
    """The sender test hook: before chunk ``chunk`` of a listed context request, tell the parent
    and sleep that request's seconds (spec: {"requests": {ctx_request_id: seconds}, "chunk": i})."""

    def __init__(self, send: Any, spec: dict[str, Any]) -> None:
        self.send, self.spec = send, spec

    def __call__(self, d: Any, chunk: int) -> None:
        seconds = self.spec["requests"].get(d.ctx_request_id)
        if seconds is not None and chunk == self.spec["chunk"]:
            self.send(("stalled", d.ctx_request_id))
            time.sleep(seconds)


def main(conn: Any, config: dict[str, Any], stall: dict[str, Any] | None = None) -> None:
    torch.set_num_threads(1)
    lock = threading.Lock()

    def send(msg: Any) -> None:
        with lock:
            conn.send(msg)

    hook = _Stall(send, stall) if stall else None
    cfg = TransportConfig(**config)
    senders: dict[str, KVSender] = {}
    receivers: dict[str, KVReceiver] = {}
    pools: dict[str, KVPool] = {}
    stash: dict[str, dict[int, tuple[Any, ...]]] = {}  # polled results nobody asked for yet
    send(("ready",))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            for t in [*senders.values(), *receivers.values()]:
                t.close(timeout_s=2.0)
            send(("stopped",))
            return
        try:
            if cmd == "sender":  # wid, pool shape, dtype name, seed[, planes[, tp]] -> endpoint
                wid, shape, dtype, seed, *extra = args  # planes: 2 (K, V) or 1 (MLA latent)
                planes, tp = (extra + [2, (1, 0)][len(extra):])[:2]  # tp: (size, rank)
                pools[wid] = KVPool(*shape, dtype=DTYPES[dtype], num_planes=planes)
                fill_pattern(pools[wid], seed)
                senders[wid] = KVSender(wid, pools[wid], config=cfg, send_hook=hook,
                                        tp_size=tp[0], rank=tp[1])
                send(("ok", senders[wid].endpoint))
            elif cmd == "receiver":
                wid, shape, dtype, seed, *planes = args
                pools[wid] = KVPool(*shape, dtype=DTYPES[dtype], num_planes=(planes or [2])[0])
                fill_pattern(pools[wid], seed)
                receivers[wid] = KVReceiver(wid, pools[wid], config=cfg)
                send(("ok", None))
            elif cmd == "hold":  # [first_token]: ends a layer-wise stream's prefill
                wid, rid, block_ids, lease_s, *first = args
                senders[wid].hold(rid, block_ids, lease_s=lease_s,
                                  first_token=first[0] if first else None)
                send(("ok", None))
            elif cmd == "begin_stream":  # layer-wise: lease before the forward writes the KV
                wid, rid, block_ids, lease_s = args
                senders[wid].begin_stream(rid, block_ids, lease_s=lease_s)
                send(("ok", None))
            elif cmd == "write_layer":  # a stand-in forward: new bits in one layer, announced
                wid, rids, block_ids, layer, seed = args
                pool = pools[wid]
                g = torch.Generator().manual_seed(seed)
                bits = pool.kv[layer][:, block_ids].view(_BITS[pool.dtype])
                info = torch.iinfo(bits.dtype)
                pool.kv[layer][:, block_ids] = torch.randint(
                    info.min, info.max, bits.shape, generator=g, dtype=torch.int64
                ).to(bits.dtype).view(pool.dtype)
                senders[wid].layers_written(rids, layer + 1)
                send(("ok", None))
            elif cmd == "first_token":
                wid, rid = args
                send(("ok", receivers[wid].take_first_token(rid)))
            elif cmd == "kv":  # answered asynchronously, as a Ray call in its own group would be
                wid, tag, payload = args
                threading.Thread(target=lambda: send(("done", tag, senders[wid].handle(payload))),
                                 daemon=True).start()
            elif cmd == "direct":  # a control message over the receiver's direct link only
                wid, ctx_wid, endpoint, payload = args
                send(("ok", receivers[wid].send_direct(ctx_wid, endpoint, payload)))
            elif cmd == "folded":
                send(("ok", senders[args[0]].folded))
            elif cmd == "pair_stats":
                send(("ok", receivers[args[0]].pair_stats()))
            elif cmd == "sender_allocations":
                send(("ok", senders[args[0]].buffer_allocations()))
            elif cmd == "cancel_ctx":
                wid, payload = args
                senders[wid].handle(payload)
                send(("ok", None))
            elif cmd == "start":
                wid, rid, kwargs = args
                send(("ok", encode_message(receivers[wid].start(rid, **kwargs))))
            elif cmd == "gen_done":
                wid, payload = args
                receivers[wid].handle(payload)
                send(("ok", None))
            elif cmd == "cancel_gen":
                wid, rid = args
                msg = receivers[wid].cancel(rid)
                send(("ok", None if msg is None else encode_message(msg)))
            elif cmd == "wait":  # until the results for all rids are polled, or timeout
                wid, rids, timeout_s = args
                t = senders.get(wid) or receivers[wid]
                got = stash.setdefault(wid, {})
                end = time.monotonic() + timeout_s
                while set(rids) - got.keys() and time.monotonic() < end:
                    got.update({r.request_id: tuple(r) for r in t.poll()})
                    time.sleep(0.005)
                send(("ok", {r: got.pop(r) for r in rids if r in got}))
            elif cmd == "bits":
                wid, block_ids = args
                send(("ok", block_bits(pools[wid], block_ids)))
            elif cmd == "records":
                wid = args[0]
                t = senders.get(wid) or receivers[wid]
                send(("ok", [tuple(r) for r in t.sessions.transfer_records()]))
            elif cmd == "state":  # wait (bounded) until the session reaches a state
                wid, rid, state, timeout_s = args
                t = senders.get(wid) or receivers[wid]
                end = time.monotonic() + timeout_s
                while t.sessions.state_of(rid) != state and time.monotonic() < end:
                    time.sleep(0.002)
                send(("ok", t.sessions.state_of(rid)))
            elif cmd == "counts":
                wid = args[0]
                t = senders.get(wid) or receivers[wid]
                send(("ok", (t.sessions.num_active, t.sessions.num_quarantined_blocks)))
            else:
                send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # report to the parent instead of dying silently
            send(("error", f"{type(exc).__name__}: {exc}"))


def stop_peers(peers) -> None:
    """Stop peer processes all at once: each closes its transports in parallel."""
    for p in peers:
        p.request_stop()
    for p in peers:
        p.stop()


class Peer:
    """Parent-side handle of one worker process. ``call`` returns the command's answer; the
    asynchronous messages ("done" answers of KV requests, "stalled" notices) are kept aside."""

    def __init__(self, mp_ctx: Any, config: dict[str, Any], stall: dict[str, Any] | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self.conn, child = mp_ctx.Pipe()
        self.proc = mp_ctx.Process(target=main, args=(child, config, stall), daemon=True)
        self.proc.start()
        child.close()
        self.side: list[tuple[Any, ...]] = []
        self._stop_sent = False
        self._expect("ready", start_timeout_s)

    def _read(self, timeout_s: float) -> tuple[Any, ...]:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("worker process did not answer in time")
        return self.conn.recv()

    def _expect(self, kind: str, timeout_s: float) -> tuple[Any, ...]:
        end = time.monotonic() + timeout_s
        while True:
            msg = self._read(max(0.0, end - time.monotonic()))
            if msg[0] == kind or msg[0] == "error":
                if msg[0] == "error":
                    raise RuntimeError(msg[1])
                return msg
            self.side.append(msg)

    def call(self, *cmd: Any, timeout_s: float = 30.0) -> Any:
        self.conn.send(cmd)
        return self._expect("ok", timeout_s)[1]

    def post(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def take(self, kind: str, timeout_s: float = 30.0) -> tuple[Any, ...]:
        """The next asynchronous message of that kind (already received or still to come)."""
        for i, msg in enumerate(self.side):
            if msg[0] == kind:
                return self.side.pop(i)
        return self._expect(kind, timeout_s)

    def request_stop(self) -> None:
        if self.proc.is_alive() and not self._stop_sent:
            self._stop_sent = True
            with contextlib.suppress(OSError):  # the peer is gone already: nothing to stop
                self.conn.send(("stop",))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the process to close its transports and exit; kill it if it does not."""
        self.request_stop()
        if self.proc.is_alive():
            # A peer that does not confirm in time is killed below, so its answer is optional.
            with contextlib.suppress(OSError, EOFError, TimeoutError, RuntimeError):
                self._expect("stopped", timeout_s)
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

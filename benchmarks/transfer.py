"""KV transfer throughput: pdserve's KVSender -> KVReceiver against a raw torch.distributed
send/recv of one contiguous tensor of the same total bytes, both over gloo between two spawned
processes on 127.0.0.1, plus the latency of a one-block transfer.

Setup: two KV pools (8 layers, 16 tokens per block, 8 KV heads, head_dim 64, fp32: 512 KiB per
block), payloads of 1, 16 and 128 MiB (2, 32 and 256 blocks). Block ids are a random permutation
on each side (a fragmented pool, so every block is gathered and scattered), or consecutive with
``--contiguous``. pdserve's figure is the generation side's per-transfer record (bytes / seconds,
from the header's arrival to the last block scattered); the raw figure is the receiver's time
from posting the recv to its completion. The control messages travel over a pipe between the two
processes (Ray in production); "e2e" latency includes them.

Goals (issue 16): pdserve >= 0.9x raw for scattered ids at 16 and 128 MiB (median); one-block
end to end <= 0.6 ms.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from typing import Any

SIZES_MB = (1, 16, 128)
MODES = ("scattered", "consecutive")  # block ids: a random permutation / one run per side
LAYERS, TOKENS_PER_BLOCK, KV_HEADS, HEAD_DIM = 8, 16, 8, 64
DIRECT_SENDS = [0]  # KV requests the generation process sent over the direct link


def _pool(num_blocks: int) -> Any:
    import torch

    from pdserve.transport.kv_pool import KVPool

    pool = KVPool(LAYERS, num_blocks, TOKENS_PER_BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    pool.kv.normal_()
    return pool


def _block_ids(num_blocks: int, n: int, rng: random.Random, contiguous: bool) -> list[int]:
    if contiguous:
        start = rng.randrange(0, num_blocks - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(num_blocks), n)


def _raw_group(endpoint: str, rank: int) -> Any:
    import torch.distributed as dist

    host, port = endpoint.split("#", 1)[0].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=30))
    return dist.ProcessGroupGloo(dist.PrefixStore("bench-raw", store), rank, 2,
                                 datetime.timedelta(seconds=60))


def _ctx_main(conn: Any, args: dict[str, Any]) -> None:
    import torch

    from pdserve.transport.torch_dist import KVSender, TransportConfig

    torch.set_num_threads(args["threads"])
    rng = random.Random(1)
    pool = _pool(args["num_blocks"])
    sender = KVSender("bench-ctx", pool, config=TransportConfig(chunk_bytes=args["chunk_bytes"]))
    conn.send(sender.locator)  # "host:port#incarnation", as workers address each other
    raw = _raw_group(sender.endpoint, 0)
    rid = 0
    sent = torch.ones(max(args["sizes_mb"]) << 20, dtype=torch.uint8)
    while True:
        cmd, *rest = conn.recv()
        if cmd == "raw":
            raw.barrier().wait()
            raw.send([sent[: rest[0]]], 1, 1).wait()
        elif cmd == "hold":
            n, contiguous = rest
            rid += 1
            sender.hold(rid, _block_ids(pool.num_blocks, n, rng, contiguous))
            conn.send(rid)
        elif cmd == "kv":
            conn.send(sender.handle(rest[0]))
            sender.poll()
        elif cmd == "stop":
            sender.close()
            conn.send("stopped")
            return


def _gen_main(conn: Any, args: dict[str, Any]) -> None:
    import torch

    from pdserve.transport.torch_dist import KVReceiver, TransportConfig

    torch.set_num_threads(args["threads"])
    rng = random.Random(2)
    pool = _pool(args["num_blocks"])
    config = TransportConfig(chunk_bytes=args["chunk_bytes"])
    receiver = KVReceiver("bench-gen", pool, config=config)
    raw = _raw_group(args["endpoint"], 1)
    runs: dict[str, dict[str, list[float]]] = {k: {} for k in ("raw", *MODES)}
    e2e: dict[str, list[float]] = {}
    gid = 0
    buf = torch.zeros(max(args["sizes_mb"]) << 20, dtype=torch.uint8)

    def pd(n: int, contiguous: bool, link: bool = True) -> tuple[float, float]:
        nonlocal gid
        gid += 1
        return _pd_once(conn, receiver, pool, n, contiguous, args["endpoint"], rng, gid, link)

    for mb in args["sizes_mb"]:
        nbytes, n = mb << 20, max(1, (mb << 20) // pool.bytes_per_block)
        for rep in range(args["reps"] + 1):  # rep 0 warms groups and staging buffers
            conn.send(("raw", nbytes))
            raw.barrier().wait()
            t0 = time.perf_counter()
            raw.recv([buf[:nbytes]], 0, 1).wait()
            t_raw = time.perf_counter() - t0
            t_pd = {mode: pd(n, mode == "consecutive")[0] for mode in MODES}
            if rep:
                runs["raw"].setdefault(str(mb), []).append(t_raw)
                for mode in MODES:
                    runs[mode].setdefault(str(mb), []).append(t_pd[mode])
    for rep in range(args["one_block_reps"] + 1):
        for link in (True, False):  # interleaved: both control paths see the same machine
            data_s, wall_s = pd(1, False, link)
            if rep:
                runs[MODES[0]].setdefault("1blk", []).append(data_s)
                e2e.setdefault("link" if link else "pipe", []).append(wall_s)
    conn.send(("stop",))
    receiver.close()
    conn.send(("result", {"runs": runs, "e2e": e2e, "direct_sends": DIRECT_SENDS[0]}))


def _pd_once(conn: Any, receiver: Any, pool: Any, n: int, contiguous: bool, endpoint: str,
             rng: random.Random, gid: int, link: bool = True) -> tuple[float, float]:
    """One transfer of n blocks: (data-plane seconds of the generation record, wall seconds
    from issuing the request to the polled result). ``link``: the request goes over the
    direct KV link first, as workers send it; else only through the pipe relay (a control
    hop through a third process, like the Ray call that used to carry it)."""
    from pdserve.transport.protocol import encode_message

    conn.send(("hold", n, contiguous))
    ctx_rid = conn.recv()
    t0 = time.perf_counter()
    req = receiver.start(gid, ctx_worker_id="bench-ctx", ctx_endpoint=endpoint,
                         ctx_request_id=ctx_rid,
                         block_ids=_block_ids(pool.num_blocks, n, rng, contiguous),
                         timeout_s=60.0)
    payload = encode_message(req)
    # As a worker does: the direct link first (once the pair's store is connected), then the
    # copy that stands in for the Ray record call, which the context side folds into the first.
    if link and receiver.send_direct("bench-ctx", endpoint, payload):
        DIRECT_SENDS[0] += 1
    conn.send(("kv", payload))
    result = None
    while result is None:
        results = receiver.poll()
        result = results[0] if results else None
        if result is None:
            time.sleep(0.0002)
    wall = time.perf_counter() - t0
    receiver.handle(conn.recv())
    if not result.ok:
        raise RuntimeError(f"transfer failed: {result.reason}")
    return result.seconds, wall


def run(sizes_mb: tuple[int, ...], reps: int, chunk_bytes: int, threads: int,
        one_block_reps: int = 50) -> dict[str, Any]:
    mpc = mp.get_context("spawn")
    num_blocks = max(sizes_mb) * 2 + 16  # 512 KiB blocks: room for the largest payload twice
    args = {"num_blocks": num_blocks, "chunk_bytes": chunk_bytes, "reps": reps,
            "one_block_reps": one_block_reps,
            "sizes_mb": sizes_mb, "threads": threads}
    a_ctx, b_ctx = mpc.Pipe()
    ctx = mpc.Process(target=_ctx_main, args=(b_ctx, args), daemon=True)
    ctx.start()
    if not a_ctx.poll(120):
        raise TimeoutError("context process did not start")
    args["endpoint"] = a_ctx.recv()
    a_gen, b_gen = mpc.Pipe()
    gen = mpc.Process(target=_gen_main, args=(b_gen, args), daemon=True)
    gen.start()
    try:
        while True:  # relay the generation process's commands to the context process
            if not a_gen.poll(300):
                raise TimeoutError("bench stalled")
            msg = a_gen.recv()
            if msg[0] == "result":
                out = msg[1]
                break
            a_ctx.send(msg)
            if msg[0] in ("hold", "kv"):
                if not a_ctx.poll(300):
                    raise TimeoutError("context process stalled")
                a_gen.send(a_ctx.recv())
            elif msg[0] == "stop" and a_ctx.poll(30):
                a_ctx.recv()
    finally:
        for p in (gen, ctx):
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def _spread(xs: list[float], scale: float) -> dict[str, float]:
    """median, min and max of xs * scale."""
    return {"median": scale * statistics.median(xs), "min": scale * min(xs),
            "max": scale * max(xs)}


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Per payload: GB/s of each run (median, min, max) and the ratio of the medians; the ratio
    of each run to the raw run of the same rep gives min and max of the ratio too."""
    runs = out["runs"]
    rows = []
    for mb in runs["raw"]:
        nbytes = int(mb) << 20
        raw = runs["raw"][mb]
        row: dict[str, Any] = {"payload_mb": int(mb), "raw_gb_s": _spread([nbytes / t / 1e9 for t in raw], 1)}
        for mode in MODES:
            ts = runs[mode][mb]
            row[f"{mode}_gb_s"] = _spread([nbytes / t / 1e9 for t in ts], 1)
            row[f"{mode}_ratio"] = _spread([r / t for r, t in zip(raw, ts)], 1)
        rows.append(row)
    lat = {"one_block_bytes": 512 << 10,
           "data_plane_ms": _spread(runs[MODES[0]]["1blk"], 1e3),
           "e2e_link_ms": _spread(out["e2e"]["link"], 1e3),
           "e2e_pipe_ms": _spread(out["e2e"]["pipe"], 1e3),
           "direct_sends": out["direct_sends"]}
    return {"rows": rows, "one_block_latency": lat}


def _fmt(d: dict[str, float], digits: int = 2) -> str:
    return f"{d['median']:.{digits}f} [{d['min']:.{digits}f}-{d['max']:.{digits}f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB))
    ap.add_argument("--reps", type=int, default=5, help="timed transfers per payload and mode")
    ap.add_argument("--one-block-reps", type=int, default=50,
                    help="timed one-block transfers per control path")
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="TransportConfig.chunk_bytes")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    out = run(tuple(a.sizes_mb), a.reps, int(a.chunk_mb * (1 << 20)), a.threads,
              a.one_block_reps)
    s = summarize(out)
    s["config"] = {"backend": "gloo", "reps": a.reps, "chunk_mb": a.chunk_mb,
                   "block_bytes": 512 << 10, "threads": a.threads, "dtype": "float32"}
    print(f"median [min-max] of {a.reps} transfers each; ratio = pdserve / raw, rep by rep")
    print(f"{'payload':>8} {'raw GB/s':>17} | {'scattered ids GB/s':>18} {'ratio':>17} | "
          f"{'consecutive ids GB/s':>20} {'ratio':>17}")
    for r in s["rows"]:
        print(f"{r['payload_mb']:>6}MB {_fmt(r['raw_gb_s']):>17} | {_fmt(r['scattered_gb_s']):>18} "
              f"{_fmt(r['scattered_ratio']):>17} | {_fmt(r['consecutive_gb_s']):>20} "
              f"{_fmt(r['consecutive_ratio']):>17}")
    lat = s["one_block_latency"]
    print(f"one 512 KiB block, scattered ids, ms (median [min-max] of {a.one_block_reps}): "
          f"data plane {_fmt(lat['data_plane_ms'])}")
    print(f"  end to end, request over the direct KV link: {_fmt(lat['e2e_link_ms'])} "
          f"({lat['direct_sends']} sent on the link)")
    print(f"  end to end, request through a relay process: {_fmt(lat['e2e_pipe_ms'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

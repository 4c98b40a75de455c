"""What the direct KV control link saves, in a real cluster: the time from a generation worker
issuing a KV request to the context worker's first byte (the header) arriving, and what a
client sees between its first and second token (which includes the KV transfer).

Starts a local Ray cluster (this process owns it and shuts only it down) and, in turn, a 1P1D
cluster of the built-in model with the link on (the default: each KV request goes over the
direct worker-to-worker link, and also as the Ray ``kv_transfer`` call that is the dashboard's
record) and off (``LaunchConfig.kv_link=False``: the Ray call alone carries it). Each sends the
same requests one after another (no queueing: the figure is the control path, not load), with a
few in flight at once as a second condition. Figures:

  first byte  the generation worker's per-pair record (``status()["kv_pairs"]``): seconds from
              issuing the KV request to its header arriving: the control message's trip, the
              context side's claim and queue, the header's gloo message
  2nd token   client side: from the first streamed token (the context worker's) to the second
              (the generation worker's first): router hop, reservation, KV transfer, one step

Run: ``.venv/bin/python benchmarks/kv_control.py [--requests 60] [--json out.json]``.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ENGINE = dict(tokens_per_block=16, max_batch_size=16, max_num_tokens=512, num_kv_blocks=256)
PROMPT_TOKENS = 256  # 16 blocks of the built-in model's KV
RAY_TIMEOUT_S = 60.0


def _one(client, prompt: list[int], rid: str) -> float:
    """Seconds between the first and the second streamed token of one request."""
    times = []
    for resp in client.generate_stream(prompt, request_id=rid, max_tokens=3, temperature=0.0,
                                       ignore_eos=True):
        if resp.token_ids:
            times.extend([time.perf_counter()] * len(resp.token_ids))
    if len(times) < 2:
        raise RuntimeError(f"request {rid} streamed {len(times)} tokens")
    return times[1] - times[0]


def run_mode(kv_link: bool, requests: int, concurrency: int, seed: int) -> dict:
    import ray

    from pdserve.cluster.client import Client
    from pdserve.cluster.launch import LaunchConfig, builtin_model_dir, launch
    from pdserve.cluster.router import RouterConfig

    cl = launch(LaunchConfig(model=str(builtin_model_dir()), engine=ENGINE,
                             router=dataclasses.replace(RouterConfig(), port=0), kv_link=kv_link))
    try:
        rng = random.Random(seed)
        prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
        out: dict = {}
        with Client(f"127.0.0.1:{cl.port}") as client:
            for i in range(3):  # warm-up: pair group, staging buffers, code paths
                _one(client, prompts[i], f"warm-{kv_link}-{i}")
            gen = cl.workers["gen-0"]
            before = len(ray.get(gen.status.remote(), timeout=RAY_TIMEOUT_S)["kv_pairs"]["ctx-0"]
                         ["first_byte_ms"])
            out["sequential_2nd_token_ms"] = [
                1e3 * _one(client, p, f"seq-{kv_link}-{i}") for i, p in enumerate(prompts)]
            pairs = ray.get(gen.status.remote(), timeout=RAY_TIMEOUT_S)["kv_pairs"]["ctx-0"]
            out["sequential_first_byte_ms"] = pairs["first_byte_ms"][before:]
            out["link_up"] = pairs["link"]
            before = len(pairs["first_byte_ms"])
            lat: list[float] = []
            lock = threading.Lock()

            def worker(k: int) -> None:
                with Client(f"127.0.0.1:{cl.port}") as c:
                    for i in range(k, requests, concurrency):
                        v = 1e3 * _one(c, prompts[i], f"con-{kv_link}-{i}")
                        with lock:
                            lat.append(v)

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            out["concurrent_2nd_token_ms"] = lat
            pairs = ray.get(gen.status.remote(), timeout=RAY_TIMEOUT_S)["kv_pairs"]["ctx-0"]
            out["concurrent_first_byte_ms"] = pairs["first_byte_ms"][before:]
        if kv_link:
            folded = ray.get(cl.workers["ctx-0"].__ray_call__.remote(
                lambda self: self.host.core.transceiver.sender.folded), timeout=RAY_TIMEOUT_S)
            out["ctx_folded_second_copies"] = folded
        return out
    finally:
        cl.shutdown()


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-cpus", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)

    import ray

    from pdserve.cluster.launch import ensure_ray

    owns = ensure_ray(num_cpus=a.num_cpus)
    try:
        res = {mode: run_mode(mode == "link", a.requests, a.concurrency, a.seed)
               for mode in ("link", "ray")}
    finally:
        if owns:
            ray.shutdown()
    print(f"1P1D, built-in model, {PROMPT_TOKENS}-token prompts, {a.requests} requests per "
          f"condition; ms, p50 / p90")
    print(f"{'':34} {'link + Ray record':>18} {'Ray alone':>14} {'ratio p50':>10}")
    for key, label in (("sequential_first_byte_ms", "first byte, one at a time"),
                       ("sequential_2nd_token_ms", "2nd token, one at a time"),
                       ("concurrent_first_byte_ms", f"first byte, {a.concurrency} in flight"),
                       ("concurrent_2nd_token_ms", f"2nd token, {a.concurrency} in flight")):
        lk, ry = res["link"][key], res["ray"][key]
        print(f"{label:34} {statistics.median(lk):8.2f} / {_p(lk, 0.9):6.2f} "
              f"{statistics.median(ry):6.2f} / {_p(ry, 0.9):6.2f} "
              f"{statistics.median(lk) / statistics.median(ry):10.2f}")
    print(f"link up: {res['link']['link_up']}; second copies the context side folded: "
          f"{res['link'].get('ctx_folded_second_copies')}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token and to second token of one long prompt on 1P1D, after-prefill against
layer-wise KV transfer, and against the same prompt colocated, in one run.

Starts a local Ray cluster (this process owns it and shuts only it down), writes a model big
enough that a 2,048-token prefill takes well over 50 ms here (8 layers, hidden 512, 8 KV heads:
32 KiB of fp32 KV per token, 64 MiB for the prompt), and launches 1P1D twice in turn, with
``kv_transfer_mode`` after_prefill and layerwise. Each round sends fresh random prompts (no
prefix cache helps), one request at a time:

  after_prefill  ``disaggregation=ALWAYS`` on the after-prefill cluster: prefill on the context
                 worker, which streams the first token at once; the KV moves once the prefill
                 is over, then the generation worker decodes the second token
  layerwise      ``disaggregation=ALWAYS`` on the layer-wise cluster: the generation worker is
                 asked when the last prefill chunk starts and the KV follows the forward layer
                 by layer
  colocated      ``disaggregation=NEVER`` (on the after-prefill cluster): the generation worker
                 prefills and decodes; same router, same hop

Figures (client side, ms, median [min-max] over the rounds): TTFT, time to the second token
(TT2T), the 1st -> 2nd token gap, and the KV transfer's seconds as the generation worker
reported them (for layer-wise: from the header to the last layer, so it includes the forward's
remaining layers). The first token always comes from the context worker, so no mode puts the
transfer on the TTFT path; the transfer hidden is the after-prefill gap minus the layer-wise
gap, as a share of the after-prefill transfer.

Run: ``.venv/bin/python benchmarks/ttft_disagg.py [--rounds 5] [--prompt-tokens 2048] [--json F]``.
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
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TOKENS_PER_BLOCK = 16


def _one(client, prompt: list[int], rid: str, mode: str) -> dict:
    """One request, 2 tokens: client-side TTFT and TT2T, and what the router reported."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    last = None
    for resp in client.generate_stream(prompt, request_id=rid, max_tokens=2, temperature=0.0,
                                       ignore_eos=True, disaggregation=mode, timeout_s=600):
        if resp.token_ids:
            arrivals.extend([time.perf_counter()] * len(resp.token_ids))
        last = resp
    if len(arrivals) < 2:
        raise RuntimeError(f"request {rid} streamed {len(arrivals)} tokens")
    t = last.timings
    return {"ttft_ms": 1e3 * (arrivals[0] - t0), "tt2t_ms": 1e3 * (arrivals[1] - t0),
            "gap_ms": 1e3 * (arrivals[1] - arrivals[0]), "kv_ms": t.kv_transfer_ms,
            "kv_bytes": t.kv_transfer_bytes, "local": t.local_prefill}


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--num-cpus", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)

    import ray

    from pdserve.cluster.client import Client
    from pdserve.cluster.launch import LaunchConfig, ensure_ray, launch
    from pdserve.cluster.router import RouterConfig
    from pdserve.workers.loading.tiny_model import make_tiny_model

    blocks = -(-a.prompt_tokens // TOKENS_PER_BLOCK) + 1
    engine = dict(tokens_per_block=TOKENS_PER_BLOCK, max_batch_size=4,
                  max_num_tokens=a.prompt_tokens + 64, num_kv_blocks=4 * blocks,
                  max_seq_len=a.prompt_tokens + 64, max_input_len=a.prompt_tokens + 16)
    rng = random.Random(a.seed)
    res: dict[str, list[dict]] = {"after_prefill": [], "layerwise": [], "colocated": []}
    overlapped = 0
    with tempfile.TemporaryDirectory(prefix="pdserve-ttft-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden_size=a.hidden, num_layers=a.layers,
                                num_heads=8, num_kv_heads=8,
                                max_position_embeddings=a.prompt_tokens + 128)
        owns = ensure_ray(num_cpus=a.num_cpus)
        try:
            for mode in ("after_prefill", "layerwise"):
                cl = launch(LaunchConfig(model=str(model), engine=engine, router=dataclasses.replace(
                    RouterConfig(), port=0, kv_transfer_mode=mode)))
                try:
                    runs = [(mode, "ALWAYS")] + ([("colocated", "NEVER")]
                                                 if mode == "after_prefill" else [])
                    with Client(f"127.0.0.1:{cl.port}") as client:
                        def prompt() -> list[int]:
                            return [rng.randrange(3, 250) for _ in range(a.prompt_tokens)]
                        for key, how in runs:  # warm-up: code paths, staging buffers
                            _one(client, prompt(), f"warm-{key}", how)
                        for i in range(a.rounds):
                            for key, how in runs:
                                res[key].append(_one(client, prompt(), f"r{i}-{key}", how))
                    if mode == "layerwise":
                        overlapped = ray.get(cl.workers["ctx-0"].__ray_call__.remote(
                            lambda self: self.host.core.transceiver.sender.overlapped),
                            timeout=60)
                finally:
                    cl.shutdown()
        finally:
            if owns:
                ray.shutdown()

    ap, lw, c = res["after_prefill"], res["layerwise"], res["colocated"]
    if any(r["local"] for r in ap + lw) or not all(r["local"] for r in c):
        raise RuntimeError("a request did not take the route its mode asks for")
    med = statistics.median
    mib = med(r["kv_bytes"] for r in ap) / 2**20
    print(f"{a.prompt_tokens}-token prompt, {a.layers} layers x hidden {a.hidden} (fp32 KV "
          f"{mib:.0f} MiB), 1P1D, {a.rounds} rounds, one request at a time; ms, median [min-max]")
    print(f"{'':20} {'after_prefill':>24} {'layerwise':>24} {'colocated':>24} "
          f"{'lw/ap':>6} {'lw/col':>6}")
    for key, label in (("ttft_ms", "TTFT"), ("tt2t_ms", "time to 2nd token"),
                       ("gap_ms", "1st -> 2nd token"), ("kv_ms", "KV transfer (gen)")):
        xa, xl, xc = ([r[key] for r in rows] for rows in (ap, lw, c))
        col = _fmt(xc) if key != "kv_ms" else "-"
        ratio = f"{med(xl) / med(xc):6.2f}" if key != "kv_ms" else f"{'-':>6}"
        print(f"{label:20} {_fmt(xa):>24} {_fmt(xl):>24} {col:>24} {med(xl) / med(xa):6.2f} {ratio}")
    hidden = (med(r["gap_ms"] for r in ap) - med(r["gap_ms"] for r in lw)) / med(r["kv_ms"] for r in ap)
    print(f"transfer hidden by layer-wise: {100 * hidden:.0f} % of the after-prefill transfer "
          f"({med(r['kv_ms'] for r in ap):.1f} ms); layer-wise sends that began during their "
          f"prefill: {overlapped} of {len(lw) + 1}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **res, "overlapped": overlapped},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

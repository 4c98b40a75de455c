"""Time to first token and to second token of one long prompt, disaggregated (1P1D) against
colocated, in one run on one cluster.

Starts a local Ray cluster (this process owns it and shuts only it down), writes a model big
enough that a 2,048-token prefill takes well over 50 ms here (8 layers, hidden 512, 8 KV heads:
32 KiB of fp32 KV per token, 64 MiB for the prompt), and launches 1P1D. Each round sends the
same kind of prompt (fresh random tokens, so no prefix cache helps) twice, one request at a
time:

  disagg     ``disaggregation=ALWAYS``: prefill on the context worker, which streams the first
             token at once; the KV moves after the prefill (``after_prefill``, pdserve's only
             mode today), then the generation worker decodes the second token
  colocated  ``disaggregation=NEVER``: the generation worker prefills and decodes; same router,
             same hop

Figures (client side, ms, median [min-max] over the rounds): TTFT, time to the second token
(TT2T), and the KV transfer's own seconds as the generation worker reported them. In
``after_prefill`` the transfer is never on the TTFT path (the first token comes from the context
worker), it is all on the path to the second token: hidden 0 %. A layer-wise mode could hide
at most the transfer's share of the 2nd-token gap, which this run prints as the bound.

Run: ``.venv/bin/python -m bench.ttft_disagg [--rounds 5] [--prompt-tokens 2048] [--json F]``.
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
    from pdserve.workers.tiny_model import make_tiny_model

    blocks = -(-a.prompt_tokens // TOKENS_PER_BLOCK) + 1
    engine = dict(tokens_per_block=TOKENS_PER_BLOCK, max_batch_size=4,
                  max_num_tokens=a.prompt_tokens + 64, num_kv_blocks=4 * blocks,
                  max_seq_len=a.prompt_tokens + 64, max_input_len=a.prompt_tokens + 16)
    rng = random.Random(a.seed)
    res: dict[str, list[dict]] = {"ALWAYS": [], "NEVER": []}
    with tempfile.TemporaryDirectory(prefix="pdserve-ttft-") as tmp:
        model = make_tiny_model(Path(tmp) / "model", hidden_size=a.hidden, num_layers=a.layers,
                                num_heads=8, num_kv_heads=8,
                                max_position_embeddings=a.prompt_tokens + 128)
        owns = ensure_ray(num_cpus=a.num_cpus)
        try:
            cl = launch(LaunchConfig(model=str(model), engine=engine,
                                     router=dataclasses.replace(RouterConfig(), port=0)))
            try:
                with Client(f"127.0.0.1:{cl.port}") as client:
                    def prompt() -> list[int]:
                        return [rng.randrange(3, 250) for _ in range(a.prompt_tokens)]
                    for mode in ("ALWAYS", "NEVER"):  # warm-up: code paths, staging buffers
                        _one(client, prompt(), f"warm-{mode}", mode)
                    for i in range(a.rounds):
                        for mode in ("ALWAYS", "NEVER"):
                            res[mode].append(_one(client, prompt(), f"r{i}-{mode}", mode))
            finally:
                cl.shutdown()
        finally:
            if owns:
                ray.shutdown()

    d, c = res["ALWAYS"], res["NEVER"]
    if any(r["local"] for r in d) or not all(r["local"] for r in c):
        raise RuntimeError("a request did not take the route its mode asks for")
    mib = statistics.median(r["kv_bytes"] for r in d) / 2**20
    print(f"{a.prompt_tokens}-token prompt, {a.layers} layers x hidden {a.hidden} (fp32 KV "
          f"{mib:.0f} MiB), 1P1D, {a.rounds} rounds; ms, median [min-max]")
    print(f"{'':28} {'disagg (after_prefill)':>24} {'colocated':>24} {'ratio':>6}")
    for key, label in (("ttft_ms", "TTFT"), ("tt2t_ms", "time to 2nd token"),
                       ("gap_ms", "1st -> 2nd token")):
        xd, xc = [r[key] for r in d], [r[key] for r in c]
        print(f"{label:28} {_fmt(xd):>24} {_fmt(xc):>24} "
              f"{statistics.median(xd) / statistics.median(xc):6.2f}")
    kv = [r["kv_ms"] for r in d]
    gap = [r["gap_ms"] for r in d]
    print(f"{'KV transfer (gen side)':28} {_fmt(kv):>24}")
    print("transfer hidden behind prefill: 0 % (after_prefill sends once the prefill is over); "
          f"a layer-wise mode could hide at most {statistics.median(kv):.1f} ms, "
          f"{100 * statistics.median(kv) / statistics.median(gap):.0f} % of the 1st -> 2nd gap")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "disagg": d, "colocated": c}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

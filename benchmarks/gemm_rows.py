"""Decode-sized GEMMs on oneDNN-prepacked weights, by row count: what one decode step's
projections cost for 1, 2, 3 ... sequences, with and without pdserve's padding of small
inputs to ``layers.MIN_PACKED_ROWS`` rows.

    python benchmarks/gemm_rows.py                  # both vs_vllm models, fp32, one thread
    python benchmarks/gemm_rows.py --sizes medium --threads 2 --dtype bfloat16

The weights are those of every layer of the model (fused qkv, o, gate_up, down) plus the LM
head, each a separate tensor, so that a pass streams them from memory as a decode step does
rather than from the cache. For each row count it runs whole passes over them, alternating the
padded and plain calls round by round, and prints the median ms per pass and plain/padded
(> 1: padding is faster). Then it checks what padding is for: a row's result equals that row
of a 64-row product, bit for bit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# hidden, layers, heads, kv heads, intermediate, vocab: benchmarks/vs_vllm.py's SIZES
MODELS = {"small": (512, 8, 8, 2, 1408, 4096), "medium": (1024, 12, 16, 4, 2816, 4096)}


def shapes(size: str) -> list[tuple[int, int]]:
    hidden, layers, heads, kv_heads, inter, vocab = MODELS[size]
    head_dim = hidden // heads
    layer = [(hidden + 2 * kv_heads * head_dim, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * layers + [(vocab, hidden)]  # [N, K] each


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gemm_rows.py", description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16", help="rows (decode sequences) per GEMM")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=4, help="passes over the weights per round and variant")
    args = ap.parse_args(argv)

    from pdserve.workers.model import layers

    if not torch.backends.mkldnn.is_available():
        print("this torch has no oneDNN: nothing to measure")
        return 1
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    for size in args.sizes.split(","):
        weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in shapes(size)]
        packed = [layers.prepack_weight(w) for w in weights]
        mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
        print(f"{size}: {len(weights)} projections, {mb:.0f} MB of {args.dtype} weights; {args.threads} thread(s); "
              f"median of {args.rounds} rounds x {args.passes} passes")
        print(f"{'rows':>5} {'padded ms':>10} {'plain ms':>9} {'plain/padded':>13}")
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(rows, w.shape[1], generator=g).to(dtype) for w in weights]
            times: dict[int, list[float]] = {layers.MIN_PACKED_ROWS: [], 1: []}
            saved = layers.MIN_PACKED_ROWS
            try:
                for _ in range(args.rounds):
                    for minimum in times:
                        layers.MIN_PACKED_ROWS = minimum
                        t = time.perf_counter()
                        for _ in range(args.passes):
                            for x, w, p in zip(xs, weights, packed):
                                layers.linear(x, w, None, p)
                        times[minimum].append((time.perf_counter() - t) / args.passes * 1e3)
            finally:
                layers.MIN_PACKED_ROWS = saved
            padded, plain = (statistics.median(v) for v in times.values())
            print(f"{rows:>5} {padded:>10.2f} {plain:>9.2f} {plain / padded:>12.2f}x")
        x = torch.randn(64, weights[3].shape[1], generator=g).to(dtype)  # a down projection
        full = layers.linear(x, weights[3], None, packed[3])
        same = all(torch.equal(layers.linear(x[:r], weights[3], None, packed[3]), full[:r]) for r in range(1, 65))
        print(f"  down projection, rows 1-64: each row {'equals' if same else 'DIFFERS from'} "
              f"its row of the 64-row product")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

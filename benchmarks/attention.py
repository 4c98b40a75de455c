"""Decode attention backends side by side on the CPU: gather + SDPA ("sdpa") against pdserve's
C++ kernel that reads the paged pool in place ("paged", workers/model/csrc/paged_attention.cpp).

    python benchmarks/attention.py                             # fp32, the 8 x 512 Llama of benchmarks/vs_vllm.py
    python benchmarks/attention.py --contexts 128,1024 --batches 16 --dtype bfloat16

For each batch size and context length it times one whole decode step of the model
(``DecoderLM.forward``: every sequence one new token, ``context`` cached tokens, block tables
shuffled through the pool) with each backend, alternating the backends round by round, and
prints the median per step and the sdpa/paged ratio (> 1: the kernel is faster). Times are the
thread's CPU time (``time.thread_time``), which other processes on a busy machine disturb less
than wall time; one torch thread, as a worker runs. Logits of the two backends are compared
too (max |diff|).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

SMALL = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=512, intermediate_size=1408,
             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/attention.py", description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="128,512,1024,2048", help="cached tokens per sequence")
    ap.add_argument("--batches", default="1,16,64", help="decode sequences per step")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps per backend per round")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    args = ap.parse_args(argv)

    from pdserve.transport.kv_pool import KVPool
    from pdserve.workers.model import SeqBatchInfo, build_model, cpu_kernels, parse_config

    torch.set_num_threads(1)
    if not cpu_kernels.available():
        print("pdserve's CPU kernels did not build (see the log): nothing to compare")
        return 1
    dtype = getattr(torch, args.dtype)
    cfg = parse_config(SMALL)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.05)
    model.prepack_linears()
    B = args.tokens_per_block
    print(f"model: Llama hidden 512, 8 layers, GQA 8/2, head_dim 64, {args.dtype}; B = {B}; one torch thread; "
          f"median of {args.rounds} rounds x {args.steps} steps")
    print(f"{'seqs':>5} {'context':>8} {'sdpa ms/step':>13} {'paged ms/step':>14} {'sdpa/paged':>11} {'max |diff|':>11}")
    for n in [int(x) for x in args.batches.split(",")]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            nb = ctx // B + 1
            pool = KVPool.for_model(cfg, n * nb + 1, B, dtype=dtype)
            pool.kv.normal_()
            ids = list(range(pool.num_blocks))
            random.Random(n * 7 + ctx).shuffle(ids)
            seqs = [SeqBatchInfo(i, 1, ctx, tuple(ids[i * nb:(i + 1) * nb])) for i in range(n)]
            tokens = torch.randint(3, cfg.vocab_size, (n,))
            logits, times = {}, {"sdpa": [], "paged": []}
            for r in range(args.rounds):
                for backend in (("sdpa", "paged") if r % 2 == 0 else ("paged", "sdpa")):
                    model.set_attention_backend(backend)
                    logits[backend] = model(tokens, None, seqs, pool)  # also the warm-up
                    t0 = time.thread_time()
                    for _ in range(args.steps):
                        model(tokens, None, seqs, pool)
                    times[backend].append((time.thread_time() - t0) / args.steps * 1e3)
            s, p = statistics.median(times["sdpa"]), statistics.median(times["paged"])
            diff = (logits["sdpa"] - logits["paged"]).abs().max().item()
            print(f"{n:>5} {ctx:>8} {s:>13.2f} {p:>14.2f} {s / p:>10.2f}x {diff:>11.2e}", flush=True)
            del pool
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Size one model from its ``config.json`` with the roofline cost model: parameters, KV bytes per
token (an MLA latent beside the plain MHA K/V the same heads would cache), KV blocks per GiB,
weights and KV pool per GPU at a few TP/EP group sizes, and step-time estimates for prefill and
decode batches. Prints Markdown tables (docs/benchmarks.md holds one run's output).

    python benchmarks/model_sizing.py --config tests/unit/model_configs/deepseek-v3.json --gpu H200

Pure arithmetic on ``bench/cost_model.py``; nothing runs a model.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from pdserve.bench.cost_model import GPU_PRESETS, CostModel, ModelShape, SeqWork

GIB = 1 << 30


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _table(header: list[str], rows: list[list[str]], right_from: int = 1) -> list[str]:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    return ["| " + " | ".join(r) + " |" for r in (header, align, *rows)]


def _b(n: float) -> str:
    return f"{n / 1e9:,.2f} B"


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def mha_kv_bytes_per_token(shape: ModelShape) -> int:
    """The K and V an MLA model's heads would cache without the latent: K of the query/key head
    size (nope + rope), V of v_head_dim, per head and layer."""
    if shape.mla is None:
        return shape.kv_bytes_per_token
    a = shape.mla
    return shape.num_layers * shape.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) \
        * shape.dtype_bytes


def _weights_label(itemsize: float) -> str:
    return {1: "FP8", 2: "BF16", 4: "FP32"}.get(itemsize, f"{itemsize:g} B")


def report(shape: ModelShape, *, gpu: str, tps: list[int], weight_bytes: list[float], tokens_per_block: int,
           mem_fraction: float, prefill_len: int, prefill_batches: list[int], decode_context: int,
           decode_batches: list[int], config_name: str) -> list[str]:
    hw = GPU_PRESETS[gpu]
    out: list[str] = []
    m = shape.moe
    dense = shape.num_layers - (m.num_moe_layers if m else 0)
    rows = [["layers", f"{shape.num_layers} ({dense} dense, {m.num_moe_layers if m else 0} MoE)"],
            ["hidden, heads, vocabulary", f"{shape.hidden_size}, {shape.num_heads}, {shape.vocab_size:,}"]]
    if shape.mla:
        a = shape.mla
        rows.append(["attention", f"MLA: q_lora {a.q_lora_rank}, kv_lora {a.kv_lora_rank}, qk nope/rope "
                                  f"{a.qk_nope_head_dim}/{a.qk_rope_head_dim}, v {a.v_head_dim}"])
    else:
        rows.append(["attention", f"{shape.num_heads} heads / {shape.num_kv_heads} KV heads x {shape.head_dim}"])
    if m:
        shared = (f"shared experts of total width {m.shared_intermediate_size}" if m.shared_intermediate_size
                  else "no shared expert")
        rows.append(["MoE layers", f"{m.num_experts} routed experts of width {m.expert_intermediate_size}, "
                                   f"top-{m.top_k}, {shared}"])
    if dense:
        rows.append(["dense layers", f"gated MLP of width {shape.intermediate_size}"])
    rows += [["parameters stored", _b(shape.num_params)],
             ["parameters per token", _b(shape.num_active_params)]]
    out += [f"**{config_name}**, as the cost model reads it (`ModelShape.from_hf_config`)", ""]
    out += _table(["model", "from config.json"], rows, right_from=2) + [""]

    # KV per token: the cache as modelled, and (MLA) plain MHA K/V of the same heads.
    dtype = _weights_label(shape.dtype_bytes)
    kv_rows = []
    variants = [("cache as modelled", shape.kv_bytes_per_token, shape.cache_heads)]
    if shape.mla:
        a = shape.mla
        variants = [(f"MLA latent ({a.kv_lora_rank} + {a.qk_rope_head_dim})", shape.kv_bytes_per_token, 1),
                    (f"MHA K/V ({shape.num_heads} heads x ({a.qk_nope_head_dim + a.qk_rope_head_dim} + "
                     f"{a.v_head_dim}))", mha_kv_bytes_per_token(shape), shape.num_heads)]
    for label, per_token, heads in variants:
        block = per_token * tokens_per_block
        row = [label, f"{per_token // shape.num_layers:,}", f"{per_token:,}", f"{GIB / block:,.1f}"]
        for tp in tps:
            row.append(f"{GIB / (block / min(tp, heads)):,.1f}")
        kv_rows.append(row)
    out += [f"KV cache per token ({dtype}) and {tokens_per_block}-token blocks per GiB; on a TP group the "
            f"cache splits by head over at most its heads (the MLA latent is one: every GPU holds all of it)", ""]
    out += _table(["cache", "bytes / token / layer", "bytes / token", "blocks / GiB",
                   *[f"blocks / GiB of each GPU, TP{tp}" for tp in tps]], kv_rows) + [""]

    # Weights and KV pool per GPU.
    mem_rows = []
    for itemsize in weight_bytes:
        sized = replace(shape, weight_dtype_bytes=itemsize)
        for tp in tps:
            cost = CostModel(sized, hw, tp)
            per_gpu = sized.weight_bytes / tp
            usable = hw.mem_bytes * mem_fraction
            fits = per_gpu <= usable
            blocks = cost.num_kv_blocks(tokens_per_block, mem_fraction)
            row = [_weights_label(itemsize), f"TP{tp} / EP{tp}" if shape.moe else f"TP{tp}", _gb(per_gpu),
                   "yes" if fits else "no", _gb(max(0.0, usable - per_gpu)),
                   f"{blocks * tokens_per_block:,}" if fits else "-"]
            if shape.mla:  # plain MHA K/V in the same free memory, split by head over the group
                mha = (usable - per_gpu) * min(tp, shape.num_heads) // mha_kv_bytes_per_token(shape)
                row.append(f"{int(mha):,}" if fits else "-")
            mem_rows.append(row)
    header = ["weights", "group", "weights / GPU", "fit", "KV pool / GPU", "tokens in the KV pool"]
    if shape.mla:
        header.append("tokens with MHA K/V")
    out += [f"Weights and KV pool per GPU on {gpu} ({hw.mem_bytes / 1e9:g} GB, {mem_fraction:.0%} usable; experts "
            f"spread over the group's GPUs, EP = TP)", ""]
    out += _table(header, mem_rows, right_from=2) + [""]

    # Step time at the first group size that holds the weights, with the smallest weight dtype.
    itemsize = min(weight_bytes)
    sized = replace(shape, weight_dtype_bytes=itemsize)
    tp = next((t for t in tps if sized.weight_bytes / t <= hw.mem_bytes * mem_fraction), tps[-1])
    cost = CostModel(sized, hw, tp)
    pool = cost.num_kv_blocks(tokens_per_block, mem_fraction) * tokens_per_block
    step_rows = []
    for kind, batches, new, past in (("prefill", prefill_batches, prefill_len, 0),
                                     ("decode", decode_batches, 1, decode_context)):
        for n in batches:
            seqs = [SeqWork(new, past, True)] * n
            step = cost.step(seqs)
            compute = step.flops / tp / hw.flops
            memory = step.bytes / hw.bytes_per_s
            # the rest of the step: TP all-reduces (the cost model's step = overhead + roofline + these)
            comm = step.seconds - hw.step_overhead_s - hw.seq_overhead_s * n - max(compute, memory)
            tokens = n * new
            experts = f"{sized.moe.expected_experts(tokens):.1f}" if sized.moe else "-"
            step_rows.append([kind, f"{n} x {new}" + (f" @ {past}" if past else ""), experts,
                              f"{step.flops / 1e12:,.1f}", f"{step.bytes / 1e9:,.1f}",
                              f"{compute * 1e3:,.2f}", f"{memory * 1e3:,.2f}", f"{comm * 1e3:,.2f}",
                              f"{step.seconds * 1e3:,.2f}",
                              "compute" if compute >= memory else "memory", f"{tokens / step.seconds:,.0f}",
                              f"{n * (new + past) / pool:.0%}" if pool else "-"])
    out += [f"Step time on {tp} x {gpu}, {_weights_label(itemsize)} weights (cost model preset: "
            f"{hw.peak_flops / 1e12:g} TFLOP/s dense BF16 at {hw.compute_efficiency:.0%}, "
            f"{hw.mem_bw / 1e12:g} TB/s HBM at {hw.bandwidth_efficiency:.0%}, "
            f"{hw.step_overhead_s * 1e3:g} ms per step, NVLink {hw.interconnect_bw / 1e9:g} GB/s all-reduces; "
            f"experts read: uniform routing)", ""]
    out += _table(["step", "seqs x new tokens @ context", "experts read / MoE layer", "TFLOP (group)",
                   "GB read / GPU", "compute ms", "memory ms", "all-reduce ms", "step ms", "bound", "tokens / s",
                   "KV pool used"], step_rows, right_from=1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/model_sizing.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config.json (or a folder holding one)")
    parser.add_argument("--gpu", default="H200", choices=sorted(GPU_PRESETS))
    parser.add_argument("--tp", default="8,16", help="TP (= EP) group sizes, comma-separated")
    parser.add_argument("--weight-bytes", default="1,2",
                        help="bytes per weight to size (1: FP8, 2: BF16), comma-separated")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV element (2: BF16)")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--mem-fraction", type=float, default=0.9)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--prefill-batches", default="1,2,4")
    parser.add_argument("--decode-context", type=int, default=4096)
    parser.add_argument("--decode-batches", default="1,8,32,128")
    args = parser.parse_args(argv)
    shape = ModelShape.from_hf_config(args.config, dtype_bytes=args.kv_bytes)
    lines = report(shape, gpu=args.gpu, tps=_ints(args.tp), weight_bytes=_floats(args.weight_bytes),
                   tokens_per_block=args.tokens_per_block, mem_fraction=args.mem_fraction,
                   prefill_len=args.prefill_len, prefill_batches=_ints(args.prefill_batches),
                   decode_context=args.decode_context, decode_batches=_ints(args.decode_batches),
                   config_name=Path(args.config).name)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

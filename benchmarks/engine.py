"""pdserve's in-process engine against transformers on the same model and prompts, in one run.

Workload: 64 requests whose prompt and output lengths come from the Azure conversation trace,
scaled so prompts fit the model (at most 512 tokens) and outputs are at most 64 tokens; greedy,
EOS ignored so every system produces exactly the requested tokens. Model: a random Llama with 8
layers, hidden 512 (``pdserve make-tiny-model``), fp32 on CPU (bf16 on CUDA).

Systems:
- pdserve: LLM.generate over all 64 requests (continuous batching, paged KV).
- transformers batched: left-padded batches of 16 through ``generate``; a batch runs until its
  longest request is done, and only the requested tokens count as output.
- transformers sequential: one request at a time.

Each system runs in its own subprocess so its peak memory (max RSS) is its own.
Goal: pdserve >= 2x the best transformers configuration in output tokens per second.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUM_REQUESTS = 64
MAX_PROMPT = 512
MAX_OUTPUT = 64
HF_BATCH = 16
MODEL = dict(arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
             intermediate_size=1408, vocab_size=4096, max_position_embeddings=2048, seed=0)


def workload(num_requests: int) -> list[tuple[list[int], int]]:
    from pdserve.traces import fit_scale, load_trace, synth_prompt

    rows = load_trace("azure_llm_2023_conv.csv", num_requests)
    scale = fit_scale(rows, MAX_PROMPT, MAX_OUTPUT)
    return [
        (synth_prompt(r, i, scale, vocab=(3, MODEL["vocab_size"])), min(MAX_OUTPUT, max(1, r.output_len)))
        for i, r in enumerate(rows)
    ]


def make_model(path: Path) -> None:
    from pdserve.workers.loading.tiny_model import make_tiny_model

    if not (path / "config.json").exists():
        make_tiny_model(path, **MODEL)


def run_pdserve(model_dir: Path, work, device: str) -> dict:
    from pdserve import LLM, SamplingParams

    llm = LLM(model_dir, device=device, max_batch_size=64, max_num_tokens=4096, tokens_per_block=16,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=256)
    prompts = [p for p, _ in work]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    llm.generate(prompts[:2], params[:2])  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return {"output_tokens": sum(len(o.token_ids) for o in outs), "seconds": elapsed,
            "outputs": [o.token_ids for o in outs]}


def _hf_model(model_dir: Path, device: str):
    import torch
    import transformers

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    return model, torch


def run_hf(model_dir: Path, work, device: str, batch: int) -> dict:
    import transformers

    model, torch = _hf_model(model_dir, device)
    gen_cfg = lambda n: transformers.GenerationConfig(  # noqa: E731
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    useful = 0
    outputs: list[list[int]] = []

    def run(items) -> None:
        nonlocal useful
        width = max(len(p) for p, _ in items)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(items):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device),
                                 generation_config=gen_cfg(max(n for _, n in items)))
        for row, (_, n) in enumerate(items):
            outputs.append(out[row, width: width + n].tolist())
            useful += n

    run(work[:2])  # warm-up
    useful, outputs = 0, []
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        run(work[i: i + batch])
    return {"output_tokens": useful, "seconds": time.perf_counter() - t0, "outputs": outputs}


def child(args) -> int:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = workload(args.num_requests)
    if args.child == "pdserve":
        result = run_pdserve(Path(args.model_dir), work, args.device)
    elif args.child == "hf_batched":
        result = run_hf(Path(args.model_dir), work, args.device, HF_BATCH)
    else:
        result = run_hf(Path(args.model_dir), work, args.device, 1)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.device == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(args.out).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/engine.py", description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-dir", default=None, help="default: a cached random 8x512 Llama")
    parser.add_argument("--systems", default="pdserve,hf_batched,hf_sequential")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "pdserve-bench-llama-8x512")
    make_model(model_dir)
    results = {}
    for system in args.systems.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--child", system, "--out", out.name,
                   "--model-dir", str(model_dir), "--device", args.device,
                   "--num-requests", str(args.num_requests)]
            subprocess.run(cmd, check=True)
            results[system] = json.loads(Path(out.name).read_text())
        r = results[system]
        r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
        print(f"{system:<15} {r['output_tokens']:>6} tokens in {r['seconds']:7.2f} s = "
              f"{r['tokens_per_s']:8.1f} tok/s, peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)

    if "pdserve" in results:
        pd = results["pdserve"]
        for other in ("hf_batched", "hf_sequential"):
            if other in results:
                print(f"pdserve / {other}: {pd['tokens_per_s'] / results[other]['tokens_per_s']:.2f}x")
                same = sum(a == b for a, b in zip(pd["outputs"], results[other]["outputs"]))
                print(f"  identical outputs vs {other}: {same}/{len(pd['outputs'])}")
        hf = [results[k]["tokens_per_s"] for k in ("hf_batched", "hf_sequential") if k in results]
        if hf:
            ratio = pd["tokens_per_s"] / max(hf)
            print(f"goal: >= 2x the best transformers configuration: {ratio:.2f}x "
                  f"({'met' if ratio >= 2 else 'NOT met'})")
    if args.json:
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}
        Path(args.json).write_text(json.dumps({"benchmark": "engine", "device": args.device,
                                               "model": MODEL, "systems": slim}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

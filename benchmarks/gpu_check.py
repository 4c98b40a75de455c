"""GPU readiness check: pdserve against transformers on one device, in bf16, with no Ray and
nothing fetched from the network.

    python benchmarks/gpu_check.py                      # CUDA: random Llama, hidden 2048, 16 layers
    python benchmarks/gpu_check.py --small              # CUDA: hidden 1024, 16 layers
    python benchmarks/gpu_check.py --device cpu --small # a tiny model on CPU (tests the script)

It writes its own random-weight Llama (``make_tiny_model``: GQA 16/4 heads, head_dim 128, or 64
with --small) and then:

(a) parity with transformers on the device, in the model dtype (bf16 by default):
    - forward: the same token sequences through pdserve's paged forward (a first prefill chunk,
      a second chunk over cached tokens, then batched decode steps, i.e. every attention path
      including FlexAttention's) and through transformers' dense forward in bf16 and in fp32.
      Asserted (bf16/fp16): max |pdserve - transformers fp32| <= 2 x max |transformers bf16 -
      transformers fp32| over every logit, and the same for the mean |diff|; pdserve's bf16
      logits are as close to the fp32 reference as transformers' own bf16 logits, within 2x.
      In fp32: max |pdserve - transformers fp32| <= 1e-3.
    - generation: pdserve's engine (``LLM``, greedy, ignore_eos) against ``generate`` (greedy,
      one prompt at a time, no padding) on the same prompts: identical sequences and the first
      divergence of the others. In fp32 every sequence must match. In bf16 a divergence passes
      only as a near-tie: at the diverging position the two tokens' transformers-fp32 logits
      differ by at most the two bf16 error bounds measured above (max |pdserve - fp32| + max
      |transformers bf16 - fp32|).
(b) output tokens/s of pdserve's engine against transformers' batched ``generate`` (left-padded
    batches) on benchmarks/engine.py's workload (Azure conversation lengths, prompts <= 512,
    outputs <= 64, EOS ignored), both warmed up, in the same dtype on the same device.
(c) the device, torch/CUDA/transformers versions and the attention backend pdserve used
    ("sdpa": gather + SDPA, the default on CUDA; "paged": pdserve's Triton decode kernel over
    the pool, opt-in; "flex": FlexAttention over the paged pool, opt-in). Where the paged
    kernel runs, the throughput part also times the engine with the other of "sdpa"/"paged".
(d) on CUDA, CUDA graphs: the engine runs decode steps as graphs (unless --enforce-eager); the
    throughput part also times the same engine with every step eager, and one decode step at
    1, 8, 32 and 64 sequences with 256 and 2,048 cached tokens, eager against the graph, for
    each of "paged" and "sdpa".

Exit status: 0 when parity holds, 1 when it fails. Budget: under 8 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MODELS = {
    "full": dict(arch="llama", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4,
                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096, seed=0),
    "small": dict(arch="llama", hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                  intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096, seed=0),
    "cpu-small": dict(arch="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=512, vocab_size=4096, max_position_embeddings=2048, seed=0),
}
B = 16  # tokens per KV block (--tokens-per-block)
BF16_FACTOR = 2.0  # pdserve's bf16 error vs transformers' own, both against fp32
FP32_ATOL = 1e-3


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[name]


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "transformers": transformers.__version__, "python": platform.python_version()}
    if device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            env["triton"] = None
    else:
        name = platform.processor() or "cpu"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        env["device"] = f"{name} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)"
    return env


def make_model(spec: dict[str, Any], root: Path) -> Path:
    from pdserve.workers.loading.tiny_model import make_tiny_model

    name = "gpu-check-" + "-".join(f"{k}{v}" for k, v in sorted(spec.items()))
    path = root / name
    if not (path / "model.safetensors").exists():
        make_tiny_model(path, **spec)
    return path


# ------------------------------------------------------------------------------ (a) parity


def forward_parity(loaded, hf16, hf32, device: str, *, num_seqs: int = 4, prompt_lens=(37, 120, 300, 515),
                   decode_steps: int = 24, seed: int = 0) -> dict[str, Any]:
    """Logits of every position of ``num_seqs`` random sequences: pdserve (chunk 1, chunk 2
    over cached tokens, then ``decode_steps`` batched decode steps) vs transformers' dense
    forward in the model dtype and in fp32."""
    from pdserve.transport.kv_pool import KVPool
    from pdserve.workers.model import SeqBatchInfo

    model = loaded.model
    vocab = loaded.config.vocab_size
    rng = random.Random(seed)
    lens = [prompt_lens[i % len(prompt_lens)] for i in range(num_seqs)]
    seqs_tokens = [[rng.randrange(3, vocab) for _ in range(n + decode_steps)] for n in lens]
    total_blocks = sum(-(-len(t) // B) for t in seqs_tokens)
    pool = KVPool.for_model(loaded.config, total_blocks + 8, B, dtype=model.dtype, device=device)
    ids = list(range(pool.num_blocks))
    rng.shuffle(ids)  # non-contiguous block tables
    tables, k = [], 0
    for t in seqs_tokens:
        nb = -(-len(t) // B)
        tables.append(tuple(ids[k:k + nb]))
        k += nb
    done = [0] * num_seqs
    rows: list[list[torch.Tensor]] = [[] for _ in range(num_seqs)]

    def step(new_counts: list[int]) -> None:
        flat, infos = [], []
        for i, n in enumerate(new_counts):
            if n == 0:
                continue
            infos.append((i, SeqBatchInfo(len(flat), n, done[i], tables[i])))
            flat.extend(seqs_tokens[i][done[i]:done[i] + n])
        logits = model(torch.tensor(flat), None, [s for _, s in infos], pool, all_logits=True)
        for i, s in infos:
            rows[i].append(logits[s.start:s.start + s.num_new_tokens].float().cpu())
            done[i] += s.num_new_tokens

    step([max(2, (n * 3) // 5) for n in lens])  # first chunks (no cached tokens)
    step([n - done[i] for i, n in enumerate(lens)])  # the rest of each prompt, over cached tokens
    for _ in range(decode_steps):
        step([1] * num_seqs)

    pd = [torch.cat(r) for r in rows]
    stats = {"max_pd_fp32": 0.0, "max_hf_fp32": 0.0, "sum_pd": 0.0, "sum_hf": 0.0, "n": 0,
             "argmax_pd_vs_fp32": 0, "argmax_hf_vs_fp32": 0, "positions": 0}
    with torch.inference_mode():
        for i, t in enumerate(seqs_tokens):
            x = torch.tensor([t], device=device)
            l16 = hf16(x).logits[0].float().cpu()
            l32 = hf32(x).logits[0].float().cpu()
            d_pd, d_hf = (pd[i] - l32).abs(), (l16 - l32).abs()
            stats["max_pd_fp32"] = max(stats["max_pd_fp32"], d_pd.max().item())
            stats["max_hf_fp32"] = max(stats["max_hf_fp32"], d_hf.max().item())
            stats["sum_pd"] += d_pd.sum().item()
            stats["sum_hf"] += d_hf.sum().item()
            stats["n"] += d_pd.numel()
            a32 = l32.argmax(-1)
            stats["argmax_pd_vs_fp32"] += int((pd[i].argmax(-1) == a32).sum())
            stats["argmax_hf_vs_fp32"] += int((l16.argmax(-1) == a32).sum())
            stats["positions"] += len(t)
    stats["mean_pd_fp32"] = stats.pop("sum_pd") / stats["n"]
    stats["mean_hf_fp32"] = stats.pop("sum_hf") / stats.pop("n")
    return stats


def forward_ok(stats: dict[str, Any], dtype: torch.dtype) -> tuple[bool, str]:
    if dtype == torch.float32:
        ok = stats["max_pd_fp32"] <= FP32_ATOL
        return ok, f"max |pdserve - fp32| {stats['max_pd_fp32']:.2e} <= {FP32_ATOL:g}"
    ok = (stats["max_pd_fp32"] <= BF16_FACTOR * stats["max_hf_fp32"]
          and stats["mean_pd_fp32"] <= BF16_FACTOR * stats["mean_hf_fp32"])
    return ok, (f"max |pdserve - fp32| {stats['max_pd_fp32']:.4f} <= {BF16_FACTOR:g} x "
                f"{stats['max_hf_fp32']:.4f} (transformers {dtype_name(dtype)} - fp32) and mean "
                f"{stats['mean_pd_fp32']:.5f} <= {BF16_FACTOR:g} x {stats['mean_hf_fp32']:.5f}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def generation_parity(llm, hf16, hf32, device: str, prompts: list[list[int]], max_tokens: int,
                      tie_tol: float | None) -> dict[str, Any]:
    """pdserve's engine vs transformers' generate, greedy, one prompt at a time. tie_tol: the
    largest fp32-logit gap a bf16 divergence may have (None: fp32, no divergence allowed)."""
    import transformers

    from pdserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pd_out = [o.token_ids for o in llm.generate(prompts, [params] * len(prompts))]
    cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                        eos_token_id=None, pad_token_id=0)
    result: dict[str, Any] = {"sequences": len(prompts), "identical": 0, "divergences": []}
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            x = torch.tensor([p], device=device)
            hf = hf16.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)[0, len(p):].tolist()
            pd = list(pd_out[i])
            if pd == hf:
                result["identical"] += 1
                continue
            pos = next((j for j, (a, b) in enumerate(zip(pd, hf)) if a != b), min(len(pd), len(hf)))
            div: dict[str, Any] = {"prompt": i, "prompt_len": len(p), "position": pos,
                                   "pdserve_len": len(pd), "transformers_len": len(hf)}
            if pos < min(len(pd), len(hf)):
                ctx = torch.tensor([p + pd[:pos]], device=device)
                l32 = hf32(ctx).logits[0, -1].float()
                gap = abs(l32[pd[pos]].item() - l32[hf[pos]].item())
                div.update(pdserve_token=pd[pos], transformers_token=hf[pos], fp32_gap=gap,
                           fp32_argmax=int(l32.argmax()))
                div["near_tie"] = tie_tol is not None and gap <= tie_tol
            else:
                div["near_tie"] = False  # a length mismatch is never a tie
            result["divergences"].append(div)
    result["ok"] = all(d["near_tie"] for d in result["divergences"])
    return result


# ------------------------------------------------------------------------------ (b) throughput


def hf_batched(hf, work, device: str, batch: int) -> dict[str, Any]:
    """transformers' generate over left-padded batches (benchmarks/engine.py's run_hf, on an
    already loaded model): only the requested tokens count."""
    import transformers

    useful = 0

    def run(items) -> None:
        nonlocal useful
        width = max(len(p) for p, _ in items)
        ids = torch.zeros((len(items), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(items):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        n = max(n for _, n in items)
        cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                            eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
        useful += sum(n for _, n in items)

    run(work[:2])
    _sync(device)
    useful = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        run(work[i:i + batch])
    _sync(device)
    return {"output_tokens": useful, "seconds": time.perf_counter() - t0}


def pdserve_engine(llm, work, device: str) -> dict[str, Any]:
    from pdserve import SamplingParams

    prompts = [p for p, _ in work]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    # Warm-up: the whole workload once, untimed. The timed run then meets no first-time work:
    # kernels compiled for its shapes (Triton's JIT), every decode-graph bucket it reaches
    # captured (graphs are captured lazily, the first time a bucket comes up).
    llm.generate(prompts, params)
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    return {"output_tokens": sum(len(o.token_ids) for o in outs), "seconds": time.perf_counter() - t0}


def decode_step_latency(loaded, device: str, batches=(1, 8, 32, 64), contexts=(256, 2048),
                        iters: int = 30) -> dict[str, dict[str, float]]:
    """One decode step's time (ms, mean of ``iters`` after warm-up) for each batch size and
    cached length, eager forward against the captured graph, for each attention backend that
    runs here ("paged": pdserve's kernel over the pool; "sdpa": gather + SDPA). Keys
    "backend/n/context"."""
    from pdserve.transport.kv_pool import KVPool
    from pdserve.workers.model import SeqBatchInfo
    from pdserve.workers.model.flex_attention import paged_supported

    model = loaded.model
    capture = device.startswith("cuda")  # CPU: the same fixed-shape path, eager
    nb = max(contexts) // B + 1
    pool = KVPool.for_model(loaded.config, max(batches) * nb + 1, B, dtype=model.dtype, device=device)
    saved, saved_backend = model.decode_graphs, model.attention_backend
    backends = ["paged", "sdpa"] if paged_supported(device, loaded.config.head_dim) else ["sdpa"]
    out: dict[str, dict[str, float]] = {}
    try:
        for backend in backends:
            model.set_attention_backend(backend)
            graphs = model.enable_decode_graphs(pool, max_batch=max(batches), max_blocks=nb, capture=capture)
            for context in contexts:
                for n in batches:
                    seqs = [SeqBatchInfo(i, 1, context, tuple(range(i * nb, (i + 1) * nb))) for i in range(n)]
                    ids = torch.randint(3, loaded.config.vocab_size, (n,), device=device)
                    row = {}
                    for mode in ("eager", "graph"):
                        model.decode_graphs = graphs if mode == "graph" else None
                        for _ in range(3):
                            model(ids, None, seqs, pool)
                        _sync(device)
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            model(ids, None, seqs, pool)
                        _sync(device)
                        row[mode] = (time.perf_counter() - t0) / iters * 1e3
                    out[f"{backend}/{n}/{context}"] = row
                    print(f"  decode step, {backend:5s}, {n:2d} seqs x {context:4d} cached tokens: eager "
                          f"{row['eager']:.2f} ms, CUDA graph {row['graph']:.2f} ms "
                          f"({row['eager'] / row['graph']:.2f}x)", flush=True)
        for key, row in out.items():
            backend, rest = key.split("/", 1)
            if backend == "paged" and f"sdpa/{rest}" in out:
                row["graph_vs_sdpa"] = out[f"sdpa/{rest}"]["graph"] / row["graph"]
        if "paged" in backends and "sdpa" in backends:
            print("  paged kernel vs gather + SDPA, graph steps: "
                  + ", ".join(f"{k.split('/', 1)[1]} {r['graph_vs_sdpa']:.2f}x" for k, r in out.items()
                              if "graph_vs_sdpa" in r), flush=True)
    finally:
        model.decode_graphs = saved
        model.set_attention_backend(saved_backend)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="a smaller model (tiny on CPU)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    ap.add_argument("--attention-backend", choices=("default", "sdpa", "flex", "paged"), default="default",
                    help="pdserve's attention backend (default: paged on CPU, sdpa on CUDA; flex failed "
                         "to compile on an H200 with torch 2.11, docs/benchmarks.md section 22)")
    ap.add_argument("--model-root", default=None, help="where to write the model (default: a temp dir)")
    ap.add_argument("--num-requests", type=int, default=None, help="throughput workload (default 64; 12 on CPU)")
    ap.add_argument("--hf-batch", type=int, default=None, help="transformers batch size (default 16; 8 on CPU)")
    ap.add_argument("--gen-prompts", type=int, default=None, help="generation parity prompts (default 8; 6 on CPU)")
    ap.add_argument("--gen-tokens", type=int, default=None, help="generation parity length (default 64; 24 on CPU)")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no CUDA graphs for the parity run (the throughput part times both anyway)")
    ap.add_argument("--decode-latency", action="store_true",
                    help="time decode steps eager vs graph (always on CUDA with graphs; off CUDA the graph "
                         "path runs uncaptured)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    import transformers

    from pdserve import LLM
    from engine import workload  # a sibling in benchmarks/ (see its README.md)

    global B
    B = args.tokens_per_block
    from pdserve.workers.loading.loader import load_model
    from pdserve.workers.model.flex_attention import paged_supported

    device = args.device
    cpu = device == "cpu"
    dtype = _dtype(args.dtype)
    spec = MODELS["cpu-small" if cpu and args.small else "small" if args.small else "full"]
    num_requests = args.num_requests or (12 if cpu else 64)
    gen_prompts_n = args.gen_prompts or (6 if cpu else 8)
    hf_batch = args.hf_batch or (8 if cpu else 16)
    gen_tokens = args.gen_tokens or (24 if cpu else 64)
    t_start = time.perf_counter()
    report: dict[str, Any] = {"environment": environment(device), "model": spec, "dtype": dtype_name(dtype)}
    env = report["environment"]
    print("device:", env["device"], "| torch", env["torch"], "| CUDA", env["cuda"],
          "| transformers", env["transformers"], *(["| triton", env["triton"]] if "triton" in env else []))
    print("model: random Llama", {k: v for k, v in spec.items() if k not in ("arch", "seed")}, "dtype", dtype_name(dtype))

    root = Path(args.model_root or tempfile.gettempdir())
    model_dir = make_model(spec, root)
    loaded = load_model(model_dir, dtype=dtype, device=device)
    if args.attention_backend != "default":
        loaded.model.set_attention_backend(args.attention_backend)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    print(f"setup {time.perf_counter() - t_start:.1f} s; attention backend requested: "
          f"{loaded.model.attention_backend}", flush=True)

    # (a) forward parity
    t0 = time.perf_counter()
    fwd = forward_parity(loaded, hf16, hf32, device)
    f_ok, f_msg = forward_ok(fwd, dtype)
    report["forward"] = {**fwd, "ok": f_ok, "criterion": f_msg}
    print(f"forward logits ({fwd['positions']} positions: chunk, chunk over cache, batched decode): "
          f"max |pdserve - transformers fp32| {fwd['max_pd_fp32']:.4g}, max |transformers "
          f"{dtype_name(dtype)} - fp32| {fwd['max_hf_fp32']:.4g}; mean {fwd['mean_pd_fp32']:.3g} vs "
          f"{fwd['mean_hf_fp32']:.3g}; argmax = fp32's: pdserve {fwd['argmax_pd_vs_fp32']}, "
          f"transformers {fwd['argmax_hf_vs_fp32']} ({time.perf_counter() - t0:.1f} s)")
    print(f"  {'PASS' if f_ok else 'FAIL'}: {f_msg}", flush=True)

    # (a) generation parity
    t0 = time.perf_counter()
    work = workload(max(num_requests, gen_prompts_n))
    work = [([t % spec["vocab_size"] for t in p], n) for p, n in work]
    num_blocks = sum(-(-(len(p) + max(n, gen_tokens)) // B) for p, n in work) + 64
    engine_args = dict(device=device, max_batch_size=64, max_num_tokens=4096, tokens_per_block=B,
                       num_kv_blocks=num_blocks, context_chunking_policy="FIRST_COME_FIRST_SERVED",
                       chunk_unit_size=256)
    llm = LLM(loaded, enforce_eager=args.enforce_eager, **engine_args)
    graphs = loaded.model.decode_graphs
    print(f"CUDA graphs for decode steps: {'on' if graphs is not None else 'off'}", flush=True)
    tie_tol = None if dtype == torch.float32 else fwd["max_pd_fp32"] + fwd["max_hf_fp32"]
    gen_prompts = [p for p, _ in work[:gen_prompts_n]]
    gen = generation_parity(llm, hf16, hf32, device, gen_prompts, gen_tokens, tie_tol)
    report["generation"] = gen
    print(f"generation ({gen['sequences']} prompts x {gen_tokens} tokens, greedy): identical "
          f"{gen['identical']}/{gen['sequences']}; first divergences: "
          f"{[d['position'] for d in gen['divergences']] or 'none'} ({time.perf_counter() - t0:.1f} s)")
    for d in gen["divergences"]:
        print(f"  prompt {d['prompt']} (len {d['prompt_len']}): diverges at token {d['position']}"
              + (f", pdserve {d['pdserve_token']} vs transformers {d['transformers_token']}, fp32 logit gap "
                 f"{d['fp32_gap']:.4g} ({'near-tie' if d['near_tie'] else 'NOT a near-tie'}, tolerance {tie_tol})"
                 if "fp32_gap" in d else ", lengths differ"))
    print(f"  {'PASS' if gen['ok'] else 'FAIL'}: "
          + ("every sequence identical" if dtype == torch.float32 else
             f"every divergence a near-tie (fp32 gap <= {tie_tol:.4g})"), flush=True)

    # (b) throughput
    if not args.skip_throughput:
        tw = work[:num_requests]
        pd = pdserve_engine(llm, tw, device)
        runs = {"pdserve": pd}
        if graphs is not None:
            # The same engine settings with every step eager, on its own pool (the model's graphs
            # stay bound to the first engine's pool, so this one never replays them).
            eager = LLM(loaded, enforce_eager=True, **engine_args)
            runs["pdserve_eager"] = pdserve_engine(eager, tw, device)
            del eager
            report["graphs"] = {"captured": sorted(graphs.graphs), "replays": graphs.replays}
        used = loaded.model.attention_backend
        other = {"paged": "sdpa", "sdpa": "paged"}.get(used)
        if other == "sdpa" or (other == "paged" and paged_supported(device, loaded.config.head_dim)):
            # The same engine (graphs of its own) with the other decode attention: pdserve's
            # kernel over the pool against gather + SDPA.
            loaded.model.set_attention_backend(other)
            second = LLM(loaded, enforce_eager=args.enforce_eager, **engine_args)
            runs[f"pdserve_{other}"] = pdserve_engine(second, tw, device)
            del second
            loaded.model.set_attention_backend(used)
            loaded.model.decode_graphs = graphs
        del hf32
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        hf = hf_batched(hf16, tw, device, hf_batch)
        runs["transformers_batched"] = hf
        for r in runs.values():
            r["tokens_per_s"] = r["output_tokens"] / r["seconds"]
        report["throughput"] = {**runs, "hf_batch": hf_batch, "requests": len(tw),
                                "ratio": pd["tokens_per_s"] / hf["tokens_per_s"]}
        print(f"throughput ({len(tw)} requests, prompts <= 512, outputs <= 64, {dtype_name(dtype)}): "
              f"pdserve {pd['tokens_per_s']:.1f} tok/s ({pd['output_tokens']} in {pd['seconds']:.2f} s"
              f"{', CUDA graphs' if graphs is not None else ''}), "
              f"transformers batched (batch {hf_batch}) {hf['tokens_per_s']:.1f} tok/s "
              f"({hf['output_tokens']} in {hf['seconds']:.2f} s): {report['throughput']['ratio']:.2f}x")
        if "pdserve_eager" in runs:
            e = runs["pdserve_eager"]
            print(f"  pdserve eager (enforce_eager) {e['tokens_per_s']:.1f} tok/s: CUDA graphs "
                  f"{pd['tokens_per_s'] / e['tokens_per_s']:.2f}x; {len(graphs.graphs)} graphs captured, "
                  f"{graphs.replays} replays", flush=True)
        for other, what in (("sdpa", "gather + SDPA"), ("paged", "the paged kernel")):
            if f"pdserve_{other}" in runs:
                g = runs[f"pdserve_{other}"]
                print(f"  pdserve with {what} ({other}) {g['tokens_per_s']:.1f} tok/s: "
                      f"{pd['tokens_per_s'] / g['tokens_per_s']:.2f}x for {loaded.model.attention_backend}",
                      flush=True)
        if graphs is not None or args.decode_latency:
            report["decode_step_ms"] = decode_step_latency(loaded, device)

    backend = loaded.model.attention_backend
    report["attention_backend"] = backend
    if device.startswith("cuda"):
        report["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    ok = f_ok and gen["ok"]
    report["ok"] = ok
    report["seconds"] = time.perf_counter() - t_start
    print(f"attention backend used: {backend}; total {report['seconds']:.0f} s; parity "
          f"{'PASSED' if ok else 'FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

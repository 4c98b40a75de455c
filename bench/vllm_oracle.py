"""vLLM as the oracle for pdserve's sampling record: the same random-weight model, the same
requests, the same answers.

It writes a small random Llama (head size 32, which vLLM's CPU attention takes; the output
projection scaled up so greedy choices are not decided by float noise between the two
implementations), starts vLLM's OpenAI server from its own virtualenv (``--vllm-venv``; see
docs/benchmarks.md, "Peer virtualenvs"), and asks both servers' engines the same things:

- greedy outputs under each penalty, logit_bias, min_p and bad_words: identical token ids;
- the top-5 logprobs of every generated token: the same ids, values within --tolerance;
- prompt logprobs (the echo / loglikelihood path): within --tolerance.

pdserve answers through its offline ``LLM`` (the same executor and sampler its workers run); vLLM
through ``/v1/completions`` with token-id prompts and ``return_tokens_as_token_ids``. Prints one
row per case and exits 1 on any disagreement.

    .venv/bin/python bench/vllm_oracle.py --vllm-venv ~/.cache/pdserve-peers/vllm
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CASES: dict[str, dict] = {
    "greedy": {},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "presence_penalty": {"presence_penalty": 1.5},
    "all_penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.6, "presence_penalty": -0.5},
    "logit_bias": "bias",  # built per prompt: the favourite first token banned
    "min_p": {"min_p": 0.3},
    "bad_words": "bad_words",  # built per prompt
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(folder: Path, seed: int) -> Path:
    from safetensors.torch import load_file, save_file

    model = folder / "model"
    subprocess.run([sys.executable, "-m", "pdserve", "make-tiny-model", str(model), "--hidden-size", "128",
                    "--num-heads", "4", "--num-kv-heads", "2", "--num-layers", "2", "--seed", str(seed)],
                   check=True, timeout=300)
    weights = load_file(str(model / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[key] = weights[key] * 20.0  # spread the logits (see the module docstring)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def start_vllm(venv: Path, model: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_LOGGING_LEVEL="WARNING")
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--max-logprobs", "20"]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1.0)
    raise TimeoutError(f"vLLM was not ready within {timeout_s:.0f} s")


def vllm_completion(port: int, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _token_id(token: str) -> int:
    return int(token.split(":", 1)[1])  # return_tokens_as_token_ids: "token_id:123"


def compare(port: int, llm, prompts: list[list[int]], max_tokens: int, tolerance: float) -> list[dict]:
    from pdserve import SamplingParams

    rows = []
    plain = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for name, extra in CASES.items():
        same, worst, n = 0, 0.0, 0
        for prompt, base in zip(prompts, plain):
            if extra == "bias":
                fields = {"logit_bias": {base.token_ids[0]: -100.0}}
            elif extra == "bad_words":
                # A generated token that is a word of its own (not a blank, not part of a character).
                words = [w for w in (llm.engine.tokenizer.decode([t]) for t in base.token_ids)
                         if w.strip() and "\ufffd" not in w]
                if not words:
                    continue
                fields = {"bad_words": [words[0]]}
            else:
                fields = dict(extra)
            ours = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                         logprobs=5, **fields))[0]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "logprobs": 5, "return_tokens_as_token_ids": True, **fields}
            if "logit_bias" in fields:
                body["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
            theirs = vllm_completion(port, body)["choices"][0]["logprobs"]
            ids = [_token_id(t) for t in theirs["tokens"]]
            same += ids == ours.token_ids
            n += 1
            for mine, their_lp, their_top in zip(ours.logprobs, theirs["token_logprobs"], theirs["top_logprobs"]):
                worst = max(worst, abs(mine.logprob - their_lp))
                top = {_token_id(t): v for t, v in their_top.items()}
                for tid, value in mine.top:
                    if tid in top:
                        worst = max(worst, abs(value - top[tid]))
        rows.append({"case": name, "identical": f"{same}/{n}", "max_abs_logprob_diff": worst,
                     "ok": same == n and worst <= tolerance})
    # Prompt logprobs: vLLM's prompt_logprobs against pdserve's.
    worst, same = 0.0, 0
    for prompt in prompts:
        ours = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5))[0]
        theirs = vllm_completion(port, {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                        "prompt_logprobs": 5})["choices"][0]["prompt_logprobs"]
        ranks_match = True
        for mine, entry in zip(ours.prompt_logprobs, theirs[1:]):
            own = entry[str(mine.token_id)]
            worst = max(worst, abs(mine.logprob - own["logprob"]))
            ranks_match &= own["rank"] == mine.rank
        same += ranks_match and len(theirs) == len(prompt)
    rows.append({"case": "prompt_logprobs", "identical": f"{same}/{len(prompts)} ranks",
                 "max_abs_logprob_diff": worst, "ok": same == len(prompts) and worst <= tolerance})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="virtualenv with vllm-cpu")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest |logprob difference| allowed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=400.0, help="seconds vLLM may take to start")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    from pdserve import LLM

    with tempfile.TemporaryDirectory(prefix="pdserve-oracle-") as tmp:
        folder = Path(tmp)
        model = write_model(folder, args.seed)
        port = free_port()
        log = folder / "vllm.log"
        t0 = time.monotonic()
        proc = start_vllm(args.vllm_venv, model, port, log)
        try:
            wait_ready(port, proc, args.start_timeout)
            print(f"vLLM ready in {time.monotonic() - t0:.0f} s", flush=True)
            rng = random.Random(args.seed)
            prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(5, 40))] for _ in range(args.prompts)]
            llm = LLM(model, dtype="float32", num_kv_blocks=512, tokens_per_block=16)
            rows = compare(port, llm, prompts, args.max_tokens, args.tolerance)
        except Exception:
            print(log.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"{'case':<20} {'identical':>14} {'max |dlogprob|':>15}  ok")
    for r in rows:
        print(f"{r['case']:<20} {r['identical']:>14} {r['max_abs_logprob_diff']:>15.2e}  {r['ok']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

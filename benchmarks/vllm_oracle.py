"""vLLM as the oracle for pdserve's sampling record: the same random-weight model, the same
requests, the same answers.

It writes a small random Llama (head size 32, which vLLM's CPU attention takes; the output
projection scaled up so greedy choices are not decided by float noise between the two
implementations), starts vLLM's OpenAI server from its own virtualenv (``--vllm-venv``; see
docs/benchmarks.md, "Peer virtualenvs"), and asks both servers' engines the same things:

- greedy outputs under each penalty, logit_bias, min_p and bad_words: identical token ids;
- the top-5 logprobs of every generated token: the same ids, values within --tolerance;
- prompt logprobs (the echo / loglikelihood path): within --tolerance;
- special tokens (with ``--arch llama``): the same Llama with a tokenizer that adds a BOS (as
  Llama 3's and Gemma's do), text prompts through ``/v1/completions`` with and without
  ``add_special_tokens`` and a chat through ``/v1/chat/completions``: the prompt token ids
  vLLM built equal pdserve's (its offline ``LLM`` on the text; for the others the ids pdserve's
  OpenAI door builds by its defaults), and the outputs and logprobs equal as above.

pdserve answers through its offline ``LLM`` (the same core and sampler its workers run); vLLM
through ``/v1/completions`` with token-id prompts and ``return_tokens_as_token_ids``. Prints one
row per case and exits 1 on any disagreement.

``--arch`` runs other model families the same way (``all``: every family make-tiny-model
writes), one at a time, each with its own vLLM server: Llama takes every case above, the other
families the greedy case and the prompt logprobs. It ends with one row per family; a family
vLLM's CPU build cannot serve gets the one-line reason instead of failing the run.

    .venv/bin/python benchmarks/vllm_oracle.py --vllm-venv ~/.cache/pdserve-peers/vllm
    .venv/bin/python benchmarks/vllm_oracle.py --vllm-venv ~/.cache/pdserve-peers/vllm --arch all
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
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


# What vLLM's CPU build needs beyond make-tiny-model's defaults, per family.
# DeepSeek-V3: its CPU MLA kernel (CPU_MLA, the one that takes float32) is built only for the real
# model's latent width, kv_lora_rank 512 + qk_rope_head_dim 64; and the router keys real
# checkpoints carry (pdserve and transformers assume them; without them vLLM builds no
# e_score_correction_bias and fails to load the checkpoint's).
FAMILY_CONFIG: dict[str, dict] = {
    "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid"},
}
# vLLM flags per family: on a CPU with AMX vLLM picks AMX_MLA, which takes only bfloat16.
FAMILY_VLLM_ARGS: dict[str, list[str]] = {"deepseek_v3": ["--attention-backend", "CPU_MLA"]}


def write_model(folder: Path, seed: int, arch: str = "llama") -> Path:
    from safetensors.torch import load_file, save_file

    from pdserve.workers.loading.tiny_model import make_tiny_model

    # Head size 32 (128 / 4): vLLM's CPU attention takes no smaller. The families' own extra
    # sizes (experts, MLA ranks, windows) come from the registry's tiny_config.
    model = make_tiny_model(folder / f"model-{arch}", arch=arch, hidden_size=128, num_heads=4, num_kv_heads=2,
                            num_layers=2, seed=seed)
    extra = FAMILY_CONFIG.get(arch)
    if extra:  # the config changes tensor shapes, so the weights are drawn again from it
        from pdserve.workers.loading.tiny_model import _random_weights

        cfg = {**json.loads((model / "config.json").read_text()), **extra}
        (model / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(_random_weights(cfg, seed), str(model / "model.safetensors"), metadata={"format": "pt"})
    weights = load_file(str(model / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[key] = weights[key] * 20.0  # spread the logits (see the module docstring)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def write_bos_model(folder: Path, seed: int) -> Path:
    """The Llama of write_model, its tokenizer given a post-processor that puts <s> before every
    sequence (Llama's TemplateProcessing): a text prompt then encodes with a BOS unless the
    caller says add_special_tokens=False."""
    from tokenizers import Tokenizer, processors

    from pdserve.workers.loading.tiny_model import BOS_ID, SPECIAL_TOKENS

    model = write_model(folder / "bos", seed, "llama")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, BOS_ID)])
    tok.save(str(model / "tokenizer.json"))
    return model


def start_vllm(venv: Path, model: Path, port: int, log: Path, extra_args: list[str] = (),
               env_overrides: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_LOGGING_LEVEL": "WARNING", **(env_overrides or {})}
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port), "--max-logprobs", "20", *extra_args]
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


def vllm_post(port: int, path: str, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _token_id(token: str) -> int:
    return int(token.split(":", 1)[1])  # return_tokens_as_token_ids: "token_id:123"


def compare(port: int, llm, prompts: list[list[int]], max_tokens: int, tolerance: float,
            cases: dict[str, dict] = CASES) -> list[dict]:
    from pdserve import SamplingParams

    rows = []
    plain = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    mismatches: list[dict] = []
    for name, extra in cases.items():
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
            if ids != ours.token_ids:
                mismatches.append({"case": name, "prompt": prompt, "pdserve": list(ours.token_ids), "vllm": ids})
            for mine, their_lp, their_top in zip(ours.logprobs, theirs["token_logprobs"], theirs["top_logprobs"]):
                worst = max(worst, abs(mine.logprob - their_lp))
                top = {_token_id(t): v for t, v in their_top.items()}
                for tid, value in mine.top:
                    if tid in top:
                        worst = max(worst, abs(value - top[tid]))
        rows.append({"case": name, "identical": f"{same}/{n}", "same": same, "n": n,
                     "max_abs_logprob_diff": worst, "ok": same == n and worst <= tolerance})
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
    for m in mismatches:  # printed in full: a disagreement is reported, never explained away here
        print(f"MISMATCH {m['case']}: prompt={m['prompt']}\n  pdserve={m['pdserve']}\n  vllm   ={m['vllm']}",
              flush=True)
    return rows


def bos_texts(count: int, seed: int) -> list[str]:
    """Text prompts of 5-40 characters: lower-case words and blanks (one byte a character, so
    each is 5-40 tokens of the byte tokenizer, and one more with the BOS)."""
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz    ") for _ in range(rng.randint(5, 40))).strip() or "a"
            for _ in range(count)]


def _logprob_diff(ours, their_lps: list[float], their_tops: list[dict]) -> float:
    """The largest |difference| over the sampled tokens' and the top-k logprobs
    (``return_tokens_as_token_ids`` keys)."""
    worst = 0.0
    for mine, their_lp, their_top in zip(ours, their_lps, their_tops):
        worst = max(worst, abs(mine.logprob - their_lp))
        top = {_token_id(t): v for t, v in their_top.items()}
        for tid, value in mine.top:
            if tid in top:
                worst = max(worst, abs(value - top[tid]))
    return worst


def compare_special_tokens(port: int, llm, model: Path, texts: list[str], max_tokens: int,
                           tolerance: float) -> list[dict]:
    """The BOS model (write_bos_model) under vLLM's add_special_tokens defaults. Rows:
    - bos_text: /v1/completions on the text (default true) against pdserve's offline
      LLM.generate on the same text: the prompt ids (which must start with the BOS, or the case
      shows nothing), the greedy output ids, the top-5 and the prompt logprobs;
    - bos_text_off: the same with add_special_tokens false, against the ids pdserve's OpenAI
      door builds for it (the text without special tokens);
    - bos_chat: /v1/chat/completions (default false: the template writes the BOS) against the
      ids pdserve's door builds (the template rendered, then tokenized by the same default):
      one BOS, not two; output ids and logprobs as above."""
    from pdserve import SamplingParams
    from pdserve.cluster.front.openai.api import ADD_SPECIAL_TOKENS_DEFAULT, CHAT
    from pdserve.cluster.front.openai.chat_template import ChatTemplate
    from pdserve.workers.loading.tiny_model import BOS_ID

    tok = llm.engine.tokenizer
    template = ChatTemplate.from_model_dir(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    greedy = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 5,
              "return_tokens_as_token_ids": True, "return_token_ids": True}
    rows, mismatches = [], []

    def prompt_diff(ours, theirs) -> float:
        worst = 0.0
        for mine, entry in zip(ours.prompt_logprobs, (theirs or [])[1:]):
            worst = max(worst, abs(mine.logprob - entry[str(mine.token_id)]["logprob"]))
        return worst

    for case, body_extra in (("bos_text", {}), ("bos_text_off", {"add_special_tokens": False})):
        same, worst, bos_first = 0, 0.0, 0
        for text in texts:
            theirs = vllm_post(port, "/v1/completions", {"model": "tiny", "prompt": text, "prompt_logprobs": 5,
                                                         **greedy, **body_extra})["choices"][0]
            if case == "bos_text":
                ours = llm.generate([text], params)[0]  # the offline API tokenizes the text itself
            else:
                ours = llm.generate([tok.encode(text, add_special_tokens=False).ids], params)[0]
            their_prompt = theirs.get("prompt_token_ids")
            their_ids = [_token_id(t) for t in theirs["logprobs"]["tokens"]]
            bos_first += bool(their_prompt) and their_prompt[0] == BOS_ID
            ok = their_prompt == ours.prompt_token_ids and their_ids == ours.token_ids
            same += ok
            if not ok:
                mismatches.append({"case": case, "prompt": text, "pdserve": [ours.prompt_token_ids, ours.token_ids],
                                   "vllm": [their_prompt, their_ids]})
            worst = max(worst, _logprob_diff(ours.logprobs, theirs["logprobs"]["token_logprobs"],
                                             theirs["logprobs"]["top_logprobs"]))
            if their_prompt == ours.prompt_token_ids:  # else the positions do not line up: a mismatch already
                worst = max(worst, prompt_diff(ours, theirs.get("prompt_logprobs")))
        want_bos = len(texts) if case == "bos_text" else 0  # the BOS is there exactly when it should be
        rows.append({"case": case, "identical": f"{same}/{len(texts)}", "same": same, "n": len(texts),
                     "bos_first": bos_first, "max_abs_logprob_diff": worst,
                     "ok": same == len(texts) and bos_first == want_bos and worst <= tolerance})

    same, worst, single_bos = 0, 0.0, 0
    for text in texts:
        messages = [{"role": "user", "content": text}]
        ids = tok.encode(template.render(messages), add_special_tokens=ADD_SPECIAL_TOKENS_DEFAULT[CHAT]).ids
        ours = llm.generate([ids], params.replace(prompt_logprobs=None))[0]
        theirs = vllm_post(port, "/v1/chat/completions", {"model": "tiny", "messages": messages, "top_logprobs": 5,
                                                           **greedy, "logprobs": True})
        content = theirs["choices"][0]["logprobs"]["content"]
        their_ids = [_token_id(c["token"]) for c in content]
        their_prompt = theirs.get("prompt_token_ids")
        single_bos += bool(their_prompt) and their_prompt.count(BOS_ID) == 1 and their_prompt[0] == BOS_ID
        ok = their_prompt == ids and their_ids == ours.token_ids
        same += ok
        if not ok:
            mismatches.append({"case": "bos_chat", "prompt": text, "pdserve": [ids, ours.token_ids],
                               "vllm": [their_prompt, their_ids]})
        worst = max(worst, _logprob_diff(ours.logprobs, [c["logprob"] for c in content],
                                         [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content]))
    rows.append({"case": "bos_chat", "identical": f"{same}/{len(texts)}", "same": same, "n": len(texts),
                 "bos_first": single_bos, "max_abs_logprob_diff": worst,
                 "ok": same == len(texts) and single_bos == len(texts) and worst <= tolerance})
    for m in mismatches:
        print(f"MISMATCH {m['case']}: prompt={m['prompt']!r}\n  pdserve={m['pdserve']}\n  vllm   ={m['vllm']}",
              flush=True)
    return rows


_ERROR_LINE = re.compile(r"\b(\w+(Error|Exception)|NotImplementedError|AssertionError)\b: ?(.*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_reason(log_text: str, fallback: str) -> str:
    """The last exception line vLLM logged (the root cause is raised last by its engine core),
    on one line; the fallback when it logged none."""
    for line in reversed(_ANSI.sub("", log_text).splitlines()):
        found = _ERROR_LINE.search(line)
        if found and "Engine core initialization failed" not in line:
            return found.group(0).strip()[:240]
    return fallback[:240]


def run_family(arch: str, args, folder: Path) -> dict:
    """One family end to end: its model, its vLLM server (stopped before returning), pdserve's
    offline LLM, the comparison. Returns {"arch", "status", "rows" | "reason"}."""
    model = write_model(folder, args.seed, arch)

    def run(port: int, llm) -> list[dict]:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(5, 40))] for _ in range(args.prompts)]
        cases = CASES if arch == "llama" else {"greedy": CASES["greedy"]}
        return compare(port, llm, prompts, args.max_tokens, args.tolerance, cases)

    return with_vllm(arch, model, args, folder, FAMILY_VLLM_ARGS.get(arch, []), run)


def run_special_tokens(args, folder: Path) -> dict:
    """The BOS tokenizer's run (compare_special_tokens), on a server of its own: vLLM reads the
    tokenizer when it starts."""
    model = write_bos_model(folder, args.seed)

    def run(port: int, llm) -> list[dict]:
        return compare_special_tokens(port, llm, model, bos_texts(args.prompts, args.seed), args.max_tokens,
                                      args.tolerance)

    return with_vllm("llama-bos", model, args, folder, [], run)


def with_vllm(name: str, model: Path, args, folder: Path, vllm_args: list[str], run) -> dict:
    """vLLM's server and pdserve's offline LLM on ``model``; ``run(port, llm)`` gives the rows.
    The server is stopped before returning. Returns {"arch": name, "status", "rows" | "reason"}."""
    from pdserve import LLM

    port = free_port()
    log = folder / f"vllm-{name}.log"
    t0 = time.monotonic()
    proc = start_vllm(args.vllm_venv, model, port, log, vllm_args)
    try:
        try:
            wait_ready(port, proc, args.start_timeout)
        except (RuntimeError, TimeoutError) as e:
            return {"arch": name, "status": "vllm", "reason": failure_reason(log.read_text(), str(e))}
        print(f"[{name}] vLLM ready in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            llm = LLM(model, dtype="float32", num_kv_blocks=512, tokens_per_block=16)
        except Exception as e:  # noqa: BLE001 - reported as the family's row
            return {"arch": name, "status": "pdserve", "reason": f"{type(e).__name__}: {e}"[:240]}
        try:
            rows = run(port, llm)
        except urllib.error.HTTPError as e:  # vLLM refused or failed a request
            return {"arch": name, "status": "vllm",
                    "reason": f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"}
        except urllib.error.URLError as e:
            return {"arch": name, "status": "vllm", "reason": failure_reason(log.read_text(), str(e))}
        return {"arch": name, "status": "ok", "rows": rows}
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def family_row(result: dict) -> dict:
    """One line per family: greedy outputs identical token for token (over its cases), the
    largest |logprob difference| (sampled, top-5 and prompt logprobs), or why it did not run."""
    if result["status"] != "ok":
        return {"arch": result["arch"], "identical": "-", "max_abs_logprob_diff": None,
                "ok": None, "note": f"{result['status']}: {result['reason']}"}
    rows = result["rows"]
    generated = [r for r in rows if "n" in r]
    same, n = sum(r["same"] for r in generated), sum(r["n"] for r in generated)
    prompt_row = next((r for r in rows if r["case"] == "prompt_logprobs"), None)
    note = f"{len(generated)} case(s)"
    if prompt_row is not None:
        note += f"; prompt logprobs {prompt_row['identical']}"
    else:  # the BOS run: prompt ids compared in every case, prompt logprobs in the text cases
        note += "; prompt ids and prompt logprobs in each"
    return {"arch": result["arch"], "identical": f"{same}/{n}",
            "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in rows),
            "ok": all(r["ok"] for r in rows), "note": note}


def main(argv: list[str] | None = None) -> int:
    from pdserve.workers.loading.tiny_model import ARCH_ALIASES, ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="virtualenv with vllm-cpu")
    ap.add_argument("--arch", default="llama",
                    help=f"comma-separated families, or 'all' ({', '.join(ARCHITECTURES)})")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=1e-4, help="largest |logprob difference| allowed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=400.0, help="seconds vLLM may take to start")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--no-special-tokens", action="store_true",
                    help="skip the BOS tokenizer's run (otherwise it follows the llama family)")
    args = ap.parse_args(argv)
    archs = list(ARCHITECTURES) if args.arch == "all" else [ARCH_ALIASES.get(a, a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if unknown:
        ap.error(f"unknown arch {', '.join(unknown)} (choose from {', '.join(ARCHITECTURES)} or all)")

    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-oracle-") as tmp:
        names = list(archs)
        if "llama" in archs and not args.no_special_tokens:
            names.insert(names.index("llama") + 1, "llama-bos")
        for arch in names:  # one at a time: one vLLM server alive at once
            result = (run_special_tokens(args, Path(tmp)) if arch == "llama-bos"
                      else run_family(arch, args, Path(tmp)))
            results.append(result)
            if result["status"] == "ok":
                print(f"[{arch}]")
                print(f"{'case':<20} {'identical':>14} {'max |dlogprob|':>15}  ok")
                for r in result["rows"]:
                    bos = f"  (BOS first: {r['bos_first']}/{r['n']})" if "bos_first" in r else ""
                    print(f"{r['case']:<20} {r['identical']:>14} {r['max_abs_logprob_diff']:>15.2e}  {r['ok']}{bos}")
            else:
                print(f"[{arch}] not compared ({result['status']}): {result['reason']}", flush=True)
    families = [family_row(r) for r in results]
    if len(results) > 1:
        print(f"\n{'family':<12} {'identical':>10} {'max |dlogprob|':>15}  {'ok':<5} note")
        for f in families:
            diff = "-" if f["max_abs_logprob_diff"] is None else f"{f['max_abs_logprob_diff']:.2e}"
            ok = "-" if f["ok"] is None else str(f["ok"])
            print(f"{f['arch']:<12} {f['identical']:>10} {diff:>15}  {ok:<5} {f['note']}")
    if args.json:
        args.json.write_text(json.dumps({"families": families, "results": results}, indent=2))
    # A family vLLM cannot serve is a row, not a failure; a disagreement on one it serves is.
    return 0 if all(f["ok"] is not False for f in families) and any(f["ok"] for f in families) else 1


if __name__ == "__main__":
    sys.exit(main())

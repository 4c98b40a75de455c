"""`pdserve bench serve` against a live local 1P1D cluster produces every figure, and `bench
compare` runs a colocated layout (no context workers: the router prefills on the generation
worker). One Ray instance for the module; each run launches and kills only its own actors."""
from __future__ import annotations

import json
import os


os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


from pdserve.bench.plots import FIGURES  # noqa: E402
from pdserve.bench.serve import main  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLICE = ["--num-requests", "12", "--time-scale", "0.2", "--max-input-len", "160",
         "--max-output-len", "12", "--no-progress", "--warmup", "1"]


def _figures_ok(out_dir) -> None:
    for name in FIGURES:
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_bench_serve_on_a_live_1p1d_cluster_writes_every_figure(ray_cluster, tmp_path, capsys):
    out_json = tmp_path / "serve.json"
    rc = main(["serve", "--launch", "1P1D", *SLICE, "--out-dir", str(tmp_path), "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT p50/p90/p99" in text and "goodput" in text and "1P1D disaggregated" in text
    _figures_ok(tmp_path)

    doc = json.loads(out_json.read_text())
    run = doc["runs"]["1P1D"]
    s = run["summary"]
    assert s["completed"] == s["requests"] == 12 and s["failed"] == 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[metric]) >= {"p50", "p90", "p99"}
        assert 0 < s[metric]["p50"] <= s[metric]["p90"] <= s[metric]["p99"]
    assert s["throughput"]["output_tokens_per_s"] > 0 and s["goodput_rps"] > 0
    requests = run["requests"]
    assert all(r["num_tokens"] == r["max_tokens"] and not r["error"] for r in requests)
    # Every request with more than one token was prefilled on ctx-0 and its KV moved to gen-0.
    remote = [r for r in requests if r["max_tokens"] > 1]
    assert s["kv_transfer"]["transfers"] == len(remote) and s["kv_transfer"]["gb_per_s"] > 0
    assert all(not r["local_prefill"] and r["kv_bytes"] > 0 for r in remote)
    assert "pauses" in s and run["status_samples"]
    assert {w["workerId"] for w in run["final_status"]["workers"]} == {"ctx-0", "gen-0"}
    assert doc["machine"]["cpus"] >= 1 and doc["workload"]["trace"] == "azure_llm_2023_conv.csv"
    # The figures can be drawn again from the JSON alone.
    assert main(["plot", str(out_json), "--out-dir", str(tmp_path / "again")]) == 0
    _figures_ok(tmp_path / "again")


def test_bench_compare_runs_a_colocated_worker(ray_cluster, tmp_path, capsys):
    out_json = tmp_path / "compare.json"
    rc = main(["compare", "--layouts", "colocated", *SLICE, "--num-requests", "6",
               "--out-dir", str(tmp_path), "--json", str(out_json)])
    assert rc == 0
    assert "1 colocated worker" in capsys.readouterr().out
    _figures_ok(tmp_path)
    run = json.loads(out_json.read_text())["runs"]["colocated"]
    assert run["summary"]["completed"] == 6
    assert all(r["local_prefill"] and r["kv_bytes"] == 0 and r["worker"] == "gen-0" for r in run["requests"])


def test_bench_serve_replays_over_the_openai_api(ray_cluster, tmp_path, capsys):
    """--backend openai: the same replay through pdserve's HTTP front door, completions and chat."""
    from pdserve.bench.serve import DEFAULT_ENGINE
    from pdserve.cluster.launch import LaunchConfig, launch
    from pdserve.cluster.router import RouterConfig

    cluster = launch(LaunchConfig(engine=dict(DEFAULT_ENGINE), router=RouterConfig(port=0, http_port=0)))
    try:
        url = f"http://127.0.0.1:{cluster.http_port}"
        out_json = tmp_path / "openai.json"
        rc = main(["serve", "--backend", "openai", "--url", url, *SLICE, "--out-dir", str(tmp_path),
                   "--json", str(out_json)])
        assert rc == 0, capsys.readouterr().out
        run = json.loads(out_json.read_text())["runs"]["openai"]
        s = run["summary"]
        assert s["completed"] == s["requests"] == 12 and s["failed"] == 0
        assert 0 < s["ttft_ms"]["p50"] and 0 < s["tpot_ms"]["p50"] and s["goodput_rps"] > 0
        requests = run["requests"]
        assert all(r["num_tokens"] == r["max_tokens"] and not r["error"] for r in requests)
        assert sum(n for r in requests for _, n in r["deltas"]) == sum(r["max_tokens"] for r in requests)
        # pdserve's own figures came back in pdserve_timings: remote prefill, KV moved.
        assert all(r["kv_bytes"] > 0 and not r["local_prefill"] for r in requests if r["max_tokens"] > 1)

        rc = main(["serve", "--backend", "openai", "--url", url, "--endpoint", "chat", *SLICE,
                   "--num-requests", "4", "--max-input-len", "24", "--out-dir", str(tmp_path / "chat"),
                   "--json", str(tmp_path / "chat.json")])
        assert rc == 0
        chat = json.loads((tmp_path / "chat.json").read_text())["runs"]["openai"]["requests"]
        assert all(r["num_tokens"] == r["max_tokens"] and r["prompt_len"] > 0 for r in chat)
    finally:
        cluster.shutdown()

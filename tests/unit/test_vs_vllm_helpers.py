"""The pure helpers of benchmarks/vs_vllm.py (issue 46, part 5): the equal-cores bind it gives
vLLM, the servers and labels a run reports, every round printed, and the raw record's CPU facts
and file name. Nothing here starts a server."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

import vs_vllm

LSCPU = """Architecture:                         x86_64
CPU op-mode(s):                       32-bit, 64-bit
CPU(s):                               2
On-line CPU(s) list:                  0,1
Model name:                           Intel(R) Xeon(R) Platinum 8488C
Thread(s) per core:                   2
Core(s) per socket:                   1
Socket(s):                            1
Flags:                                fpu sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512_bf16 amx_tile avx_vnni hypervisor
Hypervisor vendor:                    KVM
L3 cache:                             105 MiB (1 instance)
"""


@pytest.mark.parametrize("cpus, text", [([0], "0"), ([0, 1], "0-1"), ([1, 0], "0-1"), ([0, 2, 3], "0,2-3"),
                                        ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([3, 3], "3")])
def test_cpu_list_text_is_a_linux_cpu_list(cpus, text):
    assert vs_vllm.cpu_list_text(cpus) == text


def test_cpu_list_text_refuses_no_cpus():
    with pytest.raises(ValueError):
        vs_vllm.cpu_list_text([])


def test_equal_cores_covers_this_process_affinity():
    # What pdserve's --torch-threads auto counts for a worker (os.sched_getaffinity), so vLLM's
    # engine in the equal-cores configuration is bound to the same CPUs.
    assert vs_vllm.equal_cores_bind() == vs_vllm.cpu_list_text(sorted(os.sched_getaffinity(0)))


def test_server_keys_put_each_vllm_configuration_before_pdserve():
    assert vs_vllm.server_keys(["vllm", "colocated", "1p1d"], ["default", "equal-cores"]) == \
        ["vllm", "vllm-equal", "colocated", "1p1d"]
    assert vs_vllm.server_keys(["colocated", "vllm"], ["equal-cores"]) == ["vllm-equal", "colocated"]
    assert vs_vllm.server_keys(["colocated"], ["default", "equal-cores"]) == ["colocated"]


def test_labels_say_where_vllm_runs():
    labels = vs_vllm.server_labels({"vllm": "auto", "vllm-equal": "0-1"})
    assert labels["vllm"] == "vLLM (default: bind auto)"
    assert labels["vllm-equal"] == "vLLM (equal cores: 0-1)"
    assert labels["colocated"] == "pdserve colocated"
    assert vs_vllm.server_labels({"vllm": "nobind"})["vllm"] == "vLLM (bind nobind)"


def _row(tok, tpot, ttft):
    return {"output_throughput": tok, "p50_tpot_ms": tpot, "p50_ttft_ms": ttft, "load_before": 1.0,
            "load_after": 2.0}


def _serve():
    rounds = {"vllm": [_row(100.0, 20.0, 300.0), _row(110.0, 19.0, 280.0)],
              "vllm-equal": [_row(150.0, 14.0, 200.0), _row(140.0, 15.0, 210.0)],
              "colocated": [_row(120.0, 18.0, 150.0), _row(130.0, 17.0, 160.0)]}
    return {k: {"runs": {4: {**vs_vllm.median_row(rows)}}} for k, rows in rounds.items()}


def test_every_round_is_printed_per_server():
    serve = _serve()
    labels = vs_vllm.server_labels({"vllm": "auto", "vllm-equal": "0-1"})
    lines = vs_vllm.round_lines(serve, ["vllm", "vllm-equal", "colocated"], [4], labels)
    assert len(lines) == 6  # 2 rounds x 3 servers
    assert "round 1" in lines[0] and "vLLM (default: bind auto)" in lines[0] and "100.0 tok/s" in lines[0]
    assert "round 2" in lines[4] and "vLLM (equal cores: 0-1)" in lines[4] and "TPOT p50   15.0 ms" in lines[4]
    assert "TTFT p50   160.0 ms" in lines[5]


def test_each_vllm_configuration_gets_its_own_ratios():
    serve = _serve()
    assert vs_vllm.round_ratios(serve, "colocated", 4, "output_throughput", True) == [1.2, 130 / 110]
    assert vs_vllm.round_ratios(serve, "colocated", 4, "output_throughput", True, "vllm-equal") == \
        [0.8, 130 / 140]
    # vs default the median output (125 vs 105) and TPOT (17.5 vs 19.5) pass; vs equal cores not
    size = vs_vllm.SIZES["small"]
    _, met = vs_vllm.goal_line(size, serve, [4], ["vllm", "colocated"], "vllm")
    assert met
    text, met = vs_vllm.goal_line(size, serve, [4], ["vllm", "colocated"], "vllm-equal", "vLLM (equal cores: 0-1)")
    assert not met and "against vLLM (equal cores: 0-1)" in text
    table = vs_vllm.size_table(size, serve, [4], ["vllm", "colocated"], "vllm-equal", "vLLM (equal cores: 0-1)")
    assert "vLLM (equal cores: 0-1)" in table[0] and "0.86x" in table[2]  # 125 / 145


def test_parse_lscpu_keeps_the_cpu_and_its_isa():
    cpu = vs_vllm.parse_lscpu(LSCPU)
    assert cpu["Model name"] == "Intel(R) Xeon(R) Platinum 8488C"
    assert cpu["CPU(s)"] == "2" and cpu["L3 cache"] == "105 MiB (1 instance)"
    assert cpu["isa"] == ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "avx_vnni", "f16c", "fma",
                          "sse4_1", "sse4_2"]
    assert "Flags" not in cpu and "CPU op-mode(s)" not in cpu
    json.dumps(cpu)


def test_results_path_is_named_by_utc_start(tmp_path):
    assert vs_vllm.results_path(tmp_path, 0.0) == tmp_path / "vs_vllm-19700101T000000Z.json"
    assert vs_vllm.RESULTS_DIR == Path(vs_vllm.__file__).resolve().parents[1] / "bench" / "results"


def test_arguments_expand_the_vllm_configurations(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    a = vs_vllm.parse_args(["--vllm-venv", str(venv)])
    assert a.servers == ["vllm", "vllm-equal", "colocated", "1p1d"]
    assert a.vllm_binds == {"vllm": "auto", "vllm-equal": vs_vllm.equal_cores_bind()}
    a = vs_vllm.parse_args(["--vllm-venv", str(venv), "--vllm-configs", "equal-cores", "--modes", "vllm,colocated"])
    assert a.servers == ["vllm-equal", "colocated"] and list(a.labels) == ["colocated", "1p1d", "vllm-equal"]
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--vllm-venv", str(venv), "--vllm-configs", "fast"])
    assert isinstance(a, argparse.Namespace)


def test_results_folder_holds_only_records():
    # bench/ is a package of the wheel: a .py under bench/results would be an unlisted package
    # (tests/unit/test_package_list.py) and data no code reads; only records and their README.
    folder = vs_vllm.RESULTS_DIR
    if folder.exists():
        assert {p.suffix for p in folder.iterdir()} <= {".json", ".md"}
        assert not (folder / "__init__.py").exists()

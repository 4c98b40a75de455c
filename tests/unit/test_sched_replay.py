"""The scheduler demo: trace parsing, length scaling and a short replay under each policy."""
from __future__ import annotations

import pytest

from pdserve.bench.sched_replay import ReplayConfig, main, replay
from pdserve.traces import LengthScale, fit_scale, load_trace, synth_prompt


def test_azure_trace_rows_parse_with_relative_arrivals():
    rows = load_trace("azure_llm_2023_conv.csv", 50)
    assert len(rows) == 50
    assert rows[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))
    assert (rows[0].input_len, rows[0].output_len) == (374, 44)  # first data row of the CSV


def test_mooncake_hash_ids_give_equal_blocks():
    rows = load_trace("mooncake_fast25_conversation.jsonl", 5)
    scale = LengthScale(factor=1 / 64, max_input_len=4096, max_output_len=64)
    a, b = synth_prompt(rows[0], 0, scale, (3, 1000)), synth_prompt(rows[1], 1, scale, (3, 1000))
    bt = scale.block_tokens  # 512 tokens per hash block, scaled
    assert rows[0].hash_ids[0] == rows[1].hash_ids[0] and rows[0].hash_ids[1] != rows[1].hash_ids[1]
    assert a[:bt] == b[:bt] and a[bt:2 * bt] != b[bt:2 * bt]
    assert len(a) == scale.input_len(rows[0].input_len)


def test_fit_scale_brings_the_quantile_within_limits():
    rows = load_trace("azure_llm_2023_conv.csv", 200)
    scale = fit_scale(rows, max_input_len=512, max_output_len=64)
    assert 0 < scale.factor <= 1
    assert all(1 <= scale.input_len(r.input_len) <= 512 for r in rows)


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"])
def test_short_replay_completes_every_request(policy):
    cfg = ReplayConfig(num_requests=40, policy=policy, num_blocks=96)
    records = []
    result = replay(cfg, records.append)
    assert result.finished == 40
    assert result.steps == len(records)
    if policy != "MAX_UTILIZATION":
        assert result.pauses == 0
    assert records[-1].free_blocks == 96


def test_small_pool_under_max_utilization_pauses():
    result = replay(ReplayConfig(num_requests=60, policy="MAX_UTILIZATION", num_blocks=64))
    assert result.pauses > 0 and result.finished == 60


def test_demo_command_prints_table_and_summary(capsys, tmp_path):
    out_json = tmp_path / "demo.json"
    assert main(["--policy", "MAX_UTILIZATION", "--num-requests", "30", "--table-rows", "6",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "free blocks" in text and "Summary" in text
    assert '"policy": "MAX_UTILIZATION"' in out_json.read_text()

"""Qwen3 against transformers: per-head q/k RMSNorm before RoPE; in process (chunked prefill,
prefix reuse, pause and recompute) and across a 1P1D split."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="parity tests compare against transformers")

import arch_parity as P  # noqa: E402


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return P.build_hf_model(tmp_path_factory.mktemp("qwen3"), "Qwen3Config", {"head_dim": 24})


def test_qwen3_engine_matches_transformers(qwen3):
    hf, path = qwen3
    figures = P.check_engine_parity(hf, path)
    assert figures["reused_blocks"] > 0 and figures["pauses"] > 0


def test_qwen3_over_1p1d_matches_transformers(qwen3, tmp_path):
    hf, path = qwen3
    figures = P.check_disagg_parity(hf, path, tmp_path)
    # K and V per KV head per layer per token, in fp32; whole blocks of 4 tokens travel.
    per_token = 2 * 2 * 2 * 24 * 4
    assert figures["bytes"] % (4 * per_token) == 0

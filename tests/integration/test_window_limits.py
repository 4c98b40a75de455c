"""A worker whose model slides one attention window over every layer tells the router it takes
its model's whole max_seq_len, although its KV pool holds fewer tokens (a sequence keeps only
W + T of them), and runs such a request to its length. The real pieces in one process: the tiny
model with a window, its core and WorkerHost, and the router's limits from its info."""
from __future__ import annotations

import json

import pytest

from pdserve.cluster.router.core import request_limits
from pdserve.transport.requests import SamplingParams, UpdateKind, WireRequest
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine.build import build_engine_core
from pdserve.workers.loading.memory import sliding_window_of
from pdserve.workers.process.host import WorkerHost
from pdserve.workers.loading.loader import load_config
from pdserve.workers.loading.tiny_model import make_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

B, W, MAX_SEQ_LEN, VOCAB = 4, 8, 512, 259
ENGINE = dict(tokens_per_block=B, num_kv_blocks=16, max_batch_size=4, max_num_tokens=16,
              context_chunking_policy="FIRST_COME_FIRST_SERVED", chunk_unit_size=4,
              max_seq_len=MAX_SEQ_LEN)


def _windowed_model(tmp_path):
    path = make_tiny_model(tmp_path / "tiny", arch="mistral", vocab_size=VOCAB, seed=3,
                           max_position_embeddings=MAX_SEQ_LEN)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = W
    (path / "config.json").write_text(json.dumps(config))
    assert sliding_window_of(load_config(path)) == W
    return path


def test_a_windowed_worker_takes_its_max_seq_len_beyond_its_pools_tokens(tmp_path):
    config = EngineConfig.from_kwargs(ENGINE)
    _, core = build_engine_core(str(_windowed_model(tmp_path)), config)
    host = WorkerHost(core, worker_id="win-0", role="both", config=config)
    try:
        info = host.info(VOCAB)
        pool_tokens = info.num_kv_blocks * info.tokens_per_block
        assert pool_tokens < 200 < MAX_SEQ_LEN
        assert info.max_request_tokens == info.max_seq_len == MAX_SEQ_LEN
        limits = request_limits({"win-0": info}, VOCAB)
        assert (limits.max_seq_len, limits.max_input_len) == (MAX_SEQ_LEN, MAX_SEQ_LEN - 1)
        # 120 prompt + 80 output tokens: three times what the pool holds, admitted and run.
        prompt = [(7 * i) % 250 + 3 for i in range(120)]
        stream = host.stream(WireRequest(1, "long", prompt, 80, deadline_s=120.0, sampling=SamplingParams(
            max_tokens=80, temperature=0.0, ignore_eos=True)))
        updates = stream.collect(120.0)
        assert updates[-1].kind == UpdateKind.FINISHED, updates[-1]
        assert updates[-1].finish_reason == "length"
        assert sum(len(u.new_token_ids) for u in updates) == 80
    finally:
        host.stop()

"""Models by Hub name (workers/loading/hub.py) from an offline cache built here, the options pdserve
refuses, and the launch-time memory arithmetic (workers/loading/loader.py) with a made-up budget."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from hub_cache import add_to_hub_cache  # noqa: E402

from pdserve.workers.loading import hub  # noqa: E402
from pdserve.workers.config import EngineConfig  # noqa: E402
from pdserve.workers.loading.hub import (ModelResolveError, UnsupportedOption,  # noqa: E402
                                 check_supported_options, is_repo_id, resolve_model)
from pdserve.workers.loading.loader import (ModelLoadError, check_memory, checkpoint_bytes,  # noqa: E402
                                    load_config, resolve_dtype)
from pdserve.workers.loading.tiny_model import make_tiny_model  # noqa: E402

GiB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("src") / "tiny", seed=5)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny) -> tuple[Path, Path]:
    """(the cache, the snapshot of org/tiny in it), with HF_HUB_OFFLINE=1 and the cache named by
    HF_HUB_CACHE; the working directory is an empty folder (no local org/tiny)."""
    cache = tmp_path / "hf" / "hub"
    snapshot = add_to_hub_cache(tiny, "org/tiny", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return cache, snapshot


def test_the_hand_built_cache_is_one_huggingface_hub_reads(offline_cache):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    cache, snapshot = offline_cache
    found = try_to_load_from_cache("org/tiny", "config.json", cache_dir=cache)
    assert found is not None and Path(found) == snapshot / "config.json"
    scan = scan_cache_dir(cache)
    assert scan.warnings == []
    (repo,) = scan.repos
    (revision,) = repo.revisions
    assert repo.repo_id == "org/tiny" and revision.commit_hash == snapshot.name
    assert revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_a_cached_model_resolves_to_its_snapshot(offline_cache):
    _, snapshot = offline_cache
    resolved = resolve_model("org/tiny")
    assert resolved == hub.ResolvedModel("org/tiny", snapshot, snapshot.name) and resolved.from_hub
    assert resolve_model("org/tiny", commit=snapshot.name).path == snapshot  # pinned, as workers do


def test_hf_home_alone_names_the_cache(offline_cache, monkeypatch):
    cache, snapshot = offline_cache
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    assert hub.hub_cache_dir() == cache and resolve_model("org/tiny").path == snapshot


def test_a_missing_model_names_the_id_the_cache_and_the_offline_switch(offline_cache):
    cache, _ = offline_cache
    with pytest.raises(ModelResolveError) as err:
        resolve_model("org/missing")
    assert str(err.value) == (f"model 'org/missing' is not in the Hugging Face cache at {cache} and "
                              "HF_HUB_OFFLINE=1 forbids downloading it (nor is it a local directory)")
    # The loader says the same, as its own error type.
    from pdserve.workers.loading.loader import load_model

    with pytest.raises(ModelLoadError, match="'org/missing' is not in the Hugging Face cache"):
        load_model("org/missing")


def test_without_network_a_missing_model_says_the_hub_cannot_be_reached(offline_cache, monkeypatch):
    from huggingface_hub import constants

    cache, _ = offline_cache
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refuses at once
    start = time.monotonic()
    with pytest.raises(ModelResolveError) as err:
        resolve_model("org/missing")
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "'org/missing'" in message and str(cache) in message, message


def test_a_snapshot_without_weights_is_named_incomplete(offline_cache, tiny, tmp_path):
    cache, _ = offline_cache
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_bytes((tiny / "config.json").read_bytes())
    add_to_hub_cache(partial, "org/partial", cache)
    with pytest.raises(ModelResolveError, match=r"lacks tokenizer\.json, model\.safetensors"):
        resolve_model("org/partial")


def test_a_local_directory_wins_over_the_cache(offline_cache, tiny):
    local = Path("org/tiny")  # relative to the working directory, as a user types it
    local.mkdir(parents=True)
    for f in tiny.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    resolved = resolve_model("org/tiny")
    assert resolved.path == local and resolved.commit is None and not resolved.from_hub


def test_a_missing_path_that_is_no_repo_id_says_the_directory_does_not_exist(offline_cache):
    with pytest.raises(ModelResolveError, match="model directory /no/such/model does not exist"):
        resolve_model("/no/such/model")


@pytest.mark.parametrize("name,ok", [
    ("org/name", True), ("Qwen/Qwen3-0.6B", True), ("meta-llama/Llama-3.1-8B-Instruct", True),
    ("name", False), ("/abs/path", False), ("./org/name", False), ("a/b/c", False),
    ("org/na--me", False), ("org/name.git", False), ("org/../name", False), ("-org/name", False),
    ("org/name@main", False),
])
def test_repo_ids(name, ok):
    assert is_repo_id(name) is ok


def test_refused_options_say_why(offline_cache):
    with pytest.raises(UnsupportedOption, match=r"revision='v2' is not supported: .*--local-dir"):
        check_supported_options("org/tiny", revision="v2")
    with pytest.raises(UnsupportedOption, match="revision='v2'"):
        resolve_model("org/tiny@v2")  # the @REV spelling is a revision too
    with pytest.raises(UnsupportedOption, match="tokenizer='org/other' is not supported"):
        check_supported_options("org/tiny", tokenizer="org/other")
    check_supported_options("org/tiny", tokenizer="org/tiny")  # the model's own: vLLM's default
    with pytest.raises(UnsupportedOption, match="trust_remote_code=True is not supported: "
                                                ".*LlamaForCausalLM"):
        check_supported_options("org/tiny", trust_remote_code=True)
    assert UnsupportedOption("trust_remote_code", True, "x").flag_message == \
        "--trust-remote-code is not supported: x"


def test_llm_refuses_them_before_loading_anything():
    from pdserve import LLM

    for kwargs in ({"revision": "main"}, {"tokenizer": "org/other"}, {"trust_remote_code": True}):
        with pytest.raises(ValueError, match="is not supported"):
            LLM("org/not-even-looked-up", **kwargs)


@pytest.mark.parametrize("argv,message", [
    (["--revision", "v1"], "--revision v1 is not supported"),
    (["--model", "org/tiny", "--tokenizer", "org/other"], "--tokenizer org/other is not supported"),
    (["--trust-remote-code"], "--trust-remote-code is not supported"),
])
def test_launch_refuses_them_as_usage_errors(argv, message, capsys):
    from pdserve.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["launch", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_launch_refuses_a_model_it_cannot_find_before_starting_ray(offline_cache, capsys):
    from pdserve.cli.main import main

    cache, _ = offline_cache
    for model, message in [("org/missing", f"is not in the Hugging Face cache at {cache}"),
                           ("org/tiny@v1", "revision='v1' is not supported")]:
        assert main(["launch", "--model", model]) == 2
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------- dtypes


def test_auto_dtype_follows_the_checkpoint():
    for device, stored, want in [
        ("cpu", None, torch.float32), ("cuda", None, torch.bfloat16),
        ("cpu", torch.float32, torch.float32), ("cuda", torch.float32, torch.bfloat16),
        ("cpu", torch.bfloat16, torch.bfloat16), ("cuda", torch.bfloat16, torch.bfloat16),
        ("cpu", torch.float16, torch.float16), ("cuda", torch.float16, torch.float16),
    ]:
        assert resolve_dtype(None, device, stored) == want, (device, stored)
        assert resolve_dtype("auto", device, stored) == want, (device, stored)
    assert resolve_dtype("float32", "cuda", torch.bfloat16) == torch.float32  # asked for: as asked
    assert EngineConfig(dtype="auto").dtype == "auto" and EngineConfig(dtype="half").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be auto"):
        EngineConfig(dtype="int8")


# ---------------------------------------------------------------- memory check


def test_checkpoint_bytes_come_from_the_headers_at_the_target_dtype(tiny):
    tensors = _tensors(tiny)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    params = sum(int(t.numel()) for t in tensors.values())
    assert checkpoint_bytes(tiny, torch.float32) == 4 * params
    assert checkpoint_bytes(tiny, torch.bfloat16) == 2 * params


def test_a_tied_head_in_the_checkpoint_is_not_counted(tmp_path):
    d = make_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    from safetensors.torch import save_file

    tensors = _tensors(d)
    base = checkpoint_bytes(d, torch.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"))
    assert checkpoint_bytes(d, torch.float32) == base


def test_weights_and_kv_that_do_not_fit_fail_with_the_numbers():
    budget = (int(11.3 * GiB), "cpu (MemAvailable)")
    check_memory(int(9 * GiB), 2 * GiB, torch.float32, "cpu", budget=budget)  # 11 <= 11.3
    with pytest.raises(ModelLoadError) as err:
        check_memory(int(16.1 * GiB), 2 * GiB, torch.float32, "cpu", budget=budget)
    assert str(err.value).startswith(
        "weights need 16.1 GiB (float32) and the KV cache 2.0 GiB, but only 11.3 GiB is "
        "available on cpu (MemAvailable)")


def test_the_kv_bytes_checked_are_the_pool_the_engine_allocates(tiny):
    """One memory plan sizes the pool and checks it: the blocks it checks are the blocks the
    engine allocates (its scratch block included)."""
    from pdserve.workers.loading.memory import plan_memory
    from pdserve.transport.kv_pool import KVPool

    mcfg = load_config(tiny)
    per_block = KVPool.bytes_per_block_for(mcfg.num_hidden_layers, 8, mcfg.cache_heads,
                                           mcfg.cache_head_dim, torch.float32, mcfg.kv_planes)
    plan = plan_memory(EngineConfig(tokens_per_block=8, num_kv_blocks=100), mcfg, torch.float32, "cpu")
    assert (plan.kv_blocks, plan.bytes_per_block, plan.weight_bytes) == (100, per_block, None)
    plan = plan_memory(EngineConfig(tokens_per_block=8, kv_cache_memory_bytes=10 * per_block + 1),
                       mcfg, torch.float32, "cpu", scratch_blocks=1)
    assert (plan.kv_blocks, plan.pool_blocks, plan.kv_bytes) == (10, 11, 11 * per_block)
    plan = plan_memory(EngineConfig(tokens_per_block=8, num_kv_blocks=100), mcfg, torch.bfloat16,
                       "cpu", model_dir=tiny, budget=(1 << 40, "test"))
    assert plan.bytes_per_block == per_block // 2
    assert plan.weight_bytes == checkpoint_bytes(tiny, torch.bfloat16)
    with pytest.raises(ModelLoadError, match="KV cache"):
        plan_memory(EngineConfig(tokens_per_block=8, num_kv_blocks=100), mcfg, torch.float32,
                    "cpu", model_dir=tiny, budget=(plan.weight_bytes, "test"))


def test_the_engine_refuses_before_reading_a_weight(tiny, monkeypatch):
    """LLM(...) with a budget too small for the weights: the error comes from the headers, and
    no tensor is read."""
    from pdserve import LLM
    from pdserve.workers.loading import loader

    monkeypatch.setattr(loader, "memory_budget", lambda device: (1000, "cpu (a test's budget)"))
    monkeypatch.setattr(loader, "_iter_tensors",
                        lambda files: pytest.fail("weights were read before the memory check"))
    with pytest.raises(ModelLoadError, match=r"weights need 0\.5 MiB \(float32\) and the KV cache "
                                             r"0\.0 MiB, but only 0\.0 MiB is available on cpu "
                                             r"\(a test's budget\)"):
        LLM(str(tiny), num_kv_blocks=4, tokens_per_block=8)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))



def test_a_worker_pinned_to_another_commit_says_which(offline_cache):
    other = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(ModelResolveError, match=f"'org/tiny' at commit {other} \\(the launch node's\\) "
                                                "is not in the Hugging Face cache"):
        resolve_model("org/tiny", commit=other)


def test_workers_get_the_hub_settings_but_never_a_token(monkeypatch, tmp_path):
    from pdserve.cluster.launch import WORKER_ENV, worker_env

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.delenv("HF_HOME", raising=False)
    env = worker_env()
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(tmp_path)
    assert "HF_TOKEN" not in env and "HF_HOME" not in env
    assert all(env[k] == v for k, v in WORKER_ENV.items())

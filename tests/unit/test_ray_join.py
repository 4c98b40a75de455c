"""Joining a Ray cluster without starting one: the auth-mode probe against a stand-in GCS (a
gRPC server that answers the probe as a token-auth GCS would), and the per-role resource flags."""
from __future__ import annotations

import argparse
from concurrent import futures

import grpc
import pytest

from pdserve.cli.main import add_launch_arguments, launch_config_from_args
from pdserve.cluster import launch as L

TOKEN = "a" * 64


@pytest.fixture
def fake_gcs():
    """A server for the probe's one method that wants ``Bearer TOKEN`` when ``auth`` is on."""
    state = {"auth": True}

    def get_cluster_id(request: bytes, context) -> bytes:
        meta = dict(context.invocation_metadata())
        if state["auth"] and meta.get("authorization") != f"Bearer {TOKEN}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(get_cluster_id, request_deserializer=None,
                                                  response_serializer=None)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "ray.rpc.NodeInfoGcsService", {"GetClusterId": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", state
    server.stop(0)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token unless a test writes one
    return monkeypatch


def test_probe_tells_token_auth_from_none(fake_gcs):
    address, state = fake_gcs
    assert L.probe_gcs(address) == "unauthenticated"
    assert L.probe_gcs(address, "wrong") == "unauthenticated"
    assert L.probe_gcs(address, TOKEN) == "ok"
    state["auth"] = False
    assert L.probe_gcs(address) == "ok"


def test_probe_of_nothing_says_so():
    with pytest.raises(L.RayJoinError, match="no Ray cluster answers at 127.0.0.1:1"):
        L.probe_gcs("127.0.0.1:1", timeout_s=2)


def test_token_cluster_without_a_token_fails_at_once_naming_what_to_set(fake_gcs, clean_env):
    address, _ = fake_gcs
    with pytest.raises(L.RayJoinError) as err:
        L.prepare_ray_auth(address)
    message = str(err.value)
    assert "token authentication on" in message and "RAY_AUTH_TOKEN" in message
    assert "~/.ray/auth_token" in message and "ray get-auth-token" in message


def test_token_cluster_with_the_token_turns_token_mode_on(fake_gcs, clean_env):
    import os

    address, _ = fake_gcs
    clean_env.setenv("RAY_AUTH_TOKEN", TOKEN)
    L.prepare_ray_auth(address)
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_token_cluster_with_a_wrong_token_or_auth_disabled_here_fails(fake_gcs, clean_env):
    address, _ = fake_gcs
    clean_env.setenv("RAY_AUTH_TOKEN", "b" * 64)
    with pytest.raises(L.RayJoinError, match="refuses the token from RAY_AUTH_TOKEN"):
        L.prepare_ray_auth(address)
    clean_env.setenv("RAY_AUTH_TOKEN", TOKEN)
    clean_env.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(L.RayJoinError, match="RAY_AUTH_MODE=disabled is set here"):
        L.prepare_ray_auth(address)


def test_cluster_without_auth_is_joined_as_is(fake_gcs, clean_env):
    import os

    address, state = fake_gcs
    state["auth"] = False
    L.prepare_ray_auth(address)
    assert "RAY_AUTH_MODE" not in os.environ


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(list(argv))


def test_resource_flags_reach_the_launch_config():
    cfg = launch_config_from_args(parse("--context-resources", '{"prefill_node": 1}',
                                        "--generation-resources", '{"decode_node": 0.5}'))
    assert cfg.context_resources == {"prefill_node": 1}
    assert cfg.generation_resources == {"decode_node": 0.5}


@pytest.mark.parametrize("value, says", [
    ("{bad", "not JSON"), ("[1]", "must be a mapping"), ('{"CPU": 2}', "set by pdserve"),
    ('{"x": -1}', "must be a number >= 0"), ('{"x": "1"}', "must be a number >= 0")])
def test_a_bad_resource_flag_is_an_error_naming_the_flag(value, says, capsys):
    with pytest.raises(SystemExit):
        parse("--generation-resources", value)
    err = capsys.readouterr().err
    assert "argument --generation-resources" in err and says in err


def test_torch_threads_flag_reaches_the_launch_config_and_is_checked(capsys):
    assert launch_config_from_args(parse()).torch_threads == "auto"  # the node's CPUs, shared
    assert launch_config_from_args(parse("--torch-threads", "2")).torch_threads == 2
    assert launch_config_from_args(parse("--torch-threads", "AUTO")).torch_threads == "auto"
    # Threads per step size: the flag's text reaches the engine options (EngineConfig parses it).
    assert launch_config_from_args(parse("--small-step-threads", "auto")).engine["small_step_threads"] == "auto"
    assert "small_step_threads" not in launch_config_from_args(parse()).engine  # launch's default
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse("--torch-threads", bad)
        assert "argument --torch-threads: expected a positive integer or auto" in capsys.readouterr().err
    with pytest.raises(ValueError, match="torch_threads must be an integer >= 1 or 'auto', got 0"):
        L.LaunchConfig(torch_threads=0)


def test_auto_threads_share_each_node_among_its_workers(monkeypatch):
    """Three workers on one node and one alone on another: each learns how many share its node,
    and divides that node's CPUs (the machine's count, not Ray's logical one) by it."""
    import importlib

    pgmod = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is a function)

    class Group:
        def __init__(self, name: str, nodes: dict[int, str]) -> None:
            self.id, self.nodes = name, nodes

    monkeypatch.setattr(pgmod, "placement_group_table", lambda pg: {"bundles_to_node_id": pg.nodes})
    shared = Group("shared", {0: "a", 1: "a", 2: "b", 3: "a"})
    assert L.workers_per_node([(shared, i, 1) for i in range(4)], [1] * 4) == [3, 3, 1, 3]
    # a worker group's every rank is a process sharing its node's cores
    group = Group("tp", {0: "b", 1: "b"})
    assert L.workers_per_node([(shared, 0, 1), (shared, 2, 1), (group, 0, 2)], [1, 1, 2]) == [1, 3, 3]
    from pdserve.workers.config import auto_threads

    assert [auto_threads(2, 3), auto_threads(8, 1), auto_threads(2, 1), auto_threads(16, 3)] == [1, 8, 2, 5]


def test_yaml_resources_are_checked_too():
    with pytest.raises(ValueError, match="context_resources: 'GPU' is set by pdserve"):
        L.LaunchConfig(context_resources={"GPU": 1})


def test_builtin_model_is_the_same_wherever_it_is_written(tmp_path):
    """A worker on a node without the launching node's copy writes its own: the same bytes."""
    from pdserve.workers.loading.tiny_model import write_builtin_model

    a, b = write_builtin_model(tmp_path / "a" / "m"), write_builtin_model(tmp_path / "b" / "m")
    files = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in files and files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert write_builtin_model(a) == a  # there already: left as it is

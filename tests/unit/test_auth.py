"""Front-door security decisions (cluster/auth.py): where keys come from and what a bad one
says (never the key), bearer parsing, matching against every key, per-key caps, TLS option
pairing, the loopback test and the unprotected-bind warning, client targets; and that neither
RouterConfig nor a client Connection shows a key in its repr."""
from __future__ import annotations

import pytest

from pdserve.cluster import auth as A
from pdserve.cluster.client import Connection
from pdserve.cluster.router import RouterConfig

SECRET = "sk-unit-3b1f9c2e"


def test_keys_from_flags_file_and_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\n\n  key-b  \nkey-c\nkey-a\n")
    env = {A.API_KEY_ENV: " env-key \n"}
    assert A.load_api_keys(["key-a"], str(f), env) == ("key-a", "key-b", "key-c")
    assert A.load_api_keys(["key-a", "key-a"], None, env) == ("key-a",)
    assert A.load_api_keys((), None, env) == ("env-key",)  # only when no flag and no file
    assert A.load_api_keys((), None, {}) == ()


def test_bad_keys_name_the_field_and_never_quote_the_key(tmp_path):
    bad = "sk bad key"
    with pytest.raises(A.SecurityConfigError) as info:
        A.load_api_keys([bad], None, {})
    assert str(info.value).startswith("--api-key:") and bad not in str(info.value)
    f = tmp_path / "keys"
    f.write_text("good\nsk\tsecret\n")
    with pytest.raises(A.SecurityConfigError) as info:
        A.load_api_keys((), str(f), {})
    assert str(info.value).startswith("--api-key-file line 2:") and "secret" not in str(info.value)
    with pytest.raises(A.SecurityConfigError, match="^--api-key-file: cannot read"):
        A.load_api_keys((), str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(A.SecurityConfigError, match="holds no key"):
        A.load_api_keys((), str(tmp_path / "empty"), {})
    with pytest.raises(A.SecurityConfigError, match="^--api-key: a key must not be empty"):
        A.check_key("", "--api-key")
    with pytest.raises(A.SecurityConfigError, match=f"^{A.API_KEY_ENV}:"):
        A.load_api_keys((), None, {A.API_KEY_ENV: "caf\u00e9"})


def test_bearer_token():
    assert A.bearer_token(f"Bearer {SECRET}") == SECRET
    assert A.bearer_token(f"bearer   {SECRET} ") == SECRET
    for value in (None, "", "Bearer", "Bearer ", f"Basic {SECRET}", SECRET):
        assert A.bearer_token(value) is None


def test_keyring_matches_every_key_and_keeps_only_digests():
    ring = A.KeyRing(["k1", SECRET, "k3"])
    assert ring.enabled and len(ring) == 3
    assert [ring.match(k) for k in ("k1", SECRET, "k3")] == [0, 1, 2]
    for wrong in (None, "", "k", "k1 ", SECRET[:-1], SECRET + "x", SECRET.upper()):
        assert ring.match(wrong) is None
    assert ring.authenticate(f"Bearer {SECRET}") == 1 and ring.authenticate(SECRET) is None
    assert SECRET not in repr(ring) and SECRET not in repr(vars(ring))
    assert ring.fingerprints[1] == A.fingerprint(SECRET) and SECRET not in A.fingerprint(SECRET)
    assert not A.KeyRing().enabled and A.KeyRing().match("anything") is None


def test_keyring_caps_each_key_on_its_own():
    ring = A.KeyRing(["a", "b"], max_inflight_per_key=2)
    assert ring.try_acquire(0) and ring.try_acquire(0) and not ring.try_acquire(0)
    assert ring.try_acquire(1)  # another key has its own budget
    ring.release(0)
    assert ring.try_acquire(0) and ring.in_flight == [2, 1]
    for _ in range(2):
        ring.release(0)
    with pytest.raises(RuntimeError, match="release without acquire"):
        ring.release(0)
    uncapped = A.KeyRing(["a"])
    assert all(uncapped.try_acquire(0) for _ in range(1000))
    with pytest.raises(A.SecurityConfigError, match="^max_inflight_per_key:"):
        A.KeyRing(["a"], max_inflight_per_key=0)


def test_tls_options_pair_up_and_files_are_checked(tmp_path):
    assert A.TlsFiles.from_options(None, None, None) is None
    with pytest.raises(A.SecurityConfigError, match="^--tls-cert: given without --tls-key"):
        A.TlsFiles.from_options("c.pem", None, None)
    with pytest.raises(A.SecurityConfigError, match="^--tls-key: given without --tls-cert"):
        A.TlsFiles.from_options(None, "k.pem", None)
    with pytest.raises(A.SecurityConfigError, match="^--tls-client-ca: mutual TLS needs"):
        A.TlsFiles.from_options(None, None, "ca.pem")
    (tmp_path / "c.pem").write_text("not a certificate")
    tls = A.TlsFiles.from_options(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), None)
    with pytest.raises(A.SecurityConfigError, match="^--tls-cert: .* is not a PEM file"):
        tls.check()
    with pytest.raises(ValueError, match="^--tls-key: given without --tls-cert"):
        RouterConfig(tls_key="k.pem")


def test_loopback_and_the_unprotected_bind_warning():
    for host in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert A.is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "192.0.2.2", "router.example.com"):
        assert not A.is_loopback(host), host
    doors = [("gRPC", "0.0.0.0"), ("HTTP", "127.0.0.1")]
    warnings = A.exposure_warnings(doors, api_keys=False, tls=False)
    assert len(warnings) == 1 and "gRPC" in warnings[0] and "0.0.0.0" in warnings[0]
    assert A.exposure_warnings(doors, api_keys=True, tls=False) == []
    assert A.exposure_warnings(doors, api_keys=False, tls=True) == []
    assert A.exposure_warnings([("gRPC", "127.0.0.1")], api_keys=False, tls=False) == []


def test_router_config_hides_keys_and_checks_them():
    cfg = RouterConfig(api_keys=[SECRET, "k2"], max_inflight_per_key=3)
    assert cfg.api_keys == (SECRET, "k2") and SECRET not in repr(cfg)
    with pytest.raises(ValueError, match="^api_keys:") as info:
        RouterConfig(api_keys=["has space"])
    assert "has space" not in str(info.value)
    with pytest.raises(ValueError, match="^max_inflight_per_key: needs API keys"):
        RouterConfig(max_inflight_per_key=2)


def test_client_targets_and_connection(monkeypatch, tmp_path):
    assert A.split_target("https://r.example:443/") == ("r.example:443", True)
    assert A.split_target("grpcs://r:1") == ("r:1", True)
    assert A.split_target("http://r:1") == ("r:1", False)
    assert A.split_target("r:1") == ("r:1", None)
    monkeypatch.delenv(A.API_KEY_ENV, raising=False)
    plain = Connection.from_target("127.0.0.1:50051")
    assert (plain.target, plain.tls, plain.metadata) == ("127.0.0.1:50051", False, None)
    monkeypatch.setenv(A.API_KEY_ENV, SECRET)
    keyed = Connection.from_target("https://r:1", tls_ca=str(tmp_path / "ca.pem"))
    assert keyed.tls and keyed.metadata == (("authorization", f"Bearer {SECRET}"),)
    assert SECRET not in repr(keyed)
    assert Connection.from_target("r:1", api_key="other").api_key == "other"
    assert Connection.from_target("r:1", tls_ca="ca.pem").tls  # a CA file means TLS
    with pytest.raises(A.SecurityConfigError, match="plaintext target"):
        Connection.from_target("http://r:1", tls_ca="ca.pem")
    with pytest.raises(A.SecurityConfigError, match="^--tls-client-cert"):
        Connection.from_target("https://r:1", tls_client_cert="c.pem")
    with pytest.raises(A.SecurityConfigError, match="^--tls-ca: cannot read"):
        Connection.from_target("https://r:1", tls_ca=str(tmp_path / "missing.pem")).credentials()


def test_launch_flags_build_the_router_config_and_its_warning(tmp_path, monkeypatch):
    """What `pdserve launch` turns its flags into, and the warning it prints to stderr."""
    import argparse

    from pdserve.cli import main as cli

    def config(*argv):
        parser = argparse.ArgumentParser()
        cli.add_launch_arguments(parser)
        return cli.launch_config_from_args(parser.parse_args(list(argv))).router

    monkeypatch.delenv(A.API_KEY_ENV, raising=False)
    default = config()
    assert (default.host, default.http_host, default.api_keys) == ("127.0.0.1", "127.0.0.1", ())
    assert cli._security_warnings(default) == []
    exposed = config("--host", "0.0.0.0", "--http-port", "8000")
    assert exposed.http_host == "0.0.0.0"  # --host binds both doors unless --http-host says otherwise
    warnings = cli._security_warnings(exposed)
    assert [w.split(" front door")[0] for w in warnings] == ["the gRPC", "the HTTP"]
    assert cli._security_summary(exposed)["warnings"] == warnings
    assert config("--host", "0.0.0.0", "--http-host", "127.0.0.1", "--http-port", "8000").http_host == "127.0.0.1"
    keyed = config("--host", "0.0.0.0", "--api-key", SECRET, "--api-key", "k2", "--max-inflight-per-key", "3")
    assert keyed.api_keys == (SECRET, "k2") and keyed.max_inflight_per_key == 3
    assert cli._security_warnings(keyed) == [] and SECRET not in str(cli._security_summary(keyed))
    monkeypatch.setenv(A.API_KEY_ENV, SECRET)
    assert config().api_keys == (SECRET,)


# ---------------------------------------------------------------------- admin keys and peers

ADMIN = "sk-admin-unit-5d2e8a41"
LOOPBACK_PEERS = ("ipv4:127.0.0.1:5000", "ipv4:127.9.8.7:1", "ipv6:[::1]:5000", "ipv6:%5B::1%5D:5000",
                  "ipv6:%5B::ffff:127.0.0.1%5D:5000", "unix:/tmp/pdserve.sock", "unix-abstract:pdserve")
REMOTE_PEERS = ("ipv4:10.1.2.3:5555", "ipv6:%5B2001:db8::1%5D:5555", "ipv6:[fe80::1%25eth0]:5555",
                "ipv6:%5B::ffff:10.1.2.3%5D:5555", "ipv4:192.0.2.2:443")
UNREADABLE_PEERS = ("", "127.0.0.1:5000", "ipv4:", "ipv4:localhost:5000", "ipv4:::1:5000",
                    "ipv6:127.0.0.1:5000", "ipv6:[::1", "ipv6:[::1]x5000", "ipv4:127.0.0.1:99999",
                    "ipv4:127.0.0.1:port", "dns:localhost:5000", None)


def test_grpc_peer_strings_of_both_families():
    """gRPC 1.5x+ percent-encodes the brackets of an IPv6 peer: ``ipv6:%5B::1%5D:port``; the
    loopback rule must read that as ::1 (it did not: a keyless router refused Shutdown from
    ::1)."""
    assert A.parse_peer("ipv4:127.0.0.1:5000") == A.Peer("ipv4", "127.0.0.1", 5000)
    assert A.parse_peer("ipv6:[::1]:5000") == A.Peer("ipv6", "::1", 5000)
    assert A.parse_peer("ipv6:%5B::1%5D:5000") == A.Peer("ipv6", "::1", 5000)
    assert A.parse_peer("ipv6:%5Bfe80::1%25eth0%5D:7") == A.Peer("ipv6", "fe80::1%eth0", 7)
    assert A.parse_peer("ipv6:::1") == A.Peer("ipv6", "::1", None)  # bare, without a port
    assert A.parse_peer("ipv4:10.1.2.3") == A.Peer("ipv4", "10.1.2.3", None)
    assert A.parse_peer("unix:/run/p.sock") == A.Peer("unix", "/run/p.sock", None)
    for peer in LOOPBACK_PEERS:
        assert A.peer_is_loopback(peer), peer
    for peer in REMOTE_PEERS:
        assert A.parse_peer(peer) is not None and not A.peer_is_loopback(peer), peer
    for peer in UNREADABLE_PEERS:  # fails closed: not loopback
        assert A.parse_peer(peer) is None and not A.peer_is_loopback(peer), peer
    assert A.is_loopback("::ffff:127.0.0.1")  # the bind check shares the mapped-address rule


def test_admin_keys_are_a_superset_of_api_keys():
    ring = A.KeyRing(["k1", SECRET], admin_keys=[ADMIN])
    assert ring.enabled and ring.admin_enabled and (ring.api_keys, ring.admin_keys, len(ring)) == (2, 1, 3)
    assert ring.authenticate(f"Bearer {ADMIN}") == 2 and ring.is_admin(2)  # an API key for ordinary calls
    assert not ring.is_admin(ring.match(SECRET))
    assert ADMIN not in repr(ring) and "1 admin keys" in repr(ring)
    # Admin keys alone guard the admin calls only: ordinary calls stay open, as on a keyless router.
    admin_only = A.KeyRing((), admin_keys=[ADMIN])
    assert not admin_only.enabled and admin_only.admin_enabled and admin_only.match(ADMIN) == 0
    # A key given as both is an admin key (RouterConfig refuses it; the ring stays safe regardless).
    both = A.KeyRing([ADMIN, "k1"], admin_keys=[ADMIN])
    assert both.api_keys == 1 and both.is_admin(both.match(ADMIN)) and not both.is_admin(both.match("k1"))


def _refusal(ring, key, peer):
    return A.admin_call_refusal(ring, f"Bearer {key}" if key is not None else None, peer, "Shutdown")


def test_only_an_admin_key_may_shut_down_when_admin_keys_are_set():
    for ring in (A.KeyRing([SECRET], admin_keys=[ADMIN]), A.KeyRing((), admin_keys=[ADMIN])):
        for peer in LOOPBACK_PEERS[:4] + REMOTE_PEERS[:2]:  # the key counts, not where it comes from
            assert _refusal(ring, ADMIN, peer) is None
        missing = _refusal(ring, None, "ipv4:127.0.0.1:1")
        assert missing.code == "UNAUTHENTICATED" and missing.http_status == 401
        assert "needs an admin API key: no key was sent" in missing.message
        wrong = _refusal(ring, "sk-nobody", "ipv4:127.0.0.1:1")
        assert wrong.code == "UNAUTHENTICATED" and "not one of this router's keys" in wrong.message
        assert "sk-nobody" not in wrong.message
    ordinary = _refusal(A.KeyRing([SECRET], admin_keys=[ADMIN]), SECRET, "ipv4:127.0.0.1:1")
    assert ordinary.code == "PERMISSION_DENIED" and ordinary.http_status == 403  # even from loopback
    assert "an API key, not an admin key" in ordinary.message and "--admin-api-key" in ordinary.message
    assert SECRET not in ordinary.message and ADMIN not in ordinary.message


def test_without_admin_keys_shutdown_comes_from_loopback_only():
    keyless, keyed = A.KeyRing(), A.KeyRing([SECRET])
    for peer in LOOPBACK_PEERS:
        assert _refusal(keyless, None, peer) is None, peer
        assert _refusal(keyed, SECRET, peer) is None, peer
    for peer in REMOTE_PEERS + UNREADABLE_PEERS[:-1]:
        for ring, key in ((keyless, None), (keyed, SECRET)):  # an ordinary key from afar: refused
            refusal = _refusal(ring, key, peer)
            assert refusal is not None and refusal.code == "PERMISSION_DENIED", (peer, refusal)
            assert "no admin API key (--admin-api-key)" in refusal.message and "loopback" in refusal.message
            assert f"not from {peer}" in refusal.message and SECRET not in refusal.message
    # With API keys set, a loopback caller still needs one (the interceptor lets admin calls through).
    assert _refusal(keyed, None, "ipv4:127.0.0.1:1") == ("UNAUTHENTICATED", A.UNAUTHENTICATED_MESSAGE)
    assert _refusal(keyed, "sk-nobody", "ipv6:%5B::1%5D:1").code == "UNAUTHENTICATED"


def test_admin_keys_from_flags_file_and_environment(tmp_path):
    f = tmp_path / "admin-keys"
    f.write_text("# operators\nadm-b\n\nadm-a\n")
    env = {A.ADMIN_API_KEY_ENV: " env-admin\n", A.API_KEY_ENV: "env-key"}
    assert A.load_admin_api_keys(["adm-a"], str(f), env) == ("adm-a", "adm-b")
    assert A.load_admin_api_keys((), None, env) == ("env-admin",)
    assert A.load_admin_api_keys((), None, {A.API_KEY_ENV: "env-key"}) == ()
    assert A.load_api_keys((), None, {A.ADMIN_API_KEY_ENV: "x"}) == ()  # each kind its own variable
    f.write_text("ok\nsk admin\n")
    with pytest.raises(A.SecurityConfigError) as info:
        A.load_admin_api_keys((), str(f), {})
    assert str(info.value).startswith("--admin-api-key-file line 2:") and "sk admin" not in str(info.value)
    with pytest.raises(A.SecurityConfigError, match="^--admin-api-key: a key must be visible ASCII"):
        A.load_admin_api_keys(["two words"], None, {})
    with pytest.raises(A.SecurityConfigError, match="^--admin-api-key-file: cannot read"):
        A.load_admin_api_keys((), str(tmp_path / "missing"), {})


def test_router_config_admin_keys():
    cfg = RouterConfig(api_keys=[SECRET], admin_api_keys=[ADMIN])
    assert cfg.admin_api_keys == (ADMIN,) and ADMIN not in repr(cfg)
    assert RouterConfig(admin_api_keys=[ADMIN]).api_keys == ()  # admin keys alone are fine
    with pytest.raises(ValueError, match="^admin_api_keys: 1 key") as info:
        RouterConfig(api_keys=[SECRET, "k2"], admin_api_keys=[SECRET])
    assert SECRET not in str(info.value)
    with pytest.raises(ValueError, match="^admin_api_keys:") as info:
        RouterConfig(admin_api_keys=["has space"])
    assert "has space" not in str(info.value)


def test_client_sends_the_admin_key_on_admin_calls_only(monkeypatch):
    monkeypatch.delenv(A.API_KEY_ENV, raising=False)
    monkeypatch.delenv(A.ADMIN_API_KEY_ENV, raising=False)
    plain = Connection.from_target("r:1", api_key=SECRET)
    assert plain.admin_api_key is None and plain.admin_metadata == plain.metadata  # the API key, then
    admin = Connection.from_target("r:1", api_key=SECRET, admin_api_key=ADMIN)
    assert admin.metadata == (("authorization", f"Bearer {SECRET}"),)
    assert admin.admin_metadata == (("authorization", f"Bearer {ADMIN}"),) and ADMIN not in repr(admin)
    monkeypatch.setenv(A.ADMIN_API_KEY_ENV, ADMIN)
    assert Connection.from_target("r:1").admin_metadata == (("authorization", f"Bearer {ADMIN}"),)
    with pytest.raises(A.SecurityConfigError, match="^--admin-api-key:"):
        Connection.from_target("r:1", admin_api_key="two words")


def test_launch_admin_flags(tmp_path, monkeypatch):
    import argparse

    from pdserve.cli import main as cli

    def config(*argv):
        parser = argparse.ArgumentParser()
        cli.add_launch_arguments(parser)
        return cli.launch_config_from_args(parser.parse_args(list(argv))).router

    monkeypatch.delenv(A.API_KEY_ENV, raising=False)
    monkeypatch.delenv(A.ADMIN_API_KEY_ENV, raising=False)
    assert config().admin_api_keys == ()
    f = tmp_path / "admin"
    f.write_text("adm-file\n")
    cfg = config("--api-key", SECRET, "--admin-api-key", ADMIN, "--admin-api-key-file", str(f))
    assert cfg.api_keys == (SECRET,) and cfg.admin_api_keys == (ADMIN, "adm-file")
    summary = cli._security_summary(cfg)
    assert (summary["api_keys"], summary["admin_api_keys"]) == (1, 2) and ADMIN not in str(summary)
    # Admin keys alone leave ordinary calls open: an exposed bind still warns.
    assert len(cli._security_warnings(config("--host", "0.0.0.0", "--admin-api-key", ADMIN))) == 1
    monkeypatch.setenv(A.ADMIN_API_KEY_ENV, ADMIN)
    assert config().admin_api_keys == (ADMIN,)

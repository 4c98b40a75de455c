"""Front-door security, the decisions only: API keys and admin API keys (loading, matching in
constant time, per-key requests in flight), who may make an admin call (``admin_call_refusal``,
with the gRPC peer strings it reads: ``parse_peer``), the TLS files, and the warning for an
unprotected non-loopback bind. No gRPC and no aiohttp here: ``cluster/front/grpc/security.py``
(a gRPC server interceptor and the server credentials), ``cluster/front/grpc/servicer.py`` (the
admin calls) and ``cluster/front/openai/server.py`` (a middleware) adapt it.

Invariants:
- A key is never logged, echoed or shown: a ``KeyRing`` keeps only SHA-256 digests of its
  keys, errors about a key name its field and never its text, and logs and status carry
  ``fingerprint(key)`` at most.
- Matching hashes what the client sent and compares the digest with every configured key's
  digest (``hmac.compare_digest``), all of them, every time: its time depends neither on how
  much of a key matched nor on which key matched, nor on the length of a wrong key.
- Admin keys are a superset of API keys: an admin key is accepted wherever an API key is, and
  only an admin key may make an admin call (``Shutdown``). Without admin keys, an admin call is
  taken only from a loopback peer (and, when API keys are set, with one of them); a peer this
  module cannot read as loopback is refused (it fails closed).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

API_KEY_ENV = "PDSERVE_API_KEY"
ADMIN_API_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
BEARER = "bearer"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class SecurityConfigError(ValueError):
    """A bad security setting; the message starts with the field (flag) it is about."""


# ---------------------------------------------------------------------- keys

def check_key(key: str, field: str) -> str:
    """``key`` when it can travel in an HTTP header and in gRPC metadata: visible ASCII
    (0x21-0x7e), no spaces, not empty. The error never quotes the key."""
    if not isinstance(key, str):
        raise SecurityConfigError(f"{field}: a key must be a string, got {type(key).__name__}")
    if not key:
        raise SecurityConfigError(f"{field}: a key must not be empty")
    if any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise SecurityConfigError(f"{field}: a key must be visible ASCII without spaces "
                                  f"(a {len(key)}-character key is not)")
    return key


def parse_key_lines(text: str, field: str) -> list[str]:
    """One key per line; surrounding whitespace, blank lines and ``#`` comment lines skipped."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"{field} line {number}"))
    return keys


def read_key_file(path: str, field: str = "--api-key-file") -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityConfigError(f"{field}: cannot read {path}: {exc}") from None
    keys = parse_key_lines(text, field)
    if not keys:
        raise SecurityConfigError(f"{field}: {path} holds no key (one key per line)")
    return keys


def _load_keys(keys: Sequence[str], key_file: str | None, environ: Mapping[str, str],
               flag: str, env: str) -> tuple[str, ...]:
    found = [check_key(k, flag) for k in keys]
    if key_file:
        found += read_key_file(key_file, f"{flag}-file")
    if not found and environ.get(env):
        found = [check_key(environ[env].strip(), env)]
    return tuple(dict.fromkeys(found))


def load_api_keys(keys: Sequence[str] = (), key_file: str | None = None,
                  environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The keys the router accepts: every ``--api-key`` and every line of ``--api-key-file``;
    when neither is given, ``PDSERVE_API_KEY`` (one key) if set. Duplicates once, order kept."""
    return _load_keys(keys, key_file, environ, "--api-key", API_KEY_ENV)


def load_admin_api_keys(keys: Sequence[str] = (), key_file: str | None = None,
                        environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The router's admin keys, by the same rules as ``load_api_keys``: every
    ``--admin-api-key`` and every line of ``--admin-api-key-file``; when neither is given,
    ``PDSERVE_ADMIN_API_KEY`` (one key) if set."""
    return _load_keys(keys, key_file, environ, "--admin-api-key", ADMIN_API_KEY_ENV)


def client_api_key(key: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key a client sends: the one given, else ``PDSERVE_API_KEY``, else none."""
    if key is None:
        key = environ.get(API_KEY_ENV, "").strip() or None
    return check_key(key, "--api-key") if key is not None else None


def client_admin_api_key(key: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The admin key a client sends on admin calls: the one given, else
    ``PDSERVE_ADMIN_API_KEY``, else none (the client then sends its API key, if any)."""
    if key is None:
        key = environ.get(ADMIN_API_KEY_ENV, "").strip() or None
    return check_key(key, "--admin-api-key") if key is not None else None


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` value (the scheme is
    case-insensitive, RFC 7235); None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == BEARER and token else None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def fingerprint(key: str) -> str:
    """What logs and status may show of a key: 12 hex digits of its SHA-256."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    """The accepted keys (as digests), which of them are admin keys, and each key's requests in
    flight.

    The API keys come first, then the admin keys; a key given as both counts as an admin key
    (``RouterConfig`` refuses that, so that nobody believes a key ordinary that is not).
    ``match`` returns the index of the key presented (API or admin), or None; ``is_admin``
    says which kind it is. ``enabled`` says whether ordinary calls need a key: API keys make
    them need one (an admin key among them), while admin keys alone guard the admin calls only,
    and leave the ordinary ones as open as a keyless router's. ``try_acquire`` / ``release``
    count a key's requests in flight against ``max_inflight_per_key`` (None: no cap). It is
    used from one event loop (the router's), so the counts need no lock."""

    def __init__(self, keys: Iterable[str] = (), max_inflight_per_key: int | None = None,
                 admin_keys: Iterable[str] = ()) -> None:
        admin = list(dict.fromkeys(admin_keys))
        admin_digests = {_digest(k) for k in admin}
        ordinary = [k for k in dict.fromkeys(keys) if _digest(k) not in admin_digests]
        if max_inflight_per_key is not None and max_inflight_per_key < 1:
            raise SecurityConfigError(f"max_inflight_per_key: must be >= 1, got {max_inflight_per_key!r}")
        every = ordinary + admin
        self._digests = [_digest(k) for k in every]
        self._admin = [False] * len(ordinary) + [True] * len(admin)
        self.api_keys = len(ordinary)
        self.admin_keys = len(admin)
        self.fingerprints = [fingerprint(k) for k in every]
        self.max_inflight_per_key = max_inflight_per_key
        self.in_flight = [0] * len(every)

    @property
    def enabled(self) -> bool:
        """Ordinary calls need a key (API keys are set)."""
        return self.api_keys > 0

    @property
    def admin_enabled(self) -> bool:
        """Admin calls need an admin key (admin keys are set)."""
        return self.admin_keys > 0

    def is_admin(self, index: int) -> bool:
        return self._admin[index]

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return (f"KeyRing({self.api_keys} API keys {self.fingerprints[:self.api_keys]}, "
                f"{self.admin_keys} admin keys {self.fingerprints[self.api_keys:]}, "
                f"max_inflight_per_key={self.max_inflight_per_key})")

    def match(self, presented: str | None) -> int | None:
        if presented is None:
            return None
        digest = _digest(presented)
        found = None
        for index, known in enumerate(self._digests):  # no early exit: the same work for any key
            if hmac.compare_digest(digest, known) and found is None:
                found = index
        return found

    def authenticate(self, authorization: str | None) -> int | None:
        """The index of the key in an ``Authorization`` header / metadata value, or None."""
        return self.match(bearer_token(authorization))

    def try_acquire(self, index: int) -> bool:
        cap = self.max_inflight_per_key
        if cap is not None and self.in_flight[index] >= cap:
            return False
        self.in_flight[index] += 1
        return True

    def release(self, index: int) -> None:
        if self.in_flight[index] <= 0:
            raise RuntimeError(f"key {self.fingerprints[index]}: release without acquire")
        self.in_flight[index] -= 1

    def limit_message(self) -> str:
        return (f"this API key already has {self.max_inflight_per_key} requests in flight "
                f"(the router's max_inflight_per_key); retry when one finishes")


UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send it as 'authorization: Bearer <key>'"


# ---------------------------------------------------------------------- admin calls

class Peer(NamedTuple):
    """A gRPC peer, parsed: family "ipv4", "ipv6" or "unix" (``unix-abstract`` too), the
    address (an IP address without brackets, or the socket's path) and the port (None for a
    socket path)."""

    family: str
    host: str
    port: int | None


def parse_peer(peer: str) -> Peer | None:
    """``context.peer()`` of a gRPC call: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000`` (gRPC
    1.5x+ writes the address as a URI, so the brackets come percent-encoded:
    ``ipv6:%5B::1%5D:5000``, and a zone as ``%25``) or ``unix:/path``. None for anything else,
    and for an ipv4/ipv6 peer whose address is not an IP literal (a peer is never a name)."""
    if not isinstance(peer, str):
        return None
    family, sep, rest = peer.partition(":")
    if not sep:
        return None
    rest = urllib.parse.unquote(rest)
    if family in ("unix", "unix-abstract"):
        return Peer("unix", rest, None)
    if family == "ipv4":
        host, _, port_text = rest.rpartition(":")
        if not host:  # no port
            host, port_text = rest, ""
    elif family == "ipv6":
        if rest.startswith("["):
            host, bracket, tail = rest[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                return None
            port_text = tail[1:]
        else:  # no brackets: only a bare address (a port would be ambiguous)
            host, port_text = rest, ""
    else:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if (address.version == 4) != (family == "ipv4"):
        return None
    if port_text and not (port_text.isdigit() and int(port_text) <= 65535):
        return None
    return Peer(family, host, int(port_text) if port_text else None)


def _ip_is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.0/8 and ::1, and an IPv4 loopback mapped into IPv6 (``::ffff:127.0.0.1``, what
    a dual-stack socket shows an IPv4 client as), which Python before 3.13 does not count."""
    if address.is_loopback:
        return True
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped is not None and mapped.is_loopback


def peer_is_loopback(peer: str) -> bool:
    """Whether a gRPC peer is on this machine: a loopback IP address, or a Unix socket (only
    processes here can reach one). Anything unreadable is not (it fails closed)."""
    parsed = parse_peer(peer)
    if parsed is None:
        return False
    if parsed.family == "unix":
        return True
    return _ip_is_loopback(ipaddress.ip_address(parsed.host))


class Refusal(NamedTuple):
    """Why an admin call is refused: ``code`` is a gRPC status code's name (UNAUTHENTICATED: no
    key or no known key was sent; PERMISSION_DENIED: the caller is known, or is where it is, and
    may not make the call); ``message`` names what is missing, never a key."""

    code: str
    message: str

    @property
    def http_status(self) -> int:
        return 401 if self.code == "UNAUTHENTICATED" else 403


def admin_call_refusal(ring: KeyRing, authorization: str | None, peer: str,
                       call: str = "Shutdown") -> Refusal | None:
    """None when ``call`` (an admin call) may go ahead for a caller that sent ``authorization``
    (the header or metadata value) from ``peer`` (a gRPC peer string); else why not.

    With admin keys set, an admin key is what counts, from anywhere: no key or an unknown one is
    UNAUTHENTICATED, an ordinary API key PERMISSION_DENIED. Without admin keys, the call is taken
    only from a loopback peer, with an API key when API keys are set. The ring's match runs in
    every case, so the time taken says nothing about which rule applied to a key."""
    index = ring.authenticate(authorization)
    sent = bearer_token(authorization) is not None
    how = "send one as 'authorization: Bearer <admin key>' (pdserve shutdown --admin-api-key)"
    if ring.admin_enabled:
        if index is None:
            what = "the key sent is not one of this router's keys" if sent else "no key was sent"
            return Refusal("UNAUTHENTICATED", f"{call} is an admin call and needs an admin API key: "
                                              f"{what}; {how}")
        if not ring.is_admin(index):
            return Refusal("PERMISSION_DENIED", f"{call} is an admin call and needs an admin API key: "
                                                f"the key sent is an API key, not an admin key "
                                                f"(the router's --admin-api-key); {how}")
        return None
    if ring.enabled and index is None:
        return Refusal("UNAUTHENTICATED", UNAUTHENTICATED_MESSAGE)
    if not peer_is_loopback(peer):
        return Refusal("PERMISSION_DENIED", f"{call} is an admin call, and this router has no admin "
                                            f"API key (--admin-api-key), so it takes {call} only "
                                            f"from its own machine (a loopback peer), not from {peer}")
    return None


# ---------------------------------------------------------------------- TLS

class TlsPem(NamedTuple):
    cert: bytes
    key: bytes
    client_ca: bytes | None


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The server's certificate chain and key (PEM files), and the CA whose certificates
    clients must present (mutual TLS) when ``client_ca`` is set. Paths on the router's node."""

    cert: str
    key: str
    client_ca: str | None = None

    @classmethod
    def from_options(cls, cert: str | None, key: str | None, client_ca: str | None,
                     names: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")
                     ) -> "TlsFiles | None":
        """None when TLS is off; a clear error for a half-given pair."""
        if cert and not key:
            raise SecurityConfigError(f"{names[0]}: given without {names[1]} (TLS needs both)")
        if key and not cert:
            raise SecurityConfigError(f"{names[1]}: given without {names[0]} (TLS needs both)")
        if client_ca and not cert:
            raise SecurityConfigError(f"{names[2]}: mutual TLS needs {names[0]} and {names[1]} too")
        return cls(cert, key, client_ca or None) if cert else None

    def read(self, names: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")) -> TlsPem:
        """The three files' bytes, each checked to be PEM; errors name the flag."""
        return TlsPem(_read_pem(self.cert, names[0]), _read_pem(self.key, names[1]),
                      _read_pem(self.client_ca, names[2]) if self.client_ca else None)

    def server_ssl_context(self) -> ssl.SSLContext:
        """For aiohttp: TLS 1.2 or newer, client certificates required under mutual TLS. Loading
        here also proves that the certificate and the key belong together."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"--tls-cert/--tls-key: {self.cert} and {self.key} do not load "
                                      f"as a certificate chain and its private key: {exc}") from None
        if self.client_ca:
            try:
                ctx.load_verify_locations(cafile=self.client_ca)
            except (OSError, ssl.SSLError) as exc:
                raise SecurityConfigError(f"--tls-client-ca: {self.client_ca}: {exc}") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def check(self) -> None:
        """Everything a server start would find wrong with the files, found now."""
        self.read()
        self.server_ssl_context()


def _read_pem(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SecurityConfigError(f"{field}: cannot read {path}: {exc}") from None
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{field}: {path} is not a PEM file")
    return data


# ---------------------------------------------------------------------- binding

def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach: 127.0.0.0/8, ::1 and localhost.
    Any other name (it may resolve anywhere), "" and 0.0.0.0 / :: (every interface) are not."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return _ip_is_loopback(ipaddress.ip_address(host))
    except ValueError:
        return False


def exposure_warnings(doors: Sequence[tuple[str, str]], *, api_keys: bool, tls: bool) -> list[str]:
    """One warning per front door (name, bind host) that listens beyond this machine with
    neither API keys nor TLS: anyone who can reach it may use the cluster."""
    if api_keys or tls:
        return []
    return [f"the {name} front door binds {host or '*'} (not loopback) with no API key and no TLS: "
            f"anyone who can reach it can use the cluster; pass --api-key and --tls-cert/--tls-key, "
            f"or bind 127.0.0.1" for name, host in doors if not is_loopback(host)]


@dataclass(frozen=True, slots=True)
class DoorSecurity:
    """How the router's front doors are protected, as status shows it: counts and flags, never a
    key. The addresses are the bound ones ("" for a door that is off)."""

    api_keys: int = 0
    admin_api_keys: int = 0
    tls: bool = False
    mutual_tls: bool = False
    max_inflight_per_key: int | None = None
    warnings: tuple[str, ...] = ()
    grpc_address: str = ""
    http_address: str = ""


def split_target(address: str) -> tuple[str, bool | None]:
    """(host:port, TLS) from a client target: ``https://`` / ``grpcs://`` mean TLS,
    ``http://`` / ``grpc://`` mean plaintext, a bare ``host:port`` leaves it to the caller (None)."""
    for prefix, tls in (("https://", True), ("grpcs://", True), ("http://", False), ("grpc://", False)):
        if address.lower().startswith(prefix):
            return address[len(prefix):].rstrip("/"), tls
    return address, None

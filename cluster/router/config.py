"""The router's configuration: the core's settings and the front doors' (ports, keys, TLS), one
record so that `pdserve launch`, YAML and the router actor pass one thing around."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.cluster.auth import TlsFiles, check_key
from pdserve.cluster.policies import routing_mode


KV_TRANSFER_MODES = ("after_prefill", "layerwise")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # How workers are picked: round-robin | least-loaded | kv-aware (policies.ROUTING_MODES).
    routing: str = "round-robin"
    kv_overlap_weight: float = 4.0  # kv-aware: policies.KvAwareWeights
    kv_decode_weight: float = 0.25
    max_local_prefill_length: int | None = None  # conditional disaggregation off by default
    max_queue: int = 1024
    max_inflight: int | None = None  # default: the generation workers' batch sizes summed
    max_retries: int = 2
    # How long a request may wait in all for a worker to come back when none can take it (a
    # restart of the only generation worker, say); 0: fail such requests at once (UNAVAILABLE).
    worker_wait_s: float = 30.0
    # A worker heard from neither by updates nor by heartbeats this long has failed its attempts.
    worker_call_timeout_s: float = 30.0
    status_timeout_s: float = 5.0  # one worker's status call (a restarting worker is slow)
    default_deadline_s: float = 600.0
    status_refresh_s: float = 0.5
    # At start, how long to wait for every worker to report ready (generation workers: their
    # KV pairs set up) before serving anyway, with the ready ones.
    ready_timeout_s: float = 60.0
    max_message_bytes: int = 4 << 20
    agent_percentage: float | None = None  # agent tree off unless agent types are given
    agent_types: tuple[str, ...] = ()
    agent_inflight_seq_num: int | None = None
    # OpenAI-compatible HTTP on the same router (cluster/front/openai/server.py); None: off.
    http_port: int | None = None
    http_host: str = "127.0.0.1"
    served_model_name: str | None = None  # default: the model directory's name
    # How tool calls are read from the output for tool_choice "auto" (the OpenAI door's
    # TOOL_PARSERS: "hermes"); None: "auto" is refused, forced calls work without one.
    tool_call_parser: str | None = None
    # vLLM's --return-tokens-as-token-ids: the OpenAI door's logprobs name tokens
    # "token_id:{id}" unless a request's own return_tokens_as_token_ids says otherwise.
    return_tokens_as_token_ids: bool = False
    # How a remote prefill's KV moves (KV_TRANSFER_MODES): "after_prefill", once the prefill is
    # over; "layerwise", each layer as the context worker's forward writes it, with the
    # generation worker asked as soon as the last prefill chunk is scheduled.
    kv_transfer_mode: str = "after_prefill"

    # Front-door security (cluster/auth.py). Keys: both doors need one of these as a bearer
    # token (health stays open); empty: no key needed. repr=False: a config printed or logged
    # never shows them.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Admin keys: only these may make the admin calls (gRPC Shutdown); they are accepted as API
    # keys too. Empty: admin calls are taken only from a loopback peer.
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_inflight_per_key: int | None = None  # requests in flight per key, both doors; None: no cap
    # TLS on both doors (PEM paths on the router's node); tls_client_ca: mutual TLS, a client
    # certificate signed by this CA is required.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_mode not in KV_TRANSFER_MODES:
            raise ValueError(f"kv_transfer_mode: must be one of {', '.join(KV_TRANSFER_MODES)}, "
                             f"got {self.kv_transfer_mode!r}")
        object.__setattr__(self, "api_keys", tuple(check_key(k, "api_keys") for k in self.api_keys))
        object.__setattr__(self, "admin_api_keys",
                           tuple(check_key(k, "admin_api_keys") for k in self.admin_api_keys))
        both = len(set(self.api_keys) & set(self.admin_api_keys))
        if both:  # which kind would it be? Refused rather than guessed; the key is not named
            raise ValueError(f"admin_api_keys: {both} key(s) also given as API keys; an admin key "
                             f"is accepted as an API key already, so give each key once")
        if self.max_inflight_per_key is not None and self.max_inflight_per_key < 1:
            raise ValueError(f"max_inflight_per_key: must be >= 1, got {self.max_inflight_per_key!r}")
        if self.max_inflight_per_key is not None and not self.api_keys:
            raise ValueError("max_inflight_per_key: needs API keys (--api-key) to count requests by")
        self.tls_files()  # a half-given TLS pair is an error now, not at bind time
        try:
            object.__setattr__(self, "routing", routing_mode(self.routing))
        except ValueError as exc:
            raise ValueError(f"routing: {exc}") from None
        if self.agent_inflight_seq_num is not None and self.agent_inflight_seq_num < 1:
            # The router's queue holds no generating request: a budget of 0 would trim every
            # candidate and no request would ever be dispatched.
            raise ValueError(f"agent_inflight_seq_num: must be >= 1 (max_inflight caps the "
                             f"requests in flight), got {self.agent_inflight_seq_num!r}")
        for name in ("kv_overlap_weight", "kv_decode_weight", "worker_wait_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

    def tls_files(self) -> TlsFiles | None:
        return TlsFiles.from_options(self.tls_cert, self.tls_key, self.tls_client_ca)

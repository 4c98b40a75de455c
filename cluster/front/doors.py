"""``FrontDoors``: opens and closes the router's front doors (gRPC always, OpenAI HTTP when
``http_port`` is set) over one router core, with what they share: one ``KeyRing`` of API and
admin keys (so a key's cap on requests in flight counts across both doors) and one TLS
configuration. The router actor (``cluster/router_actor.py``) is the one caller."""
from __future__ import annotations

import logging
from pathlib import Path

from pdserve.cluster.auth import DoorSecurity, KeyRing, exposure_warnings
from pdserve.cluster.router import RouterConfig
from pdserve.cluster.router.api import FrontDoorApi

from .grpc.servicer import GrpcDoor, ShutdownHook

log = logging.getLogger("pdserve.router")

STOP_GRACE_S = 2.0


class FrontDoors:
    def __init__(self, api: FrontDoorApi, config: RouterConfig, model_dir: str | None = None,
                 shutdown: ShutdownHook | None = None) -> None:
        """``model_dir``: the served model (the HTTP door's model id and chat template);
        ``shutdown``: what the gRPC Shutdown call sets off (None: the call is refused)."""
        self.api = api
        self.config = config
        self.model_dir = model_dir
        self.keys = KeyRing(config.api_keys, config.max_inflight_per_key, admin_keys=config.admin_api_keys)
        doors = [("gRPC", config.host)] + ([("HTTP", config.http_host)] if config.http_port is not None else [])
        self.warnings = exposure_warnings(doors, api_keys=self.keys.enabled,
                                          tls=config.tls_cert is not None)
        self.grpc = GrpcDoor(api, config, self.keys, self.security, shutdown)
        self.http = None  # OpenAIServer, when config.http_port is set
        self.grpc_port: int | None = None
        self.http_port: int | None = None

    async def start(self) -> tuple[int, int | None]:
        """Bind and serve both doors; returns (gRPC port, HTTP port or None)."""
        cfg = self.config
        self.grpc_port = await self.grpc.start()
        log.info("router serving on %s:%d (%s)", cfg.host, self.grpc_port, self._summary())
        for warning in self.warnings:
            log.warning("UNPROTECTED: %s", warning)
        if cfg.http_port is not None:
            from .openai.chat_template import ChatTemplate
            from .openai.server import OpenAIServer

            model_id = cfg.served_model_name or (Path(self.model_dir).name if self.model_dir else "pdserve")
            template = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir else None
            self.http = OpenAIServer(self.api, cfg, self.keys, model_id, template)
            self.http_port = await self.http.start(cfg.http_host, cfg.http_port)
        return self.grpc_port, self.http_port

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop(grace_s)

    def security(self) -> DoorSecurity:
        cfg = self.config
        return DoorSecurity(
            api_keys=self.keys.api_keys, admin_api_keys=self.keys.admin_keys,
            tls=cfg.tls_cert is not None, mutual_tls=cfg.tls_client_ca is not None,
            max_inflight_per_key=cfg.max_inflight_per_key, warnings=tuple(self.warnings),
            grpc_address=f"{cfg.host}:{self.grpc_port}" if self.grpc_port is not None else "",
            http_address=f"{cfg.http_host}:{self.http_port}" if self.http_port is not None else "")

    def _summary(self) -> str:
        cfg = self.config
        ring = self.keys
        keys = (f"{ring.api_keys} API keys {', '.join(ring.fingerprints[:ring.api_keys])}" if ring.enabled
                else "no API key")
        keys += (f", {ring.admin_keys} admin keys {', '.join(ring.fingerprints[ring.api_keys:])}"
                 if ring.admin_enabled else ", no admin key (Shutdown from loopback only)")
        tls = ("mutual TLS" if cfg.tls_client_ca else "TLS") if cfg.tls_cert else "no TLS"
        return f"{keys}, {tls}"

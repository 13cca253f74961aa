"""What one server's security flags turn into at startup: the certificates (reloading), the token file
(reloading), the authenticator its interceptor and HTTP front ask, the exposure rule, and the posture line.
Files are read here, so a missing or bad one stops the server before it listens, naming its flag."""
from __future__ import annotations

import logging
from typing import Sequence

import grpc

from tandem.security.auth import Authenticator
from tandem.security.config import ServerSecurity
from tandem.security.posture import check_exposure, posture_line
from tandem.security.tls import ReloadingTls, grpc_server_credentials, server_paths
from tandem.security.tokens import TokenFile

log = logging.getLogger("tandem.security")


class ServerGuard:
    def __init__(self, cfg: ServerSecurity) -> None:
        cfg.validate()
        self.cfg = cfg
        self.tls = ReloadingTls(server_paths(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)) if cfg.tls else None
        self.tokens = TokenFile(cfg.auth_token_file) if cfg.auth_token_file is not None else None
        self.authenticator = Authenticator(self.tokens)

    def check_exposure(self, host: str, ports: Sequence[str]) -> None:
        """ports: what will listen on host over TCP ("gRPC", "HTTP", "metrics"). Raises InsecureBinding (the
        server exits 2 naming --insecure); logs a warning when --insecure lets plaintext through."""
        warning = check_exposure(host, ports, self.tls is not None, self.tokens is not None, self.cfg.insecure)
        if warning is not None:
            log.warning("%s", warning)

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        """For the TCP port: TLS that follows the files, or None (plaintext)."""
        return grpc_server_credentials(self.tls) if self.tls is not None else None

    def reload_now(self) -> None:
        """SIGHUP: certificates and tokens are read again at the next handshake / call."""
        if self.tls is not None:
            self.tls.reload_now()
        if self.tokens is not None:
            self.tokens.reload_now()

    def posture(self, extra: list[str] | None = None) -> str:
        return posture_line(self.tls is not None, self.cfg.tls_client_ca is not None,
                            self.tokens.summary() if self.tokens is not None else None, self.cfg.reflection,
                            not self.cfg.auth_health or self.tokens is None, extra)

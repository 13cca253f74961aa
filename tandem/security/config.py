"""The security flags both servers take (the same names, help and checks in tandem-executor and
tandem-scheduler), as one frozen dataclass."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServerSecurity:
    tls_cert: Path | None = None  # PEM certificate chain served to clients (TLS on when set, with tls_key)
    tls_key: Path | None = None  # its PEM private key
    tls_client_ca: Path | None = None  # mTLS: client certificates are required and must chain to this CA
    auth_token_file: Path | None = None  # bearer tokens with scopes (tandem/security/tokens.py); None = off
    auth_health: bool = False  # grpc.health.v1 and HTTP /health need a token too (default: open for probes)
    reflection: bool = True  # gRPC server reflection (grpcurl without .proto files)
    insecure: bool = False  # allow a non-loopback address without TLS (warned about at startup)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def validate(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key: client certificates are "
                             "checked during a TLS handshake")
        if self.auth_health and self.auth_token_file is None:
            raise ValueError("--auth-health needs --auth-token-file: without tokens nothing is checked")


def add_server_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("security (docs/security.md)")
    g.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve TLS with this PEM certificate chain (with --tls-key); "
                                                 "re-read on change or SIGHUP without dropping open streams")
    g.add_argument("--tls-key", type=Path, metavar="PEM", help="the PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", type=Path, metavar="PEM",
                   help="mTLS: require a client certificate signed by this PEM CA (refused in the handshake "
                        "otherwise)")
    g.add_argument("--auth-token-file", type=Path, metavar="FILE",
                   help="require `authorization: Bearer <token>` (HTTP: the OpenAI api_key) from this file: one "
                        "token per line, optionally followed by its scope `user` (default) or `admin`; # comments; "
                        "re-read on change. Missing or unknown token: UNAUTHENTICATED / 401; too low a scope: "
                        "PERMISSION_DENIED / 403")
    g.add_argument("--auth-health", action="store_true",
                   help="require a token for grpc.health.v1 (and HTTP /health) too; default: open, for probes")
    g.add_argument("--no-reflection", action="store_true", help="turn gRPC server reflection off")
    g.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without TLS, on every port it opens there (gRPC, HTTP, "
                        "metrics): refused otherwise, since anyone who reaches the port could use the server, or "
                        "with --auth-token-file read the tokens in clear; a warning is logged at startup")


def server_security(args: argparse.Namespace) -> ServerSecurity:
    return ServerSecurity(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                          auth_token_file=args.auth_token_file, auth_health=args.auth_health,
                          reflection=not args.no_reflection, insecure=args.insecure)

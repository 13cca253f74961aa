"""Certificates and token files made at test time for the security tests: a CA with a server certificate
(localhost, 127.0.0.1) and a client certificate, and a second CA with its own pair (a "wrongly signed" client,
a server the first CA does not vouch for). Made by scripts/make_test_certs.py, the README's own script."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

from tests.conftest import load_script

SERVER_NAMES = ["localhost", "127.0.0.1"]


@dataclass(frozen=True)
class Pki:
    dir: Path  # ca.pem, server.pem/.key, client.pem/.key (make_test_certs.make_all's layout), other/ the same

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def server(self) -> tuple[Path, Path]:
        return self.dir / "server.pem", self.dir / "server.key"

    def client(self) -> tuple[Path, Path]:
        return self.dir / "client.pem", self.dir / "client.key"

    @property
    def other(self) -> "Pki":
        """A second, unrelated CA and its server and client certificates."""
        return Pki(self.dir / "other")

    def server_flags(self, mtls: bool = True) -> list[str]:
        cert, key = self.server()
        return ["--tls-cert", str(cert), "--tls-key", str(key), *(["--tls-client-ca", str(self.ca)] if mtls else [])]

    def credentials(self, trust: "Pki | None" = None, client: "Pki | None" = None) -> grpc.ChannelCredentials:
        """Channel credentials trusting `trust`'s CA (default: this one), presenting `client`'s client
        certificate (None: none)."""
        trust = trust or self
        key = chain = None
        if client is not None:
            cert, key_path = client.client()
            chain, key = cert.read_bytes(), key_path.read_bytes()
        return grpc.ssl_channel_credentials(trust.ca.read_bytes(), key, chain)


def make_pki(directory: Path) -> Pki:
    maker = load_script("make_test_certs")
    maker.make_all(directory, SERVER_NAMES)
    maker.make_all(directory / "other", SERVER_NAMES, client_name="stranger")
    return Pki(directory)


def new_token() -> str:
    return secrets.token_hex(16)


def write_tokens(path: Path, tokens: dict[str, str]) -> Path:
    """A token file: a comment, a blank line, then `TOKEN SCOPE` lines (a user token without its scope)."""
    lines = ["# made by the tests", ""]
    lines += [f"{t} {scope}" if scope != "user" else t for t, scope in tokens.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)

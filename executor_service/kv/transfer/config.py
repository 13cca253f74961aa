"""What the executor is started with for moving KV between executors (docs/kv-transfer.md): its role in
disaggregated serving and how it reaches another executor for ImportKv (the same TLS/token settings a scheduler
uses for its executors). Flags, their help and their checks live here; the tiers under the prefix cache have
theirs in executor_service/kv/tiers/config.py."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KvTransferConfig:
    role: str = "both"  # GetInfoResponse.role: advisory, for a scheduler that splits prefill and decode
    # ImportKv's link to the source executor: TLS (CA, optional mTLS cert/key) and a bearer token file
    peer_tls_ca: Path | None = None
    peer_tls_cert: Path | None = None
    peer_tls_key: Path | None = None
    peer_tls: bool = False  # TLS with the system's roots (no --peer-tls-ca)
    peer_token_file: Path | None = None
    insecure: bool = False  # --insecure: a non-loopback source without TLS is allowed

    @property
    def peer_uses_tls(self) -> bool:
        return self.peer_tls or self.peer_tls_ca is not None or self.peer_tls_cert is not None

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError("--peer-tls-cert and --peer-tls-key go together: give both or neither")


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("KV transfer (docs/kv-transfer.md)")
    g.add_argument("--role", choices=ROLES, default="both",
                   help="this executor's part in disaggregated serving, reported by GetInfo for the scheduler: "
                        "prefill (runs prompts, its caches exported), decode (imports caches, decodes), both "
                        "(default). Every RPC works whatever the role")
    g.add_argument("--peer-tls-ca", type=Path, metavar="PEM",
                   help="ImportKv: verify the source executor's certificate with this PEM CA (TLS on)")
    g.add_argument("--peer-tls", action="store_true",
                   help="ImportKv: TLS to the source executor with the system's root certificates")
    g.add_argument("--peer-tls-cert", type=Path, metavar="PEM",
                   help="ImportKv: mTLS client certificate presented to the source (with --peer-tls-key)")
    g.add_argument("--peer-tls-key", type=Path, metavar="PEM", help="the PEM private key of --peer-tls-cert")
    g.add_argument("--peer-token-file", type=Path, metavar="FILE",
                   help="ImportKv: send the first token of this file as `authorization: Bearer` to the source")


def from_args(args: argparse.Namespace) -> KvTransferConfig:
    cfg = KvTransferConfig(role=args.role, peer_tls_ca=args.peer_tls_ca, peer_tls_cert=args.peer_tls_cert,
                           peer_tls_key=args.peer_tls_key, peer_tls=args.peer_tls,
                           peer_token_file=args.peer_token_file, insecure=args.insecure)
    cfg.validate()
    return cfg

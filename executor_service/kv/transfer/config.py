"""What the executor is started with for moving KV (docs/kv-transfer.md): its role in disaggregated serving,
the host-memory and disk tiers under the prefix cache, and how it reaches another executor for ImportKv (the
same TLS/token settings a scheduler uses for its executors). Flags, their help and their checks live here."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KvTransferConfig:
    role: str = "both"  # GetInfoResponse.role: advisory, for a scheduler that splits prefill and decode
    disk_dir: Path | None = None  # disk tier directory (None: no disk tier)
    disk_gb: float = 0.0  # its size bound (GiB); the least recently used blocks go when full
    host_gb: float = 0.0  # host-memory tier size (GiB); 0 = none
    disk_flush_s: float = 10.0  # on a clean stop: time to write the pool's cached blocks to the disk tier; 0 = none
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
        if self.disk_gb < 0 or self.host_gb < 0 or self.disk_flush_s < 0:
            raise ValueError("--kv-disk-gb, --kv-host-gb and --kv-disk-flush-s must be >= 0")
        if (self.disk_dir is None) != (self.disk_gb == 0):
            raise ValueError("--kv-disk-dir and --kv-disk-gb go together: give both (a directory and its size "
                             "bound in GiB) or neither")
        if (self.peer_tls_cert is None) != (self.peer_tls_key is None):
            raise ValueError("--peer-tls-cert and --peer-tls-key go together: give both or neither")


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("KV transfer and tiers (docs/kv-transfer.md)")
    g.add_argument("--role", choices=ROLES, default="both",
                   help="this executor's part in disaggregated serving, reported by GetInfo for the scheduler: "
                        "prefill (runs prompts, its caches exported), decode (imports caches, decodes), both "
                        "(default). Every RPC works whatever the role")
    g.add_argument("--kv-disk-dir", type=Path, metavar="DIR",
                   help="disk tier: prefix cache blocks evicted from the KV pool are written here (in the "
                        "background) and loaded back when a prompt's prefix misses the pool; kept across restarts "
                        "of the same model and KV layout (needs --kv-disk-gb)")
    g.add_argument("--kv-disk-gb", type=float, default=0.0, metavar="GIB",
                   help="size bound of --kv-disk-dir in GiB; least recently used blocks go first when full")
    g.add_argument("--kv-disk-flush-s", type=float, default=10.0, metavar="SECONDS",
                   help="on a clean stop (SIGTERM, after the last request), time given to writing the prefix "
                        "cache's blocks still in the KV pool to --kv-disk-dir, so that a restart finds the prefixes "
                        "that were warm (most recently used first; 0 = none: only evicted blocks survive a restart)")
    g.add_argument("--kv-host-gb", type=float, default=0.0, metavar="GIB",
                   help="host-memory tier between the KV pool and the disk (mainly for CUDA; 0 = none): evicted "
                        "blocks are kept here first, lost on restart")
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
    cfg = KvTransferConfig(role=args.role, disk_dir=args.kv_disk_dir, disk_gb=args.kv_disk_gb,
                           host_gb=args.kv_host_gb, disk_flush_s=args.kv_disk_flush_s, peer_tls_ca=args.peer_tls_ca,
                           peer_tls_cert=args.peer_tls_cert,
                           peer_tls_key=args.peer_tls_key, peer_tls=args.peer_tls,
                           peer_token_file=args.peer_token_file, insecure=args.insecure)
    cfg.validate()
    return cfg

"""What the executor is started with for the KV tiers under the prefix cache (docs/kv-transfer.md, 'Tiers'): the
host-memory tier's size, the disk tier's directory and size, and the time a clean stop gives to writing the pool's
blocks to disk. Flags, their help and their checks live here; separate from the transfer flags
(executor_service/kv/transfer/config.py) because the tiers work on one executor, with no peer."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KvTierConfig:
    disk_dir: Path | None = None  # disk tier directory (None: no disk tier)
    disk_gb: float = 0.0  # its size bound (GiB); the least recently used blocks go when full
    host_gb: float = 0.0  # host-memory tier size (GiB); 0 = none
    disk_flush_s: float = 10.0  # on a clean stop: time to write the pool's cached blocks to the disk tier; 0 = none
    disk_fsync: bool = False  # fsync each block file and its directory once written (durable across a power loss)

    def validate(self) -> None:
        if self.disk_gb < 0 or self.host_gb < 0 or self.disk_flush_s < 0:
            raise ValueError("--kv-disk-gb, --kv-host-gb and --kv-disk-flush-s must be >= 0")
        if self.disk_fsync and self.disk_dir is None:
            raise ValueError("--kv-disk-fsync needs a disk tier (--kv-disk-dir and --kv-disk-gb)")
        if (self.disk_dir is None) != (self.disk_gb == 0):
            raise ValueError("--kv-disk-dir and --kv-disk-gb go together: give both (a directory and its size "
                             "bound in GiB) or neither")


def add_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("KV tiers (docs/kv-transfer.md)")
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
    g.add_argument("--kv-disk-fsync", action="store_true",
                   help="fsync each disk tier block file, and its directory, once written. Off by default: the "
                        "tier is a cache, and a power loss (not a crash: files are written whole and renamed) may "
                        "lose or truncate the most recent files, which the tier's checks then drop (recomputed, "
                        "never served wrong). On: what was written survives a power loss, at the cost of a sync "
                        "per block on the background writer (docs/kv-transfer.md, 'Disk faults')")
    g.add_argument("--kv-host-gb", type=float, default=0.0, metavar="GIB",
                   help="host-memory tier between the KV pool and the disk (mainly for CUDA; 0 = none): evicted "
                        "blocks are kept here first, lost on restart")


def from_args(args: argparse.Namespace) -> KvTierConfig:
    cfg = KvTierConfig(disk_dir=args.kv_disk_dir, disk_gb=args.kv_disk_gb, host_gb=args.kv_host_gb,
                       disk_flush_s=args.kv_disk_flush_s, disk_fsync=args.kv_disk_fsync)
    cfg.validate()
    return cfg

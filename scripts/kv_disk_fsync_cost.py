#!/usr/bin/env python
"""What --kv-disk-fsync costs the disk tier's writer (docs/kv-transfer.md, 'Durability'): writes block files the
way the tier does (executor_service/kv/tiers/disk_writes.py: a temporary name, renamed), with and without fsync,
into a directory on the disk to measure, and prints the time per block and the bandwidth.

    python scripts/kv_disk_fsync_cost.py /var/cache/tandem-kv

Two block sizes: the tiny test Llama's (8 KiB) and SmolLM2-135M's in bfloat16 (360 KiB: 30 layers x K,V x 16
slots x 3 KV heads x 64 dims x 2 bytes). Measurement only; never imported by the servers.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_service.kv.tiers.disk_writes import write_file  # noqa: E402

SIZES = {"tiny llama fp32": 8_292, "SmolLM2-135M bf16": 30 * 2 * 16 * 3 * 64 * 2 + 100}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a directory on the disk to measure (a temporary one is made inside)")
    ap.add_argument("--blocks", type=int, default=100, help="block files written per case (default 100)")
    args = ap.parse_args(argv)
    print(f"{'block':>20} {'KiB':>7} {'fsync':>5} {'ms/block':>9} {'MiB/s':>8}")
    for name, size in SIZES.items():
        raw = os.urandom(size)
        for fsync in (False, True):
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                start = time.perf_counter()
                for i in range(args.blocks):
                    write_file(Path(d) / f"{i}.kvb", raw, fsync)
                per = (time.perf_counter() - start) / args.blocks
            print(f"{name:>20} {size / 1024:7.1f} {'on' if fsync else 'off':>5} {per * 1e3:9.3f} "
                  f"{size / per / 2**20:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What memory there is: the executor process's resident memory, and the free memory of a device (CUDA's free
bytes, or the host's MemAvailable) that a KV pool may take a fraction of."""
from __future__ import annotations

import os

import torch

_UNKNOWN_HOST_BYTES = 4 << 30  # no /proc/meminfo (not Linux): assume a modest 4 GiB


def resident_memory_bytes() -> int:
    """This process's resident set size (RSS) now, in bytes; 0 where the platform does not tell (no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device now: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _UNKNOWN_HOST_BYTES

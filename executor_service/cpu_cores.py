"""`--cpu-cores LIST`: the executor's threads on these cores only, so that executors sharing a host do not
steal each other's cores.

torch's OpenMP team (libgomp) spin-waits between parallel regions before it sleeps (libgomp's default: a
bounded number of polls, well under a millisecond to a few), and the OS places every executor's threads on
any core: two executors each with a team as wide as the machine preempt each other's threads mid-step and
spin through each other's barriers. Pinned to disjoint lists they cannot. Idle, an executor uses ~0 % of a
core either way (the spin ends soon after the last step, then the team sleeps on a futex; measured in
docs/performance.md, "Executors sharing a host"), so the wait policy is left at libgomp's default:
OMP_WAIT_POLICY=PASSIVE made the stream ~1.5x slower.

The mask is set on every thread the process has when the flag is applied (the main thread, any threads
imports started) and is inherited by every thread started after it (the model thread, its OpenMP team,
gRPC's pools). Without --threads the executor then runs as many torch threads as cores listed.

Tensor parallelism on one machine (rank 0 starts the other ranks): the list is cut into one contiguous slice per
rank, rank 0 keeping the first and each worker started with its own, so that N ranks do not each run a team as
wide as the whole list on the same cores.
"""
from __future__ import annotations

import argparse
import os

from executor_service.tp.launch import rendezvous_master


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cpu-cores", metavar="LIST",
                    help="run the executor's threads (torch's OpenMP team, the model thread, gRPC's) on these CPU "
                         "cores only, e.g. '0-3' or '0,2,4-5' (Linux's cpuset syntax; each must be one this process "
                         "may use). Without --threads, torch runs one thread per core listed. For executors sharing "
                         "a host: give each its own cores. With --tensor-parallel-size N on one machine, each rank "
                         "gets a contiguous 1/N of the list. Default: every core the process may use")


def parse_cores(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6). Raises ValueError for a malformed list or an empty one."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--cpu-cores wants core numbers and ranges like '0-3,6', got {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"--cpu-cores: the range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def pin(cores: tuple[int, ...], inherited_mask_limits: bool = True) -> None:
    """Every current thread of this process on `cores` (later threads inherit the mask). Raises ValueError
    naming the cores this process may not use (outside its cgroup's cpuset or the machine). A local
    tensor-parallel worker (inherited_mask_limits=False) inherits rank 0's slice as its mask, but its own slice,
    checked by rank 0 within the whole list, lies outside it."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cores) - allowed) if inherited_mask_limits else []
    if missing:
        raise ValueError(f"--cpu-cores: core(s) {','.join(map(str, missing))} are not available to this process "
                         f"(it may use {_ranges(sorted(allowed))})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def apply(args: argparse.Namespace) -> None:
    """--cpu-cores, once parsed: pins the process and, without --threads, sets args.threads to the core count.
    Raises ValueError for a list it cannot apply (the CLI exits 2 with the message)."""
    if args.cpu_cores is None:
        return
    cores = parse_cores(args.cpu_cores)
    pin(cores, inherited_mask_limits=args.tp_store is None)
    if not args.threads:
        args.threads = len(cores)


def share_with_local_ranks(args: argparse.Namespace) -> list[str] | None:
    """Tensor parallelism whose ranks rank 0 starts here (no --tp-master or torchrun rendezvous, not a worker):
    --cpu-cores cut into one contiguous slice per rank, in cpuset syntax; args.cpu_cores becomes rank 0's. None
    when there is nothing to share. Raises ValueError for fewer cores than ranks."""
    size = args.tensor_parallel_size
    if args.cpu_cores is None or size <= 1 or args.tp_store is not None or rendezvous_master(args) is not None:
        return None
    cores = list(parse_cores(args.cpu_cores))
    if len(cores) < size:
        raise ValueError(f"--cpu-cores lists {len(cores)} core(s) for {size} tensor-parallel ranks: each rank "
                         "needs one at least")
    cuts = [len(cores) * r // size for r in range(size + 1)]
    slices = [_ranges(cores[cuts[r]:cuts[r + 1]]) for r in range(size)]
    args.cpu_cores = slices[0]
    return slices


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for c in cores:
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)

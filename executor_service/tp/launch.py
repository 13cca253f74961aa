"""Starting a tensor-parallel group: flags, rendezvous, the process group, the watchdogs.

- One machine (`--tensor-parallel-size N` alone): rank 0 starts ranks 1..N-1 itself (`python -m
  executor_service` with the same flags plus hidden --tp-rank/--tp-store/--tp-parent-pid; the test suite's
  server_process spawner forks them from a warm interpreter instead, as siblings of rank 0). The rendezvous is a
  FileStore in a private temporary directory, and gloo binds the loopback interface: nothing listens off the
  machine.
- Several machines (`--tp-master ADDR:PORT`, `--tp-rank R`, or torchrun's MASTER_ADDR/MASTER_PORT/RANK/
  WORLD_SIZE read by __main__ at startup): rank 0 hosts a TCPStore at ADDR:PORT and every rank joins it.
  torch.distributed has no TLS or tokens, so an address off loopback is refused unless --insecure: run it
  on a private network (docs/tensor-parallel.md).

Bounds: every rank announces itself in the store; rank 0 waits --tp-join-timeout for all of them and names the
ones missing (or a local worker that exited first). Collectives are bounded by --tp-timeout. Rank 0 watches its
local workers (one that exits takes the group down: executor_service/tp/channel.py's fatal); a local worker
watches rank 0 (it exits when rank 0 is gone: a pidfd, else its parent's pid) on top of its failing collectives.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import IO

import torch
import torch.distributed as dist

from executor_service.tp.channel import AT_FATAL, ControlChannel, fatal
from models.parallel.shard import Shard
from tandem import server_process

log = logging.getLogger("tandem.executor.tp")
_current: "TpGroup | None" = None  # this process's group (torch.distributed's is process-wide too)


def add_tp_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                    help="split the model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA): each holds "
                         "1/N of the weights and of the KV heads; rank 0 serves. Alone, rank 0 starts ranks "
                         "1..N-1 on this machine; with --tp-master, ranks join from other machines. Heads and KV "
                         "heads must divide by N. Default 1 (no tensor parallelism). docs/tensor-parallel.md")
    ap.add_argument("--tp-master", metavar="ADDR:PORT",
                    help="several machines: the rendezvous address (rank 0 listens there, the others connect; "
                         "default from MASTER_ADDR/MASTER_PORT when set). Off loopback only with --insecure: "
                         "torch.distributed has no TLS or tokens")
    ap.add_argument("--tp-rank", type=int, metavar="R",
                    help="with --tp-master: this process's rank (0 serves gRPC, others are workers; default from "
                         "RANK, else 0)")
    ap.add_argument("--tp-join-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long rank 0 waits for every rank to join; the start fails naming the missing ones "
                         "(default 60)")
    ap.add_argument("--tp-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="bound on any one collective wait between ranks (a hung rank takes the group down after "
                         "it); rank 0 pings idle workers a quarter of it apart, at most 10 s (default 60)")
    ap.add_argument("--tp-store", help=argparse.SUPPRESS)  # local workers: rank 0's FileStore
    ap.add_argument("--tp-parent-pid", type=int, help=argparse.SUPPRESS)  # local workers: exit when it is gone


@dataclass(frozen=True)
class TpLaunch:
    """How this process joins its group (from the flags)."""

    size: int
    rank: int = 0
    master: str | None = None  # ADDR:PORT of a TCPStore; None: one machine
    store_path: str | None = None  # a local worker's FileStore
    parent_pid: int | None = None  # a local worker's rank 0
    join_timeout_s: float = 60.0
    timeout_s: float = 60.0
    insecure: bool = False
    rank_cores: tuple[str, ...] = ()  # local ranks' --cpu-cores slices (cpu_cores.share_with_local_ranks)

    @classmethod
    def from_args(cls, args: argparse.Namespace, rank_cores: list[str] | None = None) -> "TpLaunch | None":
        """None at size 1. Startup only: reads torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE when the
        flags leave them out. rank_cores: each rank's slice of --cpu-cores, for the workers started here."""
        env = os.environ
        size = args.tensor_parallel_size
        if size == 1 and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
            size = int(env["WORLD_SIZE"])
        if size == 1:
            return None
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        master = rendezvous_master(args)
        rank = args.tp_rank if args.tp_rank is not None else int(env.get("RANK", 0)) if master else 0
        if not 0 <= rank < size:
            raise ValueError(f"--tp-rank {rank} is outside 0..{size - 1}")
        if master is not None:
            host = master.rpartition(":")[0].strip("[]")
            if not _loopback(host) and not args.insecure:
                raise ValueError(f"--tp-master {master} is off loopback: torch.distributed links have no TLS or "
                                 "tokens; run the ranks on a private network and pass --insecure")
        return cls(size, rank, master, args.tp_store, args.tp_parent_pid, args.tp_join_timeout, args.tp_timeout,
                   args.insecure, tuple(rank_cores or ()))


def rendezvous_master(args: argparse.Namespace) -> str | None:
    """ADDR:PORT of the rank-0 store this process meets its group at: --tp-master, else torchrun's MASTER_ADDR
    and MASTER_PORT; None for one machine (rank 0 starts the workers, which find it through --tp-store)."""
    if args.tp_master is not None or args.tp_store is not None:
        return args.tp_master
    env = os.environ
    return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}" if "MASTER_ADDR" in env else None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TpGroup:
    """This process's membership: shard, channel, and (rank 0) the local workers it started."""

    def __init__(self, launch: TpLaunch, device: torch.device, worker_argv: list[str]) -> None:
        self.launch = launch
        self.workers: dict[int, server_process.ProcessHandle] = {}
        self._tmp: str | None = None
        self._stopping = False
        if launch.parent_pid is not None:  # (before the rendezvous: rank 0 may die while this one waits)
            threading.Thread(target=self._watch_parent, name="tp-parent", daemon=True).start()
        store = self._rendezvous(worker_argv)
        data_backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=launch.timeout_s)
        dist.init_process_group(data_backend, store=store, rank=launch.rank, world_size=launch.size,
                                timeout=timeout)
        control = dist.new_group(backend="gloo", timeout=timeout) if data_backend != "gloo" else dist.group.WORLD
        self.shard = Shard(launch.rank, launch.size, None)
        self.channel = ControlChannel(launch.rank, launch.size, control, None, device, launch.timeout_s)
        if self.workers:
            self.channel.why_down = self._dead_worker
            threading.Thread(target=self._watch_workers, name="tp-watchdog", daemon=True).start()
        log.info("tensor-parallel rank %d of %d joined (%s)", launch.rank, launch.size, data_backend)

    @property
    def is_worker(self) -> bool:
        return self.launch.rank != 0

    def _rendezvous(self, worker_argv: list[str]) -> dist.Store:
        launch = self.launch
        deadline = time.monotonic() + launch.join_timeout_s
        if launch.master is not None:
            host, _, port = launch.master.rpartition(":")
            try:
                store: dist.Store = dist.TCPStore(host.strip("[]"), int(port), launch.size, launch.rank == 0,
                                                  timeout=timedelta(seconds=launch.join_timeout_s),
                                                  wait_for_workers=False)
            except (RuntimeError, ValueError) as exc:  # port taken, rank 0 not reachable in time, a bad port
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                what = (f"host the rendezvous at {launch.master}" if launch.rank == 0 else
                        f"reach rank 0's rendezvous at {launch.master} within {launch.join_timeout_s:g} s")
                raise ValueError(f"tensor-parallel rank {launch.rank} could not {what} ({first})") from exc
        elif launch.store_path is not None:  # a local worker
            store = dist.FileStore(launch.store_path, launch.size)
            # (its group is down when it exits this way: rank 0, SIGKILLed, may have left its directory)
            folder = os.path.dirname(launch.store_path)
            if os.path.basename(folder).startswith("tandem-tp-"):  # only the directory rank 0 made
                AT_FATAL.append(lambda: shutil.rmtree(folder, ignore_errors=True))
        else:  # rank 0 on one machine: a private store, loopback links, and the workers started here
            self._tmp = tempfile.mkdtemp(prefix="tandem-tp-")
            AT_FATAL.append(lambda: shutil.rmtree(self._tmp or "", ignore_errors=True))
            path = os.path.join(self._tmp, "store")
            store = dist.FileStore(path, launch.size)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (inherited by the workers)
            for r in range(1, launch.size):
                argv = [*worker_argv, "--tp-rank", str(r), "--tp-store", path, "--tp-parent-pid", str(os.getpid())] \
                    + (["--cpu-cores", launch.rank_cores[r]] if launch.rank_cores else [])  # (the last one wins)
                # (the test suite's spawner forks it from a warm interpreter; nothing else installs one)
                worker = server_process.spawned("executor_service", argv, own_session=True)
                if worker is None:
                    worker = subprocess.Popen([sys.executable, "-m", "executor_service", *argv],
                                              stdin=subprocess.DEVNULL, stdout=sys.stderr, start_new_session=True)
                else:  # its stdout comes piped: to this process's stderr, as a started worker's goes
                    threading.Thread(target=_copy_lines, args=(worker.stdout,), name=f"tp-rank-{r}-stdout",
                                     daemon=True).start()
                self.workers[r] = worker
                log.info("tensor-parallel rank %d started (pid %d)", r, worker.pid)
        store.set(f"tandem/joined/{launch.rank}", "1")
        if launch.rank == 0:
            self._wait_for_ranks(store, deadline)
        return store

    def _wait_for_ranks(self, store: dist.Store, deadline: float) -> None:
        missing = list(range(1, self.launch.size))
        while missing:
            missing = [r for r in missing if not store.check([f"tandem/joined/{r}"])]
            for r in missing:
                proc = self.workers.get(r)
                if proc is not None and proc.poll() is not None:
                    self._kill_workers()
                    raise ValueError(f"tensor-parallel rank {r} exited with code {proc.returncode} before joining "
                                     "(its log is above)")
            if missing and time.monotonic() > deadline:
                self._kill_workers()
                raise ValueError(f"tensor-parallel rank{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(map(str, missing))} did not join within {self.launch.join_timeout_s:g} "
                                 "s (--tp-join-timeout)" + ("" if self.workers else
                                                           f": start them with --tp-master {self.launch.master}"))
            time.sleep(0.05)

    def _kill_workers(self) -> None:
        self._stopping = True
        for proc in self.workers.values():
            proc.kill()
            proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _dead_worker(self, wait_s: float = 1.0) -> str | None:
        """Which local worker exited, if one did (waits up to wait_s for the exit to show: a collective can fail
        before the dead process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, proc in self.workers.items():
                if proc.poll() is not None:
                    return f"rank {r} (pid {proc.pid}) exited with code {proc.returncode}: the group is down"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _watch_workers(self) -> None:
        while not self._stopping:
            dead = self._dead_worker(0)
            if dead and not self._stopping:
                fatal(dead)
            time.sleep(0.2)

    def _watch_parent(self) -> None:
        """Rank 0 is this process's parent, or (forked by the test suite's spawner) its sibling: watched by a
        pidfd where there is one (readable once it exits), else as the parent or by pid."""
        parent = self.launch.parent_pid
        assert parent is not None
        is_parent = os.getppid() == parent
        try:
            pidfd: int | None = os.pidfd_open(parent)
        except (AttributeError, OSError):  # (no pidfd_open: Linux < 5.3, another OS; or rank 0 is gone already)
            pidfd = None
        while True:
            if pidfd is not None:
                gone = bool(select.select([pidfd], [], [], 0.5)[0])
            else:
                gone = os.getppid() != parent if is_parent else not _exists(parent)
                time.sleep(0.5)
            if gone:
                fatal(f"rank {self.launch.rank}: rank 0 (pid {parent}) is gone")

    def stop(self) -> None:
        """Rank 0's clean end: the workers are told to stop and waited for (killed after 10 s)."""
        self._stopping = True
        if dist.is_initialized():
            if self.launch.rank == 0 and hasattr(self, "channel"):
                self.channel.stop()
        for r, proc in self.workers.items():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop in 10 s: killed", r)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _copy_lines(stream: IO[str]) -> None:
    for line in stream:
        sys.stderr.write(line)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_group(launch: TpLaunch, device: torch.device, worker_argv: list[str]) -> TpGroup:
    """Joins (rank 0: starts and waits for) the group; this process's group from now on (`current`)."""
    global _current
    _current = TpGroup(launch, device, worker_argv)
    return _current


def current() -> TpGroup:
    if _current is None:
        raise RuntimeError("no tensor-parallel group was started in this process (executor_service/tp/launch.py)")
    return _current

"""SIGTERM reaches a process, not a thread: the kernel may hand it to any thread that does not block it (gRPC's,
the model thread, OpenMP's), and Python then only flags it for the main thread. The executor and the scheduler
must still drain and exit 0 at once (CI once saw one killed 20 s after SIGTERM: its main thread slept in an untimed wait). Here the
signal is sent to one chosen non-main thread with tgkill(2), which is what the kernel's choice amounts to."""
from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

import pytest

from tests.grpc_harness import GrpcServer, start_executor, start_scheduler
from tandem.executor.v1 import executor_pb2 as pb

SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)


def _threads_taking(pid: int, sig: int) -> list[int]:
    """The process's non-main threads that do not block `sig` (/proc/PID/task/TID/status SigBlk)."""
    tids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        if tid == pid:
            continue
        try:
            blocked = int(next(line.split()[1] for line in (task / "status").read_text().splitlines()
                               if line.startswith("SigBlk:")), 16)
        except (OSError, StopIteration):
            continue  # the thread ended meanwhile
        if not blocked & (1 << (sig - 1)):
            tids.append(tid)
    return tids


def _stops_on_a_threads_sigterm(server: GrpcServer) -> None:
    pid = server.proc.pid
    tids = _threads_taking(pid, signal.SIGTERM)
    assert tids, "no thread other than the main one takes SIGTERM"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_TGKILL, pid, tids[-1], int(signal.SIGTERM)) == 0, os.strerror(ctypes.get_errno())
    start = time.monotonic()
    while server.proc.poll() is None and time.monotonic() - start < 15:
        time.sleep(0.05)
    assert server.proc.poll() == 0, f"still running {time.monotonic() - start:.0f} s after SIGTERM:\n" \
                                    f"{server.stderr()}"


needs_tgkill = pytest.mark.skipif(SYS_TGKILL is None or not Path("/proc/self/task").is_dir(),
                                  reason="needs Linux tgkill")


@needs_tgkill
def test_sigterm_delivered_to_another_thread_stops_executor_and_scheduler(model_dir):
    executor = start_executor(model_dir, "--kv-blocks", "32")
    scheduler = None
    try:
        scheduler = start_scheduler(executor.address)
        executor.stub.GetInfo(pb.GetInfoRequest())  # serving: every thread of a served process exists
        _stops_on_a_threads_sigterm(scheduler)
        assert "stopped" in scheduler.stderr(), scheduler.stderr()
        _stops_on_a_threads_sigterm(executor)
        assert "stopped" in executor.stderr()
    finally:
        if scheduler is not None:
            scheduler.close()
        executor.close()

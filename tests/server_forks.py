"""Servers forked from a warm interpreter: the suite's spawner for tandem/server_process.py.

tests/server_fork_zygote.py imports `executor_service.__main__` (or `scheduler.__main__`) once per pytest worker
and forks a child per server, which runs the module's main as `python -m MODULE ARGS` would. The servers are
still separate processes that serve over real sockets, are signalled, killed and reaped the same way; what they
skip is the interpreter's start and the imports (~3.5 CPU-s an executor, ~1.7 s a scheduler, ~250 servers a run).

A start falls back to a fresh interpreter (returns None) when the zygote cannot stand for one: another Python or
source tree (server_process handles those itself), or an environment that differs from the zygote's in a variable
read while importing (OMP_*, TORCH_*, ...). Tests that measure a fresh process (resident memory) are marked
`fresh_process` (tests/conftest.py turns the fork server off around them); `pytest --no-fork-server` turns it off.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
ZYGOTE_READY_TIMEOUT_S = 120.0
_PRELOAD = {  # module a server runs -> modules its zygote imports first
    "executor_service": ("executor_service.__main__", "grpc._server", "grpc._interceptor"),
    "scheduler": ("scheduler.__main__", "grpc._server", "grpc._interceptor"),
}
# Read while the zygote's modules load (libgomp, glibc malloc, the interpreter, torch's logging, gRPC): a child
# that asks for other values than the zygote had must start fresh. Not what libraries in a test process set for
# themselves at run time: TORCHINDUCTOR_CACHE_DIR (torch.compile; inductor is imported in the child, if at all),
# KMP_DUPLICATE_LIB_OK / KMP_INIT_AT_FORK (sentence-transformers' import; Intel's OpenMP, which torch's CPU
# wheel does not load), MKL_* (read when MKL first runs, in the child).
_IMPORT_TIME_PREFIXES = ("OMP_", "GOMP_", "PYTHON", "LD_", "MALLOC_", "TORCH_", "PYTORCH_", "CUDA_", "GRPC_")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES) and k != "PYTHONUNBUFFERED"}


# CPU seconds (user + system) of this process's forked servers reaped so far: what getrusage(RUSAGE_CHILDREN)
# would have counted had they been its own children (for per-test CPU profiles of the suite).
reaped_cpu_s = 0.0


class ForkedProcess:
    """The subprocess.Popen surface server_process and the tests use (pid, args, stdout, returncode, poll, wait,
    send_signal, terminate, kill) for a child of the zygote; its exit code arrives on the report socket."""

    def __init__(self, pid: int, report: socket.socket, stdout: IO[str] | None, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.stdin = None
        self.stderr = None
        self.returncode: int | None = None
        self._report = report
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                ready, _, _ = select.select([self._report], [], [], timeout)
                if ready:
                    message = self._report.recv(4096)
                    # An empty read: the zygote itself died, and SIGTERM'd the child (its parent-death signal).
                    report = json.loads(message) if message else {"rc": -signal.SIGTERM, "cpu_s": 0.0}
                    self.returncode = report["rc"]
                    global reaped_cpu_s
                    reaped_cpu_s += report["cpu_s"]
                    self._report.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _spawn(control: socket.socket, module: str, args: list[str], cwd: Path, env: dict[str, str], stderr_fd: int,
           own_session: bool, why_not: str) -> ForkedProcess:
    """One request to a zygote over its control socket (tests/server_fork_zygote.py's protocol); the caller holds
    the socket's lock. why_not: what the error says when no child comes."""
    out_r, out_w = os.pipe()
    report, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    request = {"module": module, "args": args, "cwd": str(cwd), "env": env, "own_session": own_session}
    try:
        with open(os.devnull, "rb") as devnull:
            socket.send_fds(control, [json.dumps(request).encode()],
                            [theirs.fileno(), devnull.fileno(), out_w, stderr_fd])
    finally:
        theirs.close()
        os.close(out_w)
    ready, _, _ = select.select([report], [], [], 30)
    message = report.recv(4096) if ready else b""
    if not message:
        os.close(out_r)
        report.close()
        raise RuntimeError(f"the fork server did not start {module} ({why_not})")
    stdout = os.fdopen(out_r, "r", errors="replace")
    return ForkedProcess(json.loads(message)["pid"], report, stdout, [sys.executable, "-m", module, *args])


def _differ(env: dict[str, str], zygote_env: dict[str, str]) -> list[str]:
    """The variables read at import time whose values differ between a child's environment and the zygote's."""
    return sorted(k for k in _import_time_env(env).keys() | _import_time_env(zygote_env).keys()
                  if env.get(k) != zygote_env.get(k))


class _Zygote:
    def __init__(self, module: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.server_fork_zygote", str(theirs.fileno()),
                                      *_PRELOAD[module]], pass_fds=[theirs.fileno()], cwd=ROOT, env=self.env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.control = ours
        self._lock = threading.Lock()
        ready, _, _ = select.select([ours], [], [], ZYGOTE_READY_TIMEOUT_S)
        if not ready or ours.recv(16) != b"ready":
            self.close()
            raise RuntimeError(f"the fork server for {module} did not start (exit code {self.proc.poll()})")

    def spawn(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stderr_fd: int,
              own_session: bool) -> ForkedProcess:
        with self._lock:
            return _spawn(self.control, module, args, cwd, env, stderr_fd, own_session,
                          f"zygote exit code {self.proc.poll()}")

    def close(self) -> None:
        self.control.close()  # the zygote exits on EOF; its children live on until stopped by their tests
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class ForkServer:
    """server_process's spawner: a zygote per server module, started on first use (from any thread)."""

    def __init__(self) -> None:
        self._zygotes: dict[str, _Zygote] = {}
        self._lock = threading.Lock()
        self.enabled = True

    def __call__(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stderr_fd: int,
                 own_session: bool) -> ForkedProcess | None:
        if not self.enabled or module not in _PRELOAD:
            return None
        with self._lock:
            zygote = self._zygotes.get(module)
            if zygote is None:
                zygote = self._zygotes[module] = _Zygote(module)
        differ = _differ(env, zygote.env)
        if differ:
            print(f"fork server: {module} starts fresh: its environment differs from the warm interpreter's in "
                  f"{', '.join(differ)}", file=sys.stderr)
            return None
        return zygote.spawn(module, args, cwd, env, stderr_fd, own_session)

    def close(self) -> None:
        with self._lock:
            for zygote in self._zygotes.values():
                zygote.close()
            self._zygotes.clear()


class SiblingSpawner:
    """server_process's spawner inside a forked server (installed by the zygote): what that server starts
    itself (a tensor-parallel rank 0's workers) is forked by the same zygote, over the server's own control
    socket, when the module is the zygote's and the environment agrees; the children are the zygote's, not the
    server's (executor_service/tp/launch.py watches its rank 0 by pid, not as its parent)."""

    def __init__(self, control: socket.socket, zygote_env: dict[str, str]) -> None:
        self._control = control
        self._zygote_env = zygote_env
        self._lock = threading.Lock()

    def __call__(self, module: str, args: list[str], cwd: Path, env: dict[str, str], stderr_fd: int,
                 own_session: bool) -> ForkedProcess | None:
        if module not in _PRELOAD or _differ(env, self._zygote_env):
            return None
        with self._lock:
            return _spawn(self._control, module, args, cwd, env, stderr_fd, own_session, "the zygote is gone")

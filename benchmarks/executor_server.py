"""`python -m executor_service` as a child process that loads while the benchmark loads its own copy:
tandem/server_process.launch waits for READY before it returns, this starts first and waits later."""
from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from benchmarks import ROOT


class ServerProcess:
    """`python -m executor_service` as a child process; `stop()` is idempotent and also runs at exit."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.address: str | None = None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        atexit.register(self.stop)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name="server-stdout", daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the executor server printed no READY line within {timeout:.0f}s")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"the executor server exited (code {self.proc.wait()}) before READY; "
                                   "its log is above")
            if line.startswith("READY "):
                addresses = line.split()[1:]
                self.address = next((a for a in addresses if not a.startswith("unix:")), addresses[0])
                return self.address

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the server drains and exits 0
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if this benchmark dies without running its cleanup (SIGKILL)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass

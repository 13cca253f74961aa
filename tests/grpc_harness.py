"""Runs the real executor server (`python -m executor_service`) as a subprocess for gRPC tests.

    with start_executor(model_dir, "--kv-blocks", "64") as server:
        server.stub.GetInfo(pb.GetInfoRequest())

The server prints exactly one stdout line, `READY <address>`, once the model is loaded and warm; we
wait for that line (read by a thread, so the wait has a deadline and notices an early exit) instead of
sleeping. close() sends SIGTERM, waits for the drain (SIGKILL after 20 s) and asserts exit code 0.
Tests use it through module-scoped fixtures whose finalizers always call close().
"""
from __future__ import annotations

import atexit
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import grpc

from protos import executor_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
_EOF = object()
_live: set["ExecutorProcess"] = set()  # killed at interpreter exit if a test run was interrupted


class ExecutorProcess:
    """A started server: .address ("127.0.0.1:PORT"), .channel, .stub, .proc."""

    def __init__(self, proc: subprocess.Popen, stderr_file, lines: "queue.Queue", args: list[str]) -> None:
        self.proc = proc
        self.args = args
        self._stderr_file = stderr_file
        self._lines = lines
        self.address: str = ""
        self.channel: grpc.Channel | None = None
        self.stub: executor_pb2_grpc.ExecutorServiceStub | None = None
        self.returncode: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Blocks until the READY line arrives; raises with the server's stderr if it dies or times out."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._kill()
            raise RuntimeError(f"executor did not print READY within {timeout:.0f}s; stderr:\n{self.stderr()}")
        if line is _EOF:  # stdout closed: the process is exiting (or has exited)
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._kill()
                code = self.proc.returncode
            raise RuntimeError(f"executor exited with code {code} before READY; stderr:\n{self.stderr()}")
        words = line.split()
        if len(words) < 2 or words[0] != "READY":
            self._kill()
            raise RuntimeError(f"unexpected first stdout line {line!r}; stderr:\n{self.stderr()}")
        self.address = words[1]  # the TCP address (the only one without --uds)
        self.channel = grpc.insecure_channel(self.address)
        grpc.channel_ready_future(self.channel).result(timeout=30)  # READY means listening: connects at once
        self.stub = executor_pb2_grpc.ExecutorServiceStub(self.channel)

    def send_sigterm(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Waits for the process to end (SIGKILL after `timeout`) and returns its exit code."""
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            raise AssertionError(f"executor did not exit within {timeout:.0f}s of SIGTERM (killed); "
                                 f"stderr:\n{self.stderr()}")
        return self.returncode

    def close(self) -> None:
        """SIGTERM, wait for the drain, assert exit code 0. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        try:
            if self.channel is not None:
                self.channel.close()
            self.send_sigterm()
            code = self.wait_exit()
            assert code == 0, f"executor exited with code {code} after SIGTERM; stderr:\n{self.stderr()}"
        finally:
            if self.proc.poll() is None:
                self._kill()
            self._stderr_file.close()

    def __enter__(self) -> "ExecutorProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def stderr(self, tail_chars: int = 20000) -> str:
        """The server's log so far (its last `tail_chars` characters)."""
        try:
            self._stderr_file.flush()
            with open(self._stderr_file.name, "r", errors="replace") as f:
                text = f.read()
        except (OSError, ValueError):
            return "<stderr unavailable>"
        return text[-tail_chars:]

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _live.discard(self)


def _pump_stdout(stream, lines: "queue.Queue") -> None:
    for line in stream:  # the READY line, and anything after it (so the pipe never fills)
        lines.put(line.strip())
    lines.put(_EOF)


def start_executor(model_dir: Path | str, *extra_args: str, ready_timeout: float = READY_TIMEOUT_S
                   ) -> ExecutorProcess:
    """Starts `python -m executor_service --model DIR --port 0 *extra_args` in the repo root and returns
    once it printed READY (health SERVING). Raises with its stderr if it exits or 120 s pass first."""
    args = [sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0", *extra_args]
    # Logs go to a file rather than a pipe: nobody has to drain it and failures can quote it.
    stderr_file = tempfile.NamedTemporaryFile(prefix="tandem-executor-", suffix=".log", delete=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=stderr_file, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump_stdout, args=(proc.stdout, lines), daemon=True,
                     name=f"executor-stdout-{proc.pid}").start()
    server = ExecutorProcess(proc, stderr_file, lines, args)
    _live.add(server)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server._kill()
        stderr_file.close()
        raise
    return server


def start_for(request, model_dir: Path | str, *extra_args: str) -> ExecutorProcess:
    """start_executor for a pytest fixture: the server is closed by a finalizer of `request`, whatever
    happens in the tests that use it (and the finalizer's exit-code assertion reports a bad shutdown)."""
    server = start_executor(model_dir, *extra_args)
    request.addfinalizer(server.close)
    return server


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        server._kill()

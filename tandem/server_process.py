"""Starts a Tandem server (`python -m executor_service` or `python -m scheduler`) as a subprocess and waits
for its readiness line.

Both servers print exactly one stdout line, `READY <address> [...]`, once they serve (health SERVING).
We wait for that line — read by a thread, so the wait has a deadline and notices an early exit — instead
of sleeping. stop() sends SIGTERM, waits for the drain, and SIGKILLs after a timeout. Used by
scripts/serve, the benchmarks and the tests (tests/grpc_harness.py).
"""
from __future__ import annotations

import atexit
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Callable, Protocol

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
_EOF = object()
_live: set["ServerProcess"] = set()  # killed at interpreter exit if the caller was interrupted


class ProcessHandle(Protocol):
    """What ServerProcess needs of its process: subprocess.Popen's surface (a spawner may return another)."""
    pid: int
    args: list[str]
    stdout: IO[str] | None
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


# spawner(module, args, cwd, env, stderr_fd, own_session) -> a started process with stdout piped (text), or
# None to decline (start() then runs a fresh interpreter). The test suite installs one that forks servers from
# a warm interpreter (tests/server_forks.py); nothing else does.
Spawner = Callable[[str, list[str], Path, dict[str, str], int, bool], ProcessHandle | None]
_spawner: Spawner | None = None


def use_spawner(spawner: Spawner | None) -> None:
    """Installs (or with None removes) the spawner start() tries first for `python -m MODULE` in this tree."""
    global _spawner
    _spawner = spawner


def spawned(module: str, args: list[str], own_session: bool = False) -> ProcessHandle | None:
    """`python -m module *args` from the installed spawner (stdin empty, stdout piped as text, stderr and working
    directory this process's), or None when none is installed or it declines: the caller then starts the
    process itself. For a server that starts processes of its own (tensor-parallel workers)."""
    if _spawner is None:
        return None
    return _spawner(module, list(args), Path.cwd(), dict(os.environ, PYTHONUNBUFFERED="1"), 2, own_session)


class ServerProcess:
    """A started server: .name, .address ("127.0.0.1:PORT"), .addresses (every word of READY after it; the
    scheduler's HTTP URL last with --http-port), .http_url ("http(s)://HOST:PORT" or None), .proc, .args."""

    def __init__(self, name: str, proc: ProcessHandle, log: IO | None, lines: "queue.Queue",
                 args: list[str]) -> None:
        self.name = name
        self.proc = proc
        self.args = args
        self._log = log  # a temp file holding stderr, or None when stderr is inherited
        self._lines = lines
        self.address = ""
        self.addresses: list[str] = []
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str:
        """Blocks until the READY line arrives and returns the address; raises with the server's log if it
        exits or the timeout passes first."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"{self.name} did not print READY within {timeout:.0f}s; log:\n{self.log()}")
        if line is _EOF:  # stdout closed: the process is exiting (or has exited)
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
                code = self.proc.returncode
            raise RuntimeError(f"{self.name} exited with code {code} before READY; log:\n{self.log()}")
        words = line.split()
        if len(words) < 2 or words[0] != "READY":
            self.kill()
            raise RuntimeError(f"{self.name}: unexpected first stdout line {line!r}; log:\n{self.log()}")
        self.address = words[1]  # the TCP address (the first one printed)
        self.addresses = words[1:]
        return self.address

    @property
    def http_url(self) -> str | None:
        """The scheduler's OpenAI-compatible HTTP front (READY's http:// or https:// word), if it serves one."""
        return next((w for w in self.addresses if w.startswith(("http://", "https://"))), None)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Waits for the process to end (SIGKILL after `timeout`, then raises) and returns its exit code."""
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"{self.name} did not exit within {timeout:.0f}s of SIGTERM (killed); "
                               f"log:\n{self.log()}")
        return self.returncode

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait for the drain, return the exit code. Safe to call twice."""
        try:
            if self.returncode is None:
                self.send_signal(signal.SIGTERM)
                self.wait_exit(timeout)
            return self.returncode if self.returncode is not None else -9
        finally:
            self.kill()
            if self._log is not None:
                self._log.close()
                self._log = None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _live.discard(self)

    def log(self, tail_chars: int = 20000) -> str:
        """The server's stderr so far (its last `tail_chars` characters)."""
        if self._log is None:
            return "<stderr went to the terminal>"
        try:
            self._log.flush()
            with open(self._log.name, "r", errors="replace") as f:
                return f.read()[-tail_chars:]
        except (OSError, ValueError):
            return "<log unavailable>"


def _die_with_parent(cmd: list[str]) -> list[str]:
    """Prefixes cmd with util-linux `setpriv --pdeathsig SIGTERM` where it exists (Linux): the server then
    gets SIGTERM when the launching thread's process dies, so it is not orphaned when a test run or a
    benchmark is killed (atexit does not run on a signal death). An exec wrapper, not a preexec_fn: Python
    code between fork and exec can crash a process with gRPC threads."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "SIGTERM", "--", *cmd] if setpriv and sys.platform.startswith("linux") else cmd


def _pump_stdout(stream, lines: "queue.Queue") -> None:
    for line in stream:  # the READY line, and anything after it (so the pipe never fills)
        lines.put(line.strip())
    lines.put(_EOF)


def start(name: str, module: str, *args: str, capture_log: bool = True, log_path: Path | None = None,
          own_session: bool = False, python: str = sys.executable, source_root: Path | None = None) -> ServerProcess:
    """Runs `python -m module *args` in the repo root and returns at once; .wait_ready() waits for READY.
    source_root: run another source tree instead (another release's checkout, tests/contract/previous_release.py):
    the process starts there, with it first on PYTHONPATH, so its packages win over this tree's install.
    Its stderr goes to log_path if given (kept), else with capture_log to a temp file (quoted by errors,
    .log()), else to this terminal. own_session: the child does not get the terminal's Ctrl-C (the caller
    stops it). Call it from a thread that outlives the server: the parent-death signal (see
    _die_with_parent) fires when the *thread* that started the child exits, not only its process."""
    cmd = [python, "-m", module, *args]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w")
    elif capture_log:
        log = tempfile.NamedTemporaryFile(prefix=f"tandem-{name}-", suffix=".log", mode="w", delete=True)
    else:
        log = None
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if source_root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source_root), env.get("PYTHONPATH", "")) if p)
    proc: ProcessHandle | None = None
    if _spawner is not None and source_root is None and python == sys.executable:
        proc = _spawner(module, list(args), ROOT, env, log.fileno() if log is not None else 2, own_session)
    if proc is None:
        proc = subprocess.Popen(_die_with_parent(cmd), cwd=source_root or ROOT, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log if log is not None else None, text=True, env=env,
                                start_new_session=own_session)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump_stdout, args=(proc.stdout, lines), daemon=True,
                     name=f"{name}-stdout-{proc.pid}").start()
    server = ServerProcess(name, proc, log, lines, cmd)
    _live.add(server)
    return server


def run_to_exit(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m module *args` run to its end (as subprocess.run with capture_output and text), started as start()
    starts servers: for a server that should refuse its flags and exit. Raises subprocess.TimeoutExpired (the
    process killed) if it runs past `timeout` seconds."""
    server = start(module, module, *args)
    try:
        code = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        server.kill()
        raise
    stdout = []
    while (line := server._lines.get(timeout=10)) is not _EOF:  # the pump reads to EOF after the exit
        stdout.append(line + "\n")
    stderr = server.log(tail_chars=1 << 30)
    server.stop(timeout=1)  # closes the log
    return subprocess.CompletedProcess(server.args, code, "".join(stdout), stderr)


def launch(name: str, module: str, *args: str, ready_timeout: float = READY_TIMEOUT_S, **kw) -> ServerProcess:
    """start() and wait for READY (stopping the server if it does not come up); keywords as start()'s."""
    server = start(name, module, *args, **kw)
    try:
        server.wait_ready(ready_timeout)
    except BaseException:
        server.stop(timeout=5)
        raise
    return server


def launch_executor(model_dir: Path | str, *args: str, **kw) -> ServerProcess:
    """`python -m executor_service --model DIR --port 0 *args` (any free port unless args say otherwise)."""
    return launch("executor", "executor_service", "--model", str(model_dir), "--port", "0", *args, **kw)


def launch_scheduler(executor_address: str, *args: str, **kw) -> ServerProcess:
    """`python -m scheduler --executor ADDR --port 0 *args`."""
    return launch("scheduler", "scheduler", "--executor", executor_address, "--port", "0", *args, **kw)


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        server.kill()

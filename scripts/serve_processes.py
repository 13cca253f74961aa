"""The servers scripts/serve.py runs on one machine — N executors and one scheduler driving them all — as
command lines (pure functions, unit-tested without starting anything) and as a group started and stopped
together (through tandem.server_process, which waits for each server's READY line).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tandem import server_process  # noqa: E402
from tandem.server_process import ServerProcess  # noqa: E402

MAX_PORT = 65535


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, which taskset and container cpusets narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def executor_ports(first: int, count: int, avoid: int) -> list[int]:
    """Consecutive ports from `first`, skipping `avoid` (the scheduler's port: with the defaults 50051 and
    50052, a second executor would take the scheduler's). first 0: every executor picks a free port."""
    if count < 1:
        raise ValueError(f"--executors must be >= 1, got {count}")
    if first == 0:
        return [0] * count
    ports = [p for p in range(first, first + count + 1) if p != avoid][:count]
    if ports[-1] > MAX_PORT:
        raise ValueError(f"{count} executors from port {first} run past port {MAX_PORT}")
    return ports


def has_flag(args: list[str], flag: str) -> bool:
    """Whether `flag` is among args, as `--flag VALUE` or `--flag=VALUE`."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def executor_threads(cores: int, count: int) -> int:
    """Torch threads of each of `count` executors sharing `cores` CPUs: more threads than cores in total would
    make the executors' OpenMP teams spin against each other."""
    return max(1, cores // count)


def executor_argvs(model: Path | str, host: str, ports: list[int], extra: list[str], cores: int) -> list[list[str]]:
    """The flags of each executor (`python -m executor_service ...`). Several executors split the cores with
    --threads unless `extra` sets --threads; a single one keeps torch's own choice, as it always has.
    `{i}` in `extra` becomes the executor's index (0, 1, ...), e.g. `--device cuda:{i}`: one GPU each."""
    threads = [] if len(ports) == 1 or has_flag(extra, "--threads") else \
        ["--threads", str(executor_threads(cores, len(ports)))]
    return [["--model", str(model), "--host", host, "--port", str(port), *threads,
             *(a.replace("{i}", str(i)) for a in extra)] for i, port in enumerate(ports)]


def scheduler_argv(executor_addresses: list[str], host: str, port: int, extra: list[str],
                   http_port: int | None = None) -> list[str]:
    """The scheduler's flags (`python -m scheduler ...`): `--executor HOST:PORT` once per executor, and
    `--http-port N` for the OpenAI-compatible HTTP API unless http_port is None (extra comes last: it wins)."""
    if not executor_addresses:
        raise ValueError("the scheduler needs at least one executor address")
    executors = [flag for address in executor_addresses for flag in ("--executor", address)]
    http = [] if http_port is None else ["--http-port", str(http_port)]
    return [*executors, "--host", host, "--port", str(port), *http, *extra]


def executor_names(count: int) -> list[str]:
    """Names in messages and log files (NAME.log): `executor` alone, else executor-0, executor-1, ..."""
    return ["executor"] if count == 1 else [f"executor-{i}" for i in range(count)]


def start_executors(argvs: list[list[str]], log_dir: Path, say: Callable[[str], None],
                    ready_timeout: float = 600) -> list[ServerProcess]:
    """Starts every executor at once (they load their weights in parallel) and returns them once all printed
    READY. If one fails, the others are stopped and its error is raised (RuntimeError with its log).
    All are started from this thread, which outlives them: a child gets SIGTERM when the thread that
    started it exits (tandem.server_process), so no worker threads here."""
    servers: list[ServerProcess] = []
    try:
        for name, argv in zip(executor_names(len(argvs)), argvs):
            servers.append(server_process.start(name, "executor_service", *argv, log_path=log_dir / f"{name}.log",
                                                own_session=True))
        for server in servers:  # one after the other, but they load meanwhile: the slowest sets the time
            server.wait_ready(ready_timeout)
    except BaseException:
        stop_all(servers, say, timeout=5)
        raise
    return servers


def stop_all(servers: list[ServerProcess], say: Callable[[str], None], timeout: float = 40) -> None:
    """SIGTERM to all first, so that their drains overlap, then waits for each (SIGKILL past `timeout`)."""
    for server in servers:
        server.send_signal()
    for server in servers:
        say(f"stopping the {server.name}")
        try:
            # Not stop() at once: it would send a second SIGTERM, which kills a server whose Python is
            # already exiting (its handler gone) with -15 instead of letting it finish with 0.
            server.wait_exit(timeout)
        except RuntimeError:  # it outlived the timeout and was killed; stop the others all the same
            say(f"the {server.name} did not exit within {timeout:.0f}s of SIGTERM and was killed; see its log")
        code = server.stop()  # reaps it and closes its log
        if code != 0:
            say(f"the {server.name} exited with code {code}; see its log")

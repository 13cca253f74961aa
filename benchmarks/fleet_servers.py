"""The fleet benchmark's servers: N `python -m executor_service` processes and one `python -m scheduler` over
all of them (`--executor` repeated), started together and stopped together; one executor can be SIGKILLed."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tandem import server_process
from tandem.server_process import ServerProcess


@dataclass
class FleetServers:
    executors: list[ServerProcess]
    scheduler: ServerProcess
    startup_s: float  # spawn of the first executor to the scheduler's READY

    @property
    def address(self) -> str:
        return self.scheduler.address

    @property
    def executor_addresses(self) -> list[str]:
        return [e.address for e in self.executors]

    def pids(self) -> dict[str, int]:
        """The processes a CpuMeter follows, by the names the tables use."""
        out = {f"executor-{i}": e.proc.pid for i, e in enumerate(self.executors)}
        out["scheduler"] = self.scheduler.proc.pid
        return out

    def describe(self) -> dict[str, Any]:
        """The JSON `servers` entry: address, pid and command of each process."""
        out = {f"executor-{i}": {"address": e.address, "pid": e.proc.pid, "command": e.args}
               for i, e in enumerate(self.executors)}
        out["scheduler"] = {"address": self.address, "pid": self.scheduler.proc.pid, "command": self.scheduler.args}
        out["startup_s"] = self.startup_s
        return out

    def sigkill(self, index: int) -> float:
        """SIGKILLs executor `index` (no drain: its caches and its step in flight are gone) and returns the
        perf_counter instant just before the signal. The process is reaped by stop()."""
        t = time.perf_counter()
        os.kill(self.executors[index].proc.pid, signal.SIGKILL)
        return t

    def log_tails(self, chars: int = 3000) -> str:
        parts = [f"scheduler log tail:\n{self.scheduler.log(chars)}"]
        parts += [f"executor-{i} log tail:\n{e.log(chars)}" for i, e in enumerate(self.executors)]
        return "\n".join(parts)

    def stop(self) -> dict[str, int]:
        """The scheduler first (it drains its requests), then every executor at once (SIGTERM to all before
        waiting, so that their drains overlap). Exit codes by name: 0 after a clean drain, -9 when SIGKILLed."""
        codes = {"scheduler": self.scheduler.stop()}
        for e in self.executors:
            e.send_signal()
        for i, e in enumerate(self.executors):
            try:  # not stop() at once: a second SIGTERM kills a Python that is already exiting (exit -15)
                e.wait_exit()
            except RuntimeError:
                pass  # it outlived the drain and was killed: its exit code says so
            codes[f"executor-{i}"] = e.stop()
        return codes


def start_fleet(model_dir: Path, executors: int, threads: int, executor_args: list[str], scheduler_args: list[str],
                log: Callable[[str], None]) -> FleetServers:
    """Starts `executors` executors at once (they load in parallel), each `--threads threads` and
    executor_args, then the scheduler over all of them; returns once every one printed READY."""
    started: list[ServerProcess] = []
    t = time.perf_counter()
    try:
        for _ in range(executors):
            started.append(server_process.start("executor", "executor_service", "--model", str(model_dir),
                                                "--port", "0", "--threads", str(threads), *executor_args))
        for e in started:  # one after the other, but they load meanwhile: the slowest sets the time
            e.wait_ready()
        targets = [flag for e in started for flag in ("--executor", e.address)]
        scheduler = server_process.launch("scheduler", "scheduler", *targets, "--port", "0", *scheduler_args)
    except BaseException:
        for e in started:
            e.stop(timeout=5)
        raise
    fleet = FleetServers(started, scheduler, time.perf_counter() - t)
    log(f"{executors} executor(s) x {threads} thread(s) {', '.join(fleet.executor_addresses)} and scheduler "
        f"{fleet.address} ready in {fleet.startup_s:.1f}s")
    return fleet

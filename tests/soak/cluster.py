"""The processes under soak: N executors (each on a fixed port, so that a restarted one is found where the
scheduler looks) and one scheduler with the HTTP front (--port 0 --http-port 0: each instance gets new
ports, the clients follow Target). Started, SIGKILLed and restarted from the main thread only: a server gets
SIGTERM when the thread that started it exits (tandem/server_process.py).

Besides, per process instance: RSS from /proc (first sample after READY, last, peak), the outage windows
(SIGKILL -> the replacement's READY), the adapters each executor holds, and the KV check at the end.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from tandem import server_process
from tandem.executor.v1 import executor_pb2 as epb
from tandem.executor.v1 import executor_pb2_grpc as epb_grpc
from tests.soak.clients import Target


TIMELINE_S = 30.0


@dataclass
class Instance:
    """One process instance (a restart is a new one). rss_*: kB from /proc/PID/status VmRSS."""
    name: str
    number: int
    server: server_process.ServerProcess
    ready_at: float
    log: Path
    rss_first_kb: int = 0
    rss_last_kb: int = 0
    rss_peak_kb: int = 0
    ended_at: float | None = None
    ended_how: str = ""
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s since READY, kB), every ~TIMELINE_S

    def sample_rss(self) -> None:
        kb = rss_kb(self.server.proc.pid) if self.server.proc.poll() is None else 0
        if kb:
            self.rss_first_kb = self.rss_first_kb or kb
            self.rss_last_kb = kb
            self.rss_peak_kb = max(self.rss_peak_kb, kb)
            age = time.monotonic() - self.ready_at
            if not self.timeline or age - self.timeline[-1][0] >= TIMELINE_S:
                self.timeline.append((round(age, 1), kb))


@dataclass
class Outage:
    what: str  # "executor-0", "scheduler"
    start: float
    end: float = 0.0


@dataclass
class KvState:
    executor: str
    free_blocks: int
    total_blocks: int
    active_caches: int
    waited_s: float

    @property
    def leaked_blocks(self) -> int:
        return self.total_blocks - self.free_blocks


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ClusterConfig:
    model_dir: Path
    executors: int
    adapter_root: Path
    adapters: dict[str, Path]  # name -> directory (inside adapter_root)
    session_ttl_s: float
    kv_blocks: int
    executor_args: list[str]
    scheduler_args: list[str]
    log_dir: Path
    retry_s: float = 60.0


class Cluster:
    def __init__(self, cfg: ClusterConfig, target: Target, say: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.target = target
        self.say = say
        self.ports = [free_port() for _ in range(cfg.executors)]
        self.instances: list[Instance] = []
        self.outages: list[Outage] = []
        self.executors: list[Instance | None] = [None] * cfg.executors
        self.scheduler: Instance | None = None
        self.loaded: list[set[str]] = [set(cfg.adapters) for _ in range(cfg.executors)]  # per executor
        self._channels: dict[int, grpc.Channel] = {}
        # Torch threads per executor: the cores over executors + 1 (the scheduler and the clients need one);
        # more OpenMP threads than free cores spin against each other (a 2-core machine under load: 30x slower).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.threads = max(1, cores // (cfg.executors + 1))

    # --- starting
    def _launch(self, name: str, module: str, args: list[str]) -> Instance:
        return self._ready(self._spawn(name, module, args))

    def _spawn(self, name: str, module: str, args: list[str]) -> Instance:
        number = sum(1 for i in self.instances if i.name == name)
        log = self.cfg.log_dir / f"{name}.{number}.log"
        server = server_process.start(name, module, *args, log_path=log, own_session=True)
        inst = Instance(name, number, server, 0.0, log)
        self.instances.append(inst)
        return inst

    def _ready(self, inst: Instance) -> Instance:
        try:
            inst.server.wait_ready(300)
        except BaseException:
            inst.server.stop(timeout=5)
            raise
        inst.ready_at = time.monotonic()
        inst.sample_rss()
        return inst

    def _executor_args(self, i: int) -> list[str]:
        threads = [] if "--threads" in self.cfg.executor_args else ["--threads", str(self.threads)]
        preload = [a for name in sorted(self.loaded[i]) for a in ("--adapter", f"{name}={self.cfg.adapters[name]}")]
        return ["--model", str(self.cfg.model_dir), "--port", str(self.ports[i]),
                "--kv-blocks", str(self.cfg.kv_blocks),
                "--session-ttl", str(self.cfg.session_ttl_s), "--adapter-root", str(self.cfg.adapter_root),
                *threads, *preload, *self.cfg.executor_args]

    def _start_executor(self, i: int) -> None:
        self.executors[i] = self._launch(f"executor-{i}", "executor_service", self._executor_args(i))
        self._channels.pop(i, None)

    def _start_scheduler(self) -> None:
        executors = [a for p in self.ports for a in ("--executor", f"127.0.0.1:{p}")]
        inst = self._launch("scheduler", "scheduler",
                            [*executors, "--port", "0", "--http-port", "0", "--executor-retry-s", str(self.cfg.retry_s),
                             *self.cfg.scheduler_args])
        if inst.server.http_url is None:
            raise RuntimeError("the scheduler printed no HTTP URL in its READY line")
        self.scheduler = inst
        self.target.grpc_address = inst.server.address
        self.target.http_url = inst.server.http_url
        self.target.generation += 1  # last: a client that sees the new generation sees the new addresses

    def start(self) -> None:
        """Every executor at once (they load in parallel), then the scheduler."""
        self.say(f"starting {self.cfg.executors} executor(s) on ports {self.ports}")
        for i in range(self.cfg.executors):
            self.executors[i] = self._spawn(f"executor-{i}", "executor_service", self._executor_args(i))
        for inst in self.executors:
            self._ready(inst)
        self.say("starting the scheduler")
        self._start_scheduler()
        self.say(f"scheduler at {self.target.grpc_address} and {self.target.http_url}; logs in {self.cfg.log_dir}")

    # --- chaos
    def kill_executor(self, i: int) -> str:
        old = self.executors[i]
        outage = Outage(f"executor-{i}", time.monotonic())
        self.outages.append(outage)
        self._kill(old)
        self._start_executor(i)
        outage.end = time.monotonic()
        return f"executor-{i} SIGKILLed, back in {outage.end - outage.start:.1f}s"

    def kill_scheduler(self) -> str:
        outage = Outage("scheduler", time.monotonic())
        self.outages.append(outage)
        self._kill(self.scheduler)
        self._start_scheduler()
        outage.end = time.monotonic()
        return f"scheduler SIGKILLed, back in {outage.end - outage.start:.1f}s at {self.target.grpc_address}"

    def _kill(self, inst: Instance) -> None:
        inst.sample_rss()
        inst.server.send_signal(signal.SIGKILL)
        inst.server.stop(timeout=10)  # reaps it (no SIGTERM goes to a dead process) and closes its log
        inst.ended_at, inst.ended_how = time.monotonic(), "SIGKILL"

    def executor_stub(self, i: int) -> epb_grpc.ExecutorServiceStub:
        if i not in self._channels:
            self._channels[i] = grpc.insecure_channel(f"127.0.0.1:{self.ports[i]}")
        return epb_grpc.ExecutorServiceStub(self._channels[i])

    def toggle_adapter(self, name: str, busy_wait_s: float = 20.0) -> str:
        """Unloads `name` from every executor holding it (retrying while caches use it, FAILED_PRECONDITION),
        or, if none holds it, loads it on all. Returns what happened."""
        holders = [i for i in self.lora_executors() if name in self.loaded[i]]
        done = []
        if not holders:
            for i in self.lora_executors():
                self.executor_stub(i).LoadAdapter(epb.LoadAdapterRequest(name=name, path=str(self.cfg.adapters[name])),
                                                  timeout=60)
                self.loaded[i].add(name)
                done.append(i)
            return f"adapter {name} loaded on executor(s) {done}"
        busy = []
        for i in holders:
            deadline = time.monotonic() + busy_wait_s
            while True:
                try:
                    self.executor_stub(i).UnloadAdapter(epb.UnloadAdapterRequest(name=name), timeout=10)
                    self.loaded[i].discard(name)
                    done.append(i)
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise RuntimeError(f"UnloadAdapter({name}) on executor-{i}: {exc.code().name} "
                                           f"{exc.details()}") from exc
                    if time.monotonic() > deadline:
                        busy.append(i)
                        break
                    time.sleep(0.05)
        return f"adapter {name} unloaded from executor(s) {done}" + (f", still in use on {busy}" if busy else "")

    def lora_executors(self) -> list[int]:
        """The executors that take adapters (every one here)."""
        return list(range(self.cfg.executors))

    def kv_names(self) -> list[str]:
        return [f"executor-{i}" for i in range(self.cfg.executors)]

    # --- observing
    def sample_rss(self) -> None:
        for inst in self.live():
            inst.sample_rss()

    def live(self) -> list[Instance]:
        return [i for i in [*self.executors, self.scheduler] if i is not None and i.ended_at is None]

    def dead_processes(self) -> list[str]:
        """Live instances whose process exited without being killed by the soak (a crash)."""
        return [f"{i.name}.{i.number} (exit {i.server.proc.returncode})" for i in self.live()
                if i.server.proc.poll() is not None]

    def kv_after_ttl(self, timeout: float) -> list[KvState]:
        """Waits for every executor to hold no cache and no block (a killed scheduler's session expires after
        the TTL, reaped within 1.25x), up to `timeout`; returns what each holds then."""
        start = time.monotonic()
        states: list[KvState] = []
        for i in range(self.cfg.executors):
            while True:
                kv = self.executor_stub(i).GetInfo(epb.GetInfoRequest(), timeout=10).kv
                waited = time.monotonic() - start
                if (kv.free_blocks == kv.total_blocks and kv.active_caches == 0) or waited > timeout:
                    states.append(KvState(self.kv_names()[i], kv.free_blocks, kv.total_blocks, kv.active_caches,
                                          waited))
                    break
                time.sleep(0.2)
        return states

    def stop(self) -> dict[str, int]:
        """SIGTERM to every live process (drains overlap), then their exit codes."""
        for channel in self._channels.values():
            channel.close()
        live = self.live()
        self.sample_rss()
        for inst in live:
            inst.server.send_signal()
        codes = {}
        for inst in live:
            try:
                codes[f"{inst.name}.{inst.number}"] = inst.server.wait_exit(40)
            except RuntimeError:
                codes[f"{inst.name}.{inst.number}"] = -9
            inst.server.stop()
            inst.ended_at, inst.ended_how = time.monotonic(), "SIGTERM"
        return codes

    def tracebacks(self) -> dict[str, int]:
        """'Traceback' lines per instance log (a process that logged one deserves a look)."""
        out = {}
        for inst in self.instances:
            try:
                n = inst.log.read_text(errors="replace").count("Traceback (most recent call last)")
            except OSError:
                n = 0
            if n:
                out[f"{inst.name}.{inst.number}"] = n
        return out

"""The processes of `scripts/soak --all`: every kind Tandem runs as, together, each on fixed ports so that a
restarted one is found where the others look.

    executors   prefill (--role prefill), decode-0 and decode-1 (--role decode): LoRA adapters, a KV disk tier
                each (--kv-disk-dir, flushed on SIGTERM), KV events on ZMQ; tp (--tensor-parallel-size 2, role
                both: rank 0 starts rank 1 as its child; neither LoRA nor KV tiers, which TP refuses)
    schedulers  s0 and s1, each driving every executor (--executor x4), gRPC + HTTP on fixed ports,
                --stream-stall-timeout-s for slow readers
    routers     smg (gRPC mode, over both schedulers' gRPC ports) and vllm-router (kv_aware, over both HTTP fronts,
                fed by every executor's KV events)

Chaos on any of them (tests/soak/fleet_chaos.py picks): SIGKILL + restart, SIGTERM (drain: an executor's requests
migrate with their KV, a scheduler finishes its streams within --grace) + restart, SIGKILL of the TP worker rank
(rank 0 takes the group down, exit 3) + restart, a disk-tier block file corrupted, adapters unloaded/loaded.
Each action is an outage window from the signal to the replacement's readiness (verdict.py measures stalls
outside them). Started from the main thread only (a server gets SIGTERM when the thread that started it exits).
"""
from __future__ import annotations

import collections
import os
import random
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tests.soak import counters, routers
from tests.soak.clients import Target
from tests.soak.cluster import Cluster, ClusterConfig, Instance, Outage

_PORTS = random.SystemRandom()


def fixed_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999): a process restarted on it must not find it taken
    by one of the many outgoing connections the soak makes meanwhile (which take ephemeral ports)."""
    while True:
        port = _PORTS.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


MODEL_NAME = "tiny"  # the schedulers' --served-model-name: what the routers route by
TP_EXIT_GROUP_DOWN = 3  # rank 0's exit code when a rank is lost (executor_service/tp)


@dataclass
class ExecutorSpec:
    name: str
    role: str
    tp: int = 1
    port: int = field(default_factory=fixed_port)
    pub: int = field(default_factory=fixed_port)
    rep: int = field(default_factory=fixed_port)
    metrics: int = field(default_factory=fixed_port)

    @property
    def lora(self) -> bool:
        return self.tp == 1  # tensor parallelism refuses LoRA adapters


@dataclass
class FleetConfig:
    """What --all runs (the --no-* flags take parts out)."""
    tp: bool = True
    roles: bool = True
    tiers: bool = True
    smg: bool = True
    vllm_router: bool = True
    stall_timeout_s: float = 5.0
    grace_s: float = 10.0
    kv_disk_gb: float = 0.02
    drain_timeout_s: float = 60.0


class Fleet(Cluster):
    def __init__(self, cfg: ClusterConfig, fleet: FleetConfig, target: Target, say: Callable[[str], None]) -> None:
        both = "prefill" if fleet.roles else "both"
        specs = [ExecutorSpec("prefill", both), ExecutorSpec("decode-0", "decode" if fleet.roles else "both"),
                 ExecutorSpec("decode-1", "decode" if fleet.roles else "both")]
        if fleet.tp:
            specs.append(ExecutorSpec("tp", "both", tp=2))
        cfg.executors = len(specs)
        super().__init__(cfg, target, say)
        self.fleet = fleet
        self.specs = specs
        self.ports = [s.port for s in specs]
        self.loaded = [set(cfg.adapters) if s.lora else set() for s in specs]
        self.threads = 1  # 1 OpenMP thread per process: a 2-core machine runs 5 torch processes here
        self.sched_ports = [(fixed_port(), fixed_port()) for _ in range(2)]  # (gRPC, HTTP) per scheduler
        self.schedulers: list[Instance | None] = [None, None]
        self.router_ports = {"smg": (fixed_port(), fixed_port()), "vllm-router": (fixed_port(), fixed_port())}
        self.routers: dict[str, Instance | None] = {}
        self.tp_workers: dict[int, Instance] = {}  # executor index -> its TP worker rank (RSS only)
        if fleet.smg:
            self.routers["smg"] = None
        if fleet.vllm_router:
            self.routers["vllm-router"] = None
        self.counters: collections.Counter = collections.Counter()  # tests/soak/counters.py, over every instance
        self.tp_exits: list[int] = []  # rank 0's exit codes after its worker was SIGKILLed (3: the group is down)
        self.term_exits: dict[str, int] = {}  # instance -> exit code after a chaos SIGTERM (0: drained cleanly)
        for k, (g, h) in enumerate(self.sched_ports):
            target.grpc_of[f"s{k}"], target.http_of[f"s{k}"] = f"127.0.0.1:{g}", f"http://127.0.0.1:{h}"
        target.http_of["smg"] = f"http://127.0.0.1:{self.router_ports['smg'][0]}"
        target.http_of["vr"] = f"http://127.0.0.1:{self.router_ports['vllm-router'][0]}"

    # --- names
    def executor_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def lora_executors(self) -> list[int]:
        return [i for i, s in enumerate(self.specs) if s.lora]

    def disk_dir(self, i: int) -> Path:
        return self.cfg.log_dir / "kv-disk" / self.specs[i].name

    # --- starting
    def _executor_args(self, i: int) -> list[str]:
        s = self.specs[i]
        args = ["--model", str(self.cfg.model_dir), "--port", str(s.port), "--kv-blocks", str(self.cfg.kv_blocks),
                "--session-ttl", str(self.cfg.session_ttl_s), "--role", s.role,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{s.pub}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{s.rep}", "--metrics-port", str(s.metrics)]
        if "--threads" not in self.cfg.executor_args:
            args += ["--threads", "1"]
        if s.lora:
            args += ["--adapter-root", str(self.cfg.adapter_root)]
            args += [a for name in sorted(self.loaded[i]) for a in ("--adapter", f"{name}={self.cfg.adapters[name]}")]
        if s.tp > 1:
            args += ["--tensor-parallel-size", str(s.tp), "--tp-timeout", "10"]
        if self.fleet.tiers and s.tp == 1:  # (TP refuses tiers: they would hold rank 0's KV heads only)
            args += ["--kv-disk-dir", str(self.disk_dir(i)), "--kv-disk-gb", str(self.fleet.kv_disk_gb),
                     "--kv-disk-flush-s", "2"]
        return [*args, *self.cfg.executor_args]

    def _start_executor(self, i: int) -> None:
        self.executors[i] = self._launch(self.specs[i].name, "executor_service", self._executor_args(i))
        self._channels.pop(i, None)
        self._track_tp_worker(i)

    def _track_tp_worker(self, i: int) -> None:
        """The TP worker rank is rank 0's child, not a process the soak starts: an instance of its own in the
        RSS table (it ends with rank 0)."""
        rank0 = self.executors[i]
        if self.specs[i].tp == 1 or rank0 is None:
            return
        for pid in _children(rank0.server.proc.pid):
            number = sum(1 for x in self.instances if x.name == "tp-rank1")
            worker = Instance("tp-rank1", number, _Child(pid), rank0.ready_at,
                              rank0.log.with_suffix(".rank1"))  # type: ignore[arg-type]
            worker.sample_rss()
            self.instances.append(worker)
            self.tp_workers[i] = worker

    def _scheduler_args(self, k: int) -> list[str]:
        g, h = self.sched_ports[k]
        return [*(a for s in self.specs for a in ("--executor", f"127.0.0.1:{s.port}")),
                "--port", str(g), "--http-port", str(h), "--served-model-name", MODEL_NAME,
                "--executor-retry-s", str(self.cfg.retry_s), "--grace", str(self.fleet.grace_s),
                "--stream-stall-timeout-s", str(self.fleet.stall_timeout_s), *self.cfg.scheduler_args]

    def _start_scheduler_k(self, k: int, spawn_only: bool = False) -> Instance:
        inst = self._spawn(f"scheduler-{k}", "scheduler", self._scheduler_args(k))
        self.schedulers[k] = inst
        if not spawn_only:
            self._ready(inst)
            self.target.generations[f"s{k}"] = self.target.generations.get(f"s{k}", 0) + 1
        return inst

    def _start_router(self, name: str) -> Instance:
        port, metrics = self.router_ports[name]
        number = sum(1 for i in self.instances if i.name == name)
        log = self.cfg.log_dir / f"{name}.{number}.log"
        if name == "smg":
            exe = routers.binary("smg")
            args = routers.smg_args(exe, port, metrics, [f"127.0.0.1:{g}" for g, _ in self.sched_ports],
                                    self.cfg.model_dir)
            proc = routers.RouterProcess(name, args, log, f"http://127.0.0.1:{port}/workers",
                                         {"HF_HUB_OFFLINE": "1"}, workers=2)
        else:
            exe = routers.binary("vllm-router")
            events = [(f"tcp://127.0.0.1:{s.pub}", f"tcp://127.0.0.1:{s.rep}") for s in self.specs]
            args = routers.vllm_router_args(exe, port, metrics, [f"http://127.0.0.1:{h}" for _, h in self.sched_ports],
                                            events, MODEL_NAME)
            proc = routers.RouterProcess(name, args, log, f"http://127.0.0.1:{port}/health",
                                         {"VLLM_ROUTER_TOKENIZER": str(self.cfg.model_dir)})
        inst = Instance(name, number, proc, 0.0, log)  # type: ignore[arg-type]  (a ServerProcess's parts)
        self.instances.append(inst)
        self.routers[name] = inst
        return self._ready(inst)

    def start(self) -> None:
        missing = [n for n, exe in (("smg", "smg"), ("vllm-router", "vllm-router")) if n in self.routers
                   and routers.binary(exe) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed (the test extra; or run with --no-routers)")
        self.say(f"starting executors {self.executor_names()} on ports {self.ports}")
        for i in range(len(self.specs)):
            self.executors[i] = self._spawn(self.specs[i].name, "executor_service", self._executor_args(i))
        for i, inst in enumerate(self.executors):
            self._ready(inst)
            self._track_tp_worker(i)
        self.say("starting schedulers s0 and s1")
        for k in range(2):
            self._start_scheduler_k(k, spawn_only=True)
        for k in range(2):
            self._ready(self.schedulers[k])
            self.target.generations[f"s{k}"] = 1
        self.scheduler = self.schedulers[0]  # (Cluster's progress line shows its RSS)
        self.target.grpc_address, self.target.http_url = self.target.grpc_of["s0"], self.target.http_of["s0"]
        for name in self.routers:
            self.say(f"starting {name}")
            self._start_router(name)
        self.say(f"fleet up; logs in {self.cfg.log_dir}")

    # --- chaos (each returns what it did)
    def signal_executor(self, i: int, sig: int) -> str:
        name = self.specs[i].name
        outage = Outage(name, time.monotonic())
        self.outages.append(outage)
        how = self._end(self.executors[i], sig)
        self._start_executor(i)
        outage.end = time.monotonic()
        return f"{name} {how}, back in {outage.end - outage.start:.1f}s"

    def signal_scheduler(self, k: int, sig: int) -> str:
        outage = Outage(f"scheduler-{k}", time.monotonic())
        self.outages.append(outage)
        how = self._end(self.schedulers[k], sig)
        self._start_scheduler_k(k)
        if k == 0:
            self.scheduler = self.schedulers[0]
        outage.end = time.monotonic()
        return f"scheduler-{k} {how}, back in {outage.end - outage.start:.1f}s"

    def signal_router(self, name: str, sig: int) -> str:
        outage = Outage(name, time.monotonic())
        self.outages.append(outage)
        how = self._end(self.routers[name], sig)
        self._start_router(name)
        outage.end = time.monotonic()
        return f"{name} {how}, back in {outage.end - outage.start:.1f}s"

    def kill_tp_rank(self) -> str:
        """SIGKILL the TP executor's worker rank (rank 0's child): rank 0 must take the group down (exit 3) and
        the schedulers recompute its requests elsewhere; then the executor is started again."""
        i = next(i for i, s in enumerate(self.specs) if s.tp > 1)
        inst = self.executors[i]
        outage = Outage("tp", time.monotonic())
        self.outages.append(outage)
        self._count(inst)
        inst.sample_rss()
        self._end_tp_worker(inst, "SIGKILL")
        children = _children(inst.server.proc.pid)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        try:
            code = inst.server.wait_exit(30)
        except RuntimeError:
            code = -9
        inst.server.stop(timeout=5)
        inst.ended_at, inst.ended_how = time.monotonic(), "rank 1 SIGKILLed"
        self._start_executor(i)
        outage.end = time.monotonic()
        note = "" if code == TP_EXIT_GROUP_DOWN else f" (rank 0 exited {code}, not {TP_EXIT_GROUP_DOWN}: see its log)"
        self.tp_exits.append(code)
        return (f"tp rank 1 (pid {children}) SIGKILLed, rank 0 exit {code}{note}, "
                f"back in {outage.end - outage.start:.1f}s")

    def corrupt_disk_block(self, rng: random.Random) -> str:
        """Overwrite 64 bytes in the middle of a random block file of the disk tier of an executor that runs
        prompts (a decode executor's tier holds blocks no prompt looks up), else of any (the CRC must catch it
        when the block is read back: ignored, counted, deleted, the prompt recomputed)."""
        prompts = [i for i, s in enumerate(self.specs) if s.role in ("prefill", "both")]
        files = [(i, f) for i in prompts for f in self.disk_dir(i).glob("*/*.kvb")]
        files = files or [(i, f) for i in range(len(self.specs)) for f in self.disk_dir(i).glob("*/*.kvb")]
        if not files:
            return "no disk-tier block file yet: nothing corrupted"
        i, path = rng.choice(files)
        try:
            size = path.stat().st_size
            with open(path, "r+b") as f:
                f.seek(max(0, size // 2 - 32))
                f.write(os.urandom(64))
        except OSError as exc:  # written over or evicted meanwhile
            return f"could not corrupt {path.name} of {self.specs[i].name}: {exc.strerror}"
        return f"disk block {path.name[:12]}... of {self.specs[i].name} corrupted ({len(files)} files in the tiers)"

    def _end_tp_worker(self, rank0: Instance, how: str) -> None:
        for worker in self.tp_workers.values():
            if worker.ended_at is None and worker.ready_at == rank0.ready_at:
                worker.ended_at, worker.ended_how = time.monotonic(), how

    def _count(self, inst: Instance | None) -> None:
        """Adds the counters of a process instance about to be signalled (tests/soak/counters.py)."""
        if inst is None or inst.ended_at is not None:
            return
        for i, s in enumerate(self.specs):
            if inst is self.executors[i]:
                self.counters.update(counters.scrape(f"http://127.0.0.1:{s.metrics}/metrics", counters.EXECUTOR))
        for k, (_, http) in enumerate(self.sched_ports):
            if inst is self.schedulers[k]:
                self.counters.update(counters.scrape(f"http://127.0.0.1:{http}/metrics", counters.SCHEDULER))

    def _end(self, inst: Instance, sig: int) -> str:
        """SIGKILL (reaped at once) or SIGTERM (waits for the drain, up to drain_timeout_s); what happened."""
        self._count(inst)
        inst.sample_rss()
        for worker in self.tp_workers.values():
            worker.sample_rss()
        self._end_tp_worker(inst, "with rank 0")
        if sig == signal.SIGKILL:
            inst.server.send_signal(signal.SIGKILL)
            inst.server.stop(timeout=10)
            inst.ended_at, inst.ended_how = time.monotonic(), "SIGKILL"
            return "SIGKILLed"
        t = time.monotonic()
        inst.server.send_signal(signal.SIGTERM)
        try:
            code = inst.server.wait_exit(self.fleet.drain_timeout_s)
        except RuntimeError:
            code = -9
        inst.server.stop(timeout=5)
        inst.ended_at, inst.ended_how = time.monotonic(), f"SIGTERM (exit {code})"
        self.term_exits[f"{inst.name}.{inst.number}"] = code
        return f"SIGTERMed, drained and exited {code} in {time.monotonic() - t:.1f}s"

    # --- observing
    def live(self) -> list[Instance]:
        return [i for i in [*self.executors, *self.schedulers, *self.routers.values()]
                if i is not None and i.ended_at is None]

    def sample_rss(self) -> None:
        for inst in [*self.live(), *(w for w in self.tp_workers.values() if w.ended_at is None)]:
            inst.sample_rss()

    def stop(self) -> dict[str, int]:
        for inst in self.live():
            self._count(inst)
        codes = super().stop()
        for worker in self.tp_workers.values():
            if worker.ended_at is None:
                worker.ended_at, worker.ended_how = time.monotonic(), "with rank 0"
        return codes

    def kv_names(self) -> list[str]:
        return self.executor_names()


class _Child:
    """The parts of a ServerProcess that Instance.sample_rss reads, for a process the soak did not start."""

    class _Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def poll(self) -> int | None:
            return None if Path(f"/proc/{self.pid}").exists() else 0

    def __init__(self, pid: int) -> None:
        self.proc = self._Proc(pid)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []

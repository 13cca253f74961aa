"""Executors sharing a host: an idle executor sleeps (its CPU time from /proc over a few seconds, after
decode steps have started its OpenMP team), and `--cpu-cores` puts every thread of the process on the cores
listed (executor_service/cpu_cores.py). Real executor processes on the tiny model.

The control: the same executor with OMP_WAIT_POLICY=ACTIVE (its team spins between regions for good) does
show up in the measurement, so a busy-waiting executor would fail the first test."""
from __future__ import annotations

import argparse

import os
import subprocess
import sys
import time

import pytest

from executor_service.cpu_cores import parse_cores, share_with_local_ranks
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for

TICK = os.sysconf("SC_CLK_TCK")
IDLE_WINDOW_S = 3.0
IDLE_LIMIT = 0.05  # of one core


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def runnable(pid: int) -> bool:
    """Whether any thread of the process is running or waiting for a core (state R) right now."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0] == "R":
                return True
        except FileNotFoundError:  # the thread ended
            pass
    return False


def idle_share(pid: int) -> tuple[float, float]:
    """Over IDLE_WINDOW_S: the share of one core the process used, and the share of 100 samples in which one
    of its threads was runnable. (The second does not depend on how loaded the machine is: a spinning thread
    is runnable whether or not it gets a core, a sleeping one never is.)"""
    c0, t0, hits = cpu_seconds(pid), time.monotonic(), 0
    for _ in range(100):
        hits += runnable(pid)
        time.sleep(IDLE_WINDOW_S / 100)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0), hits / 100


def decode_some(server, steps: int = 6) -> None:
    """A prompt and a few decode steps (the model thread's OpenMP team starts and works), then the release."""
    r = server.stub.Prefill(pb.PrefillRequest(token_ids=list(range(3, 40))))
    cache, token = r.cache, r.output.tokens[0].token_id
    for _ in range(steps):
        (d,) = server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=cache, token_id=token)])).results
        cache, token = d.cache, d.output.tokens[0].token_id
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache.cache_id]))


@pytest.mark.serial  # a loaded machine keeps an idle process's brief wake-ups runnable for longer
def test_an_idle_executor_uses_almost_no_cpu(request, model_dir, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # libgomp's default, as served (tests/conftest.py sets it)
    server = start_for(request, model_dir, "--threads", "2", "--kv-blocks", "32")
    decode_some(server)
    time.sleep(0.3)  # the team's spin after the last step ends well within this
    share, busy = idle_share(server.proc.pid)
    assert share < IDLE_LIMIT and busy < IDLE_LIMIT, f"an idle executor used {share:.1%} of a core, runnable {busy:.0%}"


@pytest.mark.serial
def test_a_spinning_team_would_be_seen(request, model_dir, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the server inherits it: its workers never sleep
    server = start_for(request, model_dir, "--threads", "2", "--kv-blocks", "32")
    decode_some(server)
    time.sleep(0.3)
    share, busy = idle_share(server.proc.pid)
    assert busy > 0.5, f"a spinning executor: {share:.1%} of a core, runnable {busy:.0%}"


def test_cpu_cores_pins_every_thread(request, model_dir):
    core = min(os.sched_getaffinity(0))
    server = start_for(request, model_dir, "--cpu-cores", str(core), "--kv-blocks", "32")
    decode_some(server)  # the model thread and any OpenMP workers exist now
    pid = server.proc.pid
    tasks = os.listdir(f"/proc/{pid}/task")
    assert len(tasks) > 3
    for tid in tasks:
        assert os.sched_getaffinity(int(tid)) == {core}, f"thread {tid} may run elsewhere"


def test_a_core_the_process_may_not_use_exits_2(model_dir):
    done = subprocess.run([sys.executable, "-m", "executor_service", "--model", str(model_dir), "--port", "0",
                           "--cpu-cores", "100000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "core(s) 100000 are not available to this process" in done.stderr, done.stderr


def test_parse_cores():
    assert parse_cores("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cores("5, 1-2,2") == (1, 2, 5)
    for bad, message in (("3-1", "runs backwards"), ("0,a", "wants core numbers"), ("", "wants core numbers")):
        with pytest.raises(ValueError, match=message):
            parse_cores(bad)


def test_tensor_parallel_ranks_started_here_share_the_cores():
    def args(cores: str | None, size: int, **kw) -> argparse.Namespace:
        return argparse.Namespace(cpu_cores=cores, tensor_parallel_size=size, tp_master=kw.get("master"),
                                  tp_store=kw.get("store"))
    a = args("0-3", 3)
    assert share_with_local_ranks(a) == ["0", "1", "2-3"] and a.cpu_cores == "0"
    assert share_with_local_ranks(args("0-3", 1)) is None  # no TP
    assert share_with_local_ranks(args("0-3", 2, master="10.0.0.1:29500")) is None  # ranks on other machines
    assert share_with_local_ranks(args("2-3", 2, store="/tmp/x")) is None  # a worker: rank 0 gave it its slice
    assert share_with_local_ranks(args(None, 2)) is None
    with pytest.raises(ValueError, match="lists 1 core\\(s\\) for 2 tensor-parallel ranks"):
        share_with_local_ranks(args("0", 2))

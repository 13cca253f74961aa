"""The routers of `scripts/soak --all`, as processes the soak starts, kills and restarts on their own ports:
SGLang's gateway smg (`smg launch`, gRPC mode: it speaks vLLM's engine protocol to each scheduler's gRPC port) and
vllm-router (`--policy kv_aware`: it proxies HTTP to each scheduler's HTTP front and routes by the KV events the
executors publish on ZMQ). Both come from the test extra (smg==1.13.0, vllm-router==0.1.17); the flags are those
of tests/e2e/test_smg_grpc.py and tests/e2e/test_vllm_router_kv_aware.py.

RouterProcess has the parts of tandem.server_process.ServerProcess the soak's Instance uses (proc, send_signal,
wait_ready, wait_exit, stop), so a router is one more process instance in the report (RSS, outages, exit codes).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

BLOCK_SIZE = 16  # the executors' KV block size (vllm-router hashes the blocks' token ids itself)


def binary(name: str) -> str | None:
    """The router's executable: beside this interpreter (the venv's test extra), else on PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


class RouterProcess:
    """A router subprocess with its log in a file; ready once `ready_url` answers 200 (and, for smg, every
    worker is registered and healthy, read from /workers)."""

    def __init__(self, name: str, args: list[str], log_path: Path, ready_url: str, env: dict[str, str],
                 workers: int = 0) -> None:
        self.name = name
        self.args = args
        self.ready_url = ready_url
        self.workers = workers
        self.returncode: int | None = None
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "NO_COLOR": "1", **env}, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready; "
                                   f"log: {self.log_path}")
            try:
                r = httpx.get(self.ready_url, timeout=2)
                if r.status_code == 200 and (not self.workers or
                                             sum(w.get("is_healthy", False) for w in r.json()["workers"]) >= 1):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready within {timeout:.0f}s; log: {self.log_path}")
            time.sleep(0.2)

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise RuntimeError(f"{self.name} did not exit within {timeout:.0f}s of SIGTERM (killed)")
        return self.returncode

    def stop(self, timeout: float = 20.0) -> int:
        try:
            if self.returncode is None:
                self.send_signal(signal.SIGTERM)
                self.wait_exit(timeout)
            return self.returncode if self.returncode is not None else -9
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self._log.close()


def smg_args(exe: str, port: int, metrics_port: int, scheduler_grpc: list[str], model_dir: Path) -> list[str]:
    """smg in gRPC mode over the schedulers, round robin (cache-aware routing is tested in tests/e2e); a lost
    worker is noticed within a second or two and taken back after one good probe."""
    return [exe, "launch", "--worker-urls", *(f"grpc://{a}" for a in scheduler_grpc), "--model-path", str(model_dir),
            "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
            "--health-failure-threshold", "1", "--health-success-threshold", "1", "--log-level", "info",
            "--shutdown-grace-period-secs", "2"]


def vllm_router_args(exe: str, port: int, metrics_port: int, scheduler_http: list[str],
                     events: list[tuple[str, str]], model: str) -> list[str]:
    """vllm-router kv_aware over the schedulers' HTTP fronts. Both schedulers drive every executor, so each
    worker's event sources are every executor's publisher (and replay socket): events = [(pub, rep), ...]."""
    args = [exe, "--policy", "kv_aware", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port), "--log-level", "info", "--worker-urls", *scheduler_http]
    pubs = ",".join(p for p, _ in events)
    reps = ",".join(r for _, r in events)
    for url in scheduler_http:
        if pubs:
            args += ["--kv-event-source", f"{url}={pubs}", "--kv-event-replay-source", f"{url}={reps}"]
    return args + ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]

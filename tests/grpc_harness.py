"""Real servers as subprocesses for gRPC tests: the executor (`python -m executor_service`) and the
scheduler (`python -m scheduler`), started by tandem/server_process.py (READY-line wait, no sleeps).

    with start_executor(model_dir, "--kv-blocks", "64") as server:
        server.stub.GetInfo(pb.GetInfoRequest())

close() sends SIGTERM, waits for the drain (SIGKILL after 20 s) and asserts exit code 0. Tests use them
through fixtures whose finalizers always call close().
"""
from __future__ import annotations

from pathlib import Path

import grpc

from tandem import server_process
from tandem.executor.v1 import executor_pb2_grpc
from tandem.generate.v1 import generate_pb2_grpc


class GrpcServer:
    """A started server process with a channel and a stub: .address, .channel, .stub, .proc. credentials: a
    TLS server's channel credentials (the channel is then a TLS one)."""

    def __init__(self, process: server_process.ServerProcess, stub_class: type,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.process = process
        self.proc = process.proc
        self.address = process.address
        self.channel = grpc.insecure_channel(self.address) if credentials is None \
            else grpc.secure_channel(self.address, credentials)
        grpc.channel_ready_future(self.channel).result(timeout=30)  # READY means listening: connects at once
        self.stub = stub_class(self.channel)
        self._closed = False

    def send_sigterm(self) -> None:
        self.process.send_signal()

    def wait_exit(self) -> int:
        return self.process.wait_exit()

    def stderr(self) -> str:
        return self.process.log()

    def close(self) -> None:
        """SIGTERM, wait for the drain, assert exit code 0. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        code = self.process.stop()
        assert code == 0, f"{self.process.name} exited with code {code} after SIGTERM; log:\n{self.stderr()}"

    def __enter__(self) -> "GrpcServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_executor(model_dir: Path | str, *extra_args: str,
                   credentials: grpc.ChannelCredentials | None = None, source_root: Path | None = None) -> GrpcServer:
    """`python -m executor_service --model DIR --port 0 *extra_args`, returned once READY. On the CPU unless the
    arguments name a --device: the suite compares with in-process CPU references (tests/executor_driver.py), and
    on a machine with a GPU the executor's default (`auto`) would put it on CUDA in bfloat16; the CUDA checks are
    the tests marked `cuda` (scripts/gpu_check). source_root: another release's source tree to run
    (tests/contract/previous_release.py)."""
    if not any(a == "--device" or a.startswith("--device=") for a in extra_args):
        extra_args = (*extra_args, "--device", "cpu")
    return GrpcServer(server_process.launch_executor(model_dir, *extra_args, source_root=source_root),
                      executor_pb2_grpc.ExecutorServiceStub, credentials)


def start_scheduler(executor_address: str, *extra_args: str,
                    credentials: grpc.ChannelCredentials | None = None, source_root: Path | None = None) -> GrpcServer:
    """`python -m scheduler --executor ADDR --port 0 *extra_args`, returned once READY (source_root: as
    start_executor's)."""
    return GrpcServer(server_process.launch_scheduler(executor_address, *extra_args, source_root=source_root),
                      generate_pb2_grpc.GenerateServiceStub, credentials)


def start_for(request, model_dir: Path | str, *extra_args: str,
              credentials: grpc.ChannelCredentials | None = None) -> GrpcServer:
    """start_executor for a pytest fixture: the server is closed by a finalizer of `request`, whatever
    happens in the tests that use it (and the finalizer's exit-code assertion reports a bad shutdown)."""
    server = start_executor(model_dir, *extra_args, credentials=credentials)
    request.addfinalizer(server.close)
    return server


def start_scheduler_for(request, executor_address: str, *extra_args: str,
                        credentials: grpc.ChannelCredentials | None = None) -> GrpcServer:
    server = start_scheduler(executor_address, *extra_args, credentials=credentials)
    request.addfinalizer(server.close)
    return server

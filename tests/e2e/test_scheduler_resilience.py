"""The executor going away under the scheduler for longer than --executor-retry-s: in-flight streams pause,
then end UNAVAILABLE once the window has passed; new requests are then UNAVAILABLE at once and health is
NOT_SERVING while it is gone; the scheduler serves again once an executor is back on the same address. (An
executor back within the window: test_scheduler_recovery.py.) Also: SIGTERM lets running requests finish."""
from __future__ import annotations

import signal
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.generate.v1 import generate_pb2 as pb
from tests.grpc_harness import start_executor, start_scheduler
from tests.scheduler_client import collect, ids_request, rpc_error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(channel, want, timeout: float = 60.0) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        status = stub.Check(health_pb2.HealthCheckRequest(service="")).status
        if status == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"health stayed {status}, expected {want}")
        time.sleep(0.05)


def test_executor_loss_past_the_retry_window_and_reconnect(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    port = _free_port()
    executor = start_executor(model, "--port", str(port), "--kv-blocks", "64")
    scheduler = start_scheduler(executor.address, "--executor-retry-s", "1")
    try:
        long = ids_request([1, 7, 8, 9], 240, stopping=pb.StoppingCriteria(max_new_tokens=240, ignore_eos=True))
        call = scheduler.stub.Generate(long)
        next(call)
        executor.process.kill()  # SIGKILL: no goodbye
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "did not serve again within 1 s (--executor-retry-s)" in err.value.details()
        _wait_health(scheduler.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
        refused = rpc_error(lambda: list(scheduler.stub.Generate(ids_request([1, 5], 4))))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "did not serve again" in refused.details()

        executor = start_executor(model, "--port", str(port), "--kv-blocks", "64")
        _wait_health(scheduler.channel, health_pb2.HealthCheckResponse.SERVING)
        got = collect(scheduler.stub, ids_request([1, 5, 6], 5, stopping=pb.StoppingCriteria(max_new_tokens=5,
                                                                                               ignore_eos=True)))
        assert got.usage.completion_tokens == 5
    finally:
        scheduler.close()
        executor.close()


def test_sigterm_lets_running_requests_finish(tiny_checkpoint):
    executor = start_executor(tiny_checkpoint("llama"), "--kv-blocks", "64")
    scheduler = start_scheduler(executor.address)
    try:
        call = scheduler.stub.Generate(ids_request([1, 7, 8], 60, stopping=pb.StoppingCriteria(max_new_tokens=60,
                                                                                              ignore_eos=True)))
        first = next(call)
        scheduler.process.send_signal(signal.SIGTERM)
        rest = list(call)
        tokens = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and tokens == 60
        assert scheduler.process.wait_exit() == 0
    finally:
        scheduler.close()
        executor.close()

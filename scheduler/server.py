"""The scheduler's gRPC server (asyncio): GenerateService + grpc.health.v1 + reflection, readiness, drain."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from tandem.grpc_setup import add_health_reflection_and_ports
from tandem.errors import CheckpointError, RemoteError
from tandem.generate.v1 import generate_pb2, generate_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.executor_client import ExecutorUnreachable, GrpcExecutorClient
from scheduler.interceptor import ErrorMappingInterceptor
from scheduler.servicer import GenerateServicer
from scheduler.tokenizer import ModelTokenizer

log = logging.getLogger("tandem.scheduler")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


async def _wait_for_executor(client: GrpcExecutorClient, cfg: SchedulerConfig):
    """GetInfo until the executor serves (it may still be loading its model, or be slow to answer)."""
    deadline = time.monotonic() + cfg.connect_timeout_s
    last_note = 0.0
    while True:
        try:
            return await client.info()
        except RemoteError as exc:
            if exc.status_name != "DEADLINE_EXCEEDED":  # an answer: not an executor we can use
                raise
            error: Exception = exc
        except ExecutorUnreachable as exc:
            error = exc
        now = time.monotonic()
        if now >= deadline:
            raise ExecutorUnreachable(f"executor {cfg.executor} did not serve within "
                                      f"{cfg.connect_timeout_s:.0f}s: {error}") from error
        if now - last_note >= 10:
            log.info("waiting for executor %s to serve...", cfg.executor)
            last_note = now
        await asyncio.sleep(min(cfg.reconnect_interval_s, 0.5))


async def serve_async(cfg: SchedulerConfig) -> int:
    client = GrpcExecutorClient(cfg.executor, max_message_mb=max(cfg.max_message_mb, 64))
    info = await _wait_for_executor(client, cfg)
    tokenizer_dir = Path(cfg.tokenizer or info.model_dir)
    tokenizer = ModelTokenizer(tokenizer_dir)
    if tokenizer.vocab_size > info.vocab_size:
        raise CheckpointError(f"tokenizer at {tokenizer_dir} has {tokenizer.vocab_size} tokens but the executor's "
                              f"model only {info.vocab_size}: pass the model's own tokenizer with --tokenizer")

    health_servicer = health.aio.HealthServicer()

    async def set_health(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    loop = asyncio.get_running_loop()
    limit = cfg.max_message_mb * 1024 * 1024
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()],
                             options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0)])
    addresses = add_health_reflection_and_ports(server, health_servicer, SERVICE_NAME, cfg.host, cfg.port, cfg.uds)
    engine = Engine(cfg, client, tokenizer, info, on_health=lambda up: loop.create_task(set_health(up)),
                    client_name=f"tandem-scheduler {addresses[0]}")
    # Tokenizing and chat templating run here, off the event loop (`tokenizers` releases the GIL).
    workers = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="tokenize")
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(engine, workers), server)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await engine.start()  # the session; if the executor is already gone, the engine reconnects
    await set_health(engine.up)
    engine_task = loop.create_task(engine.run(), name="engine")
    log.info("serving %s (%s) from executor %s on %s; tokenizer %s; budget %d tokens/step, max %d running",
             info.model_id, info.architecture, cfg.executor, ", ".join(addresses), tokenizer_dir,
             engine.planner.max_batch_tokens, cfg.max_running)
    print(f"READY {' '.join(addresses)}", flush=True)  # a line scripts can wait for

    stop_wait = loop.create_task(stop.wait())
    done, _ = await asyncio.wait({stop_wait, engine_task}, return_when=asyncio.FIRST_COMPLETED)
    code, grace_s = 0, cfg.grace_s
    if engine_task in done:  # the loop died (a bug): end every stream, free what we hold, exit non-zero
        stop_wait.cancel()
        log.error("the scheduling loop failed; shutting down", exc_info=engine_task.exception())
        code, grace_s = 1, 0.0
    log.info("shutting down: running requests get up to %.0fs to finish", grace_s)
    await set_health(False)
    await engine.drain(grace_s)
    await server.stop(5.0)
    engine_task.cancel()
    workers.shutdown(wait=False, cancel_futures=True)
    await client.close()
    log.info("stopped")
    return code

"""The executor's gRPC server: ExecutorService + grpc.health.v1 + reflection, readiness, the lease reaper,
clean shutdown."""
from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.kv.events.endpoint import ZmqKvConfig
from executor_service.kv.sizing import describe
from executor_service.kv.tiers.flush import flush_to_disk
from executor_service.metrics.prometheus import ExecutorExporter
from executor_service.rpc.auth_scopes import scope_of
from executor_service.metrics.op_stats import RpcMetrics
from executor_service.rpc.interceptor import ErrorMappingInterceptor
from executor_service.malloc_tuning import DEFAULT_ARENA_MAX, DEFAULT_TRIM_S, IdleTrim, set_arena_max
from executor_service.model_thread import DEFAULT_MAX_QUEUED, ModelThread
from executor_service.rpc.servicer import ExecutorServicer
from executor_service.sessions import LeaseReaper, check_ttl
from executor_service.types import PoolingOptions, PoolingTask, UnifiedItem
from executor_service.kv.events.zmq_publisher import open_publisher
from tandem.executor.v1 import executor_pb2, executor_pb2_grpc
from tandem.grpc_setup import add_health_reflection_and_ports
from tandem.security.config import ServerSecurity
from tandem.security.grpc_auth import AuthInterceptor
from tandem.security.guard import ServerGuard

log = logging.getLogger("tandem.executor")
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 50051  # 0 = any free port (printed when ready)
    uds: str | None = None  # also (or only, with port -1) listen on this Unix socket path
    max_message_mb: int = 64  # request and response size limit: logits of 64 rows x 152k vocab fit
    # RPC threads kept for calls that do not run the model (info, health, listings, release, sessions); the
    # pool also has one thread per model call allowed in flight (running + queued), so however many model
    # calls are waiting, these calls always find a free thread.
    workers: int = 16
    max_queued_calls: int = DEFAULT_MAX_QUEUED  # model calls that may wait behind the running one
    grace_s: float = 30.0  # on SIGTERM/SIGINT: time in-flight RPCs get to finish
    threads: int | None = None  # torch CPU threads of the model thread (None: torch's default)
    metrics_port: int | None = None  # Prometheus GET /metrics on host:this (0 = any free port); None = none
    security: ServerSecurity = ServerSecurity()  # TLS, tokens, reflection, --insecure (README: Security)
    kv_events_zmq: ZmqKvConfig | None = None  # KV events on ZMQ in vLLM's format; None = off
    malloc_arena_max: int = DEFAULT_ARENA_MAX  # glibc malloc arenas (0 = glibc's default, 8 per core)
    malloc_trim_s: float = DEFAULT_TRIM_S  # free heap pages handed back when the model thread idles; 0 = never


def build_server(cfg: ServerConfig, servicer: ExecutorServicer, metrics: RpcMetrics,
                 health_servicer: health.HealthServicer, guard: ServerGuard,
                 streams: int = 0) -> tuple[grpc.Server, list[str]]:
    """streams: long-lived server streams (KV event subscriptions), each holding a thread of its own."""
    limit = cfg.max_message_mb * 1024 * 1024
    threads = cfg.workers + cfg.max_queued_calls + 1 + streams
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
        # Tokens first: a refused call is not timed, mapped or run.
        interceptors=[AuthInterceptor(guard.authenticator, scope_of, cfg.security.auth_health),
                      ErrorMappingInterceptor(metrics)],
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit),
                 ("grpc.so_reuseport", 0)])
    executor_pb2_grpc.add_ExecutorServiceServicer_to_server(servicer, server)
    return server, add_health_reflection_and_ports(server, health_servicer, SERVICE_NAME, cfg.host, cfg.port, cfg.uds,
                                                   guard.grpc_credentials(), cfg.security.reflection)


def _load_and_warm(executor_cfg: ExecutorConfig) -> Executor:
    executor = Executor(executor_cfg)
    # Runs the forward's code paths once (kernels chosen, lazy inits done); writes one KV block, the only part
    # of the pool touched before READY (the rest is committed as requests first use it).
    prompt = (executor.info().bos_token_id or 0,) * 4
    if executor.pooling.lm_head:
        warm = executor.prefill(prompt).cache
    else:  # a sequence classifier samples nothing: its head runs instead (executor_service/step/pooling.py)
        (result,) = executor.unified_decode([UnifiedItem(prompt, pooling=PoolingOptions(PoolingTask.CLASSIFY))])
        if result.error is not None:
            raise result.error
        warm = result.cache
    executor.release_cache([warm.cache_id])
    return executor


def serve(executor_cfg: ExecutorConfig, cfg: ServerConfig) -> int:
    """Listens at once (health NOT_SERVING, RPCs UNAVAILABLE), loads and warms up the model, then turns
    SERVING. Blocks until SIGTERM/SIGINT, then drains in-flight RPCs and returns 0."""
    check_ttl(executor_cfg.session_ttl_s)
    guard = ServerGuard(cfg.security)  # reads certificates and tokens: a bad file stops us here, naming its flag
    guard.check_exposure(cfg.host, ["gRPC"] * (cfg.port >= 0) + ["metrics"] * (cfg.metrics_port is not None))
    metrics = RpcMetrics()
    if set_arena_max(cfg.malloc_arena_max):  # before the server's threads exist: arenas made before it stay
        log.info("malloc: %s arenas, trimmed when the model thread idles %s", cfg.malloc_arena_max or "glibc's default",
                 f"(at most every {cfg.malloc_trim_s:g} s)" if cfg.malloc_trim_s else "never (--malloc-trim-s 0)")
    thread = ModelThread(cfg.max_queued_calls, IdleTrim(cfg.malloc_trim_s).after_call)
    servicer = ExecutorServicer(metrics, thread, max_reply_bytes=cfg.max_message_mb * 1024 * 1024)
    health_servicer = health.HealthServicer()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if cfg.metrics_port is not None and not 0 <= cfg.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be 0..65535, got {cfg.metrics_port}")
    if executor_cfg.max_kv_subscribers < 0 or executor_cfg.kv_events_buffer < 1:
        raise ValueError("--max-kv-subscribers must be >= 0 and --kv-events-buffer >= 1")
    if cfg.kv_events_zmq is not None:  # a bad endpoint or an exposed one stops us before we listen
        cfg.kv_events_zmq.check(cfg.host, cfg.security.insecure)
    server, addresses = build_server(cfg, servicer, metrics, health_servicer, guard, executor_cfg.max_kv_subscribers)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: guard.reload_now())  # certificates and tokens: re-read now
    # The metrics server first: a port in use stops us before we listen.
    exporter = ExecutorExporter(metrics, thread) if cfg.metrics_port is not None else None
    metrics_server = exporter.serve(cfg.host, cfg.metrics_port, guard) if exporter is not None else None
    zmq_events = None if cfg.kv_events_zmq is None else open_publisher(cfg.kv_events_zmq, cfg.host)
    if exporter is not None and zmq_events is not None:
        exporter.kv_events_zmq = zmq_events.stats
    server.start()
    log.info("%s", guard.posture(["unix socket plaintext"] if cfg.uds else None))
    log.info("listening on %s; loading %s", ", ".join(addresses), executor_cfg.model_dir)

    start = time.perf_counter()
    if cfg.threads:  # a per-thread OpenMP setting: it must be made on the thread that runs the model
        thread.call(torch.set_num_threads, cfg.threads)
    executor = thread.call(_load_and_warm, executor_cfg)
    servicer.attach(executor)
    if zmq_events is not None:
        with executor.control_op("kv_events_zmq"):  # what the tiers reopened first, no event in between
            zmq_events.attach(executor.events, executor.model_config.kv_window, executor.prefix.snapshot())
    if exporter is not None:
        exporter.attach(executor)
    reaper = LeaseReaper(executor.reap_lapsed, executor_cfg.session_ttl_s / 4)
    reaper.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    info = executor.info()
    log.info("ready in %.2fs: %s (%s, %s on %s), KV pool %s, resident memory %.0f MiB, session lease %.1fs; "
             "instance %s serving on %s", time.perf_counter() - start, info.model_id, info.architecture, info.dtype,
             info.device, describe(info.kv_pool), info.resident_memory_bytes / 2**20, info.session_ttl_s,
             info.instance_id, ", ".join(addresses))
    print(f"READY {' '.join(addresses)}", flush=True)  # a line scripts can wait for

    # With a timeout: Python runs a signal's handler on the main thread only, between bytecodes. A SIGTERM the
    # kernel hands to another thread (gRPC's, the model's, OpenMP's) only flags it, and an untimed wait would
    # sleep on until something else woke the main thread (seen once in CI: killed 20 s after SIGTERM).
    while not stop.wait(0.25):
        pass
    deadline = time.monotonic() + cfg.grace_s
    if _sessions_hold_caches(executor):
        health_servicer.enter_graceful_shutdown()  # NOT_SERVING: schedulers move their requests (and KV) away
        _wait_for_sessions_to_move(executor, deadline)
    log.info("shutting down: finishing in-flight RPCs (up to %.0fs)", max(1.0, deadline - time.monotonic()))
    servicer.drain()
    health_servicer.enter_graceful_shutdown()  # (idempotent)
    server.stop(max(1.0, deadline - time.monotonic())).wait()
    reaper.stop()
    # the prefixes warm in the pool survive the restart (executor_service/kv/tiers/flush.py); best effort: a failure loses only
    # what a restart would have found warm, and must not keep the rest of the stop from running
    try:
        flush_to_disk(executor.prefix, lambda: executor.control_op("kv_flush"),
                      executor_cfg.kv_tiers.disk_flush_s)
    except Exception:  # noqa: BLE001 (any: a disk error, a bad block read)
        log.exception("stopping: writing the pool's KV blocks to the disk tier failed; the stop goes on")
    thread.shutdown()
    if zmq_events is not None:
        zmq_events.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    log.info("stopped")
    return 0


def _sessions_hold_caches(executor: Executor) -> bool:
    return any(s.session_id and s.caches for s in executor.list_caches())


def _wait_for_sessions_to_move(executor: Executor, deadline: float) -> None:
    """A drain: while a session (a scheduler's) holds caches, they are running requests that its scheduler
    moves to other executors (ImportKv pulls their KV from here) or finishes here; every RPC is served until
    none is held or the grace ends. Without such caches (idle, or clients without sessions) the drain
    refuses new RPCs at once, as before."""
    log.info("draining: waiting (up to %.0fs) for the sessions holding caches to move or end them",
             deadline - time.monotonic())
    while time.monotonic() < deadline and _sessions_hold_caches(executor):
        time.sleep(0.05)

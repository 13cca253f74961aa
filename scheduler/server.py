"""The scheduler's gRPC server (asyncio): GenerateService (+ vLLM's engine protocol for smg) + grpc.health.v1 +
reflection, readiness, drain."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from tandem.call_limit import CallLimit, backlog_options
from tandem.capabilities import PREFIX_CACHING
from tandem.grpc_setup import add_health_reflection_and_ports
from tandem.errors import CheckpointError, RemoteError
from tandem.executor.v1 import executor_pb2 as epb
from tandem.generate.v1 import generate_pb2, generate_pb2_grpc
from tandem.vendor.smg import vllm_engine_pb2_grpc
from scheduler.engine import executor_codec as codec
from scheduler.fleet import discovery
from scheduler.config import SchedulerConfig
from scheduler.executor.info import ExecutorInfo
from scheduler.fleet.fleet import Fleet
from scheduler.engine.recovery import unfit_reason
from scheduler.executor.client import ExecutorRefusedCredentials, ExecutorUnreachable, GrpcExecutorClient
from scheduler.http.app import build_app
from scheduler.http.serve import HttpFront
from scheduler.rpc.interceptor import ErrorMappingInterceptor
from scheduler.metrics import SchedulerMetrics
from scheduler.rpc.servicer import GenerateServicer
from scheduler.compat.vllm_engine_servicer import SERVICE_NAME as VLLM_ENGINE, VllmEngineServicer
from scheduler.token_limits import TokenLimits
from scheduler.text.tokenizer import ModelTokenizer, read_chat_template
from tandem.security.grpc_auth import AioAuthInterceptor, everyone_user
from tandem.security.guard import ServerGuard
from tandem.security.tls import ClientTls, client_paths
from tandem.security.tokens import ClientToken

log = logging.getLogger("tandem.scheduler")
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


async def _first_infos(clients: list[GrpcExecutorClient], cfg: SchedulerConfig) -> list[ExecutorInfo | None]:
    """GetInfo of every executor, polled until at least one serves (they may still be loading their model);
    None for those that do not answer yet (they join later). An error answer is an executor we cannot use."""
    deadline = time.monotonic() + cfg.connect_timeout_s
    last_note = 0.0
    while True:
        answers = await asyncio.gather(*(c.info() for c in clients), return_exceptions=True)
        infos = [codec.executor_info_from_pb(a) if isinstance(a, epb.GetInfoResponse) else None for a in answers]
        if any(infos):
            return infos
        for a in answers:
            answered = isinstance(a, RemoteError) and a.status_name != "DEADLINE_EXCEEDED"
            if (answered or isinstance(a, ExecutorRefusedCredentials)) and len(clients) == 1:
                raise a  # an answer: not an executor we can use (or not with our credentials)
        now = time.monotonic()
        if now >= deadline:
            raise ExecutorUnreachable(f"no executor of {', '.join(cfg.targets)} served within "
                                      f"{cfg.connect_timeout_s:.0f}s: {answers[0]}")
        if now - last_note >= 10:
            log.info("waiting for executor %s to serve... (%s)", ", ".join(c.address for c in clients), answers[0])
            last_note = now
        await asyncio.sleep(min(cfg.reconnect_interval_s, 0.5))


async def _addresses(cfg: SchedulerConfig) -> dict[str, str | None]:
    """Every executor address now, with the DNS name it was found under (discovery.resolve_named)."""
    deadline = time.monotonic() + cfg.connect_timeout_s
    while True:
        addresses = await discovery.resolve_named(cfg.targets)
        if addresses:
            return addresses
        if time.monotonic() >= deadline:
            raise ExecutorUnreachable(f"{', '.join(cfg.targets)} resolved to no address within "
                                      f"{cfg.connect_timeout_s:.0f}s")
        await asyncio.sleep(min(cfg.resolve_interval_s, 1.0))


async def _rediscover(fleet: Fleet, cfg: SchedulerConfig, new_client) -> None:
    """dns:/// targets: executors that appear later join the fleet (they start lost and join once serving)."""
    while True:
        await asyncio.sleep(cfg.resolve_interval_s)
        for address, name in (await discovery.resolve_named(cfg.targets)).items():
            if address not in fleet.addresses:
                log.info("executor %s appeared (DNS); it joins once it serves", address)
                fleet.add(new_client(address, name), None).recovery.lost(f"executor {address} not serving yet")


def _link_posture(tls: ClientTls | None, token: ClientToken | None, limits: TokenLimits) -> list[str]:
    """The scheduler's part of the posture line: its link to the executors, and the per-token limits."""
    link = "off" if tls is None else "on (client cert)" if tls.tls.material.cert is not None else "on"
    parts = [f"to executors: TLS {link}, token {'on' if token is not None else 'off'}"]
    if limits.on:
        parts.append(f"per-token limits {limits.max_concurrent or '-'} choices / {limits.max_tokens or '-'} tokens")
    return parts


async def serve_async(cfg: SchedulerConfig) -> int:
    # Certificates and token files are read first: a bad one (or an exposed address) stops us at once.
    guard = ServerGuard(cfg.security)
    guard.check_exposure(cfg.host, ["gRPC"] * (cfg.port >= 0) + ["HTTP"] * (cfg.http_port is not None)
                         + ["metrics"] * (cfg.metrics_port is not None))
    chat_template = read_chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    client_tls = ClientTls(client_paths(cfg.executor_tls_ca, cfg.executor_tls_cert, cfg.executor_tls_key),
                           cfg.executor_tls_server_name) if cfg.executor_tls_on else None
    token = ClientToken(cfg.executor_token_file) if cfg.executor_token_file is not None else None
    limits = TokenLimits(cfg.max_concurrent_per_token, cfg.max_queued_tokens_per_token)

    def new_client(address: str, tls_name: str | None = None) -> GrpcExecutorClient:
        return GrpcExecutorClient(address, max_message_mb=max(cfg.max_message_mb, 64), tls=client_tls,
                                  tls_name=tls_name, token=token)

    clients = [new_client(a, name) for a, name in (await _addresses(cfg)).items()]
    infos = await _first_infos(clients, cfg)
    info = next(i for i in infos if i is not None)  # the reference: every executor must serve its model
    tokenizer_dir = Path(cfg.tokenizer or info.model_dir)
    tokenizer = ModelTokenizer(tokenizer_dir, chat_template)
    if tokenizer.vocab_size > info.vocab_size:
        raise CheckpointError(f"tokenizer at {tokenizer_dir} has {tokenizer.vocab_size} tokens but the executor's "
                              f"model only {info.vocab_size}: pass the model's own tokenizer with --tokenizer")

    health_servicer = health.aio.HealthServicer()

    async def set_health(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, VLLM_ENGINE):
            await health_servicer.set(name, status)

    loop = asyncio.get_running_loop()
    limit = cfg.max_message_mb * 1024 * 1024
    # Tokens first: a refused call never reaches the error mapping or the servicer.
    # Calls over --max-concurrent-rpcs are refused on arrival; core holds the calls not yet taken meanwhile
    # instead of cancelling them itself (tandem/call_limit.py).
    calls = CallLimit(cfg.rpc_limit, "--max-concurrent-rpcs", "scheduler")
    server = grpc.aio.server(interceptors=[AioAuthInterceptor(guard.authenticator, everyone_user,
                                                              cfg.security.auth_health),
                                           ErrorMappingInterceptor(calls)],
                             options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", 64 * 1024 * 1024), ("grpc.so_reuseport", 0),
                                      *backlog_options(cfg.rpc_limit)])
    addresses = add_health_reflection_and_ports(server, health_servicer, SERVICE_NAME, cfg.host, cfg.port, cfg.uds,
                                                guard.grpc_credentials(), cfg.security.reflection, (VLLM_ENGINE,))
    metrics = SchedulerMetrics()
    metrics.call_limit = lambda: calls.refused
    fleet = Fleet(cfg, tokenizer, info, on_health=lambda up: loop.create_task(set_health(up)),
                  client_name=f"tandem-scheduler {addresses[0]}", events=metrics)
    metrics.watch(fleet.stats, (cfg.served_model_names or (info.model_id,))[0],
                  lambda: PREFIX_CACHING in fleet.info.capabilities)
    lost = []
    for client, its_info in zip(clients, infos):
        unfit = unfit_reason(info, its_info, client.address) if its_info is not None else ""
        e = fleet.add(client, its_info if its_info is not None and not unfit else None)
        if its_info is None:
            lost.append((e, f"executor {client.address} does not serve yet; it joins once it does"))
        elif unfit:
            log.error("%s", unfit)
            lost.append((e, unfit))
    # Tokenizing and chat templating run here, off the event loop (`tokenizers` releases the GIL).
    workers = ThreadPoolExecutor(cfg.tokenizer_threads, thread_name_prefix="tokenize")
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(fleet, workers, limits), server)
    # vLLM's engine protocol, for SGLang's gateway smg (`smg launch --worker-urls grpc://...`)
    # (its HealthCheck reads `stop`, set below, only once the server runs: a draining scheduler reports unhealthy)
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(
        VllmEngineServicer(fleet, workers, limits, (cfg.served_model_names or (info.model_id,))[0], chat_template,
                           healthy=lambda: fleet.up and not stop.is_set()),
        server)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def reload_now() -> None:  # SIGHUP: certificates and token files, served and presented, read again now
        guard.reload_now()
        for source in (client_tls, token):
            if source is not None:
                source.reload_now()

    loop.add_signal_handler(signal.SIGHUP, reload_now)
    metrics_server = metrics.serve(cfg.host, cfg.metrics_port, guard) if cfg.metrics_port is not None else None
    http = None
    if cfg.http_port is not None:  # the OpenAI-compatible front, on this loop (binds now: a busy port fails here)
        app = build_app(fleet, workers, healthy=lambda: fleet.up and not stop.is_set(), max_body_bytes=limit,
                        metrics=metrics.render, authenticator=guard.authenticator,
                        auth_health=cfg.security.auth_health, limits=limits, allowed_origins=cfg.allowed_origins,
                        http_limits=cfg.http_limits)
        http = HttpFront(app, cfg.host, cfg.http_port, guard.tls, cfg.http_limits)
        metrics.connection_caps = http.guard.refused.copy  # (a copy: a scrape may run on the metrics thread)
    await server.start()
    if http is not None:
        http.start()
    for e, reason in lost:
        e.recovery.lost(reason)
    await fleet.start()  # the sessions; an executor already gone is reconnected to
    await set_health(fleet.up)
    fleet_task = loop.create_task(fleet.run(), name="fleet")
    tasks = [loop.create_task(_rediscover(fleet, cfg, new_client), name="discovery")] \
        if any(discovery.is_dns(t) for t in cfg.targets) else []
    log.info("%s", guard.posture(_link_posture(client_tls, token, limits)
                                 + (["unix socket plaintext"] if cfg.uds else [])))
    log.info("serving %s (%s) from executors %s on %s; tokenizer %s; budget %d tokens/step, max %d running",
             info.model_id, info.architecture, ", ".join(fleet.addresses), ", ".join(addresses), tokenizer_dir,
             fleet.max_batch_tokens, cfg.max_running)
    if http is not None:
        log.info("OpenAI-compatible HTTP on %s (/v1/chat/completions, /v1/completions, /v1/models)", http.url)
    # A line scripts can wait for: the gRPC addresses (the first is the TCP one), then the HTTP URL if on.
    print(f"READY {' '.join(addresses + ([http.url] if http is not None else []))}", flush=True)

    stop_wait = loop.create_task(stop.wait())
    done, _ = await asyncio.wait({stop_wait, fleet_task}, return_when=asyncio.FIRST_COMPLETED)
    code, grace_s = 0, cfg.grace_s
    if fleet_task in done:  # the loop died (a bug): end every stream, free what we hold, exit non-zero
        stop_wait.cancel()
        log.error("the scheduling loop failed; shutting down", exc_info=fleet_task.exception())
        code, grace_s = 1, 0.0
    log.info("shutting down: running requests get up to %.0fs to finish", grace_s)
    await set_health(False)
    await fleet.drain(grace_s)
    if http is not None:
        await http.stop()
    await server.stop(5.0)
    fleet_task.cancel()
    for t in tasks:
        t.cancel()
    workers.shutdown(wait=False, cancel_futures=True)
    await fleet.close()
    if metrics_server is not None:
        metrics_server.shutdown()
    log.info("stopped")
    return code

"""The client side of the soak, on its own thread with its own event loop: first the clean run (every
reference key once, one at a time), then `concurrency` workers that each send one request after another until
told to stop. A request whose attempt ends UNAVAILABLE (the scheduler killed under it, or not back yet) is sent
again — from scratch, on the scheduler serving now — until it ends otherwise or `retry_s` passed.

The main thread owns the processes (a server dies with the thread that started it) and tells the clients
where the scheduler is now through Target; the clients only read it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx

from tests.soak.attempts import SHUTDOWN_ABORT, Attempt, grpc_attempt, http_attempt
from tests.soak.workload import Mix, Spec, choose, reference_specs

OTHER = {"s0": "s1", "s1": "s0"}  # --all: where a direct request goes when re-sent
# A channel to a restarted process (same port, --all) tries again within a second, not after gRPC's 2-minute backoff.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]


@dataclass
class Target:
    """Where the scheduler serves now (set by the main thread at every start). --all: where each route (Spec.route:
    a scheduler "s0"/"s1", or a router "smg"/"vr") serves, on fixed ports; generations[route] counts its starts."""
    grpc_address: str = ""
    http_url: str = ""
    generation: int = 0
    grpc_of: dict[str, str] = field(default_factory=dict)
    http_of: dict[str, str] = field(default_factory=dict)
    generations: dict[str, int] = field(default_factory=dict)


@dataclass
class Record:
    """One request and every attempt it took (retries after UNAVAILABLE)."""
    spec: Spec
    attempts: list[Attempt] = field(default_factory=list)


@dataclass
class LoadConfig:
    prompts: list[str]
    adapters: tuple[str, ...]
    mix: Mix
    concurrency: int
    max_tokens: int
    request_timeout_s: float
    retry_s: float
    seed: int
    max_requests: int | None = None
    model: str = ""  # the base model's name in HTTP bodies (--all: what the routers route by)
    slow_tokens: int = 0  # a slow reader's max tokens
    slow_pause_s: float = 0.0  # how long a slow reader leaves its stream unread
    retry_routed: bool = False  # --all: also re-send a routed request a router answered 5xx (see verdict.py)
    reference_concurrency: int = 1  # clean-run requests at once (before any chaos; answers do not depend on it)


class Clients:
    """start() runs the thread; wait_references() returns once the clean run is done; go() starts the
    load; stop() asks the workers to send nothing new; join() waits for the requests in flight."""

    def __init__(self, cfg: LoadConfig, target: Target) -> None:
        self.cfg = cfg
        self.target = target
        self.references: dict[tuple, object] = {}
        self.records: list[Record] = []
        self.in_flight = 0
        self.started_requests = 0
        self.error: BaseException | None = None
        self._refs_done = threading.Event()
        self._go = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="soak-clients", daemon=True)
        self._channels: dict[tuple[str, int, bool], grpc.aio.Channel] = {}
        self._counter = itertools.count()

    # --- the main thread's side
    def start(self) -> None:
        self._thread.start()

    def wait_references(self, timeout: float) -> None:
        if not self._refs_done.wait(timeout):
            raise RuntimeError(f"the clean run did not finish within {timeout:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"the clean run failed: {self.error}") from self.error

    def go(self) -> None:
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- the client thread
    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self._refs_done.set()

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=4 * self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=10.0)
        # A slow reader's connection has a small receive buffer, like a client on a slow link: its unread stream
        # backs up into the server within a few hundred kB instead of the megabytes loopback would buffer.
        slow = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)])
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http, \
                httpx.AsyncClient(transport=slow, timeout=timeout) as slow_http:
            self._http, self._slow_http = http, slow_http
            try:
                await self._clean_run()
                self._refs_done.set()
                while not self._go.is_set():
                    await asyncio.sleep(0.05)
                await asyncio.gather(*(self._worker(w) for w in range(self.cfg.concurrency)))
            finally:
                for channel in self._channels.values():
                    await channel.close()

    async def _clean_run(self) -> None:
        specs = reference_specs(len(self.cfg.prompts), self.cfg.adapters, self.cfg.mix)
        step = max(1, self.cfg.reference_concurrency)
        for k in range(0, len(specs), step):
            group = specs[k:k + step]
            for spec, att in zip(group, await asyncio.gather(*(self._attempt(s) for s in group))):
                if att.status != "OK":
                    raise RuntimeError(f"the clean run's {spec.label} request for {spec.key} ended {att.label}: "
                                       f"{att.detail}")
                self.references[spec.key] = att.tokens if spec.protocol == "grpc" else att.text

    async def _worker(self, w: int) -> None:
        rng = random.Random(self.cfg.seed * 1_000_003 + w)
        while not self._stop.is_set():
            n = next(self._counter)
            if self.cfg.max_requests is not None and n >= self.cfg.max_requests:
                return
            spec = choose(n, rng, self.cfg.mix, len(self.cfg.prompts), self.cfg.adapters, self.cfg.max_tokens)
            self.started_requests += 1
            self.in_flight += 1
            try:
                self.records.append(await self._request(spec))
            finally:
                self.in_flight -= 1

    async def _request(self, spec: Spec) -> Record:
        record = Record(spec)
        give_up = float("inf")  # retry_s from the first attempt that is re-sent (a long request may run for minutes)
        pause = 0.1
        sent = spec
        while True:
            att = await self._attempt(sent)
            att.route = sent.route
            record.attempts.append(att)
            if not self._retriable(sent, att) or att.client_cancelled or time.monotonic() > give_up:
                return record
            give_up = min(give_up, time.monotonic() + self.cfg.retry_s)
            if sent.route in OTHER:  # (--all) a client that knows two schedulers tries the other one next
                sent = dataclasses.replace(sent, route=OTHER[sent.route])
            await asyncio.sleep(pause)  # the scheduler is restarting: try the one serving next
            pause = min(2.0, pause * 2)

    def _retriable(self, spec: Spec, att: Attempt) -> bool:
        """UNAVAILABLE (a process restarting) and a stream a shutting-down scheduler ended as aborted are sent
        again; so is a router's 5xx or error event in its stream, whose verdict comes later (verdict.py: a failure
        unless an outage explains it)."""
        if att.status in ("UNAVAILABLE", SHUTDOWN_ABORT):
            return True
        return self.cfg.retry_routed and spec.route in ("smg", "vr") and att.label.startswith(("http 5", "http sse"))

    async def _attempt(self, spec: Spec) -> Attempt:
        prompt = self.cfg.prompts[spec.prompt]
        tokens = self.cfg.slow_tokens if spec.slow else self.cfg.max_tokens
        if spec.protocol == "grpc":
            return await grpc_attempt(self._channel(spec.route, spec.slow), spec, prompt, tokens,
                                      self.cfg.request_timeout_s, self.cfg.slow_pause_s)
        url = self.target.http_of[spec.route] if spec.route else self.target.http_url
        return await http_attempt(self._slow_http if spec.slow else self._http, url, spec, prompt, tokens,
                                  self.cfg.model, self.cfg.slow_pause_s)

    def _channel(self, route: str = "", slow: bool = False) -> grpc.aio.Channel:
        """The channel to the scheduler serving now; the old ones stay open (closing one would end the calls
        still on it CANCELLED, which the soak must only see for the client's own cancels). Slow readers have
        their own, with HTTP/2 windows that do not grow (no BDP probing): an unread stream backs up into the
        server after 64 kB."""
        key = (route, self.target.generations.get(route, 0), slow) if route else ("", self.target.generation, slow)
        if key not in self._channels:
            address = self.target.grpc_of[route] if route else self.target.grpc_address
            options = RECONNECT + ([("grpc.http2.bdp_probe", 0)] if slow else [])
            self._channels[key] = grpc.aio.insecure_channel(address, options=options)
        return self._channels[key]

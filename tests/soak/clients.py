"""The client side of the soak, on its own thread with its own event loop: first the clean run (every
reference key once, one at a time), then `concurrency` workers that each send one request after another until
told to stop. A request whose attempt ends UNAVAILABLE (the scheduler killed under it, or not back yet) is sent
again — from scratch, on the scheduler serving now — until it ends otherwise or `retry_s` passed.

The main thread owns the processes (a server dies with the thread that started it) and tells the clients
where the scheduler is now through Target; the clients only read it.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx

from tests.soak.attempts import Attempt, grpc_attempt, http_attempt
from tests.soak.workload import Mix, Spec, choose, reference_specs


@dataclass
class Target:
    """Where the scheduler serves now (set by the main thread at every start)."""
    grpc_address: str = ""
    http_url: str = ""
    generation: int = 0


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
        self._channels: dict[int, grpc.aio.Channel] = {}
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
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            self._http = http
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
        for spec in reference_specs(len(self.cfg.prompts), self.cfg.adapters, self.cfg.mix):
            att = await self._attempt(spec)
            if att.status != "OK":
                raise RuntimeError(f"the clean run's {spec.label} request for {spec.key} ended {att.label}: "
                                   f"{att.detail}")
            self.references[spec.key] = att.tokens if spec.kind == "grpc" else att.text

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
        give_up = time.monotonic() + self.cfg.retry_s
        pause = 0.1
        while True:
            att = await self._attempt(spec)
            record.attempts.append(att)
            if att.status != "UNAVAILABLE" or att.client_cancelled or time.monotonic() > give_up:
                return record
            await asyncio.sleep(pause)  # the scheduler is restarting: try the one serving next
            pause = min(2.0, pause * 2)

    async def _attempt(self, spec: Spec) -> Attempt:
        prompt = self.cfg.prompts[spec.prompt]
        if spec.kind == "grpc":
            return await grpc_attempt(self._channel(), spec, prompt, self.cfg.max_tokens,
                                      self.cfg.request_timeout_s)
        return await http_attempt(self._http, self.target.http_url, spec, prompt, self.cfg.max_tokens)

    def _channel(self) -> grpc.aio.Channel:
        """The channel to the scheduler serving now; the old ones stay open (closing one would end the calls
        still on it CANCELLED, which the soak must only see for the client's own cancels)."""
        gen = self.target.generation
        if gen not in self._channels:
            self._channels[gen] = grpc.aio.insecure_channel(self.target.grpc_address)
        return self._channels[gen]

"""One scheduler, several executors: an Engine per executor (its own running batch, session, recovery), a
router in front (scheduler/fleet/router.py) and failover by recompute between them.

Each engine steps its executor on its own (one UnifiedDecode per executor per step, concurrently: executors
never wait on each other). A new request goes to the best-scored executor that serves and holds its adapter.
When an executor is lost, its engine requeues what it ran (outputs kept: recomputed from prompt + tokens
already streamed, so a client sees a pause and then exactly the tokens it would have seen), and the fleet
moves every queued request to the executors that serve. Only when none serves do requests wait on their
engine, bounded by --executor-retry-s, then fail UNAVAILABLE. An executor back after a loss gets new work
(and any request still waiting for one). Executors that serve another model are refused (scheduler/engine/recovery.py's
unfit_reason), the rest keep serving.

The servicers see the fleet as one engine: submit, abort, info (adapters and capabilities: those of every
serving executor), refresh_info, stats (each executor's, as plain data), tokenizer, cfg.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import dataclasses
from typing import Callable

from scheduler.engine.executor_codec import capabilities_needed
from scheduler.fleet.disaggregation import by_kv, eligible, hand_off_prompts_done
from scheduler.config import SchedulerConfig
from scheduler.engine.engine import Engine
from scheduler.executor.client import ExecutorClient
from scheduler.executor.info import ExecutorInfo, ExecutorStats
from scheduler.structured.grammar import GrammarCompiler
from scheduler.fleet.kv_follower import follow_kv_events
from scheduler.fleet.kv_migration import KvMigration
from scheduler.request import GenerateRequest
from scheduler.output.request_events import RequestEvents
from scheduler.output.request_stream import RequestStream
from scheduler.fleet.router import Candidate, PrefixIndex, choose, prompt_hashes
from scheduler.sequence import Sequence
from scheduler.engine.token_masks import MaskWorker
from tandem.capabilities import DETERMINISTIC
from scheduler.vision.chat_images import ChatImages
from tandem.errors import AdapterNotFound, Overloaded, Unsupported

log = logging.getLogger("tandem.scheduler")


class Fleet:
    def __init__(self, cfg: SchedulerConfig, tokenizer, info: ExecutorInfo,
                 on_health: Callable[[bool], None] = lambda up: None, client_name: str = "tandem-scheduler",
                 events: RequestEvents | None = None) -> None:
        """info: the reference executor's (the first that served): every executor must serve its model.
        events: where every engine's requests report (the process's metrics, scheduler/metrics.py)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.reference = info
        self.events = events
        self.engines: list[Engine] = []
        self.indexes: dict[Engine, PrefixIndex] = {}
        self._owner: dict[Sequence, Engine] = {}
        self._arrivals = itertools.count()  # one order for all engines: a moved request keeps its place
        self._on_health = on_health
        self._client_name = client_name
        self._tasks: list[asyncio.Task] = []
        self._running = False
        # Structured output: constraints compiled for the model's vocabulary (by the servicers' worker threads)
        # and the one thread every engine's token masks are computed in
        self.grammars = GrammarCompiler(tokenizer, info.vocab_size, info.eos_token_ids)
        self.mask_worker = MaskWorker(info.vocab_size)
        # Images in chat prompts (scheduler/vision/): the model's image processor under the media policy; None
        # for a model that takes none
        self.images = ChatImages.load(tokenizer.model_dir, cfg.media) if hasattr(tokenizer, "model_dir") else None
        # Requests that move with their KV: off draining executors, prefill -> decode (scheduler/fleet/kv_migration.py)
        self.migration = KvMigration(lambda: self.engines, self._target, self._owner.__setitem__, events)

    # ----------------------------------------------------------------- executors
    def add(self, client: ExecutorClient, info: ExecutorInfo | None) -> Engine:
        """An engine for this executor; info None (not reachable yet) or unfit: it starts lost and joins
        once its executor serves the reference model."""
        cell: list[Engine] = []
        engine = Engine(self.cfg, client, self.tokenizer, info or self.reference,
                        on_health=lambda up: self._health_changed(cell[0], up), client_name=self._client_name,
                        arrivals=self._arrivals, events=self.events, mask_worker=self.mask_worker)
        cell.append(engine)
        engine.after_step = lambda: hand_off_prompts_done(engine, self.migration)
        self.engines.append(engine)
        self.indexes[engine] = PrefixIndex()
        if self._running:
            self._launch(engine)
        return engine

    @property
    def up(self) -> bool:
        return any(e.up for e in self.engines)

    @property
    def info(self) -> ExecutorInfo:
        """The reference model's info, with the adapters and capabilities of every serving executor (what a
        request may ask for: _route sends it to an executor that has what it needs)."""
        serving = [e for e in self.engines if e.up]
        if len(serving) == 1:  # (the usual single executor: its own info)
            return serving[0].info
        if not serving:
            return self.reference
        return dataclasses.replace(serving[0].info, adapters=tuple(sorted({a for e in serving for a in e.info.adapters})),
                                   capabilities=frozenset(c for e in serving for c in e.info.capabilities))

    @property
    def deterministic(self) -> bool:
        """Whether every serving executor runs --deterministic (capability "deterministic"): then a request's tokens
        and logprobs do not depend on where, or beside what, it ran (docs/deterministic.md)."""
        serving = [e for e in self.engines if e.up]
        return bool(serving) and all(DETERMINISTIC in e.info.capabilities for e in serving)

    @property
    def addresses(self) -> list[str]:
        return [e.client.address for e in self.engines]

    @property
    def max_batch_tokens(self) -> int:
        """The per-step token budget (of the first serving executor: each has its own)."""
        first = next((e for e in self.engines if e.up), self.engines[0])
        return first.planner.max_batch_tokens

    def stats(self) -> list[ExecutorStats]:
        """Each executor's state, load and counters, as plain data (GetModelInfo, the metrics)."""
        return [e.stats() for e in self.engines]

    async def refresh_info(self) -> None:
        await asyncio.gather(*(e.refresh_info() for e in self.engines if e.up))

    # ----------------------------------------------------------------- requests
    def check_overload(self) -> None:
        """Before any work on a new request (tokenizing): raises Overloaded when every serving executor's queue
        would refuse it (full, or a wait estimated past --max-queue-time-s), with the soonest Retry-After."""
        refusals = []
        for e in self.engines:
            if e.up:
                try:
                    e.policy.check_overload()
                    return
                except Overloaded as exc:
                    refusals.append(exc)
        if refusals:
            self._refused(min(refusals, key=lambda r: r.retry_after_s))

    def _refused(self, refusal: Overloaded) -> None:
        if self.events is not None:
            self.events.refused(refusal.reason)
        raise refusal

    def submit(self, request: GenerateRequest) -> tuple[Sequence, RequestStream]:
        engine, hashes = self._route(request)
        try:
            seq, stream = engine.submit(request)
        except Overloaded as exc:
            self._refused(exc)
        self._owner[seq] = engine
        self.indexes[engine].routed(hashes)
        return seq, stream

    def abort(self, seq: Sequence) -> None:
        engine = self._owner.pop(seq, None)
        if engine is not None:
            engine.abort(seq)

    def _route(self, request: GenerateRequest, phase: str = "prompt") -> tuple[Engine, list[bytes]]:
        """The engine for a request, and the block hashes of its prompt there (for the router's memory)."""
        serving = [e for e in self.engines if e.up]
        if not serving:  # none serves: queue on the first (it waits within --executor-retry-s, or refuses)
            return self.engines[0], []
        return self._choose(request, eligible(serving, phase, self.migration.draining) or serving)

    def _target(self, request: GenerateRequest, phase: str, avoid: Engine, kv: str = "none") -> Engine | None:
        """Where a request leaving `avoid` goes (scheduler/fleet/kv_migration.py): None when nowhere can take it.
        kv: whether it takes its cache along (disaggregation.by_kv)."""
        pool = by_kv(eligible([e for e in self.engines if e.up], phase, self.migration.draining, avoid), avoid, kv)
        try:
            engine, hashes = self._choose(request, pool) if pool else (None, [])
        except (AdapterNotFound, Unsupported):
            return None
        if engine is not None:
            self.indexes[engine].routed(hashes)
        return engine

    def _choose(self, request: GenerateRequest, serving: list[Engine]) -> tuple[Engine, list[bytes]]:
        fit = [e for e in serving if not request.adapter or request.adapter in e.info.adapters]
        if not fit:
            raise AdapterNotFound(f"unknown adapter {request.adapter!r}: no serving executor holds it; "
                                  f"loaded: {sorted(self.info.adapters) or 'none'}")
        needed = capabilities_needed(request)  # (a fleet mid-upgrade may mix executor versions)
        if needed:  # (most requests need nothing: no per-executor set on the request path)
            fit = [e for e in fit if needed <= set(e.info.capabilities)]
        if not fit:
            raise Unsupported(f"this request needs an executor with the capabilities {sorted(needed)}; no serving "
                              "executor that could take it has them (upgrade the executors)")
        if len(self.engines) == 1:  # nothing to choose between: no prompt hashing on the request path
            return fit[0], []
        hashes: dict[int, list[bytes]] = {}  # by block size (executors may differ)
        candidates = {}
        for e in fit:
            bs = e.policy.kv.block_size
            if bs not in hashes:
                hashes[bs] = prompt_hashes(request.prompt_ids, request.adapter, bs, request.cache_salt)
            candidates[e.client.address] = (e, self._candidate(e, hashes[bs]))
        best = choose([c for _, c in candidates.values()], len(request.prompt_ids))
        engine = candidates[best.name][0]
        return engine, hashes[engine.policy.kv.block_size]

    def _candidate(self, e: Engine, hashes: list[bytes]) -> Candidate:
        pending = sum(s.num_tokens - s.num_cached for s in e.policy.waiting)
        pending += sum(s.remaining for s in e.policy.running)
        kv = e.policy.kv
        cached = self.indexes[e].cached_blocks(hashes) * kv.block_size
        return Candidate(e.client.address, kv.free_blocks, kv.total_blocks, pending, e.planner.max_batch_tokens, cached)

    # ----------------------------------------------------------------- loss and return
    def _health_changed(self, engine: Engine, up: bool) -> None:
        if not up:
            self.indexes[engine].clear()
            self._move_from(engine)
        else:
            for other in self.engines:  # requests that waited for any executor to serve
                if not other.up:
                    self._move_from(other)
        self._on_health(self.up)

    def _move_from(self, src: Engine) -> None:
        """Moves src's queued requests (src is down) to the serving executors, each routed anew."""
        if not any(e.up for e in self.engines if e is not src):
            return
        moved = src.take_waiting()
        for seq, stream in moved:
            try:
                dst, hashes = self._route(seq.request)
            except (AdapterNotFound, Unsupported) as exc:
                stream.fail(exc)
                continue
            dst.adopt(seq, stream)
            self._owner[seq] = dst
            self.indexes[dst].routed(hashes)
        if moved:
            log.warning("executor %s lost: %d requests moved to the executors that serve, to be recomputed there",
                        src.client.address, len(moved))

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.engines if e.up))

    async def run(self) -> None:
        """Runs every engine's loop (and KV-event follower) until drained; a loop that fails ends it all."""
        self._running = True
        for e in self.engines:
            self._launch(e)
        try:
            while True:
                pending = [t for t in self._tasks if not t.done()]
                if not pending:
                    return
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()
        finally:
            for t in self._tasks:
                t.cancel()

    def _launch(self, e: Engine) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(e.run(), name=f"engine {e.client.address}"))
        if hasattr(e.client, "health_watch"):  # (a drain shows as NOT_SERVING: its requests move away)
            self._tasks.append(asyncio.get_running_loop().create_task(self.migration.watch(e),
                                                                      name=f"health {e.client.address}"))
        if hasattr(e.client, "kv_events"):
            self._tasks.append(asyncio.get_running_loop().create_task(
                follow_kv_events(e.client, self.indexes[e], lambda e=e: e.closed), name=f"kv {e.client.address}"))

    async def drain(self, grace_s: float) -> None:
        await asyncio.gather(*(e.drain(grace_s) for e in self.engines))

    async def close(self) -> None:
        self.migration.close()
        for e in self.engines:
            await e.client.close()
        self.mask_worker.close()


"""Requests that move between executors with their KV: live migration off a draining executor, and the
prefill -> decode hand-off of disaggregated serving (scheduler/fleet/disaggregation.py decides when).

One move: the request leaves its engine between two passes (never while a step call holding it is in
flight), the target executor pulls the request's cache from the source (ImportKv, create_cache: the bytes go
executor to executor, never through the scheduler), the request joins the target engine's queue holding the
new cache (admitted like a request whose prefix was found: it writes its last token and samples on), and the
source cache is released. Tokens are identical: the cache holds exactly what the source computed, and the
executor keys a seeded draw on the token's position, not on the cache. The first item on the new cache sends
the sampling parameters and the prompt's end again (the new cache has none registered). When the transfer
fails (the source went away mid-stream, the pool is full, the fingerprints differ, either side predates
"kv_transfer"), the request is recomputed on the target from its prompt and the tokens already streamed, as
after an executor's loss: never lost, never an error to its client.

Drain: an executor that turns NOT_SERVING while the scheduler uses it (SIGTERM: executor_service keeps serving
the sessions that hold caches until they hold none) is watched through its health stream. Its engine is held
between passes, its queued requests are routed anew, its running ones move (all at once, concurrently), its
caches are released, and it gets no new work; the executor then exits, having no cache left to serve. When no
other executor can take them, nothing moves and it serves out its grace as before.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from scheduler.engine.engine import Engine
from scheduler.executor.client import ExecutorUnreachable
from scheduler.request import GenerateRequest
from scheduler.output.request_events import RequestEvents
from scheduler.output.request_stream import RequestStream
from scheduler.sequence import Sequence, Status
from tandem.capabilities import KV_TRANSFER
from tandem.errors import RemoteError

log = logging.getLogger("tandem.scheduler")

IMPORT_TIMEOUT_S = 120.0  # one ImportKv: a long prompt's cache across hosts takes seconds
HEALTH_POLL_S = 1.0  # a drained executor: how often to ask whether a new process serves there

# (request, phase "prompt" | "decode", executor to avoid, its KV: "none" | "prefer" | "only" (as
# scheduler/fleet/disaggregation.py's by_kv)) -> the engine to move it to, or None
Target = Callable[[GenerateRequest, str, Engine, str], "Engine | None"]


class KvMigration:
    def __init__(self, engines: Callable[[], list[Engine]], target: Target,
                 set_owner: Callable[[Sequence, Engine], None], events: RequestEvents | None) -> None:
        """target: where a request goes (the fleet's router; None: nowhere); set_owner: the fleet now finds
        the request on that engine (for aborts)."""
        self.engines = engines
        self._target = target
        self._set_owner = set_owner
        self._events = events
        self.draining: set[Engine] = set()  # executors NOT_SERVING while they hold our requests: no new work
        self._moves: set[asyncio.Task] = set()
        self._stranded: set[Engine] = set()  # draining with nowhere to move to (said once)

    # ----------------------------------------------------------------- one request
    def hand_off(self, src: Engine, seqs: list[Sequence], phase: str, kv: str = "prefer") -> int:
        """Takes these running sequences of src (between passes: none is in a step call) to executors the
        router picks, each moved in a task of its own (kv "only": only to executors that can import src's KV;
        "prefer": those where there are). Those with nowhere to go stay. Returns how many left."""
        moving = []
        for seq in seqs:
            dst = self._target(seq.request, phase, src, kv)
            if dst is None or dst is src:
                continue
            src.policy.running.remove(seq)
            if src.policy.speculator is not None:
                src.policy.speculator.forget(seq)
            moving.append((seq, dst))
        streams = dict(src.streams.take([seq for seq, _ in moving]))
        for seq, dst in moving:
            task = asyncio.get_running_loop().create_task(self.move(src, seq, streams.get(seq), dst),
                                                          name="kv move")
            self._moves.add(task)
            task.add_done_callback(self._moves.discard)
        return len(moving)

    async def move(self, src: Engine, seq: Sequence, stream: RequestStream | None, dst: Engine) -> None:
        """seq, taken out of src's queues, continues on dst: with its cache when the transfer succeeds, else
        recomputed there."""
        old_id, old_len = seq.cache_id, seq.num_cached
        imported = await self._import(src, dst, old_id) if old_id else None
        if old_id:  # the source's copy goes (with src's next call, or alone); unknown ids are no error
            src.policy.releases.failed([old_id])
            src.wake()
        if seq.finished or stream is None or stream.finished:  # the client went away meanwhile
            if imported is not None:
                dst.policy.releases.failed([imported[0]])
                dst.wake()
            if stream is not None:
                stream.cancelled()
            return
        prompt_logprobs = list(seq.prompt_logprobs)  # (gathered for a prompt still being written: kept)
        if imported is not None and 0 < imported[1] <= old_len:
            seq.drop_cache()
            seq.lost_tokens += old_len - imported[1]  # (a cache the importer took only in part: the rest again)
            seq.cache_id, seq.num_cached, seq.prefix_looked_up = imported[0], imported[1], imported[1]
            seq.prompt_logprobs = prompt_logprobs if imported[1] == old_len else []
            seq.status = Status.WAITING
            if self._events is not None:
                self._events.migrated()
        else:
            if imported is not None:  # (more tokens than the source held: not the cache asked for)
                dst.policy.releases.failed([imported[0]])
            seq.reset_cache()  # recomputed on dst: prompt + the tokens already streamed
            if not dst.up:  # (lost meanwhile: the fleet has moved its queue already; this one goes elsewhere)
                dst = self._target(seq.request, "prompt", src, "none") or dst
        dst.adopt(seq, stream)
        self._set_owner(seq, dst)

    async def _import(self, src: Engine, dst: Engine, cache_id: str) -> tuple[str, int] | None:
        """dst pulls src's cache: (its new cache id, tokens), or None when it could not (logged, counted)."""
        if not (KV_TRANSFER in src.info.capabilities and KV_TRANSFER in dst.info.capabilities
                and hasattr(dst.client, "import_kv")):
            return None
        started = time.monotonic()
        try:
            resp = await dst.client.import_kv(src.client.address, cache_id, src.session.id, dst.session.id,
                                              IMPORT_TIMEOUT_S)
        except (ExecutorUnreachable, RemoteError) as exc:
            log.warning("moving a request's KV from executor %s to %s failed (%s); it is recomputed there",
                        src.client.address, dst.client.address, exc)
            if self._events is not None:
                self._events.kv_transfer_failed()
            return None
        if self._events is not None:
            self._events.kv_transferred(resp.bytes, time.monotonic() - started)
        return resp.cache_id, resp.num_tokens

    # ----------------------------------------------------------------- a draining executor
    async def evacuate(self, src: Engine) -> None:
        """src's executor drains: its requests move to the others (queued ones routed anew, running ones with
        their KV), its caches are released, and it gets no new work until a new process serves there."""
        if not any(e.up and e is not src and e not in self.draining for e in self.engines()):
            if src not in self._stranded:
                self._stranded.add(src)
                log.warning("executor %s is draining but no other executor serves: its requests stay there "
                            "(it serves them for its grace)", src.client.address)
            return
        self._stranded.discard(src)
        self.draining.add(src)
        started = time.monotonic()
        await src.hold()
        try:
            queued = src.take_waiting()
            src.policy.releases.failed(src.policy.releases.take_stale())  # their reused prefixes there
            running = [s for s in src.policy.running if s.cache_id]
            decoding = [s for s in src.policy.running if s.output_ids]
            prompting = [s for s in src.policy.running if not s.output_ids]  # (their prompt goes on elsewhere)
            left = self.hand_off(src, decoding, "decode") + self.hand_off(src, prompting, "prompt")
            for seq, stream in queued:
                dst = self._target(seq.request, "decode" if seq.output_ids else "prompt", src, "none")
                if dst is None:
                    src.adopt(seq, stream)  # (nowhere else: it waits here)
                    continue
                dst.adopt(seq, stream)
                self._set_owner(seq, dst)
            await asyncio.gather(*list(self._moves), return_exceptions=True)
            log.warning("executor %s is draining: %d running requests handed over (%d held a cache to move), "
                        "%d queued ones routed anew, in %.2f s", src.client.address, left, len(running), len(queued),
                        time.monotonic() - started)
        finally:
            src.held = False
            src.wake()

    async def watch(self, engine: Engine) -> None:
        """Follows engine's executor's health (Watch): NOT_SERVING while it serves us is a drain; then it asks
        (unary: an open Watch would hold the executor's shutdown) until a new process serves there, moving the
        requests away as soon as another executor can take them."""
        client = engine.client
        while not engine.closed:
            drained = False
            call = client.health_watch()
            try:
                async for msg in call:
                    if msg.status == health_pb2.HealthCheckResponse.SERVING:
                        self.draining.discard(engine)
                    elif msg.status == health_pb2.HealthCheckResponse.NOT_SERVING:  # (draining, or loading)
                        drained = True
                        break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return
            finally:
                call.cancel()
            while drained and not engine.closed and not await client.healthy():
                if engine.up and engine not in self.draining:
                    await self.evacuate(engine)
                await asyncio.sleep(HEALTH_POLL_S)
            self.draining.discard(engine)
            self._stranded.discard(engine)
            if not drained:
                await asyncio.sleep(HEALTH_POLL_S)

    def close(self) -> None:
        for task in list(self._moves):
            task.cancel()


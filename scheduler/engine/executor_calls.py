"""The engine's calls to its executor (a step call, CreateCache, ReleaseCache, KeepAlive, GetInfo) and what each
one's failure means for the requests: a loss starts recovery, a refused burst goes again in fewer steps, a full
pool makes room, anything else fails the step's requests or is retried. Separate from the loop
(scheduler/engine/engine.py), which decides when to call; here is how a call is made and what its answer or its
failure changes. How a failure is classified: scheduler/executor/call_failures.py.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from scheduler.engine.decode_bursts import DecodeBursts
from scheduler.engine.planner import StepPlan
from scheduler.engine.policy import SchedulingPolicy
from scheduler.engine.recovery import Recovery
from scheduler.engine.step_answer import ItemResult, StepAnswer
from scheduler.executor.call_failures import Call, Verdict, classify
from scheduler.executor.client import ExecutorClient, ExecutorUnreachable
from scheduler.executor.info import ExecutorInfo
from scheduler.executor.session import ExecutorSession
from scheduler.output.output_processor import OutputProcessor
from scheduler.engine import executor_codec as codec
from scheduler.engine.token_masks import StepMasks
from tandem.codec import kv_usage_from_pb
from tandem.errors import RemoteError
from tandem.capabilities import (DRAFT_MODEL, PREFIX_CACHING, REGISTERED_SAMPLING, RELEASE_WITH_STEP,
                                 SPECULATIVE_DRAFTS)

log = logging.getLogger("tandem.scheduler")
STALL_POLL_S = (0.02, 0.5)  # KV held by another client of the executor: look again, backing off to 0.5 s
KEEP_ALIVE_RETRY_S = 1.0
MAX_RELEASES_PER_STEP = 4096  # the contract's limit on release_cache_ids


class ExecutorCalls:
    """One engine's calls to its executor. info: the executor's info as the engine knows it now (it changes
    when recovery adopts an executor back); on_info: a fresh GetInfo answer of the same instance."""

    def __init__(self, client: ExecutorClient, session: ExecutorSession, policy: SchedulingPolicy,
                 recovery: Recovery, streams: OutputProcessor, masks: StepMasks, bursts: DecodeBursts,
                 clock: Callable[[], float], info: Callable[[], ExecutorInfo],
                 on_info: Callable[[ExecutorInfo], None]) -> None:
        self.client, self.session, self.policy, self.recovery = client, session, policy, recovery
        self.planner = policy.planner
        self.streams, self.masks, self.bursts, self.clock = streams, masks, bursts, clock
        self._info, self._on_info = info, on_info

    @property
    def up(self) -> bool:
        return self.recovery.up

    @property
    def releases_ride(self) -> bool:  # (the executor applies release_cache_ids)
        return RELEASE_WITH_STEP in self._info().capabilities

    async def refresh_info(self) -> None:
        """Re-reads the executor's info (adapters loaded since, KV). A slow or failed answer keeps what the
        scheduler knew; no answer, or another instance, is the executor's loss."""
        if not self.up:
            return
        try:
            info = codec.executor_info_from_pb(await self.client.info())
        except (ExecutorUnreachable, RemoteError) as exc:
            self._failed(exc, Call.INFO, "keeping the executor's last info")
            return
        if info.instance_id != self._info().instance_id:
            self.recovery.lost(f"executor {self.client.address} restarted (instance {self._info().instance_id!r} is "
                               f"now {info.instance_id!r}): its caches are gone")
            return
        self._on_info(info)
        self.policy.kv = info.kv

    async def step(self, plan: StepPlan) -> tuple[StepAnswer | None, int]:
        """Sends the plan (with the pending releases when they ride along). None: no result to apply (the
        failure was handled: a loss, a refused burst to send again, an error that ended the step's requests)."""
        started, losses = self.clock(), self.recovery.losses
        steps = self.bursts.steps(plan, bool(self.policy.waiting), self.policy.kv, self._info().capabilities,
                                  self.planner.speculator)
        release = self.policy.releases.take(MAX_RELEASES_PER_STEP) if self.releases_ride else []
        try:
            if steps > 1:  # a burst: several decode steps on the executor (scheduler/engine/decode_bursts.py)
                resp = await self.client.decode(self.bursts.to_pb(plan), steps, self.session.id, release=release)
            else:
                items = codec.step_to_pb(plan, REGISTERED_SAMPLING in self._info().capabilities)
                await self.masks.attach(plan, items)  # (returns at once when no item is constrained)
                resp = await self.client.unified_decode(items, self.session.id, release=release)
        except (ExecutorUnreachable, RemoteError) as exc:
            self.policy.releases.failed(release)  # releasing is idempotent: they go again (or stale, if lost)
            if losses == self.recovery.losses:
                if isinstance(exc, RemoteError) and self.bursts.refused(steps, exc):
                    self.policy.step_refused(plan)  # nothing ran: the step goes again, in fewer steps
                else:
                    await self._step_failed(plan, exc)
            return None, steps
        results = codec.item_results_from_pb(resp)
        if losses != self.recovery.losses:  # declared lost meanwhile (by a handler's GetInfo): the plan was requeued
            self.policy.releases.keep_stale([r.cache_id for r in results if r.cache_id] + release)
            return None, steps
        if not self.session.id and _names_unknown_cache(plan, results):  # no sessions: a restart shows as
            await self.refresh_info()  # unknown caches; a new instance id says so (refresh_info starts recovery)
            if not self.up:
                self.policy.releases.keep_stale([r.cache_id for r in results if r.cache_id])
                return None, steps
        self.session.renewed(started)
        drafting_s = getattr(resp, "draft_model_ms", 0.0) / 1e3  # (a DecodeResponse has none)
        return StepAnswer(results, kv_usage_from_pb(resp.kv), self.clock() - started, drafting_s), steps

    async def _step_failed(self, plan: StepPlan, exc: ExecutorUnreachable | RemoteError) -> None:
        failure = classify(exc, Call.STEP, self.client.address, bool(self.session.id))
        if failure.verdict is Verdict.LOST:
            self.recovery.lost(failure.reason)
            return
        if failure.verdict is Verdict.CHECK_RESTART:
            await self.refresh_info()  # no sessions: unknown caches may mean a restart (a new instance id)
            if not self.up:
                return
        kv_full = failure.verdict is Verdict.KV_FULL
        self.streams.fail(self.policy.step_failed(plan, exc, kv_full))
        if kv_full:  # someone else took blocks: make room (done), look at the pool, plan again
            await self.refresh_info()
            if not self.policy.running:
                await asyncio.sleep(STALL_POLL_S[0])

    async def match_prefixes(self) -> None:
        """Before admission: the waiting sequences that may be admitted get caches holding the longest prefix
        the executor has cached (CreateCache pins it at once), so admission counts only the blocks they
        still need and the step sends only the rest of their prompts. A failed lookup only means no reuse."""
        # (read each pass: an executor back after a loss may have it on or off)
        self.planner.reuse_prefixes = PREFIX_CACHING in self._info().capabilities
        self.planner.speculator = self.policy.speculator if SPECULATIVE_DRAFTS in self._info().capabilities else None
        if self.policy.speculator is not None:  # model drafts where the executor runs a draft model (--draft-model)
            self.policy.speculator.draft_model = DRAFT_MODEL in self._info().capabilities
        if not self.planner.reuse_prefixes:
            return
        seqs = self.policy.to_match()
        if not seqs:
            return
        items = codec.create_cache_items(seqs)
        losses = self.recovery.losses
        try:
            resp = await self.client.create_caches(items, self.session.id)
        except (ExecutorUnreachable, RemoteError) as exc:
            if losses == self.recovery.losses:
                self._failed(exc, Call.CREATE_CACHE, "these requests start without a reused prefix")
            return
        created, kv = codec.created_caches_from_pb(resp)
        if losses != self.recovery.losses:  # declared lost meanwhile: the caches went with it
            self.policy.releases.keep_stale([c[0] for c in created if c is not None])
            return
        self.policy.kv = kv
        self.policy.attach_prefixes(seqs, created)
        self.streams.prefixes_found(seqs)

    async def release_pending(self) -> None:
        """A ReleaseCache call of its own, for releases no step call carries."""
        if not self.policy.releases.has_pending or not self.up:
            return
        ids = self.policy.releases.take()
        started = self.clock()
        try:
            resp = await self.client.release(ids, self.session.id)
        except (ExecutorUnreachable, RemoteError) as exc:
            failure = self._failed(exc, Call.RELEASE, f"{len(ids)} caches stay held until the session ends",
                                        before_loss=lambda: self.policy.releases.failed(ids))
            if failure is Verdict.RETRY:
                self.policy.releases.failed(ids)  # retried (ReleaseCache is idempotent)
            return
        self.session.renewed(started)
        self.policy.kv = kv_usage_from_pb(resp.kv)

    async def keep_alive_if_due(self) -> None:
        due = self.session.keep_alive_in()
        if due is None or due > 0:
            return
        try:
            await self.session.keep_alive()
        except (ExecutorUnreachable, RemoteError) as exc:
            if self._failed(exc, Call.KEEP_ALIVE) is Verdict.RETRY:
                self.session.retry_keep_alive_in(KEEP_ALIVE_RETRY_S)

    def _failed(self, exc: ExecutorUnreachable | RemoteError, call: Call, consequence: str = "",
                     before_loss: Callable[[], None] | None = None) -> Verdict:
        """A control call failed: a loss starts recovery; anything else is logged (the caller retries)."""
        failure = classify(exc, call, self.client.address, bool(self.session.id))
        if failure.verdict is Verdict.LOST:
            if before_loss is not None:
                before_loss()  # (stale now: released, or their session closed, once the executor is back)
            self.recovery.lost(failure.reason)
        else:  # (a release that failed leaves KV held: an error; the others cost only a retry or a reuse)
            level = logging.ERROR if failure.verdict is Verdict.FAILED and call is Call.RELEASE else logging.WARNING
            log.log(level, "%s; %s", failure.reason, consequence or "retrying")
        return failure.verdict


def _names_unknown_cache(plan: StepPlan, results: list[ItemResult]) -> bool:
    """Whether an item that named an existing cache failed NOT_FOUND (the executor no longer holds it): the one
    question asked of an answer without sessions, where an executor's restart shows only this way."""
    return any(isinstance(r.error, RemoteError) and r.error.status_name == "NOT_FOUND" and item.seq.cache_id
               for item, r in zip(plan.items, results))

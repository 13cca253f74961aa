"""The continuous-batching loop: moves data between the scheduling policy (scheduler/policy.py, synchronous),
the executor client (scheduler/executor_client.py) and each request's output stream.

Everything runs on the server's asyncio loop (no locks): gRPC handlers submit and abort requests; the loop
task asks the policy for a step, awaits the executor, hands the step's results back to the policy, streams
the deltas and releases the caches the policy retired.

What the loop concludes from the executor's answers: the transport failed, a step got no answer in time,
the instance id changed, or the executor forgot our session (NOT_FOUND on a call naming it) — the executor
is lost, and scheduler/recovery.py requeues everything for recompute until one serves again. A slow control
call (DEADLINE_EXCEEDED of GetInfo, KeepAlive, ReleaseCache) or any other error of one is only retried; it
never ends the loop. An item that failed alone ends its request; a step answered with an error ends the
step's requests, unless it is KV exhaustion (preempt, plan again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Iterator


import grpc

from scheduler import codec
from scheduler.config import SchedulerConfig
from scheduler.decode_bursts import DecodeBursts
from scheduler.executor_client import ExecutorClient, ExecutorUnreachable, is_kv_exhaustion
from scheduler.policy import Failure, SchedulingPolicy
from scheduler.recovery import Recovery
from scheduler.request import GenerateRequest
from scheduler.request_output import RequestOutput
from scheduler.sequence import Sequence
from scheduler.session import ExecutorSession
from scheduler.speculation import SPECULATIVE_DRAFTS
from scheduler.token_masks import MaskWorker, StepMasks
from tandem.codec import kv_usage_from_pb
from tandem.errors import RemoteError, Unavailable
from tandem.executor.v1 import executor_pb2 as epb

if TYPE_CHECKING:
    from scheduler.metrics import SchedulerMetrics

log = logging.getLogger("tandem.scheduler")
_STALL_POLL_S = (0.02, 0.5)  # KV held by another client of the executor: look again, backing off to 0.5 s
_KEEP_ALIVE_RETRY_S = 1.0
_STATS_EVERY_S = 10.0
REGISTERED_SAMPLING = "registered_sampling"  # GetInfo capability: sampling is registered with the cache
PREFIX_CACHING = "prefix_caching"  # GetInfo capability: CreateCache reuses cached prompt prefixes


class Engine:
    def __init__(self, cfg: SchedulerConfig, client: ExecutorClient, tokenizer, info: epb.GetInfoResponse,
                 on_health: Callable[[bool], None] = lambda up: None, clock: Callable[[], float] = time.monotonic,
                 client_name: str = "tandem-scheduler", arrivals: Iterator[int] | None = None,
                 metrics: "SchedulerMetrics | None" = None, mask_worker: MaskWorker | None = None) -> None:
        """arrivals: the numbering of requests (shared by the engines of one fleet: a moved request keeps its
        place in the queue of another). metrics: where requests report their latencies and endings.
        mask_worker: the thread computing token masks (shared by the engines of one fleet; None = its own)."""
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        self.clock = clock
        self.metrics = metrics
        self.policy = SchedulingPolicy(cfg, kv_usage_from_pb(info.kv), info.max_batch_tokens,
                                       info.max_adapters_on_device, clock, arrivals)
        self.planner = self.policy.planner
        self.session = ExecutorSession(client, client_name, clock)
        self.outputs: dict[Sequence, RequestOutput] = {}
        self.masks = StepMasks(mask_worker or MaskWorker(info.vocab_size))  # constrained sequences' token masks
        self.up = True  # the executor answers, and our session on it is open
        self.closed = False  # drained: the loop and the reconnect task end
        self.recovery = Recovery(self, on_health)
        self.steps = 0
        self.bursts = DecodeBursts(cfg.bursts)
        self._wake = asyncio.Event()
        self._stall_poll_s = _STALL_POLL_S[0]
        self._stepping = False
        self._stopping = False
        self._stats = (time.monotonic(), 0)

    @property
    def _registered_sampling(self) -> bool:
        return REGISTERED_SAMPLING in self.info.capabilities

    # ----------------------------------------------------------------- requests (called by the servicer)
    def submit(self, request: GenerateRequest) -> tuple[Sequence, RequestOutput]:
        """Queues a request. While the executor is away (within the retry window) it is queued too, and runs
        when it is back; once the window has passed, or the executor came back unfit, it fails at once."""
        if self._stopping:
            raise Unavailable("the scheduler is shutting down; retry on another one")
        if not self.up and self.recovery.refusal:
            raise ExecutorUnreachable(self.recovery.refusal)
        self.policy.check_admissible(len(request.prompt_ids), request.stopping.max_new_tokens)
        seq = Sequence(request, self.policy.next_arrival(), self.info.eos_token_ids, self.info.max_seq_len,
                       codec.executor_sampling(request, self.info.eos_token_ids))
        output = RequestOutput(request, self.tokenizer, self.metrics)
        self.outputs[seq] = output
        self.policy.add(seq)
        self._wake.set()
        return seq, output

    def abort(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline) or its stream ended: drop the sequence, free its cache."""
        output = self.outputs.pop(seq, None)
        if output is not None and not output.finished:
            log.info("a request was cancelled by the client after %d tokens", len(seq.output_ids))
            output.cancelled()
        self.policy.abort(seq)
        self._wake.set()

    async def refresh_info(self) -> None:
        """Re-reads the executor's info (adapters loaded since, KV). A slow or failed answer keeps what the
        scheduler knew; no answer, or another instance, is the executor's loss."""
        if not self.up:
            return
        try:
            info = await self.client.info()
        except ExecutorUnreachable as exc:
            self.recovery.lost(str(exc))
            return
        except RemoteError as exc:
            log.warning("GetInfo answered %s; keeping the executor's last info", exc)
            return
        if info.instance_id != self.info.instance_id:
            self.recovery.lost(f"executor {self.client.address} restarted (instance {self.info.instance_id!r} is "
                                f"now {info.instance_id!r}): its caches are gone")
            return
        self.info = info
        self.policy.kv = kv_usage_from_pb(info.kv)

    # ----------------------------------------------------------------- the loop
    async def start(self) -> None:
        """Opens the scheduler's session on the executor (before run())."""
        try:
            await self.session.open(self.info.session_ttl_ms)
        except ExecutorUnreachable as exc:
            self.recovery.lost(f"cannot open a session on executor {self.client.address}: {exc}")
            return
        if self.session.id:
            log.info("session %s on executor %s (lease %.0f s)", self.session.id, self.client.address,
                     self.session.ttl_s)

    async def run(self) -> None:
        while not self.closed:
            if not self.up:  # the reconnect task wakes us once the executor is back
                await self._sleep(None)
                continue
            self.fail(self.policy.expire_waiting())
            await self._release_pending()
            await self._keep_alive_if_due()
            if not self.up:
                continue
            if not self.policy.has_work:
                if not self.policy.has_releases:
                    await self._sleep(self.session.keep_alive_in())
                continue
            self._stepping = True
            try:
                await self._step()
            finally:
                self._stepping = False

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests, lets running ones finish for up to grace_s, aborts the rest, releases what
        it can and closes the session (the executor frees whatever the session still holds)."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self.policy.has_work and self.up and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for seq in self.policy.abort_all():
            output = self.outputs.get(seq)
            if output is not None:
                output.abort(seq.preemptions)
        # The step in progress must return before its caches can be released; never wait past the grace
        # (at least a second, so a step about to return still gets its caches freed).
        step_deadline = max(deadline, time.monotonic() + 1.0)
        while self._stepping and time.monotonic() < step_deadline:
            await asyncio.sleep(0.01)
        self.closed = True
        self.recovery.stop()
        if self.up:
            await self._release_pending()
            try:
                await self.session.close()
            except (ExecutorUnreachable, RemoteError) as exc:
                log.warning("closing the session failed (%s); the executor frees its caches after the lease", exc)
        self._wake.set()

    async def _sleep(self, timeout_s: float | None) -> None:
        """Waits for a wake-up (a request, an abort, the executor's return) or the timeout."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), None if timeout_s is None else max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass

    async def _step(self) -> None:
        policy = self.policy
        await self._match_prefixes()
        if not self.up:
            return
        plan = policy.schedule()
        for seq in plan.admitted:
            output = self.outputs.get(seq)
            if output is not None:
                output.admitted()
        if plan.preempted or plan.unpinned:
            await self._release_pending()  # the plan counts on the victims' blocks being free
            if not self.up:
                return
        if not plan.items:
            # (else: plan again with what releasing the waiting prefixes freed, or after the lookup)
            if not plan.unpinned and not plan.head_needs_lookup:
                await self._stalled()
            return
        started, losses = self.clock(), self.recovery.losses
        steps = self.bursts.steps(plan, bool(policy.waiting), policy.kv, self.info.capabilities,
                                  self.planner.speculator is not None)
        try:
            if steps > 1:  # a burst: several decode steps on the executor (scheduler/decode_bursts.py)
                resp = await self.client.decode(codec.burst_to_pb(plan), steps, self.session.id)
            else:
                items = codec.step_to_pb(plan, self._registered_sampling)
                await self.masks.attach(plan, items)  # (returns at once when no item is constrained)
                resp = await self.client.unified_decode(items, self.session.id)
        except ExecutorUnreachable as exc:
            if losses == self.recovery.losses:
                self.recovery.lost(str(exc))
            return
        except RemoteError as exc:
            if losses == self.recovery.losses:
                if self.bursts.refused(steps, exc):  # nothing ran: the step goes again, in fewer steps
                    self.policy.step_refused(plan)
                else:
                    await self._step_error(plan, exc)
            return
        if losses != self.recovery.losses:  # declared lost meanwhile (by a handler's GetInfo): the plan was requeued
            self.policy.keep_stale([r.cache.cache_id for r in resp.results if r.cache.cache_id])
            return
        if not self.session.id and _names_unknown_cache(plan, resp):  # no sessions: a restart shows as unknown
            await self.refresh_info()  # caches; a new instance id says so (refresh_info then starts recovery)
            if not self.up:
                self.policy.keep_stale([r.cache.cache_id for r in resp.results if r.cache.cache_id])
                return
        self.session.renewed(started)
        self.bursts.observe(plan, steps, self.clock() - started)
        self.steps += 1
        self._stall_poll_s = _STALL_POLL_S[0]
        outcome = policy.update(plan, codec.item_results_from_pb(resp), kv_usage_from_pb(resp.kv))
        self.masks.prefetch(policy.running)  # the next step's masks, computed while the loop streams and plans
        self.fail(outcome.failed)
        touched: dict[RequestOutput, None] = {}  # (ordered) streams with new tokens: one message each
        for e in outcome.emitted:
            output = self.outputs.get(e.seq)
            if output is None or output.finished:  # (a stop string ended it earlier in this step's run)
                continue
            output.drafted_tokens, output.accepted_tokens = e.seq.drafted_tokens, e.seq.accepted_tokens
            ended = output.add(e.token, e.finish, e.seq.preemptions)
            if ended is not None and e.finish is None:  # a stop string: only the text showed it
                policy.finish(e.seq)
            touched[output] = None
        for output in touched:
            output.publish()
        if outcome.drafted and self.metrics is not None:
            self.metrics.speculated(outcome.drafts, outcome.drafted, outcome.accepted)
        self._log_stats(len(outcome.emitted) if steps > 1 else sum(item.count for item in plan.items))

    async def _match_prefixes(self) -> None:
        """Before admission: the waiting sequences that may be admitted get caches holding the longest prefix
        the executor has cached (CreateCache pins it at once), so admission counts only the blocks they
        still need and the step sends only the rest of their prompts. A failed lookup only means no reuse."""
        # (read each step: an executor back after a loss may have it on or off)
        self.planner.reuse_prefixes = PREFIX_CACHING in self.info.capabilities
        self.planner.speculator = self.policy.speculator if SPECULATIVE_DRAFTS in self.info.capabilities else None
        if not self.planner.reuse_prefixes:
            return
        seqs = self.policy.to_match()
        if not seqs:
            return
        items = [epb.CreateCacheItem(token_ids=s.token_slice(0, s.num_tokens), adapter=s.request.adapter)
                 for s in seqs]
        losses = self.recovery.losses
        try:
            resp = await self.client.create_caches(items, self.session.id)
        except ExecutorUnreachable as exc:
            if losses == self.recovery.losses:
                self.recovery.lost(str(exc))
            return
        except RemoteError as exc:
            if exc.status_name == "NOT_FOUND" and self.session.id and losses == self.recovery.losses:
                self.recovery.lost(f"executor {self.client.address} no longer knows this scheduler's session: {exc}")
            else:
                log.warning("CreateCache answered %s; these requests start without a reused prefix", exc)
            return
        if losses != self.recovery.losses:  # declared lost meanwhile: the caches went with it
            self.policy.keep_stale([r.cache.cache_id for r in resp.results if r.cache.cache_id])
            return
        self.policy.kv = kv_usage_from_pb(resp.kv)
        self.policy.attach_prefixes(seqs, [None if r.status.code else (r.cache.cache_id, r.cache.seq_len)
                                           for r in resp.results])
        for seq in seqs:
            output = self.outputs.get(seq)
            if output is not None and seq.prefix_hit:
                output.cached_tokens = seq.prefix_hit

    async def _step_error(self, plan, exc: RemoteError) -> None:
        if exc.status_name == "DEADLINE_EXCEEDED":  # no answer in time: whether the step ran is unknown
            self.recovery.lost(f"a step got no answer from executor {self.client.address} in time ({exc})")
            return
        if exc.status_name == "NOT_FOUND":
            if self.session.id:  # the whole call NOT_FOUND names the session: the executor forgot it
                self.recovery.lost(f"executor {self.client.address} no longer knows this scheduler's session "
                                    f"(expired, or the executor restarted): {exc}")
                return
            await self.refresh_info()  # no sessions: unknown caches may mean a restart (a new instance id)
            if not self.up:
                return
        kv_full = is_kv_exhaustion(exc)
        self.fail(self.policy.step_failed(plan, exc, kv_full))
        if kv_full:  # someone else took blocks: make room (done), look at the pool, plan again
            await self.refresh_info()
            if not self.policy.running:
                await asyncio.sleep(_STALL_POLL_S[0])

    async def _stalled(self) -> None:
        """No item fits this step. Preempt if our own sequences hold the blocks; fail a request that cannot
        fit even an empty cache; otherwise the blocks are held elsewhere: look again after a pause that
        grows to _STALL_POLL_S[1] (the head's wait ends at cfg.max_queue_time_s in any case)."""
        if self.policy.preempt_for_stall():
            return
        await self._release_pending()
        await self.refresh_info()
        if not self.up:
            return
        head = self.policy.drop_unfittable_head()
        if head is not None:
            self.fail([head])
            return
        await asyncio.sleep(self._stall_poll_s)
        self._stall_poll_s = min(self._stall_poll_s * 2, _STALL_POLL_S[1])

    async def _release_pending(self) -> None:
        if not self.policy.has_releases or not self.up:
            return
        ids = self.policy.take_releases()
        started = self.clock()
        try:
            resp = await self.client.release(ids, self.session.id)
        except ExecutorUnreachable as exc:
            self.policy.release_failed(ids)  # stale now: released (or their session closed) once it is back
            self.recovery.lost(str(exc))
            return
        except RemoteError as exc:
            if exc.status_name == "NOT_FOUND" and self.session.id:
                self.policy.release_failed(ids)
                self.recovery.lost(f"executor {self.client.address} no longer knows this scheduler's session: "
                                    f"{exc}")
            elif exc.status_name == "DEADLINE_EXCEEDED":
                self.policy.release_failed(ids)  # retried (ReleaseCache is idempotent)
            else:
                log.error("ReleaseCache of %d caches failed: %s", len(ids), exc)
            return
        self.session.renewed(started)
        self.policy.kv = kv_usage_from_pb(resp.kv)

    async def _keep_alive_if_due(self) -> None:
        due = self.session.keep_alive_in()
        if due is None or due > 0:
            return
        try:
            await self.session.keep_alive()
        except ExecutorUnreachable as exc:
            self.recovery.lost(str(exc))
        except RemoteError as exc:
            if exc.status_name == "NOT_FOUND":
                self.recovery.lost(f"executor {self.client.address} no longer knows this scheduler's session: "
                                    f"{exc}")
            else:
                log.warning("KeepAlive answered %s; retrying", exc)
                self.session.retry_keep_alive_in(_KEEP_ALIVE_RETRY_S)

    # ----------------------------------------------------------------- moving requests (several executors)
    def take_waiting(self) -> list[tuple[Sequence, RequestOutput]]:
        """Removes every queued request (with its stream) for another engine to run: after this executor's
        loss they hold no cache here (policy.executor_lost) and are recomputed there from prompt + outputs."""
        moved = [(seq, self.outputs.pop(seq)) for seq in self.policy.take_waiting() if seq in self.outputs]
        return moved

    def adopt(self, seq: Sequence, output: RequestOutput) -> None:
        """Queues a request another engine gave up (take_waiting): it keeps its place by arrival."""
        self.outputs[seq] = output
        self.policy.add(seq)
        self._wake.set()

    # ----------------------------------------------------------------- failures
    def wake(self) -> None:
        """Ends the loop's wait (a request, an abort, the executor's return)."""
        self._wake.set()

    def fail(self, failures: list[Failure]) -> None:
        """Ends these requests' streams with their errors."""
        for f in failures:
            output = self.outputs.get(f.seq)
            if output is not None:
                output.fail(f.error)

    def _log_stats(self, tokens: int) -> None:
        since, count = self._stats
        count += tokens
        now = time.monotonic()
        if now - since >= _STATS_EVERY_S:
            kv = self.policy.kv
            used = 1 - kv.free_blocks / max(1, kv.total_blocks)
            log.info("%d running, %d waiting, KV %.0f%% used, %.1f tokens/s through the model, %d preemptions",
                     len(self.policy.running), len(self.policy.waiting), 100 * used, count / (now - since),
                     self.policy.preemptions)
            since, count = now, 0
        self._stats = (since, count)


def _names_unknown_cache(plan, resp) -> bool:
    """Whether an item that named an existing cache failed NOT_FOUND (the executor no longer holds it)."""
    return any(r.status.code == grpc.StatusCode.NOT_FOUND.value[0] and item.seq.cache_id
               for item, r in zip(plan.items, resp.results))

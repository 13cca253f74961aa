"""The continuous-batching loop for one executor: moves data between the scheduling policy
(scheduler/engine/policy.py, synchronous), the executor client and the output processor (the client streams).

Words: a *pass* is one turn of the loop; a *step call* is the one UnifiedDecode (or multi-step Decode) RPC a
pass sends; a *decode step* is one forward on the executor (a burst runs several per call).

Everything runs on the server's asyncio loop (no locks). In steady state a pass is one RPC: the caches the
policy retired ride with the next step call (capability "release_with_step") and the step renews the session's
lease; ReleaseCache goes alone only when no step follows or to an older executor, KeepAlive only when idle,
CreateCache when new requests may reuse cached prefixes. The calls themselves and what their failures mean:
scheduler/engine/executor_calls.py; the executor's loss and return: scheduler/engine/recovery.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterator

from scheduler.engine import executor_codec as codec
from scheduler.engine.admission import next_expiry
from scheduler.config import SchedulerConfig
from scheduler.engine.decode_bursts import DecodeBursts
from scheduler.engine.executor_calls import STALL_POLL_S, ExecutorCalls
from scheduler.executor.client import ExecutorClient, ExecutorUnreachable
from scheduler.executor.info import ExecutorInfo, ExecutorStats, adapters_of
from scheduler.output.output_processor import OutputProcessor
from scheduler.engine.policy import SchedulingPolicy
from scheduler.engine.recovery import Recovery
from scheduler.request import GenerateRequest
from scheduler.output.request_events import RequestEvents
from scheduler.output.request_stream import RequestStream
from scheduler.sequence import Sequence
from scheduler.executor.session import ExecutorSession
from scheduler.engine.throughput_log import ThroughputLog
from scheduler.engine.token_masks import MaskWorker, StepMasks
from scheduler.vision.image_chunks import longest_span
from tandem.errors import RemoteError, Unavailable

log = logging.getLogger("tandem.scheduler")


class Engine:
    def __init__(self, cfg: SchedulerConfig, client: ExecutorClient, tokenizer, info: ExecutorInfo,
                 on_health: Callable[[bool], None] = lambda up: None, clock: Callable[[], float] = time.monotonic,
                 client_name: str = "tandem-scheduler", arrivals: Iterator[int] | None = None,
                 events: RequestEvents | None = None, mask_worker: MaskWorker | None = None) -> None:
        """arrivals: the numbering of requests (shared by the engines of one fleet: a moved request keeps its
        place in the queue of another). events: where requests report their latencies and endings (the
        metrics). mask_worker: the thread computing token masks (shared by a fleet's engines; None = its own)."""
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        self.clock = clock
        self.policy = SchedulingPolicy(cfg, info.kv, info.max_batch_tokens, info.max_adapters_on_device, clock,
                                       arrivals, device=info.device)
        self.planner, self.session = self.policy.planner, ExecutorSession(client, client_name, clock)
        self.streams = OutputProcessor(tokenizer, events)
        self.masks = StepMasks(mask_worker or MaskWorker(info.vocab_size))  # constrained sequences' token masks
        self.closed = False  # drained: the loop and the reconnect task end
        self.recovery = Recovery(cfg, client, self.session, self.policy, clock, lambda: self.info, self._adopt,
                                 self.streams.fail, on_health, lambda: self.closed)
        self.step_calls = 0
        self.bursts = DecodeBursts(cfg.bursts)
        self.calls = ExecutorCalls(client, self.session, self.policy, self.recovery, self.streams, self.masks,
                                   self.bursts, clock, lambda: self.info, self._fresh_info)
        self._wake = asyncio.Event()
        self._stall_poll_s = STALL_POLL_S[0]
        self._stepping = False
        self._stopping = False
        self._throughput = ThroughputLog(self.policy)
        self.held = False  # the loop waits between passes while a migration moves requests (hold())
        self.after_step: Callable[[], None] = lambda: None  # the fleet's look at a step's results (roles)
        self._expiry: asyncio.TimerHandle | None = None  # at the first queued request's --max-queue-time-s

    @property
    def up(self) -> bool:
        """The executor answers, and our session on it is open."""
        return self.recovery.up

    def stats(self) -> ExecutorStats:
        r, kv, serving, m, p = self.recovery, self.policy.kv, self.recovery.up, self.masks.stats, self.policy
        return ExecutorStats(self.client.address, "serving" if serving else "refused" if r.unfit else "unreachable",
                             "" if serving else (r.unfit or r.reason), len(p.running), len(p.waiting),
                             kv.free_blocks, kv.cached_blocks, kv.total_blocks, self.info.device if serving else "",
                             self.info.instance_id if serving else "", p.preemptions, self.step_calls, r.losses,
                             m.masks, m.compute_s, m.wait_s, adapters_of(p.running), adapters_of(p.waiting),
                             self.info.max_adapters_on_device, kv.block_size)

    # ----------------------------------------------------------------- requests (called by the fleet)
    def check_overload(self) -> None:
        """As Fleet.check_overload, for a servicer driving one engine: Overloaded when its queue would refuse."""
        self.policy.check_overload()

    def submit(self, request: GenerateRequest) -> tuple[Sequence, RequestStream]:
        """Queues a request. While the executor is away (within the retry window) it is queued too, and runs
        when it is back; once the window has passed, or the executor came back unfit, it fails at once."""
        if self._stopping:
            raise Unavailable("the scheduler is shutting down; retry on another one")
        if not self.up and self.recovery.refusal:
            raise ExecutorUnreachable(self.recovery.refusal)
        self.policy.check_admissible(len(request.prompt_ids), request.stopping.max_new_tokens,
                                     longest_span(request.images))
        seq = Sequence(request, self.policy.next_arrival(), self.info.eos_token_ids, self.info.max_seq_len,
                       codec.executor_sampling(request, self.info.eos_token_ids))
        stream = self.streams.open(seq, request)
        self.policy.add(seq)
        if request.received_at is not None:  # (the policy's clock is time.monotonic here: the fronts' clock)
            seq.queued_at = min(seq.queued_at, request.received_at)
        self._arm_expiry()
        self._wake.set()
        return seq, stream

    def abort(self, seq: Sequence) -> None:
        """The client went away (cancel, deadline) or its stream ended: drop the sequence, free its cache."""
        self.streams.cancel(seq)
        self.policy.abort(seq)
        self._wake.set()

    def take_waiting(self) -> list[tuple[Sequence, RequestStream]]:
        """Removes every queued request (with its stream) for another engine to run: after this executor's
        loss they hold no cache here (policy.executor_lost) and are recomputed there from prompt + outputs."""
        return self.streams.take(self.policy.take_waiting())

    def adopt(self, seq: Sequence, stream: RequestStream) -> None:
        """Queues a request another engine gave up (take_waiting): it keeps its place by arrival."""
        self.streams.adopt(seq, stream)
        self.policy.add(seq)
        self._arm_expiry()
        self._wake.set()

    def wake(self) -> None:
        """Ends the loop's wait (a request, an abort, the executor's return)."""
        self._wake.set()


    async def refresh_info(self) -> None:
        """Re-reads the executor's info (scheduler/engine/executor_calls.py)."""
        await self.calls.refresh_info()

    def _fresh_info(self, info: ExecutorInfo) -> None:
        """A new GetInfo answer of the same executor instance (adapters loaded since, KV)."""
        self.info = info

    def _adopt(self, info: ExecutorInfo) -> None:
        """An executor serves again (recovery checked it serves our model): its limits, adapters, queue."""
        self.info = info
        self.policy.reconfigure(info.kv, info.max_batch_tokens, info.max_adapters_on_device, info.device)
        self.streams.fail(self.policy.drop_missing_adapters(set(info.adapters)))
        self.policy.restart_queue_clocks()
        self._disarm_expiry()
        self._arm_expiry()
        self._wake.set()

    # ----------------------------------------------------------------- the queue bound, on time
    def _arm_expiry(self) -> None:
        """A timer at the first queued request's --max-queue-time-s (unless one is set already: the requests
        queued since reach theirs later). The bound is kept while a step call is in flight or the loop waits:
        ending a request that never ran touches nothing the step holds."""
        if self._expiry is not None or self.closed:
            return
        due = next_expiry(self.cfg, self.policy.waiting)
        if due is not None:
            # (at least 1 ms: a bound due now by one clock's rounding and not yet by expired()'s never spins)
            self._expiry = asyncio.get_running_loop().call_later(max(0.001, due - self.clock()), self._expire)

    def _disarm_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _expire(self) -> None:
        self._expiry = None
        if not self.up or self.held:  # the loop arms it again when it runs (the executor back: clocks restarted)
            return
        self.streams.fail(self.policy.expire_waiting())
        if self.policy.releases.has_pending:
            self._wake.set()  # (the loop releases the prefixes they reused)
        self._arm_expiry()

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
            if not self.up or self.held:  # the reconnect task (or the migration) wakes us
                await self._sleep(None)
                continue
            self.streams.fail(self.policy.expire_waiting())
            self._arm_expiry()
            if not (self.policy.has_work and self.calls.releases_ride):
                await self.calls.release_pending()  # (else they ride with this pass's step call)
            await self.calls.keep_alive_if_due()
            if not self.up:
                continue
            if not self.policy.has_work:
                if not self.policy.releases.has_pending:
                    await self._sleep(self.session.keep_alive_in())
                continue
            self._stepping = True
            try:
                await self._pass()
            finally:
                self._stepping = False

    async def hold(self) -> None:
        """Holds the loop between passes (until held is False again and wake()): returns once no step call is
        in flight, so a migration can take running requests (scheduler/fleet/kv_migration.py)."""
        self.held = True
        while self._stepping:
            await asyncio.sleep(0.002)

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests, lets running ones finish for up to grace_s, aborts the rest, releases what
        it can and closes the session (the executor frees whatever the session still holds)."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self.policy.has_work and self.up and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.streams.abort(self.policy.abort_all())
        # The step in progress must return before its caches can be released; never wait past the grace
        # (at least a second, so a step about to return still gets its caches freed).
        step_deadline = max(deadline, time.monotonic() + 1.0)
        while self._stepping and time.monotonic() < step_deadline:
            await asyncio.sleep(0.01)
        self.closed = True
        self._disarm_expiry()
        self.recovery.stop()
        if self.up:
            await self.calls.release_pending()
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


    async def _pass(self) -> None:
        policy = self.policy
        await self.calls.match_prefixes()
        if not self.up:
            return
        plan = policy.schedule()
        self.streams.admitted(plan.admitted)
        if not plan.items:
            await self.calls.release_pending()  # no step call to ride with (the plan may count on these blocks)
            # (else: plan again with what releasing the waiting prefixes freed, or after the lookup)
            if self.up and not plan.unpinned and not plan.head_needs_lookup:
                await self._stalled()
            return
        if not self.calls.releases_ride and (plan.preempted or plan.unpinned):
            await self.calls.release_pending()  # the plan counts on the victims' blocks being free
            if not self.up:
                return
        resp, steps = await self.calls.step(plan)
        if resp is None:
            return
        self.bursts.observe(plan, steps, resp.elapsed_s)
        self.step_calls += 1
        self._stall_poll_s = STALL_POLL_S[0]
        outcome = policy.update(plan, resp.results, resp.kv)
        outcome.seconds = resp.elapsed_s
        if policy.speculator is not None:
            policy.speculator.observe_step(plan.items, steps, resp.elapsed_s, outcome, resp.draft_model_s)
        self.masks.prefetch(policy.running)  # the next step's masks, computed while the loop streams and plans
        for seq in self.streams.process(outcome):  # a stop string ended it: only the text showed it
            policy.abort(seq)
        cfg = self.cfg
        for seq in self.streams.stalled(cfg.stream_stall_timeout_s, cfg.stream_max_buffered):
            policy.abort(seq)
        self._throughput.add(len(outcome.emitted) if steps > 1 else sum(item.count for item in plan.items))
        self.after_step()

    async def _stalled(self) -> None:
        """No item fits this step. Preempt if our own sequences hold the blocks; fail a request that cannot
        fit even an empty cache; otherwise the blocks are held elsewhere: look again after a pause that
        grows to STALL_POLL_S[1] (the head's wait ends at cfg.max_queue_time_s in any case)."""
        if self.policy.preempt_for_stall():
            return
        await self.calls.release_pending()
        await self.refresh_info()
        if not self.up:
            return
        head = self.policy.drop_unfittable_head()
        if head is not None:
            self.streams.fail([head])
            return
        await asyncio.sleep(self._stall_poll_s)
        self._stall_poll_s = min(self._stall_poll_s * 2, STALL_POLL_S[1])

"""The scheduling policy as a synchronous object: no asyncio, no I/O.

It owns the waiting and running queues, admission, the step plan (scheduler/engine/planner.py) and the preemption
choice, and applies a step's results; the caches to release are in its ledger (scheduler/engine/release_ledger.py).
Time comes from an injected clock, so tests drive it by hand. A thin async loop (scheduler/engine/engine.py) moves
data between it, the executor client and the client streams, in the shape of vLLM V1's `schedule()` /
`update_from_output()`:

    plan = policy.schedule()                   # which sequences, how many tokens (preemptions applied)
    ids = policy.releases.take()               # caches to release on the executor (before plan.items run)
    results = <the executor runs plan.items>   # one step call (the releases ride with it)
    outcome = policy.update(plan, results, kv) # tokens appended, finished and failed sequences retired

Admission and the step plan follow the planner's rules (scheduler/engine/planner.py). Failure rules (each returns
the requests that end, with their error, for the loop to report):
- an item the executor failed alone (its result's status) ends that request only; the step's others go on;
- a step answered with an error: KV exhaustion preempts the youngest running sequence and the step is planned
  again; any other error (a message over the size limit included) ends the step's requests with it;
- no answer, or an executor that restarted or forgot our session (executor_lost): nothing ends — every
  running sequence is requeued with its cache forgotten (the old executor's caches are gone), outputs kept,
  and recomputed once an executor serves again, exactly as after a preemption. The loop decides when that
  has taken too long (fail_all);
- overload is refused at the door (check_overload), and a request not admitted a first time within
  max_queue_time_s ends (expire_waiting): scheduler/engine/admission.py.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time
from typing import Callable, Iterator

from scheduler.config import SchedulerConfig, step_tokens_default
from scheduler.engine.admission import expired, overload, span_too_long, too_big
from scheduler.engine.drain_rate import DrainRate
from scheduler.engine.planner import Planner, StepPlan
from scheduler.engine.prefix_wait import shared_prefix
from scheduler.engine.release_ledger import ReleaseLedger
from scheduler.sequence import Sequence, Status
from scheduler.engine.speculation import Speculator
from scheduler.engine.step_answer import ItemResult
from scheduler.output.step_outcome import Emitted, Failure, Pooled, StepOutcome
from tandem.errors import AdapterNotFound, CapacityExceeded, Overloaded, RemoteError, TandemError
from tandem.kv_usage import KvUsage

log = logging.getLogger("tandem.scheduler")
MAX_MATCH_PER_STEP = 256  # CreateCache items per call (the executor's limit)


class SchedulingPolicy:
    def __init__(self, cfg: SchedulerConfig, kv: KvUsage, executor_max_batch_tokens: int = 0,
                 max_adapters: int = 0, clock: Callable[[], float] = time.monotonic,
                 arrivals: Iterator[int] | None = None, device: str = "") -> None:
        self.cfg = cfg
        self.planner = Planner(self._budget(executor_max_batch_tokens, device), cfg.max_running, cfg.prefill_chunk,
                               max_adapters)
        self.kv = kv
        self.clock = clock
        # Drafts (--speculative): the engine hands it to the planner while the executor verifies drafts.
        self.speculator = Speculator(cfg.speculative) if cfg.speculative.enabled else None
        self.running: list[Sequence] = []  # admitted, oldest arrival first
        self.waiting: list[Sequence] = []  # new or preempted, oldest arrival first
        self.preemptions = 0
        self.wait_reason = ""  # why the head of the queue was not admitted at the last step
        self.head_needs_blocks = False  # ... and it was for KV blocks
        # The running sequences were short of KV blocks at the last plan (or step): no prefixes are reused
        # for waiting ones until a plan fits, or pinning them would take the blocks just freed right back.
        self.short_of_blocks = False
        self._arrivals = arrivals or itertools.count()
        self.releases = ReleaseLedger()  # the caches to release on the executor (scheduler/engine/release_ledger.py)
        self._in_flight: set[Sequence] = set()
        self.drain = DrainRate(clock)  # how fast the batch frees places: estimated waits, Retry-After

    def _budget(self, executor_max_batch_tokens: int, device: str) -> int:  # (--max-batch-tokens, or by device)
        own = self.cfg.max_batch_tokens or step_tokens_default(device, self.cfg.max_running)
        return min(own, executor_max_batch_tokens or own)

    def reconfigure(self, kv: KvUsage, executor_max_batch_tokens: int, max_adapters: int, device: str = "") -> None:
        """An executor (back after a loss) with these limits: the plan adapts to them."""
        self.kv = kv
        self.planner.max_batch_tokens = self._budget(executor_max_batch_tokens, device)
        self.planner.max_adapters = max_adapters

    # ----------------------------------------------------------------- requests
    def next_arrival(self) -> int:
        return next(self._arrivals)

    def check_overload(self) -> None:
        """Raises Overloaded when a new request would be refused for overload (scheduler/engine/admission.py)."""
        if (refusal := overload(self.cfg, self.drain, len(self.waiting), len(self.running))) is not None:
            raise refusal

    def check_admissible(self, prompt_tokens: int, max_new_tokens: int, one_chunk_span: int = 0) -> None:
        """Raises Overloaded, or CapacityExceeded: it never fits the KV pool, or a step (vision/image_chunks.py)."""
        self.check_overload()
        if refusal := (too_big(self.kv, prompt_tokens, max_new_tokens)
                       or span_too_long(one_chunk_span, self.planner.max_batch_tokens)):
            raise refusal

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (check_admissible first), or one moved from another engine."""
        self._enqueue(seq)

    def abort(self, seq: Sequence) -> None:
        """Drops a sequence (client cancel, deadline, shutdown); its cache is released now, or when the step
        that holds it returns."""
        if seq in self.running:
            self._leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq not in self._in_flight and seq.cache_id:
            self.releases.add(seq.cache_id)
            seq.cache_id = ""
        self._forget(seq)
        seq.status = Status.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ----------------------------------------------------------------- a step
    def schedule(self) -> StepPlan:
        """Plans the next step and applies its preemptions and admissions. Release the caches from
        releases.take() before sending plan.items: the plan counts on the preempted sequences' blocks."""
        plan = self.planner.plan(self.running, self.waiting, self.kv)
        for victim in plan.preempted:
            self._preempt(victim)
        for seq in plan.unpinned:
            self._release(seq)
            seq.drop_cache()
        self.short_of_blocks = bool(plan.preempted or plan.unpinned)
        now = self.clock()
        for seq in plan.admitted:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            seq.admitted_at, seq.started = now, True
            _insort(self.running, seq)
        if plan.head_needs_blocks:  # the reused prefixes pinned behind the head would keep blocks from it
            for seq in self.waiting[1:]:
                if seq.cache_id:
                    self._release(seq)
                    seq.drop_cache()
        self.wait_reason = plan.wait_reason
        self.head_needs_blocks = plan.head_needs_blocks
        self._in_flight = {item.seq for item in plan.items}
        return plan

    def update(self, plan: StepPlan, results: list[ItemResult], kv: KvUsage) -> StepOutcome:
        """Applies the executor's answer to the step: caches, sampled tokens, stops, items that failed alone.
        Tokens are returned for the sequences still live (aborted ones only get their caches released)."""
        self._in_flight = set()
        self.kv = kv
        out = StepOutcome()
        for item, res in zip(plan.items, results):
            seq = item.seq
            if res.error is not None:  # nothing of the item was written: its cache (if any) is as it was
                if not seq.finished:
                    out.failed.append(Failure(seq, res.error))
                self._end(seq)
                continue
            if item.is_final:  # (read before the token is appended) the executor now holds its sampling
                seq.registered_sampling = seq.sampling_for_next_token()
            seq.written(res.cache_id, res.seq_len, res.prompt_logprobs)
            if seq.finished:  # aborted while the step ran
                self._release(seq)
                continue
            if seq.request.pooling is not None:  # pooled: its final chunk's values end it (no token)
                if item.is_final:
                    self._pooled(out, seq, res.pooled)
                continue
            if self.speculator is not None and (item.drafts or item.model_drafts or res.burst_drafts[0]):
                self.speculator.settle(out, seq, item.drafts, res)
            for token in res.tokens:  # a stop inside an accepted run ends the sequence there
                finish = seq.append(token.token_id)
                if seq.constraint is not None and seq.constraint.error:  # the executor ignored the token mask
                    out.failed.append(Failure(seq, RemoteError("INTERNAL", f"executor: {seq.constraint.error}")))
                    self._end(seq)
                    break
                out.emitted.append(Emitted(seq, token, finish))
                if finish is not None:
                    self._leave(seq)
                    self._release(seq)
                    self._forget(seq)
                    break
        if out.failed:
            log.warning("%d of %d items of a step failed alone: %s", len(out.failed), len(plan.items),
                        out.failed[0].error)
        return out

    def _pooled(self, out: StepOutcome, seq: Sequence, values: tuple[float, ...] | None) -> None:
        """A pooled sequence's final chunk ran: it ends with its values (an executor that returned none ignored
        the pooling it was asked for: the request fails, naming that)."""
        if values is None:
            out.failed.append(Failure(seq, RemoteError("INTERNAL", "executor: a pooled item returned no values")))
            self._end(seq)
            return
        out.pooled.append(Pooled(seq, values))
        self._leave(seq)
        self._release(seq)
        self._forget(seq)
        seq.status = Status.FINISHED

    def step_failed(self, plan: StepPlan, error: TandemError, kv_full: bool) -> list[Failure]:
        """The executor answered the step with an error; nothing of the step was written. KV exhaustion
        (blocks taken by another client): a step that carried draft tokens is planned again without them
        first; otherwise the youngest running sequence is preempted and the step planned again. Anything else
        (a message over the size limit included) ends the step's requests with error."""
        self._in_flight = set()
        if kv_full:
            self.short_of_blocks = True
            if any(item.drafts or item.model_drafts for item in plan.items):  # maybe only the drafts did not fit
                self.planner.skip_drafts_once = True
                return []
            if self.running:
                self._preempt(self.running[-1])
            return []
        log.error("UnifiedDecode failed for %d requests: %s", len(plan.items), error)
        failed = [Failure(item.seq, error) for item in plan.items if not item.seq.finished]
        for item in plan.items:
            self._end(item.seq)
        return failed

    def step_refused(self, plan: StepPlan) -> None:
        """The executor refused the step as a whole (nothing of it ran) and it will go again in another form (a
        multi-step burst in fewer steps): every sequence stays as it was; those aborted while it ran release
        their caches now."""
        self._in_flight = set()
        for item in plan.items:
            if item.seq.finished:
                self._release(item.seq)

    def preempt_for_stall(self) -> bool:
        """No item fitted the step: preempts the youngest running sequence if there is one (our own
        sequences hold the blocks). False: the blocks are held by another client of the executor."""
        if not self.running:
            return False
        self._preempt(self.running[-1])
        self.short_of_blocks = True
        return True

    def drop_unfittable_head(self) -> Failure | None:
        """After a stall with nothing to preempt: the head of the queue if it cannot fit even an empty pool
        (removed, for the loop to fail), else None."""
        head = self.waiting[0] if self.waiting else None
        if head is None or Planner.fits_alone(head.num_tokens + 1, self.kv):
            return None
        self._end(head)
        return Failure(head, CapacityExceeded(
            f"the request ({head.num_tokens} tokens) does not fit the executor's KV cache "
            f"({self.kv.total_blocks} blocks of {self.kv.block_size} tokens)"))

    def expire_waiting(self) -> list[Failure]:
        """Requests that have waited max_queue_time_s for their first admission end RESOURCE_EXHAUSTED
        (Overloaded), saying why; nothing of them ran (scheduler/engine/admission.py)."""
        failed = [Failure(seq, error) for seq, error in expired(self.cfg, self.waiting, self.clock(), self.wait_reason,
                                                                  self.drain, len(self.running))]
        for f in failed:
            self._end(f.seq)
        return failed

    # ----------------------------------------------------------------- prefix caching
    def to_match(self) -> list[Sequence]:
        """Waiting sequences to look up in the executor's prefix cache (CreateCache) before the next
        schedule(): among the first ones that could be admitted (as many as free running slots; only the head
        while the head waits for KV blocks; none while the running ones are short of blocks), those without a
        cache, and those whose prompt a running request has since written further than their cache holds
        (the new cache replaces the old). Not those waiting for a running request to write their prefix."""
        if self.short_of_blocks:
            return []
        slots = 1 if self.head_needs_blocks else self.cfg.max_running - len(self.running)
        picked = []
        for s in self.waiting[:max(0, slots)]:
            if not s.reuses_prefix:  # (mean pooling: every position is computed)
                continue
            shared = shared_prefix(s, self.running, self.kv.block_size)
            if shared.awaited(s.num_cached):
                continue  # being written by a running request: looked up once it is
            # (again when more of it is cached now, by a running request: once per new written length)
            if not s.cache_id or shared.written > max(s.num_cached, s.prefix_looked_up):
                s.prefix_looked_up = shared.written
                picked.append(s)
        return picked[:MAX_MATCH_PER_STEP]

    def attach_prefixes(self, seqs: list[Sequence], results: list[tuple[str, int] | None]) -> None:
        """CreateCache's answer, per sequence: (cache id, tokens reused), or None where its item failed (the
        sequence then starts without a cache, as before). A sequence that ended meanwhile gets its new cache
        released."""
        for seq, res in zip(seqs, results):
            if res is None:
                continue
            cache_id, cached, *prompt_logprobs = res  # (prompt logprobs when the sequence asked)
            if seq.finished or seq not in self.waiting or (seq.cache_id and cached <= seq.num_cached):
                self.releases.add(cache_id)
                continue
            self._release(seq)  # (looked up again: the new cache reuses more than the one it held)
            seq.drop_cache()
            seq.adopt_prefix(cache_id, cached, *prompt_logprobs)

    # ----------------------------------------------------------------- the executor lost, back, gone
    def executor_lost(self) -> int:
        """No answer, or the executor restarted or forgot our session: every running sequence is requeued to
        be recomputed (caches forgotten, outputs kept); nothing ends. Returns how many were running. The
        forgotten caches are kept as stale: release them once an executor serves (unknown ids are no error)."""
        stale = [s for s in self._in_flight if s.finished and s.cache_id]  # aborted during the lost step
        self.releases.executor_lost(s.cache_id for s in stale + self.running if s.cache_id)
        self._in_flight = set()
        for seq in stale:
            seq.cache_id = ""
        for seq in self.waiting:  # reused prefixes taken for sequences not admitted yet: gone too
            if seq.cache_id:
                self.releases.keep_stale([seq.cache_id])
                seq.drop_cache()
        requeued = list(self.running)
        self.running.clear()
        self.short_of_blocks = False
        for seq in requeued:
            seq.reset_cache()
            self._enqueue(seq)
        return len(requeued)

    def take_waiting(self) -> list[Sequence]:
        """Empties the queue for another executor's policy; their reused prefixes here become stale."""
        taken, self.waiting = self.waiting, []
        for seq in taken:
            if seq.cache_id:
                self.releases.keep_stale([seq.cache_id])
            seq.drop_cache()
        return taken

    def fail_all(self, error: TandemError) -> list[Failure]:
        """Every live request ends with error (the executor did not come back in time, or came back unfit)."""
        failed = [Failure(s, error) for s in self.running + self.waiting]
        for f in failed:
            self._end(f.seq)
        return failed

    def drop_missing_adapters(self, loaded: set[str]) -> list[Failure]:
        """Waiting requests whose adapter the executor (back after a loss) no longer has end NOT_FOUND."""
        gone = [s for s in self.waiting if s.request.adapter and s.request.adapter not in loaded]
        for seq in gone:
            self._end(seq)
        return [Failure(s, AdapterNotFound(
            f"adapter {s.request.adapter!r} is no longer loaded on the executor (it restarted without it); "
            f"loaded: {sorted(loaded) or 'none'}")) for s in gone]

    def restart_queue_clocks(self) -> None:
        """The executor is back: time spent waiting for it does not count against max_queue_time_s."""
        now = self.clock()
        for seq in self.waiting:
            seq.queued_at = now

    def abort_all(self) -> list[Sequence]:
        """Shutdown: every live sequence ends (returned, for the loop to end their streams as ABORTED)."""
        ended = self.running + self.waiting
        for seq in ended:
            self.abort(seq)
        return ended

    # ----------------------------------------------------------------- caches
    def _release(self, seq: Sequence) -> None:
        if seq.cache_id:
            self.releases.add(seq.cache_id)
            seq.cache_id = ""

    def _leave(self, seq: Sequence) -> None:
        """seq leaves the running batch for good (done, failed, aborted): its place is free (the drain rate)."""
        self.running.remove(seq)
        self.drain.finished(self.clock() - seq.admitted_at)

    def _end(self, seq: Sequence) -> None:
        """Removes seq from the queues and releases its cache: it is over."""
        if seq in self.running:
            self._leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self._forget(seq)
        seq.status = Status.FINISHED

    def _forget(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.queued_at = self.clock()
        _insort(self.waiting, seq)

    def _preempt(self, seq: Sequence) -> None:
        """Releases seq's cache and requeues it; it is recomputed (prompt + outputs so far) when admitted."""
        self.running.remove(seq)
        self._release(seq)
        seq.reset_cache()
        self._enqueue(seq)
        self.preemptions += 1
        log.info("preempted a request (%d tokens) to free KV blocks; it will be recomputed", seq.num_tokens)


def _insort(seqs: list[Sequence], seq: Sequence) -> None:
    bisect.insort(seqs, seq, key=lambda s: s.arrival)

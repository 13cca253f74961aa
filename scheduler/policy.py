"""The scheduling policy as a synchronous object: no asyncio, no I/O.

It owns the waiting and running queues, admission, the step plan (scheduler/planner.py) and the preemption
choice, and applies a step's results. A thin async loop (scheduler/engine.py) moves data between it, the
executor client and the client streams, in the shape of vLLM V1's `schedule()` / `update_from_output()`:

    plan = policy.schedule()                   # which sequences, how many tokens (preemptions applied)
    results = <the executor runs plan.items>   # one UnifiedDecode
    emitted = policy.update(plan, results, kv) # tokens appended, finished sequences retired
    ids = policy.take_releases()               # caches the loop must release on the executor

On a failed step the loop calls step_failed() (the executor's answer was an error) or executor_lost()
(no answer at all); both leave the queues consistent and say which requests ended, with what error.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from scheduler.planner import Planner, StepPlan
from scheduler.request import Finish, TokenLogprob
from scheduler.sequence import Sequence, Status
from tandem.errors import CapacityExceeded, TandemError
from tandem.kv_usage import KvUsage

log = logging.getLogger("tandem.scheduler")


@dataclass(frozen=True)
class ItemResult:
    """The executor's answer for one item of a step (domain form of tandem.executor.v1.UnifiedResult)."""

    cache_id: str
    seq_len: int  # tokens the cache holds after the step
    token: TokenLogprob | None = None  # sampled after a final chunk


@dataclass(frozen=True)
class Emitted:
    """A token a step gave a live sequence, and the stop it caused (None: the sequence goes on)."""

    seq: Sequence
    token: TokenLogprob
    finish: Finish | None


class SchedulingPolicy:
    def __init__(self, cfg: SchedulerConfig, kv: KvUsage, executor_max_batch_tokens: int = 0) -> None:
        budget = min(cfg.max_batch_tokens, executor_max_batch_tokens or cfg.max_batch_tokens)
        self.planner = Planner(budget, cfg.max_running, cfg.prefill_chunk)
        self.max_waiting = cfg.max_waiting
        self.kv = kv
        self.running: list[Sequence] = []  # admitted, oldest arrival first
        self.waiting: list[Sequence] = []  # new or preempted, oldest arrival first
        self.preemptions = 0
        self._arrivals = itertools.count()
        self._to_release: list[str] = []
        self._in_flight: set[Sequence] = set()

    # ----------------------------------------------------------------- requests
    def next_arrival(self) -> int:
        return next(self._arrivals)

    def check_admissible(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raises CapacityExceeded when the queue is full or the request could never fit the KV pool."""
        if len(self.waiting) >= self.max_waiting:
            raise CapacityExceeded(f"the scheduler's queue is full ({self.max_waiting} requests waiting); "
                                   "retry later")
        tokens = prompt_tokens + max_new_tokens
        if not Planner.fits_alone(tokens, self.kv):
            raise CapacityExceeded(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) need "
                f"{self.kv.blocks_for(tokens)} KV blocks but the executor's whole cache has {self.kv.total_blocks} "
                f"(x {self.kv.block_size} tokens); shorten the request")

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence (check_admissible first)."""
        _insort(self.waiting, seq)

    def abort(self, seq: Sequence) -> None:
        """Drops a sequence (client cancel, deadline, shutdown); its cache is released now, or when the step
        that holds it returns."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq not in self._in_flight and seq.cache_id:
            self._to_release.append(seq.cache_id)
            seq.cache_id = ""
        seq.status = Status.FINISHED

    def finish(self, seq: Sequence) -> None:
        """Ends a sequence the request side stopped (a stop string in the text)."""
        self.abort(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def has_releases(self) -> bool:
        return bool(self._to_release)

    # ----------------------------------------------------------------- a step
    def schedule(self) -> StepPlan:
        """Plans the next step and applies its preemptions and admissions. Release the caches from
        take_releases() before sending plan.items: the plan counts on the preempted sequences' blocks."""
        plan = self.planner.plan(self.running, self.waiting, self.kv)
        for victim in plan.preempted:
            self._preempt(victim)
        for seq in plan.admitted:
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            _insort(self.running, seq)
        self._in_flight = {item.seq for item in plan.items}
        return plan

    def update(self, plan: StepPlan, results: list[ItemResult], kv: KvUsage) -> list[Emitted]:
        """Applies the executor's answer to the step: caches, sampled tokens, stops. Returns the tokens of the
        sequences still live (aborted ones only get their caches released)."""
        self._in_flight = set()
        self.kv = kv
        emitted = []
        for item, res in zip(plan.items, results):
            seq = item.seq
            seq.cache_id, seq.num_cached = res.cache_id, res.seq_len
            if seq.finished:  # aborted while the step ran
                self._release(seq)
                continue
            if res.token is None:
                continue
            finish = seq.append(res.token.token_id)
            emitted.append(Emitted(seq, res.token, finish))
            if finish is not None:
                self.running.remove(seq)
                self._release(seq)
        return emitted

    def step_failed(self, plan: StepPlan, error: TandemError, status_name: str) -> list[Sequence]:
        """The executor answered the step with an error; nothing of the step was written. RESOURCE_EXHAUSTED
        (blocks taken by another client): the youngest running sequence is preempted and the step planned
        again. Anything else ends the step's sequences; they are returned for the loop to fail with error."""
        self._in_flight = set()
        if status_name == "RESOURCE_EXHAUSTED":
            if self.running:
                self._preempt(self.running[-1])
            return []
        log.error("UnifiedDecode failed for %d requests: %s", len(plan.items), error)
        failed = []
        for item in plan.items:
            seq = item.seq
            if seq in self.running:
                self.running.remove(seq)
            self._release(seq)
            if not seq.finished:
                seq.status = Status.FINISHED
                failed.append(seq)
        return failed

    def preempt_for_stall(self) -> bool:
        """No item fitted the step: preempts the youngest running sequence if there is one (our own
        sequences hold the blocks). False: the blocks are held by another client of the executor."""
        if not self.running:
            return False
        self._preempt(self.running[-1])
        return True

    def drop_unfittable_head(self) -> Sequence | None:
        """After a stall with nothing to preempt: the head of the queue if it cannot fit even an empty pool
        (removed, for the loop to fail), else None."""
        head = self.waiting[0] if self.waiting else None
        if head is not None and not Planner.fits_alone(head.num_tokens + 1, self.kv):
            self.waiting.remove(head)
            head.status = Status.FINISHED
            return head
        return None

    def executor_lost(self) -> list[Sequence]:
        """The executor stopped answering: every sequence ends (returned, for the loop to fail); caches it
        may still hold are released once it is back (unknown ids are no error there)."""
        self._in_flight = set()
        lost = self.running + self.waiting
        for seq in lost:
            self._release(seq)
            seq.status = Status.FINISHED
        self.running.clear()
        self.waiting.clear()
        return lost

    def abort_all(self) -> list[Sequence]:
        """Shutdown: every live sequence ends (returned, for the loop to end their streams as ABORTED)."""
        ended = self.running + self.waiting
        for seq in ended:
            self.abort(seq)
        return ended

    # ----------------------------------------------------------------- caches
    def take_releases(self) -> list[str]:
        ids, self._to_release = self._to_release, []
        return ids

    def release_failed(self, cache_ids: list[str]) -> None:
        """The release did not reach the executor: keep the ids for the next try."""
        self._to_release.extend(cache_ids)

    def _release(self, seq: Sequence) -> None:
        if seq.cache_id:
            self._to_release.append(seq.cache_id)
            seq.cache_id = ""

    def _preempt(self, seq: Sequence) -> None:
        """Releases seq's cache and requeues it; it is recomputed (prompt + outputs so far) when admitted."""
        self.running.remove(seq)
        self._release(seq)
        seq.reset_cache()
        _insort(self.waiting, seq)
        self.preemptions += 1
        log.info("preempted a request (%d tokens) to free KV blocks; it will be recomputed", seq.num_tokens)


def _insort(seqs: list[Sequence], seq: Sequence) -> None:
    bisect.insort(seqs, seq, key=lambda s: s.arrival)

"""Overload refusals at the door of one engine's queue, before any work on the request: a full queue
(--max-waiting), or a wait for the first step estimated from the measured drain rate
(scheduler/engine/drain_rate.py) past --max-queue-time-s. A refused request is told when to come back
(Retry-After, from the same rate): a flood is answered in milliseconds instead of timing out in the queue."""
from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.engine.drain_rate import DrainRate
from scheduler.engine.planner import Planner
from scheduler.sequence import Sequence
from tandem.errors import CapacityExceeded, Overloaded
from tandem.kv_usage import KvUsage


def overload(cfg: SchedulerConfig, drain: DrainRate, queued: int, running: int) -> Overloaded | None:
    """The refusal of a new request with `queued` requests waiting and `running` in the batch, or None."""
    if queued >= cfg.max_waiting:
        return Overloaded(f"the scheduler's queue is full ({cfg.max_waiting} requests waiting, --max-waiting); "
                          "retry later", drain.retry_after_s(queued, running), "queue_full")
    wait = drain.wait_s(queued, cfg.max_running - running, running)
    limit = cfg.max_queue_time_s
    if wait is not None and wait > limit:
        return Overloaded(f"the scheduler is overloaded: a new request would wait about {wait:.0f} s for its first "
                          f"step ({queued} queued, {running} running), past the {limit:g} s bound "
                          "(--max-queue-time-s); retry later", drain.retry_after_s(queued, running),
                          "queue_wait_estimate")
    return None


def expired(cfg: SchedulerConfig, waiting: list[Sequence], now: float, wait_reason: str, drain: DrainRate,
            running: int) -> list[tuple[Sequence, Overloaded]]:
    """The queued requests past --max-queue-time-s without their first step, each with its refusal naming
    why (wait_reason: the planner's, for the head). One admitted before (preempted, or requeued after the
    executor's loss) is never among them: it may have streamed tokens, and it is ahead of every new request."""
    limit = cfg.max_queue_time_s
    late = [(i, s) for i, s in enumerate(waiting) if not s.started and not s.output_ids and now - s.queued_at >= limit]
    if not late:
        return []
    retry_after = drain.retry_after_s(len(waiting), running)
    out = []
    for ahead, seq in late:
        why = wait_reason or "the executor had no room for it"
        if ahead:
            why = f"{ahead} requests ahead of it in the queue; the first of them waits because {why}"
        out.append((seq, Overloaded(f"not admitted within {limit:g} s (--max-queue-time-s): {why}", retry_after,
                                    "queue_time")))
    return out


def next_expiry(cfg: SchedulerConfig, waiting: list[Sequence]) -> float | None:
    """When the first of the queued requests that expired() may end reaches --max-queue-time-s (the policy's
    clock), or None when none waits for a first admission."""
    starts = [s.queued_at for s in waiting if not s.started and not s.output_ids]
    return min(starts) + cfg.max_queue_time_s if starts else None


def too_big(kv: KvUsage, prompt_tokens: int, max_new_tokens: int) -> CapacityExceeded | None:
    """The refusal of a request that could never fit the executor's whole KV pool, or None."""
    tokens = prompt_tokens + max_new_tokens
    if Planner.fits_alone(tokens, kv):
        return None
    return CapacityExceeded(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) need "
                            f"{kv.blocks_for(tokens)} KV blocks but the executor's whole cache has {kv.total_blocks} "
                            f"(x {kv.block_size} tokens); shorten the request")


def span_too_long(span: int, step_tokens: int) -> CapacityExceeded | None:
    """The refusal of a request with an image span of `span` tokens that must be written in one chunk (Gemma 3)
    when a step takes at most `step_tokens`, or None."""
    if span <= step_tokens:
        return None
    return CapacityExceeded(f"an image of this request takes {span} tokens that this model writes in one prefill "
                            f"chunk, but a step holds at most {step_tokens} tokens (--max-batch-tokens, and the "
                            "executor's limit): raise it")

"""The overload rules on a hand-driven clock (scheduler/engine/drain_rate.py, scheduler/engine/admission.py): the
drain rate measured from finishes, the wait it gives a new request, the refusals at the door and their
Retry-After. The same rules with real processes: tests/e2e/test_overload.py."""
from __future__ import annotations

import math

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine.admission import overload
from scheduler.engine.drain_rate import MAX_RETRY_AFTER_S, WINDOW_S, DrainRate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_nothing_measured_refuses_nothing_on_estimate_and_says_retry_in_a_second():
    drain = DrainRate(Clock())
    assert drain.per_second(running=4) is None and drain.wait_s(100, 0, 4) is None
    assert drain.retry_after_s(queued=100, running=4) == 1
    cfg = SchedulerConfig("x", max_running=4, max_waiting=1000, max_queue_time_s=1)
    assert overload(cfg, drain, queued=500, running=4) is None  # (the queue-time bound still applies in the queue)


def test_the_rate_is_finishes_in_the_window_or_the_batch_over_its_time_in_it():
    clock = Clock()
    drain = DrainRate(clock)
    for _ in range(20):  # 2 finishes a second for 10 s, each after 2 s in the batch
        clock.now += 0.5
        drain.finished(2.0)
    assert drain.per_second(running=0) == pytest.approx(20 / WINDOW_S)
    assert drain.per_second(running=8) == pytest.approx(8 / 2.0)  # Little's law: 8 running, 2 s each
    clock.now += 2 * WINDOW_S  # the window empties; the service time stays
    assert drain.per_second(running=0) is None and drain.per_second(running=4) == pytest.approx(2.0)


def test_a_new_request_that_fits_waits_nothing_else_its_queue_over_the_rate():
    clock = Clock()
    drain = DrainRate(clock)
    drain.finished(1.0)  # 1 s in the batch
    assert drain.wait_s(ahead=3, free_slots=4, running=4) == 0.0
    assert drain.wait_s(ahead=10, free_slots=0, running=4) == pytest.approx(11 / 4)
    assert drain.retry_after_s(queued=10, running=4) == math.ceil(10 / 4)
    drain.service_s = 1e6  # a rate near zero (and the window empty): Retry-After stays within its bound
    clock.now += 2 * WINDOW_S
    assert drain.retry_after_s(queued=10, running=1) == MAX_RETRY_AFTER_S


def test_overload_refuses_a_full_queue_and_a_wait_past_the_bound_naming_why():
    clock = Clock()
    drain = DrainRate(clock)
    drain.finished(2.0)  # with 2 running: 1 request a second
    cfg = SchedulerConfig("x", max_running=2, max_waiting=8, max_queue_time_s=3)
    assert overload(cfg, drain, queued=2, running=2) is None  # ~3 s: within the bound
    late = overload(cfg, drain, queued=3, running=2)  # ~4 s
    assert late.reason == "queue_wait_estimate" and late.retry_after_s == 3 and "--max-queue-time-s" in str(late)
    full = overload(cfg, drain, queued=8, running=2)
    assert full.reason == "queue_full" and full.retry_after_s == 8 and "--max-waiting" in str(full)

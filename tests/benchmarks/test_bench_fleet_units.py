"""The fleet benchmark's pure pieces, on made-up records: what a stream saw around the kill (the resume after a
straggler token, the tokens recomputed, pause detection), the victim choice, the --configs parser."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.fleet import parse_configs
from benchmarks.fleet_client import busiest
from benchmarks.fleet_failover import group_summary, stream_view
from benchmarks.request_metrics import Record


def record(times: list[float], preemptions: int, prompt_len: int = 10, start: float = 0.0) -> Record:
    rec = Record(0, prompt_len, start=start, end=times[-1])
    rec.messages = [(t, 1) for t in times]
    rec.output_ids = list(range(len(times)))
    rec.finish_reason = "FINISH_REASON_LENGTH"
    rec.usage = {"prompt_tokens": prompt_len, "completion_tokens": len(times), "cached_tokens": 0,
                 "preemptions": preemptions}
    return rec


def test_a_moved_stream_resumes_after_its_largest_gap_past_the_kill_not_at_a_straggler():
    # tokens every 0.1 s; kill at 0.55; a straggler sampled before the kill arrives at 0.56; the move costs 2 s
    times = [0.1, 0.2, 0.3, 0.4, 0.5, 0.56, 2.56, 2.66]
    v = stream_view(record(times, preemptions=1), t_kill=0.55, output_len=len(times))
    assert v["moved"] and v["completed"] and v["tokens_before_kill"] == 5
    assert v["next_token_after_kill_ms"] == pytest.approx(10)
    assert v["resume_after_kill_ms"] == pytest.approx(2010) and v["pause_ms"] == pytest.approx(2000)
    assert v["tokens_before_resume"] == 6  # the straggler too: the scheduler held it when it requeued
    assert v["recomputed_tokens"] == 10 + 6
    assert v["max_gap_ms"] == pytest.approx(2000) and v["median_gap_before_kill_ms"] == pytest.approx(100)
    assert v["paused"]


def test_a_stream_that_stayed_recomputes_nothing_and_pauses_only_on_a_long_gap():
    steady = stream_view(record([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0), t_kill=0.35, output_len=6)
    assert steady["moved"] is False and steady["recomputed_tokens"] == 0 and not steady["paused"]
    assert steady["resume_after_kill_ms"] is None and steady["tokens_before_resume"] is None
    slowed = stream_view(record([0.1, 0.2, 0.3, 0.4, 1.4, 1.5], 0), t_kill=0.35, output_len=6)
    assert slowed["paused"] and slowed["pause_ms"] == pytest.approx(1000) and slowed["recomputed_tokens"] == 0
    g = group_summary([steady, slowed])
    assert (g["streams"], g["paused"], g["completed"], g["recomputed_tokens"]) == (2, 1, 2, 0)


def test_a_failed_stream_is_neither_moved_nor_completed():
    rec = record([0.1, 0.2], 0)
    rec.usage, rec.error = None, "UNAVAILABLE: gone"
    v = stream_view(rec, t_kill=0.15, output_len=8)
    assert v["moved"] is None and not v["completed"] and v["recomputed_tokens"] == 0


class _Status:
    def __init__(self, address: str, running: int) -> None:
        self.address, self.running = address, running


def test_the_victim_is_the_executor_running_the_most_the_first_on_a_tie():
    addresses = ["a:1", "b:2", "c:3"]
    assert busiest([_Status("a:1", 3), _Status("b:2", 5), _Status("c:3", 5)], addresses) == 1
    assert busiest([_Status("c:3", 2), _Status("a:1", 2)], addresses) == 0


def test_configs_parse_and_refuse_nonsense():
    ap = argparse.ArgumentParser()
    assert parse_configs("1x2, 2X1", ap) == [(1, 2), (2, 1)]
    for bad in ("2", "0x1", "ax1", ""):
        with pytest.raises(SystemExit):
            parse_configs(bad, ap)

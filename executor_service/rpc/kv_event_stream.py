"""The messages of one SubscribeKvEvents stream: the snapshot, then the events as they come, with a summary
in the first message after the snapshot and every interval."""
from __future__ import annotations

import time
from typing import Callable, Iterator

from executor_service.rpc import codec
from executor_service.executor import Executor
from executor_service.kv.events.hub import Subscription
from tandem.executor.v1 import executor_pb2 as pb

DEFAULT_SUMMARY_MS = 5000
MIN_SUMMARY_MS = 100
SNAPSHOT_CHUNK = 1000  # events per snapshot message (a large index is sent in several)
_POLL_S = 0.5  # how often a quiet stream checks that its client is still there


def kv_event_stream(sub: Subscription, ex: Executor, interval_s: float,
                    alive: Callable[[], bool]) -> Iterator[pb.SubscribeKvEventsResponse]:
    seq = 0

    def message(events, summary: bool, snapshot: bool = False) -> pb.SubscribeKvEventsResponse:
        nonlocal seq
        seq += 1
        m = pb.SubscribeKvEventsResponse(seq=seq, events=[codec.kv_event_to_pb(e) for e in events],
                                         snapshot=snapshot, instance_id=ex.instance_id)
        if summary:
            m.summary.kv.CopyFrom(codec.kv_usage_to_pb(ex.kv_usage()))
            m.summary.prefix_cache.CopyFrom(codec.prefix_stats_to_pb(ex.prefix_stats()))
        return m

    for start in range(0, len(sub.snapshot), SNAPSHOT_CHUNK):
        yield message(sub.snapshot[start:start + SNAPSHOT_CHUNK], False, snapshot=True)
    sub.snapshot = []
    yield message([], True)
    next_summary = time.monotonic() + interval_s
    while alive():
        events = sub.wait(max(0.0, min(_POLL_S, next_summary - time.monotonic())))  # SubscriberTooSlow
        due = time.monotonic() >= next_summary
        if due:
            next_summary = time.monotonic() + interval_s
        if events or due:
            yield message(events, due)

"""KV events: the prefix cache's index changes, fanned out to SubscribeKvEvents streams and to sinks (the
ZMQ publisher in vLLM's format, executor_service/kv/events/zmq_publisher.py).

Publishing happens on the model's path (under the model lock), so it only appends to each subscriber's
bounded queue and never waits: a subscriber whose queue is full is dropped (its stream ends
RESOURCE_EXHAUSTED and it may subscribe again for a fresh snapshot) — a slow reader never slows the model.
A sink is called on the same path and must not wait either (the ZMQ publisher only enqueues).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tandem.errors import CapacityExceeded

DEFAULT_MAX_PENDING = 10_000  # events a subscriber may have unread
DEFAULT_MAX_SUBSCRIBERS = 8
# Where a block is (vLLM v0.28.0's `medium` names: MEDIUM_GPU in vllm/distributed/kv_events.py for the engine's
# own pool, and "CPU" for its offloading connector's host memory, vllm/v1/kv_offload/mediums.py). "GPU" is the
# KV pool whatever its device, as in vLLM. vLLM has no disk medium of its own; "DISK" names the disk tier.
MEDIUM_POOL = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive full blocks of one sequence became reusable."""

    hashes: tuple[bytes, ...]
    parent: bytes  # b"" when hashes[0] is a sequence's first block
    adapter: str
    token_count: int
    token_ids: tuple[int, ...] = ()  # the blocks' tokens in order (token_count of them)
    medium: str = MEDIUM_POOL  # where they are stored now


@dataclass(frozen=True)
class BlocksRemoved:
    """Blocks left the index (evicted), or a tier."""

    hashes: tuple[bytes, ...]
    medium: str = MEDIUM_POOL  # the storage they left


KvEvent = BlocksStored | BlocksRemoved
KvEventSink = Callable[[KvEvent], None]  # called on the model's path: must return at once


class SubscriberTooSlow(CapacityExceeded):
    """A subscriber fell more events behind than its queue holds."""


class Subscription:
    def __init__(self, hub: "KvEventHub", snapshot: list[KvEvent], max_pending: int) -> None:
        self._hub = hub
        self.snapshot = snapshot  # what was indexed when it began (events to send first)
        self._max_pending = max_pending
        self._queue: deque[KvEvent] = deque()
        self._ready = threading.Condition()
        self.dropped = False

    def _push(self, event: KvEvent) -> None:
        with self._ready:
            if self.dropped:
                return
            if len(self._queue) >= self._max_pending:
                self.dropped = True  # never block the model: this subscriber starts over instead
                self._queue.clear()
            else:
                self._queue.append(event)
            self._ready.notify()

    def wait(self, timeout_s: float) -> list[KvEvent]:
        """The events published since the last call (waiting up to timeout_s for one); SubscriberTooSlow
        once the subscriber was dropped."""
        with self._ready:
            if not self._queue and not self.dropped:
                self._ready.wait(timeout_s)
            if self.dropped:
                raise SubscriberTooSlow(
                    f"this KV event subscriber fell more than {self._max_pending} events behind and was dropped; "
                    "read faster, or subscribe again (a new subscription starts with a snapshot)")
            events = list(self._queue)
            self._queue.clear()
            return events

    def close(self) -> None:
        self._hub._remove(self)


class KvEventHub:
    def __init__(self, max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.max_subscribers = max_subscribers
        self.max_pending = max_pending
        self._guard = threading.Lock()
        self._subs: list[Subscription] = []
        self._sinks: list[KvEventSink] = []

    @property
    def active(self) -> bool:
        # read without the lock: a stale answer only skips or builds one event
        return bool(self._subs) or bool(self._sinks)

    def add_sink(self, sink: KvEventSink) -> None:
        """Every event from now on also goes to sink (which must never block)."""
        with self._guard:
            self._sinks.append(sink)

    def publish(self, event: KvEvent) -> None:
        with self._guard:
            subs = list(self._subs)
            sinks = list(self._sinks)
        for sub in subs:
            sub._push(event)
        for sink in sinks:
            sink(event)

    def subscribe(self, snapshot: list[KvEvent]) -> Subscription:
        """A new subscription starting after snapshot. The caller holds the model lock, so that no event
        falls between the snapshot and the subscription."""
        with self._guard:
            if len(self._subs) >= self.max_subscribers:
                raise CapacityExceeded(f"the executor already streams KV events to {self.max_subscribers} "
                                       "subscribers (--max-kv-subscribers); close one or retry later")
            sub = Subscription(self, snapshot, self.max_pending)
            self._subs.append(sub)
            return sub

    def _remove(self, sub: Subscription) -> None:
        with self._guard:
            if sub in self._subs:
                self._subs.remove(sub)

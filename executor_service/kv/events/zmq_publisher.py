"""KV events on ZMQ in vLLM's format (--kv-events-endpoint): a PUB socket sending three frames per batch
(topic, sequence number as u64 big-endian, msgpack EventBatch: executor_service/kv/events/vllm_wire.py), and an
optional ROUTER socket (--kv-events-replay-endpoint) that answers "batches from sequence N" from a ring of
the last batches, as vLLM v0.28.0's ZmqEventPublisher does.

The model's path only appends to a bounded queue (enqueue, a KvEventHub sink) and never waits; one thread
encodes, sends and serves replays. A slow or absent subscriber never slows a step: ZMQ's PUB socket drops
what a subscriber's pipe cannot hold (its high-water mark; the subscriber sees the gap in sequence numbers
and asks the replay socket). vLLM's own queue blocks the engine when full; this one drops the newest event
instead, counts it, and puts an AllBlocksCleared event where the loss happened, so that a consumer never
keeps a block the executor may have removed. The first batch (sequence 0) is AllBlocksCleared too: nothing
an earlier process at the same endpoint announced is still held — except what it announces right after: the
blocks its disk tier reopened (medium "DISK"), and any already in the pool.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import zmq

from executor_service.kv.events import vllm_wire as wire
from executor_service.kv.events.hub import KvEvent, KvEventHub
from executor_service.kv.events.endpoint import ZmqKvConfig

log = logging.getLogger("tandem.executor")

DEFAULT_REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's buffer_steps)
DEFAULT_MAX_QUEUED = 100_000  # events waiting for the publisher thread (vLLM's max_queue_size)
DEFAULT_HWM = 100_000  # batches ZMQ holds per subscriber before dropping for it (vLLM's hwm)
MAX_BATCH_EVENTS = 1024  # a burst larger than this leaves as several batches
_IDLE_WAIT_S = 0.02  # how often an idle thread looks for replay requests


class _Cleared:
    """A marker in the queue: AllBlocksCleared goes here."""


CLEARED = _Cleared()


@dataclass(frozen=True)
class ZmqKvStats:
    published_batches: int
    published_events: int  # AllBlocksCleared markers included
    dropped_events: int  # never sent: the queue was full
    replay_requests: int
    queued: int


class ZmqKvPublisher:
    def __init__(self, pub_address: str, bind: bool, replay_address: str | None, topic: str,
                 replay_batches: int = DEFAULT_REPLAY_BATCHES, max_queued: int = DEFAULT_MAX_QUEUED,
                 hwm: int = DEFAULT_HWM, start: bool = True) -> None:
        """Binds (or connects) at once: an address in use raises OSError here, before the executor listens.
        start=False leaves the thread for start() (tests fill the queue first)."""
        if replay_batches < 1 or max_queued < 2:
            raise ValueError(f"--kv-events-replay-buffer must be >= 1 (got {replay_batches}) and the queue >= 2")
        self.topic = topic.encode()
        self._max_queued = max_queued
        self._queue: deque[KvEvent | _Cleared] = deque([CLEARED])
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._wake = threading.Event()
        self._stopping = False
        self._overflowed = False
        self._seq = 0
        self._sliding_window: int | None = None  # the model's, when every layer slides
        self._events = 0
        self._dropped = 0
        self._replays = 0
        self._ctx = zmq.Context()  # its own: term() at close ends ZMQ's I/O thread too
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.bind(pub_address) if bind else self._pub.connect(pub_address)
            if replay_address is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_address)
        except zmq.ZMQError as exc:
            self._close_sockets()
            what = replay_address if self._replay is not None else pub_address
            raise OSError(f"KV events: cannot {'bind' if bind or self._replay is not None else 'connect'} {what}: "
                          f"{exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self._thread.start()

    def attach(self, hub: KvEventHub, sliding_window: int | None, snapshot: Sequence[KvEvent] = ()) -> None:
        """Publishes snapshot (what is held already: a restarted executor's disk tier), then hub's events from
        now on; sliding_window: the model's ModelConfig.kv_window. The caller holds the model lock, so that no
        event falls between the snapshot and the first one from hub."""
        self._sliding_window = sliding_window
        for event in snapshot:
            self.enqueue(event)
        hub.add_sink(self.enqueue)

    # ------------------------------------------------------------------ the model's path
    def enqueue(self, event: KvEvent) -> None:
        """A KvEventHub sink: appends, never waits. Only the model's path calls it (one writer)."""
        room = self._max_queued - len(self._queue)
        if self._overflowed:
            if room < 2:
                self._dropped += 1
                return
            self._queue.append(CLEARED)  # where the loss happened: consumers forget what came before
            self._overflowed = False
        elif room < 1:
            self._dropped += 1
            self._overflowed = True
            return
        self._queue.append(event)
        self._wake.set()

    def stats(self) -> ZmqKvStats:
        return ZmqKvStats(self._seq, self._events, self._dropped, self._replays, len(self._queue))

    # ------------------------------------------------------------------ the publisher thread
    def _run(self) -> None:
        while True:
            self._wake.wait(_IDLE_WAIT_S)
            self._wake.clear()
            if self._replay is not None:
                self._serve_replays()
            while self._queue:
                self._send(self._take())
            if self._stopping:
                return

    def _take(self) -> list[KvEvent | _Cleared]:
        out = []
        while self._queue and len(out) < MAX_BATCH_EVENTS:
            out.append(self._queue.popleft())
        return out

    def _send(self, events: list[KvEvent | _Cleared]) -> None:
        window = self._sliding_window
        payload = wire.encode_batch([wire.ALL_BLOCKS_CLEARED if e is CLEARED else wire.event_to_wire(e, window)
                                     for e in events], time.time())
        seq = self._seq.to_bytes(8, "big")
        try:  # a PUB socket never blocks: at a subscriber's high-water mark ZMQ drops for that subscriber
            self._pub.send_multipart((self.topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # kept in the ring: a subscriber that sees the gap replays it
            log.warning("KV events: batch %d not sent (%s)", self._seq, exc)
        self._ring.append((self._seq, payload))
        self._seq += 1
        self._events += len(events)

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: ignored a replay request of %d frames (want: identity, empty, 8-byte "
                            "start sequence)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self._replays += 1
            for seq, payload in list(self._ring):
                if seq >= first:  # ROUTER drops for a peer that is gone or full: never waits either
                    self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Sends what is queued, stops the thread, closes the sockets (linger 0) and the context."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # never seen: it only sends without blocking
                log.warning("KV events: the publisher thread did not stop; sockets left open")
                return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def open_publisher(cfg: ZmqKvConfig, bind_host: str) -> ZmqKvPublisher:
    """The publisher of cfg (already check()ed), bound or connected; logs where."""
    pub, replay = cfg.endpoints()
    topic = cfg.topic
    publisher = ZmqKvPublisher(pub.address(bind_host), pub.binds,
                               None if replay is None else replay.address(bind_host), topic, cfg.replay_buffer)
    log.info("KV events in vLLM %s's format on %s %s, topic %r%s", wire.VLLM_RELEASE,
             "bound at" if pub.binds else "connected to", pub.address(bind_host), topic,
             "" if replay is None else f", replay at {replay.address(bind_host)}")
    return publisher

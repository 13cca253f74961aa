"""A SubscribeKvEvents stream read on a background thread, for tests: messages (or the stream's error) arrive
in a queue and are taken with deadlines, never with sleeps."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import grpc

from tandem.executor.v1 import executor_pb2 as pb


class KvEventReader:
    def __init__(self, stub, summary_interval_ms: int = 100, timeout_s: float = 120.0, metadata=None) -> None:
        """timeout_s: the stream's gRPC deadline (a test that hangs fails instead); metadata: the call's (a
        token)."""
        self.call = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(summary_interval_ms=summary_interval_ms),
                                           timeout=timeout_s, metadata=metadata)
        self._queue: queue.Queue[pb.SubscribeKvEventsResponse | grpc.RpcError] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True, name="kv-event-reader")
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self._queue.put(message)
        except grpc.RpcError as exc:
            self._queue.put(exc)

    def next(self, timeout_s: float = 10.0) -> pb.SubscribeKvEventsResponse:
        """The next message; raises the stream's RpcError when it ended with one."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no KV event message within {timeout_s}s") from None
        if isinstance(item, grpc.RpcError):
            self._queue.put(item)  # it stays the stream's end
            raise item
        return item

    def until(self, done: Callable[[pb.SubscribeKvEventsResponse], bool], timeout_s: float = 10.0,
              what: str = "a message") -> list[pb.SubscribeKvEventsResponse]:
        """Reads messages up to and including the first for which done() is true; returns them all."""
        end = time.monotonic() + timeout_s
        read = []
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {what}")
            read.append(self.next(left))
            if done(read[-1]):
                return read

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=10)


def stored(messages: list[pb.SubscribeKvEventsResponse]) -> list[pb.BlocksStored]:
    return [e.stored for m in messages for e in m.events if e.WhichOneof("event") == "stored"]


def removed_hashes(messages: list[pb.SubscribeKvEventsResponse]) -> list[bytes]:
    return [h for m in messages for e in m.events if e.WhichOneof("event") == "removed"
            for h in e.removed.block_hashes]

"""The choices of one HTTP request (n, or several prompts) running on the fleet: submitted together (or none:
a refusal of the k-th aborts the ones before it), their deltas merged into one stream in arrival order, and
all of them aborted — KV freed at once — when the client disconnects, when one fails, or when the reader
stops. The disconnect is watched on the ASGI receive channel (which answers http.disconnect when the client
goes), not polled, and for streamed and whole responses alike.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from scheduler.fleet.fleet import Fleet
from scheduler.request import Delta, GenerateRequest
from scheduler.output.request_stream import RequestStream
from scheduler.token_limits import Lease
from tandem.errors import TandemError

_GONE = object()  # the client disconnected


class ClientGone(Exception):
    """The client disconnected; every choice was aborted."""


class Generation:
    def __init__(self, fleet: Fleet, requests: list[GenerateRequest],
                 receive: Callable[[], Awaitable[dict]], lease: Lease | None = None) -> None:
        """Submits every request (fleet.submit raises what a gRPC client would get: a full queue, a request
        that cannot fit) and starts watching `receive` for the client's disconnect. lease: the caller's token
        share, released by close()."""
        self._fleet = fleet
        self._lease = lease
        self._runs = []
        self._tasks: list[asyncio.Task] = []
        self._watch: asyncio.Task | None = None
        self.disconnected = False
        try:
            for r in requests:
                self._runs.append(fleet.submit(r))
        except BaseException:
            self.close()
            raise
        # Bounded: a response writer that stops (its client stopped reading) stops the pumps, so the messages
        # wait in the streams' own queues, where the engine sees how long (--stream-stall-timeout-s).
        self._events: asyncio.Queue = asyncio.Queue(maxsize=len(self._runs) or 1)
        self._open = len(self._runs)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(i, stream)) for i, (_, stream) in enumerate(self._runs)]
        self._watch = loop.create_task(self._watch_disconnect(receive))

    async def _pump(self, index: int, stream: RequestStream) -> None:
        while True:
            event = await stream.events.get()
            await self._events.put((index, event))
            if isinstance(event, TandemError) or event.finish_reason is not None:
                return

    async def _watch_disconnect(self, receive: Callable[[], Awaitable[dict]]) -> None:
        # After the body was read, receive() returns only when the client goes (or the response is complete,
        # which uvicorn also reports as http.disconnect: close() is then a no-op for finished choices).
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self.close()
        try:
            self._events.put_nowait(_GONE)
        except asyncio.QueueFull:  # the reader finds `disconnected` set at its next message
            pass

    async def started(self) -> None:
        """Waits until every choice was admitted into a batch or ended; raises the first that was refused before
        its first step (every choice aborted), or ClientGone. A stream's status line goes after this: a request
        refused in the queue (--max-queue-time-s) is a 429 with Retry-After, never an error event after a 200."""
        for _, stream in self._runs:
            await stream.started.wait()  # (a disconnect cancels every choice: each is set then)
            if self.disconnected:
                raise ClientGone()
            if stream.refusal is not None:
                self.close()
                raise stream.refusal

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) until every choice has finished. Raises the first choice's error (the others
        are aborted), or ClientGone."""
        try:
            while self._open:
                item = await self._events.get()
                if item is _GONE or self.disconnected:
                    raise ClientGone()
                index, event = item
                if isinstance(event, TandemError):
                    raise event
                if event.finish_reason is not None:
                    self._open -= 1
                yield index, event
        finally:
            self.close()

    def close(self) -> None:
        """Aborts every choice (a no-op for finished ones), releases the token share and stops watching. Safe
        to call again."""
        for seq, _ in self._runs:
            self._fleet.abort(seq)
        if self._lease is not None:
            self._lease.release()
        current = asyncio.current_task()
        for t in (*self._tasks, self._watch):
            if t is not None and t is not current:
                t.cancel()
